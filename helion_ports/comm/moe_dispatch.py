"""Helion twin of ``kraken.comm.moe_dispatch``: same function, same arguments.

The routing bookkeeping (count histogram, the on-device count exchange with its barrier and the
prefix sums, each pair's destination slot) is the recipe's own three small Triton kernels, shared
as its host code is (``kraken.comm.moe_dispatch.dispatch``: the prepared call, the handle): it is
index arithmetic on a few kilobytes, and the twin's subject is the data movement. The token copy is
ported: ``hl.grid(num_blocks)`` is the persistent grid and the barrier's block id, block ``b``
copies its contiguous range of (token, k) pairs, whole rows, as ``[rows, block_h]`` tiles gathered
from the local tokens and stored into the owner's receive buffer (one masked ``hl.store`` per rank,
unrolled with ``hl.static_range``; exactly one of them stores), then the kraken barrier (release +
acquire) through ``hl.inline_triton``. Warm calls launch through the prepared call's launcher
(``kraken._blocks.helion.run``).

Set ``HELION_PRINT_OUTPUT_CODE=1`` to see the generated Triton.
"""

from __future__ import annotations

import functools

import helion
import helion.language as hl
import torch
import torch.distributed as dist

from kraken._blocks.helion import flat_kernel, run, views
from kraken._ptx_utils.inline_source import SYMM_MEM_SYNC
from kraken.comm.moe_dispatch import MoEHandle, dispatch, route  # shared with the Triton recipe
from kraken.runtime import symm
from kraken.runtime.launcher import jit_launch

# "My rows are visible to their owners; the peers' rows for me have landed."
SYNC_END = SYMM_MEM_SYNC[(True, True)]


def dispatch_body(
    tokens: torch.Tensor,
    slots: torch.Tensor,
    recv_peers: tuple[torch.Tensor, ...],  # every rank's recv buffer, flat
    signal_pad_ptrs: int,
    num_blocks: int,
    pairs_per_block: int,
    capacity: int,
    top_k: int,
    rank: int,
    world_size: hl.constexpr,
    group_name: hl.ProcessGroupName,
) -> torch.Tensor:
    # Sizes from the top-level tensors (Helion 1.5.0 does not re-specialise on tensors only inside a tuple).
    num_pairs = slots.size(0)
    hidden = tokens.size(1)
    for block in hl.grid(num_blocks):
        start = block * pairs_per_block
        # Rows of pairs, then the hidden dimension in tiles, as the recipe: a row's slot, owner and token are
        # worked out once for all its hidden tiles (one 2-D tile loop loaded the slots and divided again per tile).
        for tile_p in hl.tile(start, min(start + pairs_per_block, num_pairs)):
            slot = hl.load(slots, [tile_p])
            kept = slot >= 0
            slot = torch.clamp(slot, min=0)
            owner = slot // capacity
            row = slot - owner * capacity
            token = tile_p.index // top_k
            for tile_h in hl.tile(hidden):
                values = hl.load(tokens, [token, tile_h], extra_mask=kept[:, None])
                # Every rank's recv buffer flat, at one offset tensor (no stride registers per peer).
                at = row[:, None] * hidden + tile_h.index[None, :]
                inside = (tile_h.index < hidden)[None, :]  # a flat index carries no tile mask of its own
                for r in hl.static_range(world_size):  # one store per row lands: the owner's
                    hl.store(recv_peers[r], [at], values, extra_mask=(kept & (owner == r))[:, None] & inside)
        hl.inline_triton(
            SYNC_END,
            args={"signal_pad_ptrs": signal_pad_ptrs, "block_id": block, "rank": rank, "world_size": world_size},
            output_like=None,
        )
    return slots


@functools.cache
def compiled(rows: int, block_h: int, num_warps: int) -> helion.Kernel:
    """One Helion kernel per launch configuration, each with an explicit config (``pid_type="flat"``)."""
    return flat_kernel(dispatch_body, (rows, block_h), num_warps)


def launch(
    tokens: torch.Tensor,
    expert_ids: torch.Tensor,
    handle: MoEHandle,
    counts_ctx: symm.SymmContext,
    rank: int,
    rows: int,
    block_h: int,
    num_warps: int,
    num_blocks: int,
    pairs_per_block: int,
    group_name: str = "",
    launcher=jit_launch,
    **routing,
) -> MoEHandle:
    """Launch on prepared arguments (no checks); mirrors ``kraken.comm.moe_dispatch.launch``."""
    route(expert_ids, handle, counts_ctx, rank, launcher=launcher, **routing)
    ctx = handle.recv_context
    args = (tokens, handle.slots.view(-1), views(ctx.peers, -1), ctx.signal_pad_ptrs, num_blocks, pairs_per_block,
            handle.capacity, expert_ids.shape[1], rank, len(ctx.peers), group_name)
    run(compiled(rows, block_h, num_warps), args, launcher)
    return handle


def moe_dispatch(
    tokens: torch.Tensor,
    expert_ids: torch.Tensor,
    num_experts: int,
    group: dist.ProcessGroup | str | None = None,
    capacity: int | None = None,
    check_status: bool = False,
    **config,
) -> tuple[torch.Tensor, torch.Tensor, MoEHandle]:
    """Send each token to its top-k experts' ranks: ``(recv, recv_counts, handle)`` (see the kraken recipe)."""
    return dispatch(launch, "helion moe_dispatch", tokens, expert_ids, num_experts, group, capacity, check_status,
                    config)
