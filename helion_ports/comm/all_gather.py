"""Helion twin of ``kraken.comm.all_gather``: same function, same arguments.

The structure mirrors the Triton recipe one to one: ``hl.grid(num_blocks)`` is
the persistent grid and the barrier's block id; the barriers are the kraken PTX
through ``hl.inline_triton``; the shards arrive as one tuple, rotated so that it
starts with rank ``rank + 1`` and ends with this rank's own, and each step loads
the tile from every shard (``hl.static_range(world_size)``) before it stores any.

Set ``HELION_PRINT_OUTPUT_CODE=1`` to see the generated Triton.
"""

from __future__ import annotations

import functools

import helion
import helion.language as hl
import torch
import torch.distributed as dist

from kraken._blocks.helion import flat_kernel, flat_view, run, stage, views
from kraken._ptx_utils.inline_source import SYMM_MEM_SYNC
from kraken.comm.all_gather import plan, prepare, prepare_call  # shared with the Triton recipe
from kraken.runtime import staging
from kraken.runtime.launcher import jit_launch

# The barriers: "peers' shards are ready" (acquire) and "done reading peers" (release).
SYNC_START = SYMM_MEM_SYNC[(False, True)]
SYNC_END = SYMM_MEM_SYNC[(True, False)]


def all_gather_body(
    out: torch.Tensor,
    local: torch.Tensor,
    sources: tuple[torch.Tensor, ...],
    signal_pad_ptrs: int,
    num_blocks: int,
    chunk: int,
    rank: int,
    world_size: hl.constexpr,
    group_name: hl.ProcessGroupName,
) -> torch.Tensor:
    # The size comes from the top-level ``local`` (this rank's shard, also the last source): Helion 1.5.0
    # does not re-specialise on the sizes of tensors that sit only inside a tuple (README, Helion notes).
    shard = local.size(0)
    for block in hl.grid(num_blocks):
        barrier = {"signal_pad_ptrs": signal_pad_ptrs, "block_id": block, "rank": rank, "world_size": world_size}
        hl.inline_triton(SYNC_START, args=barrier, output_like=None)
        start = block * chunk
        for tile in hl.tile(start, min(start + chunk, shard)):
            values = [hl.load(sources[i], [tile]) for i in hl.static_range(world_size)]
            for i in hl.static_range(world_size):
                hl.store(out, [tile.index + ((rank + 1 + i) % world_size) * shard], values[i])
        hl.inline_triton(SYNC_END, args=barrier, output_like=None)
    return out


@functools.cache
def compiled(block_size: int, num_warps: int) -> helion.Kernel:
    """One Helion kernel per launch configuration, each with an explicit config (``pid_type="flat"``)."""
    return flat_kernel(all_gather_body, (block_size,), num_warps)


def launch(
    peers: tuple[torch.Tensor, ...],
    out: torch.Tensor,
    signal_pad_ptrs: int,
    rank: int,
    block_size: int,
    num_warps: int,
    num_blocks: int,
    chunk: int,
    wide: bool = False,  # unused: Helion picks 64-bit indices itself from the tensors' sizes
    group_name: str = "",
    launcher=jit_launch,
    x: torch.Tensor | None = None,
) -> torch.Tensor:
    """Launch on prepared arguments (no checks); mirrors ``kraken.comm.all_gather.launch`` (an ordinary ``x`` is staged by a
    copy launch: ``kraken._blocks.helion.stage``)."""
    if x is not None:
        stage(peers, rank, x, group_name, launcher)
    flat = views(peers, -1)
    sources = flat[rank + 1:] + flat[:rank + 1]
    args = (
        flat_view(out), flat[rank], sources, signal_pad_ptrs, num_blocks, chunk, rank, len(peers), group_name,
    )
    run(compiled(block_size, num_warps), args, launcher)
    return out


def all_gather(tensor: torch.Tensor, group: dist.ProcessGroup | str | None = None, **config) -> torch.Tensor:
    """Every rank's ``tensor`` stacked along the first dimension in rank order (see the kraken recipe)."""
    ctx, launch_cfg, staged = prepare_call(tensor, group, "helion all_gather", config)
    out = staging.new_rows(tensor, ctx.world_size * tensor.shape[0])
    return staging.launched(launch, ctx, launch_cfg, staged, tensor, out)
