"""Helion twin of ``kraken.fused.all_gather_matmul_fp8``: same function, same arguments.

The staging kernel and the gather are the recipe's (its one-kernel ``stage`` into this rank's chunk of the
gather buffer, launched on the gather's side stream for the peers; then ``kraken.comm.all_gather_with_progress``
on the copy engine), and so are ``plan``, ``prepare``, ``b_operand`` and ``buffer_views``. The GEMM is the bf16
twin's kernel (``helion_ports.fused.all_gather_matmul``) with ``scaled`` on, mirroring the recipe's kernel:

* ``hl.grid(num_blocks)`` is the persistent grid, tiles ``b, b + num_blocks, ...`` chunk by chunk (own
  rows first, from ``a`` and ``scale_a``; then the peers', from the buffer), ``group_m``-row bands;
* a block waits for a peer's chunk at its first tile of it (the recipe's ``GMEM_WAIT_ASYNC`` PTX through
  ``hl.inline_triton``); the own rows need no wait;
* the fp8 values of ``a``, of the gathered rows and ``b`` load through host-built tensor descriptors (TMA);
  ``b`` arrives as [N, K] and its tiles go to ``hl.dot`` transposed (``b_trans``), fp32 accumulation;
* the epilogue loads the rows' scales (``scale_a`` as an [M] view, or each gathered row's from the buffer,
  ``row_scales``, a strided fp32 view) and the column scales (``scale_b`` as an [N] view: stride 0 for a
  per-tensor scale), masked to the chunk's rows and to N, and stores bf16.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from kraken._blocks.helion import run
from kraken.runtime.collectives import helion_all_gather
from helion_ports.fused.all_gather_matmul import compiled  # the bf16 twin's kernel, scaled
from kraken._gemm_core import tma_fp8
from kraken.comm.all_gather_with_progress import start as start_gather
from kraken.fused.all_gather_matmul_fp8 import (  # noqa: F401 (shared with the recipe)
    OP, OUT_DTYPE, b_operand, buffer_views, call, plan, prepare, row_bytes, stage,
)
from kraken.runtime.launcher import jit_launch

# Per load/store of one tile loop, in program order: the rows (a's or the buffer's) and b through TMA; the row and
# column scales and the store to out through pointers.
INDEXING = ("tensor_descriptor", "tensor_descriptor", "pointer", "pointer", "pointer")


def launch_matmul(
    a: torch.Tensor,
    scale_a: torch.Tensor,
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
    launcher=jit_launch,
) -> torch.Tensor:
    """The GEMM alone; mirrors the recipe's ``launch_matmul``: my rows from ``a`` (TMA-ready, ``tma_fp8``) and
    ``scale_a``, the peers' rows and scales from the gather buffer."""
    values, row_scales = buffer_views(gathered, k)
    m, n = out.shape[0] // world_size, out.shape[1]
    args = (
        a, values, b, scale_a.reshape(-1).expand(m), row_scales, scale_b.reshape(-1).expand(n), out, progress,
        num_blocks, rank, world_size, b_trans, True, block_m, block_n, group_m,
    )
    run(compiled(block_m, block_n, block_k, num_warps, num_stages, world_size, INDEXING), args, launcher)
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
    launcher=jit_launch,
) -> torch.Tensor:
    """Launch on prepared arguments (no checks); mirrors ``kraken.fused.all_gather_matmul_fp8.launch``."""
    b, b_trans = b_operand(b, b_layout)
    started = start_gather(peers, signal_pad_ptrs, rank, gathered, progress, launcher=launcher, flag_own=False,
                           stage_launch=lambda: stage(a, scale_a, own_values, own_scales, launcher))
    launch_matmul(tma_fp8(a, block_m), scale_a, gathered, b, scale_b, out, progress, rank, len(peers), a.shape[1],
                  b_trans, block_m, block_n, block_k, group_m, num_warps, num_stages, num_blocks, launcher)
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
    return call(launch, f"helion {OP}", a, b, scale_a, scale_b, group, config, helion_all_gather)
