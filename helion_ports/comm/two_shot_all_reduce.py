"""Helion twin of ``kraken.comm.two_shot_all_reduce``: in place, same arguments.

Same structure as the Triton recipe: ``hl.grid(num_blocks)`` is the persistent
grid and the barrier's block id; the kraken barriers come in through
``hl.inline_triton``; the peers arrive as one tuple, read and written
(``hl.store`` into ``peers[r]``) under ``hl.static_range(world_size)``.
"""

from __future__ import annotations

import functools

import helion
import helion.language as hl
import torch
import torch.distributed as dist

from kraken._blocks.helion import copy_into, flat_kernel, run, stage, views
from kraken._ptx_utils.inline_source import SYMM_MEM_SYNC
from kraken.comm.two_shot_all_reduce import plan, prepare, prepare_call  # shared with the Triton recipe
from kraken.runtime import staging
from kraken.runtime.launcher import jit_launch

# "Peers' inputs are ready" (acquire), then "my pushes are visible / yours are" (release + acquire).
SYNC_START = SYMM_MEM_SYNC[(False, True)]
SYNC_END = SYMM_MEM_SYNC[(True, True)]


def two_shot_all_reduce_body(
    local: torch.Tensor,
    peers: tuple[torch.Tensor, ...],
    signal_pad_ptrs: int,
    num_blocks: int,
    shard: int,
    chunk: int,
    rank: int,
    world_size: hl.constexpr,
    group_name: hl.ProcessGroupName,
) -> None:
    # The size comes from the top-level ``local`` (this rank's buffer, also peers[rank]): Helion 1.5.0
    # does not re-specialize on the sizes of tensors that are only inside a tuple, so a kernel first
    # compiled for numel=1 was reused for numel=7 (see the README's Helion notes).
    numel = local.size(0)
    for block in hl.grid(num_blocks):
        barrier = {"signal_pad_ptrs": signal_pad_ptrs, "block_id": block, "rank": rank, "world_size": world_size}
        hl.inline_triton(SYNC_START, args=barrier, output_like=None)
        start = rank * shard + block * chunk
        # The range is clipped here, as in the recipe, rather than masked per element: with one bound,
        # ptxas issues the peers' loads as the recipe's do (see the one-shot twin).
        for tile in hl.tile(start, min(start + chunk, min(rank * shard + shard, numel))):
            acc = hl.zeros([tile], dtype=torch.float32)
            for r in hl.static_range(world_size):
                acc = acc + hl.load(peers[r], [tile]).to(torch.float32)
            result = acc.to(local.dtype)
            for r in hl.static_range(world_size):
                hl.store(peers[r], [tile], result)
        hl.inline_triton(SYNC_END, args=barrier, output_like=None)


@functools.cache
def compiled(block_size: int, num_warps: int) -> helion.Kernel:
    """One Helion kernel per launch configuration, each with an explicit config.

    ``pid_type="flat"``: the recipe's grid, one program per block (see ``helion_ports``).
    """
    return flat_kernel(two_shot_all_reduce_body, (block_size,), num_warps)


def launch(
    peers: tuple[torch.Tensor, ...],
    signal_pad_ptrs: int,
    rank: int,
    block_size: int,
    num_warps: int,
    num_blocks: int,
    shard: int,
    chunk: int,
    wide: bool = False,
    group_name: str = "",
    launcher=jit_launch,
    x: torch.Tensor | None = None,
) -> torch.Tensor:
    """Launch on prepared arguments (no checks); mirrors ``kraken.comm.two_shot_all_reduce.launch`` (an ordinary
    ``x`` is staged by a copy launch, ``kraken._blocks.helion.stage``, and the sum copied back into it). ``wide`` (past
    2**31 elements) is refused on every rank before any launch: the shard's start, ``rank * shard``, is a product of
    scalars that Triton types 32-bit from their values, whatever index width Helion picks for the tensors."""
    if wide:
        raise ValueError(f"helion two_shot_all_reduce: {len(peers)} shards of {shard} elements pass 2**31 - 1; the "
                         "twin addresses 32 bits (kraken.comm.two_shot_all_reduce takes such tensors)")
    if x is not None:
        stage(peers, rank, x, group_name, launcher)
    flat_peers = views(peers, -1)
    args = (
        flat_peers[rank], flat_peers, signal_pad_ptrs, num_blocks, shard, chunk, rank, len(peers), group_name,
    )
    run(compiled(block_size, num_warps), args, launcher)
    if x is None:
        return peers[rank]
    copy_into(x, peers[rank][:x.numel()], group_name, launcher)
    return x


def two_shot_all_reduce(
    tensor: torch.Tensor, group: dist.ProcessGroup | str | None = None, **config
) -> torch.Tensor:
    """Sum ``tensor`` over the group in place and return it (see the kraken recipe)."""
    ctx, launch_cfg, staged = prepare_call(tensor, group, "helion two_shot_all_reduce", config)
    return staging.launched(launch, ctx, launch_cfg, staged, tensor)
