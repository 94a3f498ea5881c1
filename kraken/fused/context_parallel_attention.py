"""Context-parallel attention: a flash-attention forward that takes the peers' K/V as they land.

Long-context models shard the sequence: every rank holds ``q``, ``k``, ``v`` [batch, heads,
S_local, head_dim] for its part of the sequence, and its queries must attend to every rank's keys.
The usual answers move K/V with NCCL (one all-gather, or a ring of send/recv with one flash call
per step and a log-sum-exp merge). Here one kernel launch does the whole attention, starting on
its own K/V at once:

* K/V travel on the copy engine (the machinery of ``kraken.comm.all_gather_with_progress``: a side
  stream, one-block barrier kernels, flags written by stream memory operations). On the current stream
  this rank's ``k`` and ``v`` are staged into its chunk of a symmetric gather buffer
  [world_size, 2 (k, v), batch * kv_heads, S_local, head_dim] (``stage_own``); on the side stream the ranks
  meet at a barrier; then every peer's K/V is copied in ``pieces`` (a range of (batch, kv head) rows of K,
  then of V), piece-major and, within a piece, ``rank + 1`` first, each piece flagged as it lands; a last
  barrier says "done reading". No SM moves data, so attention blocks spinning on a flag cannot starve the copies.
* The attention kernel is persistent (``blocks_per_sm`` blocks per SM but ``RESERVED_SMS`` SMs' worth, left
  to the barrier kernel; without causal at one rank, where no block waits, ``FULL_ONE_RANK_WAVES`` times that)
  and takes the query tiles in the order of a host-built table (``tile_order``): piece by piece, so the first
  tiles need only the first pieces, and within a piece the tiles with the most keys first (under causal), so the
  blocks finish together. Each tile keeps its online-softmax state (row max, row sum,
  fp32 accumulator) in registers across every rank's keys: its own first, then ``rank + 1``'s, ``rank + 2``'s,
  ... Before a peer's piece it waits on that piece's flag (an acquire spin, then the async-proxy fence: the K/V
  tiles load through TMA). No per-step launches and no merge of partial results across ranks. Two kernels:
* Without ``causal``, ``full_attention_kernel``: every query sees every key, so a tile is one key loop over every rank's
  shard, all read from the gather buffer (at one rank from ``k`` and ``v``) through device-built TMA descriptors, K's
  and V's: 2-D boxes where S_local is whole query tiles (the output then leaves through a TMA store), else [1, BLOCK_N,
  head_dim] boxes that end at each shard's end (TMA's zeros past it). Its tile loop is warp-specialized (Triton 3.6 on
  sm_90: a producer warpgroup issues the loads, two consumer warpgroups take 64 query rows each, as in
  FlashAttention-3), with a static schedule (block b takes tiles b, b + blocks, ...) and fixed tiles (``FULL_CHOICES``).
* With ``causal``, ``context_parallel_attention_kernel``: each block takes the next tile from a count in memory
  when done with its last one (a dynamic schedule); its own K/V come straight from ``k`` and ``v`` and the
  peers' from the gather buffer, through host-built descriptors over the flattened [rows, head_dim] tensors.
  The keys a tile sees of each rank's shard are a prefix of it (below): full key tiles run an unmasked loop,
  then the prefix's last tile, and the diagonal's, run the masked one (scores past a chunk's end masked to
  ``MASKED_SCORE``, values zeroed: those rows belong to another head, or to a piece still in flight). Triton
  3.6 warp-specializes only one key loop per tile loop, so this kernel is not.
* With ``causal`` at head_dim 128 (``SPLIT_HEAD_DIMS``) both, in turn: ``full_attention_kernel`` (``CAUSAL``) takes
  every key tile that all of a query tile's rows see (its one key loop, unmasked, warp-specialized) and leaves each
  row's output and log2-sum-exp2; then ``context_parallel_attention_kernel`` (``MERGE``) runs the rest, the masked
  tiles (the diagonal, a chunk's partial last key tile), and merges its own row max and sum with them at the end.
  The first output passes through bf16 once more (relative error against float64 at 8K: 2.39e-3, cuDNN's 2.09e-3).

``causal=True`` uses the load-balanced layout: the sequence is cut into ``2 * world_size`` equal
chunks and rank r holds chunks ``r`` and ``2 * world_size - 1 - r``, in that order, as its S_local
rows (``shard_sequence`` / ``unshard_sequence``). Every rank then has the same work: for a query
chunk ``cq`` and a key chunk ``ck``, keys are all visible if ``ck < cq``, causally masked if
``ck == cq`` and skipped if ``ck > cq``. A rank's two chunks are in the sequence's order, so the keys of one
shard that a query row sees are a prefix: of its own shard, those up to its own position; of a peer's, none, the
first chunk or both. Without ``causal``, rank r holds the r-th contiguous ``1 / world_size`` of the sequence.

Host: ``prepare`` (checks, agreement across ranks, plan, the gather buffer's context and flags, a ``Launcher``)
is kept per call signature (``prepared.per_signature``; docs/design.md, "The host fast path"); a warm call allocates
its output and queues the exchange and the attention kernels through the launcher: from the second call with the
same pointers, as one CUDA graph launch (``graphs.graphed``; ``attention_on_gathered`` alike).

GQA: ``k``, ``v`` may have fewer heads than ``q`` (a divisor); query head ``h`` reads kv head
``h // (heads // kv_heads)``. ``attention_on_gathered`` runs the same kernel on K/V that are all
here already (no communication, no flags): the comparison that shows what the exchange costs.

World size 1 is a group of one: the same exchange (the two barriers met by myself alone, no peer piece to copy or
flag; my K/V not staged: the kernels read ``k`` and ``v`` where they are, the buffer's only shard) and the same
kernels, whose peer loops have no step; full attention over the local sequence.
"""

from __future__ import annotations

import heapq
import math

import torch
import torch.distributed as dist
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
from triton.tools.tensor_descriptor import TensorDescriptor

from kraken._ptx_utils import wait_async, wait_each_thread
from kraken.runtime.progress import (
    LANDED, GatherInProgress, barrier, copy_order, copy_stream, fork, on_stream, reset_flags, set_flag,
)
from kraken.runtime import agreement, graphs, groups, prepared, symm
from kraken.runtime.launcher import Launcher, jit_launch

