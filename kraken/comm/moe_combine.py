"""Mixture-of-experts combine: each token's top-k expert outputs, weighted, summed, back home in token order.

The inverse of ``kraken.comm.moe_dispatch`` (whose module docstring has the layout): ``expert_out``
is this rank's ``[capacity, H]`` expert outputs in the dispatch's row order (local expert ``e`` at
``handle.recv_offsets[e] ..``), ``weights [T, k]`` the router's top-k weights. The result is
``out [T, H]``: ``out[t] = sum_j weights[t, j] * expert_out_on_owner[row of (t, j)]``, accumulated
in fp32 in j order and rounded once. Pairs that went nowhere (dropped past capacity, or id -1)
add nothing.

The home rank *pulls*: it knows where each of its pairs went (``handle.slots``, from the
dispatch), so one pass loads the k rows of a token (from whichever ranks hold them, all in
flight), weights and sums them in registers, and stores the token once: each row crosses NVLink
once and nothing is staged. The peers' rows must be readable, so ``expert_out`` must be the
dispatch's ``recv`` buffer (symmetric memory): write the expert outputs into it in place (a
grouped GEMM's ``out=``; the identity expert is ``recv`` itself). Any other tensor is first copied
into ``recv`` on this rank (all ``capacity`` rows: a local copy, documented cost).

A persistent grid: block ``b`` takes a contiguous range of tokens and uses barrier slot ``b``:

1. barrier (acquire): block ``b`` of every peer has started, so every peer's expert outputs are
   written (stream order);
2. per tile of tokens and columns: for each j, the row from its owner (one masked load per rank,
   exactly one of which loads), weighted, added in fp32; store;
3. barrier (release): "done reading your ``recv``", so it may be overwritten when this returns.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kraken._ptx_utils import symm_mem_sync
from kraken.comm.moe_dispatch import MoEHandle
from kraken.runtime import agreement, groups, prepared
from kraken.runtime.launcher import Launcher, jit_launch
from kraken.runtime.replay import replayed

# Up to 4 blocks per SM: the combine is a gather bound by loads in flight, and one 8-warp block per SM kept too
# few. On one H200 (4096 tokens x 7168, top-8 of 64, world size 1) 132 blocks ran at 52% of a copy of the
# T * k rows, 264 at 93%, 528 at 139% (the twin 65%, 111%, 156%); 2 -> 8 tokens per tile moved it less. The
# signal pad caps the grid below this at 8 ranks (288 blocks).
DEFAULT_CONFIG = {"tokens": 2, "block_h": 1024, "num_warps": 8, "max_blocks": 528}
WEIGHT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@triton.jit
def combine_kernel(
    out_ptr,  # [T, H], local
    weights_ptr,  # [T, k], local
    slots_ptr,  # [T, k] int32: owner * capacity + row, or -1
    recv_peers,  # tuple of world_size pointers: rank r's expert outputs [capacity, H]
    signal_pad_ptrs,  # of the recv buffer
    num_tokens,
    hidden,
    capacity,
    tokens_per_block,
    rank,
    world_size: tl.constexpr,
    TOP_K: tl.constexpr,
    TOKENS: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    block_id = tl.program_id(0)
    symm_mem_sync(signal_pad_ptrs, block_id, rank, world_size, hasPreviousMemAccess=False, hasSubsequentMemAccess=True)
    start = block_id * tokens_per_block
    end = tl.minimum(start + tokens_per_block, num_tokens)
    for t0 in tl.range(start, end, TOKENS):
        tokens = t0 + tl.arange(0, TOKENS)
        inside_t = tokens < end
        for h in tl.range(0, hidden, BLOCK_H):
            cols = h + tl.arange(0, BLOCK_H)
            inside = inside_t[:, None] & (cols[None, :] < hidden)
            acc = tl.zeros([TOKENS, BLOCK_H], tl.float32)
            for j in tl.static_range(TOP_K):
                slot = tl.load(slots_ptr + tokens * TOP_K + j, mask=inside_t, other=-1)
                weight = tl.load(weights_ptr + tokens * TOP_K + j, mask=inside_t, other=0).to(tl.float32)
                kept = slot >= 0
                slot = tl.maximum(slot, 0)  # Triton's integer division truncates: divide non-negatives only
                owner = slot // capacity
                row = slot - owner * capacity
                value = tl.zeros([TOKENS, BLOCK_H], out_ptr.dtype.element_ty)
                for r in tl.static_range(world_size):  # exactly one of these loads, the owner's
                    mask = inside & (kept & (owner == r))[:, None]
                    value = tl.where(mask, tl.load(recv_peers[r] + row[:, None] * hidden + cols[None, :], mask=mask),
                                     value)
                acc += weight[:, None] * value.to(tl.float32)
            tl.store(out_ptr + tokens[:, None] * hidden + cols[None, :], acc.to(out_ptr.dtype.element_ty), mask=inside)
    symm_mem_sync(signal_pad_ptrs, block_id, rank, world_size, hasPreviousMemAccess=True, hasSubsequentMemAccess=False)


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
    """Launch on prepared arguments (no checks; the expert outputs are in ``handle.recv``); the same
    signature as the Helion port's ``launch``. ``launcher``: the prepared call's ``Launcher``, or Triton's."""
    ctx = handle.recv_context
    launcher(
        combine_kernel, (num_blocks,), out, weights, handle.slots, ctx.peers, ctx.signal_pad_ptrs, out.shape[0],
        out.shape[1], handle.capacity, tokens_per_block, rank, len(ctx.peers), TOP_K=weights.shape[1],
        TOKENS=tokens, BLOCK_H=block_h, num_warps=num_warps,
    )
    return out


