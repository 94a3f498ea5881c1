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

Capacity: ``recv`` has ``capacity`` rows on every rank (symmetric memory, allocated once per
shape). The default is ``2 * T * k``, twice the rows an evenly routed rank receives; the worst case
is ``world_size * T * k``. Rows past ``capacity`` are *dropped*: never written, counted on the
sending rank in ``handle.status[0]`` (a device tensor; ``check(handle)`` or ``check_status=True`` raises on
every rank), and ``recv_counts`` counts only the rows that fit. Which rows drop is deterministic:
the rows whose place in the expert-major order is ``>= capacity``. Ids outside ``[-1,
num_experts)`` are skipped and counted in ``handle.status[1]`` (the ids live on the device: checking
them on the host would be a synchronisation per call).

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

CUDA graphs: the barriers reset themselves and every launch size depends on shapes only. A
caveat of the buffer reuse (as in DeepEP's low-latency mode): ``recv`` is overwritten by the next
dispatch of the same shape, so finish with one (combine it) before dispatching the next.
Steps 1 and 3 and the bookkeeping of 2 are shared with the Helion twin, which ports step 4.

The host fast path (docs/design.md): the first call of a signature checks and agrees, plans, finds
the buffers and makes the routing scratch (``prepare``, kept by ``prepared.per_signature``); a warm call
looks that up, allocates its handle (one allocation) and launches the four kernels through the
prepared call's ``Launcher``. The scratch is consumed within a call, in stream order, as the
symmetric ``counts`` and ``recv`` of the shape are shared by its calls.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.distributed as dist
import triton
import triton.language as tl

from kraken._ptx_utils import symm_mem_sync
from kraken.runtime import agreement, graphs, groups, prepared, symm
from kraken.runtime.launcher import Launcher, jit_launch

DEFAULT_CONFIG = {"rows": 4, "block_h": 1024, "num_warps": 8, "max_blocks": 132}
CHUNK = 128  # (token, k) pairs per program of the histogram and slots kernels
MAX_EXPERTS = 256
MAX_TOP_K = 16
MAX_NUMEL = 2**31 - 1  # element offsets into recv and tokens are 32-bit
ID_DTYPES = (torch.int32, torch.int64)


# ---------------------------------------------------------------------------
# Device: routing bookkeeping (shared with the Helion twin)
# ---------------------------------------------------------------------------


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
def exchange_kernel(
    hist_ptr,  # [num_chunks, E_PAD] int32, local
    chunk_base_ptr,  # [num_chunks, E_PAD] int32, local: first destination row of each (chunk, expert)
    count_peers,  # tuple of world_size pointers: rank r's symmetric counts [world_size, E_PAD] int32
    counts_ptr,  # this rank's counts (count_peers[rank]: a tuple takes constexpr indices only)
    signal_pad_ptrs,  # of the counts buffer
    recv_counts_ptr,  # [E_local] int32
    recv_offsets_ptr,  # [E_local] int32
    status_ptr,  # [2] int32: (pairs dropped past capacity, bad ids), zeroed here
    num_chunks,
    num_experts,
    experts_per_rank,
    capacity,
    rank,
    world_size: tl.constexpr,
    E_PAD: tl.constexpr,
    WS_PAD: tl.constexpr,
    CHUNK_TILE: tl.constexpr,
):
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


# ---------------------------------------------------------------------------
# Device: the token copy (ported by the twin)
# ---------------------------------------------------------------------------


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


# ---------------------------------------------------------------------------
# Host
# ---------------------------------------------------------------------------


@dataclass
class MoEHandle:
    """What ``moe_combine`` needs of a dispatch, and what it reports.

    ``slots[t, j]``: where pair (token t, its j-th expert) went, ``owner * capacity + row``, or -1 (dropped
    past capacity, or no expert). ``status``: int32 [pairs this rank dropped past capacity, bad expert ids on
    this rank], on the device; ``check(handle)`` reads it (on every rank). ``recv_counts`` / ``recv_offsets``:
    this rank's rows per local expert, and where each expert's rows start in ``recv``. ``recv``: this rank's
    receive buffer (symmetric), whose peers ``recv_context`` holds.

    The four per-call tensors are views of one allocation, ``routing`` (int32: ``status`` padded to 16 bytes,
    then ``slots``, ``recv_counts``, ``recv_offsets``), each made on first use: a view costs a microsecond or two
    of host time, and a warm dispatch, replayed from a CUDA graph, makes only the one it returns (the counts).
    """

    routing: torch.Tensor
    pairs: tuple[int, int]  # (tokens, top-k): the dispatch's expert_ids' shape, and ``slots``'s
    recv: torch.Tensor
    recv_context: symm.SymmContext
    num_experts: int
    capacity: int
    group_name: str

    @functools.cached_property
    def status(self) -> torch.Tensor:
        return self.routing[:2]

    @functools.cached_property
    def slots(self) -> torch.Tensor:
        return self.routing[4:4 + self.pairs[0] * self.pairs[1]].view(self.pairs)

    @functools.cached_property
    def recv_counts(self) -> torch.Tensor:
        start = 4 + self.pairs[0] * self.pairs[1]
        return self.routing[start:start + self.num_experts // self.recv_context.world_size]

    @functools.cached_property
    def recv_offsets(self) -> torch.Tensor:
        per_rank = self.num_experts // self.recv_context.world_size
        return self.routing[4 + self.pairs[0] * self.pairs[1] + per_rank:]


def default_capacity(num_tokens: int, top_k: int) -> int:
    """Receive rows per rank when none is given: twice what an evenly routed rank receives (``T * k``)."""
    return max(1, 2 * num_tokens * top_k)


def plan(num_tokens: int, top_k: int, hidden: int, num_experts: int, world_size: int, config: dict,
         itemsize: int = 2) -> dict:
    """The launch configuration (shared with the Helion twin): routing chunks, padded sizes, the copy's
    persistent grid (block b copies pairs ``b * pairs_per_block ..``, whole rows)."""
    cfg = groups.resolve_config(config, DEFAULT_CONFIG, "moe_dispatch")
    num_pairs = num_tokens * top_k
    rows = cfg["rows"]
    block_h = min(cfg["block_h"], triton.next_power_of_2(hidden))
    num_blocks = groups.persistent_grid(groups.cdiv(num_pairs, rows), cfg["max_blocks"], world_size)
    pairs_per_block = groups.round_up(groups.cdiv(num_pairs, num_blocks), rows)
    num_blocks = max(1, groups.cdiv(num_pairs, pairs_per_block))
    return {
        "num_chunks": max(1, groups.cdiv(num_pairs, CHUNK)),
        "e_pad": max(16, triton.next_power_of_2(num_experts)),
        "ws_pad": max(2, triton.next_power_of_2(world_size)),
        "rows": rows, "block_h": block_h, "num_warps": cfg["num_warps"],
        "num_blocks": num_blocks, "pairs_per_block": pairs_per_block,
    }


def check_routing(tokens, expert_ids, num_experts, capacity, world_size: int, op: str) -> int:
    """Checks of the arguments besides the tensors' own; returns the capacity to use."""
    groups.check_tensor(tokens, "tokens", op, ndim=2)
    groups.check_tensor(expert_ids, "expert_ids", op, dtypes=ID_DTYPES, ndim=2)
    if expert_ids.shape[0] != tokens.shape[0]:
        raise ValueError(f"{op}: expert_ids has {expert_ids.shape[0]} rows but tokens has {tokens.shape[0]}")
    if expert_ids.device != tokens.device:
        raise ValueError(f"{op}: expert_ids is on {expert_ids.device}, tokens on {tokens.device}")
    top_k = expert_ids.shape[1]
    if not 1 <= top_k <= MAX_TOP_K:
        raise ValueError(f"{op}: top-k = {top_k} (expert_ids' second dimension) must be 1..{MAX_TOP_K}")
    if isinstance(num_experts, bool) or not isinstance(num_experts, int):
        raise TypeError(f"{op}: num_experts must be an int, got {type(num_experts).__name__}")
    if not 1 <= num_experts <= MAX_EXPERTS or num_experts % world_size:
        raise ValueError(f"{op}: num_experts = {num_experts} must be 1..{MAX_EXPERTS} and divisible by the "
                         f"world size {world_size} (every rank owns num_experts / world_size experts)")
    if tokens.shape[0] < 1 or tokens.shape[1] < 1:
        raise ValueError(f"{op}: tokens must have at least one row and one column, got {tuple(tokens.shape)}")
    capacity = default_capacity(tokens.shape[0], top_k) if capacity is None else capacity
    if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 1:
        raise ValueError(f"{op}: capacity must be a positive int (receive rows per rank), got {capacity!r}")
    if capacity * tokens.shape[1] > MAX_NUMEL or tokens.numel() > MAX_NUMEL or world_size * capacity > MAX_NUMEL:
        raise ValueError(f"{op}: capacity {capacity} x hidden {tokens.shape[1]} is more than this kernel's 32-bit "
                         f"offsets address ({MAX_NUMEL})")
    return capacity


_buffers: dict[tuple, tuple[torch.Tensor, symm.SymmContext, symm.SymmContext]] = {}


def buffers(capacity: int, hidden: int, dtype: torch.dtype, e_pad: int, device: torch.device, group,
            op: str) -> tuple[torch.Tensor, symm.SymmContext, symm.SymmContext]:
    """The symmetric ``recv [capacity, hidden]`` and ``counts [world_size, e_pad]`` of this shape, cached (a
    collective the first time: call it only after the ranks agreed on the arguments)."""
    pg = groups.resolve_group(group, op)
    key = (device, pg.group_name, capacity, hidden, dtype, e_pad)
    if key not in _buffers:
        world_size = dist.get_world_size(pg)
        recv = symm.symm_empty((capacity, hidden), dtype, device, pg)
        counts = symm.symm_empty((world_size, e_pad), torch.int32, device, pg)
        _buffers[key] = (recv, symm.symm_context(recv, pg, op, "recv"), symm.symm_context(counts, pg, op, "counts"))
    return _buffers[key]


def routing_scratch(num_pairs: int, num_chunks: int, e_pad: int, device: torch.device) -> tuple[torch.Tensor, ...]:
    """The routing kernels' local scratch: per chunk its count per expert and its first row per expert, per pair
    its place in its chunk. Consumed within one call (stream order), so a prepared call keeps one set."""
    hist = torch.empty((num_chunks, e_pad), dtype=torch.int32, device=device)
    chunk_base = torch.empty((num_chunks, e_pad), dtype=torch.int32, device=device)
    return hist, chunk_base, torch.empty(num_pairs, dtype=torch.int32, device=device)


@dataclass(frozen=True)
class PreparedDispatch:
    """A dispatch signature's prepared call (``prepare``): the buffers, the capacity, and ``launch``'s keyword
    arguments (the plan, the routing scratch, the ``Launcher``)."""

    recv: torch.Tensor
    recv_context: symm.SymmContext
    counts_context: symm.SymmContext
    capacity: int
    launch_cfg: dict


@prepared.per_signature(lambda tokens, expert_ids, num_experts, group, capacity, op, config: (
    op, group, prepared.tensor_key(tokens), prepared.tensor_key(expert_ids), prepared.scalar_key(num_experts),
    prepared.scalar_key(capacity), prepared.config_key(config)))
def prepare(tokens, expert_ids, num_experts, group, capacity, op: str, config: dict) -> PreparedDispatch:
    """Validate (``agreement.agreed``: bad input on any rank raises on every rank), plan, find the buffers, make the
    routing scratch and the launcher; kept per signature (``prepared.per_signature``)."""
    with agreement.agreed(op, group, tokens=tokens, expert_ids=expert_ids, num_experts=num_experts, capacity=capacity,
                          config=config):
        world_size = groups.world_size_of(group, op)
        capacity = check_routing(tokens, expert_ids, num_experts, capacity, world_size, op)
        num_tokens, hidden = tokens.shape
        cfg = plan(num_tokens, expert_ids.shape[1], hidden, num_experts, world_size, config, tokens.element_size())
        groups.check_barrier_blocks(cfg["num_blocks"], world_size, op)
    recv, recv_ctx, counts_ctx = buffers(capacity, hidden, tokens.dtype, cfg["e_pad"], tokens.device, group, op)
    scratch = routing_scratch(expert_ids.numel(), cfg["num_chunks"], cfg["e_pad"], tokens.device)
    launch_cfg = {**cfg, "scratch": scratch, "group_name": recv_ctx.group_name, "launcher": Launcher(op)}
    return PreparedDispatch(recv, recv_ctx, counts_ctx, capacity, launch_cfg)


def new_handle(tokens, expert_ids, num_experts, recv, recv_ctx, capacity) -> MoEHandle:
    """A handle with fresh (uninitialised) per-call tensors: two dispatches never share one. One allocation
    (``MoEHandle.routing``), no view yet."""
    routing = torch.empty(4 + expert_ids.numel() + 2 * (num_experts // recv_ctx.world_size), dtype=torch.int32,
                          device=tokens.device)
    return MoEHandle(routing, tuple(expert_ids.shape), recv, recv_ctx, num_experts, capacity, recv_ctx.group_name)


def route(expert_ids: torch.Tensor, handle: MoEHandle, counts_ctx: symm.SymmContext, rank: int, num_chunks: int,
          e_pad: int, ws_pad: int, scratch: tuple[torch.Tensor, ...] | None = None, launcher=jit_launch,
          **_) -> None:
    """Steps 1-3 (histogram, count exchange + prefix sums, slots): fills the handle's slots, recv counts and
    offsets and status. Shared by the recipe and its twin. ``scratch``: ``routing_scratch``'s tensors (made here
    when not given); ``launcher``: the prepared call's ``Launcher``, or Triton's own launch."""
    world_size = len(counts_ctx.peers)
    num_pairs = expert_ids.numel()
    hist, chunk_base, place = scratch or routing_scratch(num_pairs, num_chunks, e_pad, expert_ids.device)
    num_experts, capacity = handle.num_experts, handle.capacity
    per_rank = num_experts // world_size
    launcher(histogram_kernel, (num_chunks,), expert_ids, hist, place, num_pairs, num_experts, CHUNK=CHUNK,
             E_PAD=e_pad, num_warps=4)
    launcher(
        exchange_kernel, (1,), hist, chunk_base, counts_ctx.peers, counts_ctx.peers[rank], counts_ctx.signal_pad_ptrs,
        handle.recv_counts, handle.recv_offsets, handle.status, num_chunks, num_experts, per_rank, capacity, rank,
        world_size, E_PAD=e_pad, WS_PAD=ws_pad, CHUNK_TILE=32, num_warps=4,
    )
    launcher(slots_kernel, (num_chunks,), expert_ids, place, chunk_base, handle.slots, handle.status, num_pairs,
             num_experts, per_rank, capacity, CHUNK=CHUNK, E_PAD=e_pad, num_warps=4)


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
    """Launch on prepared arguments (no checks): ``route`` (``routing``: its keyword arguments, the plan's
    ``num_chunks``, ``e_pad``, ``ws_pad`` and the prepared call's ``scratch``), then the copy. The same signature
    as the Helion port's ``launch`` (which takes ``group_name`` as its ``hl.ProcessGroupName``)."""
    route(expert_ids, handle, counts_ctx, rank, launcher=launcher, **routing)
    recv_ctx = handle.recv_context
    launcher(
        dispatch_kernel, (num_blocks,), tokens, handle.slots, recv_ctx.peers, recv_ctx.signal_pad_ptrs,
        expert_ids.numel(), tokens.shape[1], handle.capacity, pairs_per_block, rank, len(recv_ctx.peers),
        TOP_K=expert_ids.shape[1], ROWS=rows, BLOCK_H=block_h, num_warps=num_warps,
    )
    return handle


def dispatch(launch, op: str, tokens, expert_ids, num_experts, group, capacity, check_status: bool,
             config: dict) -> tuple[torch.Tensor, torch.Tensor, MoEHandle]:
    """``moe_dispatch`` with a given ``launch`` (the recipe's or its twin's) under the name ``op``: the prepared
    call (a dictionary lookup once warm), a new handle, the launches through the prepared call's launcher."""
    call = prepare(tokens, expert_ids, num_experts, group, capacity, op, config)
    handle = new_handle(tokens, expert_ids, num_experts, call.recv, call.recv_context, call.capacity)
    # Four launches per call: replayed from one CUDA graph per pointer set (the handle's tensors are one allocation).
    graphs.graphed((call.launch_cfg["launcher"], tokens.data_ptr(), expert_ids.data_ptr(), handle.routing.data_ptr()),
                   lambda: launch(tokens, expert_ids, handle, call.counts_context, call.recv_context.rank,
                                  **call.launch_cfg), tokens.device)
    if check_status:
        check(handle)
    return call.recv, handle.recv_counts, handle


def check(handle: MoEHandle) -> None:
    """Raise on every rank if any rank dropped pairs past capacity or passed bad expert ids (a collective
    that synchronises with the device: not inside a CUDA graph capture)."""
    pg = groups.resolve_group(handle.group_name, "moe_dispatch")
    everyone = torch.empty((dist.get_world_size(pg), 2), dtype=torch.int32, device=handle.status.device)
    dist.all_gather_into_tensor(everyone.view(-1), handle.status.view(-1), group=pg)  # flat: any backend takes it
    problems = []
    for r, (dropped, bad) in enumerate(everyone.tolist()):
        if bad:
            problems.append(f"rank {r}: {bad} expert ids outside [-1, {handle.num_experts}) (skipped)")
        if dropped:
            problems.append(f"rank {r}: {dropped} (token, expert) pairs dropped past capacity {handle.capacity}")
    if problems:
        raise ValueError("moe_dispatch: " + "; ".join(problems) + " (raise capacity= to keep every token)")


def moe_dispatch(
    tokens: torch.Tensor,
    expert_ids: torch.Tensor,
    num_experts: int,
    group: dist.ProcessGroup | str | None = None,
    capacity: int | None = None,
    check_status: bool = False,
    **config,
) -> tuple[torch.Tensor, torch.Tensor, MoEHandle]:
    """Send each token to its top-k experts' ranks: returns ``(recv, recv_counts, handle)``.

    ``tokens [T, H]`` (bf16/fp16/fp32) and ``expert_ids [T, k]`` (int32/int64; -1: no expert) are ordinary
    CUDA tensors. ``recv [capacity, H]`` is this rank's receive buffer (symmetric memory, reused by the next
    dispatch of this shape): local expert ``e``'s tokens at rows ``handle.recv_offsets[e] ..`` ``+
    recv_counts[e]``, from rank 0 first, each rank's in token order. ``check_status=True`` calls ``check``
    (a host synchronisation) before returning. ``config`` overrides ``DEFAULT_CONFIG``. See the module
    docstring for the capacity and what happens past it.
    """
    return dispatch(launch, "moe_dispatch", tokens, expert_ids, num_experts, group, capacity, check_status, config)


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


__all__ = ["MoEHandle", "check", "moe_dispatch", "reference_dispatch", "reference_slots"]
