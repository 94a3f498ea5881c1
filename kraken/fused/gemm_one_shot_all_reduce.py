"""GEMM + all-reduce: ``sum over ranks of a @ b`` in one kernel, in one of three forms.

The row-parallel linear layer of tensor parallelism: every rank holds a slice of
the reduction dimension, computes a partial product and the partials are summed.
The output is cut into ``BLOCK_M x BLOCK_N`` tiles. The persistent grid is
``groups x SPLIT_K`` blocks; group ``g`` takes tiles ``g, g + groups, ...``, one
per round (small M has too few tiles to keep the SMs streaming ``b``; splitting k
over the ``SPLIT_K`` blocks of a group keeps them busy). Block ``b`` of every rank:

1. GEMM, every round: the main loop of ``kraken._gemm_core`` (TMA loads, ``tl.dot`` into fp32);
2. with a k split, stores its fp32 partial, meets its group at a local barrier
   (the same CAS barrier as across GPUs, over pads in local memory), and sums its
   ``BLOCK_M / SPLIT_K`` rows of the tile over the group's partials;
3. stores those rows (the rank's partial, in ``out_dtype``) into its slot of chunk
   ``b`` of the symmetric workspace: with ``shot="push"``, into that slot on every rank, its
   own included (posted stores that drain over NVLink while the next round's GEMM runs);
   else only into its own;
4. after the last round, one barrier (release + acquire) with block ``b`` of every
   peer: "my partials are visible to you, yours to me". The workspace's signal pad is
   its own, so this is the epoch barrier: a posted store of the round number to each
   peer and a spin until theirs arrive, no compare-and-swap round trip (``epoch_sync``);
5. reduce, every round, in rank order (bitwise identical on every rank), in fp32:

   * ``"one"`` / ``"push"`` (one-shot): sums its rows over every rank's partial and writes
     ``out``: from every rank's chunk ``b`` (``"one"``), or all from its local chunk (``"push"``).
     Every rank reads ``world_size - 1`` whole partials;
   * ``"two"`` (two-shot): the block's rows are cut into ``shards`` (``world_size`` rounded up to a
     power of two) slices, slice ``j`` owned by rank ``j % world_size``. The block sums the slices it
     owns over every rank's partial and writes the sums over its own partial's rows (nobody else
     reads those rows of it); a second epoch barrier ("my sums are visible to you"); then it copies
     every slice, from its owner's chunk ``b``, into ``out``. Every rank reads ``(world_size - 1) /
     world_size`` of the output twice: at 8 ranks a quarter of what one-shot reads, for one more barrier.

With no k split at 1 or 2 ranks (``keeps_last``, one-shot only), the last round skips the round trip:
its partial goes only to the peer (pushed, or left in the workspace for it to pull) and stays in
registers through the barrier, where the block adds the peer's to it and writes ``out`` (two partials
sum the same in either order: still bitwise identical); then the earlier rounds are reduced as above.
At one rank the kernel then costs what its GEMM costs plus one barrier with itself, split (its send first, its wait
where it meets), and the earlier rounds' partials (M = 1024, 4096 x 4096: none); with no k split there, where no
block waits for another, the grid is one block per tile (``ONE_RANK_TILE_PER_BLOCK``), so there are no earlier
rounds.

Which form (``plan``; ``shot`` in ``config`` forces one): two-shot where the output is large enough for
its bytes to matter at 4-8 ranks (``ONE_SHOT_UP_TO``, by M x N output elements); else one-shot, pushing
for up to ``SKINNY_M`` rows at up to ``PUSH_MAX_WORLD_SIZE`` ranks. Pushing keeps the NVLink round trip of
remote loads out of the tail. At 4 ranks pushing to 3 peers is slower than pulling from them, so only 2
ranks push. The cost is memory, a slot per rank (``world_size`` times the output, twice), and registers:
an address per element and peer, which made the Helion twin spill on the 128x256 tiles of large M, where
the exchange is a small part of the time and the recipe pulls.

The workspace: a symmetric buffer viewed as [2, chunks, rounds, slots, BLOCK_M, BLOCK_N] (``rounds_of``,
``chunk_tile``), ``parity`` and ``epochs`` (int32 per block) and the buffer's own signal pad. No barrier at
the end: block ``b`` writes half ``parity[b]`` of its chunk and flips it, so the next launch writes the other
half while a peer may still be reading this one (the launch before that has finished on every rank: each
launch passes a barrier with every peer); its barrier rounds are numbered ``epochs[b] + 1, ...`` and advance
on the device.

The workspace holds partials in ``out_dtype``: fp32 partials for an fp32 output
(no rounding before the sum), bf16 partials for a bf16 output, which halves the
bytes crossing NVLink and rounds each partial once, as ``torch.matmul`` followed
by a bf16 all-reduce does. A k split sums its partials in fp32 first.

Layout: ``a`` [M, K] and ``b`` [K, N] contiguous, bf16 or fp16, the same shapes on every rank; ``out``
[M, N], bf16 or fp32. TMA needs 16-byte aligned rows: other operands are zero-padded copies
(``kraken._gemm_core.tma_operands``).

This file is the recipe: the kernel, ``plan`` (pure), ``launch`` (the seam the installed package's fast
path calls with its own ``launcher``) and a plain host function. ``kraken.gemm_one_shot_all_reduce`` is the
same kernel behind the product layer (``kraken.runtime.gemm_all_reduce``: checks agreed across ranks, the
choice between this fused form and cuBLAS then the SM all-reduce, prepared calls, a shared workspace).

    torchrun --nproc-per-node 2 kraken/fused/gemm_one_shot_all_reduce.py
"""

