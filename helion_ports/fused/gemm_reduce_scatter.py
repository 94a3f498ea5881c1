"""Helion twin of ``kraken.fused.gemm_reduce_scatter``: same function, same arguments.

The structure mirrors the Triton recipe one to one (``plan`` and ``prepare`` are shared):

* ``hl.grid(num_blocks)`` is the persistent grid; the grid index is the barrier's block id and
  the workspace chunk, identical on every rank. Block ``b`` takes band-local tiles
  ``b, b + blocks, ...`` (in the recipe's grouped order) of every band;
* phase 1, ``hl.grid((world_size - 1) * rounds)``: the peers' bands, owner ``rank + 1`` first.
  The GEMM is a 2-D ``hl.tile`` over one whole tile with an ``hl.tile`` over k and ``hl.dot``
  into fp32; ``a`` and ``b`` load through host-built tensor descriptors (TMA): rows and columns
  past ``m``, ``n`` and ``k`` come in as zeros. The partial goes to this rank's slot of the owner's
  workspace: the peers' workspaces arrive as one tuple walked with ``hl.static_range``, and the
  store into ``peers[r]`` runs for the ``r`` that is the owner;
* phase 2, ``hl.grid(rounds)``: the own band's tiles; after the first GEMM the epoch barrier
  (the kraken PTX through ``hl.inline_triton``; a group of one splits it around the band, as the
  recipe), then the peers' partials from the local ``workspace`` added in slot order and the band's
  rows stored to ``out`` with a mask;
* the block's parity flips and its epoch count advances at the end (``symm.BlockWorkspace``: no
  trailing barrier).

The body also serves the fp8 twin (``b_trans``, ``scaled`` and the scales; off and None here, and
absent from the generated kernel). The config is explicit: ``block_sizes`` follow the loops (phase 1's
tile m, n and k step, then phase 2's), from the recipe's ``plan``. Set ``HELION_PRINT_OUTPUT_CODE=1`` to see the generated Triton.
"""

from __future__ import annotations

import functools

import helion
import helion.language as hl
import torch
import torch.distributed as dist

from kraken._blocks.helion import flat_kernel, own_storage, run
from kraken._ptx_utils.inline_source import EPOCH_SEND, EPOCH_SYNC, EPOCH_WAIT
from kraken._gemm_core import tma_operands
from kraken.runtime.collectives import helion_reduce_scatter
from kraken.fused.gemm_reduce_scatter import call, chunk_tile, plan, prepare, rounds_of  # shared with the recipe
from kraken.runtime.launcher import jit_launch

__all__ = ["chunk_tile", "gemm_reduce_scatter", "launch", "plan", "prepare", "rounds_of"]

def indexing(world_size: int) -> tuple[str, ...]:
    """Per load/store, in program order: the parity and epoch loads, phase 1's ``a`` and ``b`` loads through
    tensor descriptors (TMA, as in the recipe), a push per rank, phase 2's ``a`` and ``b`` loads (TMA), then
    the peers' partials (one load in a loop), ``out``, parity and epoch through pointers."""
    tma = ("tensor_descriptor",) * 2
    return ("pointer",) * 2 + tma + ("pointer",) * world_size + tma + ("pointer",) * 4


