"""Context-parallel attention: a flash-attention forward that takes the peers' K/V as they land.

Every rank holds ``q``, ``k``, ``v`` [batch, heads, S_local, head_dim] for its part of a long sequence; its queries
attend to every rank's keys. Rather than an all-gather (or a ring of flash calls merged by log-sum-exp), one launch does
the whole attention, starting on its own K/V at once:

* K/V travel on the copy engine: this rank's ``k`` and ``v`` are staged into its chunk of a symmetric gather buffer
  [world_size, 2 (k, v), batch * kv_heads, S_local, head_dim]; on a side stream the ranks meet at a barrier, then every
  peer's K/V is copied in ``pieces`` (ranges of (batch, kv head) rows), piece-major and ``rank + 1`` first, each piece
  flagged as it lands (a stream memory operation, which fences the copy system-wide first); a last barrier says "done
  reading". No SM moves data, so attention blocks spinning on a flag cannot starve the copies. The installed
  ``kraken.context_parallel_attention`` runs this exchange (``kraken.runtime.attention``); this file's plain function
  copies every piece first and launches with no waits, the simpler form of the same exchange.
* The kernels are persistent (``RESERVED_SMS`` SMs' worth of slots left to the barrier kernel) and take the query
  tiles in the order of a host-built table (``tile_order``): piece by piece, so the first tiles need only the first
  pieces; under causal the tiles with the most keys first, so the blocks finish together. A tile keeps its
  online-softmax state (row max, row sum, fp32 accumulator) in registers across every rank's keys, its own first, then
  ``rank + 1``'s, ... Before a peer's piece it waits on the piece's flag: an acquire spin (pairing with the flag write
  after the copy), then the async-proxy fence, since K/V tiles load through TMA.
* Without ``causal``, ``full_attention_kernel``: a tile is one key loop over every rank's shard in the gather buffer
  (at one rank ``k`` and ``v``), through device-built TMA descriptors; its tile loop is warp-specialized (a producer
  warpgroup loads, two consumer warpgroups take 64 query rows each, as in FlashAttention-3), on a static schedule
  (block b takes tiles b, b + blocks, ...) and fixed tiles (``FULL_CHOICES``).
* With ``causal``, ``context_parallel_attention_kernel``: a dynamic schedule (the next tile from a count in memory); my
  K/V from ``k`` and ``v``, the peers' from the gather buffer. The keys a tile sees of each shard are a prefix of it
  (below): full key tiles run an unmasked loop, the prefix's last tile and the diagonal a masked one (values past a
  chunk's end zeroed: another head's rows, or a piece in flight). Triton 3.6 warp-specializes only one key loop per
  tile loop, so this kernel is not. At head_dim 128 (``SPLIT_HEAD_DIMS``) ``full_attention_kernel`` (``CAUSAL``) first
  takes the key tiles all of a tile's rows see and leaves each row's output and log2-sum-exp2, then this kernel
  (``MERGE``) runs the rest and merges (where no block waits on a flag, as a programmatic dependent launch).

``causal=True`` uses the load-balanced layout: the sequence is cut into ``2 * world_size`` equal chunks and rank r holds
chunks ``r`` and ``2 * world_size - 1 - r``, in that order (``shard_sequence``): every rank has the same work, and the
keys of one shard that a query row sees are a prefix: of its own shard, those up to its own position; of a peer's, none,
the first chunk or both. Without ``causal``, rank r holds the r-th ``1 / world_size`` of the sequence. GQA: ``k``, ``v``
may have fewer heads than ``q`` (a divisor). World size 1: the same kernels, whose peer loops have no step.

This file is the recipe: the kernels, the sequence layout, a pure ``plan``, ``launch_attention`` and a plain host
function; the tile orders the kernels read are building blocks (``kraken._blocks.attention``), shared with the twin.
``kraken.context_parallel_attention`` adds checks agreed across ranks, prepared calls, the overlapped exchange and CUDA
graphs.

    torchrun --nproc-per-node 2 kraken/fused/context_parallel_attention.py
"""

from __future__ import annotations

import math
import os
import time
import types

import torch
import torch.distributed as dist
import torch.distributed._symmetric_memory as symm_mem
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
from triton.runtime import _allocation
from triton.tools.tensor_descriptor import TensorDescriptor

from kraken._blocks.attention import _MASKED_SCORE, attend, full_order, softmax_step, tile_order
from kraken._ptx_utils import wait_async, wait_each_thread