from __future__ import annotations

import math
import os
import time

import torch
import torch.distributed as dist
import torch.distributed._symmetric_memory as symm_mem
import torch.distributed.distributed_c10d as c10d
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from kraken._gemm_core import (
    SKINNY_M, TILE_CONFIGS, cdiv, mainloop, skinny_or_large_tiles, tile_coords, tma_operands,
)
from kraken._ptx_utils import barrier_blocks, epoch_send, epoch_sync, epoch_wait, symm_mem_sync

# Tiles: ``kraken._gemm_core.skinny_or_large_tiles``, and for this recipe: ``SKINNY_FILL`` of the SMs stream ``b``
# as fast as all of them, and pushing, half the blocks push, fence and meet half as often, so those tiles take no
# k split. Skinny tiles push at world size 2 (``PUSH_MAX_WORLD_SIZE``); at 4, pushing to 3 peers is slower than
# pulling from them, so they pull there. Larger M pulls, and at 4-8 ranks outputs above ``ONE_SHOT_UP_TO`` run
# two-shot, on the pulling tiles. With too few tiles for the SMs (small N), ``split_k`` cuts k so that tiles x
# split_k fills them (up to ``MAX_SPLIT_K``).
# Any key may be overridden per call. ``max_blocks`` None: one block per SM. ``shot``, ``split_k``, ``reduce_m``
# None: chosen.
SKINNY_FILL = 0.45
PUSH_MAX_WORLD_SIZE = 2
MAX_SPLIT_K = 4
MIN_K_TILES_PER_SPLIT = 4  # a split shorter than this spends more on its partial than it saves
MAX_WORLD_SIZE = 8  # one NVLink domain: the most ranks a k split's local barrier serves as parties too
DEFAULT_CONFIG = {**TILE_CONFIGS[0], "split_k": None, "reduce_m": None, "max_blocks": None, "shot": None}
OP = "gemm_one_shot_all_reduce"
ONE, PUSH, TWO = "one", "push", "two"  # one-shot pulling, one-shot pushing, two-shot (module docstring)
SHOTS = (ONE, PUSH, TWO)
# The largest output (M x N elements) that runs one-shot, by world size (a world size without an entry takes the
# next larger one's). One-shot reads ``world_size - 1`` whole partials, two-shot ``2 (world_size - 1) / world_size``
# of one for one more barrier: at 2 ranks as much, so never; at 4 and 8 from where those bytes outgrow a barrier
# (estimates at about 360 GB/s per peer read). ``kraken.runtime.crossover``'s ``gemm_all_reduce`` row, kept equal
# by a test.
ONE_SHOT_UP_TO = {1: math.inf, 2: math.inf, 4: 1 << 18, 8: 1 << 16}
# At one rank with no k split no block waits for another (its epoch barrier is with itself), so the grid need not
# be persistent: one block per tile, each keeping its only tile in registers through the barrier (``KEEP_LAST``), where
# a persistent grid sends all but its last tile through the workspace and back. The block ids stay within the pad's
# (the workspace keeps a parity and an epoch for each); more tiles than that keep the persistent grid.
ONE_RANK_TILE_PER_BLOCK = True
# The reduce tile holds about this many values per thread (fp32 sums, and loads from up to 4 ranks in flight).
REDUCE_VALUES_PER_THREAD = 64


@triton.jit
def store_rows(out_ptr, rows, cols, values, M, N):
    """``out[rows, cols] = values`` for the rows below M and the columns below N (a tile's tails)."""
    tl.store(out_ptr + (rows[:, None] * N + cols[None, :]), values.to(out_ptr.dtype.element_ty),
             mask=(rows[:, None] < M) & (cols[None, :] < N))


