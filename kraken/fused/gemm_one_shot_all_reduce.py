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
its bytes to matter at 4-8 ranks (``kraken.runtime.crossover``, the ``gemm_all_reduce`` row, by M x N);
else one-shot, pushing for up to ``SKINNY_M`` rows at up to ``PUSH_MAX_WORLD_SIZE`` ranks. Pushing
keeps the NVLink round trip of remote loads out of the tail (M = 64 on 2 H200s: 13.9 us against 14.8
for the best tiles pulling). At 4 ranks pushing to 3 peers was slower than pulling from them, so
only 2 ranks push. The cost is memory, a slot per rank (``world_size`` times the output, twice), and
registers: an address per element and peer, which made the Helion twin spill on the 128x256 tiles
of large M, where the exchange is a small part of the time and the recipe pulls. No barrier at the
end: the workspace is a ``symm.BlockWorkspace``, so the next launch writes the other half while a
peer may still be reading this one.

The workspace holds partials in ``out_dtype``: fp32 partials for an fp32 output
(no rounding before the sum), bf16 partials for a bf16 output, which halves the
bytes crossing NVLink and rounds each partial once, as ``torch.matmul`` followed
by a bf16 all-reduce does. A k split sums its partials in fp32 first.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
import triton
import triton.language as tl

from kraken._gemm_core import (  # noqa: F401 (OUT_DTYPES, SKINNY_M: this recipe's, used by tests)
    OUT_DTYPES, SKINNY_M, TILE_CONFIGS, mainloop, skinny_or_large_tiles, tile_coords, tma_operands,
)
from kraken._ptx_utils import epoch_send, epoch_sync, epoch_wait, symm_mem_sync
from kraken.runtime.collectives import all_reduce as sm_all_reduce
from kraken.runtime import agreement, crossover, groups, prepared, symm
from kraken.runtime.gemm_checks import check_inputs
from kraken.runtime.launcher import Launcher, jit_launch, tma_operand
from kraken.runtime.replay import prepared_launch

# Tiles: ``kraken._gemm_core.skinny_or_large_tiles`` (swept on 2x H200, ``probe`` runs of the recipe and its
# twin, ``python -m benchmark.tune``), and for this recipe: ``SKINNY_FILL`` of the SMs stream ``b`` as fast as all of
# them (M = 64: 64x64 tiles on 64 SMs, 10.5 us; 64x32 on 128, 10.4), and pushing, half the blocks push,
# fence and meet half as often (13.9 us against 14.3 for the whole fused kernel), so those tiles take no
# k split. Skinny tiles push at world size 2 (``PUSH_MAX_WORLD_SIZE``); at 4, pushing to 3 peers was
# slower than pulling from them (M = 256: 53.8 us against 42.3), so they pull there.
# Larger M pulls, and at 4-8 ranks outputs above ``kraken.runtime.crossover``'s ``gemm_all_reduce`` entry run two-shot,
# on the pulling tiles. With too few tiles for the SMs (small N), ``split_k`` cuts k so that tiles x split_k
# fills them (up to ``MAX_SPLIT_K``).
# Any key may be overridden per call. ``max_blocks`` None: one block per SM. ``shot``, ``split_k``, ``reduce_m``
# None: chosen.
SKINNY_FILL = 0.45
PUSH_MAX_WORLD_SIZE = 2
MAX_SPLIT_K = 4
MIN_K_TILES_PER_SPLIT = 4  # a split shorter than this spends more on its partial than it saves
DEFAULT_CONFIG = {**TILE_CONFIGS[0], "split_k": None, "reduce_m": None, "max_blocks": None, "shot": None}
OP = "gemm_one_shot_all_reduce"
ONE, PUSH, TWO = "one", "push", "two"  # one-shot pulling, one-shot pushing, two-shot (module docstring)
SHOTS = (ONE, PUSH, TWO)
# At one rank with no k split no block waits for another (its epoch barrier is with itself), so the grid need not
# be persistent: one block per tile, each keeping its only tile in registers through the barrier (``KEEP_LAST``), where
# a persistent grid sends all but its last tile through the workspace and back (one H200, CUDA graphs, bf16 out, x
# cuBLAS, against HEAD in one process: 2048x4096x4096 1.106-1.108 -> 1.078-1.079, 8192x4096x4096 1.126-1.129 -> 1.079;
# 1024 rows, one tile per SM already, 1.060-1.063 either way). The block ids stay within the pad's
# (``symm.BlockWorkspace`` keeps a parity and an epoch for each); more tiles than that keep the persistent grid.
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
    epochs_ptr,  # int32[chunks]: the barrier rounds block b has completed (symm.BlockWorkspace)
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
    # stands where the block meets (64-256 rows x 4096 x 4096 on one H200, x cuBLAS: 1.19-1.25 -> 1.10-1.18).
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
    # The next launch writes the other half: no "done reading" barrier needed (symm.BlockWorkspace).
    tl.store(parity_ptr + block, 1 - parity)
    tl.store(epochs_ptr + block, epoch + (2 if SHARDS > 1 else 1))


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
    launcher=jit_launch,
) -> torch.Tensor:
    """Launch on prepared arguments (no checks); the same signature as the Helion port's ``launch``.

    ``peers`` are every rank's workspace as ``prepare`` views it, ``peers[rank]`` this rank's;
    ``group_name`` is unused here (Helion's ``hl.ProcessGroupName``).
    """
    m, n = out.shape
    a, b = tma_operands(a, b, block_m)  # a's rows zero-padded to whole tiles (``tma_operands`` says why)
    workspace = peers[rank]
    launcher(
        gemm_one_shot_all_reduce_kernel, (num_blocks,),
        tma_operand(a, [block_m, block_k]), tma_operand(b, [block_k, block_n]),
        partials, workspace, peers, parity, epochs, out, signal_pad_ptrs, split_pad_ptrs, m, n, a.shape[1],
        *workspace.stride()[:2], num_groups, k_per_split, rank, len(peers),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, SPLIT_K=split_k, REDUCE_M=reduce_m, PUSH=shot == PUSH,
        KEEP_LAST=keeps_last(split_k, len(peers), out.dtype, shot), SHARDS=shards_of(shot, len(peers)),
        num_warps=num_warps, num_stages=num_stages,
    )
    return out


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
    """The form for an M x N output: two-shot above ``kraken.runtime.crossover``'s ``gemm_all_reduce`` entry, else
    one-shot (``one_shot_form``)."""
    if crossover.choose(OP, m * n, world_size) == crossover.TWO:
        return TWO
    return one_shot_form(m, world_size)


