"""Helion twin of ``kraken.comm.reduce_scatter``: same function, same arguments.

The structure mirrors the Triton recipe one to one: ``hl.grid(num_blocks)`` is
the persistent grid and the barrier's block id; the barriers are the kraken PTX
through ``hl.inline_triton``; the peers arrive as one tuple walked with
``hl.static_range(world_size)`` in rank order, accumulating in fp32.

Set ``HELION_PRINT_OUTPUT_CODE=1`` to see the generated Triton.
"""

from __future__ import annotations

import functools

import helion
import helion.language as hl
import torch
import torch.distributed as dist

from kraken._blocks.helion import flat_kernel, flat_view, run, stage
from kraken._ptx_utils.inline_source import SYMM_MEM_SYNC
from kraken.comm.reduce_scatter import plan, prepare, prepare_call  # shared with the Triton recipe
from kraken.runtime import staging
from kraken.runtime.launcher import jit_launch

# The barriers: "peers' inputs are ready" (acquire) and "done reading peers" (release).
SYNC_START = SYMM_MEM_SYNC[(False, True)]
SYNC_END = SYMM_MEM_SYNC[(True, False)]


def reduce_scatter_body(
    out: torch.Tensor,
    peers: tuple[torch.Tensor, ...],
    signal_pad_ptrs: int,
    num_blocks: int,
    chunk: int,
    rank: int,
    world_size: hl.constexpr,
    group_name: hl.ProcessGroupName,
) -> torch.Tensor:
    # Sizes come from the top-level ``out``: Helion 1.5.0 does not re-specialise on the sizes of tensors
    # that sit only inside a tuple (see the README's Helion notes).
    # peers[r] is rank r's copy of this rank's shard (``shard_views``), so one tile index serves
    # every load and the store.
    shard = out.size(0)
    for block in hl.grid(num_blocks):
        barrier = {"signal_pad_ptrs": signal_pad_ptrs, "block_id": block, "rank": rank, "world_size": world_size}
        hl.inline_triton(SYNC_START, args=barrier, output_like=None)
        start = block * chunk
        # The range is clipped, as in the recipe: one bound serves the loop and the mask (see the
        # one-shot all-reduce twin for what a separate mask cost).
        for tile in hl.tile(start, min(start + chunk, shard)):
            acc = hl.load(peers[0], [tile]).to(torch.float32)
            for r in hl.static_range(world_size):  # not (1, world_size): docs/helion-notes.md
                if r > 0:  # rank order, from rank 0's value, as in the recipe (folded at compile time)
                    acc = acc + hl.load(peers[r], [tile]).to(torch.float32)
            hl.store(out, [tile], acc.to(out.dtype))
        hl.inline_triton(SYNC_END, args=barrier, output_like=None)
    return out


@functools.cache
def compiled(block_size: int, num_warps: int) -> helion.Kernel:
    """One Helion kernel per launch configuration, each with an explicit config (``pid_type="flat"``)."""
    return flat_kernel(reduce_scatter_body, (block_size,), num_warps)


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
    """Launch on prepared arguments (no checks); mirrors ``kraken.comm.reduce_scatter.launch`` (an ordinary ``x`` is staged by a
    copy launch: ``kraken._blocks.helion.stage``)."""
    if x is not None:
        stage(peers, rank, x, group_name, launcher)
    args = (
        flat_view(out), shard_views(peers, rank, out.numel()), signal_pad_ptrs, num_blocks, chunk, rank, len(peers),
        group_name,
    )
    run(compiled(block_size, num_warps), args, launcher)
    return out


_shard_views: dict[tuple, tuple[torch.Tensor, ...]] = {}


def shard_views(peers: tuple[torch.Tensor, ...], rank: int, shard: int) -> tuple[torch.Tensor, ...]:
    """Every peer's copy of this rank's shard, flat (cached: the peers tuple is cached per buffer).

    The twin loads ``peers[r][tile]`` from these views where the recipe adds ``rank * shard`` to
    each peer's pointer. Indexing the whole buffers with ``tile.index + rank * shard`` instead made
    ptxas issue a thread's last peer load after adds that wait on the first ones (two NVLink round
    trips per step instead of one); ``test_gather_scatter_cpu`` checks the SASS.
    """
    key = (peers, rank, shard)
    views = _shard_views.get(key)
    if views is None:
        views = _shard_views[key] = tuple(p.view(-1)[rank * shard:(rank + 1) * shard] for p in peers)
    return views


def reduce_scatter(tensor: torch.Tensor, group: dist.ProcessGroup | str | None = None, **config) -> torch.Tensor:
    """This rank's ``[M / world_size, ...]`` rows of the sum over the group (see the kraken recipe)."""
    ctx, launch_cfg, staged = prepare_call(tensor, group, "helion reduce_scatter", config)
    out = staging.new_rows(tensor, tensor.shape[0] // ctx.world_size)
    return staging.launched(launch, ctx, launch_cfg, staged, tensor, out)