@triton.jit
def gemm_one_shot_all_reduce_kernel(
    a_desc,  # TMA descriptor of a [M, K], BLOCK_M x BLOCK_K boxes
    b_desc,  # TMA descriptor of b [K, N], BLOCK_K x BLOCK_N boxes
    partials_ptr,  # [blocks, 2, BLOCK_M, BLOCK_N] fp32, local: k-split partials, double buffered by round
    workspace_ptr,  # this rank's BlockWorkspace as [2, chunks, tiles per chunk, slots, BLOCK_M, BLOCK_N], out_dtype
    peers,  # tuple of world_size pointers, peers[r] = rank r's workspace
    parity_ptr,  # int32[chunks]: the half of the workspace block b writes in this launch
    epochs_ptr,  # int32[chunks]: the barrier rounds block b has completed
    out_ptr,  # [M, N]
    signal_pad_ptrs,
    split_pad_ptrs,  # local pads: the k-split group's barrier
    M,
    N,
    K,
    half_stride,  # workspace strides, in elements
    chunk_stride,
    num_groups,
    k_per_split,
    rank,
    world_size: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
    REDUCE_M: tl.constexpr,  # rows per reduce step: a slice of a tile, so world_size loads fit in registers
    PUSH: tl.constexpr,  # partials go to every rank's workspace (a slot per rank) or stay in mine (one slot)
    KEEP_LAST: tl.constexpr,  # 1: the last round's partial stays in registers through the barrier (``keeps_last``)
    SHARDS: tl.constexpr,  # two-shot: slices of the block's rows, slice j reduced by rank j % world_size; 1: one-shot
):
    TILE: tl.constexpr = BLOCK_M * BLOCK_N
    SLICE_M: tl.constexpr = BLOCK_M // SPLIT_K  # rows of each tile this block sums over the ranks
    SHARD_M: tl.constexpr = SLICE_M // SHARDS  # rows of each slice (two-shot), else the block's rows
    OWNED: tl.constexpr = (SHARDS + world_size - 1) // world_size if SHARDS > 1 else 1  # slices per rank
    SLOTS: tl.constexpr = world_size if PUSH else 1  # partials of a tile in one rank's chunk
    block = tl.program_id(0)
    group = block // SPLIT_K
    split = block % SPLIT_K
    parity = tl.load(parity_ptr + block)
    epoch = tl.load(epochs_ptr + block)
    chunk = parity.to(tl.int64) * half_stride + block.to(tl.int64) * chunk_stride  # a workspace can pass 2**31
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    k_begin = split * k_per_split
    k_end = tl.minimum(k_begin + k_per_split, K)
    cols = tl.arange(0, BLOCK_N)
    in_tile = tl.arange(0, BLOCK_M)[:, None] * BLOCK_N + cols[None, :]
    in_slice = (split * SLICE_M + tl.arange(0, SLICE_M))[:, None] * BLOCK_N + cols[None, :]

    num_tiles = tiles_m * tiles_n
    # A group of one that keeps its last tile in registers reads nothing through the barrier with itself: the
    # barrier is split, the send first, relaxed (nothing in this launch is written before it), so that only the wait
    # stands where the block meets.
    ALONE: tl.constexpr = world_size == 1 and KEEP_LAST == 1
    if ALONE:
        epoch_send(signal_pad_ptrs, block, rank, world_size, epoch + 1)
    # Every block of a group runs every round, so the split barriers stay paired even in a last round
    # that has no tile for some groups (their GEMM is empty and their stores fall outside ``out``).
    rounds = tl.cdiv(num_tiles, num_groups)
    for rnd in tl.range(0, rounds - KEEP_LAST):
        tile = group + rnd * num_groups
        tile_m, tile_n = tile_coords(tile, tiles_m, tiles_n, 1)  # row-major; past the last tile: m0 >= M
        m0 = tile_m * BLOCK_M
        n0 = tile_n * BLOCK_N
        acc = mainloop(a_desc, b_desc, m0, n0, k_begin, tl.where(tile < num_tiles, k_end, k_begin), BLOCK_M,
                       BLOCK_N, BLOCK_K, False)
        slots = chunk + rnd * SLOTS * TILE  # this round's slots in a chunk; mine is ``rank`` when pushing, else 0
        if SPLIT_K == 1:
            rows_of_mine = in_tile
            partial = acc.to(workspace_ptr.dtype.element_ty)
        else:
            scratch = partials_ptr + (rnd % 2) * TILE
            tl.store(scratch + block * 2 * TILE + in_tile, acc)
            # Every split's partial of this tile is visible to its whole group (local barrier).
            symm_mem_sync(split_pad_ptrs, group, split, SPLIT_K, hasPreviousMemAccess=True, hasSubsequentMemAccess=True)
            part = tl.zeros([SLICE_M, BLOCK_N], dtype=tl.float32)
            for s in tl.static_range(SPLIT_K):
                part += tl.load(scratch + (group * SPLIT_K + s) * 2 * TILE + in_slice)
            rows_of_mine = in_slice
            partial = part.to(workspace_ptr.dtype.element_ty)
        if PUSH:
            for r in tl.static_range(world_size):
                tl.store(peers[r] + slots + rank * TILE + rows_of_mine, partial)
        else:
            tl.store(workspace_ptr + slots + rows_of_mine, partial)
    if KEEP_LAST:
        # The last round's GEMM: my partial goes to the peer (pushed into its slot for me, or left in my
        # workspace for it to pull) and stays in registers through the barrier for my own sum (no round trip
        # through memory); the earlier rounds are reduced after it.
        last = rounds - 1
        last_tile = group + last * num_groups
        last_m, last_n = tile_coords(last_tile, tiles_m, tiles_n, 1)
        last_m0 = last_m * BLOCK_M
        last_n0 = last_n * BLOCK_N
        mine = mainloop(a_desc, b_desc, last_m0, last_n0, k_begin, tl.where(last_tile < num_tiles, k_end, k_begin),
                        BLOCK_M, BLOCK_N, BLOCK_K, False).to(workspace_ptr.dtype.element_ty)
        last_slots = chunk + last * SLOTS * TILE
        if world_size > 1:
            if PUSH:
                tl.store(tl.where(rank == 0, peers[1], peers[0]) + last_slots + rank * TILE + in_tile, mine)
            else:
                tl.store(workspace_ptr + last_slots + in_tile, mine)
        if ALONE:  # the send's wait (its thread barrier: the earlier rounds' partials, read below, are the block's)
            epoch_wait(signal_pad_ptrs, block, rank, world_size, epoch + 1)
        else:
            epoch_sync(signal_pad_ptrs, block, rank, world_size, epoch + 1)
        # At most 2 ranks: a + b == b + a, so both ranks' sums are bitwise the same (mine rounded as theirs is).
        last_sum = mine.to(tl.float32)
        if world_size > 1:
            if PUSH:
                theirs = workspace_ptr + last_slots + (1 - rank) * TILE + in_tile
            else:
                theirs = tl.where(rank == 0, peers[1], peers[0]) + last_slots + in_tile
            last_sum += tl.load(theirs).to(tl.float32)
        store_rows(out_ptr, last_m0 + tl.arange(0, BLOCK_M), last_n0 + cols, last_sum, M, N)
    else:
        # My partials are visible to every peer's block b, theirs (the same slices: same block id) to me.
        epoch_sync(signal_pad_ptrs, block, rank, world_size, epoch + 1)

    for rnd in tl.range(0, rounds - KEEP_LAST):
        tile = group + rnd * num_groups
        tile_m, tile_n = tile_coords(tile, tiles_m, tiles_n, 1)
        m0 = tile_m * BLOCK_M
        n0 = tile_n * BLOCK_N
        for t in tl.static_range(OWNED):
            # One-shot: the block's rows. Two-shot: slice ``shard`` of them, one of mine (rank, rank + world_size, ...).
            shard = rank + t * world_size if SHARDS > 1 else 0
            if t == 0 or shard < SHARDS:  # a world size that is no power of two owns unevenly
                for r0 in tl.static_range(0, SHARD_M, REDUCE_M):
                    rows = split * SLICE_M + shard * SHARD_M + r0 + tl.arange(0, REDUCE_M)
                    offsets = chunk + rnd * SLOTS * TILE + rows[:, None] * BLOCK_N + cols[None, :]
                    total = tl.zeros([REDUCE_M, BLOCK_N], dtype=tl.float32)
                    for r in tl.static_range(world_size):
                        if PUSH:
                            total += tl.load(workspace_ptr + offsets + r * TILE).to(tl.float32)
                        else:
                            total += tl.load(peers[r] + offsets).to(tl.float32)
                    if SHARDS > 1:
                        # Over my own partial of these rows: the peers read only the rows they own of it.
                        tl.store(workspace_ptr + offsets, total.to(workspace_ptr.dtype.element_ty))
                    else:
                        store_rows(out_ptr, m0 + rows, n0 + cols, total, M, N)
    if SHARDS > 1:
        # My sums are visible to every peer's block b, theirs to me: gather every slice from its owner (mine too,
        # from local memory: no branch between the loads, so they are all in flight at once).
        epoch_sync(signal_pad_ptrs, block, rank, world_size, epoch + 2)
        for rnd in tl.range(0, rounds):
            tile = group + rnd * num_groups
            tile_m, tile_n = tile_coords(tile, tiles_m, tiles_n, 1)
            m0 = tile_m * BLOCK_M
            n0 = tile_n * BLOCK_N
            for j in tl.static_range(SHARDS):
                for r0 in tl.static_range(0, SHARD_M, REDUCE_M):
                    rows = split * SLICE_M + j * SHARD_M + r0 + tl.arange(0, REDUCE_M)
                    owner = peers[j % world_size]
                    summed = tl.load(owner + chunk + rnd * TILE + rows[:, None] * BLOCK_N + cols[None, :])
                    store_rows(out_ptr, m0 + rows, n0 + cols, summed, M, N)
    # The next launch writes the other half: no "done reading" barrier needed (the module docstring).
    tl.store(parity_ptr + block, 1 - parity)
    tl.store(epochs_ptr + block, epoch + (2 if SHARDS > 1 else 1))


