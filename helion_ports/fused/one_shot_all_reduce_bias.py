"""Helion twin of ``kraken.fused.one_shot_all_reduce_bias``: same function, same arguments.

Mirrors the Triton recipe step for step: ``hl.grid(num_blocks)`` is the
persistent grid and the barrier's block id; the first ``hl.tile`` loop stages
the block's chunk of ``x`` into this rank's workspace (passed as its own
argument: Helion cannot store through ``peers[rank]`` with a runtime rank); the
kraken barriers come in through ``hl.inline_triton``; the second loop sums the
peers (a tuple walked with ``hl.static_range``) and adds the bias, gathered by
column with ``tile.index % hidden``.

Set ``HELION_PRINT_OUTPUT_CODE=1`` to see the generated Triton.
"""

from __future__ import annotations

import functools

import helion
import helion.language as hl
import torch
import torch.distributed as dist

from kraken._blocks.helion import flat_kernel, own_storage, run, views
from kraken._ptx_utils.inline_source import SYMM_MEM_SYNC
from kraken.fused.one_shot_all_reduce_bias import plan, prepare, signature, staged_call  # shared with the recipe
from kraken.runtime.launcher import jit_launch

# "My staged chunk is visible / yours is" (release + acquire), then "done reading yours" (release).
SYNC_STAGED = SYMM_MEM_SYNC[(True, True)]
SYNC_DONE = SYMM_MEM_SYNC[(True, False)]


def one_shot_all_reduce_bias_body(
    x: torch.Tensor,
    bias: torch.Tensor,
    workspace: torch.Tensor,
    peers: tuple[torch.Tensor, ...],
    out: torch.Tensor,
    signal_pad_ptrs: int,
    num_blocks: int,
    chunk: int,
    rank: int,
    world_size: hl.constexpr,
    group_name: hl.ProcessGroupName,
) -> torch.Tensor:
    numel = x.size(0)
    hidden = bias.size(0)
    for block in hl.grid(num_blocks):
        barrier = {"signal_pad_ptrs": signal_pad_ptrs, "block_id": block, "rank": rank, "world_size": world_size}
        start = block * chunk
        # Ranges are clipped, as in the recipe, rather than masked per element: with one bound ptxas
        # batches the peers' loads as it does for the recipe (the CPU tests compare the schedules).
        for tile in hl.tile(start, min(start + chunk, numel)):
            hl.store(workspace, [tile], hl.load(x, [tile]))
        hl.inline_triton(SYNC_STAGED, args=barrier, output_like=None)
        for tile in hl.tile(start, min(start + chunk, numel)):
            acc = hl.load(peers[0], [tile]).to(torch.float32)
            for r in hl.static_range(world_size):  # not (1, world_size): docs/helion-notes.md
                if r > 0:  # rank order, from rank 0's value, as in the recipe (folded at compile time)
                    acc = acc + hl.load(peers[r], [tile]).to(torch.float32)
            acc = acc + hl.load(bias, [tile.index % hidden]).to(torch.float32)
            hl.store(out, [tile], acc.to(out.dtype))
        hl.inline_triton(SYNC_DONE, args=barrier, output_like=None)
    return out


@functools.cache
def compiled(block_size: int, num_warps: int) -> helion.Kernel:
    """One Helion kernel per launch configuration, each with an explicit config.

    ``pid_type="flat"``: the recipe's grid, one program per block (see ``helion_ports``).
    """
    return flat_kernel(one_shot_all_reduce_bias_body, (block_size, block_size), num_warps)


def launch(
    x: torch.Tensor,
    bias: torch.Tensor,
    peers: tuple[torch.Tensor, ...],
    out: torch.Tensor,
    signal_pad_ptrs: int,
    rank: int,
    block_size: int,
    num_warps: int,
    num_blocks: int,
    chunk: int,
    group_name: str = "",
    launcher=jit_launch,
) -> torch.Tensor:
    """Launch on prepared arguments (no checks); mirrors ``kraken.fused.one_shot_all_reduce_bias.launch``."""
    # `workspace` through its own storage object: see kraken._blocks.helion.own_storage. The workspace is flat already.
    args = (x, bias, own_storage(peers[rank]), peers, out, signal_pad_ptrs, num_blocks, chunk, rank, len(peers),
            group_name)
    run(compiled(block_size, num_warps), args, launcher, flat_args)
    return out


def flat_args(args: tuple) -> tuple:
    """``launch``'s arguments as the kernel takes them: ``x``, the peers and ``out`` flat (``kraken._blocks.helion.run``)."""
    x, bias, workspace, peers, out, *rest = args
    return (x.view(-1), bias, workspace, views(peers, -1), out.view(-1), *rest)


def one_shot_all_reduce_bias(
    x: torch.Tensor, bias: torch.Tensor, group: dist.ProcessGroup | str | None = None, **config
) -> torch.Tensor:
    """``sum over ranks of x`` + ``bias``; a new tensor (see the kraken recipe)."""
    op = "helion one_shot_all_reduce_bias"
    return staged_call(launch, op, x, (bias,), signature(x, bias, group, op, config))
