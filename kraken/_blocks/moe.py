"""The MoE dispatch's routing bookkeeping, shared by the recipe and its Helion twin: three small Triton kernels.

1. ``histogram_kernel`` (one program per ``CHUNK`` (token, k) pairs): the chunk's count per expert, and each pair's
   place among its chunk's pairs for the same expert;
2. ``exchange_kernel`` (one program): this rank's counts into row ``rank`` of every rank's symmetric ``counts
   [world_size, E_PAD]``, a barrier, then the prefix sums: each (chunk, expert)'s first destination row, and this
   rank's ``recv_counts`` / ``recv_offsets``; it zeroes ``status`` [dropped past capacity, bad ids];
3. ``slots_kernel`` (one program per chunk): each pair's ``owner * capacity + row``, or -1, and the status counts.
"""

from __future__ import annotations

import triton
import triton.language as tl

from kraken._ptx_utils import symm_mem_sync


@triton.jit
def histogram_kernel(expert_ids_ptr, hist_ptr, place_ptr, num_pairs, num_experts,
                     CHUNK: tl.constexpr, E_PAD: tl.constexpr):
    chunk = tl.program_id(0)
    pairs = chunk * CHUNK + tl.arange(0, CHUNK)
    inside = pairs < num_pairs
    ids = tl.load(expert_ids_ptr + pairs, mask=inside, other=-1).to(tl.int32)
    valid = inside & (ids >= 0) & (ids < num_experts)
    experts = tl.arange(0, E_PAD)
    onehot = ((ids[:, None] == experts[None, :]) & valid[:, None]).to(tl.int32)  # [CHUNK, E_PAD]
    earlier = tl.cumsum(onehot, axis=0) - onehot  # pairs of the same expert before this one, in the chunk
    tl.store(place_ptr + pairs, tl.sum(earlier * onehot, axis=1), mask=inside)
    tl.store(hist_ptr + chunk * E_PAD + experts, tl.sum(onehot, axis=0))


@triton.jit
def exchange_kernel(hist_ptr, chunk_base_ptr, count_peers, counts_ptr, signal_pad_ptrs, recv_counts_ptr,
                    recv_offsets_ptr, status_ptr, num_chunks, num_experts, experts_per_rank, capacity, rank,
                    world_size: tl.constexpr, E_PAD: tl.constexpr, WS_PAD: tl.constexpr, CHUNK_TILE: tl.constexpr):
    # count_peers: every rank's counts; counts_ptr: this rank's (a tuple takes constexpr indices only).
    experts = tl.arange(0, E_PAD)
    mine = tl.zeros([E_PAD], tl.int32)
    for c0 in range(0, num_chunks, CHUNK_TILE):
        chunks = c0 + tl.arange(0, CHUNK_TILE)
        hist = tl.load(hist_ptr + chunks[:, None] * E_PAD + experts[None, :], mask=chunks[:, None] < num_chunks,
                       other=0)
        mine += tl.sum(hist, axis=0)
    for r in tl.static_range(world_size):
        tl.store(count_peers[r] + rank * E_PAD + experts, mine)
    # Release: our counts are visible to every peer. Acquire: theirs to us. Also: every peer has started
    # this call, so it is done with its recv from the last one (stream order) and may be written.
    symm_mem_sync(signal_pad_ptrs, 0, rank, world_size, hasPreviousMemAccess=True, hasSubsequentMemAccess=True)
    sources = tl.arange(0, WS_PAD)
    counts = tl.load(counts_ptr + sources[:, None] * E_PAD + experts[None, :],
                     mask=sources[:, None] < world_size, other=0)  # [WS_PAD, E_PAD]: counts[s, e]
    total = tl.sum(counts, axis=0)  # rows expert e receives
    lower_ranks = tl.sum(tl.where(sources[:, None] < rank, counts, 0), axis=0)
    # Rows of the owner's earlier experts: (all experts before e) - (all experts before e's owner's first).
    before = tl.cumsum(total, axis=0) - total
    owners = sources  # as owner ids
    first_of_owner = owners * experts_per_rank  # [WS_PAD]
    before_owner = tl.sum(tl.where(experts[None, :] < first_of_owner[:, None], total[None, :], 0), axis=1)
    owner_of = experts // experts_per_rank
    owner_base = tl.sum(tl.where(owners[:, None] == owner_of[None, :], before_owner[:, None], 0), axis=0)
    expert_base = before - owner_base  # first row of expert e on its owner
    start = expert_base + lower_ranks  # first row of (this rank, expert e) on e's owner
    local = (owner_of == rank) & (experts < num_experts)
    local_expert = experts - rank * experts_per_rank
    tl.store(recv_offsets_ptr + local_expert, tl.minimum(expert_base, capacity), mask=local)
    tl.store(recv_counts_ptr + local_expert, tl.maximum(tl.minimum(total, capacity - expert_base), 0), mask=local)
    running = start
    for c0 in range(0, num_chunks, CHUNK_TILE):
        chunks = c0 + tl.arange(0, CHUNK_TILE)
        inside = chunks[:, None] < num_chunks
        hist = tl.load(hist_ptr + chunks[:, None] * E_PAD + experts[None, :], mask=inside, other=0)
        tl.store(chunk_base_ptr + chunks[:, None] * E_PAD + experts[None, :],
                 running[None, :] + tl.cumsum(hist, axis=0) - hist, mask=inside)
        running += tl.sum(hist, axis=0)
    tl.store(status_ptr + tl.arange(0, 2), tl.zeros([2], tl.int32))


@triton.jit
def slots_kernel(expert_ids_ptr, place_ptr, chunk_base_ptr, slots_ptr, status_ptr, num_pairs, num_experts,
                 experts_per_rank, capacity, CHUNK: tl.constexpr, E_PAD: tl.constexpr):
    chunk = tl.program_id(0)
    pairs = chunk * CHUNK + tl.arange(0, CHUNK)
    inside = pairs < num_pairs
    ids = tl.load(expert_ids_ptr + pairs, mask=inside, other=-1).to(tl.int32)
    valid = inside & (ids >= 0) & (ids < num_experts)
    expert = tl.where(valid, ids, 0)
    row = tl.load(chunk_base_ptr + chunk * E_PAD + expert, mask=valid, other=0) + tl.load(
        place_ptr + pairs, mask=valid, other=0)
    kept = valid & (row < capacity)
    tl.store(slots_ptr + pairs, tl.where(kept, (expert // experts_per_rank) * capacity + row, -1), mask=inside)
    dropped = tl.sum((valid & (row >= capacity)).to(tl.int32))
    bad = tl.sum((inside & (ids != -1) & ~valid).to(tl.int32))
    if dropped > 0:
        tl.atomic_add(status_ptr, dropped)
    if bad > 0:
        tl.atomic_add(status_ptr + 1, bad)
