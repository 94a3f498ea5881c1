"""``moe_dispatch`` and ``moe_combine`` as ``torch.library`` operators: the dispatch's handle crosses the operator
boundary as tensors.

The rest of the recipes are operators by one table (``kraken/runtime/library.py``, whose conventions hold here: the
group by name then its size, ``**config`` as text). What the MoE pair adds is the handle
(``kraken.runtime.moe.MoEHandle``), a Python object that no schema can carry. It is made of one int32 tensor,
``routing`` (status, slots, receive counts and offsets), the receive buffer ``recv`` and numbers (the expert count,
the capacity, which is ``recv``'s row count, and the group), so the dispatch operator returns the two tensors and
the combine operator takes them back beside the numbers (``kraken_helion::`` for the twins)::

    kraken::moe_dispatch(Tensor tokens, Tensor expert_ids, SymInt num_experts, str? group, int world_size,
                         SymInt? capacity, bool check_status, str config) -> (Tensor recv, Tensor routing)
    kraken::moe_combine(Tensor expert_out, Tensor(a!) recv, Tensor routing, SymInt num_experts, str? group,
                        int world_size, Tensor weights, str config) -> Tensor

No shape depends on the routing: ``recv`` has the ``capacity`` rows the recipe allocates whatever the routing
(``2 * T * k`` unless given), ``routing`` ``4 + T * k + 2 * num_experts / world_size`` entries.

``recv`` is the recipe's receive buffer itself (symmetric memory, one per shape), never a copy: the experts read it
in place and the identity expert's combine copies nothing, as in eager. The combine writes the expert outputs into
it when they are another tensor, which its schema declares (``Tensor(a!) recv``): ``recv`` stays alive up to the
combine (so inductor writes no other tensor into its memory before it), and a read of ``recv`` after the combine
sees the expert outputs, as in eager. Inductor passes the combine the buffer itself (its reinplacing pass) unless
the graph still reads the received rows after the combine (inductor computes a read where its result is used,
which may be past the combine); then, and always under ``aot_eager``, functionalisation passes a copy of ``recv``:
the operator finds the buffer from the copy's shape, the expert count and the group, combines from it, puts the
received rows back into it (no peer reads it once the combine returns) and writes the expert outputs into the copy.

What no schema says: the next dispatch of the same shape overwrites the buffer, as in eager, and a compiled graph
may compute a read of ``recv`` where its result is used. Reading ``recv`` for the experts whose outputs the combine
takes is safe (they run before it); a result read from it and used only after the next dispatch of that shape is
not.

The front doors: in eager each calls its installed function (``kraken.runtime.moe``) straight away (one
``torch.compiler.is_dynamo_compiling()`` check, as ``library.front_door``); while Dynamo traces, ``moe_dispatch``
calls its operator and returns ``(recv, handle.recv_counts, handle)`` with an ``OperatorHandle`` (a ``MoEHandle``
made of the operator's tensors), and ``moe_combine`` takes any ``MoEHandle`` (that one, or one that an eager
dispatch made) apart into its operator's arguments.
"""

from __future__ import annotations

import functools
import sys
from typing import Callable

import torch

from kraken.runtime import library, moe, prepared
from kraken.runtime.moe import MoEHandle, default_capacity

NAMES = ("moe_dispatch", "moe_combine")


# ---------------------------------------------------------------------------
# Fakes (schema order; the group by name, then its size)
# ---------------------------------------------------------------------------