OP = "context_parallel_attention"
INPUT_DTYPES = (torch.bfloat16, torch.float16)
HEAD_DIMS = (64, 128)
MAX_INDEX = 2**31 - 1  # element offsets are int32
LOG2E = 1.4426950408889634
# The kernel leaves this many SMs' worth of block slots free: its blocks spin on flags that follow the gather's
# one-block barrier kernel, which must find room on some SM while every attention block is resident.
RESERVED_SMS = 1
# Without causal at one rank no block waits: this many times the resident blocks, so the hardware hands a slow block's
# would-be last tiles to blocks that finish early (a persistent grid ends on its slowest block).
FULL_ONE_RANK_WAVES = 4
# Causal tiles per head_dim (``context_parallel_attention_kernel``) and the blocks resident per SM (``plan`` caps each
# thread's registers so that many fit, ``maxnreg``: else spinning blocks could wait on blocks never scheduled). Several
# 4-warp blocks of 64 rows per SM: a block's CTA barriers (around its TMA loads) hold only its own warps, so one
# block's softmax runs under another's GEMMs. With peers, head_dim 128 fits its registers only as one 8-warp block.
TILES = {
    64: {"block_m": 64, "block_n": 64, "num_warps": 4, "num_stages": 3, "blocks_per_sm": 3},
    128: {"block_m": 128, "block_n": 64, "num_warps": 8, "num_stages": 3, "blocks_per_sm": 1},
}
# At one rank head_dim 128 always splits (``SPLIT_HEAD_DIMS``): the second pass's tiles (1 or 2 key tiles a query tile).
ONE_RANK_TILES = {128: {"block_m": 64, "block_n": 64, "num_warps": 4, "num_stages": 1, "blocks_per_sm": 3}}
# Without causal (``full_attention_kernel``): ``num_warps`` 4 is the producer warpgroup; Triton adds two consumer
# warpgroups of BLOCK_M / 2 rows each (12 warps, one block per SM).
FULL_TILES = {d: {"block_m": 128, "block_n": 128, "num_warps": 4, "num_stages": 2, "blocks_per_sm": 1}
              for d in HEAD_DIMS}
# The configs the warp-specialized kernel takes (``plan`` refuses the rest): under Triton 3.6, 64-row tiles with 4
# warps fail to compile, two blocks per SM hung at 2 ranks, and 128 x 64 tiles at 3 stages gave NaN outputs.
FULL_CHOICES = {"block_m": (128,), "block_n": (64, 128), "num_warps": (4,), "num_stages": (2,), "blocks_per_sm": (1,)}
# Causal at these head_dims runs in two kernels (``plan``'s ``split_blocks``, the module docstring); head_dim 64 keeps
# the causal kernel alone (the split did not pay there).
SPLIT_HEAD_DIMS = (128,)
# At one rank, from this S_local on, the split's first kernel takes one block per tile, kv head by kv head (K/V shared
# in L2); shorter sequences run ``SPLIT_ONE_RANK_WAVES`` times the resident blocks, longest tiles first.
SPLIT_LONG = 16384
SPLIT_ONE_RANK_WAVES = 5
SM_REGISTERS, MAX_REGISTERS = 65536, 255  # registers per SM, and per thread at most
# ``pieces``: each peer's K/V is copied (and flagged) in up to this many ranges of (batch, kv head) rows; by default
# ``PIECE_BUDGET // world_size`` (at least 2): finer pieces start the first tiles sooner but cost the host more copies.
PIECE_BUDGET = 32
DEFAULT_CONFIG = {"block_m": None, "block_n": None, "num_warps": None, "num_stages": None, "blocks_per_sm": None,
                  "pieces": None, "max_blocks": None}


# The kernels (their key loops: ``kraken._blocks.attention``) --------------------------------------------------------


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
    """ONE key loop per tile over every rank's shard, warp-specialized (the module docstring). Triton 3.6 specializes it
    only for one key loop in the tile loop, with no branch in it, with descriptors built on the device (host-built ones
    hung, docs/helion-notes.md)."""
    # K and V load through descriptors of their own, over the same buffer: V's starts one K block later, so a V tile has
    # its K tile's coordinates. WHOLE: every tile lies inside one (rank, k|v, (batch, kv head)) shard of the buffer and
    # one (batch, head) of q and out, so K/V load as 2-D [BLOCK_N, HEAD_DIM] boxes and the output leaves through a TMA
    # store of the tile. Else K/V boxes are [1, BLOCK_N, HEAD_DIM] of one shard, so TMA fills the rows past its end with
    # zeros and no key tile reads another shard (of a piece that may be in flight), and the store keeps the shard's rows
    # (a pointer store).
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


# The sequence layout -------------------------------------------------------------------------------------------------