def plan(num_tokens: int, hidden: int, world_size: int, config: dict) -> dict:
    """The persistent grid (shared with the Helion twin): block b combines tokens ``b * tokens_per_block ..``."""
    cfg = groups.resolve_config(config, DEFAULT_CONFIG, "moe_combine")
    tokens = cfg["tokens"]
    num_blocks = groups.persistent_grid(groups.cdiv(num_tokens, tokens), cfg["max_blocks"], world_size)
    tokens_per_block = groups.round_up(groups.cdiv(num_tokens, num_blocks), tokens)
    return {"tokens": tokens, "block_h": min(cfg["block_h"], triton.next_power_of_2(hidden)),
            "num_warps": cfg["num_warps"], "num_blocks": max(1, groups.cdiv(num_tokens, tokens_per_block)),
            "tokens_per_block": tokens_per_block}


def check_inputs(expert_out, handle, weights, op: str) -> None:
    if not isinstance(handle, MoEHandle):
        raise TypeError(f"{op}: handle must be the MoEHandle moe_dispatch returned, got {type(handle).__name__}")
    recv = handle.recv
    groups.check_tensor(expert_out, "expert_out", op, dtypes=(recv.dtype,), ndim=2)
    if tuple(expert_out.shape) != tuple(recv.shape):
        raise ValueError(f"{op}: expert_out has shape {tuple(expert_out.shape)}; the dispatch's receive buffer is "
                         f"{tuple(recv.shape)} (capacity x hidden)")
    groups.check_tensor(weights, "weights", op, dtypes=WEIGHT_DTYPES, ndim=2)
    if tuple(weights.shape) != tuple(handle.slots.shape):
        raise ValueError(f"{op}: weights has shape {tuple(weights.shape)}; the dispatch routed "
                         f"{tuple(handle.slots.shape)} (tokens x top-k)")
    if expert_out.device != recv.device or weights.device != recv.device:
        raise ValueError(f"{op}: expert_out ({expert_out.device}) and weights ({weights.device}) must be on the "
                         f"dispatch's device {recv.device}")


