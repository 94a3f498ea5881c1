"""Helion twin of ``kraken.fused.all_gather_matmul_fp8``: same function, same arguments.

The staging and the gather are the recipe's (its one-kernel ``stage`` into this rank's chunk of the gather
buffer, then ``kraken.comm.all_gather_with_progress`` on the copy engine), and so are ``plan``,
``prepare``, ``b_operand`` and ``buffer_views``. The GEMM mirrors the recipe's kernel one to one, as the
bf16 twin (``helion_ports.fused.all_gather_matmul``) does:

* ``hl.grid(num_blocks)`` is the persistent grid, tiles ``b, b + num_blocks, ...`` chunk by chunk (own
  rows first), ``group_m``-row bands;
* a block waits for a peer's chunk at its first tile of it (the recipe's ``GMEM_WAIT_ASYNC`` PTX through
  ``hl.inline_triton``); the own rows need no wait;
* the fp8 values of the gathered rows and ``b`` load through host-built tensor descriptors (TMA); ``b``
  arrives as [N, K] and its tiles go to ``hl.dot`` transposed (``b_trans``), fp32 accumulation;
* the epilogue loads each row's scale from the gathered rows (``row_scales``, a strided fp32 view of the
  buffer) and the column scales (``scale_b`` as an [N] view: stride 0 for a per-tensor scale), masked to
  the chunk's rows and to N, and stores bf16.
"""

from __future__ import annotations

import functools

import helion
import helion.language as hl
import torch
import torch.distributed as dist

from helion_ports import flat_kernel, run
from helion_ports.fused.all_gather_matmul import WAIT_FLAG  # the bf16 twin's flag wait
from kraken import host
from kraken.comm.all_gather_with_progress import start as start_gather
from kraken.fused.all_gather_matmul_fp8 import (  # noqa: F401 (shared with the recipe)
    OP, OUT_DTYPE, b_operand, buffer_views, plan, prepare, row_bytes, stage,
)

# Per load/store, in program order: the gathered rows and b through TMA; the row and column scales and the
# store to out through pointers.
INDEXING = ("tensor_descriptor", "tensor_descriptor", "pointer", "pointer", "pointer")


def all_gather_matmul_fp8_body(
    values: torch.Tensor,
    b: torch.Tensor,
    row_scales: torch.Tensor,
    scale_b: torch.Tensor,
    out: torch.Tensor,
    progress: torch.Tensor,
    num_blocks: int,
    rank: int,
    world_size: hl.constexpr,
    b_trans: hl.constexpr,
    block_m: hl.constexpr,
    block_n: hl.constexpr,
    group_m: hl.constexpr,
) -> torch.Tensor:
    k = values.size(1)
    m = out.size(0) // world_size
    n = out.size(1)
    tiles_m = (m + block_m - 1) // block_m
    tiles_n = (n + block_n - 1) // block_n
    chunk_tiles = tiles_m * tiles_n
    band_tiles = group_m * tiles_n
    num_tiles = world_size * chunk_tiles
    rounds = (num_tiles + num_blocks - 1) // num_blocks
    for block in hl.grid(num_blocks):
        for rnd in hl.grid(rounds):
            tile = block + rnd * num_blocks
            if tile < num_tiles:
                step = tile // chunk_tiles  # 0: my rows, then rank + 1's, rank + 2's, ...
                prev_step = (tile + num_tiles - num_blocks) // chunk_tiles - world_size
                src = (rank + step) % world_size
                within = tile % chunk_tiles
                band = within // band_tiles
                band_rows = min(tiles_m - band * group_m, group_m)
                m0 = (band * group_m + within % band_tiles % band_rows) * block_m
                n0 = within % band_tiles // band_rows * block_n
                # A peer's rows and scales have landed (acquire; async-proxy fence for TMA): at the block's first
                # tile of each peer's chunk. My own rows were staged by earlier kernels on this stream.
                if step != prev_step and step > 0:
                    hl.inline_triton(WAIT_FLAG, args={"progress": progress, "index": src, "value": 1}, output_like=None)
                row0 = src * m + m0
                for tile_g, tile_n in hl.tile([row0, n0], [row0 + block_m, n0 + block_n]):
                    acc = hl.zeros([tile_g, tile_n], dtype=torch.float32)
                    for tile_k in hl.tile(0, k):
                        if b_trans:
                            acc = hl.dot(values[tile_g, tile_k], b[tile_n, tile_k].T, acc=acc)
                        else:
                            acc = hl.dot(values[tile_g, tile_k], b[tile_k, tile_n], acc=acc)
                    row_in = tile_g.index < src * m + m  # the chunk's rows only
                    col_in = tile_n.index < n
                    scale_rows = hl.load(row_scales, [tile_g], extra_mask=row_in)
                    scale_cols = hl.load(scale_b, [tile_n], extra_mask=col_in)
                    acc = acc * scale_rows[:, None] * scale_cols[None, :]
                    hl.store(out, [tile_g, tile_n], acc.to(out.dtype), extra_mask=row_in[:, None] & col_in[None, :])
    return out