OP = "context_parallel_attention"
INPUT_DTYPES = (torch.bfloat16, torch.float16)
HEAD_DIMS = (64, 128)
MAX_INDEX = 2**31 - 1  # element offsets are int32
LOG2E = 1.4426950408889634
# A masked key's score (after scaling): finite, so a row whose first tile were all masked would not
# turn into NaN (its weights are wiped by the rescale at its first real key; none occurs here).
MASKED_SCORE = -1.0e30
_MASKED_SCORE = tl.constexpr(MASKED_SCORE)  # Triton reads module globals only as constexprs
# The kernel leaves this many SMs' worth of block slots free: its blocks spin on flags that follow the gather's
# one-block barrier kernel, which must find room on some SM while every attention block is resident.
RESERVED_SMS = 1
# Without causal at one rank no block waits on a flag, so nothing needs the reserved SM and the grid may exceed the
# resident blocks: ``FULL_ONE_RANK_WAVES`` times as many blocks, each with a quarter of a persistent block's tiles, so
# that the hardware hands the tiles of a slow block's would-be last rounds to blocks that finish early. A persistent
# grid ends on its slowest block: the per-block end times of one launch spread by about one tile (100-170 us after the
# median block at 8K, the slow block a different one per launch), and the whole launch takes that much longer. One
# H200, B1 H32 8K head_dim 128, CUDA graphs, x cuDNN: 131 blocks 1.111-1.117, 262 1.060-1.067, 524 1.049-1.054, 1024
# 1.071-1.075, 2048 1.121; 32K: 131 1.129, 524 1.076-1.077. With peers, blocks spin on flags that follow the gather's
# barrier kernel, which must find an SM: the grid stays persistent.
FULL_ONE_RANK_WAVES = 4
# Causal tiles per head_dim (``context_parallel_attention_kernel``): (block_m, block_n, num_warps, num_stages) and the
# blocks resident per SM (the persistent grid is blocks_per_sm * (SMs - RESERVED_SMS); ``plan`` caps each thread's
# registers so that many fit (``maxnreg``) and the CPU test checks that the compiled kernels' registers and shared
# memory let them share an SM, else spinning blocks could wait on blocks never scheduled). Several 4-warp blocks of
# 64-row tiles per SM: a block's CTA barriers (around its TMA loads) hold only its own warps, so one block's softmax
# runs under another's GEMMs, where one 8-warp block of 128 rows keeps its two warpgroups in step. One H200, world size
# 1, CUDA graphs, 8K: head_dim 64 three blocks (at most 168 registers) 1509 us to two blocks' 1786 (B4 H16 causal);
# head_dim 128 two blocks of 64 x 64 (3 stages: 2 x 112 KB of shared memory) 2078 us to one 8-warp block of 128 x 64's
# 2288 (non-causal), 1320 to 1536 (causal). Head_dim 128 runs several blocks at one rank only (``ONE_RANK_TILES``):
# with the peer loop too, the 4-warp block takes 221 registers here but all 255 in the Helion twin, which spills 8 bytes
# from 2 ranks (the predicate of the thread that takes the next tile), where one 8-warp block of 128 x 64 fits both with
# no spill at 1 to 8 ranks (128 x 128 spills under causal from 2 ranks).
TILES = {
    64: {"block_m": 64, "block_n": 64, "num_warps": 4, "num_stages": 3, "blocks_per_sm": 3},
    128: {"block_m": 128, "block_n": 64, "num_warps": 8, "num_stages": 3, "blocks_per_sm": 1},
}
# At one rank head_dim 128 always splits (``SPLIT_HEAD_DIMS``), so these are the second pass's tiles: one stage (a
# query tile meets one or two key tiles), three blocks per SM (at most 168 registers, the merge's state loaded after
# the key loop). One H200, world size 1, CUDA graphs, x cuDNN, against two blocks of 3 stages: B1 H32 8K Hkv 32
# 1.128 -> 1.113, Hkv 8 1.075 -> 1.056, 32K Hkv 8 1.092 -> 1.085 (docs/history.md, context-parallel attention).
ONE_RANK_TILES = {
    128: {"block_m": 64, "block_n": 64, "num_warps": 4, "num_stages": 1, "blocks_per_sm": 3},
}
# Without causal (``full_attention_kernel``, warp-specialized): ``num_warps`` 4 is the producer warpgroup, and Triton
# adds two consumer warpgroups of BLOCK_M / 2 query rows each (12 warps, one block per SM). One H200, world size 1,
# CUDA graphs, B1 H32 Hkv8 head_dim 128, against cuDNN SDPA in the same process: 8K 1899 us (cuDNN 1697) to the causal
# kernel's 2271, 32K 31408 (28883) to 37966. Causal needs a masked and an unmasked key loop per tile (or a mask on
# every key tile, which made the warp-specialized kernel slower than this one: 8K 1253 us to 1065), and Triton 3.6
# specializes only one loop per tile loop, so the causal kernel is not warp-specialized.
FULL_TILES = {
    64: {"block_m": 128, "block_n": 128, "num_warps": 4, "num_stages": 2, "blocks_per_sm": 1},
    128: {"block_m": 128, "block_n": 128, "num_warps": 4, "num_stages": 2, "blocks_per_sm": 1},
}
# The configs the warp-specialized kernel takes (``plan`` refuses the rest): under Triton 3.6, 64-row tiles with 4
# warps fail to compile (PassManager::run failed), two blocks per SM hung at 2 ranks on one H200, and 128 x 64 tiles
# at 3 stages gave NaN outputs.
# Causal at these head_dims runs in two kernels (``plan``'s ``split_blocks``): the warp-specialized one over every key
# tile that a query tile sees whole, then the causal kernel over the rest (the diagonal, a chunk's partial last key
# tile), resuming from the first's output and log-sum-exp (``MERGE``). One H200, world size 1, CUDA graphs, x cuDNN:
# B1 H32 8K Hkv 8 1.145 -> 1.073, Hkv 32 1.21 -> 1.13, 32K 1.20 -> 1.06-1.08; head_dim 64 (B4 H16 8K) 1.098 -> 1.128,
# so head_dim 64 keeps the causal kernel alone. The warp-specialized kernel alone ran at 0.95-1.05x cuDNN at 8K; the
# second pass costs 105-125 us at 8K, 90-100 on ``ONE_RANK_TILES`` (it reads q, the key tiles and the first's output
# and writes the output: 224-320 MB at 8K, 2.1-2.9 TB/s; latency-bound: 1-2 key tiles per query tile). Folding the
# diagonal into the warp-specialized kernel did not pay: a branch on it in the key loop makes Triton 3.6 drop warp
# specialization (255 registers, spills; 3.8x slower), a mask on every key tile or the diagonal pass first, merged in
# this kernel's epilogue, were no faster (docs/history.md, context-parallel attention).
SPLIT_HEAD_DIMS = (128,)
# At one rank, from this S_local on, the warp-specialized causal kernel takes one block per tile, kv head by kv head
# (the tiles running at once share a few heads' K/V in L2), where shorter sequences run on ``SPLIT_ONE_RANK_WAVES``
# times the resident blocks with the tiles longest first over all heads (the blocks' sums evened by the order): x cuDNN,
# the first kernel alone, 32K 1.040 against 1.13, 8K Hkv 8 1.018 against 0.952, Hkv 32 1.07 against 1.003.
SPLIT_LONG = 16384
# Five waves rather than ``FULL_ONE_RANK_WAVES``' four: the last wave's ragged end is where the causal kernel, a
# dependent launch (``dependent_merge``), starts. One H200, B1 H32 8K causal, both kernels, x cuDNN: Hkv 32 4 waves
# 1.106-1.109, 5 waves 1.100-1.101, 6 1.106-1.107, 7 1.116, 2 1.126-1.127, 8 1.135-1.137, 4.5 or 5.5 waves (a last wave
# part-filled) 1.17-1.18; Hkv 8 4 waves 1.044-1.046, 5 1.043-1.045, 3 1.040-1.042 (docs/history.md).
SPLIT_ONE_RANK_WAVES = 5
FULL_CHOICES = {"block_m": (128,), "block_n": (64, 128), "num_warps": (4,), "num_stages": (2,), "blocks_per_sm": (1,)}
# Registers per SM (and per thread at most): ``plan``'s register cap for blocks_per_sm blocks.
SM_REGISTERS, MAX_REGISTERS = 65536, 255
# ``pieces``: each peer's K/V is copied (and flagged) in up to this many ranges of (batch, kv head) rows; by
# default ``PIECE_BUDGET // world_size`` (at least 2): finer pieces let the first tiles start sooner, but each
# costs the host two copies and a flag write per peer.
PIECE_BUDGET = 32
DEFAULT_CONFIG = {"block_m": None, "block_n": None, "num_warps": None, "num_stages": None, "blocks_per_sm": None,
                  "pieces": None, "max_blocks": None}


# ---------------------------------------------------------------------------
# The kernel
# ---------------------------------------------------------------------------


@triton.jit
def softmax_step(qk, m_i, l_i, acc, qk_scale, keep, MASKED: tl.constexpr):
    """One online-softmax step on a key tile's raw scores ``qk`` (MASKED: only where ``keep``, the rest scored
    ``MASKED_SCORE``): the probabilities ``p`` (exp2, the scale folded in), the new row max and row sum, and ``acc``
    rescaled to the new max, ready for ``acc += p @ v``. Both kernels' key loops take it."""
    if MASKED:
        qk = tl.where(keep, qk * qk_scale, _MASKED_SCORE)
        m_ij = tl.maximum(m_i, tl.max(qk, 1))
        qk = qk - m_ij[:, None]
    else:
        m_ij = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
        qk = qk * qk_scale - m_ij[:, None]
    p = tl.math.exp2(qk)
    alpha = tl.math.exp2(m_i - m_ij)
    return p, m_ij, l_i * alpha + tl.sum(p, 1), acc * alpha[:, None]


@triton.jit
def attend(acc, m_i, l_i, q, k_desc, v_desc, k_row0, v_row0, lo, hi, q_limit, qk_scale,
           MASKED: tl.constexpr, BLOCK_N: tl.constexpr):
    """Online softmax over keys ``lo .. hi`` of one chunk (rows ``k_row0 + ...`` of ``k_desc``, ``v_row0 + ...``
    of ``v_desc``). MASKED: key ``j`` counts for query row ``i`` only if ``j <= q_limit[i]`` and ``j < hi``."""
    for start in tl.range(lo, hi, BLOCK_N):
        k = k_desc.load([k_row0 + start, 0])
        cols = start + tl.arange(0, BLOCK_N)
        keep = (cols[None, :] <= q_limit[:, None]) & (cols[None, :] < hi)
        p, m_ij, l_i, acc = softmax_step(tl.dot(q, k.T), m_i, l_i, acc, qk_scale, keep, MASKED)
        v = v_desc.load([v_row0 + start, 0])
        if MASKED:
            # Rows past the chunk: another head's values, or a piece still in flight (any bits, NaN too).
            v = tl.where((cols < hi)[:, None], v, tl.zeros_like(v))
        acc = tl.dot(p.to(v.dtype), v, acc)
        m_i = m_ij
    return acc, m_i, l_i