def combine_key(expert_out, handle, weights, op: str, config: dict) -> tuple:
    """``prepare``'s cache key: everything it reads (the handle's group, its slots' shape: their dtype, layout and
    alignment are ``new_handle``'s), and the receive buffer's address: a prepared call serves one buffer (its peers
    and signal pads, which ``combine``'s replay keeps as constants). A handle of another type is not cached
    (``prepare`` says what is wrong)."""
    if not isinstance(handle, MoEHandle):
        raise TypeError("not a MoEHandle")  # prepared.per_signature: skip the cache
    return (op, handle.group_name, prepared.tensor_key(expert_out), prepared.tensor_key(weights), handle.pairs,
            prepared.tensor_key(handle.recv, address=True), prepared.config_key(config))


@prepared.per_signature(combine_key)
def prepare(expert_out, handle, weights, op: str, config: dict) -> dict:
    """Validate and agree (first call of a signature), plan; ``launch``'s keyword arguments with the prepared
    call's ``Launcher``, kept per signature."""
    group = handle.group_name if isinstance(handle, MoEHandle) else None
    with agreement.agreed(op, group, expert_out=expert_out, weights=weights, config=config,
                          handle=handle.slots if isinstance(handle, MoEHandle) else handle):
        check_inputs(expert_out, handle, weights, op)
        world_size = groups.world_size_of(group, op)
        cfg = plan(weights.shape[0], expert_out.shape[1], world_size, config)
        groups.check_barrier_blocks(cfg["num_blocks"], world_size, op)
    return {**cfg, "group_name": handle.group_name, "launcher": Launcher(op)}


def combine(launch, op: str, expert_out: torch.Tensor, handle: MoEHandle, weights: torch.Tensor,
            config: dict) -> torch.Tensor:
    """``moe_combine`` with a given ``launch`` (the recipe's or its twin's) under the name ``op``: the prepared
    call (a dictionary lookup once warm), the copy into ``recv`` when ``expert_out`` is not it, a new output, and
    the launch, replayed from the prepared call's second call on (``replayed``: this call's output, weights
    and routing tensor, where the slots lie; the receive buffer's peers and pads, which the prepared call's key
    fixes, as constants)."""
    cfg = prepare(expert_out, handle, weights, op, config)
    recv, ctx = handle.recv, handle.recv_context
    if expert_out.data_ptr() != recv.data_ptr():
        recv.copy_(expert_out)
    out = expert_out.new_empty((weights.shape[0], expert_out.shape[1]))
    return replayed(cfg["launcher"], launch, (out, weights, handle.routing),  # the slots lie in routing
                    lambda: launch(out, weights, handle, ctx.rank, **cfg), (ctx,))


def moe_combine(expert_out: torch.Tensor, handle: MoEHandle, weights: torch.Tensor, **config) -> torch.Tensor:
    """``[T, H]``: every token's expert outputs weighted by ``weights [T, k]`` and summed (fp32, j order), in
    the original token order on its home rank. ``expert_out [capacity, H]`` in the dispatch's row order;
    zero-copy when it is the dispatch's ``recv`` (see the module docstring). ``config`` overrides
    ``DEFAULT_CONFIG``."""
    return combine(launch, "moe_combine", expert_out, handle, weights, config)


def reference_combine(all_expert_out: list[torch.Tensor], all_slots: list[torch.Tensor], weights: torch.Tensor,
                      rank: int, capacity: int) -> torch.Tensor:
    """Rank ``rank``'s combine with plain torch (fp32, j order) from every rank's expert outputs and this
    rank's slots (``kraken.comm.moe_dispatch.reference_slots``) and weights."""
    slots = all_slots[rank].long()
    num_tokens, top_k = slots.shape
    hidden = all_expert_out[0].shape[1]
    acc = torch.zeros((num_tokens, hidden), dtype=torch.float32, device=weights.device)
    for j in range(top_k):
        value = torch.zeros_like(acc)
        for r, expert_out in enumerate(all_expert_out):
            here = (slots[:, j] >= 0) & (slots[:, j] // capacity == r)
            rows = slots[:, j][here] % capacity
            value[here.to(acc.device)] = expert_out[rows.to(expert_out.device)].float().to(acc.device)
        acc = acc + weights[:, j, None].float() * value
    return acc.to(all_expert_out[0].dtype)


__all__ = ["moe_combine", "reference_combine"]
