"""Mixture-of-experts combine: each token's top-k expert outputs, weighted, summed, back home in token order.

The inverse of ``kraken/comm/moe_dispatch.py`` (whose module docstring has the layout): ``expert_out``
is this rank's ``[capacity, H]`` expert outputs in the dispatch's row order (local expert ``e`` at
``recv_offsets[e] ..``), ``weights [T, k]`` the router's top-k weights. The result is
``out [T, H]``: ``out[t] = sum_j weights[t, j] * expert_out_on_owner[row of (t, j)]``, accumulated
in fp32 in j order and rounded once. Pairs that went nowhere (dropped past capacity, or id -1)
add nothing.

The home rank *pulls*: it knows where each of its pairs went (``slots [T, k]`` from the dispatch,
``owner * capacity + row`` or -1), so one pass loads the k rows of a token (from whichever ranks
hold them, all in flight), weights and sums them in registers, and stores the token once: each row
crosses NVLink once and nothing is staged. The peers' rows must be readable, so ``expert_out`` must be the
dispatch's ``recv`` buffer (symmetric memory): write the expert outputs into it in place (a
grouped GEMM's ``out=``; the identity expert is ``recv`` itself). Any other tensor is first copied
into ``recv`` on this rank (all ``capacity`` rows: a local copy, documented cost).

A persistent grid: block ``b`` takes a contiguous range of tokens and uses barrier slot ``b``:

1. barrier (acquire): block ``b`` of every peer has started, so every peer's expert outputs are
   written (stream order);
2. per tile of tokens and columns: for each j, the row from its owner (one masked load per rank,
   exactly one of which loads), weighted, added in fp32; store;
3. barrier (release): "done reading your ``recv``", so it may be overwritten when this returns.

This file is the recipe: the kernel, ``plan`` (pure), ``launch`` (the seam the installed package's fast path
calls with its own ``launcher``), a plain host function and the plain-torch reference. ``kraken.moe_combine`` is
the same kernel behind the product layer (``kraken.runtime.moe``: it takes the dispatch's handle, checks agreed
across ranks, a prepared call per receive buffer, replayed launches).

    torchrun --nproc-per-node 2 kraken/comm/moe_combine.py
"""

from __future__ import annotations

import os
import time

import torch
import torch.distributed as dist
import torch.distributed._symmetric_memory as symm_mem
import triton
import triton.language as tl

from kraken._ptx_utils import barrier_blocks, symm_mem_sync

# Up to 4 blocks per SM: the combine is a gather bound by loads in flight, and one 8-warp block per SM kept too
# few loads in flight; more tokens per tile helped less. The signal pad caps the grid below this at 8 ranks
# (288 blocks).
DEFAULT_CONFIG = {"tokens": 2, "block_h": 1024, "num_warps": 8, "max_blocks": 528}


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


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def plan(num_tokens: int, hidden: int, world_size: int, config: dict, pad_bytes: int | None = None) -> dict:
    """The persistent grid: block b combines tokens ``b * tokens_per_block ..``, at most ``max_blocks`` blocks and
    the block ids the signal pad holds (``pad_bytes``; by default torch's pad size)."""
    unknown = set(config) - set(DEFAULT_CONFIG)
    if unknown:
        raise TypeError(f"moe_combine: unknown config keys {sorted(unknown)}; known: {sorted(DEFAULT_CONFIG)}")
    cfg = {**DEFAULT_CONFIG, **config}
    pad_bytes = symm_mem.get_signal_pad_size() if pad_bytes is None else pad_bytes
    tokens = cfg["tokens"]
    num_blocks = max(1, min(cdiv(num_tokens, tokens), cfg["max_blocks"], barrier_blocks(world_size, pad_bytes)))
    tokens_per_block = cdiv(cdiv(num_tokens, num_blocks), tokens) * tokens
    return {"tokens": tokens, "block_h": min(cfg["block_h"], triton.next_power_of_2(hidden)),
            "num_warps": cfg["num_warps"], "num_blocks": max(1, cdiv(num_tokens, tokens_per_block)),
            "tokens_per_block": tokens_per_block}


def triton_launch(kernel, grid: tuple[int, ...], *args, **meta):
    """``launch``'s default launcher: Triton's own ``kernel[grid](...)``."""
    return kernel[grid](*args, **meta)


def launch(
    out: torch.Tensor,
    weights: torch.Tensor,
    slots: torch.Tensor,
    recv_peers: tuple[torch.Tensor, ...],
    signal_pad_ptrs: int,
    rank: int,
    capacity: int,
    tokens: int,
    block_h: int,
    num_warps: int,
    num_blocks: int,
    tokens_per_block: int,
    group_name: str = "",
    launcher=triton_launch,
) -> torch.Tensor:
    """Launch on planned arguments (no checks; the expert outputs are in ``recv_peers``, every rank's receive
    buffer); the same signature as the Helion twin's. ``slots [T, k]`` int32: the dispatch's. ``group_name`` is
    unused here (Helion takes it as its ``hl.ProcessGroupName``); ``launcher``: Triton's own launch, or the one the
    installed package's prepared call passes."""
    launcher(
        combine_kernel, (num_blocks,), out, weights, slots, recv_peers, signal_pad_ptrs, out.shape[0],
        out.shape[1], capacity, tokens_per_block, rank, len(recv_peers), TOP_K=weights.shape[1],
        TOKENS=tokens, BLOCK_H=block_h, num_warps=num_warps,
    )
    return out