@functools.cache
def compiled(block_m: int, block_n: int, block_k: int, num_warps: int, num_stages: int) -> helion.Kernel:
    """One Helion kernel per tile config (``block_sizes``: the tile's m, n and k step; TMA through host-built
    descriptors for the values and b; ``pid_type="flat"``: the recipe's grid)."""
    return flat_kernel(all_gather_matmul_fp8_body, (block_m, block_n, block_k), num_warps, num_stages,
                       indexing=INDEXING, host_tensor_descriptors=True)


def launch_matmul(
    gathered: torch.Tensor,
    b: torch.Tensor,
    scale_b: torch.Tensor,
    out: torch.Tensor,
    progress: torch.Tensor,
    rank: int,
    world_size: int,
    k: int,
    b_trans: bool,
    block_m: int,
    block_n: int,
    block_k: int,
    group_m: int,
    num_warps: int,
    num_stages: int,
    num_blocks: int,
    launcher=host.jit_launch,
) -> torch.Tensor:
    """The GEMM alone; mirrors the recipe's ``launch_matmul``."""
    values, row_scales = buffer_views(gathered, k)
    args = (
        values, b, row_scales, scale_b.reshape(-1).expand(out.shape[1]), out, progress, num_blocks, rank,
        world_size, b_trans, block_m, block_n, group_m,
    )
    run(compiled(block_m, block_n, block_k, num_warps, num_stages), args, launcher)
    return out


def launch(
    a: torch.Tensor,
    b: torch.Tensor,
    scale_a: torch.Tensor,
    scale_b: torch.Tensor,
    peers: tuple[torch.Tensor, ...],
    gathered: torch.Tensor,
    own_values: torch.Tensor,
    own_scales: torch.Tensor,
    out: torch.Tensor,
    progress: torch.Tensor,
    signal_pad_ptrs: int,
    rank: int,
    b_layout: str,
    block_m: int,
    block_n: int,
    block_k: int,
    group_m: int,
    num_warps: int,
    num_stages: int,
    num_blocks: int,
    group_name: str = "",
    launcher=host.jit_launch,
) -> torch.Tensor:
    """Launch on prepared arguments (no checks); mirrors ``kraken.fused.all_gather_matmul_fp8.launch``."""
    b, b_trans = b_operand(b, b_layout)
    stage(a, scale_a, own_values, own_scales, launcher)
    started = start_gather(peers, signal_pad_ptrs, rank, gathered, progress, launcher=launcher)
    launch_matmul(gathered, b, scale_b, out, progress, rank, len(peers), a.shape[1], b_trans, block_m, block_n,
                  block_k, group_m, num_warps, num_stages, num_blocks, launcher)
    started.wait()
    return out


def all_gather_matmul_fp8(
    a: torch.Tensor,
    b: torch.Tensor,
    scale_a: torch.Tensor,
    scale_b: torch.Tensor,
    group: dist.ProcessGroup | str | None = None,
    **config,
) -> torch.Tensor:
    """``_scaled_mm(all_gather(a), b, all_gather(scale_a), scale_b)`` in bf16; see the kraken recipe."""
    ctx, cfg = prepare(a, b, scale_a, scale_b, group, f"helion {OP}", config)
    out = torch.empty(cfg["gathered"].shape[0], b.shape[1], dtype=OUT_DTYPE, device=a.device)
    return launch(a, b, scale_a, scale_b, signal_pad_ptrs=ctx.signal_pad_ptrs, rank=ctx.rank, out=out, **cfg,
                  group_name=ctx.group_name)
