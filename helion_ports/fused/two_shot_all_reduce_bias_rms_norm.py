"""Helion twin of ``kraken.fused.two_shot_all_reduce_bias_rms_norm``: same function, same arguments.

The Triton recipe's five steps in rows: workspaces arrive as
``[2, tokens, hidden]`` views (0: staged input, 1: pushed result), a row is one
``[1, hidden]`` tile of ``hl.tile(..., block_size=1)``, the shard owners are
unrolled with ``hl.static_range``, and the row math is the shared
``helion_ports.fused.rms_norm.rms_normalize``.
"""

from __future__ import annotations

import functools

import helion
import helion.language as hl
import torch
import torch.distributed as dist

from helion_ports.fused.rms_norm import rms_normalize
from helion_ports import flat_kernel, own_storage, run, views
from kraken import host
from kraken._ptx_utils.inline_source import SYMM_MEM_SYNC
from kraken.fused.two_shot_all_reduce_bias_rms_norm import plan, prepare  # shared with the Triton recipe

# Both barriers: "my writes are visible to you" (release) and "yours to me" (acquire).
SYNC = SYMM_MEM_SYNC[(True, True)]


def two_shot_all_reduce_bias_rms_norm_body(
    x: torch.Tensor,
    bias: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    workspace: torch.Tensor,
    peers: tuple[torch.Tensor, ...],
    out: torch.Tensor,
    signal_pad_ptrs: int,
    num_blocks: int,
    shard: int,
    chunk: int,
    rank: int,
    world_size: hl.constexpr,
    group_name: hl.ProcessGroupName,
) -> torch.Tensor:
    tokens = x.size(0)
    for block in hl.grid(num_blocks):
        barrier = {"signal_pad_ptrs": signal_pad_ptrs, "block_id": block, "rank": rank, "world_size": world_size}
        for owner in hl.static_range(world_size):
            start = owner * shard + block * chunk
            for rows in hl.tile(start, start + chunk, block_size=1):
                valid = ((rows.index < tokens) & (rows.index < owner * shard + shard))[:, None]
                row = hl.load(x, [rows, slice(None)], extra_mask=valid)
                hl.store(workspace, [0, rows, slice(None)], row, extra_mask=valid)
        # The same for every row, and not written by peers: loaded once, while the barrier waits.
        bias_row = hl.load(bias, [slice(None)]).to(torch.float32)[None, :]
        weight_row = hl.load(weight, [slice(None)]).to(torch.float32)[None, :]
        hl.inline_triton(SYNC, args=barrier, output_like=None)
        start = rank * shard + block * chunk
        # Masked rows rather than a clipped range, unlike the other twins: here clipping made ptxas issue
        # fewer peers' loads before the first add (2 of 4 at 4 ranks, 3 with the mask; the recipe 4).
        for rows in hl.tile(start, start + chunk, block_size=1):
            valid = ((rows.index < tokens) & (rows.index < rank * shard + shard))[:, None]
            # Start from rank 0's row (as sum_peers does): hl.zeros([rows, hidden]) would need hidden specialized.
            h = hl.load(peers[0], [0, rows, slice(None)], extra_mask=valid).to(torch.float32)
            for r in hl.static_range(world_size):  # not (1, world_size): docs/helion-notes.md
                if r > 0:  # rank order, from rank 0's value, as in the recipe (folded at compile time)
                    h = h + hl.load(peers[r], [0, rows, slice(None)], extra_mask=valid).to(torch.float32)
            h = h + bias_row
            y = rms_normalize(h, weight_row, eps).to(out.dtype)
            for r in hl.static_range(world_size):
                hl.store(peers[r], [1, rows, slice(None)], y, extra_mask=valid)
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
    launcher=host.jit_launch,
) -> torch.Tensor:
    """Launch on prepared arguments (no checks); mirrors the kraken recipe's ``launch``."""
    regions = (2, *x.shape)
    # `workspace` through its own storage object: see helion_ports.own_storage.
    region_peers = views(peers, regions)
    args = (
        x, bias, weight, float(eps), own_storage(peers[rank]).view(regions), region_peers, out, signal_pad_ptrs, num_blocks,
        shard, chunk, rank, len(peers), group_name,
    )
    run(compiled(num_warps), args, launcher)
    return out


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
    x2d, ctx, launch_cfg = prepare(x, bias, weight, eps, group, op, config)
    out = torch.empty_like(x2d)
    launch(
        x2d, bias, weight, eps, ctx.peers, out, ctx.signal_pad_ptrs, ctx.rank, **launch_cfg,
        group_name=ctx.group_name,
    )
    return out if x.dim() == 2 else out.view(x.shape)
