"""Helion twin of ``kraken.fused.all_gather_matmul``: same function, same arguments.

The gather is the recipe's (``kraken.comm.all_gather_with_progress``: copy-engine copies,
stream memory operations and two one-block barrier kernels, all host code), and so are
``plan``, ``prepare`` and ``tma_inputs``. The GEMM mirrors the recipe's kernel:

* ``hl.grid(num_blocks)`` is the persistent grid; block ``b`` takes tiles ``b, b +
  num_blocks, ...``, chunk by chunk: this rank's rows first, read from ``a`` itself, then
  rank + 1's, rank + 2's, ... from the gather buffer, as the recipe: two ``hl.grid`` loops,
  one per source of rows, each with its own k loop (Helion 1.5 cannot pick a load's tensor
  per tile, docs/helion-notes.md; the recipe, too, keeps one loop per source). The loops
  follow each other, so their pipeline buffers share shared memory; a group of one compiles
  the first alone;
* a block waits for the rows' flag at its first tile of each peer's chunk, with the recipe's
  PTX (``GMEM_WAIT_ASYNC``: acquire spin by one thread, thread barrier, every thread's
  async-proxy fence) pasted in with ``hl.inline_triton``;
* within a chunk, ``group_m``-row bands of tiles, as the recipe;
* each tile is a 2-D ``hl.tile`` over one whole tile with an ``hl.tile`` over k and
  ``hl.dot`` into fp32; ``a``, ``gathered`` and ``b`` load through host-built tensor
  descriptors (TMA, ``host_tensor_descriptors``; Helion loads a tensor smaller than its box
  through pointers, whole boxes, so ``a``'s rows come padded to whole tiles up to
  ``SKINNY_M``, ``tma_inputs``); the store to ``out`` is masked to the chunk's rows. A
  transposed ``b`` arrives as its [N, K] transpose and each tile is transposed in
  registers (``b_trans``), as the recipe.

The body also serves the fp8 twin (``scaled`` and the scales; off and None here, and absent from the
generated kernel). The config is explicit: ``block_sizes`` follow the loops (the tile's m
and n, its k step, per tile loop), from the recipe's ``plan``. Set ``HELION_PRINT_OUTPUT_CODE=1`` to see the
generated Triton.
"""

from __future__ import annotations

import functools

import helion
import helion.language as hl
import torch
import torch.distributed as dist

from kraken._blocks.helion import flat_kernel, run
from kraken.runtime.collectives import helion_all_gather
from kraken._gemm_core import flattens
from kraken._ptx_utils.inline_source import GMEM_WAIT_ASYNC
from kraken.comm.all_gather_with_progress import start as start_gather
from kraken.fused.all_gather_matmul import (  # noqa: F401 (shared with the recipe)
    OP, call, outputs, plan, prepare, tma_inputs,
)
from kraken.runtime.launcher import jit_launch

# The flag (a pointer expression in the snippet): progress + index.
WAIT_FLAG = GMEM_WAIT_ASYNC.replace("{flag}", "{progress} + {index}")
# Per load/store, in program order: the gathered rows and b through TMA, the store to out through pointers.
INDEXING = ("tensor_descriptor", "tensor_descriptor", "pointer")


