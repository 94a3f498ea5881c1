"""Mixture-of-experts token dispatch: every token goes to the ranks that hold its top-k experts.

Shape conventions: those of Megatron-LM's all-to-all token dispatcher and of torch's
``all_to_all_vdev_2d`` (torchtitan), i.e. what a grouped GEMM with per-expert offsets
(``torch._grouped_mm(x, w, offs=...)``) consumes. ``num_experts`` global experts, ``E_local =
num_experts / world_size`` per rank, rank ``d`` owns experts ``d * E_local .. (d + 1) * E_local - 1``.
Each rank passes ``tokens [T, H]`` and ``expert_ids [T, k]`` (top-k ids; ``-1`` means "no expert",
as in DeepEP). Rank ``d`` receives ``recv [capacity, H]``, *expert-major*: local expert ``e``'s rows
are ``recv_offsets[e] .. recv_offsets[e] + recv_counts[e]``, and within an expert the rows come
from rank 0, 1, ..., each rank's in token order (then k order): exactly the rows Megatron's
permute + ``all_to_all_single`` + ``sort_chunks_by_idxs`` produce. Each (token, k) pair is one row
(a token with two experts on one rank is sent twice, as in Megatron and DeepEP's low-latency mode).

Capacity: ``recv`` has ``capacity`` rows on every rank (symmetric memory). The default is ``2 * T * k``,
twice the rows an evenly routed rank receives; the worst case is ``world_size * T * k``. Rows past
``capacity`` are *dropped*: never written, counted on the sending rank in ``status[0]`` (a device tensor),
and ``recv_counts`` counts only the rows that fit. Which rows drop is deterministic: the rows whose place
in the expert-major order is ``>= capacity``. Ids outside ``[-1, num_experts)`` are skipped and counted in
``status[1]`` (the ids live on the device: checking them on the host would be a synchronisation per call).

Counts travel on the device, no host synchronisation, in four launches:

1. ``histogram_kernel`` (one program per chunk of 128 (token, k) pairs): each chunk's count per
   expert, and each pair's place among its chunk's pairs for the same expert;
2. ``exchange_kernel`` (one program): sums the chunks, writes this rank's count per expert into
   row ``rank`` of every rank's symmetric ``counts [world_size, E]``, barrier ("my counts are
   visible to you", and: every rank has finished its previous call, so its ``recv`` may be
   overwritten), then the prefix sums: the first row of (this rank, expert ``e``) on ``e``'s owner
   is (rows of the owner's earlier experts, from every rank) + (rows of expert ``e`` from lower
   ranks); plus each chunk's offset, and this rank's ``recv_counts``/``recv_offsets``;
3. ``slots_kernel`` (one program per chunk): each pair's destination ``owner * capacity + row``,
   or -1 (dropped, or no expert), and the drop and bad-id counts;
4. ``dispatch_kernel`` (persistent grid, block ``b`` takes a contiguous range of pairs): copies
   each pair's token row from local memory into its owner's ``recv`` (NVLink stores, posted: the
   block does not wait for them), then barrier ``b`` (release + acquire): when the kernel ends,
   every peer's rows for this rank have landed.

Steps 1-3 are building blocks (``kraken._blocks.moe``), shared with the Helion twin, which ports step 4.
``slots`` is what the combine (``kraken/comm/moe_combine.py``) needs to bring each pair's expert output home.

CUDA graphs: the barriers reset themselves and every launch size depends on shapes only. A caveat of
reusing the buffers (as in DeepEP's low-latency mode): ``recv`` is overwritten by the next dispatch into
it, so finish with one (combine it) before dispatching the next.

This file is the recipe: the copy kernel, ``plan`` (pure), ``launch`` (the seam the installed package's fast
path calls with its own ``launcher``), a plain host function and the plain-torch reference.
``kraken.moe_dispatch`` is the same kernels behind the product layer (``kraken.runtime.moe``: checks agreed
across ranks, a receive buffer kept per shape, a handle for the combine, launches replayed from a CUDA graph).

    torchrun --nproc-per-node 2 kraken/comm/moe_dispatch.py
"""

from __future__ import annotations

import os
import time

import torch
import torch.distributed as dist
import torch.distributed._symmetric_memory as symm_mem
import triton
import triton.language as tl

from kraken._blocks.moe import exchange_kernel, histogram_kernel, slots_kernel
from kraken._ptx_utils import barrier_blocks, symm_mem_sync

