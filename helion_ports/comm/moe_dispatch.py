"""Helion twin of ``kraken/comm/moe_dispatch.py``: the same routing, layout, plan and arguments.

The routing bookkeeping (count histogram, the on-device count exchange with its barrier and the
prefix sums, each pair's destination slot) is the recipe's three small Triton kernels, building
blocks shared by both (``kraken._blocks.moe``): it is index arithmetic on a few kilobytes, and the
twin's subject is the data movement. The token copy is ported: ``hl.grid(num_blocks)`` is the
persistent grid and the barrier's block id, block ``b`` copies its contiguous range of (token, k)
pairs, whole rows, as ``[rows, block_h]`` tiles gathered from the local tokens and stored into the
owner's receive buffer (one masked ``hl.store`` per rank, unrolled with ``hl.static_range``; exactly
one of them stores), then the kraken barrier (release + acquire) through ``hl.inline_triton``.
``helion_ports.moe_dispatch`` is the installed twin (checks agreed across ranks, buffers kept per shape,
the handle, launches replayed from a CUDA graph). Set ``HELION_PRINT_OUTPUT_CODE=1`` to see the
generated Triton.

    torchrun --nproc-per-node 2 helion_ports/comm/moe_dispatch.py
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

from kraken._blocks.helion import flat_kernel, run, views
from kraken._blocks.moe import exchange_kernel, histogram_kernel, slots_kernel
from kraken._ptx_utils import barrier_blocks
from kraken._ptx_utils.inline_source import SYMM_MEM_SYNC

# The recipe's defaults (kraken/comm/moe_dispatch.py), kept equal by a test.
DEFAULT_CONFIG = {"rows": 4, "block_h": 1024, "num_warps": 8, "max_blocks": 132}
CHUNK = 128  # (token, k) pairs per program of the histogram and slots kernels

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


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def plan(num_tokens: int, top_k: int, hidden: int, num_experts: int, world_size: int, config: dict,
         pad_bytes: int | None = None) -> dict:
    """The recipe's plan: routing chunks, padded sizes, the copy's persistent grid (block b copies pairs
    ``b * pairs_per_block ..``, whole rows; at most ``max_blocks`` and the block ids the signal pad holds)."""
    unknown = set(config) - set(DEFAULT_CONFIG)
    if unknown:
        raise TypeError(f"moe_dispatch: unknown config keys {sorted(unknown)}; known: {sorted(DEFAULT_CONFIG)}")
    cfg = {**DEFAULT_CONFIG, **config}
    pad_bytes = symm_mem.get_signal_pad_size() if pad_bytes is None else pad_bytes
    num_pairs = num_tokens * top_k
    rows = cfg["rows"]
    num_blocks = max(1, min(cdiv(num_pairs, rows), cfg["max_blocks"], barrier_blocks(world_size, pad_bytes)))
    pairs_per_block = cdiv(cdiv(num_pairs, num_blocks), rows) * rows
    return {
        "num_chunks": max(1, cdiv(num_pairs, CHUNK)),
        "e_pad": max(16, triton.next_power_of_2(num_experts)),
        "ws_pad": max(2, triton.next_power_of_2(world_size)),
        "rows": rows, "block_h": min(cfg["block_h"], triton.next_power_of_2(hidden)), "num_warps": cfg["num_warps"],
        "num_blocks": max(1, cdiv(num_pairs, pairs_per_block)), "pairs_per_block": pairs_per_block,
    }


def default_capacity(num_tokens: int, top_k: int) -> int:
    """Receive rows per rank when none is given: twice what an evenly routed rank receives (``T * k``)."""
    return max(1, 2 * num_tokens * top_k)


def triton_launch(kernel, grid: tuple[int, ...], *args, **meta):
    """The routing kernels' launch when no launcher is given: Triton's own ``kernel[grid](...)``."""
    return kernel[grid](*args, **meta)


def routing_scratch(num_pairs: int, num_chunks: int, e_pad: int, device: torch.device) -> tuple[torch.Tensor, ...]:
    """The routing kernels' local scratch (per chunk: counts and first rows per expert; per pair: its place)."""
    hist = torch.empty((num_chunks, e_pad), dtype=torch.int32, device=device)
    chunk_base = torch.empty((num_chunks, e_pad), dtype=torch.int32, device=device)
    return hist, chunk_base, torch.empty(num_pairs, dtype=torch.int32, device=device)