def default_config(m: int, n: int, k: int, num_sms: int, world_size: int, shot: str | None = None) -> dict:
    """This shape's form (``shot``, or ``choose_shot``) and tiles (``kraken._gemm_core.skinny_or_large_tiles``,
    narrower when pushing), with no k split for up to ``SKINNY_M`` rows if the tiles give ``SKINNY_FILL`` of
    the SMs a tile."""
    shot = choose_shot(m, n, world_size) if shot is None else shot
    # Pushing 64-row tiles takes them 64 wide (fewer pushes); a group of one pushes nothing: 32 wide, twice the
    # blocks streaming b (M = 64, 4096 x 4096 on one H200: 10.3 us against 10.9).
    cfg = {**skinny_or_large_tiles(m, n, k, num_sms, shot == PUSH and world_size > 1), "shot": shot}
    if m <= SKINNY_M and groups.cdiv(m, cfg["block_m"]) * groups.cdiv(n, cfg["block_n"]) >= SKINNY_FILL * num_sms:
        cfg["split_k"] = 1
    return cfg


def split_k_for(num_tiles: int, k: int, block_k: int, max_blocks: int, max_split: int = MAX_SPLIT_K) -> int:
    """The largest power-of-two k split (<= ``max_split``) whose blocks all fit the grid at once and
    divide k's tiles evenly, at least ``MIN_K_TILES_PER_SPLIT`` each."""
    k_tiles, split = groups.cdiv(k, block_k), 1
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