def all_gather_matmul_body(
    a: torch.Tensor,
    gathered: torch.Tensor,
    b: torch.Tensor,
    scale_a: torch.Tensor | None,  # scaled: fp32 [M] (stride 0 for a per-tensor scale), my rows' scales; None here
    row_scales: torch.Tensor | None,  # scaled: fp32 [world_size * M], each gathered row's scale; None here
    scale_b: torch.Tensor | None,  # scaled: fp32 [N] (stride 0 for a per-tensor scale); None here
    out: torch.Tensor,
    progress: torch.Tensor,
    num_blocks: int,
    rank: int,
    world_size: hl.constexpr,
    b_trans: hl.constexpr,
    scaled: hl.constexpr,  # the fp8 twin's: the epilogue multiplies by the rows' and columns' scales
    block_m: hl.constexpr,
    block_n: hl.constexpr,
    group_m: hl.constexpr,
) -> torch.Tensor:
    k = gathered.size(1)
    m = out.size(0) // world_size
    n = out.size(1)
    tiles_m = (m + block_m - 1) // block_m
    tiles_n = (n + block_n - 1) // block_n
    chunk_tiles = tiles_m * tiles_n
    band_tiles = group_m * tiles_n
    num_tiles = world_size * chunk_tiles
    own_rounds = (chunk_tiles + num_blocks - 1) // num_blocks
    rounds = (num_tiles + num_blocks - 1) // num_blocks
    for block in hl.grid(num_blocks):
        # My rows, from a: block b's tiles b, b + num_blocks, ... of my chunk.
        for rnd in hl.grid(own_rounds):
            tile = block + rnd * num_blocks
            if tile < chunk_tiles:
                band = tile // band_tiles
                band_rows = min(tiles_m - band * group_m, group_m)
                m0 = (band * group_m + tile % band_tiles % band_rows) * block_m
                n0 = tile % band_tiles // band_rows * block_n
                for tile_m, tile_n in hl.tile([m0, n0], [m0 + block_m, n0 + block_n]):
                    acc = hl.zeros([tile_m, tile_n], dtype=torch.float32)
                    for tile_k in hl.tile(0, k):
                        if b_trans:
                            acc = hl.dot(a[tile_m, tile_k], b[tile_n, tile_k].T, acc=acc)
                        else:
                            acc = hl.dot(a[tile_m, tile_k], b[tile_k, tile_n], acc=acc)
                    row_in = tile_m.index < m
                    col_in = tile_n.index < n
                    if scaled:
                        scale_rows = hl.load(scale_a, [tile_m], extra_mask=row_in)
                        scale_cols = hl.load(scale_b, [tile_n], extra_mask=col_in)
                        acc = acc * scale_rows[:, None] * scale_cols[None, :]
                    hl.store(out, [tile_m.index + rank * m, tile_n], acc.to(out.dtype),
                             extra_mask=row_in[:, None] & col_in[None, :])
        # The peers' rows, from the gather buffer: the same block's later tiles (its first may be in the round
        # where its own rows ended), chunk by chunk, rank + 1's first.
        if world_size > 1:
            for rnd in hl.grid(own_rounds - 1, rounds):
                tile = block + rnd * num_blocks
                if tile >= chunk_tiles and tile < num_tiles:
                    step = tile // chunk_tiles
                    # The step of this block's previous tile (0 when it was one of my rows), as the recipe.
                    prev_step = (tile + num_tiles - num_blocks) // chunk_tiles - world_size
                    src = (rank + step) % world_size
                    within = tile % chunk_tiles
                    band = within // band_tiles
                    band_rows = min(tiles_m - band * group_m, group_m)
                    m0 = (band * group_m + within % band_tiles % band_rows) * block_m
                    n0 = within % band_tiles // band_rows * block_n
                    # At a block's first tile of each peer's chunk: the copy engine has landed these rows (acquire),
                    # and TMA will see them (async-proxy fence).
                    if step != prev_step:
                        hl.inline_triton(WAIT_FLAG, args={"progress": progress, "index": src, "value": 1},
                                         output_like=None)
                    row0 = src * m + m0
                    for tile_g, tile_n in hl.tile([row0, n0], [row0 + block_m, n0 + block_n]):
                        acc = hl.zeros([tile_g, tile_n], dtype=torch.float32)
                        for tile_k in hl.tile(0, k):
                            if b_trans:
                                acc = hl.dot(gathered[tile_g, tile_k], b[tile_n, tile_k].T, acc=acc)
                            else:
                                acc = hl.dot(gathered[tile_g, tile_k], b[tile_k, tile_n], acc=acc)
                        # Only the chunk's rows: a tile at its end also read some of the next chunk's, discarded.
                        row_in = tile_g.index < src * m + m
                        col_in = tile_n.index < n
                        if scaled:
                            scale_rows = hl.load(row_scales, [tile_g], extra_mask=row_in)
                            scale_cols = hl.load(scale_b, [tile_n], extra_mask=col_in)
                            acc = acc * scale_rows[:, None] * scale_cols[None, :]
                        hl.store(out, [tile_g, tile_n], acc.to(out.dtype), extra_mask=row_in[:, None] & col_in[None, :])
    return out