def symmetric_peers(buf: torch.Tensor, group) -> tuple:
    """Every rank's ``buf`` (a symmetric tensor, the same shape on every rank) as this rank sees it, the signal
    pads' pointer array, this rank (a collective: every rank calls it)."""
    handle = symm_mem.rendezvous(buf, group if isinstance(group, str) else group.group_name)
    shape = tuple(buf.shape)
    peers = tuple(buf if r == handle.rank else handle.get_buffer(r, shape, buf.dtype) for r in range(handle.world_size))
    return peers, handle.signal_pad_ptrs_dev, handle.rank


def moe_combine(expert_out: torch.Tensor, recv: torch.Tensor, slots: torch.Tensor, weights: torch.Tensor,
                group: dist.ProcessGroup | str | None = None, **config) -> torch.Tensor:
    """``[T, H]``: every token's expert outputs weighted by ``weights [T, k]`` and summed (fp32, j order), in
    the original token order on its home rank.

    The recipe spelled out: ``recv`` and ``slots`` are what the dispatch returned (its symmetric receive buffer
    ``[capacity, H]`` and where each pair went); ``expert_out`` is copied into ``recv`` unless it is ``recv``; the
    peers of ``recv``, the plan, one launch. It checks nothing; ``kraken.moe_combine`` is the installed one (it
    takes the dispatch's handle, checks agreed across ranks, prepared calls)."""
    group = dist.group.WORLD if group is None else group
    peers, signal_pad_ptrs, rank = symmetric_peers(recv, group)
    if expert_out.data_ptr() != recv.data_ptr():
        recv.copy_(expert_out)
    out = expert_out.new_empty((weights.shape[0], expert_out.shape[1]))
    cfg = plan(weights.shape[0], recv.shape[1], len(peers), config)
    return launch(out, weights, slots, peers, signal_pad_ptrs, rank, recv.shape[0], **cfg)


def reference_combine(all_expert_out: list[torch.Tensor], all_slots: list[torch.Tensor], weights: torch.Tensor,
                      rank: int, capacity: int) -> torch.Tensor:
    """Rank ``rank``'s combine with plain torch (fp32, j order) from every rank's expert outputs and this
    rank's slots (``reference_slots`` of ``kraken/comm/moe_dispatch.py``) and weights."""
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


def main(num_tokens: int = 512, hidden: int = 4096, top_k: int = 2, iters: int = 100) -> None:
    """Route every rank's tokens with a simple rule (pair (t, j) of rank s to rank (s + t + j) % world_size, at a
    row of its own), push the rows into the owners' receive buffers with plain torch, combine the identity expert
    and twice it against plain torch, and time the combine (``torchrun``, or alone as a group of one)."""
    if "RANK" not in os.environ:  # run alone: a group of one
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT="29501")
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", device_id=device)
    rank, world_size = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(rank)
    tokens = torch.randn(num_tokens, hidden, dtype=torch.bfloat16, device=device)
    weights = torch.rand(num_tokens, top_k, device=device)
    capacity = world_size * num_tokens * top_k  # rank s's rows: s * T * k .. on every owner
    recv = symm_mem.empty((capacity, hidden), dtype=tokens.dtype, device=device)
    peers, signal_pad_ptrs, _ = symmetric_peers(recv, dist.group.WORLD)
    t, j = torch.arange(num_tokens, device=device)[:, None], torch.arange(top_k, device=device)[None, :]
    owner = (rank + t + j) % world_size
    row = rank * num_tokens * top_k + t * top_k + j
    slots = (owner * capacity + row).int()
    for r in range(world_size):  # plain torch stores into the peers' buffers (their rows from this rank)
        mine = owner == r
        peers[r][row[mine]] = tokens.expand(top_k, -1, -1).transpose(0, 1)[mine]
    torch.cuda.synchronize()
    dist.barrier()  # every rank's rows have landed
    torch.cuda.synchronize()

    expected = tokens.float() * weights.sum(1, keepdim=True)
    doubled = recv * 2  # an ordinary tensor: copied into recv first
    got = moe_combine(doubled, recv, slots, weights)
    torch.testing.assert_close(got.float(), 2 * expected, rtol=2e-2, atol=2e-2)
    got = moe_combine(recv, recv, slots, weights)  # the identity expert: recv itself, zero copy
    torch.testing.assert_close(got.float(), 2 * expected, rtol=2e-2, atol=2e-2)

    out, cfg = torch.empty_like(tokens), plan(num_tokens, hidden, world_size, {})
    for _ in range(10):  # warm up (compile)
        launch(out, weights, slots, peers, signal_pad_ptrs, rank, capacity, **cfg)
    dist.barrier()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(iters):
        launch(out, weights, slots, peers, signal_pad_ptrs, rank, capacity, **cfg)
    torch.cuda.synchronize()
    us = (time.perf_counter() - start) / iters * 1e6
    torch.testing.assert_close(out.float(), 2 * expected, rtol=2e-2, atol=2e-2)
    if rank == 0:
        print(f"moe_combine: {num_tokens} tokens x {hidden} bf16, top-{top_k} x {world_size} ranks: matches plain "
              f"torch, {us:.1f} us per call (eager launches; {cfg})")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