DEFAULT_CONFIG = {"rows": 4, "block_h": 1024, "num_warps": 8, "max_blocks": 132}
CHUNK = 128  # (token, k) pairs per program of the histogram and slots kernels


@triton.jit
def dispatch_kernel(
    tokens_ptr,  # [T, H], local
    slots_ptr,  # [T * k] int32: owner * capacity + row, or -1
    recv_peers,  # tuple of world_size pointers: rank r's recv [capacity, H]
    signal_pad_ptrs,  # of the recv buffer
    num_pairs,
    hidden,
    capacity,
    pairs_per_block,
    rank,
    world_size: tl.constexpr,
    TOP_K: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    block_id = tl.program_id(0)
    start = block_id * pairs_per_block
    end = tl.minimum(start + pairs_per_block, num_pairs)
    for p0 in tl.range(start, end, ROWS):
        pairs = p0 + tl.arange(0, ROWS)
        slot = tl.load(slots_ptr + pairs, mask=pairs < end, other=-1)
        kept = slot >= 0
        slot = tl.maximum(slot, 0)  # Triton's integer division truncates: divide non-negatives only
        owner = slot // capacity
        row = slot - owner * capacity
        token = pairs // TOP_K
        for h in tl.range(0, hidden, BLOCK_H):
            cols = h + tl.arange(0, BLOCK_H)
            inside = kept[:, None] & (cols[None, :] < hidden)
            values = tl.load(tokens_ptr + token[:, None] * hidden + cols[None, :], mask=inside)
            for r in tl.static_range(world_size):  # one store per row lands: the owner's
                tl.store(recv_peers[r] + row[:, None] * hidden + cols[None, :], values,
                         mask=inside & (owner[:, None] == r))
    # Release: this block's rows are visible to their owners. Acquire: the peers' blocks b have pushed theirs,
    # so once every block has passed this, every row for this rank has landed.
    symm_mem_sync(signal_pad_ptrs, block_id, rank, world_size, hasPreviousMemAccess=True, hasSubsequentMemAccess=True)


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def plan(num_tokens: int, top_k: int, hidden: int, num_experts: int, world_size: int, config: dict,
         pad_bytes: int | None = None) -> dict:
    """The launch configuration: routing chunks, padded sizes, the copy's persistent grid (block b copies pairs
    ``b * pairs_per_block ..``, whole rows; at most ``max_blocks`` and the block ids the signal pad holds,
    ``pad_bytes``, by default torch's pad size)."""
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
    """``launch``'s default launcher: Triton's own ``kernel[grid](...)``."""
    return kernel[grid](*args, **meta)


def routing_scratch(num_pairs: int, num_chunks: int, e_pad: int, device: torch.device) -> tuple[torch.Tensor, ...]:
    """The routing kernels' local scratch: per chunk its count per expert and its first row per expert, per pair
    its place in its chunk. Consumed within one call (stream order), so one set may serve every call of a shape."""
    hist = torch.empty((num_chunks, e_pad), dtype=torch.int32, device=device)
    chunk_base = torch.empty((num_chunks, e_pad), dtype=torch.int32, device=device)
    return hist, chunk_base, torch.empty(num_pairs, dtype=torch.int32, device=device)


def route(expert_ids, slots, recv_counts, recv_offsets, status, count_peers, count_signal_pads, rank, num_experts,
          capacity, num_chunks, e_pad, ws_pad, scratch=None, launcher=triton_launch) -> None:
    """Steps 1-3 (histogram, count exchange + prefix sums, slots): fill ``slots``, ``recv_counts``,
    ``recv_offsets`` and ``status``. ``count_peers``: every rank's symmetric ``counts [world_size, e_pad]``
    int32; ``scratch``: ``routing_scratch``'s tensors (made here when not given)."""
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
    launcher=triton_launch,
) -> torch.Tensor:
    """Launch on planned arguments (no checks): ``route``, then the copy; the same signature as the Helion twin's.

    Writes ``slots [T, k]``, ``recv_counts`` / ``recv_offsets [E_local]`` and ``status [2]`` (int32, this rank's),
    and every rank's rows for this rank into ``recv_peers[rank] [capacity, H]``, which it returns.
    ``recv_peers`` / ``count_peers``: every rank's receive buffer and ``counts [world_size, e_pad]`` int32 (two
    symmetric allocations, each with its signal pads). ``group_name`` is unused here (Helion takes it as its
    ``hl.ProcessGroupName``). ``launcher(kernel, grid, *args, **meta)``: Triton's own launch, or the one the
    installed package's prepared call passes."""
    route(expert_ids, slots, recv_counts, recv_offsets, status, count_peers, count_signal_pads, rank, num_experts,
          capacity, num_chunks, e_pad, ws_pad, scratch, launcher)
    launcher(
        dispatch_kernel, (num_blocks,), tokens, slots, recv_peers, recv_signal_pads, expert_ids.numel(),
        tokens.shape[1], capacity, pairs_per_block, rank, len(recv_peers), TOP_K=expert_ids.shape[1], ROWS=rows,
        BLOCK_H=block_h, num_warps=num_warps,
    )
    return recv_peers[rank]