@functools.cache
def compiled(block_m: int, block_n: int, block_k: int, num_warps: int, num_stages: int, world_size: int,
             indexing: tuple[str, ...] = INDEXING) -> helion.Kernel:
    """One Helion kernel per tile config, each with an explicit config (``block_sizes``: the tile's m, n and
    k step, per tile loop: one at world size 1, two above; ``indexing`` per load and store of one tile loop: TMA
    through descriptors built on the host, as the recipe's; ``pid_type="flat"``: the recipe's grid, see
    ``helion_ports``)."""
    loops = 1 if world_size == 1 else 2
    # My rows' tile loop (the loop over rounds, Helion's loop 1) flattened as the recipe's (``flattens``).
    flatten = {"range_flattens": (None, True)} if flattens(block_m, block_n) else {}
    return flat_kernel(all_gather_matmul_body, (block_m, block_n, block_k) * loops, num_warps, num_stages,
                       indexing=indexing * loops, host_tensor_descriptors=True, **flatten)


def launch_matmul(
    a: torch.Tensor,
    gathered: torch.Tensor,
    b: torch.Tensor,
    out: torch.Tensor,
    progress: torch.Tensor,
    rank: int,
    world_size: int,
    b_trans: bool,
    block_m: int,
    block_n: int,
    block_k: int,
    group_m: int,
    num_warps: int,
    num_stages: int,
    num_blocks: int,
    launcher=jit_launch,
) -> torch.Tensor:
    """The GEMM alone, on TMA-ready operands (``tma_inputs``; my rows ``a``, the peers' in ``gathered``); mirrors
    the recipe's ``launch_matmul``."""
    args = (
        a, gathered, b, None, None, None, out, progress, num_blocks, rank, world_size, b_trans,
        False, block_m, block_n, group_m,
    )
    run(compiled(block_m, block_n, block_k, num_warps, num_stages, world_size), args, launcher)
    return out


def launch(
    a: torch.Tensor,
    b: torch.Tensor,
    peers: tuple[torch.Tensor, ...],
    gathered: torch.Tensor,
    out: torch.Tensor,
    progress: torch.Tensor,
    signal_pad_ptrs: int,
    rank: int,
    a_out: torch.Tensor | None,
    b_layout: str,
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
    """Launch on prepared arguments (no checks); mirrors ``kraken.fused.all_gather_matmul.launch`` (the
    same gather on the copy engine, then this GEMM)."""
    m = a.shape[0]
    a, b, b_trans = tma_inputs(a, b, b_layout, block_m)
    started = start_gather(peers, signal_pad_ptrs, rank, gathered, progress, stage_from=a if len(a) == m else a[:m],
                           snapshot=a_out, launcher=launcher, flag_own=False)  # my rows: read from a
    launch_matmul(a, gathered, b, out, progress, rank, len(peers), b_trans, block_m, block_n, block_k, group_m,
                  num_warps, num_stages, num_blocks, launcher)
    started.wait()
    return out


def all_gather_matmul(
    a: torch.Tensor,
    b: torch.Tensor,
    group: dist.ProcessGroup | str | None = None,
    return_a: bool = False,
    **config,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """``all_gather(a) @ b`` (and the gathered ``a`` first when ``return_a``); see the kraken recipe."""
    return call(launch, f"helion {OP}", a, b, group, return_a, config, helion_all_gather)