def shard_chunks(rank: int, world_size: int, causal: bool) -> tuple[int, ...]:
    """The chunks rank ``rank`` holds, in order: ``(rank,)``, or under causal ``(rank, 2 * world_size - 1 - rank)``."""
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


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def default_tiles(head_dim: int, world_size: int, causal: bool) -> dict:
    """``FULL_TILES`` without causal; under causal ``TILES``, or ``ONE_RANK_TILES`` at one rank where it has one."""
    if not causal:
        return FULL_TILES.get(head_dim, FULL_TILES[128])
    return (ONE_RANK_TILES if world_size == 1 else {}).get(head_dim) or TILES.get(head_dim, TILES[128])


def plan(batch: int, heads: int, kv_heads: int, s_local: int, head_dim: int, world_size: int, causal: bool,
         config: dict, num_sms: int) -> dict:
    """The launch configuration (``DEFAULT_CONFIG`` overridden by ``config``): a persistent grid of at most
    ``blocks_per_sm`` blocks per SM but ``RESERVED_SMS`` SMs' worth, never more blocks than query tiles (without causal
    at one rank ``FULL_ONE_RANK_WAVES`` times that); ``piece_rows``: the (batch, kv head) rows of each flagged piece."""
    unknown = set(config) - set(DEFAULT_CONFIG)
    if unknown:
        raise TypeError(f"{OP}: unknown config keys {sorted(unknown)}; known: {sorted(DEFAULT_CONFIG)}")
    cfg = {**DEFAULT_CONFIG, **config}
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
    piece_rows = cdiv(kv_rows, min(pieces, kv_rows))
    chunk = s_local // 2 if causal else s_local
    num_tiles = batch * heads * (2 if causal else 1) * cdiv(max(chunk, 1), cfg["block_m"])
    slots = cfg["blocks_per_sm"] * max(1, num_sms - RESERVED_SMS)
    if not causal and world_size == 1:  # no flag to wait for (``FULL_ONE_RANK_WAVES``)
        slots *= FULL_ONE_RANK_WAVES
    max_blocks = slots if cfg["max_blocks"] is None else max(1, min(cfg["max_blocks"], slots))
    num_blocks = max(1, min(num_tiles, max_blocks))
    # Causal at head_dim 128 (``SPLIT_HEAD_DIMS``): the warp-specialized kernel first, on ``FULL_TILES``, its grid
    # ``split_blocks`` as without causal; at one rank from ``SPLIT_LONG`` rows on, one block per tile.
    split_blocks = 0
    if causal and head_dim in SPLIT_HEAD_DIMS:
        split_tiles = batch * heads * 2 * cdiv(max(chunk, 1), FULL_TILES[head_dim]["block_m"])
        split_slots = FULL_TILES[head_dim]["blocks_per_sm"] * max(1, num_sms - RESERVED_SMS)
        if world_size == 1:
            split_slots = split_tiles if s_local >= SPLIT_LONG else split_slots * SPLIT_ONE_RANK_WAVES
        if cfg["max_blocks"] is not None:
            split_slots = max(1, min(cfg["max_blocks"], split_slots))
        split_blocks = max(1, min(split_tiles, split_slots))
    if world_size == 1 and cfg["pieces"] is None:
        # No peer piece to wait for: pieces only group the tiles that ``tile_order`` sorts longest first. Two tiles
        # per block in each, so the short tiles of one piece never end the launch while long ones remain.
        piece_rows = max(piece_rows, min(kv_rows, cdiv(2 * num_blocks, num_tiles // kv_rows)))
    keys = ("block_m", "block_n", "num_warps", "num_stages")
    return {**{key: cfg[key] for key in keys}, "maxnreg": register_cap(cfg["blocks_per_sm"], cfg["num_warps"]),
            "piece_rows": piece_rows, "pieces": cdiv(kv_rows, piece_rows), "num_blocks": num_blocks,
            "split_blocks": split_blocks}


def register_cap(blocks_per_sm: int, num_warps: int) -> int | None:
    """The registers per thread that let ``blocks_per_sm`` blocks of ``num_warps`` warps share an SM's register file
    (allocated per thread in units of 8), or None where the hardware's 255 per thread already do."""
    cap = SM_REGISTERS // (blocks_per_sm * num_warps * 32) // 8 * 8
    return None if cap >= MAX_REGISTERS else cap


def progress_size(world_size: int, pieces: int) -> int:
    """Slots of a launch's ``progress``: a flag per (rank, piece), then the count of tiles taken."""
    return world_size * pieces + 1


def lse_buffer(rows: int, device) -> torch.Tensor:
    """fp32 [rows]: the split's log2-sum-exp2 per query row, which the causal kernel's ``MERGE`` reads."""
    return torch.empty(rows, dtype=torch.float32, device=device)


# ``launch_attention``'s orders and lse buffer by default, built per call (the installed package keeps them per shape).
UNCACHED = types.SimpleNamespace(full_order=full_order, tile_order=tile_order, lse_buffer=lse_buffer)


def softmax_scale(scale: float | None, head_dim: int) -> float:
    """The scale of the scores (default 1 / sqrt(head_dim)) times log2(e): the kernel exponentiates with exp2."""
    return (1.0 / math.sqrt(head_dim) if scale is None else float(scale)) * LOG2E


def dependent_merge(wait: bool, world_size: int) -> bool:
    """Whether the causal kernel after the warp-specialized one (``MERGE``) is a programmatic dependent launch (its key
    loops on the SMs the first grid's tail leaves idle): where no block waits for a peer's piece, whose barrier kernel
    needs the SM its blocks would take."""
    return not (wait and world_size > 1)


def triton_launch(kernel, grid: tuple[int, ...], *args, **meta):
    """Triton's own ``kernel[grid](...)``, with torch memory for device-built TMA descriptors (for this launch only)."""
    token = _allocation._allocator.set(lambda size, align, stream: torch.empty(size, dtype=torch.int8, device="cuda"))
    try:
        return kernel[grid](*args, **meta)
    finally:
        _allocation._allocator.reset(token)


def launch_attention(q, k, v, gathered, out, progress, rank: int, world_size: int, causal: bool, scale, wait: bool,
                     block_m: int, block_n: int, num_warps: int, num_stages: int, maxnreg: int | None, piece_rows: int,
                     pieces: int, num_blocks: int, split_blocks: int, launcher=triton_launch,
                     tables=None) -> torch.Tensor:
    """The attention kernels on planned arguments (no checks): every rank's K/V from ``gathered`` [world_size, 2,
    batch * kv_heads, S_local, head_dim] (mine staged there; at one rank ``k`` and ``v``), waiting on ``progress``
    (``progress_size`` int32, zeroed) if ``wait`` (the module docstring says which kernels run). ``launcher(kernel,
    grid, *args, **meta)``: Triton's, or the installed package's; ``tables``: makes the tile orders and lse buffer."""
    tables = UNCACHED if tables is None else tables
    batch, heads, s_local, head_dim = q.shape
    kv_heads = k.shape[1]
    qk_scale = softmax_scale(scale, head_dim)
    split = causal and split_blocks > 0  # else the causal kernel alone, all keys
    full = FULL_TILES[head_dim] if split else {"block_m": block_m, "block_n": block_n, "num_warps": num_warps,
                                                "num_stages": num_stages}
    chunk = s_local // 2 if causal else s_local
    lse = tables.lse_buffer(q.numel() // head_dim, q.device) if split else out
    grid = split_blocks if split else num_blocks
    if not causal or split:
        order = tables.full_order(batch, heads, kv_heads, s_local, causal, full["block_m"], piece_rows, world_size,
                                  grid, q.device, rank, full["block_n"])
        # K/V: the gather buffer's K blocks and, from its first V block, its V blocks; at one rank my ``k`` and ``v``
        # (the buffer would hold a copy of them and nothing else).
        k_src, v_src = (k, v) if world_size == 1 else (gathered, gathered[0, 1])
        launcher(
            full_attention_kernel, (grid,),
            q, k_src, v_src, out, lse, progress, order, batch * heads * s_local, batch * kv_heads, s_local,
            order.shape[0], cdiv(s_local, full["block_n"]), pieces, qk_scale, rank, grid, world_size,
            CAUSAL=causal, WAIT=wait, WHOLE=chunk % full["block_m"] == 0,
            TAIL=not causal and s_local % full["block_n"] != 0,
            HEAD_DIM=head_dim, BLOCK_M=full["block_m"], BLOCK_N=full["block_n"], num_warps=full["num_warps"],
            num_stages=full["num_stages"], **({} if causal or maxnreg is None else {"maxnreg": maxnreg}),
        )
    if causal:
        order = tables.tile_order(batch * heads, heads // kv_heads, s_local, causal, block_m, piece_rows, q.device)
        boxes = zip((q, k, v, gathered), (block_m, block_n, block_n, block_n))  # host-built, over [rows, head_dim]
        q_desc, k_desc, v_desc, kv_desc = (TensorDescriptor.from_tensor(t.view(-1, head_dim), [rows, head_dim])
                                           for t, rows in boxes)
        launcher(
            context_parallel_attention_kernel, (num_blocks,),
            q_desc, k_desc, v_desc, kv_desc, out, lse, progress, order, heads, kv_heads, batch * kv_heads, s_local,
            pieces, qk_scale, rank, world_size, CAUSAL=causal, WAIT=wait, MERGE=split,
            SPLIT=full["block_m"] if split else block_n, HEAD_DIM=head_dim, BLOCK_M=block_m, BLOCK_N=block_n,
            num_warps=num_warps, num_stages=num_stages, **({} if maxnreg is None else {"maxnreg": maxnreg}),
            **({"launch_pdl": True} if split and dependent_merge(wait, world_size) else {}),
        )
    return out


def context_parallel_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                               group: dist.ProcessGroup | str | None = None, causal: bool = False,
                               scale: float | None = None, **config) -> torch.Tensor:
    """This rank's [batch, heads, S_local, head_dim] output of attention over the whole sequence; ``q``, ``k``, ``v``:
    this rank's shard of it (``shard_sequence``). The recipe spelled out: a symmetric gather buffer, my K/V staged into
    my chunk, a barrier, every peer's chunk copied (the copy engine reading the peer's buffer), a barrier ("done
    reading"), the kernels with no flag to wait for. It allocates and rendezvouses on every call and checks nothing."""
    group = dist.group.WORLD if group is None else group
    pg = dist.distributed_c10d._resolve_process_group(group) if isinstance(group, str) else group
    world_size = dist.get_world_size(pg)
    batch, heads, s_local, head_dim = q.shape
    kv_rows = batch * k.shape[1]
    shape = (world_size, 2, kv_rows, s_local, head_dim)
    gathered = symm_mem.empty(shape, dtype=k.dtype, device=k.device)
    handle = symm_mem.rendezvous(gathered, pg.group_name)
    rank = handle.rank
    gathered[rank, 0].copy_(k.view(kv_rows, s_local, head_dim))
    gathered[rank, 1].copy_(v.view(kv_rows, s_local, head_dim))
    handle.barrier()  # every rank's K/V is staged in its own buffer
    for peer in range(world_size):
        if peer != rank:  # the peer's own chunk of its buffer into my chunk ``peer``
            gathered[peer].copy_(handle.get_buffer(peer, shape, k.dtype)[peer])
    handle.barrier()  # done reading: every rank may stage into its buffer again
    num_sms = torch.cuda.get_device_properties(q.device).multi_processor_count
    cfg = plan(batch, heads, k.shape[1], s_local, head_dim, world_size, causal, config, num_sms)
    progress = torch.zeros(progress_size(world_size, cfg["pieces"]), dtype=torch.int32, device=q.device)
    return launch_attention(q, k, v, gathered, torch.empty_like(q), progress, rank, world_size, causal, scale, False,
                            **cfg)


def main(batch: int = 1, seq: int = 4096, heads: int = 8, kv_heads: int = 2, head_dim: int = 128, iters: int = 20):
    """Check against SDPA on the whole sequence, causal and not; time the plain function (``torchrun``, or alone)."""
    if "RANK" not in os.environ:  # run alone: a group of one
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT="29501")
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", device_id=device)
    rank, world_size = dist.get_rank(), dist.get_world_size()
    gen = torch.Generator(device=device).manual_seed(0)  # the same sequence on every rank
    for causal in (False, True):
        q_seq, k_seq, v_seq = (torch.randn(batch, h, seq, head_dim, device=device, generator=gen, dtype=torch.bfloat16)
                               for h in (heads, kv_heads, kv_heads))
        expected = torch.nn.functional.scaled_dot_product_attention(q_seq, k_seq, v_seq, is_causal=causal,
                                                                    enable_gqa=True)
        q, k, v = (shard_sequence(t, rank, world_size, causal) for t in (q_seq, k_seq, v_seq))
        got = context_parallel_attention(q, k, v, causal=causal)
        torch.testing.assert_close(got, shard_sequence(expected, rank, world_size, causal), rtol=2e-2, atol=2e-2)
        dist.barrier()
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(iters):
            context_parallel_attention(q, k, v, causal=causal)
        torch.cuda.synchronize()
        if rank == 0:
            print(f"context_parallel_attention: B{batch} S{seq} H{heads} Hkv{kv_heads} D{head_dim} causal={causal}, "
                  f"{world_size} ranks: matches SDPA, {(time.perf_counter() - start) / iters * 1e6:.0f} us per call "
                  "(allocation and rendezvous included)")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