def keeps_last(split_k: int, world_size: int, out_dtype: torch.dtype, shot: str) -> int:
    """1 if the last round's partial stays in registers through the barrier (``KEEP_LAST``): one-shot, with no k
    split (a split sums slices of the tile, not the tile) and at most 2 ranks (where the sum of two partials is the
    same in either order), bf16 partials at 2 ranks (a whole fp32 tile of the peer's beside mine spills)."""
    one_shot = shot != TWO
    return int(one_shot and split_k == 1 and (world_size == 1 or (world_size == 2 and out_dtype.itemsize == 2)))


def shards_of(shot: str, world_size: int) -> int:
    """``SHARDS``: the slices a two-shot block cuts its rows into, ``world_size`` rounded up to a power of two
    (slice j is rank ``j % world_size``'s); 1 for one-shot."""
    return 1 << (world_size - 1).bit_length() if shot == TWO else 1


def one_shot_form(m: int, world_size: int) -> str:
    """One-shot's form for M rows: pushing up to ``SKINNY_M`` rows at up to ``PUSH_MAX_WORLD_SIZE`` ranks, else
    pulling."""
    return PUSH if m <= SKINNY_M and world_size <= PUSH_MAX_WORLD_SIZE else ONE


def choose_shot(m: int, n: int, world_size: int) -> str:
    """The form for an M x N output: two-shot above ``ONE_SHOT_UP_TO``'s entry for the world size (that of the
    smallest world size at or above it), else one-shot (``one_shot_form``)."""
    sizes = sorted(ONE_SHOT_UP_TO)
    if not 1 <= world_size <= sizes[-1]:
        raise ValueError(f"{OP}: no crossover for world size {world_size} (measured: {sizes})")
    if m * n > ONE_SHOT_UP_TO[min(ws for ws in sizes if ws >= world_size)]:
        return TWO
    return one_shot_form(m, world_size)