def plan(m: int, n: int, k: int, world_size: int, config: dict, num_sms: int) -> dict:
    """Resolve the launch configuration (shared with the Helion port).

    The grid is persistent: ``num_groups`` groups of ``split_k`` blocks, at most one block per SM
    and within the signal pad's budget; group g owns tiles g, g + num_groups, ...; at one rank with no k split,
    one block per tile, one-shot (``ONE_RANK_TILE_PER_BLOCK``).
    """
    groups.resolve_config(config, DEFAULT_CONFIG, OP)  # rejects unknown keys
    shot = config.get("shot")
    if shot is not None and shot not in SHOTS:
        raise ValueError(f"{OP}: shot must be one of {', '.join(map(repr, SHOTS))} (or absent: chosen by shape), "
                         f"got {shot!r}")
    defaults = default_config(m, n, k, num_sms, world_size, shot)
    cfg = {**DEFAULT_CONFIG, **defaults, **config, "shot": defaults["shot"]}  # shot None: the chosen one
    shards = shards_of(cfg["shot"], world_size)
    for key in ("block_m", "block_n", "block_k"):
        if cfg[key] < 16 or not _power_of_two(cfg[key]):
            raise ValueError(f"{OP}: {key} must be a power of two >= 16, got {cfg[key]}")
    num_tiles = groups.cdiv(max(m, 1), cfg["block_m"]) * groups.cdiv(max(n, 1), cfg["block_n"])
    max_blocks = num_sms if cfg["max_blocks"] is None else min(cfg["max_blocks"], num_sms)
    max_blocks = groups.persistent_grid(num_sms, max_blocks, world_size)
    if cfg["split_k"] is None:  # two-shot: every rank's slice of the block's rows at least one row
        max_split = min(MAX_SPLIT_K, cfg["block_m"] // shards)
        cfg["split_k"] = split_k_for(num_tiles, k, cfg["block_k"], max_blocks, max_split)
    split = cfg["split_k"]
    if not _power_of_two(split) or split > min(groups.MAX_WORLD_SIZE, cfg["block_m"] // shards, max_blocks):
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
    if solo and num_tiles <= groups.max_barrier_blocks(1):
        num_groups = num_tiles  # one tile per block (``ONE_RANK_TILE_PER_BLOCK``)
    else:
        num_groups = min(num_tiles, max_blocks // split)
    keys = ("block_m", "block_n", "block_k", "split_k", "reduce_m", "shot", "num_warps", "num_stages")
    return {
        **{key: cfg[key] for key in keys},
        "num_blocks": num_groups * split,
        "num_groups": num_groups,
        "k_per_split": groups.cdiv(groups.cdiv(k, cfg["block_k"]), split) * cfg["block_k"],
    }


def rounds_of(m: int, n: int, cfg: dict) -> int:
    """Rounds of the persistent loop (``plan``'s ``cfg``): the tiles each group takes."""
    return groups.cdiv(groups.cdiv(m, cfg["block_m"]) * groups.cdiv(n, cfg["block_n"]), cfg["num_groups"])


def chunk_tile(cfg: dict, world_size: int) -> tuple[int, int, int]:
    """What block ``b``'s chunk of the workspace holds per round (``plan``'s ``cfg``): [slots, BLOCK_M,
    BLOCK_N], a slot per rank's partial of the round's tile when pushing, else one for this rank's (two-shot:
    overwritten by the sums of the rows it owns)."""
    return (world_size if cfg["shot"] == PUSH else 1, cfg["block_m"], cfg["block_n"])


@prepared.per_signature(lambda a, b, group, out_dtype, op, config: (
    op, group, prepared.tensor_key(a), prepared.tensor_key(b), out_dtype, prepared.config_key(config)))
def prepare(
    a: torch.Tensor, b: torch.Tensor, group, out_dtype: torch.dtype, op: str, config: dict
) -> tuple[symm.SymmContext, dict]:
    """Validate, plan, and find the workspace: the context's ``peers`` are every rank's
    ``symm.BlockWorkspace`` viewed as [2, chunks, tiles per chunk, slots, BLOCK_M, BLOCK_N] of
    ``out_dtype`` (``chunk_tile``)."""
    # The first call of each signature checks that every rank passes the same shapes and valid ones.
    with agreement.agreed(op, group, a=a, b=b, out_dtype=out_dtype, config=config):
        check_inputs(a, b, out_dtype, op)
        (m, k), n = a.shape, b.shape[1]
        num_sms = torch.cuda.get_device_properties(a.device).multi_processor_count
        world_size = groups.world_size_of(group, op)
        cfg = plan(m, n, k, world_size, config, num_sms)
        groups.check_barrier_blocks(cfg["num_blocks"], world_size, op)
    tile = chunk_tile(cfg, world_size)
    chunk_bytes = rounds_of(m, n, cfg) * math.prod(tile) * out_dtype.itemsize
    workspace = symm.block_workspace(chunk_bytes, a.device, group, op)
    ctx = workspace.context(out_dtype, tile)
    split_args = {
        "parity": workspace.parity,
        "epochs": workspace.epochs,
        "partials": symm.local_scratch((workspace.num_chunks, 2, *tile[1:]) if cfg["split_k"] > 1 else (1,),
                                       torch.float32, a.device),
        "split_pad_ptrs": symm.local_barrier_pads(a.device),
    }
    return ctx, {**split_args, **cfg, "launcher": Launcher(op)}


def gemm_one_shot_all_reduce(
    a: torch.Tensor,
    b: torch.Tensor,
    group: dist.ProcessGroup | str | None = None,
    out_dtype: torch.dtype = torch.float32,
    **config,
) -> torch.Tensor:
    """``sum over ranks of a @ b`` as a new [M, N] tensor of ``out_dtype`` (bf16 or fp32).

    ``a`` [M, K] and ``b`` [K, N] are ordinary contiguous CUDA tensors, bf16 or
    fp16, the same shapes on every rank. ``config`` overrides ``default_config(M, N, K, num_sms, world_size)``
    (the form, ``shot="one"`` / ``"push"`` / ``"two"``, and tiles) and the chosen ``split_k``/``reduce_m``/
    ``max_blocks`` (see ``plan``); ``form="fused"`` or ``"sequential"`` forces the form ``crossover`` would
    choose by size.
    """
    return call(launch, OP, a, b, group, out_dtype, config, sm_all_reduce)


def call(launch, op: str, a: torch.Tensor, b: torch.Tensor, group, out_dtype: torch.dtype, config: dict,
         all_reduce) -> torch.Tensor:
    """``gemm_one_shot_all_reduce`` with a given ``launch`` and ``all_reduce`` (the recipe's or its twin's front door)
    under the name ``op``, in the form ``crossover`` chooses: sequential, cuBLAS then ``all_reduce`` (one- or
    two-shot by size: the sum in fp32, rounded once), only where the output dtype is ``a``'s; else the prepared
    call and its launch."""
    prepared = chosen(a, b, group, out_dtype, op, config)
    if prepared == crossover.SEQUENTIAL:
        return all_reduce(torch.matmul(a, b), group)
    ctx, launch_cfg = prepared
    out = torch.empty(a.shape[0], b.shape[1], dtype=out_dtype, device=a.device)
    return prepared_launch(launch, (a, b), ctx, launch_cfg, out)


@prepared.per_signature(lambda a, b, group, out_dtype, op, config: (
    op, group, prepared.tensor_key(a), prepared.tensor_key(b), out_dtype, prepared.config_key(config)))
def chosen(a: torch.Tensor, b: torch.Tensor, group, out_dtype: torch.dtype, op: str, config: dict):
    """``crossover.SEQUENTIAL`` or the fused form's ``prepare``, kept per signature (``crossover.fused_prepared``);
    sequential only where the output dtype is ``a``'s."""
    sequential_ok = isinstance(a, torch.Tensor) and a.dtype == out_dtype
    return crossover.fused_prepared(op, a, b, group, False, sequential_ok, config, check_sequential,
                                    lambda fused_config: prepare(a, b, group, out_dtype, op, fused_config),
                                    fills_poorly)


def check_sequential(a: torch.Tensor, b: torch.Tensor, world_size: int, op: str) -> None:
    """The sequential form's checks (``kraken.runtime.crossover.form`` runs them inside its agreement)."""
    check_inputs(a, b, a.dtype, op)


# The fused kernel runs one block per output tile (or per k slice of one). Above ``SKINNY_M`` rows the tensor
# cores bind, and where its tiles leave more than a quarter of the SMs' last wave idle (512x5120x5120: 80 tiles
# of 128x256 on 132 SMs), cuBLAS, which splits such shapes its own way, then the all-reduce is the faster form
# (``kraken.runtime.crossover``). Up to ``SKINNY_M`` rows streaming ``b`` binds, whatever the wave's fill.
MIN_WAVE_FILL = 0.75


def fills_poorly(a: torch.Tensor, b: torch.Tensor, world_size: int) -> bool:
    """Whether the fused plan for ``a @ b`` (more than ``SKINNY_M`` rows) fills less than ``MIN_WAVE_FILL`` of its
    waves of SMs."""
    (m, k), n = a.shape, b.shape[1]
    if m <= SKINNY_M:
        return False
    num_sms = torch.cuda.get_device_properties(a.device).multi_processor_count
    cfg = plan(m, n, k, world_size, {}, num_sms)
    units = groups.cdiv(m, cfg["block_m"]) * groups.cdiv(n, cfg["block_n"]) * cfg["split_k"]
    return units / (groups.cdiv(units, num_sms) * num_sms) < MIN_WAVE_FILL
