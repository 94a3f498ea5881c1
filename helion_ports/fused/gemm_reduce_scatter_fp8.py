"""Helion twin of ``kraken.fused.gemm_reduce_scatter_fp8``: same function, same arguments.

The bf16 twin (``helion_ports.fused.gemm_reduce_scatter``) with fp8 operands and the scales applied in
the epilogue of both phases, as the recipe (``plan`` and ``prepare`` are shared). Its body is the bf16
twin's ``gemm_reduce_scatter_body`` with ``b_trans`` and ``scaled`` on and the scales passed in:

* ``hl.grid(num_blocks)`` is the persistent grid, the barrier's block id and the workspace chunk;
* phase 1: the peers' bands, owner ``rank + 1`` first; ``a`` and ``b`` (as [N, K], its tiles transposed
  for ``hl.dot``: K-major for fp8 wgmma) through host-built tensor descriptors, fp32 accumulation, then
  ``acc * scale_a[rows, None] * scale_b[None, cols]`` and the push into this rank's slot of the owner's
  workspace (``hl.store(peers[r], ...)`` for the ``r`` that is the owner);
* phase 2: the own band's tiles, the epoch barrier after the first GEMM (the kraken PTX through
  ``hl.inline_triton``), the peers' partials added from the local workspace in slot order, the band's
  rows stored masked;
* the scales arrive as [M] and [N] views (stride 0 for a per-tensor scale): one code path for both.
"""

from __future__ import annotations

import functools

import helion
import torch
import torch.distributed as dist

from kraken._blocks.helion import flat_kernel, own_storage, run
from kraken.runtime.collectives import helion_reduce_scatter
from helion_ports.fused.gemm_reduce_scatter import gemm_reduce_scatter_body  # the bf16 twin's, scaled
from kraken.fused.gemm_reduce_scatter_fp8 import (  # shared with the recipe
    OP, b_operand, call, chunk_tile, plan, prepare, rounds_of, tma_a,
)
from kraken.runtime.launcher import jit_launch

__all__ = ["chunk_tile", "gemm_reduce_scatter_fp8", "launch", "plan", "prepare", "rounds_of"]


def indexing(world_size: int) -> tuple[str, ...]:
    """Per load/store, in program order: the parity and epoch loads; phase 1's ``a`` and ``b`` through tensor
    descriptors (TMA), its two scale loads and a push per rank; phase 2's ``a`` and ``b`` (TMA), its two scale
    loads, the peers' partials (one load in a loop), ``out``, parity and epoch through pointers."""
    tma = ("tensor_descriptor",) * 2
    return ("pointer",) * 2 + tma + ("pointer",) * (2 + world_size) + tma + ("pointer",) * 6


@functools.cache
def compiled(block_m: int, block_n: int, block_k: int, num_warps: int, num_stages: int, world_size: int) -> helion.Kernel:
    """One Helion kernel per launch configuration (``block_sizes``: phase 1's tile m, n, its k step; phase 2's;
    TMA for ``a`` and ``b`` through host-built descriptors; ``pid_type="flat"``: the recipe's grid)."""
    return flat_kernel(gemm_reduce_scatter_body, (block_m, block_n, block_k) * 2, num_warps, num_stages,
                       indexing=indexing(world_size), host_tensor_descriptors=True)


def launch(
    a: torch.Tensor,
    b: torch.Tensor,
    scale_a: torch.Tensor,
    scale_b: torch.Tensor,
    peers: tuple[torch.Tensor, ...],
    out: torch.Tensor,
    signal_pad_ptrs: int,
    rank: int,
    parity: torch.Tensor,
    epochs: torch.Tensor,
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
    """Launch on prepared arguments (no checks); mirrors ``kraken.fused.gemm_reduce_scatter_fp8.launch``
    (``peers[rank]`` also goes in as ``workspace`` under its own storage: see the bf16 twin)."""
    b, b_trans = b_operand(b, b_layout)  # (a copy, where b is not TMA-ready, is an argument of its own)
    args = (
        tma_a(a), b, scale_a, scale_b, own_storage(peers[rank]), peers, parity, epochs, out, signal_pad_ptrs,
        num_blocks, rank, len(peers), b_trans, True, block_m, block_n, group_m, group_name,
    )
    run(compiled(block_m, block_n, block_k, num_warps, num_stages, len(peers)), args, launcher, scaled_args)
    return out


def scaled_args(args: tuple) -> tuple:
    """``launch``'s arguments as the kernel takes them (``kraken._blocks.helion.run``): the scales as [M] and [N] views."""
    a, b, scale_a, scale_b, workspace, peers, parity, epochs, out, *rest = args
    return (a, b, scale_a.reshape(-1).expand(a.shape[0]), scale_b.reshape(-1).expand(out.shape[1]), workspace, peers,
            parity, epochs, out, *rest)


def gemm_reduce_scatter_fp8(
    a: torch.Tensor,
    b: torch.Tensor,
    scale_a: torch.Tensor,
    scale_b: torch.Tensor,
    group: dist.ProcessGroup | str | None = None,
    out_dtype: torch.dtype = torch.bfloat16,
    **config,
) -> torch.Tensor:
    """This rank's [M / ws, N] rows of ``sum over ranks of _scaled_mm(a, b, scale_a, scale_b)`` (see the recipe),
    in the recipe's form: fused, or ``torch._scaled_mm`` then the twin's reduce-scatter."""
    return call(launch, f"helion {OP}", a, b, scale_a, scale_b, group, out_dtype, config, helion_reduce_scatter)
