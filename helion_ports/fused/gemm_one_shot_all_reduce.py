"""Helion twin of ``kraken.fused.gemm_one_shot_all_reduce``: same function, same arguments.

The structure mirrors the Triton recipe one to one (``plan`` and ``prepare`` are shared):

* ``hl.grid(num_groups * split_k)`` is the persistent grid; the grid index is
  the barrier's block id, identical on every rank. Block ``b`` is split
  ``b % split_k`` of group ``b // split_k``, which owns tiles ``g, g + groups, ...``,
  one per round (``hl.grid(rounds)``; a round past the last tile has empty loops
  and only keeps the split group's barriers paired);
* the GEMM is a 2-D ``hl.tile`` over one whole tile, with an ``hl.tile`` over this
  split's k range and ``hl.dot`` into fp32. ``a`` and ``b`` load through tensor
  descriptors (TMA), as in the recipe: rows and columns past ``m``, ``n`` and ``k``
  come in as zeros, so the whole tile goes to the workspace with no mask (masks
  on the pushes to 8 peers made ptxas spill) and only the reduce clips to ``[m, n]``;
* with a k split, the partial goes to local scratch, the group meets at the same
  PTX barrier over local pads, and each block sums its slice of rows;
* the block stores its rows into its slot of the workspace: with ``push``, into every
  rank's (the peers' workspaces arrive as one tuple, walked with ``hl.static_range``,
  stored to with ``hl.store(peers[r], ...)``), else into its own (the top-level
  ``workspace`` argument);
* the barriers are the kraken PTX, pasted in with ``hl.inline_triton``: the CAS
  barrier for the split group, and after the last round the epoch barrier across
  ranks; then a second ``hl.grid(rounds)`` sums every rank's partial (from the local
  ``workspace`` with ``push``, else from ``flat_peers[r]``, every rank's workspace as one
  flat view, at one offset tensor as the recipe's ``peers[r] + offsets``), and the block's parity flips and
  its epoch count advances at the end (``symm.BlockWorkspace``: no trailing barrier);
* ``keep_last`` (the recipe's ``KEEP_LAST``, ``keeps_last``): the last round is its own GEMM tile
  loop, which also holds the epoch barrier and that tile's sum (my partial from registers, the
  peer's from memory), before the earlier rounds' reduce.

The config is explicit: ``block_sizes`` follow the loops (the GEMM tile m, n, its k step, the
slice's rows and columns, with ``keep_last`` the last round's tile m, n and k step, the reduce
tile m, n), from the recipe's ``plan``.
Set ``HELION_PRINT_OUTPUT_CODE=1`` to see the generated Triton.
"""

from __future__ import annotations

import functools

import helion
import helion.language as hl
import torch
import torch.distributed as dist

from kraken._blocks.helion import flat_kernel, own_storage, run, views
from kraken.runtime.collectives import helion_all_reduce
from kraken._ptx_utils.inline_source import EPOCH_SEND, EPOCH_SYNC, EPOCH_WAIT, SYMM_MEM_SYNC
from kraken._gemm_core import tma_operands
from kraken.fused.gemm_one_shot_all_reduce import (  # shared with the recipe
    PUSH, call, chunk_tile, keeps_last, plan, prepare, rounds_of, shards_of,
)
from kraken.runtime.launcher import jit_launch

# Both barriers are "my writes are visible to you, yours to me" (release + acquire): the k-split
# group's CAS barrier over local pads, then the ranks' epoch barrier over the workspace's own pad.
SPLIT_SYNC = SYMM_MEM_SYNC[(True, True)]


def indexing(split_k: int, push: bool, keep_last: int, world_size: int) -> tuple[str, ...]:
    """Per load/store, in program order: the parity and epoch loads, the ``a`` and ``b`` loads through tensor
    descriptors (TMA, as in the recipe), the partial's stores; with ``keep_last`` the last round's ``a`` and
    ``b`` (TMA) after them; then pointers (as many as two-shot at 8 ranks with a k split has, and some)."""
    tma = ("tensor_descriptor",) * 2
    if not keep_last:
        return ("pointer",) * 2 + tma + ("pointer",) * 64
    stores = world_size if push else 1  # every push target, or my slot
    return ("pointer",) * 2 + tma + ("pointer",) * stores + tma + ("pointer",) * 64