@triton.jit
def context_parallel_attention_kernel(
    q_desc,  # q as [batch * heads * S_local, head_dim], BLOCK_M x HEAD_DIM boxes
    k_desc,  # my k as [batch * kv_heads * S_local, head_dim], BLOCK_N x HEAD_DIM boxes
    v_desc,  # my v, the same
    kv_desc,  # the gather buffer [world_size * 2 * batch * kv_heads * S_local, head_dim]: (rank, k|v, row, ...)
    out_ptr,  # [batch, heads, S_local, head_dim]
    lse_ptr,  # MERGE: fp32 [batch * heads * S_local], the warp-specialized kernel's log2-sum-exp2 per query row
    progress_ptr,  # int32[world_size * pieces + 1]: [r * pieces + p] piece p of rank r's K/V has landed; last: the
    # count of tiles taken (zero at launch)
    order_ptr,  # int32[num_tiles, 5]: the query tiles in the order blocks take them (``tile_order``)
    heads,
    kv_heads,
    kv_rows,  # batch * kv_heads
    s_local,
    pieces,
    qk_scale,  # softmax scale * log2(e)
    rank,
    world_size: tl.constexpr,
    CAUSAL: tl.constexpr,
    WAIT: tl.constexpr,  # False: every rank's K/V is in the gather buffer already (no flags to wait for)
    MERGE: tl.constexpr,  # resume from ``out`` and ``lse``: only the key tiles the warp-specialized kernel left
    SPLIT: tl.constexpr,  # MERGE: its key tiles' size (and query tiles'), else BLOCK_N
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    HALVES: tl.constexpr = 2 if CAUSAL else 1
    chunk = s_local // HALVES
    whole = chunk // SPLIT * SPLIT  # its keys in whole key tiles
    tiles_per_chunk = tl.cdiv(chunk, BLOCK_M)
    tiles_per_head = HALVES * tiles_per_chunk
    num_tiles = kv_rows * (heads // kv_heads) * tiles_per_head
    # Dynamic schedule: a block takes the next tile of ``order`` when it is done with its last one, so the blocks
    # finish together although causal tiles differ in cost (``order``: piece by piece, the costliest first).
    taken = progress_ptr + world_size * pieces
    tile = tl.atomic_add(taken, 1, sem="relaxed")
    last_piece = -1  # the piece of this block's previous tile
    while tile < num_tiles:
        # The tile's first row of q, first row of its (batch, kv head)'s K/V, half of my shard, first row in its
        # chunk, and piece: decoded on the host, so no division here.
        fields = order_ptr + tile * 5
        q_row0 = tl.load(fields)
        kv_row0 = tl.load(fields + 1)
        half = tl.load(fields + 2)
        m0 = tl.load(fields + 3)
        piece = tl.load(fields + 4)
        q = q_desc.load([q_row0, 0])
        offs_m = m0 + tl.arange(0, BLOCK_M)
        dims = tl.arange(0, HEAD_DIM)
        rows = q_row0 - m0 + offs_m
        m_i = tl.full([BLOCK_M], _MASKED_SCORE, dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
        # My own K/V first, read where the caller keeps them: a prefix of my shard's keys. Under causal my chunks are
        # (rank, 2 ws - 1 - rank), in the sequence's order, so a query row at position p of my shard sees my keys
        # 0 .. p: all of them unmasked up to the tile's first row (rounded down to a whole key tile: ``m0`` is one,
        # so ``half * whole + m0``), the rest masked up to its last row.
        if CAUSAL:
            full = half * whole + m0 // SPLIT * SPLIT
            hi = half * chunk + tl.minimum(m0 + BLOCK_M, chunk)
            limit = offs_m + half * chunk
        else:
            full, hi, limit = whole, chunk, offs_m + chunk
        if not MERGE:
            acc, m_i, l_i = attend(acc, m_i, l_i, q, k_desc, v_desc, kv_row0, kv_row0, 0, full, offs_m, qk_scale,
                                   False, BLOCK_N)
        acc, m_i, l_i = attend(acc, m_i, l_i, q, k_desc, v_desc, kv_row0, kv_row0, full, hi, limit, qk_scale,
                               True, BLOCK_N)
        # Then rank + 1's, rank + 2's, ... from the gather buffer, each once its piece has landed.
        for step in tl.range(1, world_size):
            src = (rank + step) % world_size
            if WAIT:
                if piece != last_piece:  # this block's first tile of the piece: wait once per peer
                    # Acquire: the copy engine's writes are visible; async-proxy fence: TMA sees them too.
                    wait_async(progress_ptr + src * pieces + piece, 1)
            # A peer's keys are a prefix of its shard too, never masked but at its end. Under causal its chunks are
            # (src, 2 ws - 1 - src): chunk src is visible to my query half 1, and to half 0 if src < rank (the step
            # wrapped around); chunk 2 ws - 1 - src to my query half 1 if src > rank (then chunk src is too).
            if CAUSAL:
                wrapped = (rank + step) // world_size
                hi = (half * (2 - wrapped) + (1 - half) * wrapped) * chunk
            else:
                hi = chunk
            k_row0 = (src * 2) * kv_rows * s_local + kv_row0
            v_row0 = k_row0 + kv_rows * s_local
            if not MERGE:
                acc, m_i, l_i = attend(acc, m_i, l_i, q, kv_desc, kv_desc, k_row0, v_row0, 0, hi // SPLIT * SPLIT,
                                       offs_m, qk_scale, False, BLOCK_N)
            acc, m_i, l_i = attend(acc, m_i, l_i, q, kv_desc, kv_desc, k_row0, v_row0, hi // SPLIT * SPLIT, hi,
                                   offs_m + hi, qk_scale, True, BLOCK_N)
        if MERGE:
            # Combined with the state the warp-specialized kernel left (its output normalized, its log2-sum-exp2),
            # loaded only now: held through the key loops, its registers kept a third block off the SM. Launched
            # while that kernel still runs (``launch_attention``): its writes are complete and visible past this wait.
            gdc_wait()
            lse = tl.load(lse_ptr + rows, mask=offs_m < chunk, other=0.0)
            m_ij = tl.maximum(m_i, lse)
            earlier, here = tl.math.exp2(lse - m_ij), tl.math.exp2(m_i - m_ij)
            prev = tl.load(out_ptr + rows[:, None] * HEAD_DIM + dims[None, :], mask=(offs_m < chunk)[:, None],
                           other=0.0)
            acc = prev.to(tl.float32) * earlier[:, None] + acc * here[:, None]
            l_i = earlier + l_i * here
        acc = acc / l_i[:, None]
        # Only the chunk's rows: a tile at a chunk's end also read some rows after it, discarded.
        tl.store(out_ptr + rows[:, None] * HEAD_DIM + dims[None, :], acc.to(out_ptr.dtype.element_ty),
                 mask=(offs_m < chunk)[:, None])
        last_piece = piece
        tile = tl.atomic_add(taken, 1, sem="relaxed")


# ``s_local``, ``num_tiles`` and ``per_rank`` are never specialized: at 1 (Triton's constant for an int argument of 1)
# with one rank a loop has one trip, the compiler drops it, and warp specialization fails to compile without it.
@triton.jit(do_not_specialize=["s_local", "num_tiles", "per_rank"])
def full_attention_kernel(
    q_ptr,  # q as [batch * heads * S_local, head_dim]
    k_ptr,  # the gather buffer as [world_size * 2 * batch * kv_heads, S_local, head_dim]: rank, k|v, (batch, kv head);
    # at one rank my ``k`` (the buffer's only K block)
    v_ptr,  # the same buffer from its first V block (at one rank my ``v``): a V row has its K row's index
    out_ptr,  # [batch, heads, S_local, head_dim]
    lse_ptr,  # CAUSAL: fp32 [batch * heads * S_local], each query row's log2-sum-exp2 of the scores seen here
    progress_ptr,  # int32[world_size * pieces + 1]: [r * pieces + p] piece p of rank r's K/V has landed
    order_ptr,  # int32[num_tiles, 5]: the query tiles in the order the blocks' rounds take them (``tile_order``)
    q_rows,  # batch * heads * S_local
    kv_rows,  # batch * kv_heads
    s_local,
    num_tiles,  # batch * heads * query tiles per (batch, head)
    per_rank,  # key tiles per rank's shard
    pieces,
    qk_scale,  # softmax scale * log2(e)
    rank,
    num_blocks,  # the persistent grid
    world_size: tl.constexpr,
    # CAUSAL: only the key tiles every query row of the tile sees whole (the rest: the causal kernel's ``MERGE``)
    CAUSAL: tl.constexpr,
    WAIT: tl.constexpr,  # False: every rank's K/V is in the gather buffer already (no flags to wait for)
    WHOLE: tl.constexpr,  # a chunk is a whole number of query (so key) tiles: 2-D boxes, TMA store (below)
    TAIL: tl.constexpr,  # S_local is not a whole number of key tiles: mask the keys past it
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """Without ``causal``: every query sees every key, so each tile is ONE key loop over every rank's shard (mine, then
    rank + 1's, ...), all read from the gather buffer (mine staged there, ``stage_own``; at one rank from ``k`` and
    ``v``), and the persistent tile loop is warp-specialized: on sm_90 a producer warpgroup issues the TMA loads and
    two consumer warpgroups take BLOCK_M / 2 query rows each (FlashAttention-3's split). Triton 3.6 specializes this
    only for one key loop in the tile loop, with no branch in it, and with descriptors built on the device (host-built
    ones hung, docs/helion-notes.md)."""
    # K and V load through descriptors of their own, over the same buffer: V's starts one K block later, so a V tile has
    # its K tile's coordinates. WHOLE: every tile lies inside one (rank, k|v, (batch, kv head)) shard of the buffer and
    # one (batch, head) of q and out, so K/V load as 2-D [BLOCK_N, HEAD_DIM] boxes and the output leaves through a TMA
    # store of the tile. Else K/V boxes are [1, BLOCK_N, HEAD_DIM] of one shard, so TMA fills the rows past its end with
    # zeros and no key tile reads another shard (of a piece that may be in flight), and the store keeps the shard's rows
    # (a pointer store). In a minimal kernel (one H200, world size 1, B1 H32 Hkv8 8K, persistent grid) each of these
    # measured 3-8% (one descriptor for K and V 1730 us against 1605, a pointer store 7%, 3-D boxes 3-5%); here, within
    # 1%: on the persistent grid this kernel's time was its slowest block's (``FULL_ONE_RANK_WAVES``; docs/history.md,
    # context-parallel attention).
    if CAUSAL:  # the causal kernel (``MERGE``) may launch now: its blocks take the SMs this grid's tail leaves idle
        gdc_launch_dependents()
    q_desc = tl.make_tensor_descriptor(q_ptr, shape=[q_rows, HEAD_DIM], strides=[HEAD_DIM, 1],
                                       block_shape=[BLOCK_M, HEAD_DIM])
    blocks = world_size * 2 * kv_rows  # the buffer's (rank, k|v, (batch, kv head)) blocks of S_local rows
    if WHOLE:
        k_desc = tl.make_tensor_descriptor(k_ptr, shape=[(blocks - kv_rows) * s_local, HEAD_DIM], strides=[HEAD_DIM, 1],
                                           block_shape=[BLOCK_N, HEAD_DIM])
        v_desc = tl.make_tensor_descriptor(v_ptr, shape=[(blocks - kv_rows) * s_local, HEAD_DIM], strides=[HEAD_DIM, 1],
                                           block_shape=[BLOCK_N, HEAD_DIM])
        out_desc = tl.make_tensor_descriptor(out_ptr, shape=[q_rows, HEAD_DIM], strides=[HEAD_DIM, 1],
                                             block_shape=[BLOCK_M, HEAD_DIM])
    else:
        k_desc = tl.make_tensor_descriptor(k_ptr, shape=[blocks - kv_rows, s_local, HEAD_DIM],
                                           strides=[s_local * HEAD_DIM, HEAD_DIM, 1],
                                           block_shape=[1, BLOCK_N, HEAD_DIM])
        v_desc = tl.make_tensor_descriptor(v_ptr, shape=[blocks - kv_rows, s_local, HEAD_DIM],
                                           strides=[s_local * HEAD_DIM, HEAD_DIM, 1],
                                           block_shape=[1, BLOCK_N, HEAD_DIM])
    later = world_size - 1 - rank  # peers after me (rank + 1 ...); the other ``rank`` peers wrap around (0 ...)
    HALVES: tl.constexpr = 2 if CAUSAL else 1
    chunk = s_local // HALVES
    # Static persistent schedule: block b takes tiles b, b + num_blocks, ... of ``order`` (piece by piece).
    for tile in tl.range(tl.program_id(0), num_tiles, num_blocks, warp_specialize=True):
        fields = order_ptr + tile * 5  # first row of q, first row of its (batch, kv head)'s K/V, half, first row, piece
        q_row0 = tl.load(fields)
        kv_head = tl.load(fields + 1) // s_local
        m0 = tl.load(fields + 3)
        piece = tl.load(fields + 4)
        if WAIT:  # every peer's piece has landed (acquire; async-proxy fence: TMA reads it)
            for step in tl.static_range(1, world_size):
                kv_head += wait_each_thread(progress_ptr + (rank + step) % world_size * pieces + piece, 1)
        # Key tiles of each shard: mine (``n_own``), each later peer's (``n_later``), each wrapped one's. Without causal
        # every shard's. Under causal (the module docstring's prefixes) only those every query row of the tile sees
        # whole: of mine, those before the tile's first row (its half's chunk of whole tiles, then ``m0``); of a peer
        # after me both its chunks to my query half 1 and none to half 0; of a wrapped one its first chunk. The rest
        # (the diagonal, a chunk's last partial key tile) is the causal kernel's, under ``MERGE``.
        if CAUSAL:
            half = tl.load(fields + 2)
            n_own = half * (chunk // BLOCK_N) + m0 // BLOCK_N
            n_later = half * (s_local // BLOCK_N)
            n_wrapped = chunk // BLOCK_N
        else:
            n_own, n_later, n_wrapped = per_rank, per_rank, per_rank
        end_later = n_own + later * n_later
        q = q_desc.load([q_row0, 0])
        # (The pointer store's rows come from ``offs_m``, made here, before the key loop: a value the producer uses
        # before the loop and the consumers after it, ``q_row0`` alone, gave wrong rows under warp specialization. The
        # TMA store of whole tiles takes ``q_row0``: Triton splits its box and coordinate per consumer warpgroup.)
        offs_m = m0 + tl.arange(0, BLOCK_M)
        m_i = tl.full([BLOCK_M], _MASKED_SCORE, dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
        # Key tile i: my own (i < n_own), then rank + 1's, ..., then the wrapped ones (0, ...).
        for i in tl.range(0, end_later + rank * n_wrapped):
            if world_size == 1:
                src = rank
                start = i * BLOCK_N
            else:
                is_later = i < end_later
                j_later = i - n_own
                j_wrapped = i - end_later
                step_later = j_later // tl.maximum(n_later, 1)
                step_wrapped = j_wrapped // tl.maximum(n_wrapped, 1)
                src = (rank + tl.where(i < n_own, 0, tl.where(is_later, 1 + step_later, 1 + later + step_wrapped))
                       ) % world_size
                start = tl.where(i < n_own, i, tl.where(is_later, j_later - step_later * n_later,
                                                        j_wrapped - step_wrapped * n_wrapped)) * BLOCK_N
            k_row = src * 2 * kv_rows + kv_head
            if WHOLE:
                k = k_desc.load([k_row * s_local + start, 0])
            else:
                k = k_desc.load([k_row, start, 0]).reshape(BLOCK_N, HEAD_DIM)
            keep = (start + tl.arange(0, BLOCK_N))[None, :] <= (s_local - 1)  # TAIL: keys past the shard (TMA's zeros)
            p, m_ij, l_i, acc = softmax_step(tl.dot(q, k.T), m_i, l_i, acc, qk_scale, keep, TAIL)
            if WHOLE:
                v = v_desc.load([k_row * s_local + start, 0])
            else:
                v = v_desc.load([k_row, start, 0]).reshape(BLOCK_N, HEAD_DIM)
            acc = tl.dot(p.to(v.dtype), v, acc)
            m_i = m_ij
        rows = q_row0 - m0 + offs_m
        if CAUSAL:
            # The state the causal kernel resumes from (``MERGE``): the normalized output and the row's log2-sum-exp2
            # (a row that saw no key here, l_i 0: output 0 and -inf, which weigh nothing there).
            tl.store(lse_ptr + rows, m_i + tl.math.log2(l_i), mask=offs_m < chunk)
            acc = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        else:
            acc = acc / l_i[:, None]
        if WHOLE:
            out_desc.store([q_row0, 0], acc.to(out_ptr.dtype.element_ty))
        else:
            # Only the chunk's rows: a tile at its end also read some rows after it, discarded.
            dims = tl.arange(0, HEAD_DIM)
            tl.store(out_ptr + rows[:, None] * HEAD_DIM + dims[None, :], acc.to(out_ptr.dtype.element_ty),
                     mask=(offs_m < chunk)[:, None])


# ---------------------------------------------------------------------------
# The sequence layout
# ---------------------------------------------------------------------------


def shard_chunks(rank: int, world_size: int, causal: bool) -> tuple[int, ...]:
    """The chunks of the sequence rank ``rank`` holds, in order: of ``world_size`` chunks ``(rank,)``, or with
    ``causal`` (the load-balanced layout) of ``2 * world_size`` chunks ``(rank, 2 * world_size - 1 - rank)``."""
    return (rank, 2 * world_size - 1 - rank) if causal else (rank,)


def shard_sequence(x: torch.Tensor, rank: int, world_size: int, causal: bool = False, dim: int = 2) -> torch.Tensor:
    """Rank ``rank``'s shard (a new contiguous tensor) of the full sequence ``x`` along ``dim`` (2: [batch,
    heads, S, head_dim]). S must divide into ``world_size`` (``2 * world_size`` with ``causal``) equal chunks."""
    parts = 2 * world_size if causal else world_size
    if x.shape[dim] % parts:
        raise ValueError(f"{OP}: a sequence of {x.shape[dim]} does not split into {parts} equal chunks")
    chunks = x.chunk(parts, dim=dim)
    return torch.cat([chunks[c] for c in shard_chunks(rank, world_size, causal)], dim=dim).contiguous()


def unshard_sequence(shards: list[torch.Tensor] | tuple[torch.Tensor, ...], causal: bool = False,
                     dim: int = 2) -> torch.Tensor:
    """The full sequence from every rank's shard (``shards[r]``: rank r's), the inverse of ``shard_sequence``."""
    world_size = len(shards)
    parts = 2 * world_size if causal else world_size
    chunks: list[torch.Tensor | None] = [None] * parts
    for rank, shard in enumerate(shards):
        for c, piece in zip(shard_chunks(rank, world_size, causal), shard.chunk(len(shard_chunks(0, 1, causal)), dim)):
            chunks[c] = piece
    return torch.cat(chunks, dim=dim)


def sequence_positions(s_local: int, rank: int, world_size: int, causal: bool = False) -> torch.Tensor:
    """The positions in the full sequence of rank ``rank``'s ``s_local`` rows (int64, on the CPU)."""
    chunk = s_local // 2 if causal else s_local
    return torch.cat([torch.arange(c * chunk, (c + 1) * chunk) for c in shard_chunks(rank, world_size, causal)])


# ---------------------------------------------------------------------------
# Host side
# ---------------------------------------------------------------------------


def default_tiles(head_dim: int, world_size: int, causal: bool) -> dict:
    """``FULL_TILES`` without causal; under causal ``TILES``, or at one rank ``ONE_RANK_TILES`` where it has the
    head_dim."""
    if not causal:
        return FULL_TILES.get(head_dim, FULL_TILES[128])
    return (ONE_RANK_TILES if world_size == 1 else {}).get(head_dim) or TILES.get(head_dim, TILES[128])


def plan(batch: int, heads: int, kv_heads: int, s_local: int, head_dim: int, world_size: int, causal: bool,
         config: dict, num_sms: int) -> dict:
    """Resolve the launch configuration (shared with the Helion port). The grid is persistent: at most
    ``blocks_per_sm`` blocks per SM but ``RESERVED_SMS`` SMs' worth, never more blocks than query tiles; without causal
    at one rank ``FULL_ONE_RANK_WAVES`` times that (no flag waits).
    ``piece_rows``: the (batch, kv head) rows of each flagged piece of a peer's K/V."""
    cfg = groups.resolve_config(config, DEFAULT_CONFIG, OP)  # rejects unknown keys
    defaults = default_tiles(head_dim, world_size, causal)
    cfg = {**cfg, **{key: cfg[key] if cfg[key] is not None else value for key, value in defaults.items()}}
    for key in ("block_m", "block_n"):
        value = cfg[key]
        if value < 16 or value & (value - 1):
            raise ValueError(f"{OP}: {key} must be a power of two >= 16, got {value}")
    if cfg["block_m"] % cfg["block_n"]:
        raise ValueError(f"{OP}: block_n must divide block_m (the causal diagonal starts at a query tile), "
                         f"got block_m={cfg['block_m']}, block_n={cfg['block_n']}")
    if isinstance(cfg["blocks_per_sm"], bool) or not isinstance(cfg["blocks_per_sm"], int) or cfg["blocks_per_sm"] < 1:
        raise ValueError(f"{OP}: blocks_per_sm must be an int >= 1, got {cfg['blocks_per_sm']!r}")
    if not causal:  # the warp-specialized kernels (the recipe's and the twin's)
        refused = {key: cfg[key] for key, allowed in FULL_CHOICES.items() if cfg[key] not in allowed}
        if refused:
            raise ValueError(f"{OP}: without causal the kernel is warp-specialized and takes only "
                             f"{', '.join(f'{key} in {allowed}' for key, allowed in FULL_CHOICES.items())}; got "
                             f"{', '.join(f'{key}={value!r}' for key, value in refused.items())}")
    pieces = max(2, PIECE_BUDGET // world_size) if cfg["pieces"] is None else cfg["pieces"]
    if pieces < 1:
        raise ValueError(f"{OP}: pieces must be >= 1, got {pieces}")
    kv_rows = batch * kv_heads
    piece_rows = groups.cdiv(kv_rows, min(pieces, kv_rows))
    chunk = s_local // 2 if causal else s_local
    num_tiles = batch * heads * (2 if causal else 1) * groups.cdiv(max(chunk, 1), cfg["block_m"])
    slots = cfg["blocks_per_sm"] * max(1, num_sms - RESERVED_SMS)
    if not causal and world_size == 1:  # no flag to wait for (``FULL_ONE_RANK_WAVES``)
        slots *= FULL_ONE_RANK_WAVES
    max_blocks = slots if cfg["max_blocks"] is None else max(1, min(cfg["max_blocks"], slots))
    num_blocks = max(1, min(num_tiles, max_blocks))
    # Causal at head_dim 128 (``SPLIT_HEAD_DIMS``): the warp-specialized kernel first, on ``FULL_TILES``, its grid
    # ``split_blocks`` as without causal; at one rank from ``SPLIT_LONG`` rows on, one block per tile.
    split_blocks = 0
    if causal and head_dim in SPLIT_HEAD_DIMS:
        split_tiles = batch * heads * 2 * groups.cdiv(max(chunk, 1), FULL_TILES[head_dim]["block_m"])
        split_slots = FULL_TILES[head_dim]["blocks_per_sm"] * max(1, num_sms - RESERVED_SMS)
        if world_size == 1:
            split_slots = split_tiles if s_local >= SPLIT_LONG else split_slots * SPLIT_ONE_RANK_WAVES
        if cfg["max_blocks"] is not None:
            split_slots = max(1, min(cfg["max_blocks"], split_slots))
        split_blocks = max(1, min(split_tiles, split_slots))
    if world_size == 1 and cfg["pieces"] is None:
        # No peer piece to wait for: pieces only group the tiles that ``tile_order`` sorts longest first. Two tiles
        # per block in each, so the short tiles of one piece never end the launch while long ones remain.
        piece_rows = max(piece_rows, min(kv_rows, groups.cdiv(2 * num_blocks, num_tiles // kv_rows)))
    keys = ("block_m", "block_n", "num_warps", "num_stages")
    return {**{key: cfg[key] for key in keys}, "maxnreg": register_cap(cfg["blocks_per_sm"], cfg["num_warps"]),
            "piece_rows": piece_rows, "pieces": groups.cdiv(kv_rows, piece_rows), "num_blocks": num_blocks,
            "split_blocks": split_blocks}


def register_cap(blocks_per_sm: int, num_warps: int) -> int | None:
    """The registers per thread that let ``blocks_per_sm`` blocks of ``num_warps`` warps share an SM's register file
    (allocated per thread in units of 8), or None where the hardware's 255 per thread already do."""
    cap = SM_REGISTERS // (blocks_per_sm * num_warps * 32) // 8 * 8
    return None if cap >= MAX_REGISTERS else cap


def check_inputs(q, k, v, causal, scale, op: str) -> None:
    """Argument checks that need neither a GPU nor torch.distributed."""
    named = (("q", q), ("k", k), ("v", v))
    for name, tensor in named:
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"{op}: {name} must be a torch.Tensor, got {type(tensor).__name__}")
    # groups.check_tensor's checks, but every one on all three before the device (the last, below).
    for name, tensor in named:
        if tensor.dtype not in INPUT_DTYPES:
            groups.check_tensor(tensor, name, op, INPUT_DTYPES)  # raises, naming the dtype
    for name, tensor in named:
        if tensor.dim() != 4:
            raise ValueError(f"{op}: {name} must be 4-D, got shape {tuple(tensor.shape)}")
        if not tensor.is_contiguous():
            raise ValueError(f"{op}: {name} must be contiguous (got strides {tensor.stride()}); call .contiguous() first")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"{op}: q, k and v must have the same dtype, got {q.dtype}, {k.dtype} and {v.dtype}")
    if k.shape != v.shape:
        raise ValueError(f"{op}: k and v must have the same shape, got {tuple(k.shape)} and {tuple(v.shape)}")
    (batch, heads, s_local, head_dim), (kv_batch, kv_heads, kv_len, kv_dim) = q.shape, k.shape
    if kv_batch != batch or kv_len != s_local or kv_dim != head_dim:
        raise ValueError(f"{op}: q is [batch, heads, S_local, head_dim] = {tuple(q.shape)} but k and v are "
                         f"{tuple(k.shape)}: batch, S_local and head_dim must match")
    if head_dim not in HEAD_DIMS:
        raise ValueError(f"{op}: head_dim must be one of {HEAD_DIMS}, got {head_dim}")
    if kv_heads == 0 or heads % kv_heads:
        raise ValueError(f"{op}: the kv heads ({kv_heads}) must divide the query heads ({heads})")
    if q.numel() == 0:
        raise ValueError(f"{op}: empty input (q is {tuple(q.shape)})")
    if not isinstance(causal, bool):
        raise TypeError(f"{op}: causal must be a bool, got {type(causal).__name__}")
    if causal and s_local % 2:
        raise ValueError(f"{op}: causal=True needs an even S_local (two equal chunks per rank, the load-balanced "
                         f"layout), got {s_local}")
    if scale is not None and (isinstance(scale, bool) or not isinstance(scale, (int, float))
                              or not math.isfinite(scale) or scale <= 0):
        raise ValueError(f"{op}: scale must be a positive finite number or None, got {scale!r}")
    for name, tensor in named:
        groups.check_tensor(tensor, name, op, INPUT_DTYPES, ndim=4)  # the device
    if k.device != q.device or v.device != q.device:
        raise ValueError(f"{op}: q, k and v must be on the same device, got {q.device}, {k.device} and {v.device}")


def check_sizes(q: torch.Tensor, k: torch.Tensor, world_size: int, op: str) -> None:
    if max(q.numel(), world_size * 2 * k.numel()) > MAX_INDEX:
        raise ValueError(f"{op}: q or the gathered K/V has more than 2**31 - 1 elements (32-bit offsets)")


def softmax_scale(scale: float | None, head_dim: int) -> float:
    """The scale of the scores (default 1 / sqrt(head_dim)) times log2(e): the kernel exponentiates with exp2."""
    return (1.0 / math.sqrt(head_dim) if scale is None else float(scale)) * LOG2E


def descriptors(q, k, v, gathered, block_m: int, block_n: int):
    """Host-built TMA descriptors over the flattened [rows, head_dim] tensors (the causal kernel's)."""
    head_dim = q.shape[-1]
    return (TensorDescriptor.from_tensor(q.view(-1, head_dim), [block_m, head_dim]),
            TensorDescriptor.from_tensor(k.view(-1, head_dim), [block_n, head_dim]),
            TensorDescriptor.from_tensor(v.view(-1, head_dim), [block_n, head_dim]),
            TensorDescriptor.from_tensor(gathered.view(-1, head_dim), [block_n, head_dim]))


def launch_attention(q, k, v, gathered, out, progress, rank: int, world_size: int, causal: bool, scale, wait: bool,
                     block_m: int, block_n: int, num_warps: int, num_stages: int, maxnreg: int | None, piece_rows: int,
                     pieces: int, num_blocks: int, split_blocks: int, launcher=jit_launch) -> torch.Tensor:
    """The attention kernels alone: every rank's K/V from ``gathered`` [world_size, 2, batch * kv_heads, S_local,
    head_dim] (mine where ``stage_own`` put them; at one rank ``k`` and ``v`` themselves), waiting on ``progress`` if
    ``wait``: the warp-specialized kernel without causal, or under causal at ``SPLIT_HEAD_DIMS`` (``split_blocks``)
    then the causal kernel on the rest (``MERGE``); else the causal kernel alone. The causal kernel reads my K/V from
    ``k`` and ``v``; after the warp-specialized kernel, as a dependent launch where ``dependent_merge`` says."""
    batch, heads, s_local, head_dim = q.shape
    kv_heads = k.shape[1]
    qk_scale = softmax_scale(scale, head_dim)
    split = causal and split_blocks > 0  # else the causal kernel alone, all keys
    full = FULL_TILES[head_dim] if split else {"block_m": block_m, "block_n": block_n, "num_warps": num_warps,
                                                "num_stages": num_stages}
    chunk = s_local // 2 if causal else s_local
    lse = lse_buffer(q.numel() // head_dim, q.device) if split else out
    grid = split_blocks if split else num_blocks
    if not causal or split:
        order = full_order(batch, heads, kv_heads, s_local, causal, full["block_m"], piece_rows, world_size, grid,
                           q.device, rank, full["block_n"])
        # K/V: the gather buffer's K blocks and, from its first V block, its V blocks; at one rank my ``k`` and ``v``
        # (the buffer would hold a copy of them and nothing else).
        k_src, v_src = (k, v) if world_size == 1 else (gathered, gathered[0, 1])
        launcher(
            full_attention_kernel, (grid,),
            q, k_src, v_src, out, lse, progress, order, batch * heads * s_local, batch * kv_heads, s_local,
            order.shape[0], groups.cdiv(s_local, full["block_n"]), pieces, qk_scale, rank, grid, world_size,
            CAUSAL=causal, WAIT=wait, WHOLE=chunk % full["block_m"] == 0,
            TAIL=not causal and s_local % full["block_n"] != 0,
            HEAD_DIM=head_dim, BLOCK_M=full["block_m"], BLOCK_N=full["block_n"], num_warps=full["num_warps"],
            num_stages=full["num_stages"], **({} if causal or maxnreg is None else {"maxnreg": maxnreg}),
        )
    if causal:
        order = tile_order(batch * heads, heads // kv_heads, s_local, causal, block_m, piece_rows, q.device)
        q_desc, k_desc, v_desc, kv_desc = descriptors(q, k, v, gathered, block_m, block_n)
        launcher(
            context_parallel_attention_kernel, (num_blocks,),
            q_desc, k_desc, v_desc, kv_desc, out, lse, progress, order, heads, kv_heads, batch * kv_heads, s_local,
            pieces, qk_scale, rank, world_size, CAUSAL=causal, WAIT=wait, MERGE=split,
            SPLIT=full["block_m"] if split else block_n, HEAD_DIM=head_dim, BLOCK_M=block_m, BLOCK_N=block_n,
            num_warps=num_warps, num_stages=num_stages, **({} if maxnreg is None else {"maxnreg": maxnreg}),
            **({"launch_pdl": True} if split and dependent_merge(wait, world_size) else {}),
        )
    return out


def dependent_merge(wait: bool, world_size: int) -> bool:
    """Whether the causal kernel after the warp-specialized one (``MERGE``) is a programmatic dependent launch
    (``launch_pdl``): wherever no block waits for a peer's piece. Its blocks then start on the SMs the first grid's last
    blocks leave idle and run their key loops there, and wait for that grid only before they merge (``gdc_wait``). One
    H200, world size 1, CUDA graphs, x cuDNN, against a plain launch, four runs: B1 H32 8K Hkv 32 1.109-1.116 ->
    1.101-1.108, Hkv 8 1.055-1.064 -> 1.046-1.056 (docs/history.md; before ``SPLIT_ONE_RANK_WAVES``).
    With flag waits it stays a plain launch: its blocks would take the SMs kept for the exchange's barrier kernel
    (``RESERVED_SMS``) while the first grid's blocks wait for pieces that kernel lets in."""
    return not (wait and world_size > 1)


def full_order(batch: int, heads: int, kv_heads: int, s_local: int, causal: bool, block_m: int, piece_rows: int,
               world_size: int, grid: int, device, rank: int = 0, block_n: int = 128) -> torch.Tensor:
    """The warp-specialized kernel's ``tile_order`` on a grid of ``grid`` blocks (the recipe's and the twin's). Without
    causal, piece by piece. Under causal, with peers: balanced across the static schedule's blocks by the tiles' key
    counts (``balanced_order``: a rank's tiles differ by up to ``2 * world_size`` times); at one rank no tile waits, so
    one piece, longest first, snaked, or, with a block per tile (``SPLIT_LONG``), kv head by kv head, longest first
    (the tiles running at once share K/V in L2)."""
    tiles = batch * heads * 2 * groups.cdiv(s_local // 2, block_m) if causal else 0
    if causal and world_size > 1 and grid < tiles:
        order = tile_order(batch * heads, heads // kv_heads, s_local, causal, block_m, piece_rows, "cpu")
        return balanced_order(order, s_local, block_n, rank, world_size, grid, device)
    rows = piece_rows if world_size > 1 or not causal else (1 if grid == tiles else batch * kv_heads)
    return tile_order(batch * heads, heads // kv_heads, s_local, causal, block_m, rows, device,
                      grid if causal and grid < tiles else 0)


_balanced: dict = {}


def balanced_order(order: torch.Tensor, s_local: int, block_n: int, rank: int, world_size: int, blocks: int,
                   device) -> torch.Tensor:
    """``order`` (causal, on the CPU) rearranged for the warp-specialized kernel's static schedule (block b takes
    positions b, b + blocks, ...) so that the blocks' key tiles sum evenly. A causal tile's key tiles there are its own
    shard's before its first row, both chunks of each peer after this rank to the later query half (none to the
    earlier), and the first chunk of each peer before it: at rank 0 of 4 the later half's tiles see 15 times the
    earlier half's keys, and rounds of ``blocks`` tiles in piece order left the costliest block 1.85 times the mean.
    Piece by piece (the tiles running at once share a few kv heads' K/V in L2, and wait for the first pieces to land),
    the piece's tiles keep its positions but, longest first, each goes to the least-loaded block (over the pieces
    before) among those with a position left in it."""
    key = (order.data_ptr(), s_local, block_n, rank, world_size, blocks, device)
    hit = _balanced.get(key)
    if hit is not None and hit[0] is order:
        return hit[1]
    chunk = s_local // 2
    half, m0, piece = order[:, 2], order[:, 3], order[:, 4]
    later = world_size - 1 - rank
    # key tiles per tile (as the kernel counts them), plus two for the tile's own load and epilogue
    cost = (half * (chunk // block_n) + m0 // block_n + later * half * (s_local // block_n)
            + rank * (chunk // block_n) + 2).tolist()
    loads = [0] * blocks
    positions = torch.empty(len(cost), dtype=torch.long)
    pieces = piece.tolist()
    begin = 0
    while begin < len(cost):  # piece by piece: the positions its tiles take stay where ``order`` has them
        end = begin
        while end < len(cost) and pieces[end] == pieces[begin]:
            end += 1
        slots: dict[int, list[int]] = {}
        for position in range(begin, end):
            slots.setdefault(position % blocks, []).append(position)
        heap = [(loads[b], b) for b in slots]
        heapq.heapify(heap)
        for t in sorted(range(begin, end), key=lambda t: -cost[t]):
            _, b = heapq.heappop(heap)
            positions[slots[b].pop(0)] = t
            loads[b] += cost[t]
            if slots[b]:
                heapq.heappush(heap, (loads[b], b))
        begin = end
    result = order[positions].to(torch.int32).to(device)
    if len(_balanced) >= prepared.MAX_PREPARED:
        graphs.drop_graphs()  # (a kept graph may read the orders dropped here)
        _balanced.clear()
    _balanced[key] = (order, result)
    return result


_lse: dict = {}


def lse_buffer(rows: int, device) -> torch.Tensor:
    """fp32 [rows]: the causal warp-specialized kernel's log2-sum-exp2 per query row, for the causal kernel's
    ``MERGE`` (cached per size and device, as ``progress_flags``: the two kernels use it in stream order)."""
    key = (rows, device)
    if key not in _lse:
        if len(_lse) >= prepared.MAX_PREPARED:
            graphs.drop_graphs()  # (a kept graph may write the buffers dropped here)
            _lse.clear()
        _lse[key] = torch.empty(rows, dtype=torch.float32, device=device)
    return _lse[key]


_orders: dict = {}


def tile_order(query_rows: int, group: int, s_local: int, causal: bool, block_m: int, piece_rows: int,
               device, blocks: int = 0) -> torch.Tensor:
    """The query tiles in the order the kernel's blocks take them, each as (its first row of q, the first row of its
    kv head's K/V: rows of the flattened [rows, head_dim] q and k; half of the shard, first row in the chunk, piece):
    piece by piece (a piece's tiles need only its flags). Within a piece, under causal, position by position across
    its heads, the costliest position first: a tile's keys grow with its last row, so the later half's tiles from its
    last, then the earlier half's from its last (longest first, so the last tiles taken are short and the blocks
    finish together). Without, all cost the same: head by head, so that the tiles running at once share a few kv
    heads' K/V in L2 (one H200, B1 H32 Hkv32 8K: 1836 -> 1821 us; Hkv8 unchanged). Cached per (shape, tiles, piece,
    device): built once on the host, an int32 [tiles, 5] tensor on ``device``."""
    key = (query_rows, group, s_local, causal, block_m, piece_rows, device, blocks)
    order = _orders.get(key)
    if order is None:
        halves = 2 if causal else 1
        tiles_per_chunk = groups.cdiv(max(s_local // halves, 1), block_m)
        position = torch.arange(halves * tiles_per_chunk)
        half = halves - 1 - position // tiles_per_chunk  # the later half first
        m0 = (tiles_per_chunk - 1 - position % tiles_per_chunk if causal else position) * block_m  # from its last
        heads_per_piece = group * piece_rows
        tiles = []
        for piece, first in enumerate(range(0, query_rows, heads_per_piece)):
            bh = torch.arange(first, min(first + heads_per_piece, query_rows))[None, :].expand(len(position), -1)
            tile_half, tile_m0 = half[:, None].expand_as(bh), m0[:, None].expand_as(bh)
            fields = (bh * s_local + tile_half * (s_local // halves) + tile_m0, bh // group * s_local, tile_half,
                      tile_m0, torch.full_like(bh, piece))
            stacked = torch.stack(fields, -1)  # [position, head, field]: position-major under causal, else head-major
            tiles.append((stacked if causal else stacked.transpose(0, 1)).reshape(-1, 5))
        if len(_orders) >= prepared.MAX_PREPARED:
            graphs.drop_graphs()  # (a kept graph may read the orders dropped here)
            _orders.clear()
        order = torch.cat(tiles)
        if blocks:
            # A static schedule (block b takes b, b + blocks, ...): every other round of ``blocks`` tiles reversed, so
            # the block that takes a round's longest tile takes the next round's shortest (the blocks' sums even).
            p = torch.arange(len(order))
            first = p // blocks * blocks
            width = torch.clamp(len(order) - first, max=blocks)
            order = order[torch.where(p // blocks % 2 == 0, p, first + width - 1 - (p - first))]
        order = _orders[key] = order.to(torch.int32).to(device)
    return order


def progress_size(world_size: int, pieces: int) -> int:
    """Slots of a launch's ``progress``: a flag per (rank, piece), then the count of tiles taken."""
    return world_size * pieces + 1


_exchange_plans: dict = {}


def exchange_plan(peers, gathered, rank: int, piece_rows: int, pieces: int) -> tuple:
    """(the order of ranks, my K and V chunks, and per (piece, peer), piece-major and rank + 1 first, its flag's index
    and its two (destination, source) copies: K, then V, each contiguous, for the copy engine rather than a strided
    copy kernel). Views of the prepared call's buffers, kept per (``peers``, ``gathered``, ...) as
    ``kraken._blocks.helion.views`` keeps its views (the objects are kept with them, so their ids stay theirs): each view costs
    about a microsecond, and a call makes four per piece and peer."""
    key = (id(peers), id(gathered), rank, piece_rows, pieces)
    hit = _exchange_plans.get(key)
    if hit is None or hit[0] is not peers or hit[1] is not gathered:
        world_size, kv_rows = len(peers), peers[rank].shape[1]
        order = copy_order(rank, world_size)
        rows = [(p * piece_rows, min((p + 1) * piece_rows, kv_rows)) for p in range(pieces)]
        copies = tuple((src * pieces + p, tuple((gathered[src, kv, begin:end], peers[src][kv, begin:end])
                                                for kv in (0, 1)))
                       for p, (begin, end) in enumerate(rows) for src in order[1:])
        if len(_exchange_plans) >= prepared.MAX_PREPARED:  # as many as the prepared calls it serves (a bound)
            _exchange_plans.clear()
        hit = _exchange_plans[key] = (peers, gathered, (order, peers[rank][0], peers[rank][1], copies))
    return hit[2]


def stage_own(k: torch.Tensor, v: torch.Tensor, my_k: torch.Tensor, my_v: torch.Tensor) -> None:
    """My ``k`` and ``v`` into my chunk of the gather buffer (``my_k``, ``my_v``: its [batch * kv_heads, S_local,
    head_dim] halves), on the current stream: the kernel reads every rank's K/V, mine too, from the buffer."""
    my_k.copy_(k.view(my_k.shape))
    my_v.copy_(v.view(my_v.shape))


def start_kv_gather(k, v, peers, gathered, progress, signal_pad_ptrs: int, rank: int, piece_rows: int,
                    pieces: int, launcher=jit_launch) -> GatherInProgress:
    """Stage my ``k``, ``v`` into my chunk of the symmetric ``gathered`` and copy every peer's K/V into
    ``gathered`` on the copy engine, piece by piece, flagging each (see the module docstring). ``peers[r]``:
    rank r's own chunk [2, batch * kv_heads, S_local, head_dim] of rank r's gather buffer. ``launcher`` launches
    the two barrier kernels."""
    world_size = len(peers)
    order, my_k, my_v, copies = exchange_plan(peers, gathered, rank, piece_rows, pieces)
    side = copy_stream(k.device)
    reset_flags(progress)  # before the fork: no flag of the previous call survives into this one
    # My K/V into my chunk, on the current stream (after the previous call's closing barrier, which the current
    # stream joined): the attention kernel reads them there in stream order, the peers after the first barrier.
    if world_size > 1:  # (at one rank the kernels read my ``k`` and ``v`` where they are)
        stage_own(k, v, my_k, my_v)
    fork(side)
    with on_stream(side):
        barrier(signal_pad_ptrs, rank, world_size, launcher)  # every rank's K/V is staged
        for flag, piece in copies:  # piece by piece; within a piece rank + 1 first
            for dst, src in piece:
                dst.copy_(src)
            set_flag(progress, flag, LANDED)
        barrier(signal_pad_ptrs, rank, world_size, launcher)  # done reading: peers may stage into their buffers again
    return GatherInProgress(gathered, progress, side, order)


def launch(q, k, v, peers, gathered, out, progress, signal_pad_ptrs: int, rank: int, causal: bool, scale,
           block_m: int, block_n: int, num_warps: int, num_stages: int, maxnreg: int | None, piece_rows: int,
           pieces: int, num_blocks: int, split_blocks: int, group_name: str = "", launcher=jit_launch,
           attention=None) -> torch.Tensor:
    """Launch on prepared arguments (no checks): the K/V exchange, then the attention kernel, ``attention`` (this
    recipe's ``launch_attention`` by default; the Helion twin passes its own). ``group_name`` is unused here."""
    started = start_kv_gather(k, v, peers, gathered, progress, signal_pad_ptrs, rank, piece_rows, pieces, launcher)
    (attention or launch_attention)(q, k, v, gathered, out, progress, rank, len(peers), causal, scale, True, block_m,
                                    block_n, num_warps, num_stages, maxnreg, piece_rows, pieces, num_blocks,
                                    split_blocks, launcher)
    started.wait()
    return out


_flags: dict[tuple, torch.Tensor] = {}


def progress_flags(count: int, device: torch.device) -> torch.Tensor:
    """The flags of one launch, one per (rank, piece), and its count of tiles taken (cached; zeroed by every launch
    before its gather)."""
    key = (device, count)
    if key not in _flags:
        _flags[key] = torch.zeros(count, dtype=torch.int32, device=device)
    return _flags[key]


@prepared.per_signature(lambda q, k, v, group, op, causal, scale, config: (
    op, group, prepared.tensor_key(q), prepared.tensor_key(k), prepared.tensor_key(v), prepared.scalar_key(causal),
    prepared.scalar_key(scale), prepared.config_key(config)))
def prepare(q, k, v, group, op: str, causal: bool, scale, config: dict) -> tuple[symm.SymmContext, dict]:
    """Validate, plan, and find the buffers: the context of the symmetric gather buffer (a slice of
    ``symm.symm_workspace``) and the launch arguments but the output (every rank's own chunk of the buffer as
    ``peers``, ``gathered``, ``progress``, the plan, the ``launcher``); kept per signature."""
    # Local checks; the first call of each signature also agrees on them (and on the shapes) across ranks.
    with agreement.agreed(op, group, q=q, k=k, v=v, causal=causal, scale=scale, config=config):
        check_inputs(q, k, v, causal, scale, op)  # (the device last: a CUDA tensor from here on)
        world_size = groups.world_size_of(group, op)
        check_sizes(q, k, world_size, op)
        num_sms = torch.cuda.get_device_properties(q.device).multi_processor_count
        batch, heads, s_local, head_dim = q.shape
        cfg = plan(batch, heads, k.shape[1], s_local, head_dim, world_size, causal, config, num_sms)
    pg = groups.resolve_group(group, op)
    shape = (world_size, 2, k.shape[0] * k.shape[1], k.shape[2], k.shape[3])
    gathered = symm.symm_workspace(math.prod(shape), k.dtype, k.device, pg, op).view(shape)
    ctx = symm.symm_context(gathered, pg, op, name="K/V gather buffer")
    progress = progress_flags(progress_size(world_size, cfg["pieces"]), q.device)
    peers = tuple(p[r] for r, p in enumerate(ctx.peers))  # rank r's own chunk of rank r's buffer
    return ctx, {"peers": peers, "gathered": gathered, "progress": progress, **cfg,
                 "launcher": Launcher(op)}


def attend_to_sequence(q, k, v, group, causal: bool, scale, config: dict, op: str = OP,
                       attention=None) -> torch.Tensor:
    """``context_parallel_attention`` of the recipe (``attention`` None) or of the Helion twin (its op name and its
    ``launch_attention``): the prepared call, a new output, the launch: the flags' reset, the fork, the exchange, the
    attention kernels and the join, replayed from one CUDA graph per pointer set (``graphs.graphed``)."""
    ctx, cfg = prepare(q, k, v, group, op, causal, scale, config)
    out = torch.empty_like(q)
    graphs.graphed((cfg["launcher"], q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr()),
                   lambda: launch(q, k, v, out=out, signal_pad_ptrs=ctx.signal_pad_ptrs, rank=ctx.rank, causal=causal,
                                  scale=scale, **cfg, group_name=ctx.group_name, attention=attention), q.device)
    return out


def context_parallel_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    group: dist.ProcessGroup | str | None = None,
    causal: bool = False,
    scale: float | None = None,
    **config,
) -> torch.Tensor:
    """This rank's [batch, heads, S_local, head_dim] output of attention over the whole sequence.

    ``q`` [batch, heads, S_local, head_dim], ``k``, ``v`` [batch, kv_heads, S_local, head_dim]: this rank's
    shard of the sequence (``shard_sequence``; with ``causal``, the load-balanced layout), contiguous CUDA
    tensors, bf16 or fp16, head_dim 64 or 128, kv_heads dividing heads, the same shapes on every rank.
    ``scale`` defaults to 1 / sqrt(head_dim). ``config`` overrides ``block_m``, ``block_n``, ``num_warps``,
    ``num_stages``, ``blocks_per_sm``, ``pieces`` and ``max_blocks`` (see ``plan``; without ``causal`` the tiles
    are limited to ``FULL_CHOICES``).
    """
    return attend_to_sequence(q, k, v, group, causal, scale, config)


def check_gathered(gathered, k, rank: int, op: str) -> None:
    if not isinstance(gathered, torch.Tensor):
        raise TypeError(f"{op}: gathered must be a torch.Tensor, got {type(gathered).__name__}")
    shape = (2, k.shape[0] * k.shape[1], k.shape[2], k.shape[3])
    if gathered.dim() != 5 or tuple(gathered.shape[1:]) != shape:
        raise ValueError(f"{op}: gathered must be [world_size, 2, batch * kv_heads, S_local, head_dim] = "
                         f"[world_size, {', '.join(map(str, shape))}], got {tuple(gathered.shape)}")
    if not 0 <= rank < gathered.shape[0]:
        raise ValueError(f"{op}: rank {rank} is not in 0 .. {gathered.shape[0] - 1}")
    groups.check_tensor(gathered, "gathered", op, (k.dtype,), ndim=5)
    if gathered.device != k.device:
        raise ValueError(f"{op}: gathered must be on {k.device}, got {gathered.device}")


@prepared.per_signature(lambda q, k, v, gathered, rank, op, causal, scale, config: (
    op, prepared.tensor_key(q), prepared.tensor_key(k), prepared.tensor_key(v), prepared.tensor_key(gathered), rank,
    prepared.scalar_key(causal), prepared.scalar_key(scale), prepared.config_key(config)))
def prepare_on_gathered(q, k, v, gathered, rank: int, op: str, causal: bool, scale,
                        config: dict) -> tuple[dict, torch.Tensor, Launcher]:
    """``attention_on_gathered``'s checks and plan, its (never read) flags and its launcher; kept per signature."""
    check_inputs(q, k, v, causal, scale, op)
    check_gathered(gathered, k, rank, op)
    world_size = gathered.shape[0]
    check_sizes(q, k, world_size, op)
    num_sms = torch.cuda.get_device_properties(q.device).multi_processor_count
    batch, heads, s_local, head_dim = q.shape
    cfg = plan(batch, heads, k.shape[1], s_local, head_dim, world_size, causal, config, num_sms)
    return cfg, progress_flags(progress_size(world_size, cfg["pieces"]), q.device), Launcher(op)


def on_gathered(q, k, v, gathered, rank: int, causal: bool, scale, config: dict, op: str = OP,
                attention=None) -> torch.Tensor:
    """``attention_on_gathered`` of the recipe (``attention`` None) or of the Helion twin: the flags' reset, my K/V
    staged, the attention kernels, replayed from one CUDA graph per pointer set (``graphs.graphed``)."""
    cfg, progress, launcher = prepare_on_gathered(q, k, v, gathered, rank, op, causal, scale, config)
    out = torch.empty_like(q)

    def run() -> None:
        reset_flags(progress)  # no flag is read here, but the causal kernels' count of tiles taken starts at 0
        if gathered.shape[0] > 1:  # the warp-specialized kernels read my K/V there (at one rank from ``k`` and ``v``)
            stage_own(k, v, gathered[rank, 0], gathered[rank, 1])
        (attention or launch_attention)(q, k, v, gathered, out, progress, rank, gathered.shape[0], causal, scale, False,
                                        **cfg, launcher=launcher)

    graphs.graphed((launcher, q.data_ptr(), k.data_ptr(), v.data_ptr(), gathered.data_ptr(), out.data_ptr()), run,
                   q.device)
    return out


def attention_on_gathered(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    gathered: torch.Tensor,
    rank: int,
    causal: bool = False,
    scale: float | None = None,
    **config,
) -> torch.Tensor:
    """The same attention kernel with every rank's K/V here already: no communication, no flag waits.

    ``gathered`` [world_size, 2, batch * kv_heads, S_local, head_dim]: rank r's k and v at ``[r, 0]`` and
    ``[r, 1]`` (any memory; with two or more ranks ``[rank]`` is overwritten with ``k`` and ``v``, which the
    warp-specialized kernel reads there; the causal kernel reads them from ``k`` and ``v``). Also attention on one GPU
    (world size 1: ``gathered`` [1, ...], the whole sequence in order, causal or not; not read: the kernels read ``k``
    and ``v`` in place). No process group.
    """
    return on_gathered(q, k, v, gathered, rank, causal, scale, config)