def route(expert_ids, slots, recv_counts, recv_offsets, status, count_peers, count_signal_pads, rank, num_experts,
          capacity, num_chunks, e_pad, ws_pad, scratch=None, launcher=None) -> None:
    """The recipe's steps 1-3 (histogram, count exchange + prefix sums, slots), its Triton kernels as they are."""
    launcher = launcher or triton_launch
    world_size = len(count_peers)
    num_pairs = expert_ids.numel()
    hist, chunk_base, place = scratch or routing_scratch(num_pairs, num_chunks, e_pad, expert_ids.device)
    per_rank = num_experts // world_size
    launcher(histogram_kernel, (num_chunks,), expert_ids, hist, place, num_pairs, num_experts, CHUNK=CHUNK,
             E_PAD=e_pad, num_warps=4)
    launcher(
        exchange_kernel, (1,), hist, chunk_base, count_peers, count_peers[rank], count_signal_pads, recv_counts,
        recv_offsets, status, num_chunks, num_experts, per_rank, capacity, rank, world_size, E_PAD=e_pad,
        WS_PAD=ws_pad, CHUNK_TILE=32, num_warps=4,
    )
    launcher(slots_kernel, (num_chunks,), expert_ids, place, chunk_base, slots, status, num_pairs, num_experts,
             per_rank, capacity, CHUNK=CHUNK, E_PAD=e_pad, num_warps=4)


def launch(
    tokens: torch.Tensor,
    expert_ids: torch.Tensor,
    slots: torch.Tensor,
    recv_counts: torch.Tensor,
    recv_offsets: torch.Tensor,
    status: torch.Tensor,
    recv_peers: tuple[torch.Tensor, ...],
    recv_signal_pads: int,
    count_peers: tuple[torch.Tensor, ...],
    count_signal_pads: int,
    rank: int,
    num_experts: int,
    capacity: int,
    rows: int,
    block_h: int,
    num_warps: int,
    num_blocks: int,
    pairs_per_block: int,
    num_chunks: int,
    e_pad: int,
    ws_pad: int,
    scratch: tuple[torch.Tensor, ...] | None = None,
    group_name: str = "",
    launcher=None,
) -> torch.Tensor:
    """Launch on planned arguments (no checks); the recipe's ``launch`` signature: ``route``, then the ported
    copy. ``launcher``: None for plain calls, or the installed package's (``run``). Returns ``recv_peers[rank]``."""
    route(expert_ids, slots, recv_counts, recv_offsets, status, count_peers, count_signal_pads, rank, num_experts,
          capacity, num_chunks, e_pad, ws_pad, scratch, launcher)
    args = (tokens, slots.view(-1), views(recv_peers, -1), recv_signal_pads, num_blocks, pairs_per_block, capacity,
            expert_ids.shape[1], rank, len(recv_peers), group_name)
    run(compiled(rows, block_h, num_warps), args, launcher)
    return recv_peers[rank]


def symmetric_peers(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, name: str) -> tuple:
    """A symmetric buffer on every rank of the group ``name`` (a collective): (every rank's buffer as this rank
    sees it, the signal pads' pointer array, this rank)."""
    buf = symm_mem.empty(shape, dtype=dtype, device=device)
    handle = symm_mem.rendezvous(buf, name)
    peers = tuple(buf if r == handle.rank else handle.get_buffer(r, shape, dtype) for r in range(handle.world_size))
    return peers, handle.signal_pad_ptrs_dev, handle.rank


