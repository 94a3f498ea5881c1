"""The MoE pair's product layer (``kraken.moe_dispatch``, ``kraken.moe_combine`` and their Helion twins), wrapped
around the recipes (``kraken/comm/moe_dispatch.py``, ``kraken/comm/moe_combine.py``) from outside.

What the installed pair adds to the recipes' kernels, plans and ``launch`` seams: the checks of a call's arguments,
agreed across ranks on the first call of each signature (``agreement.agreed``: one rank's bad input raises on every
rank); the symmetric receive buffer and count table kept per shape (``buffers``); the handle (``MoEHandle``) that
carries a dispatch's routing to its combine, and ``check(handle)``, which raises on every rank if any rank dropped
rows past capacity or passed bad expert ids.

The host fast path (docs/design.md): the first call of a dispatch signature checks and agrees, plans, finds the
buffers and makes the routing scratch (``prepare_dispatch``, kept by ``prepared.per_signature``); a warm call looks
that up, allocates its handle (one allocation) and launches the four kernels through the prepared call's
``Launcher``, replayed from one CUDA graph per pointer set (``graphs.graphed``). The scratch is consumed within a
call, in stream order, as the symmetric ``counts`` and ``recv`` of the shape are shared by its calls. A combine's
prepared call (``prepare_combine``) serves one receive buffer; its launch is replayed from its second call on
(``replayed``). ``moe_dispatch_with`` / ``moe_combine_with`` make the installed functions around a ``launch``: the
recipe's, or its Helion twin's (``kraken.runtime.twins``). ``kraken.runtime.moe_ops`` makes the pair operators.
"""

from __future__ import annotations

import functools
import importlib
from dataclasses import dataclass

import torch
import torch.distributed as dist

from kraken.runtime import agreement, graphs, groups, prepared, symm
from kraken.runtime.launcher import Launcher
from kraken.runtime.replay import replayed

# The recipes' modules: their ``plan`` called through them (tests replace it there), their ``launch`` by name.
DISPATCH = importlib.import_module("kraken.comm.moe_dispatch")
COMBINE = importlib.import_module("kraken.comm.moe_combine")

MAX_EXPERTS = 256
MAX_TOP_K = 16
MAX_NUMEL = 2**31 - 1  # element offsets into recv and tokens are 32-bit
ID_DTYPES = (torch.int32, torch.int64)
WEIGHT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
default_capacity = DISPATCH.default_capacity  # receive rows per rank when none is given: 2 * T * k


# ---------------------------------------------------------------------------
# The handle
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


# ---------------------------------------------------------------------------
# moe_dispatch
# ---------------------------------------------------------------------------


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


@dataclass(frozen=True)
class PreparedDispatch:
    """A dispatch signature's prepared call (``prepare_dispatch``): the buffers, the capacity, and ``launch``'s keyword
    arguments (the plan, the routing scratch, the ``Launcher``)."""

    recv: torch.Tensor
    recv_context: symm.SymmContext
    counts_context: symm.SymmContext
    capacity: int
    launch_cfg: dict


@prepared.per_signature(lambda tokens, expert_ids, num_experts, group, capacity, op, config: (
    op, group, prepared.tensor_key(tokens), prepared.tensor_key(expert_ids), prepared.scalar_key(num_experts),
    prepared.scalar_key(capacity), prepared.config_key(config)))
def prepare_dispatch(tokens, expert_ids, num_experts, group, capacity, op: str, config: dict) -> PreparedDispatch:
    """Validate (``agreement.agreed``: bad input on any rank raises on every rank), plan, find the buffers, make the
    routing scratch and the launcher; kept per signature (``prepared.per_signature``)."""
    with agreement.agreed(op, group, tokens=tokens, expert_ids=expert_ids, num_experts=num_experts, capacity=capacity,
                          config=config):
        world_size = groups.world_size_of(group, op)
        capacity = check_routing(tokens, expert_ids, num_experts, capacity, world_size, op)
        num_tokens, hidden = tokens.shape
        cfg = DISPATCH.plan(num_tokens, expert_ids.shape[1], hidden, num_experts, world_size, config)
        groups.check_barrier_blocks(cfg["num_blocks"], world_size, op)
    recv, recv_ctx, counts_ctx = buffers(capacity, hidden, tokens.dtype, cfg["e_pad"], tokens.device, group, op)
    scratch = DISPATCH.routing_scratch(expert_ids.numel(), cfg["num_chunks"], cfg["e_pad"], tokens.device)
    launch_cfg = {**cfg, "scratch": scratch, "group_name": recv_ctx.group_name, "launcher": Launcher(op)}
    return PreparedDispatch(recv, recv_ctx, counts_ctx, capacity, launch_cfg)