def default_config(m: int, n: int, k: int, num_sms: int, world_size: int, shot: str | None = None) -> dict:
    """This shape's form (``shot``, or ``choose_shot``) and tiles (``kraken._gemm_core.skinny_or_large_tiles``,
    narrower when pushing), with no k split for up to ``SKINNY_M`` rows if the tiles give ``SKINNY_FILL`` of
    the SMs a tile."""
    shot = choose_shot(m, n, world_size) if shot is None else shot
    # Pushing 64-row tiles takes them 64 wide (fewer pushes); a group of one pushes nothing: 32 wide, twice the
    # blocks streaming b.
    cfg = {**skinny_or_large_tiles(m, n, k, num_sms, shot == PUSH and world_size > 1), "shot": shot}
    if m <= SKINNY_M and cdiv(m, cfg["block_m"]) * cdiv(n, cfg["block_n"]) >= SKINNY_FILL * num_sms:
        cfg["split_k"] = 1
    return cfg


def split_k_for(num_tiles: int, k: int, block_k: int, max_blocks: int, max_split: int = MAX_SPLIT_K) -> int:
    """The largest power-of-two k split (<= ``max_split``) whose blocks all fit the grid at once and
    divide k's tiles evenly, at least ``MIN_K_TILES_PER_SPLIT`` each."""
    k_tiles, split = cdiv(k, block_k), 1
    while (
        2 * split <= max_split
        and num_tiles * 2 * split <= max_blocks
        and k_tiles % (2 * split) == 0
        and k_tiles // (2 * split) >= MIN_K_TILES_PER_SPLIT
    ):
        split *= 2
    return split