def routing_size(num_pairs, num_experts, world_size):
    """``MoEHandle.routing``'s length (``moe.new_handle``): status padded to 4, slots, counts, offsets."""
    return 4 + num_pairs + 2 * (num_experts // world_size)


def dispatched(tokens, expert_ids, num_experts, group, world_size, capacity, check_status, config):
    if num_experts % world_size:
        raise ValueError(f"moe_dispatch: num_experts = {num_experts} must be divisible by the world size "
                         f"{world_size} (every rank owns num_experts / world_size experts)")
    num_tokens, top_k = expert_ids.shape
    rows = default_capacity(num_tokens, top_k) if capacity is None else capacity
    recv = tokens.new_empty((rows, tokens.shape[1]))
    return recv, tokens.new_empty((routing_size(num_tokens * top_k, num_experts, world_size),), dtype=torch.int32)


def combined(expert_out, recv, routing, num_experts, group, world_size, weights, config):
    return expert_out.new_empty((weights.shape[0], expert_out.shape[1]))


COMBINE_SCHEMA = ("(Tensor expert_out, Tensor(a!) recv, Tensor routing, SymInt num_experts, str? group, "
                  "int world_size, Tensor weights, str config) -> Tensor")


# ---------------------------------------------------------------------------
# The handle from tensors
# ---------------------------------------------------------------------------


@prepared.per_signature(lambda group, world_size, num_experts, shape, dtype, device: (
    group, world_size, num_experts, shape, dtype, device))
def receive_buffer(group, world_size: int, num_experts: int, shape: tuple, dtype, device) -> tuple:
    """``(recv, recv_context)``: the dispatch's receive buffer of this shape (``kraken.runtime.moe.buffers``, keyed
    by the padded expert count of the dispatch's plan) and its peers; kept per signature."""
    capacity, hidden = shape
    e_pad = moe.DISPATCH.plan(1, 1, hidden, num_experts, world_size, {})["e_pad"]
    recv, recv_context, _ = moe.buffers(capacity, hidden, dtype, e_pad, device, group, "moe_combine")
    return recv, recv_context


class OperatorHandle(MoEHandle):
    """The handle while Dynamo traces: the dispatch operator's ``recv`` and ``routing``, and ``routing``'s pieces as
    views (plain attributes: the graph holds the views, as ``MoEHandle``'s cached properties would be).
    ``group_name`` is the operator's group (None: the default group). A handle that leaves the compiled region
    finds its peers (``recv_context``) on first use, so an eager ``moe_combine`` or ``check`` takes it too."""

    def __init__(self, routing, pairs, recv, num_experts, group_name, world_size):
        self.routing, self.pairs, self.recv = routing, pairs, recv
        self.num_experts, self.capacity, self.group_name = num_experts, recv.shape[0], group_name
        num_pairs, per_rank = pairs[0] * pairs[1], num_experts // world_size
        self.status = routing[:2]
        self.slots = routing[4:4 + num_pairs].view(pairs)
        self.recv_counts = routing[4 + num_pairs:4 + num_pairs + per_rank]
        self.recv_offsets = routing[4 + num_pairs + per_rank:]

    @property
    def recv_context(self):
        return receive_buffer(self.group_name, library.world_size(self.group_name), self.num_experts,
                              tuple(self.recv.shape), self.recv.dtype, self.recv.device)[1]


# ---------------------------------------------------------------------------
# Operators and front doors
# ---------------------------------------------------------------------------


def check_world_size(name: str, group, size: int) -> None:
    actual = library.world_size(group)
    if size != actual:
        raise RuntimeError(f"{name}: called with world_size={size}, but the group ({group or 'default'}) has "
                           f"{actual} ranks")


def register_combine(recipe: Callable, namespace: str):
    """``torch.ops.<namespace>.moe_combine``: rebuilds the handle around the dispatch's buffer and calls ``recipe``."""

    def moe_combine(expert_out, recv, routing, num_experts, group, world_size, weights, config):
        check_world_size("moe_combine", group, world_size)
        expected = routing_size(weights.numel(), num_experts, world_size)
        if routing.numel() != expected:
            raise ValueError(f"moe_combine: routing has {routing.numel()} entries; a dispatch of "
                             f"{tuple(weights.shape)} (tokens x top-k, the weights' shape) to {num_experts} experts "
                             f"has {expected}")
        buffer, context = receive_buffer(group, world_size, num_experts, tuple(recv.shape), recv.dtype, recv.device)
        handle = MoEHandle(routing, tuple(weights.shape), buffer, context, num_experts, buffer.shape[0],
                           context.group_name)
        out = recipe(expert_out, handle, weights, **library.decode_config(config))
        if recv.data_ptr() != buffer.data_ptr():
            # Functionalisation passed a copy: the graph may still read the buffer's rows as they were (the copy's),
            # so they go back (no peer reads them once the combine is done), and the copy takes the write.
            if expert_out.data_ptr() != buffer.data_ptr():
                buffer.copy_(recv)
            recv.copy_(expert_out)
        return out

    op = torch.library.custom_op(f"{namespace}::moe_combine", moe_combine, mutates_args=("recv",),
                                 schema=COMBINE_SCHEMA)
    op.register_fake(combined)
    return op


def handle_of(result, arguments) -> tuple:
    """The dispatch operator's ``(recv, routing)`` as the recipe returns them: ``(recv, recv_counts, handle)``."""
    recv, routing = result
    name = library.group_name(arguments["group"])
    handle = OperatorHandle(routing, tuple(arguments["expert_ids"].shape), recv, arguments["num_experts"], name,
                            library.world_size(name))
    return recv, handle.recv_counts, handle


# The dispatch fits the table's conventions (its schema is ``library.schema_of`` the recipe's signature), but for
# what it returns; the combine takes the handle, which no schema type is, so its schema is written out.
DISPATCH = library.Entry("moe_dispatch", dispatched, returns="(Tensor recv, Tensor routing)",
                         to_op=lambda result: (result[0], result[2].routing), from_op=handle_of)


def combine_door(recipe: Callable, op) -> Callable:
    """``recipe`` in eager; while Dynamo traces, its operator, with the handle taken apart."""
    tracing = torch.compiler.is_dynamo_compiling

    def traced(expert_out, handle, weights, **config):
        group = handle.group_name
        return op(expert_out, handle.recv, handle.routing, handle.num_experts, group, library.world_size(group),
                  weights, library.encode_config(config))

    @functools.wraps(recipe)
    def call(*args, **kwargs):
        if not tracing():
            return recipe(*args, **kwargs)
        return traced(*args, **kwargs)

    call.op = op
    return call


def install_front_doors(exports, namespace: str) -> None:
    """Register the MoE pair of the package ``exports`` (if it has them) in ``namespace`` and put the front doors in
    the package and in the module that defines each (as ``library.install_front_doors``: ``kraken.moe_dispatch is
    kraken.runtime.moe.moe_dispatch``; a twin made there by a factory is not that module's own)."""
    dispatch, combine = (getattr(exports, name, None) for name in NAMES)
    if dispatch is None or combine is None or hasattr(dispatch, "op"):
        return
    doors = (library.front_door(dispatch, DISPATCH, library.register(dispatch, DISPATCH, namespace)),
             combine_door(combine, register_combine(combine, namespace)))
    for name, recipe, door in zip(NAMES, (dispatch, combine), doors):
        setattr(exports, name, door)
        home = sys.modules[recipe.__module__]
        if getattr(home, name, None) is recipe:
            setattr(home, name, door)
