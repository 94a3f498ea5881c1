"""Helion twin of ``kraken/fused/context_parallel_attention.py``: the same kernels' algorithm, plan and arguments.

Its ``plan`` is the recipe's, copied (a CPU test keeps the two equal); the tile orders the kernels read are the
recipe's building blocks (``kraken._blocks.attention``). ``launch_attention`` has the recipe's signature and launches
these kernels through ``kraken._blocks.helion.run``; ``helion_ports.context_parallel_attention`` is the same product code as
``kraken.context_parallel_attention`` (``kraken.runtime.attention``: checks, prepared calls, the K/V exchange on the
copy engine, CUDA graphs) driving this ``launch_attention``. The two attention kernels mirror the recipe's two.

Causal (``context_parallel_attention_body``, the recipe's ``context_parallel_attention_kernel``):

* ``hl.grid(num_blocks)`` is the persistent grid; each block takes its next query tile from the count of
  tiles taken (``hl.atomic_add`` on the last slot of ``progress``, in a ``while`` loop) and reads it from
  the recipe's ``tile_order`` table: the recipe's dynamic schedule, longest tiles first;
* each query tile is a one-step ``hl.tile`` of ``block_m`` rows; the online-softmax state (row max, row
  sum, fp32 accumulator) lives across every key loop: ``hl.tile`` loops of ``block_n`` keys over my own
  K/V (from ``k``, ``v``), then, for ``rank + 1``, ``rank + 2``, ... (``hl.grid(world_size - 1)``), over the
  gather buffer; per rank the visible keys are a prefix of its shard, as the recipe: an unmasked loop over
  its full key tiles and a masked one for its last tile and the causal diagonal (their bounds are device
  values, so ``explicit_masks`` keeps Helion from masking them: the body masks what needs it, as the
  recipe). The sizes those bounds meet come from ``spans``, an int32 table on the device, not from host
  ints: Helion lowers a host int as an int64, and its products with the tile's fields held register pairs
  through the key loops;
* before a peer's keys, a block's first tile of each piece waits on the piece's flag with the recipe's
  PTX (``GMEM_WAIT_ASYNC``: acquire spin by one thread, thread barrier, every thread's async-proxy
  fence), pasted in with ``hl.inline_triton``;
* q, k, v and the gather buffer load through host-built tensor descriptors (TMA), the output is stored
  through pointers, masked to the chunk's rows. The gather buffer comes in twice, the second view
  starting at its first V block, so that a K row and its V row have the same index (one tile, two
  loads: Helion loads a tile at an offset index through pointers, not TMA).

Without causal (``full_attention_body``, the recipe's ``full_attention_kernel``): a static persistent schedule (block
b takes tiles b, b + num_blocks, ... of ``tile_order``) whose tile loop is warp-specialized
(``range_warp_specializes``, offered on sm_90 by ``warp_specialization``): a producer warpgroup issues the TMA loads,
two consumer warpgroups take half of the query rows each. One key loop per tile walks every rank's shard in the gather
buffer, mine staged there first (at one rank ``k`` and ``v`` in place); the flag waits are the recipe's per-thread
ones (``GMEM_WAIT_EACH_THREAD``), their 0 added into the loads' coordinates. The TMA loads are ``hl.inline_triton``
snippets on descriptors built on the device before the tile loop (docs/helion-notes.md says why).

The configs are explicit (``flat_kernel``): every tile loop names its block size (``block_m``, ``block_n``
from the recipe's ``plan``). Set ``HELION_PRINT_OUTPUT_CODE=1`` to see the generated Triton.
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
import time
import types

import helion
from helion._compiler.compile_environment import BlockSizeInfo, CompileEnvironment
import helion.language as hl
import helion.language.loops as helion_loops
import torch
import torch.distributed as dist
import torch.distributed._symmetric_memory as symm_mem
from triton.runtime import _allocation

from kraken._blocks.attention import full_order, tile_order
from kraken._blocks.helion import flat_kernel, run
from kraken._ptx_utils.inline_source import GMEM_WAIT_ASYNC, GMEM_WAIT_EACH_THREAD

# The plan: the recipe's, copied (``test/test_context_parallel_attention_cpu.py`` keeps the two equal; the recipe's
# comments say why each value) ------------------------------------------------------------------------------------

OP = "context_parallel_attention"
HEAD_DIMS = (64, 128)
LOG2E = 1.4426950408889634
RESERVED_SMS = 1
FULL_ONE_RANK_WAVES = 4
TILES = {
    64: {"block_m": 64, "block_n": 64, "num_warps": 4, "num_stages": 3, "blocks_per_sm": 3},
    128: {"block_m": 128, "block_n": 64, "num_warps": 8, "num_stages": 3, "blocks_per_sm": 1},
}
ONE_RANK_TILES = {128: {"block_m": 64, "block_n": 64, "num_warps": 4, "num_stages": 1, "blocks_per_sm": 3}}
FULL_TILES = {d: {"block_m": 128, "block_n": 128, "num_warps": 4, "num_stages": 2, "blocks_per_sm": 1}
              for d in HEAD_DIMS}
FULL_CHOICES = {"block_m": (128,), "block_n": (64, 128), "num_warps": (4,), "num_stages": (2,), "blocks_per_sm": (1,)}
SPLIT_HEAD_DIMS = (128,)
SPLIT_LONG = 16384
SPLIT_ONE_RANK_WAVES = 5
SM_REGISTERS, MAX_REGISTERS = 65536, 255
PIECE_BUDGET = 32
DEFAULT_CONFIG = {"block_m": None, "block_n": None, "num_warps": None, "num_stages": None, "blocks_per_sm": None,
                  "pieces": None, "max_blocks": None}


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def default_tiles(head_dim: int, world_size: int, causal: bool) -> dict:
    if not causal:
        return FULL_TILES.get(head_dim, FULL_TILES[128])
    return (ONE_RANK_TILES if world_size == 1 else {}).get(head_dim) or TILES.get(head_dim, TILES[128])


def plan(batch: int, heads: int, kv_heads: int, s_local: int, head_dim: int, world_size: int, causal: bool,
         config: dict, num_sms: int) -> dict:
    """The recipe's ``plan``: tiles, register cap, pieces, the persistent grids of both kernels."""
    unknown = set(config) - set(DEFAULT_CONFIG)
    if unknown:
        raise TypeError(f"{OP}: unknown config keys {sorted(unknown)}; known: {sorted(DEFAULT_CONFIG)}")
    cfg = {**DEFAULT_CONFIG, **config}
    defaults = default_tiles(head_dim, world_size, causal)
    cfg = {**cfg, **{key: cfg[key] if cfg[key] is not None else value for key, value in defaults.items()}}
    for key in ("block_m", "block_n"):
        if cfg[key] < 16 or cfg[key] & (cfg[key] - 1):
            raise ValueError(f"{OP}: {key} must be a power of two >= 16, got {cfg[key]}")
    if cfg["block_m"] % cfg["block_n"]:
        raise ValueError(f"{OP}: block_n must divide block_m (the causal diagonal starts at a query tile), "
                         f"got block_m={cfg['block_m']}, block_n={cfg['block_n']}")
    if isinstance(cfg["blocks_per_sm"], bool) or not isinstance(cfg["blocks_per_sm"], int) or cfg["blocks_per_sm"] < 1:
        raise ValueError(f"{OP}: blocks_per_sm must be an int >= 1, got {cfg['blocks_per_sm']!r}")
    if not causal:
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
    if not causal and world_size == 1:
        slots *= FULL_ONE_RANK_WAVES
    max_blocks = slots if cfg["max_blocks"] is None else max(1, min(cfg["max_blocks"], slots))
    num_blocks = max(1, min(num_tiles, max_blocks))
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
        piece_rows = max(piece_rows, min(kv_rows, cdiv(2 * num_blocks, num_tiles // kv_rows)))
    cap = SM_REGISTERS // (cfg["blocks_per_sm"] * cfg["num_warps"] * 32) // 8 * 8
    keys = ("block_m", "block_n", "num_warps", "num_stages")
    return {**{key: cfg[key] for key in keys}, "maxnreg": None if cap >= MAX_REGISTERS else cap,
            "piece_rows": piece_rows, "pieces": cdiv(kv_rows, piece_rows), "num_blocks": num_blocks,
            "split_blocks": split_blocks}


def progress_size(world_size: int, pieces: int) -> int:
    """Slots of a launch's ``progress``: a flag per (rank, piece), then the count of tiles taken."""
    return world_size * pieces + 1


def softmax_scale(scale: float | None, head_dim: int) -> float:
    """The scores' scale (default 1 / sqrt(head_dim)) times log2(e): the kernels exponentiate with exp2."""
    return (1.0 / math.sqrt(head_dim) if scale is None else float(scale)) * LOG2E


def dependent_merge(wait: bool, world_size: int) -> bool:
    """Whether the causal kernel after the warp-specialized one is a programmatic dependent launch (the recipe's)."""
    return not (wait and world_size > 1)


def lse_buffer(rows: int, device) -> torch.Tensor:
    return torch.empty(rows, dtype=torch.float32, device=device)


def shard_sequence(x: torch.Tensor, rank: int, world_size: int, causal: bool = False, dim: int = 2) -> torch.Tensor:
    """Rank ``rank``'s shard of the full sequence ``x`` (the recipe's layout: under causal chunks ``rank`` and
    ``2 * world_size - 1 - rank`` of ``2 * world_size``, else the ``rank``-th of ``world_size``)."""
    chunks = x.chunk(2 * world_size if causal else world_size, dim=dim)
    mine = (rank, 2 * world_size - 1 - rank) if causal else (rank,)
    return torch.cat([chunks[c] for c in mine], dim=dim).contiguous()


# A masked key's score is the recipe's ``MASKED_SCORE`` (-1e30), written as a literal in the body: Helion reads a
# module constant used in device code as ``_source_module.NAME`` after ``import helion_ports.fused.
# context_parallel_attention as _source_module``, which finds the package's re-exported function of that name,
# not this module (docs/helion-notes.md).
# The flag (a pointer expression in the snippet): progress + index.
WAIT_FLAG = GMEM_WAIT_ASYNC.replace("{flag}", "{progress} + {index}")


def indexing(merge: bool) -> tuple[str, ...]:
    """The causal body's loads and stores, in program order, through pointers (``order``'s fields, ``spans``, the
    store to out) or TMA (q, k, v and the gather buffer): the tile's first q row and first row in its chunk; q; my own
    K/V's spans, the tile's half and first row, then k and v of its unmasked and masked key loops; the peer's the same
    with the piece, the step's first row, its wrap and the second chunk's whole tiles; with ``merge`` the lse and
    output it resumes from; the store; the piece again (the block's last)."""
    pointer, tma = ("pointer",), ("tensor_descriptor",)
    own = pointer * 4 + tma * 4
    peer = pointer * 9 + tma * 4
    return pointer * 2 + tma + own + peer + (pointer + tma) * merge + pointer + pointer


def context_parallel_attention_body(
    q2: torch.Tensor,  # q as [batch * heads * S_local, head_dim]
    k2: torch.Tensor,  # my k as [batch * kv_heads * S_local, head_dim]
    v2: torch.Tensor,  # my v, the same
    kv_k: torch.Tensor,  # the gather buffer as rows [world_size * 2 * batch * kv_heads * S_local, head_dim]
    kv_v: torch.Tensor,  # the same buffer from its first V block: row i here is the V row of K row i of kv_k
    out2: torch.Tensor,  # [batch * heads * S_local, head_dim]
    lse: torch.Tensor,  # merge: fp32 [batch * heads * S_local], the warp-specialized body's log2-sum-exp2 per row
    progress: torch.Tensor,  # int32[world_size * pieces + 1]: the flags, then the count of tiles taken
    taken: torch.Tensor,  # progress[-1:], the count of tiles taken (its own argument: ptxas spilled its address)
    order: torch.Tensor,  # int32[num_tiles, 5]: the query tiles in the order blocks take them (the recipe's)
    spans: torch.Tensor,  # int32[world_size, 3]: the sizes the key loops meet (``spans``, in key tiles of ``split``)
    chunk: int,  # half of s_local
    qk_scale: float,
    num_blocks: int,
    world_size: hl.constexpr,
    wait: hl.constexpr,
    merge: hl.constexpr,  # resume from ``out2`` and ``lse``: only the key tiles the warp-specialized body left
    split: hl.constexpr,  # merge: its key tiles' size (and query tiles'), else block_n
    block_m: hl.constexpr,
    block_n: hl.constexpr,
) -> torch.Tensor:
    head_dim = hl.specialize(q2.size(1))
    # Sizes derived on the host arrive as arguments: Helion would otherwise spell each one out at every use.
    num_tiles = order.size(0)
    for block in hl.grid(num_blocks):
        # Dynamic schedule, as the recipe: the next tile of ``order`` when this block is done with its last one.
        tile = hl.atomic_add(taken, [0], 1)
        last_piece = tile * 0 - 1  # the piece of this block's previous tile (an int32 on the device, as the pieces)
        while tile < num_tiles:
            # The tile's fields, decoded on the host: its first row of q and first row in its chunk here; its half,
            # its kv head's first K/V row and its piece where they are used (held through the key loops, they made
            # ptxas spill). Every size they meet comes from ``spans`` (int32 on the device) too: Helion lowers a host
            # int as an int64, and each product with a field held two registers through the key loops.
            q_row0 = order[tile, 0]
            m0 = order[tile, 3]
            for tile_m, tile_d in hl.tile([q_row0, 0], [q_row0 + block_m, head_dim], block_size=[block_m, head_dim]):
                q = q2[tile_m, tile_d]
                offs_m = tile_m.index - (q_row0 - m0)  # query rows within the chunk
                m_i = hl.full([tile_m], -1.0e30, dtype=torch.float32)
                l_i = hl.zeros([tile_m], dtype=torch.float32)
                acc = hl.zeros([tile_m, tile_d], dtype=torch.float32)
                # My own K/V first, read where the caller keeps them: a prefix of my shard's keys, unmasked up to the
                # tile's first row (my chunks are in the sequence's order), the rest masked.
                span = spans[0, 0]  # chunk
                whole = spans[0, 1]  # its keys in whole key tiles
                half = order[tile, 2]
                full = half * whole + m0 // split * split
                hi = half * span + torch.minimum(m0 + block_m, span)
                limit = offs_m + half * span  # the last key each query row sees
                row0 = order[tile, 1]
                # The online-softmax step is written out in each of the four key loops (the recipe's ``attend``): a
                # Python helper called in a device loop does not lower in Helion 1.5 (docs/helion-notes.md, repro).
                for tile_n in hl.tile(row0, row0 + full * (1 - merge), block_size=block_n):
                    qk = hl.dot(q, k2[tile_n, tile_d].T, out_dtype=torch.float32)
                    m_ij = torch.maximum(m_i, torch.amax(qk, -1) * qk_scale)
                    p = torch.exp2(qk * qk_scale - m_ij[:, None])
                    alpha = torch.exp2(m_i - m_ij)
                    l_i = l_i * alpha + torch.sum(p, -1)
                    v = v2[tile_n, tile_d]
                    acc = hl.dot(p.to(v.dtype), v, acc=acc * alpha[:, None])
                    m_i = m_ij
                for tile_n in hl.tile(row0 + full, row0 + hi, block_size=block_n):
                    qk = hl.dot(q, k2[tile_n, tile_d].T, out_dtype=torch.float32)
                    cols = tile_n.index - row0
                    keep = (cols[None, :] <= limit[:, None]) & (cols[None, :] < hi)
                    qk = torch.where(keep, qk * qk_scale, -1.0e30)
                    m_ij = torch.maximum(m_i, torch.amax(qk, -1))
                    p = torch.exp2(qk - m_ij[:, None])
                    alpha = torch.exp2(m_i - m_ij)
                    l_i = l_i * alpha + torch.sum(p, -1)
                    # Rows past the chunk: another head's values, or a piece still in flight.
                    v = torch.where((cols < hi)[:, None], v2[tile_n, tile_d], 0.0)
                    acc = hl.dot(p.to(v.dtype), v, acc=acc * alpha[:, None])
                    m_i = m_ij
                # Then rank + 1's, rank + 2's, ... from the gather buffer, each once its piece has landed.
                for step in hl.grid(world_size - 1):
                    piece = order[tile, 4]  # (outside the branch: the same loads whether or not it waits)
                    flag = spans[1 + step, 2] + piece
                    if wait:
                        if piece != last_piece:  # this block's first tile of the piece: wait once per peer
                            hl.inline_triton(WAIT_FLAG, args={"progress": progress, "index": flag, "value": 1},
                                             output_like=None)
                    # A peer's keys are a prefix of its shard, masked only at its end. Its chunk src is visible to my
                    # query half 1, and to half 0 if src < rank (the step wrapped around); its second chunk to my
                    # query half 1 if src > rank: ``first`` and ``second`` (0 or 1; second implies first).
                    peer_span = spans[0, 0]
                    peer_whole = spans[0, 1]
                    wrapped = spans[1 + step, 1]
                    peer_half = order[tile, 2]
                    first = peer_half + (1 - peer_half) * wrapped
                    second = peer_half * (1 - wrapped)
                    peer_full = first * peer_whole + second * spans[0, 2]
                    peer_hi = (first + second) * peer_span
                    peer_row0 = spans[1 + step, 0] + order[tile, 1]  # K rows; V: kv_v, the same rows
                    for tile_n in hl.tile(peer_row0, peer_row0 + peer_full * (1 - merge), block_size=block_n):
                        peer_qk = hl.dot(q, kv_k[tile_n, tile_d].T, out_dtype=torch.float32)
                        peer_m_ij = torch.maximum(m_i, torch.amax(peer_qk, -1) * qk_scale)
                        peer_p = torch.exp2(peer_qk * qk_scale - peer_m_ij[:, None])
                        peer_alpha = torch.exp2(m_i - peer_m_ij)
                        l_i = l_i * peer_alpha + torch.sum(peer_p, -1)
                        peer_v = kv_v[tile_n, tile_d]
                        acc = hl.dot(peer_p.to(peer_v.dtype), peer_v, acc=acc * peer_alpha[:, None])
                        m_i = peer_m_ij
                    for tile_n in hl.tile(peer_row0 + peer_full, peer_row0 + peer_hi, block_size=block_n):
                        peer_qk = hl.dot(q, kv_k[tile_n, tile_d].T, out_dtype=torch.float32)
                        peer_cols = tile_n.index - peer_row0
                        peer_qk = torch.where(peer_cols[None, :] < peer_hi, peer_qk * qk_scale, -1.0e30)
                        peer_m_ij = torch.maximum(m_i, torch.amax(peer_qk, -1))
                        peer_p = torch.exp2(peer_qk - peer_m_ij[:, None])
                        peer_alpha = torch.exp2(m_i - peer_m_ij)
                        l_i = l_i * peer_alpha + torch.sum(peer_p, -1)
                        peer_v = torch.where((peer_cols < peer_hi)[:, None], kv_v[tile_n, tile_d], 0.0)
                        acc = hl.dot(peer_p.to(peer_v.dtype), peer_v, acc=acc * peer_alpha[:, None])
                        m_i = peer_m_ij
                if merge:
                    # Combined with the state the warp-specialized body left (its output normalized, its
                    # log2-sum-exp2), loaded only now, as the recipe's (rows past the chunk: discarded at the store),
                    # once that kernel's writes are visible: this one may launch while it runs (``GDC_WAIT``).
                    hl.inline_triton(GDC_WAIT, args={}, output_like=None)
                    earlier_lse = hl.load(lse, [tile_m], extra_mask=offs_m < chunk)
                    merged_m = torch.maximum(m_i, earlier_lse)
                    earlier = torch.exp2(earlier_lse - merged_m)
                    here = torch.exp2(m_i - merged_m)
                    acc = out2[tile_m, tile_d].to(torch.float32) * earlier[:, None] + acc * here[:, None]
                    l_i = earlier + l_i * here
                # Only the chunk's rows: a tile at a chunk's end also read some rows after it, discarded.
                hl.store(out2, [tile_m, tile_d], (acc / l_i[:, None]).to(out2.dtype),
                         extra_mask=(offs_m < chunk)[:, None])
            last_piece = order[tile, 4]
            tile = hl.atomic_add(taken, [0], 1)
    return out2


# Before the tile loop, the warp-specialized kernel's descriptors, built on the device as the recipe's (Triton 3.6
# specializes a tile loop on sm_90 only with TMA loads from device-built descriptors; docs/helion-notes.md): with
# ``whole`` tiles, 2-D K/V boxes and a TMA store of each output tile, else [1, block_n, head_dim] boxes of one shard
# (the recipe's ``WHOLE``). K and V through descriptors of their own, V's one K block later in the buffer, as the
# recipe's (faster than one descriptor for both).
Q_DESCRIPTOR = "q_desc = tl.make_tensor_descriptor({q2}, [{q_rows}, {d}], [{d}, 1], [{bm}, {d}])\n"
WHOLE_DESCRIPTORS = Q_DESCRIPTOR + "".join(
    f"{which}_desc = tl.make_tensor_descriptor({{{which}_src}}, [({{kv_blocks}} - {{kv_rows}}) * {{s_local}}, {{d}}], "
    "[{d}, 1], [{bn}, {d}])\n" for which in "kv"
) + "out_desc = tl.make_tensor_descriptor({out2}, [{q_rows}, {d}], [{d}, 1], [{bm}, {d}])"
SHARD_DESCRIPTORS = Q_DESCRIPTOR + "\n".join(
    f"{which}_desc = tl.make_tensor_descriptor({{{which}_src}}, [{{kv_blocks}} - {{kv_rows}}, {{s_local}}, {{d}}], "
    "[{s_local} * {d}, {d}, 1], [1, {bn}, {d}])" for which in "kv"
)
# A K or V tile (``{which}``: k or v): its (rank, k, batch and kv head) block and first key (Helion computes them in
# int64).
WHOLE_KV_LOAD = "{which}_desc.load([({row} * {s_local} + {start}).to(tl.int32), 0])"
SHARD_KV_LOAD = "{which}_desc.load([({row}).to(tl.int32), ({start}).to(tl.int32), 0]).reshape({bn}, {d})"
WHOLE_K_LOAD, WHOLE_V_LOAD = (WHOLE_KV_LOAD.replace("{which}", which) for which in "kv")
SHARD_K_LOAD, SHARD_V_LOAD = (SHARD_KV_LOAD.replace("{which}", which) for which in "kv")
WHOLE_STORE = "out_desc.store([({row0}).to(tl.int32), 0], {value})"
WAIT_EACH = GMEM_WAIT_EACH_THREAD.replace("{flag}", "{progress} + {index}")
# The recipe's programmatic dependent launch of the causal kernel after the warp-specialized one (its
# ``launch_attention``), with Triton's own griddepcontrol ops: Helion's ``hl.pdl_wait`` waits only at a kernel's entry,
# where the causal body must run its key loops first, and any ``hl.pdl_*`` op makes the kernel that holds it a dependent
# launch too (docs/helion-notes.md). ``run_capped`` launches the causal body with ``launch_pdl``.
GDC_LAUNCH_DEPENDENTS = "tl.extra.cuda.gdc_launch_dependents()"
GDC_WAIT = "tl.extra.cuda.gdc_wait()"


def full_attention_body(
    q2: torch.Tensor,  # q as [batch * heads * S_local, head_dim]
    k_src: torch.Tensor,  # the gather buffer [world_size, 2, batch * kv_heads, S_local, head_dim] (at one rank my k)
    v_src: torch.Tensor,  # the same from its first V block (at one rank my v): a V row has its K row's index
    out2: torch.Tensor,  # [batch * heads * S_local, head_dim]
    lse: torch.Tensor,  # causal: fp32 [batch * heads * S_local], each query row's log2-sum-exp2 of the scores seen here
    progress: torch.Tensor,  # int32[world_size * pieces + 1]: the flags
    order: torch.Tensor,  # int32[num_tiles, 5]: the query tiles in the order the blocks' rounds take them
    q_rows: int,  # batch * heads * S_local
    kv_blocks: int,  # world_size * 2 * batch * kv_heads: the gather buffer's blocks of S_local rows
    kv_rows: int,  # batch * kv_heads
    s_local: int,
    per_rank: int,  # key tiles per rank's shard
    pieces: int,
    qk_scale: float,
    rank: int,
    num_blocks: int,
    world_size: hl.constexpr,
    causal: hl.constexpr,  # only the key tiles every query row of the tile sees whole (the rest: the causal body's)
    wait: hl.constexpr,
    whole: hl.constexpr,  # a chunk is a whole number of query (so key) tiles: 2-D K/V boxes, TMA store
    tail: hl.constexpr,  # S_local is not a whole number of key tiles: mask the keys past it
    block_m: hl.constexpr,
    block_n: hl.constexpr,
) -> torch.Tensor:
    """The recipe's ``full_attention_kernel``: a static persistent schedule whose tile loop is warp-specialized
    (``range_warp_specializes``), one key loop per tile over every rank's shard (mine, then rank + 1's, ...), under
    causal only over the key tiles the tile's query rows all see. Its TMA loads are ``hl.inline_triton`` snippets on
    descriptors built on the device before the tile loop, as the recipe's: Helion's own tensor-descriptor loads of q and
    K/V either do not bind in this loop nest or are not specialized (docs/helion-notes.md)."""
    head_dim = hl.specialize(q2.size(1))
    num_tiles = order.size(0)
    chunk = s_local // 2 if causal else s_local
    later = world_size - 1 - rank  # peers after me; the other ``rank`` peers wrap around
    for block in hl.grid(num_blocks):
        hl.inline_triton(WHOLE_DESCRIPTORS if whole else SHARD_DESCRIPTORS,
                         args={"q2": q2, "k_src": k_src, "v_src": v_src, "out2": out2, "q_rows": q_rows,
                               "kv_blocks": kv_blocks, "kv_rows": kv_rows, "s_local": s_local, "d": head_dim,
                               "bm": block_m, "bn": block_n},
                         output_like=None)
        if causal:  # the causal body (``merge``) may launch now, as the recipe's (``GDC_LAUNCH_DEPENDENTS``)
            hl.inline_triton(GDC_LAUNCH_DEPENDENTS, args={}, output_like=None)
        for tile in hl.grid(block, num_tiles, num_blocks):  # block b: tiles b, b + num_blocks, ...
            q_row0 = order[tile, 0]
            kv_head = order[tile, 1] // s_local
            m0 = order[tile, 3]
            piece = order[tile, 4]
            if wait and world_size > 1:  # every peer's piece has landed (its 0 goes into the loads' coordinates)
                for peer in hl.static_range(1, world_size):
                    kv_head = kv_head + hl.inline_triton(
                        WAIT_EACH, args={"progress": progress, "index": (rank + peer) % world_size * pieces + piece,
                                         "value": 1}, output_like=piece)
            # Key tiles of each shard, as the recipe's: mine, each later peer's, each wrapped one's.
            if causal:
                half = order[tile, 2]
                n_own = half * (chunk // block_n) + m0 // block_n
                n_later = half * (s_local // block_n)
                n_wrapped = chunk // block_n + half * 0  # (``+ 0 * field``: a device value, as its siblings)
            else:
                n_own = per_rank + m0 * 0
                n_later = n_own
                n_wrapped = n_own
            end_later = n_own + later * n_later
            q = hl.inline_triton("q_desc.load([({row0}).to(tl.int32), 0])", args={"row0": q_row0},
                                 output_like=hl.zeros([block_m, head_dim], dtype=q2.dtype))
            # The pointer store's rows (without whole tiles) come from ``offs_m`` (m0, a field of its own), not from
            # q_row0 alone: under warp specialization the second consumer warpgroup then got q_row0 + 64 where q_row0
            # was meant, its rows 64 too far (the recipe's note; docs/helion-notes.md). The TMA store takes q_row0.
            offs_m = m0 + hl.arange(block_m)
            m_i = hl.full([block_m], -1.0e30, dtype=torch.float32)
            l_i = hl.zeros([block_m], dtype=torch.float32)
            acc = hl.zeros([block_m, head_dim], dtype=torch.float32)
            for tile_n in hl.tile(0, (end_later + rank * n_wrapped) * block_n, block_size=block_n):
                if world_size == 1:  # every key tile is mine (``+ 0 * kv_head``: a device value, see helion-notes)
                    src = rank
                    start = tile_n.begin + 0 * kv_head
                else:
                    i = tile_n.begin // block_n
                    j_later = i - n_own
                    j_wrapped = i - end_later
                    step_later = j_later // torch.clamp(n_later, min=1)
                    step_wrapped = j_wrapped // torch.clamp(n_wrapped, min=1)
                    src = (rank + torch.where(i < n_own, 0, torch.where(i < end_later, 1 + step_later,
                                                                         1 + later + step_wrapped))) % world_size
                    start = torch.where(i < n_own, i, torch.where(i < end_later, j_later - step_later * n_later,
                                                                  j_wrapped - step_wrapped * n_wrapped)) * block_n
                k_row = src * 2 * kv_rows + kv_head
                k = hl.inline_triton(WHOLE_K_LOAD if whole else SHARD_K_LOAD,
                                     args={"row": k_row, "start": start, "s_local": s_local, "bn": block_n,
                                           "d": head_dim},
                                     output_like=hl.zeros([block_n, head_dim], dtype=q2.dtype))
                qk = hl.dot(q, k.T, out_dtype=torch.float32)
                if tail:  # keys past the shard are TMA's zeros: score them out
                    cols = start + hl.arange(block_n)
                    qk = torch.where(cols[None, :] < s_local, qk * qk_scale, -1.0e30)
                    m_ij = torch.maximum(m_i, torch.amax(qk, -1))
                    p = torch.exp2(qk - m_ij[:, None])
                else:
                    m_ij = torch.maximum(m_i, torch.amax(qk, -1) * qk_scale)
                    p = torch.exp2(qk * qk_scale - m_ij[:, None])
                alpha = torch.exp2(m_i - m_ij)
                l_i = l_i * alpha + torch.sum(p, -1)
                v = hl.inline_triton(WHOLE_V_LOAD if whole else SHARD_V_LOAD,
                                     args={"row": k_row, "start": start, "s_local": s_local, "bn": block_n,
                                           "d": head_dim},
                                     output_like=hl.zeros([block_n, head_dim], dtype=q2.dtype))
                acc = hl.dot(p.to(v.dtype), v, acc=acc * alpha[:, None])
                m_i = m_ij
            rows = q_row0 - m0 + offs_m
            if causal:  # the state the causal body resumes from (a row that saw no key here: 0 and -inf)
                hl.store(lse, [rows], m_i + torch.log2(l_i), extra_mask=offs_m < chunk)
                result = acc / torch.where(l_i > 0, l_i, 1.0)[:, None]
            else:
                result = acc / l_i[:, None]
            if whole:
                hl.inline_triton(WHOLE_STORE, args={"row0": q_row0, "value": result.to(out2.dtype)}, output_like=None)
            else:  # only the chunk's rows: a tile at its end also read some rows after it, discarded
                hl.store(out2, [rows, hl.arange(head_dim)], result.to(out2.dtype), extra_mask=(offs_m < chunk)[:, None])
    return out2

@contextlib.contextmanager
def explicit_masks():
    """While Helion generates this twin's kernel: no tile loop gets a bounds mask. Every bound here is a device value
    (the tile comes from the count of tiles taken, its rows from ``order``), so Helion 1.5 cannot prove any extent a
    multiple of its block and would mask every tile loop: a select per score before the row max and the row sum, and
    the query rows' mask in every key loop (the dynamic twin's 4-warp kernel took 244 registers to the static one's
    165). The body masks what needs it itself, as the recipe: the keys past a chunk's end or the diagonal (``keep``,
    and their values zeroed), the query rows past the chunk at the store (``extra_mask``); a query tile is exactly
    ``block_m`` rows and an unmasked key loop a whole number of tiles, and TMA fills rows past a tensor with zeros.
    Only this twin's compile sees it; other kernels keep Helion's rule."""
    plain = BlockSizeInfo.known_multiple
    BlockSizeInfo.known_multiple = lambda info, block_size: True
    try:
        yield
    finally:
        BlockSizeInfo.known_multiple = plain


@contextlib.contextmanager
def warp_specialization():
    """While Helion binds the warp-specialized kernel: ``range_warp_specializes`` offered on sm_90. Helion 1.5.0 offers
    it only where the device's capability is (10, 0) or more (``helion.language.loops._supports_warp_specialize``),
    where Triton 3.6 specializes an sm_90 tile loop too (the recipe's ``full_attention_kernel``); and the CPU tests
    compile for sm_90 with no GPU. Only this twin's bind sees it; the setting ``allow_warp_specialize`` still rules."""
    plain = helion_loops._supports_warp_specialize

    helion_loops._supports_warp_specialize = lambda: CompileEnvironment.current().settings.allow_warp_specialize
    try:
        yield
    finally:
        helion_loops._supports_warp_specialize = plain


@functools.cache
def compiled(causal: bool, merge: bool, block_m: int, block_n: int, num_warps: int, num_stages: int) -> helion.Kernel:
    """One Helion kernel per config, each with an explicit config (``pid_type="flat"``: the recipe's grid, see
    ``helion_ports``). Causal: every tile loop names its block size, TMA for q, k, v and the gather buffer through
    descriptors built on the host, as the recipe's. Without: ``full_attention_body`` with its tile loop (the second
    of its loops) warp-specialized, the order table through pointers (and the store where tiles are not whole)."""
    if not causal:
        return flat_kernel(full_attention_body, (), num_warps, num_stages, indexing="pointer",
                           range_warp_specializes=(None, True, None))
    return flat_kernel(context_parallel_attention_body, (), num_warps, num_stages, indexing=indexing(merge),
                       host_tensor_descriptors=True)


def run_capped(kernel: helion.Kernel, args: tuple, launcher, maxnreg: int | None, launch_pdl: bool = False):
    """``kraken._blocks.helion.run`` with the recipe's register cap (``plan``'s ``maxnreg``, where several blocks share an SM)
    given to Triton, and with ``launch_pdl`` as a programmatic dependent launch. Helion 1.5.0 takes ``maxnreg`` only
    with its persistent pid types (``flat`` here, see ``helion_ports``), so the cap goes into the launch itself: the
    bound kernel's generated host code launches through the ``_launcher`` it is given, and a Triton launch compiles for
    the ``maxnreg`` and ``launch_pdl`` among its keywords. Even the first call launches so (it compiles the config, then
    launches capped): an uncapped kernel could fit fewer blocks per SM than the grid counts on."""
    options = {} if maxnreg is None else {"maxnreg": maxnreg}
    if launch_pdl:
        options["launch_pdl"] = True
    if not options:
        return run(kernel, args, launcher)
    launcher = triton_launch if launcher is None else launcher

    def capped(triton_kernel, grid, *kernel_args, **meta):
        return launcher(triton_kernel, grid, *kernel_args, **meta, **options)

    kept = getattr(launcher, "bound", None)  # a prepared call's Launcher keeps its bound kernel
    bound = kept.get(id(kernel)) if kept is not None else None
    if bound is None:
        bound = kernel.bind(args)
        bound.ensure_config_exists(args)
        if kept is not None:
            kept[id(kernel)] = bound
    return bound._run(*args, _launcher=capped)


def spans(chunk: int, block_n: int, kv_block: int, rank: int, world_size: int, pieces: int, device) -> torch.Tensor:
    """The sizes the kernel's key loops meet, as int32 on ``device``: row 0 (``chunk``, its keys in whole key tiles of
    ``block_n``, the more whole tiles that two chunks have), then per peer step (rank + 1 + step: the first row of its
    K in the gather buffer, whose blocks are ``kv_block`` rows; 1 if the step wrapped around past the last rank; the
    index of its first piece's flag in ``progress``)."""
    whole, both = chunk // block_n * block_n, 2 * chunk // block_n * block_n
    rows = [(chunk, whole, both - whole)]
    rows += [(src % world_size * 2 * kv_block, src // world_size, src % world_size * pieces)
             for src in range(rank + 1, rank + world_size)]
    return torch.tensor(rows, dtype=torch.int32).to(device)


# ``launch_attention``'s orders, lse buffer and span tables by default, built per call (the installed package keeps
# them per shape: ``kraken.runtime.attention``).
UNCACHED = types.SimpleNamespace(full_order=full_order, tile_order=tile_order, lse_buffer=lse_buffer, spans=spans)


@contextlib.contextmanager
def scratch():
    """Triton's allocator set to torch memory while a plain call launches: the warp-specialized body builds its TMA
    descriptors on the device (in global scratch)."""
    token = _allocation._allocator.set(lambda size, align, stream: torch.empty(size, dtype=torch.int8, device="cuda"))
    try:
        yield
    finally:
        _allocation._allocator.reset(token)


def triton_launch(kernel, grid: tuple[int, ...], *args, **meta):
    """Triton's own ``kernel[grid](...)``: a plain call's launcher of the capped kernels (inside ``scratch``)."""
    return kernel[grid](*args, **meta)


def launch_attention(q, k, v, gathered, out, progress, rank: int, world_size: int, causal: bool, scale, wait: bool,
                     block_m: int, block_n: int, num_warps: int, num_stages: int, maxnreg: int | None, piece_rows: int,
                     pieces: int, num_blocks: int, split_blocks: int, launcher=None, tables=None) -> torch.Tensor:
    """The attention kernels alone; mirrors the recipe's ``launch_attention`` (its orders and its split). ``launcher``:
    None for a plain call, or the installed package's; ``tables``: makes the orders, lse buffer and span tables."""
    if launcher is None:  # a plain call: Helion's own launch (``run``), with Triton's scratch in torch memory
        with scratch():
            return launch_attention(q, k, v, gathered, out, progress, rank, world_size, causal, scale, wait, block_m,
                                    block_n, num_warps, num_stages, maxnreg, piece_rows, pieces, num_blocks,
                                    split_blocks, triton_launch, tables)
    tables = UNCACHED if tables is None else tables
    batch, heads, s_local, head_dim = q.shape
    kv_heads = k.shape[1]
    qk_scale = softmax_scale(scale, head_dim)
    split = causal and split_blocks > 0
    full = FULL_TILES[head_dim] if split else {"block_m": block_m, "block_n": block_n, "num_warps": num_warps,
                                                "num_stages": num_stages}
    chunk = s_local // 2 if causal else s_local
    lse = tables.lse_buffer(q.numel() // head_dim, q.device) if split else out.view(-1)
    if not causal or split:
        grid = split_blocks if split else num_blocks
        order = tables.full_order(batch, heads, kv_heads, s_local, causal, full["block_m"], piece_rows, world_size,
                                  grid, q.device, rank, full["block_n"])
        k_src, v_src = (k, v) if world_size == 1 else (gathered, gathered[0, 1])
        args = (q.view(-1, head_dim), k_src, v_src, out.view(-1, head_dim), lse, progress, order,
                batch * heads * s_local, gathered.shape[0] * 2 * batch * kv_heads, batch * kv_heads, s_local,
                cdiv(s_local, full["block_n"]), pieces, qk_scale, rank, grid, world_size, causal, wait,
                chunk % full["block_m"] == 0, not causal and s_local % full["block_n"] != 0, full["block_m"],
                full["block_n"])
        kernel = compiled(False, False, full["block_m"], full["block_n"], full["num_warps"], full["num_stages"])
        with explicit_masks(), warp_specialization():
            run_capped(kernel, args, launcher, None if causal else maxnreg)
    if not causal:
        return out
    order = tables.tile_order(batch * heads, heads // kv_heads, s_local, causal, block_m, piece_rows, q.device)
    rows = gathered.view(-1, head_dim)
    args = (
        q.view(-1, head_dim), k.view(-1, head_dim), v.view(-1, head_dim), rows, rows[batch * kv_heads * s_local:],
        out.view(-1, head_dim), lse, progress, progress[world_size * pieces:], order,
        tables.spans(chunk, full["block_m"] if split else block_n, batch * kv_heads * s_local, rank, world_size,
                     pieces, q.device), chunk, qk_scale, num_blocks, world_size, wait, split, full["block_m"] if split else block_n,
        block_m, block_n,
    )
    with explicit_masks():  # (a warm call launches the bound kernel: nothing is generated, nothing changes)
        run_capped(compiled(True, split, block_m, block_n, num_warps, num_stages), args, launcher, maxnreg,
                   split and dependent_merge(wait, world_size))
    return out


def context_parallel_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                               group: dist.ProcessGroup | str | None = None, causal: bool = False,
                               scale: float | None = None, **config) -> torch.Tensor:
    """This rank's output of attention over the whole sequence, spelled out as the recipe's plain function: a
    symmetric gather buffer, my K/V staged, a barrier, every peer's chunk copied, a barrier, then these kernels with
    no flag to wait for. It allocates and rendezvouses on every call and checks nothing."""
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
        if peer != rank:
            gathered[peer].copy_(handle.get_buffer(peer, shape, k.dtype)[peer])
    handle.barrier()  # done reading
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
            print(f"helion context_parallel_attention: B{batch} S{seq} H{heads} Hkv{kv_heads} D{head_dim} "
                  f"causal={causal}, {world_size} ranks: matches SDPA, "
                  f"{(time.perf_counter() - start) / iters * 1e6:.0f} us per call (allocation and rendezvous included)")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
