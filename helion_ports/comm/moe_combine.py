"""Helion twin of ``kraken/comm/moe_combine.py``: the same algorithm, plan and arguments.

The structure mirrors the Triton recipe one to one: ``hl.grid(num_blocks)`` is the persistent grid
and the barrier's block id; block ``b`` combines its contiguous range of tokens in ``[tokens,
block_h]`` tiles; for each of the k experts (``hl.static_range``) the row is gathered from its owner's
receive buffer with one masked ``hl.load`` per rank (exactly one of them loads), weighted and added
in fp32; the barriers are the kraken PTX through ``hl.inline_triton``. ``helion_ports.moe_combine`` is
the installed twin (the dispatch's handle, checks agreed across ranks, prepared calls, replayed launches).

Set ``HELION_PRINT_OUTPUT_CODE=1`` to see the generated Triton.

    torchrun --nproc-per-node 2 helion_ports/comm/moe_combine.py
"""

from __future__ import annotations

import functools
import os
import time

import helion
import helion.language as hl
import torch
import torch.distributed as dist
import torch.distributed._symmetric_memory as symm_mem
import triton

from kraken._blocks.helion import flat_kernel, run
from kraken._ptx_utils import barrier_blocks
from kraken._ptx_utils.inline_source import SYMM_MEM_SYNC

# The recipe's defaults (kraken/comm/moe_combine.py), kept equal by a test.
DEFAULT_CONFIG = {"tokens": 2, "block_h": 1024, "num_warps": 8, "max_blocks": 528}

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


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def plan(num_tokens: int, hidden: int, world_size: int, config: dict, pad_bytes: int | None = None) -> dict:
    """The recipe's plan: block b combines tokens ``b * tokens_per_block ..``, at most ``max_blocks`` blocks and the
    block ids the signal pad holds."""
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
    launcher=None,
) -> torch.Tensor:
    """Launch on planned arguments (no checks); the recipe's ``launch`` signature. ``launcher``: None for a plain
    call, or the installed package's (``run``)."""
    target = out
    if out.shape[0] == 1:
        # Helion 1.5.0 specialises a size-1 dimension and then stores every row of the tile to row 0, the
        # masked-off ones too (docs/helion-notes.md): combine one token as two, the second going nowhere.
        slots = torch.cat([slots, torch.full_like(slots, -1)])
        weights = torch.cat([weights, torch.zeros_like(weights)])
        target = out.new_empty((2, out.shape[1]))
    args = (target, weights, slots, recv_peers, signal_pad_ptrs, num_blocks, tokens_per_block, capacity, rank,
            len(recv_peers), group_name)
    run(compiled(tokens, block_h, num_warps), args, launcher)
    if target is not out:
        out.copy_(target[:1])
    return out


def symmetric_peers(buf: torch.Tensor, name: str) -> tuple:
    """Every rank's ``buf`` (a symmetric tensor, the same shape on every rank) as this rank sees it, the signal
    pads' pointer array, this rank (a collective: every rank calls it)."""
    handle = symm_mem.rendezvous(buf, name)
    shape = tuple(buf.shape)
    peers = tuple(buf if r == handle.rank else handle.get_buffer(r, shape, buf.dtype) for r in range(handle.world_size))
    return peers, handle.signal_pad_ptrs_dev, handle.rank


def moe_combine(expert_out: torch.Tensor, recv: torch.Tensor, slots: torch.Tensor, weights: torch.Tensor,
                group: dist.ProcessGroup | str | None = None, **config) -> torch.Tensor:
    """``[T, H]``: every token's expert outputs weighted by ``weights [T, k]`` and summed in fp32, in token order,
    as the recipe's plain function (``recv`` and ``slots``: the dispatch's; ``expert_out`` copied into ``recv``
    unless it is ``recv``; no checks)."""
    group = dist.group.WORLD if group is None else group
    name = group if isinstance(group, str) else group.group_name
    peers, signal_pad_ptrs, rank = symmetric_peers(recv, name)
    if expert_out.data_ptr() != recv.data_ptr():
        recv.copy_(expert_out)
    out = expert_out.new_empty((weights.shape[0], expert_out.shape[1]))
    cfg = plan(weights.shape[0], recv.shape[1], len(peers), config)
    return launch(out, weights, slots, peers, signal_pad_ptrs, rank, recv.shape[0], **cfg, group_name=name)


def main(num_tokens: int = 512, hidden: int = 4096, top_k: int = 2, iters: int = 100) -> None:
    """Route every rank's tokens with a simple rule (pair (t, j) of rank s to rank (s + t + j) % world_size, at a
    row of its own), push the rows into the owners' receive buffers with plain torch, combine the identity expert
    and twice it against plain torch, and time the combine (``torchrun``, or alone as a group of one)."""
    if "RANK" not in os.environ:  # run alone: a group of one
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT="29501")
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", device_id=device)
    rank, world_size, name = dist.get_rank(), dist.get_world_size(), dist.group.WORLD.group_name
    torch.manual_seed(rank)
    tokens = torch.randn(num_tokens, hidden, dtype=torch.bfloat16, device=device)
    weights = torch.rand(num_tokens, top_k, device=device)
    capacity = world_size * num_tokens * top_k  # rank s's rows: s * T * k .. on every owner
    recv = symm_mem.empty((capacity, hidden), dtype=tokens.dtype, device=device)
    peers, signal_pad_ptrs, _ = symmetric_peers(recv, name)
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
    got = moe_combine(recv * 2, recv, slots, weights)  # an ordinary tensor: copied into recv first
    torch.testing.assert_close(got.float(), 2 * expected, rtol=2e-2, atol=2e-2)
    got = moe_combine(recv, recv, slots, weights)  # the identity expert: recv itself, zero copy
    torch.testing.assert_close(got.float(), 2 * expected, rtol=2e-2, atol=2e-2)

    out, cfg = torch.empty_like(tokens), plan(num_tokens, hidden, world_size, {})
    for _ in range(10):  # warm up
        launch(out, weights, slots, peers, signal_pad_ptrs, rank, capacity, **cfg, group_name=name)
    dist.barrier()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(iters):
        launch(out, weights, slots, peers, signal_pad_ptrs, rank, capacity, **cfg, group_name=name)
    torch.cuda.synchronize()
    us = (time.perf_counter() - start) / iters * 1e6
    torch.testing.assert_close(out.float(), 2 * expected, rtol=2e-2, atol=2e-2)
    if rank == 0:
        print(f"helion moe_combine: {num_tokens} tokens x {hidden} bf16, top-{top_k} x {world_size} ranks: matches "
              f"plain torch, {us:.1f} us per call (plain launches; {cfg})")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