def new_handle(tokens, expert_ids, num_experts, recv, recv_ctx, capacity) -> MoEHandle:
    """A handle with fresh (uninitialised) per-call tensors: two dispatches never share one. One allocation
    (``MoEHandle.routing``), no view yet."""
    routing = torch.empty(4 + expert_ids.numel() + 2 * (num_experts // recv_ctx.world_size), dtype=torch.int32,
                          device=tokens.device)
    return MoEHandle(routing, tuple(expert_ids.shape), recv, recv_ctx, num_experts, capacity, recv_ctx.group_name)


def dispatch(launch, op: str, tokens, expert_ids, num_experts, group, capacity, check_status: bool,
             config: dict) -> tuple[torch.Tensor, torch.Tensor, MoEHandle]:
    """``moe_dispatch`` with a given ``launch`` (the recipe's or its twin's) under the name ``op``: the prepared
    call (a dictionary lookup once warm), a new handle, the launches through the prepared call's launcher."""
    call = prepare_dispatch(tokens, expert_ids, num_experts, group, capacity, op, config)
    handle = new_handle(tokens, expert_ids, num_experts, call.recv, call.recv_context, call.capacity)
    launcher = call.launch_cfg["launcher"]

    def launches() -> None:
        launch(tokens, expert_ids, handle.slots, handle.recv_counts, handle.recv_offsets, handle.status,
               call.recv_context.peers, call.recv_context.signal_pad_ptrs, call.counts_context.peers,
               call.counts_context.signal_pad_ptrs, call.recv_context.rank, num_experts, call.capacity,
               **call.launch_cfg)

    # Four launches per call: replayed from one CUDA graph per pointer set (the handle's tensors are one allocation);
    # on addresses that do not come back (a model's layers), the launches replayed from a record of the first call
    # (``replayed``: the handle's tensors lie in ``routing``).
    graphs.graphed((launcher, tokens.data_ptr(), expert_ids.data_ptr(), handle.routing.data_ptr()),
                   lambda: replayed(launcher, launch, (tokens, expert_ids, handle.routing), launches,
                                    (call.recv_context, call.counts_context, call.launch_cfg)),
                   tokens.device)
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


def moe_dispatch_with(launch, op: str):
    """The installed MoE dispatch, driving ``launch``: the recipe's (``kraken.moe_dispatch``) or its Helion
    twin's (``helion_ports.moe_dispatch``, ``op`` "helion moe_dispatch")."""

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
        (a host synchronisation) before returning. ``config`` overrides the recipe's ``DEFAULT_CONFIG``
        (``kraken/comm/moe_dispatch.py``, whose module docstring has the capacity and what happens past it).
        """
        return dispatch(launch, op, tokens, expert_ids, num_experts, group, capacity, check_status, config)

    return moe_dispatch


# ---------------------------------------------------------------------------
# moe_combine
# ---------------------------------------------------------------------------


def check_combine(expert_out, handle, weights, op: str) -> None:
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
    """``prepare_combine``'s cache key: everything it reads (the handle's group, its slots' shape: their dtype,
    layout and alignment are ``new_handle``'s), and the receive buffer's address: a prepared call serves one buffer
    (its peers and signal pads, which ``combine``'s replay keeps as constants). A handle of another type is not cached
    (``prepare_combine`` says what is wrong)."""
    if not isinstance(handle, MoEHandle):
        raise TypeError("not a MoEHandle")  # prepared.per_signature: skip the cache
    return (op, handle.group_name, prepared.tensor_key(expert_out), prepared.tensor_key(weights), handle.pairs,
            prepared.tensor_key(handle.recv, address=True), prepared.config_key(config))


@prepared.per_signature(combine_key)
def prepare_combine(expert_out, handle, weights, op: str, config: dict) -> dict:
    """Validate and agree (first call of a signature), plan; ``launch``'s keyword arguments with the prepared
    call's ``Launcher``, kept per signature."""
    group = handle.group_name if isinstance(handle, MoEHandle) else None
    with agreement.agreed(op, group, expert_out=expert_out, weights=weights, config=config,
                          handle=handle.slots if isinstance(handle, MoEHandle) else handle):
        check_combine(expert_out, handle, weights, op)
        world_size = groups.world_size_of(group, op)
        cfg = COMBINE.plan(weights.shape[0], expert_out.shape[1], world_size, config)
        groups.check_barrier_blocks(cfg["num_blocks"], world_size, op)
    return {**cfg, "group_name": handle.group_name, "launcher": Launcher(op)}


def combine(launch, op: str, expert_out: torch.Tensor, handle: MoEHandle, weights: torch.Tensor,
            config: dict) -> torch.Tensor:
    """``moe_combine`` with a given ``launch`` (the recipe's or its twin's) under the name ``op``: the prepared
    call (a dictionary lookup once warm), the copy into ``recv`` when ``expert_out`` is not it, a new output, and
    the launch, replayed from the prepared call's second call on (``replayed``: this call's output, weights
    and routing tensor, where the slots lie; the receive buffer's peers and pads, which the prepared call's key
    fixes, as constants)."""
    cfg = prepare_combine(expert_out, handle, weights, op, config)
    recv, ctx = handle.recv, handle.recv_context
    if expert_out.data_ptr() != recv.data_ptr():
        recv.copy_(expert_out)
    out = expert_out.new_empty((weights.shape[0], expert_out.shape[1]))
    return replayed(cfg["launcher"], launch, (out, weights, handle.routing),  # the slots lie in routing
                    lambda: launch(out, weights, handle.slots, ctx.peers, ctx.signal_pad_ptrs, ctx.rank,
                                   handle.capacity, **cfg), (ctx,))


def moe_combine_with(launch, op: str):
    """The installed MoE combine, driving ``launch``: the recipe's (``kraken.moe_combine``) or its Helion twin's
    (``helion_ports.moe_combine``, ``op`` "helion moe_combine")."""

    def moe_combine(expert_out: torch.Tensor, handle: MoEHandle, weights: torch.Tensor, **config) -> torch.Tensor:
        """``[T, H]``: every token's expert outputs weighted by ``weights [T, k]`` and summed (fp32, j order), in
        the original token order on its home rank. ``expert_out [capacity, H]`` in the dispatch's row order;
        zero-copy when it is the dispatch's ``recv`` (see the recipe's docstring). ``config`` overrides
        the recipe's ``DEFAULT_CONFIG`` (``kraken/comm/moe_combine.py``)."""
        return combine(launch, op, expert_out, handle, weights, config)

    return moe_combine


moe_dispatch = moe_dispatch_with(DISPATCH.launch, "moe_dispatch")
moe_combine = moe_combine_with(COMBINE.launch, "moe_combine")