def symmetric_peers(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, group) -> tuple:
    """A symmetric buffer on every rank of ``group`` (a collective): (every rank's buffer as this rank sees it,
    the signal pads' pointer array, this rank)."""
    buf = symm_mem.empty(shape, dtype=dtype, device=device)
    handle = symm_mem.rendezvous(buf, group if isinstance(group, str) else group.group_name)
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
    """Send each token to its top-k experts' ranks: ``(recv, recv_counts, recv_offsets, slots, status)``.

    The recipe spelled out: a symmetric receive buffer and a symmetric count table on every rank, the plan, the
    four launches. ``recv`` and ``slots`` are what ``kraken/comm/moe_combine.py`` takes back. It allocates and
    rendezvouses on every call and checks nothing; ``kraken.moe_dispatch`` is the installed one (checks agreed
    across ranks, buffers kept per shape, a handle, ``check_status``)."""
    group = dist.group.WORLD if group is None else group
    (num_tokens, hidden), top_k, device = tokens.shape, expert_ids.shape[1], tokens.device
    capacity = default_capacity(num_tokens, top_k) if capacity is None else capacity
    recv_peers, recv_pads, rank = symmetric_peers((capacity, hidden), tokens.dtype, device, group)
    cfg = plan(num_tokens, top_k, hidden, num_experts, len(recv_peers), config)
    count_peers, count_pads, _ = symmetric_peers((len(recv_peers), cfg["e_pad"]), torch.int32, device, group)
    local = num_experts // len(recv_peers)
    slots = torch.empty((num_tokens, top_k), dtype=torch.int32, device=device)
    recv_counts, recv_offsets, status = (torch.empty(n, dtype=torch.int32, device=device) for n in (local, local, 2))
    recv = launch(tokens, expert_ids, slots, recv_counts, recv_offsets, status, recv_peers, recv_pads, count_peers,
                  count_pads, rank, num_experts, capacity, **cfg)
    return recv, recv_counts, recv_offsets, slots, status


# ---------------------------------------------------------------------------
# The reference (plain torch, any device): what every rank receives, from every rank's routing
# ---------------------------------------------------------------------------