def moe_dispatch(
    tokens: torch.Tensor,
    expert_ids: torch.Tensor,
    num_experts: int,
    group: dist.ProcessGroup | str | None = None,
    capacity: int | None = None,
    **config,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Send each token to its top-k experts' ranks: ``(recv, recv_counts, recv_offsets, slots, status)``, as the
    recipe's plain function (a symmetric receive buffer and count table per call, the plan, the launches; no
    checks)."""
    group = dist.group.WORLD if group is None else group
    name = group if isinstance(group, str) else group.group_name
    (num_tokens, hidden), top_k, device = tokens.shape, expert_ids.shape[1], tokens.device
    capacity = default_capacity(num_tokens, top_k) if capacity is None else capacity
    recv_peers, recv_pads, rank = symmetric_peers((capacity, hidden), tokens.dtype, device, name)
    cfg = plan(num_tokens, top_k, hidden, num_experts, len(recv_peers), config)
    count_peers, count_pads, _ = symmetric_peers((len(recv_peers), cfg["e_pad"]), torch.int32, device, name)
    local = num_experts // len(recv_peers)
    slots = torch.empty((num_tokens, top_k), dtype=torch.int32, device=device)
    recv_counts, recv_offsets, status = (torch.empty(n, dtype=torch.int32, device=device) for n in (local, local, 2))
    recv = launch(tokens, expert_ids, slots, recv_counts, recv_offsets, status, recv_peers, recv_pads, count_peers,
                  count_pads, rank, num_experts, capacity, **cfg, group_name=name)
    return recv, recv_counts, recv_offsets, slots, status


def main(num_tokens: int = 512, hidden: int = 4096, experts_per_rank: int = 4, top_k: int = 2,
         iters: int = 100) -> None:
    """Dispatch random tokens on random routing; check that every row this rank received is the token its sender's
    slot names, and the counts; time the launches on buffers made once (``torchrun``, or alone)."""
    if "RANK" not in os.environ:  # run alone: a group of one
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT="29501")
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", device_id=device)
    rank, world_size = dist.get_rank(), dist.get_world_size()
    num_experts, name = experts_per_rank * world_size, dist.group.WORLD.group_name
    torch.manual_seed(rank)
    tokens = torch.randn(num_tokens, hidden, dtype=torch.bfloat16, device=device)
    ids = torch.randint(0, num_experts, (num_tokens, top_k), device=device)
    capacity = world_size * num_tokens * top_k  # every pair fits whatever the routing
    for _ in range(2):  # compile, then a warm call
        recv, recv_counts, recv_offsets, slots, status = moe_dispatch(tokens, ids, num_experts, capacity=capacity)
    all_tokens, all_slots = [torch.empty_like(tokens) for _ in range(world_size)], [torch.empty_like(slots)
                                                                                   for _ in range(world_size)]
    dist.all_gather(all_tokens, tokens)
    dist.all_gather(all_slots, slots)
    received = []  # the rows this rank received
    for source, sent in zip(all_tokens, all_slots):
        pairs = torch.nonzero(sent.flatten() // capacity == rank).flatten()
        received.append(sent.flatten()[pairs] % capacity)
        assert torch.equal(recv[received[-1]], source[pairs // top_k]), "a received row is not its token"
    received = torch.cat(received)
    assert int(recv_counts.sum()) == received.numel() and status.tolist() == [0, 0]

    recv_peers, recv_pads, _ = symmetric_peers((capacity, hidden), tokens.dtype, device, name)
    cfg = plan(num_tokens, top_k, hidden, num_experts, world_size, {})
    count_peers, count_pads, _ = symmetric_peers((world_size, cfg["e_pad"]), torch.int32, device, name)
    scratch = routing_scratch(ids.numel(), cfg["num_chunks"], cfg["e_pad"], device)
    args = (tokens, ids, slots, recv_counts, recv_offsets, status, recv_peers, recv_pads, count_peers, count_pads,
            rank, num_experts, capacity)
    for _ in range(10):  # warm up
        launch(*args, **cfg, scratch=scratch, group_name=name)
    dist.barrier()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(iters):
        launch(*args, **cfg, scratch=scratch, group_name=name)
    torch.cuda.synchronize()
    us = (time.perf_counter() - start) / iters * 1e6
    assert torch.equal(recv_peers[rank][received], recv[received]), "received rows differ after the timed calls"
    if rank == 0:
        print(f"helion moe_dispatch: {num_tokens} tokens x {hidden} bf16, top-{top_k} of {num_experts} experts x "
              f"{world_size} ranks: every row is its token, {us:.1f} us per call (plain launches; {cfg})")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
