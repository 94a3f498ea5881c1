"""Helion twin of ``kraken.fused.one_shot_all_reduce_bias_rms_norm``: same function, same arguments.

Same structure as the Triton recipe: ``hl.grid(num_blocks)`` with
``pid_type="flat"`` launches exactly the recipe's persistent grid (one program
per block, the barrier's block id); each block walks its rows with
``hl.tile(start, start + rows_per_block, block_size=1)``, a row being one
``[1, hidden]`` tile (the ``:`` index is Helion's persistent reduction
dimension, ``BLOCK_H`` in Triton). The staging copy goes to this rank's
workspace, passed as its own argument; the barriers are the kraken PTX through
``hl.inline_triton``; the row math is ``helion_ports.fused.rms_norm.rms_normalize``.
"""

from __future__ import annotations

import functools

import helion
import helion.language as hl
import torch
import torch.distributed as dist

from helion_ports.fused.rms_norm import rms_normalize
from kraken._blocks.helion import flat_kernel, own_storage, run, views
from kraken._ptx_utils.inline_source import SYMM_MEM_SYNC
from kraken.fused.one_shot_all_reduce_bias import staged_call  # the family's call
from kraken.fused.one_shot_all_reduce_bias_rms_norm import plan, prepare, signature  # shared with the recipe
from kraken.runtime.launcher import jit_launch

# "My staged rows are visible / yours are" (release + acquire), then "done reading yours" (release).
SYNC_STAGED = SYMM_MEM_SYNC[(True, True)]
SYNC_DONE = SYMM_MEM_SYNC[(True, False)]


def one_shot_all_reduce_bias_rms_norm_body(
    x: torch.Tensor,
    bias: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    workspace: torch.Tensor,
    peers: tuple[torch.Tensor, ...],
    out: torch.Tensor,
    signal_pad_ptrs: int,
    num_blocks: int,
    rows_per_block: int,
    rank: int,
    world_size: hl.constexpr,
    group_name: hl.ProcessGroupName,
) -> torch.Tensor:
    tokens = x.size(0)
    for block in hl.grid(num_blocks):
        barrier = {"signal_pad_ptrs": signal_pad_ptrs, "block_id": block, "rank": rank, "world_size": world_size}
        start = block * rows_per_block
        # Ranges are clipped, as in the recipe, rather than masked per row: with one bound ptxas
        # batches the peers' loads as it does for the recipe (the CPU tests compare the schedules).
        for rows in hl.tile(start, min(start + rows_per_block, tokens), block_size=1):
            hl.store(workspace, [rows, slice(None)], hl.load(x, [rows, slice(None)]))
        # The same for every row, and not written by peers: loaded once, while the barrier waits.
        bias_row = hl.load(bias, [slice(None)]).to(torch.float32)[None, :]
        weight_row = hl.load(weight, [slice(None)]).to(torch.float32)[None, :]
        hl.inline_triton(SYNC_STAGED, args=barrier, output_like=None)
        for rows in hl.tile(start, min(start + rows_per_block, tokens), block_size=1):
            # Start from rank 0's row (as sum_peers does): hl.zeros([rows, hidden]) would need hidden specialized.
            h = hl.load(peers[0], [rows, slice(None)]).to(torch.float32)
            for r in hl.static_range(world_size):  # not (1, world_size): docs/helion-notes.md
                if r > 0:  # rank order, from rank 0's value, as in the recipe (folded at compile time)
                    h = h + hl.load(peers[r], [rows, slice(None)]).to(torch.float32)
            h = h + bias_row
            y = rms_normalize(h, weight_row, eps)
            hl.store(out, [rows, slice(None)], y.to(out.dtype))
        hl.inline_triton(SYNC_DONE, args=barrier, output_like=None)
    return out


@functools.cache
def compiled(num_warps: int) -> helion.Kernel:
    """One Helion kernel per launch configuration, each with an explicit config.

    ``pid_type="flat"``: the recipe's grid, one program per block (see ``helion_ports``).
    """
    return flat_kernel(one_shot_all_reduce_bias_rms_norm_body, (), num_warps)


def launch(
    x: torch.Tensor,
    bias: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    peers: tuple[torch.Tensor, ...],
    out: torch.Tensor,
    signal_pad_ptrs: int,
    rank: int,
    num_warps: int,
    num_blocks: int,
    rows_per_block: int,
    group_name: str = "",
    launcher=jit_launch,
) -> torch.Tensor:
    """Launch on prepared arguments (no checks); mirrors the kraken recipe's ``launch``."""
    # `workspace` through its own storage object: see kraken._blocks.helion.own_storage.
    args = (x, bias, weight, float(eps), own_storage(peers[rank]), peers, out, signal_pad_ptrs, num_blocks,
            rows_per_block, rank, len(peers), group_name)
    run(compiled(num_warps), args, launcher, row_args)
    return out


def row_args(args: tuple) -> tuple:
    """``launch``'s arguments as the kernel takes them (``kraken._blocks.helion.run``): the workspaces as ``x``'s rows."""
    x, bias, weight, eps, workspace, peers, *rest = args
    return (x, bias, weight, eps, workspace.view(x.shape), views(peers, x.shape), *rest)


def one_shot_all_reduce_bias_rms_norm(
    x: torch.Tensor,
    bias: torch.Tensor,
    weight: torch.Tensor,
    eps: float = 1e-5,
    group: dist.ProcessGroup | str | None = None,
    **config,
) -> torch.Tensor:
    """RMSNorm(``sum over ranks of x`` + ``bias``) * ``weight``; a new tensor (see the kraken recipe)."""
    op = "helion one_shot_all_reduce_bias_rms_norm"
    return staged_call(launch, op, x, (bias, weight, eps), signature(x, bias, weight, eps, group, op, config))
