"""Helion twin of ``kraken.fused.two_shot_all_reduce_bias_rms_norm``: same function, same arguments.

The Triton recipe's five steps in rows: this rank's workspace arrives as a
``[2, tokens, hidden]`` view (0: staged input, 1: pushed result), a row is one
``[1, hidden]`` tile of ``hl.tile(..., block_size=1)``, and the shard owners
are unrolled with ``hl.static_range``. The peers' workspaces arrive as flat
views of their two regions (``staged``, ``results``: see
``kraken._blocks.helion.views``), read and written at the recipe's offsets
``row * hidden + cols``.
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
from kraken.fused.two_shot_all_reduce_bias_rms_norm import plan, prepare, signature  # shared with the recipe
from kraken.runtime import groups
from kraken.runtime.launcher import jit_launch

# Both barriers: "my writes are visible to you" (release) and "yours to me" (acquire).
SYNC = SYMM_MEM_SYNC[(True, True)]


def two_shot_all_reduce_bias_rms_norm_body(
    x: torch.Tensor,
    bias: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    workspace: torch.Tensor,
    staged: tuple[torch.Tensor, ...],
    results: tuple[torch.Tensor, ...],
    out: torch.Tensor,
    signal_pad_ptrs: int,
    num_blocks: int,
    shard: int,
    chunk: int,
    rank: int,
    shard_end: int,
    world_size: hl.constexpr,
    block_h: hl.constexpr,
    group_name: hl.ProcessGroupName,
) -> torch.Tensor:
    tokens, hidden = x.size(0), x.size(1)
    for block in hl.grid(num_blocks):
        barrier = {"signal_pad_ptrs": signal_pad_ptrs, "block_id": block, "rank": rank, "world_size": world_size}
        for owner in hl.static_range(world_size):
            start = owner * shard + block * chunk
            for rows in hl.tile(start, start + chunk, block_size=1):
                valid = ((rows.index < tokens) & (rows.index < owner * shard + shard))[:, None]
                row = hl.load(x, [rows, slice(None)], extra_mask=valid)
                hl.store(workspace, [0, rows, slice(None)], row, extra_mask=valid)
        # The same for every row, and not written by peers: loaded once, while the barrier waits.
        cols = hl.arange(block_h)
        in_row = cols < hidden
        bias_row = hl.load(bias, [cols], extra_mask=in_row).to(torch.float32)[None, :]
        weight_row = hl.load(weight, [cols], extra_mask=in_row).to(torch.float32)[None, :]
        hl.inline_triton(SYNC, args=barrier, output_like=None)
        start = rank * shard + block * chunk
        # As the recipe: a clipped range of rows, and every peer's row at the one offset row * hidden + cols
        # from its flat view's base. With [2, tokens, hidden] views (peers[r][0, rows, :]: a stride parameter
        # per peer, so an offset per peer) or with masked rows, ptxas issued 3 of the 4 peers' loads before
        # the first add at 4 ranks (the recipe 4); see docs/helion-notes.md. `shard_end` (my shard's end,
        # clipped to `tokens`) comes from the host: with `min(start + chunk, min(rank * shard + shard, tokens))`
        # here the same happened at 8 ranks (3 of 8, the recipe 4) when the barriers have their timeout.
        for rows in hl.tile(start, min(start + chunk, shard_end), block_size=1):
            offsets = rows.index[:, None] * hidden + cols[None, :]
            # Start from rank 0's row (as sum_peers does): hl.zeros([rows, hidden]) would need hidden specialized.
            h = hl.load(staged[0], [offsets], extra_mask=in_row[None, :]).to(torch.float32)
            for r in hl.static_range(world_size):  # not (1, world_size): docs/helion-notes.md
                if r > 0:  # rank order, from rank 0's value, as in the recipe (folded at compile time)
                    h = h + hl.load(staged[r], [offsets], extra_mask=in_row[None, :]).to(torch.float32)
            h = h + bias_row
            # rms_normalize with the row's width: torch.mean over the block_h columns would divide by block_h.
            y = (h * torch.rsqrt(torch.sum(h * h, dim=-1, keepdim=True) / hidden + eps) * weight_row).to(out.dtype)
            for r in hl.static_range(world_size):
                hl.store(results[r], [offsets], y, extra_mask=in_row[None, :])
        hl.inline_triton(SYNC, args=barrier, output_like=None)
        for owner in hl.static_range(world_size):
            start = owner * shard + block * chunk
            for rows in hl.tile(start, start + chunk, block_size=1):
                valid = ((rows.index < tokens) & (rows.index < owner * shard + shard))[:, None]
                row = hl.load(workspace, [1, rows, slice(None)], extra_mask=valid)
                hl.store(out, [rows, slice(None)], row, extra_mask=valid)
    return out


@functools.cache
def compiled(num_warps: int) -> helion.Kernel:
    """One Helion kernel per launch configuration, each with an explicit config.

    ``pid_type="flat"``: the recipe's grid, one program per block (see ``helion_ports``).
    """
    return flat_kernel(two_shot_all_reduce_bias_rms_norm_body, (), num_warps)


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
    shard: int,
    chunk: int,
    group_name: str = "",
    launcher=jit_launch,
) -> torch.Tensor:
    """Launch on prepared arguments (no checks); mirrors the kraken recipe's ``launch``."""
    tokens, hidden = x.shape
    # `workspace` through its own storage object: see kraken._blocks.helion.own_storage.
    args = (
        x, bias, weight, float(eps), own_storage(peers[rank]), peers, out, signal_pad_ptrs, num_blocks, shard, chunk,
        rank, min((rank + 1) * shard, tokens), len(peers), groups.next_power_of_2(hidden), group_name,
    )
    run(compiled(num_warps), args, launcher, region_args)
    return out


def region_args(args: tuple) -> tuple:
    """``launch``'s arguments as the kernel takes them (``kraken._blocks.helion.run``): the workspaces as two regions of
    ``x``'s rows (staged input, reduced shard), and the peers' regions flat."""
    x, bias, weight, eps, workspace, peers, *rest = args
    tokens, hidden = x.shape
    flat = (2, tokens * hidden)
    return (x, bias, weight, eps, workspace.view(2, tokens, hidden), views(peers, flat, 0), views(peers, flat, 1),
            *rest)


def two_shot_all_reduce_bias_rms_norm(
    x: torch.Tensor,
    bias: torch.Tensor,
    weight: torch.Tensor,
    eps: float = 1e-5,
    group: dist.ProcessGroup | str | None = None,
    **config,
) -> torch.Tensor:
    """RMSNorm(``sum over ranks of x`` + ``bias``) * ``weight``, rows sharded over ranks (see the kraken recipe)."""
    op = "helion two_shot_all_reduce_bias_rms_norm"
    return staged_call(launch, op, x, (bias, weight, eps), signature(x, bias, weight, eps, group, op, config))