def reference_slots(all_expert_ids: list[torch.Tensor], num_experts: int, capacity: int) -> dict:
    """The dispatch's bookkeeping from every rank's ``expert_ids``, by plain sorting: per rank ``slots``
    (as in ``MoEHandle``), ``recv_counts``, ``recv_offsets``, ``dropped`` and ``bad`` counts."""
    world_size = len(all_expert_ids)
    per_rank = num_experts // world_size
    ids = [x.reshape(-1).long().cpu() for x in all_expert_ids]
    valid = [(x >= 0) & (x < num_experts) for x in ids]
    counts = torch.stack([torch.bincount(x[v], minlength=num_experts) for x, v in zip(ids, valid)])  # [src, e]
    total = counts.sum(0)
    expert_base = torch.zeros(num_experts, dtype=torch.long)
    for e in range(num_experts):
        first = (e // per_rank) * per_rank
        expert_base[e] = total[first:e].sum()
    out = {"slots": [], "recv_counts": [], "recv_offsets": [], "dropped": [], "bad": []}
    for s in range(world_size):
        slots = torch.full_like(ids[s], -1)
        start = expert_base + counts[:s].sum(0)
        seen = torch.zeros(num_experts, dtype=torch.long)
        dropped = 0
        for i in torch.nonzero(valid[s]).flatten().tolist():  # token order, then k order
            e = int(ids[s][i])
            row = int(start[e] + seen[e])
            seen[e] += 1
            if row < capacity:
                slots[i] = (e // per_rank) * capacity + row
            else:
                dropped += 1
        out["slots"].append(slots.view(all_expert_ids[s].shape).int())
        out["dropped"].append(dropped)
        out["bad"].append(int(((ids[s] != -1) & ~valid[s]).sum()))
        mine = slice(s * per_rank, (s + 1) * per_rank)
        base = expert_base[mine]
        out["recv_offsets"].append(base.clamp(max=capacity).int())
        out["recv_counts"].append(torch.minimum(total[mine], (capacity - base).clamp(min=0)).int())
    return out


def reference_dispatch(all_tokens: list[torch.Tensor], all_expert_ids: list[torch.Tensor], num_experts: int,
                       capacity: int, rank: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s ``(recv rows, recv_counts, recv_offsets)``: the rows that hold data, ``[rows used, H]``
    (the rest of ``recv`` is not written), gathered with plain torch from every rank's tokens and routing."""
    ref = reference_slots(all_expert_ids, num_experts, capacity)
    hidden = all_tokens[0].shape[1]
    used = int((ref["recv_offsets"][rank] + ref["recv_counts"][rank]).max()) if num_experts else 0
    out = all_tokens[0].new_zeros((used, hidden))
    top_k = all_expert_ids[0].shape[1]
    for s, slots in enumerate(ref["slots"]):
        flat = slots.reshape(-1).long()
        here = (flat >= 0) & (flat // capacity == rank)
        pairs = torch.nonzero(here).flatten()
        rows = (flat[pairs] % capacity).to(out.device)
        out[rows] = all_tokens[s][(pairs // top_k).to(all_tokens[s].device)].to(out.device)
    return out, ref["recv_counts"][rank], ref["recv_offsets"][rank]


def main(num_tokens: int = 512, hidden: int = 4096, experts_per_rank: int = 4, top_k: int = 2,
         iters: int = 100) -> None:
    """Check against the plain-torch reference on random tokens and routing, and time the four launches on
    buffers made once (``torchrun``, or alone as a group of one)."""
    if "RANK" not in os.environ:  # run alone: a group of one
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT="29501")
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", device_id=device)
    rank, world_size = dist.get_rank(), dist.get_world_size()
    num_experts = experts_per_rank * world_size
    torch.manual_seed(rank)
    tokens = torch.randn(num_tokens, hidden, dtype=torch.bfloat16, device=device)
    ids = torch.randint(0, num_experts, (num_tokens, top_k), device=device)
    capacity = world_size * num_tokens * top_k  # every pair fits whatever the routing
    recv, recv_counts, recv_offsets, slots, status = moe_dispatch(tokens, ids, num_experts, capacity=capacity)
    all_tokens, all_ids = [torch.empty_like(tokens) for _ in range(world_size)], [torch.empty_like(ids)
                                                                                 for _ in range(world_size)]
    dist.all_gather(all_tokens, tokens)
    dist.all_gather(all_ids, ids)
    rows, counts, offsets = reference_dispatch(all_tokens, all_ids, num_experts, capacity, rank)
    assert torch.equal(recv[:rows.shape[0]], rows), "received rows differ from the reference"
    assert recv_counts.tolist() == counts.tolist() and recv_offsets.tolist() == offsets.tolist()
    assert torch.equal(slots.cpu(), reference_slots(all_ids, num_experts, capacity)["slots"][rank])
    assert status.tolist() == [0, 0]

    recv_peers, recv_pads, _ = symmetric_peers((capacity, hidden), tokens.dtype, device, dist.group.WORLD)
    cfg = plan(num_tokens, top_k, hidden, num_experts, world_size, {})
    count_peers, count_pads, _ = symmetric_peers((world_size, cfg["e_pad"]), torch.int32, device, dist.group.WORLD)
    scratch = routing_scratch(ids.numel(), cfg["num_chunks"], cfg["e_pad"], device)
    args = (tokens, ids, slots, recv_counts, recv_offsets, status, recv_peers, recv_pads, count_peers, count_pads,
            rank, num_experts, capacity)
    for _ in range(10):  # warm up (compile)
        launch(*args, **cfg, scratch=scratch)
    dist.barrier()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(iters):
        launch(*args, **cfg, scratch=scratch)
    torch.cuda.synchronize()
    us = (time.perf_counter() - start) / iters * 1e6
    assert torch.equal(recv_peers[rank][:rows.shape[0]], rows), "received rows differ after the timed calls"
    if rank == 0:
        print(f"moe_dispatch: {num_tokens} tokens x {hidden} bf16, top-{top_k} of {num_experts} experts x "
              f"{world_size} ranks: matches the reference, {us:.1f} us per call (eager launches; {cfg})")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
