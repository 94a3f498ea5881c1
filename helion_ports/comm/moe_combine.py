"""Helion twin of ``kraken.comm.moe_combine``: same function, same arguments.

The structure mirrors the Triton recipe one to one: ``hl.grid(num_blocks)`` is the persistent grid
and the barrier's block id; block ``b`` combines its contiguous range of tokens in ``[tokens,
block_h]`` tiles; for each of the k experts (``hl.static_range``) the row is gathered from its owner's
receive buffer with one masked ``hl.load`` per rank (exactly one of them loads), weighted and added
in fp32; the barriers are the kraken PTX through ``hl.inline_triton``.

Set ``HELION_PRINT_OUTPUT_CODE=1`` to see the generated Triton.
"""

from __future__ import annotations

import functools

import helion
import helion.language as hl
import torch

from kraken._blocks.helion import flat_kernel, run
from kraken._ptx_utils.inline_source import SYMM_MEM_SYNC
from kraken.comm.moe_combine import combine  # shared with the Triton recipe
from kraken.comm.moe_dispatch import MoEHandle
from kraken.runtime.launcher import jit_launch

# The barriers: "peers' expert outputs are written" (acquire) and "done reading peers" (release).
SYNC_START = SYMM_MEM_SYNC[(False, True)]
SYNC_END = SYMM_MEM_SYNC[(True, False)]


def combine_body(
    out: torch.Tensor,
    weights: torch.Tensor,
    slots: torch.Tensor,
    recv_peers: tuple[torch.Tensor, ...],
    signal_pad_ptrs: int,
    num_blocks: int,
    tokens_per_block: int,
    capacity: int,
    rank: int,
    world_size: hl.constexpr,
    group_name: hl.ProcessGroupName,
) -> torch.Tensor:
    num_tokens, hidden = out.size(0), out.size(1)
    top_k = hl.specialize(weights.size(1))
    for block in hl.grid(num_blocks):
        barrier = {"signal_pad_ptrs": signal_pad_ptrs, "block_id": block, "rank": rank, "world_size": world_size}
        hl.inline_triton(SYNC_START, args=barrier, output_like=None)
        start = block * tokens_per_block
        for tile_t, tile_h in hl.tile([start, 0], [min(start + tokens_per_block, num_tokens), hidden]):
            acc = hl.zeros([tile_t, tile_h], dtype=torch.float32)
            for j in hl.static_range(top_k):
                slot = hl.load(slots, [tile_t, j])
                weight = hl.load(weights, [tile_t, j]).to(torch.float32)
                kept = slot >= 0
                slot = torch.clamp(slot, min=0)
                owner = slot // capacity
                row = slot - owner * capacity
                value = hl.zeros([tile_t, tile_h], dtype=out.dtype)
                for r in hl.static_range(world_size):  # exactly one of these loads, the owner's
                    mask = (kept & (owner == r))[:, None]
                    value = torch.where(mask, hl.load(recv_peers[r], [row, tile_h], extra_mask=mask), value)
                acc = acc + weight[:, None] * value.to(torch.float32)
            out[tile_t, tile_h] = acc.to(out.dtype)
        hl.inline_triton(SYNC_END, args=barrier, output_like=None)
    return out


@functools.cache
def compiled(tokens: int, block_h: int, num_warps: int) -> helion.Kernel:
    """One Helion kernel per launch configuration, each with an explicit config (``pid_type="flat"``)."""
    return flat_kernel(combine_body, (tokens, block_h), num_warps)


def launch(
    out: torch.Tensor,
    weights: torch.Tensor,
    handle: MoEHandle,
    rank: int,
    tokens: int,
    block_h: int,
    num_warps: int,
    num_blocks: int,
    tokens_per_block: int,
    group_name: str = "",
    launcher=jit_launch,
) -> torch.Tensor:
    """Launch on prepared arguments (no checks); mirrors ``kraken.comm.moe_combine.launch``."""
    ctx = handle.recv_context
    slots, target = handle.slots, out
    if out.shape[0] == 1:
        # Helion 1.5.0 specialises a size-1 dimension and then stores every row of the tile to row 0, the
        # masked-off ones too (docs/helion-notes.md): combine one token as two, the second going nowhere.
        slots = torch.cat([slots, torch.full_like(slots, -1)])
        weights = torch.cat([weights, torch.zeros_like(weights)])
        target = out.new_empty((2, out.shape[1]))
    args = (target, weights, slots, ctx.peers, ctx.signal_pad_ptrs, num_blocks, tokens_per_block, handle.capacity,
            rank, len(ctx.peers), group_name)
    run(compiled(tokens, block_h, num_warps), args, launcher)
    if target is not out:
        out.copy_(target[:1])
    return out


def moe_combine(expert_out: torch.Tensor, handle: MoEHandle, weights: torch.Tensor, **config) -> torch.Tensor:
    """``[T, H]``: every token's expert outputs, weighted and summed in fp32, in token order (see the recipe)."""
    return combine(launch, "helion moe_combine", expert_out, handle, weights, config)