def gemm_reduce_scatter_body(
    a: torch.Tensor,
    b: torch.Tensor,
    scale_a: torch.Tensor | None,  # scaled: [M] (stride 0 for a per-tensor scale); None here
    scale_b: torch.Tensor | None,  # scaled: [N]; None here
    workspace: torch.Tensor,
    peers: tuple[torch.Tensor, ...],
    parity: torch.Tensor,
    epochs: torch.Tensor,
    out: torch.Tensor,
    signal_pad_ptrs: int,
    num_blocks: int,
    rank: int,
    world_size: hl.constexpr,
    b_trans: hl.constexpr,  # the fp8 twin's: b as [N, K], its tiles transposed for hl.dot
    scaled: hl.constexpr,  # the fp8 twin's: each partial times its scales before it leaves the SM
    block_m: hl.constexpr,
    block_n: hl.constexpr,
    group_m: hl.constexpr,
    group_name: hl.ProcessGroupName,
) -> torch.Tensor:
    band_m, n = out.size()  # a and b may be zero-padded in k and n for TMA (``tma_operands``)
    k = a.size(1)
    m = band_m * world_size
    tiles_m = (band_m + block_m - 1) // block_m
    tiles_n = (n + block_n - 1) // block_n
    width = group_m * tiles_n
    for block in hl.grid(num_blocks):
        half = parity[block]
        epoch = epochs[block]
        rounds = (tiles_m * tiles_n - block + num_blocks - 1) // num_blocks
        for i in hl.grid((world_size - 1) * rounds):
            owner = (rank + 1 + i // rounds) % world_size
            rnd = i % rounds
            j = block + rnd * num_blocks
            first_m = j // width * group_m
            group_rows = min(tiles_m - first_m, group_m)
            m0 = owner * band_m + (first_m + j % width % group_rows) * block_m
            n0 = j % width // group_rows * block_n
            # The owner's slot q holds sender owner + 1 + q. (Not ``rank - (rank > owner)``: Helion 1.5.0 drops
            # a comparison of two runtime ints inside an int expression.)
            slot = (rank - owner - 1 + world_size) % world_size
            for tile_m, tile_n in hl.tile([m0, n0], [m0 + block_m, n0 + block_n]):
                acc = hl.zeros([tile_m, tile_n], dtype=torch.float32)
                for tile_k in hl.tile(k):
                    if b_trans:
                        acc = hl.dot(a[tile_m, tile_k], b[tile_n, tile_k].T, acc=acc)
                    else:
                        acc = hl.dot(a[tile_m, tile_k], b[tile_k, tile_n], acc=acc)
                if scaled:
                    scale_rows = hl.load(scale_a, [tile_m], extra_mask=tile_m.index < m)
                    scale_cols = hl.load(scale_b, [tile_n], extra_mask=tile_n.index < n)
                    acc = acc * scale_rows[:, None] * scale_cols[None, :]
                partial = acc.to(workspace.dtype)
                for r in hl.static_range(world_size):
                    if owner == r:
                        hl.store(peers[r], [half, block, rnd, slot, tile_m.index - m0, tile_n.index - n0], partial)
        if world_size == 1:  # a group of one: the barrier with itself split around its band (as the recipe)
            hl.inline_triton(EPOCH_SEND, args={"signal_pad_ptrs": signal_pad_ptrs, "block_id": block, "rank": rank, "world_size": world_size, "epoch": epoch + 1}, output_like=None)
        for rnd in hl.grid(rounds):
            j = block + rnd * num_blocks
            first_m = j // width * group_m
            group_rows = min(tiles_m - first_m, group_m)
            r0 = (first_m + j % width % group_rows) * block_m
            m0 = rank * band_m + r0
            n0 = j % width // group_rows * block_n
            for tile_m, tile_n in hl.tile([m0, n0], [m0 + block_m, n0 + block_n]):
                acc = hl.zeros([tile_m, tile_n], dtype=torch.float32)
                for tile_k in hl.tile(k):
                    if b_trans:
                        acc = hl.dot(a[tile_m, tile_k], b[tile_n, tile_k].T, acc=acc)
                    else:
                        acc = hl.dot(a[tile_m, tile_k], b[tile_k, tile_n], acc=acc)
                if scaled:
                    scale_rows = hl.load(scale_a, [tile_m], extra_mask=tile_m.index < m)
                    scale_cols = hl.load(scale_b, [tile_n], extra_mask=tile_n.index < n)
                    acc = acc * scale_rows[:, None] * scale_cols[None, :]
                if world_size > 1:
                    if rnd == 0:
                        hl.inline_triton(EPOCH_SYNC, args={"signal_pad_ptrs": signal_pad_ptrs, "block_id": block, "rank": rank, "world_size": world_size, "epoch": epoch + 1}, output_like=None)
                for q in hl.grid(world_size - 1):  # a loop, as in the recipe (unrolled, it spills at 8 ranks)
                    acc = acc + workspace[half, block, rnd, q, tile_m.index - m0, tile_n.index - n0].to(torch.float32)
                rows = tile_m.index - rank * band_m
                inside = (rows < band_m)[:, None] & (tile_n.index < n)[None, :]
                hl.store(out, [rows, tile_n], acc.to(out.dtype), extra_mask=inside)
        if world_size == 1:
            hl.inline_triton(EPOCH_WAIT, args={"signal_pad_ptrs": signal_pad_ptrs, "block_id": block, "rank": rank, "world_size": world_size, "epoch": epoch + 1}, output_like=None)
        parity[block] = 1 - half
        epochs[block] = epoch + 1
    return out


@functools.cache
def compiled(block_m: int, block_n: int, block_k: int, num_warps: int, num_stages: int, world_size: int) -> helion.Kernel:
    """One Helion kernel per launch configuration, each with an explicit config: ``block_sizes`` follow the
    loops (phase 1's tile m, n, its k step; phase 2's), TMA for ``a`` and ``b`` through descriptors built on
    the host, pointers elsewhere, ``pid_type="flat"`` (the recipe's grid, see ``helion_ports``)."""
    block_sizes = (block_m, block_n, block_k) * 2
    return flat_kernel(gemm_reduce_scatter_body, block_sizes, num_warps, num_stages, indexing=indexing(world_size),
                       host_tensor_descriptors=True)


def launch(
    a: torch.Tensor,
    b: torch.Tensor,
    peers: tuple[torch.Tensor, ...],
    out: torch.Tensor,
    signal_pad_ptrs: int,
    rank: int,
    parity: torch.Tensor,
    epochs: torch.Tensor,
    block_m: int,
    block_n: int,
    block_k: int,
    group_m: int,
    num_warps: int,
    num_stages: int,
    num_blocks: int,
    group_name: str = "",
    launcher=jit_launch,
) -> torch.Tensor:
    """Launch on prepared arguments (no checks); mirrors ``kraken.fused.gemm_reduce_scatter.launch``.

    ``peers[rank]`` goes in twice: as ``workspace`` (the top-level argument phase 2 reads; ``rank`` is a
    runtime value, and a tuple is indexed only by ``hl.static_range``), under its own storage object
    (``own_storage``: no CTA barrier before its loads), and inside ``peers``.
    """
    a, b = tma_operands(a, b, block_m)  # as the recipe
    args = (
        a, b, None, None, own_storage(peers[rank]), peers, parity, epochs, out, signal_pad_ptrs, num_blocks, rank,
        len(peers), False, False, block_m, block_n, group_m, group_name,
    )
    run(compiled(block_m, block_n, block_k, num_warps, num_stages, len(peers)), args, launcher)
    return out


def gemm_reduce_scatter(
    a: torch.Tensor,
    b: torch.Tensor,
    group: dist.ProcessGroup | str | None = None,
    out_dtype: torch.dtype = torch.bfloat16,
    **config,
) -> torch.Tensor:
    """This rank's [M / ws, N] rows of ``sum over ranks of a @ b`` in ``out_dtype`` (see the kraken recipe)."""
    return call(launch, "helion gemm_reduce_scatter", a, b, group, out_dtype, config, helion_reduce_scatter)
