"""Helion twin of ``kraken.fused.two_shot_all_reduce_bias``: same function, same arguments.

Same five steps as the Triton recipe. The workspaces arrive as ``[2, numel]``
views (row 0: staged input, row 1: pushed result), so "the result region" is
index ``1`` rather than a pointer offset, and their result rows once more as
views of their own (``results``: see ``kraken._blocks.helion.views``), which the pushes
``hl.store(results[r], ...)`` write. ``hl.static_range(world_size)`` over the
shard owners unrolls the staging and gathering loops exactly like
``tl.static_range`` in the Triton kernel.
"""

from __future__ import annotations

import functools

import helion
import helion.language as hl
import torch
import torch.distributed as dist

from kraken._blocks.helion import flat_kernel, own_storage, run, views
from kraken._ptx_utils.inline_source import SYMM_MEM_SYNC
from kraken.fused.one_shot_all_reduce_bias import staged_call  # the family's call
from kraken.fused.two_shot_all_reduce_bias import plan, prepare, signature  # shared with the recipe
from kraken.runtime.launcher import jit_launch

# Both barriers: "my writes are visible to you" (release) and "yours to me" (acquire).
SYNC = SYMM_MEM_SYNC[(True, True)]


def two_shot_all_reduce_bias_body(
    x: torch.Tensor,
    bias: torch.Tensor,
    workspace: torch.Tensor,
    peers: tuple[torch.Tensor, ...],
    results: tuple[torch.Tensor, ...],
    out: torch.Tensor,
    signal_pad_ptrs: int,
    num_blocks: int,
    shard: int,
    chunk: int,
    rank: int,
    world_size: hl.constexpr,
    group_name: hl.ProcessGroupName,
) -> torch.Tensor:
    numel = x.size(0)
    hidden = bias.size(0)
    for block in hl.grid(num_blocks):
        barrier = {"signal_pad_ptrs": signal_pad_ptrs, "block_id": block, "rank": rank, "world_size": world_size}
        for owner in hl.static_range(world_size):
            start = owner * shard + block * chunk
            # Ranges are clipped, as in the recipe, rather than masked per element: with one bound ptxas
            # batches the peers' loads as it does for the recipe (the CPU tests compare the schedules).
            for tile in hl.tile(start, min(start + chunk, min(owner * shard + shard, numel))):
                hl.store(workspace, [0, tile], hl.load(x, [tile]))
        hl.inline_triton(SYNC, args=barrier, output_like=None)
        start = rank * shard + block * chunk
        for tile in hl.tile(start, min(start + chunk, min(rank * shard + shard, numel))):
            acc = hl.load(peers[0], [0, tile]).to(torch.float32)
            for r in hl.static_range(world_size):  # not (1, world_size): docs/helion-notes.md
                if r > 0:  # rank order, from rank 0's value, as in the recipe (folded at compile time)
                    acc = acc + hl.load(peers[r], [0, tile]).to(torch.float32)
            acc = acc + hl.load(bias, [tile.index % hidden]).to(torch.float32)
            result = acc.to(out.dtype)
            # Into views of the result regions, not peers[r][1, ...]: ptxas then issued 3 of the 4 peers' loads
            # before the first add at 4 ranks (the recipe 4) and 3 of 8 at 8 (the recipe 5); see kraken._blocks.helion.views.
            for r in hl.static_range(world_size):
                hl.store(results[r], [tile], result)
        hl.inline_triton(SYNC, args=barrier, output_like=None)
        for owner in hl.static_range(world_size):
            start = owner * shard + block * chunk
            for tile in hl.tile(start, min(start + chunk, min(owner * shard + shard, numel))):
                hl.store(out, [tile], hl.load(workspace, [1, tile]))
    return out


@functools.cache
def compiled(block_size: int, num_warps: int) -> helion.Kernel:
    """One Helion kernel per launch configuration, each with an explicit config.

    ``pid_type="flat"``: the recipe's grid, one program per block (see ``helion_ports``).
    """
    return flat_kernel(two_shot_all_reduce_bias_body, (block_size,) * 3, num_warps)


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
    shard: int,
    chunk: int,
    group_name: str = "",
    launcher=jit_launch,
) -> torch.Tensor:
    """Launch on prepared arguments (no checks); mirrors ``kraken.fused.two_shot_all_reduce_bias.launch``."""
    # `workspace` through its own storage object: see kraken._blocks.helion.own_storage.
    args = (x, bias, own_storage(peers[rank]), peers, out, signal_pad_ptrs, num_blocks, shard, chunk, rank, len(peers),
            group_name)
    run(compiled(block_size, num_warps), args, launcher, region_args)
    return out


def region_args(args: tuple) -> tuple:
    """``launch``'s arguments as the kernel takes them (``kraken._blocks.helion.run``): ``x`` and ``out`` flat, the
    workspaces as their two regions [2, numel] (staged input, reduced shard), and the peers' second regions."""
    x, bias, workspace, peers, out, *rest = args
    regions = (2, x.numel())
    return (x.view(-1), bias, workspace.view(regions), views(peers, regions), views(peers, regions, 1), out.view(-1),
            *rest)


def two_shot_all_reduce_bias(
    x: torch.Tensor, bias: torch.Tensor, group: dist.ProcessGroup | str | None = None, **config
) -> torch.Tensor:
    """``sum over ranks of x`` + ``bias``, sharded reduction; a new tensor (see the kraken recipe)."""
    op = "helion two_shot_all_reduce_bias"
    return staged_call(launch, op, x, (bias,), signature(x, bias, group, op, config))