def gemm_one_shot_all_reduce_body(
    a: torch.Tensor,
    b: torch.Tensor,
    partials: torch.Tensor,
    workspace: torch.Tensor,
    peers: tuple[torch.Tensor, ...],
    flat_workspace: torch.Tensor,  # two-shot: ``workspace`` as one flat view (one-shot: unused)
    flat_peers: tuple[torch.Tensor, ...],  # every rank's, pulling (pushing: unused)
    parity: torch.Tensor,
    epochs: torch.Tensor,
    out: torch.Tensor,
    signal_pad_ptrs: int,
    split_pad_ptrs: int,
    num_groups: int,
    k_per_split: int,
    rank: int,
    world_size: hl.constexpr,
    split_k: hl.constexpr,
    block_m: hl.constexpr,
    block_n: hl.constexpr,
    push: hl.constexpr,
    keep_last: hl.constexpr,  # the recipe's KEEP_LAST (``keeps_last``): the last round's partial stays in registers
    shards: hl.constexpr,  # the recipe's SHARDS (``shards_of``): two-shot slices of the block's rows; 1: one-shot
    group_name: hl.ProcessGroupName,
) -> torch.Tensor:
    m, n = out.size()  # a and b may be zero-padded in k and n for TMA (``tma_operands``)
    k = a.size(1)
    slice_m = block_m // split_k
    tiles_n = (n + block_n - 1) // block_n
    num_tiles = (m + block_m - 1) // block_m * tiles_n
    barriers = 2 if shards > 1 else 1  # epoch barrier rounds per launch
    for block in hl.grid(num_groups * split_k):
        group = block // split_k
        split = block % split_k
        half = parity[block]
        epoch = epochs[block]
        k_begin = split * k_per_split
        rounds = (num_tiles + num_groups - 1) // num_groups
        if keep_last:
            if world_size == 1:  # a group of one: the barrier with itself split, the send first (as the recipe)
                hl.inline_triton(EPOCH_SEND, args={"signal_pad_ptrs": signal_pad_ptrs, "block_id": block, "rank": rank, "world_size": world_size, "epoch": epoch + 1}, output_like=None)
        for rnd in hl.grid(rounds - keep_last):
            tile = group + rnd * num_groups
            m0 = tile // tiles_n * block_m
            n0 = tile % tiles_n * block_n
            for tile_m, tile_n in hl.tile([m0, n0], [m0 + block_m, n0 + block_n]):
                acc = hl.zeros([tile_m, tile_n], dtype=torch.float32)
                for tile_k in hl.tile(k_begin, min(k_begin + k_per_split, k)):
                    acc = hl.dot(a[tile_m, tile_k], b[tile_k, tile_n], acc=acc)
                if split_k == 1:
                    partial = acc.to(workspace.dtype)
                    if push:
                        for r in hl.static_range(world_size):
                            hl.store(peers[r], [half, block, rnd, rank, tile_m.index - m0, tile_n.index - n0], partial)
                    else:
                        workspace[half, block, rnd, 0, tile_m.index - m0, tile_n.index - n0] = partial
                else:
                    partials[block, rnd % 2, tile_m.index - m0, tile_n.index - n0] = acc
            if split_k > 1:
                hl.inline_triton(SPLIT_SYNC, args={"signal_pad_ptrs": split_pad_ptrs, "block_id": group, "rank": split, "world_size": split_k}, output_like=None)
                for tile_r, tile_c in hl.tile([split * slice_m, 0], [(split + 1) * slice_m, block_n]):
                    part = hl.zeros([tile_r, tile_c], dtype=torch.float32)
                    for s in hl.static_range(split_k):
                        part = part + partials[group * split_k + s, rnd % 2, tile_r, tile_c]
                    partial = part.to(workspace.dtype)
                    if push:
                        for r in hl.static_range(world_size):
                            hl.store(peers[r], [half, block, rnd, rank, tile_r, tile_c], partial)
                    else:
                        workspace[half, block, rnd, 0, tile_r, tile_c] = partial
        if keep_last:
            # The last round: my partial to the peer, then the barrier and my sum with it still in registers.
            last = rounds - 1
            last_tile = group + last * num_groups
            last_m0 = last_tile // tiles_n * block_m
            last_n0 = last_tile % tiles_n * block_n
            for tile_m, tile_n in hl.tile([last_m0, last_n0], [last_m0 + block_m, last_n0 + block_n]):
                acc = hl.zeros([tile_m, tile_n], dtype=torch.float32)
                for tile_k in hl.tile(k_begin, min(k_begin + k_per_split, k)):
                    acc = hl.dot(a[tile_m, tile_k], b[tile_k, tile_n], acc=acc)
                mine = acc.to(workspace.dtype)
                if world_size > 1:
                    if push:
                        for r in hl.static_range(world_size):
                            if r != rank:
                                hl.store(peers[r], [half, block, last, rank, tile_m.index - last_m0, tile_n.index - last_n0], mine)
                    else:
                        workspace[half, block, last, 0, tile_m.index - last_m0, tile_n.index - last_n0] = mine
                if world_size == 1:
                    hl.inline_triton(EPOCH_WAIT, args={"signal_pad_ptrs": signal_pad_ptrs, "block_id": block, "rank": rank, "world_size": world_size, "epoch": epoch + 1}, output_like=None)  # the send's wait (as the recipe)
                else:
                    hl.inline_triton(EPOCH_SYNC, args={"signal_pad_ptrs": signal_pad_ptrs, "block_id": block, "rank": rank, "world_size": world_size, "epoch": epoch + 1}, output_like=None)
                # At most 2 ranks: a + b == b + a, the same sum on both.
                total = mine.to(torch.float32)
                if world_size > 1:
                    if push:
                        total = total + workspace[half, block, last, 1 - rank, tile_m.index - last_m0, tile_n.index - last_n0].to(torch.float32)
                    else:
                        for r in hl.static_range(world_size):
                            if r != rank:
                                total = total + hl.load(peers[r], [half, block, last, 0, tile_m.index - last_m0, tile_n.index - last_n0]).to(torch.float32)
                inside = (tile_m.index < m)[:, None] & (tile_n.index < n)[None, :]
                hl.store(out, [tile_m, tile_n], total.to(out.dtype), extra_mask=inside)
        else:
            hl.inline_triton(EPOCH_SYNC, args={"signal_pad_ptrs": signal_pad_ptrs, "block_id": block, "rank": rank, "world_size": world_size, "epoch": epoch + 1}, output_like=None)
        chunk = half * workspace.stride(0) + block * workspace.stride(1)  # my chunk, pulled flat (below)
        if shards == 1:
            for rnd in hl.grid(rounds - keep_last):
                tile = group + rnd * num_groups
                m0 = tile // tiles_n * block_m
                n0 = tile % tiles_n * block_n
                slots = chunk + rnd * workspace.stride(2)
                # Whole slices, as the recipe: the slots hold whole tiles, so only the store to ``out`` has a mask
                # (with masked loads from 8 slots, ptxas ran out of predicates and held loads back). The loop runs
                # over the tile's own rows and columns, and a pull reads every rank's flat workspace at one offset
                # tensor, both as the recipe: the loads' addresses wait for no tile coordinates and keep no register
                # per peer (either alone, ptxas issued 4 or 5 of 8 peers' loads before the first add at 8 ranks).
                for out_rows, out_cols in hl.tile([split * slice_m, 0], [(split + 1) * slice_m, block_n]):
                    total = hl.zeros([out_rows, out_cols], dtype=torch.float32)
                    at = slots + out_rows.index[:, None] * block_n + out_cols.index[None, :]
                    for r in hl.static_range(world_size):
                        if push:
                            total = total + workspace[half, block, rnd, r, out_rows, out_cols].to(torch.float32)
                        else:
                            total = total + hl.load(flat_peers[r], [at]).to(torch.float32)
                    rows, cols = m0 + out_rows.index, n0 + out_cols.index
                    inside = (rows < m)[:, None] & (cols < n)[None, :]
                    hl.store(out, [rows, cols], total.to(out.dtype), extra_mask=inside)
        else:
            # Two-shot: sum the slices I own (rank, rank + world_size, ...) over every rank's partial, over my own
            # partial of those rows (the peers read only the rows they own of it); then the second barrier and
            # every slice from its owner into ``out`` (mine too, from local memory: no branch between the loads).
            # Through flat views and one offset tensor for every rank, as the recipe's ``peers[r] + offsets``:
            # indexed as [half, block, rnd, 0, row, col], each peer's address was its own arithmetic on its own
            # strides, and ptxas issued 2 of the 8 peers' loads before the first add at 8 ranks (the recipe 8).
            # (The one-shot pull above needed its loop over the tile's own rows too: docs/helion-notes.md.)
            shard_m = slice_m // shards
            for rnd in hl.grid(rounds):
                tile = group + rnd * num_groups
                m0 = tile // tiles_n * block_m
                n0 = tile % tiles_n * block_n
                tile_base = chunk + rnd * workspace.stride(2)
                for t in hl.static_range((shards + world_size - 1) // world_size):
                    # My t-th slice, rank + t * world_size (no scalar bound inside the ``if``: Helion 1.5.0 cannot
                    # merge a scalar bound again in the next unrolled iteration, see docs/helion-notes.md).
                    row0 = m0 + split * slice_m + (rank + t * world_size) * shard_m
                    if t == 0 or rank + t * world_size < shards:  # a world size that is no power of two owns unevenly
                        for sum_rows, sum_cols in hl.tile([row0, n0], [row0 + shard_m, n0 + block_n]):
                            offsets = tile_base + (sum_rows.index - m0)[:, None] * block_n + (sum_cols.index - n0)[None, :]
                            total = hl.zeros([sum_rows, sum_cols], dtype=torch.float32)
                            for r in hl.static_range(world_size):
                                total = total + hl.load(flat_peers[r], [offsets]).to(torch.float32)
                            hl.store(flat_workspace, [offsets], total.to(workspace.dtype))
            hl.inline_triton(EPOCH_SYNC, args={"signal_pad_ptrs": signal_pad_ptrs, "block_id": block, "rank": rank, "world_size": world_size, "epoch": epoch + 2}, output_like=None)
            for rnd in hl.grid(rounds):
                gather_tile = group + rnd * num_groups
                gather_m0 = gather_tile // tiles_n * block_m
                gather_n0 = gather_tile % tiles_n * block_n
                gather_row0 = gather_m0 + split * slice_m
                gather_base = chunk + rnd * workspace.stride(2)
                # One loop over the first slice's rows, every slice an offset of them: the loads from every owner
                # are in one loop body, all in flight at once (a loop per slice waited for each in turn).
                for gather_rows, gather_cols in hl.tile([gather_row0, gather_n0], [gather_row0 + shard_m, gather_n0 + block_n]):
                    for j in hl.static_range(shards):
                        rows = gather_rows.index + j * shard_m
                        at = gather_base + (rows - gather_m0)[:, None] * block_n + (gather_cols.index - gather_n0)[None, :]
                        summed = hl.load(flat_peers[j % world_size], [at])
                        inside = (rows < m)[:, None] & (gather_cols.index < n)[None, :]
                        hl.store(out, [rows, gather_cols], summed.to(out.dtype), extra_mask=inside)
        parity[block] = 1 - half
        epochs[block] = epoch + barriers
    return out


def boxed_operands(a: torch.Tensor, b: torch.Tensor, block_m: int, block_n: int, block_k: int):
    """``a`` and ``b`` as TMA can load them (``tma_operands``), zero-padded to at least one box in every dimension.

    Helion 1.5.0 loads an operand whose box is larger than the tensor (``block_m`` > M, ``block_n`` > N or
    ``block_k`` > K) through pointers instead, masked only where a loop's end is not a multiple of its
    block (the k tail). The tile loops end at ``m0 + block_m``, so those loads read up to ``block_m - M`` rows
    past the end of ``a`` (M = 37, K = 1000: 52 KB past a 74 KB buffer), and which way a load goes is fixed
    when a kernel is first bound, then reused for other shapes. Zero rows and columns add nothing; the output
    keeps the true M and N (``out``'s).
    """
    a, b = tma_operands(a, b, block_m)  # as the recipe: up to SKINNY_M rows, a multiple of block_m
    (m, k), n = a.shape, b.shape[1]
    rows, depth, cols = max(m, block_m), max(k, block_k), max(n, block_n)
    if (rows, depth) != (m, k):
        a_box = a.new_zeros(rows, depth)
        a_box[:m, :k] = a
        a = a_box
    if (depth, cols) != (k, n):
        b_box = b.new_zeros(depth, cols)
        b_box[:k, :n] = b
        b = b_box
    return a, b


@functools.cache
def compiled(
    block_m: int, block_n: int, block_k: int, split_k: int, reduce_m: int, push: bool, num_warps: int, num_stages: int,
    keep_last: int, world_size: int, shards: int,
) -> helion.Kernel:
    """One Helion kernel per launch configuration, each with an explicit config.

    ``block_sizes`` follow the loops: the GEMM tile (m, n), its k step, the k split's slice
    (rows, columns: one step; no such loop without a split), the reduce tile (m, n). ``indexing``: TMA
    for ``a`` and ``b`` through descriptors built on the host (``host_tensor_descriptors``, like the
    recipe's; built in every program, they cost 5-12% at M <= 256), pointers elsewhere.
    ``pid_type="flat"``: the recipe's grid, one program per block (see ``helion_ports``).
    """
    gemm = (block_m, block_n, block_k)
    reduce = (reduce_m, block_n) * (1 if shards == 1 else 2)  # two-shot: the sums, then the gather
    block_sizes = (*gemm, *((block_m // split_k, block_n) if split_k > 1 else ()), *(gemm if keep_last else ()), *reduce)
    return flat_kernel(gemm_one_shot_all_reduce_body, block_sizes, num_warps, num_stages,
                       indexing=indexing(split_k, push, keep_last, world_size), host_tensor_descriptors=True)


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
    """Launch on prepared arguments (no checks); mirrors ``kraken.fused.gemm_one_shot_all_reduce.launch``.

    ``peers[rank]`` goes in twice: as ``workspace``, the top-level argument for this rank's own slots
    (``rank`` is a runtime value, and a tuple is indexed only by ``hl.static_range``), under its own
    storage object (``own_storage``: Helion would put a CTA barrier before loads from storage the
    kernel stored to; the epoch barrier already orders them), and inside ``peers``. Every size the body
    uses comes from top-level tensors, which is what makes Helion 1.5.0 re-specialize when a shape
    changes bucket (it ignores sizes inside tuples).
    """
    a, b = boxed_operands(a, b, block_m, block_n, block_k)
    push, shards, keep = shot == PUSH, shards_of(shot, len(peers)), keeps_last(split_k, len(peers), out.dtype, shot)
    # Helion 1.5.0 specialises a size-1 dimension and then drops the row mask of a store through a
    # taller tile (every row of the tile lands on row 0). So M = 1 writes two rows (``a`` has block_m).
    staged = out if out.shape[0] > 1 else out.new_empty(2, out.shape[1])
    workspace = own_storage(peers[rank])
    # Pulls read every rank's workspace, and two-shot writes its own, through flat views (the views are contiguous).
    flat_peers = peers if push else views(peers, -1)
    flat_workspace = workspace.view(-1) if shards > 1 else workspace
    args = (
        a, b, partials, workspace, peers, flat_workspace, flat_peers, parity, epochs, staged, signal_pad_ptrs, split_pad_ptrs, num_groups, k_per_split,
        rank, len(peers), split_k, block_m, block_n, push, keep, shards, group_name,
    )
    run(compiled(block_m, block_n, block_k, split_k, reduce_m, push, num_warps, num_stages, keep, len(peers), shards),
        args, launcher)
    if staged is not out:
        out.copy_(staged[:1])
    return out


def gemm_one_shot_all_reduce(
    a: torch.Tensor,
    b: torch.Tensor,
    group: dist.ProcessGroup | str | None = None,
    out_dtype: torch.dtype = torch.float32,
    **config,
) -> torch.Tensor:
    """``sum over ranks of a @ b`` as a new [M, N] tensor of ``out_dtype`` (see the kraken recipe)."""
    return call(launch, "helion gemm_one_shot_all_reduce", a, b, group, out_dtype, config, helion_all_reduce)