def reduce_rows(rows: int, block_n: int, num_warps: int, world_size: int) -> int:
    """Rows per reduce step: as many of ``rows`` as fit the register budget, so a slice is loaded (over
    NVLink when pulling) in as few round trips as possible."""
    budget = REDUCE_VALUES_PER_THREAD * 32 * num_warps
    while rows > 1 and rows * block_n * min(world_size, 4) > budget:
        rows //= 2
    return rows


def _power_of_two(value: int) -> bool:
    return value >= 1 and value & (value - 1) == 0


def plan(m: int, n: int, k: int, world_size: int, config: dict, num_sms: int, pad_bytes: int | None = None) -> dict:
    """The launch configuration (shared with the Helion twin).

    The grid is persistent: ``num_groups`` groups of ``split_k`` blocks, at most one block per SM
    and per block id the signal pad holds (``pad_bytes``; by default torch's pad size); group g owns tiles g,
    g + num_groups, ...; at one rank with no k split, one block per tile, one-shot (``ONE_RANK_TILE_PER_BLOCK``).
    """
    unknown = set(config) - set(DEFAULT_CONFIG)
    if unknown:
        raise TypeError(f"{OP}: unknown config keys {sorted(unknown)}; known: {sorted(DEFAULT_CONFIG)}")
    shot = config.get("shot")
    if shot is not None and shot not in SHOTS:
        raise ValueError(f"{OP}: shot must be one of {', '.join(map(repr, SHOTS))} (or absent: chosen by shape), "
                         f"got {shot!r}")
    pad_bytes = symm_mem.get_signal_pad_size() if pad_bytes is None else pad_bytes
    defaults = default_config(m, n, k, num_sms, world_size, shot)
    cfg = {**DEFAULT_CONFIG, **defaults, **config, "shot": defaults["shot"]}  # shot None: the chosen one
    shards = shards_of(cfg["shot"], world_size)
    for key in ("block_m", "block_n", "block_k"):
        if cfg[key] < 16 or not _power_of_two(cfg[key]):
            raise ValueError(f"{OP}: {key} must be a power of two >= 16, got {cfg[key]}")
    num_tiles = cdiv(max(m, 1), cfg["block_m"]) * cdiv(max(n, 1), cfg["block_n"])
    max_blocks = num_sms if cfg["max_blocks"] is None else min(cfg["max_blocks"], num_sms)
    max_blocks = max(1, min(num_sms, max_blocks, barrier_blocks(world_size, pad_bytes)))
    if cfg["split_k"] is None:  # two-shot: every rank's slice of the block's rows at least one row
        max_split = min(MAX_SPLIT_K, cfg["block_m"] // shards)
        cfg["split_k"] = split_k_for(num_tiles, k, cfg["block_k"], max_blocks, max_split)
    split = cfg["split_k"]
    if not _power_of_two(split) or split > min(MAX_WORLD_SIZE, cfg["block_m"] // shards, max_blocks):
        rows = "block_m" + (f" / {shards} (two-shot slices)" if shards > 1 else "")
        raise ValueError(f"{OP}: split_k must be a power of two <= min(8, {rows}, blocks), got {split}")
    shard_m = cfg["block_m"] // split // shards
    if cfg["reduce_m"] is None:
        cfg["reduce_m"] = reduce_rows(shard_m, cfg["block_n"], cfg["num_warps"], world_size)
    if not _power_of_two(cfg["reduce_m"]) or cfg["reduce_m"] > shard_m:
        what = "block_m / split_k" + (f" / {shards} (two-shot slices)" if shards > 1 else "")
        raise ValueError(f"{OP}: reduce_m must be a power of two <= {what} = {shard_m}, got {cfg['reduce_m']}")
    # Only where the kernel keeps its one tile in registers (``keeps_last``): two-shot sends every tile through its
    # block's chunk of the workspace, and there are chunks for one block per SM.
    solo = (ONE_RANK_TILE_PER_BLOCK and world_size == 1 and split == 1 and cfg["max_blocks"] is None
            and cfg["shot"] != TWO)
    if solo and num_tiles <= barrier_blocks(1, pad_bytes):
        num_groups = num_tiles  # one tile per block (``ONE_RANK_TILE_PER_BLOCK``)
    else:
        num_groups = min(num_tiles, max_blocks // split)
    keys = ("block_m", "block_n", "block_k", "split_k", "reduce_m", "shot", "num_warps", "num_stages")
    return {
        **{key: cfg[key] for key in keys},
        "num_blocks": num_groups * split,
        "num_groups": num_groups,
        "k_per_split": cdiv(cdiv(k, cfg["block_k"]), split) * cfg["block_k"],
    }


def rounds_of(m: int, n: int, cfg: dict) -> int:
    """Rounds of the persistent loop (``plan``'s ``cfg``): the tiles each group takes."""
    return cdiv(cdiv(m, cfg["block_m"]) * cdiv(n, cfg["block_n"]), cfg["num_groups"])


def chunk_tile(cfg: dict, world_size: int) -> tuple[int, int, int]:
    """What block ``b``'s chunk of the workspace holds per round (``plan``'s ``cfg``): [slots, BLOCK_M,
    BLOCK_N], a slot per rank's partial of the round's tile when pushing, else one for this rank's (two-shot:
    overwritten by the sums of the rows it owns)."""
    return (world_size if cfg["shot"] == PUSH else 1, cfg["block_m"], cfg["block_n"])


def triton_launch(kernel, grid: tuple[int, ...], *args, **meta):
    """``launch``'s default launcher: Triton's own ``kernel[grid](...)``."""
    return kernel[grid](*args, **meta)


def descriptor(tensor: torch.Tensor, block_shape: list[int]) -> TensorDescriptor:
    """A host TMA descriptor of ``tensor`` in ``block_shape`` boxes (zeros past its ends)."""
    return TensorDescriptor(tensor, tensor.shape, tensor.stride(), block_shape)


def launch(
    a: torch.Tensor,
    b: torch.Tensor,
    peers: tuple[torch.Tensor, ...],
    out: torch.Tensor,
    signal_pad_ptrs: int,
    rank: int,
    parity: torch.Tensor,
    epochs: torch.Tensor,
    partials: torch.Tensor,
    split_pad_ptrs: int,
    block_m: int,
    block_n: int,
    block_k: int,
    split_k: int,
    reduce_m: int,
    shot: str,
    num_warps: int,
    num_stages: int,
    num_blocks: int,
    num_groups: int,
    k_per_split: int,
    group_name: str = "",
    launcher=triton_launch,
) -> torch.Tensor:
    """Launch on planned arguments (no checks); the same signature as the Helion twin's ``launch``.

    ``peers`` are every rank's workspace viewed as [2, chunks, rounds, *chunk_tile], ``peers[rank]`` this rank's;
    ``partials`` fp32 [blocks, 2, BLOCK_M, BLOCK_N] local scratch for a k split (anything without one) and
    ``split_pad_ptrs`` the k-split group's local barrier pads (``local_barrier_pads``); ``group_name`` is unused
    here (Helion's ``hl.ProcessGroupName``). ``launcher``: Triton's own launch, or the installed package's.
    """
    m, n = out.shape
    a, b = tma_operands(a, b, block_m)  # a's rows zero-padded to whole tiles (``tma_operands`` says why)
    workspace = peers[rank]
    launcher(
        gemm_one_shot_all_reduce_kernel, (num_blocks,),
        descriptor(a, [block_m, block_k]), descriptor(b, [block_k, block_n]),
        partials, workspace, peers, parity, epochs, out, signal_pad_ptrs, split_pad_ptrs, m, n, a.shape[1],
        *workspace.stride()[:2], num_groups, k_per_split, rank, len(peers),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, SPLIT_K=split_k, REDUCE_M=reduce_m, PUSH=shot == PUSH,
        KEEP_LAST=keeps_last(split_k, len(peers), out.dtype, shot), SHARDS=shards_of(shot, len(peers)),
        num_warps=num_warps, num_stages=num_stages,
    )
    return out


def local_barrier_pads(num_blocks: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Signal pads for the k-split groups' barrier between blocks of one GPU, as ``symm_mem_sync`` takes them:
    a zeroed int32 pad per party (split), a slot per (block id, party), and the device array of their addresses
    (its ``data_ptr()`` is ``split_pad_ptrs``). The barrier resets its slots, so the pads serve every launch."""
    pads = torch.zeros(MAX_WORLD_SIZE, max(num_blocks, 1) * MAX_WORLD_SIZE, dtype=torch.int32, device=device)
    return pads, torch.tensor([row.data_ptr() for row in pads], dtype=torch.int64, device=device)


def block_workspace(m: int, n: int, cfg: dict, dtype: torch.dtype, device: torch.device,
                    group: dist.ProcessGroup) -> tuple:
    """A fresh symmetric workspace for ``plan``'s ``cfg`` on every rank of ``group`` (a collective): (every rank's
    workspace viewed as [2, num_blocks, rounds, *chunk_tile] as this rank sees it, the signal pads' pointer array,
    this rank, parity, epochs). Its pad is new, all zeros: the barrier rounds count from 1."""
    world_size = group.size()
    shape = (2, cfg["num_blocks"], rounds_of(m, n, cfg), *chunk_tile(cfg, world_size))
    buf = symm_mem.empty(math.prod(shape), dtype=dtype, device=device)
    handle = symm_mem.rendezvous(buf, group.group_name)
    peers = tuple(buf.view(shape) if r == handle.rank else handle.get_buffer(r, shape, dtype)
                  for r in range(handle.world_size))
    parity = torch.zeros(cfg["num_blocks"], dtype=torch.int32, device=device)
    return peers, handle.signal_pad_ptrs_dev, handle.rank, parity, torch.zeros_like(parity)


def gemm_one_shot_all_reduce(
    a: torch.Tensor,
    b: torch.Tensor,
    group: dist.ProcessGroup | str | None = None,
    out_dtype: torch.dtype = torch.float32,
    **config,
) -> torch.Tensor:
    """``sum over ranks of a @ b`` as a new [M, N] tensor of ``out_dtype`` (bf16 or fp32), by the fused kernel.

    The recipe spelled out: the plan (its form, ``shot``, and tiles; ``config`` overrides them), a symmetric
    workspace on every rank, the k split's local scratch and pads, one launch. It allocates and rendezvouses on
    every call and checks nothing; ``kraken.gemm_one_shot_all_reduce`` is the installed one (checks agreed across
    ranks, cuBLAS then the SM all-reduce where that is faster, prepared calls)."""
    group = dist.group.WORLD if group is None else group
    group = c10d._resolve_process_group(group) if isinstance(group, str) else group
    (m, k), n = a.shape, b.shape[1]
    num_sms = torch.cuda.get_device_properties(a.device).multi_processor_count
    cfg = plan(m, n, k, group.size(), config, num_sms)
    peers, signal_pad_ptrs, rank, parity, epochs = block_workspace(m, n, cfg, out_dtype, a.device, group)
    partials = torch.empty(cfg["num_blocks"] * 2 * cfg["block_m"] * cfg["block_n"] if cfg["split_k"] > 1 else 1,
                           dtype=torch.float32, device=a.device)
    pads, pad_ptrs = local_barrier_pads(cfg["num_blocks"], a.device)
    out = torch.empty(m, n, dtype=out_dtype, device=a.device)
    launch(a, b, peers, out, signal_pad_ptrs, rank, parity, epochs, partials, pad_ptrs.data_ptr(), **cfg)
    return out


def main(m: int = 256, n: int = 4096, k: int = 4096, iters: int = 20) -> None:
    """Check against ``torch.matmul`` and NCCL's all-reduce and time the kernel (``torchrun``, or alone)."""
    if "RANK" not in os.environ:  # run alone: a group of one
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT="29501")
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", device_id=device)
    rank, world_size = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(rank)
    a = (torch.randn(m, k, device=device) / k**0.5).to(torch.bfloat16)
    b = torch.randn(k, n, device=device).to(torch.bfloat16)
    expected = a.float() @ b.float()
    dist.all_reduce(expected)
    got = gemm_one_shot_all_reduce(a, b)
    torch.testing.assert_close(got, expected, rtol=1e-2, atol=1e-2 * world_size)

    cfg = plan(m, n, k, world_size, {}, torch.cuda.get_device_properties(device).multi_processor_count)
    peers, signal_pad_ptrs, rank, parity, epochs = block_workspace(m, n, cfg, torch.float32, device,
                                                                   dist.group.WORLD)
    partials = torch.empty(cfg["num_blocks"] * 2 * cfg["block_m"] * cfg["block_n"] if cfg["split_k"] > 1 else 1,
                           device=device)
    pads, pad_ptrs = local_barrier_pads(cfg["num_blocks"], device)
    out = torch.empty(m, n, device=device)
    args = (a, b, peers, out, signal_pad_ptrs, rank, parity, epochs, partials, pad_ptrs.data_ptr())
    for _ in range(3):  # warm up (compile)
        launch(*args, **cfg)
    dist.barrier()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(iters):
        launch(*args, **cfg)
    torch.cuda.synchronize()
    us = (time.perf_counter() - start) / iters * 1e6
    torch.testing.assert_close(out, expected, rtol=1e-2, atol=1e-2 * world_size)
    if rank == 0:
        print(f"gemm_one_shot_all_reduce: {m}x{n}x{k} bf16 -> fp32 x {world_size} ranks: matches matmul + NCCL, "
              f"{us:.1f} us per call (eager launches; {cfg})")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
