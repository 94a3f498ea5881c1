"""The MoE pair as custom operators (``kraken/runtime/moe_ops.py``), without a GPU: the operators' schemas follow the
recipes' signatures with the handle as tensors, in both namespaces; the fakes give the recipes' shapes and dtypes
under ``FakeTensorMode``; a MoE layer (router, dispatch, per-expert linear, combine) compiles with
``fullgraph=True`` as one graph holding both operators and gives eager's result, with the recipes' host code
emulated on CPU in a world of one (the plain-torch reference in place of the kernels, a CPU tensor in place of the
symmetric receive buffer); a handle crosses between eager and compiled code both ways; the eager front doors call
the recipes directly."""

from __future__ import annotations

import importlib
import inspect
import timeit

import pytest
import torch
import torch.distributed as dist
from torch._dynamo.testing import CompileCounterWithBackend
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.testing._internal.distributed.fake_pg import FakeStore

import helion_ports
import kraken
from kraken.runtime import groups, library, moe, moe_ops, prepared, symm

D = importlib.import_module("kraken.comm.moe_dispatch")  # the recipes: plans, plain-torch references
C = importlib.import_module("kraken.comm.moe_combine")
PACKAGES = {"kraken": kraken, "kraken_helion": helion_ports}  # op namespace -> package
RECIPES = {"kraken": ("kraken.comm.moe_dispatch", "kraken.comm.moe_combine"),  # whose launch each installed one drives
           "kraken_helion": ("helion_ports.comm.moe_dispatch", "helion_ports.comm.moe_combine")}


def op(namespace: str, name: str):
    return getattr(getattr(torch.ops, namespace), name).default


# ---------------------------------------------------------------------------
# Schemas and fakes
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("namespace", list(PACKAGES))
def test_the_pair_are_operators_whose_schemas_follow_the_recipes(namespace):
    """The dispatch's schema is the recipe's signature (group: its name, then its size; config: text) returning
    ``(recv, routing)``; the combine's is the recipe's with the handle as its tensors and numbers. Only the
    combine writes an argument: the receive buffer, into which it copies the expert outputs."""
    dispatch, combine = (op(namespace, name) for name in moe_ops.NAMES)
    assert str(dispatch._schema) == (
        f"{namespace}::moe_dispatch(Tensor tokens, Tensor expert_ids, SymInt num_experts, str? group, int world_size, "
        "SymInt? capacity, bool check_status, str config) -> (Tensor recv, Tensor routing)")
    assert str(combine._schema) == (
        f"{namespace}::moe_combine(Tensor expert_out, Tensor(a!) recv, Tensor routing, SymInt num_experts, str? group, "
        "int world_size, Tensor weights, str config) -> Tensor")
    for schema in (dispatch._schema, combine._schema):
        written = [a.name for a in schema.arguments if a.alias_info is not None and a.alias_info.is_write]
        assert written == (["recv"] if "combine" in schema.name else [])
    recipe_dispatch, recipe_combine = (getattr(PACKAGES[namespace], name).__wrapped__ for name in moe_ops.NAMES)
    parameters = [name for name in inspect.signature(recipe_dispatch).parameters]
    expected = [n for p in parameters for n in ((p, "world_size") if p == "group" else (p,))]
    assert [a.name for a in dispatch._schema.arguments] == expected
    handle = ["recv", "routing", "num_experts", "group", "world_size"]
    expected = [n for p in inspect.signature(recipe_combine).parameters for n in (handle if p == "handle" else (p,))]
    assert [a.name for a in combine._schema.arguments] == expected


def fake(shape, dtype=torch.bfloat16):
    return torch.empty(shape, dtype=dtype, device="cuda")


# tokens, hidden, experts, top-k, world size, capacity (None: the recipe's default)
SHAPES = [(1, 1, 1, 1, 1, None), (37, 129, 8, 2, 4, None), (300, 64, 16, 4, 8, 77), (5, 7168, 64, 8, 2, 3)]


@pytest.mark.parametrize("namespace", list(PACKAGES))
@pytest.mark.parametrize("shape", SHAPES, ids=[f"T{s[0]}-H{s[1]}-E{s[2]}-k{s[3]}-ws{s[4]}-c{s[5]}" for s in SHAPES])
def test_fakes_give_the_recipes_shapes(namespace, shape):
    """``recv [capacity, H]`` in the tokens' dtype (the default capacity ``2 * T * k``), ``routing`` as long as the
    allocation of ``kraken.runtime.moe.new_handle``, the combine's ``[T, H]`` in the expert outputs' dtype."""
    tokens, hidden, experts, top_k, ws, capacity = shape
    rows = 2 * tokens * top_k if capacity is None else capacity
    recv_ctx = symm.SymmContext(0, ws, "", (), 0)
    handle = moe.new_handle(torch.empty(tokens, hidden), torch.empty(tokens, top_k, dtype=torch.int64), experts,
                          torch.empty(rows, hidden), recv_ctx, rows)
    with FakeTensorMode():
        for dtype, ids_dtype in ((torch.bfloat16, torch.int64), (torch.float32, torch.int32)):
            recv, routing = op(namespace, "moe_dispatch")(fake((tokens, hidden), dtype),
                                                        fake((tokens, top_k), ids_dtype), experts, None, ws, capacity,
                                                        False, "")
            assert (tuple(recv.shape), recv.dtype) == ((rows, hidden), dtype)
            assert (tuple(routing.shape), routing.dtype) == (tuple(handle.routing.shape), torch.int32)
            out = op(namespace, "moe_combine")(fake((rows, hidden), dtype), recv, routing, experts, None, ws,
                                               fake((tokens, top_k), torch.float32), "")
            assert (tuple(out.shape), out.dtype) == ((tokens, hidden), dtype)
            assert all(t.device.type == "cuda" and t.is_contiguous() for t in (recv, routing, out))
        with pytest.raises(ValueError, match="divisible by the world size"):
            op(namespace, "moe_dispatch")(fake((tokens, hidden)), fake((tokens, top_k), torch.int64), 3, None, 2,
                                          None, False, "")


# ---------------------------------------------------------------------------
# Compiled in a world of one, the recipes' host code emulated on CPU
# ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def world_of_one():
    """A process group of one rank in this process (torch's ``fake`` backend: no collectives run)."""
    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    dist.init_process_group("fake", rank=0, world_size=1, store=FakeStore())
    yield dist.group.WORLD
    dist.destroy_process_group()


class Emulated:
    """The installed functions' host code (``kraken.runtime.moe``'s ``dispatch``, ``combine``: the recipes' and the
    twins' go through them) on CPU in a
    world of one: the routing from ``reference_slots``, the rows from ``reference_dispatch``, the combine from
    ``reference_combine``; one NaN-filled CPU tensor per shape stands in for the symmetric receive buffer. Records
    which op ran and whether the combine copied its expert outputs into the buffer."""

    def __init__(self, monkeypatch):
        self.calls, self.buffers = [], {}
        self.received = self.expert_out = None  # the last dispatch's rows, the last combine's expert outputs
        monkeypatch.setattr(moe, "dispatch", self.dispatch)
        monkeypatch.setattr(moe, "combine", self.combine)
        monkeypatch.setattr(moe, "buffers", self.find_buffers)
        monkeypatch.setattr(groups, "check_tensor", lambda *args, **kwargs: None)  # CPU tensors stand in for CUDA ones

    def find_buffers(self, capacity, hidden, dtype, e_pad, device, group, op):
        key = (capacity, hidden, dtype, e_pad)
        if key not in self.buffers:
            recv = torch.full((capacity, hidden), float("nan"), dtype=dtype)
            self.buffers[key] = (recv, symm.SymmContext(0, 1, dist.group.WORLD.group_name, (recv,), 0), None)
        return self.buffers[key]

    def dispatch(self, launch, op, tokens, expert_ids, num_experts, group, capacity, check_status, config):
        capacity = D.default_capacity(*expert_ids.shape) if capacity is None else capacity
        e_pad = D.plan(*expert_ids.shape, tokens.shape[1], num_experts, 1, config)["e_pad"]
        recv, recv_ctx, _ = moe.buffers(capacity, tokens.shape[1], tokens.dtype, e_pad, tokens.device, group, op)
        handle = moe.new_handle(tokens, expert_ids, num_experts, recv, recv_ctx, capacity)
        ref = D.reference_slots([expert_ids], num_experts, capacity)
        handle.routing.zero_()
        handle.status.copy_(torch.tensor([ref["dropped"][0], ref["bad"][0]]))
        handle.slots.copy_(ref["slots"][0])
        handle.recv_counts.copy_(ref["recv_counts"][0])
        handle.recv_offsets.copy_(ref["recv_offsets"][0])
        rows, _, _ = D.reference_dispatch([tokens], [expert_ids], num_experts, capacity, 0)
        recv[:rows.shape[0]] = rows
        self.calls.append(op)
        self.received = recv.clone()
        return recv, handle.recv_counts, handle

    def combine(self, launch, op, expert_out, handle, weights, config):
        moe.check_combine(expert_out, handle, weights, op)
        copied = expert_out.data_ptr() != handle.recv.data_ptr()
        if copied:
            handle.recv.copy_(expert_out)
        self.calls.append((op, "copied" if copied else "in place"))
        self.expert_out = expert_out.clone()
        return C.reference_combine([handle.recv], [handle.slots], weights, 0, handle.capacity)


@pytest.fixture
def emulated(world_of_one, monkeypatch):
    prepared.forget_prepared_calls()  # the operators' own lookups of the receive buffer among them
    yield Emulated(monkeypatch)
    prepared.forget_prepared_calls()  # nothing found in this emulated world serves another test


HIDDEN, EXPERTS, TOP_K, TOKENS = 16, 4, 2, 11


class MoELayer(torch.nn.Module):
    """Router (top-k of a softmax), dispatch, one linear per local expert on its rows of ``recv`` (masks: no shape
    depends on the routing), combine, residual. ``identity``: the experts are the identity (``recv`` itself
    combined)."""

    def __init__(self, comm, identity: bool = False, world_size: int = 1):
        super().__init__()
        gen = torch.Generator().manual_seed(0)
        self.comm, self.identity, self.local = comm, identity, EXPERTS // world_size
        self.router = torch.nn.Parameter(torch.randn(HIDDEN, EXPERTS, generator=gen))
        self.experts = torch.nn.Parameter(torch.randn(self.local, HIDDEN, HIDDEN, generator=gen) / HIDDEN**0.5)

    def forward(self, x):
        weights, ids = torch.topk(torch.softmax(x @ self.router, dim=-1), TOP_K)
        recv, counts, handle = self.comm.moe_dispatch(x, ids, EXPERTS)
        if self.identity:
            return x + self.comm.moe_combine(recv, handle, weights)
        rows = torch.arange(recv.shape[0])[:, None]
        first, last = handle.recv_offsets, handle.recv_offsets + counts
        out = torch.zeros_like(recv)
        for e in range(self.local):  # unwritten rows of recv hold anything: where(), not a product with the mask
            out = torch.where((rows >= first[e]) & (rows < last[e]), recv @ self.experts[e], out)
        return x + self.comm.moe_combine(out, handle, weights)


def reference(layer: MoELayer, x):
    weights, ids = torch.topk(torch.softmax(x @ layer.router, dim=-1), TOP_K)
    expert = torch.stack([x @ layer.experts[e] for e in range(EXPERTS)])  # [E, T, H]
    if layer.identity:
        expert = x.expand(EXPERTS, *x.shape)
    picked = expert[ids, torch.arange(x.shape[0])[:, None]]  # [T, k, H]
    return x + (weights[..., None] * picked).sum(1)


def inputs(seed: int):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(TOKENS, HIDDEN, generator=gen)


def same(a, b) -> bool:
    """Equal, NaN where the other is NaN (rows of the receive buffer that no dispatch wrote)."""
    return a.shape == b.shape and bool(((a == b) | (a.isnan() & b.isnan())).all())


@pytest.mark.parametrize("identity", [False, True], ids=["experts", "identity"])
@pytest.mark.parametrize("namespace", list(PACKAGES))
def test_a_moe_layer_compiles_as_one_graph_and_gives_eagers_result(emulated, namespace, identity):
    """``fullgraph=True`` (``aot_eager``: no kernel compiles on CPU) traces one graph holding both operators whose
    result is eager's, bit for bit. The combine combines the dispatch's buffer in place (the identity expert) or
    copies the experts' outputs into it, as in eager; functionalisation hands the operator a copy of ``recv`` here,
    and the buffer's rows are put back after the combine."""
    layer = MoELayer(PACKAGES[namespace], identity)
    recipe = "helion " if namespace == "kraken_helion" else ""
    calls = [f"{recipe}moe_dispatch", (f"{recipe}moe_combine", "in place" if identity else "copied")] * 3
    xs = [inputs(seed) for seed in range(3)]
    with torch.no_grad():
        eager = [layer(x) for x in xs]
        assert emulated.calls == calls
        for x, out in zip(xs, eager):
            torch.testing.assert_close(out, reference(layer, x), rtol=1e-5, atol=1e-5)

        torch._dynamo.reset()
        emulated.calls.clear()
        counter = CompileCounterWithBackend("aot_eager")
        compiled = torch.compile(layer, backend=counter, fullgraph=True)
        for x, out in zip(xs, eager):
            assert torch.equal(compiled(x), out)
            (recv, *_), = emulated.buffers.values()
            assert same(recv, emulated.received), "the buffer's rows are back after the combine"
        assert counter.frame_count == 1, "one graph, no recompilation"
        targets = [n.target for n in counter.graphs[0].graph.nodes if n.op == "call_function"]
        assert op(namespace, "moe_dispatch") in targets and op(namespace, "moe_combine") in targets, targets
        assert emulated.calls == calls
    torch._dynamo.reset()


@pytest.mark.parametrize("namespace", list(PACKAGES))
def test_a_moe_layer_exports_as_one_graph_at_four_ranks(world_of_one, monkeypatch, namespace):
    """``torch.export`` (strict: Dynamo, no graph break; fake tensors, nothing runs) with the group's size traced as
    4: both operators in the graph with the group's size as a constant, the combine taking the dispatch's ``recv``
    and ``routing`` back, the shapes from the fakes (``routing``: status, slots, one local expert's count and
    offset)."""
    monkeypatch.setattr(library, "world_size", lambda group: 4)
    program = torch.export.export(MoELayer(PACKAGES[namespace], world_size=4), (inputs(0),), strict=True)
    calls = [n for n in program.graph.nodes if n.op == "call_function"]
    (dispatch,) = [n for n in calls if n.target is op(namespace, "moe_dispatch")]
    assert dispatch.args[2:] == (EXPERTS, None, 4, None, False, "")
    recv, routing = dispatch.meta["val"]
    assert tuple(recv.shape) == (2 * TOKENS * TOP_K, HIDDEN) and tuple(routing.shape) == (4 + TOKENS * TOP_K + 2,)
    (combine,) = [n for n in calls if n.target is op(namespace, "moe_combine")]
    assert combine.args[3:6] == (EXPERTS, None, 4)
    received, routed_ = (n for n in calls if n.args and n.args[0] is dispatch)  # the dispatch's two outputs
    assert combine.args[1] is received and combine.args[2] is routed_, "the handle's tensors, back"
    (out,) = program.graph.output_node().args[0]
    assert tuple(out.meta["val"].shape) == (TOKENS, HIDDEN)


def reads_before_and_after_the_combine(x, ids, weights):
    """Reads of ``recv`` on both sides of the combine (which copies ``2 * recv`` into it)."""
    recv, _, handle = kraken.moe_dispatch(x, ids, EXPERTS)
    before = recv[:TOKENS * TOP_K] + 0
    out = kraken.moe_combine(torch.nan_to_num(recv) * 2, handle, weights)
    return out, before, recv[:TOKENS * TOP_K] + 0


def routed(seed: int):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(TOKENS, HIDDEN, generator=gen), torch.randint(0, EXPERTS, (TOKENS, TOP_K), generator=gen),
            torch.rand(TOKENS, TOP_K, generator=gen))


def test_after_the_combine_recv_holds_the_expert_outputs_as_in_eager(emulated):
    """The combine's declared write (``Tensor(a!) recv``): a read of ``recv`` before the combine sees the received
    rows, one after it the expert outputs, as in eager."""
    args = routed(3)
    eager = reads_before_and_after_the_combine(*args)
    assert torch.equal(eager[2], eager[1] * 2)
    torch._dynamo.reset()
    compiled = torch.compile(reads_before_and_after_the_combine, backend="aot_eager", fullgraph=True)(*args)
    assert all(torch.equal(got, expected) for got, expected in zip(compiled, eager))
    torch._dynamo.reset()


def test_inductor_hands_the_combine_the_buffer_and_keeps_its_rows_for_earlier_reads(emulated):
    """Inductor (one test: its first compile in a process costs seconds) passes the combine the buffer itself, where
    it copies the experts' outputs or, for the identity expert, nothing; where the graph reads ``recv``'s received
    rows after the combine (inductor moves a read to its use: here, past the combine), it passes a copy, and the
    rows the combine put back are the ones read."""
    xs = [inputs(seed) for seed in range(2)]
    with torch.no_grad():
        for identity in (False, True):
            layer = MoELayer(kraken, identity)
            eager = [layer(x) for x in xs]
            torch._dynamo.reset()
            emulated.calls.clear()
            compiled = torch.compile(layer, backend="inductor", fullgraph=True)
            for x, out in zip(xs, eager):
                torch.testing.assert_close(compiled(x), out, rtol=1e-5, atol=1e-5)
                (recv, *_), = emulated.buffers.values()
                assert same(recv, emulated.expert_out), "the combine wrote the buffer itself"
            assert emulated.calls == ["moe_dispatch", ("moe_combine", "in place" if identity else "copied")] * 2
        args = routed(3)
        eager = reads_before_and_after_the_combine(*args)
        torch._dynamo.reset()
        compiled = torch.compile(reads_before_and_after_the_combine, backend="inductor", fullgraph=True)(*args)
        assert all(torch.equal(got, expected) for got, expected in zip(compiled, eager))
    torch._dynamo.reset()


def test_a_handle_crosses_between_eager_and_compiled_code(emulated):
    """A dispatch compiled on its own returns an ``OperatorHandle`` (a ``MoEHandle`` of the operator's tensors) that
    an eager combine takes, finding its peers from its buffer; an eager dispatch's handle goes into a compiled
    combine, which takes it apart into its operator's arguments."""
    comm = kraken
    x, ids, weights = routed(4)
    recv, counts, handle = comm.moe_dispatch(x, ids, EXPERTS)
    expected = comm.moe_combine(recv, handle, weights)
    slots, offsets = handle.slots.clone(), handle.recv_offsets.clone()
    torch._dynamo.reset()

    dispatch = torch.compile(lambda x, ids: comm.moe_dispatch(x, ids, EXPERTS), backend="aot_eager", fullgraph=True)
    recv2, counts2, handle2 = dispatch(x, ids)
    assert type(handle2) is moe_ops.OperatorHandle and isinstance(handle2, moe.MoEHandle)
    assert recv2.data_ptr() == recv.data_ptr(), "the receive buffer itself"
    assert torch.equal(handle2.slots, slots) and torch.equal(handle2.recv_offsets, offsets)
    assert torch.equal(counts2, counts) and counts2.data_ptr() == handle2.recv_counts.data_ptr()
    assert handle2.status.tolist() == [0, 0] and handle2.capacity == handle.capacity == 2 * TOKENS * TOP_K
    assert handle2.recv_context is handle.recv_context  # found from the buffer, on first use
    assert torch.equal(comm.moe_combine(recv2, handle2, weights), expected)

    emulated.calls.clear()
    combine = torch.compile(lambda recv, handle, weights: comm.moe_combine(recv, handle, weights),
                            backend="aot_eager", fullgraph=True)
    assert torch.equal(combine(recv, handle, weights), expected)
    assert emulated.calls == [("moe_combine", "in place")]
    torch._dynamo.reset()


def test_the_operators_refuse_another_dispatchs_routing_and_another_world_size(emulated):
    x, ids, weights = routed(5)
    dispatch, combine = (op("kraken", name) for name in moe_ops.NAMES)
    recv, routing = dispatch(x, ids, EXPERTS, None, 1, None, False, "")
    assert routing.numel() == 4 + TOKENS * TOP_K + 2 * EXPERTS
    with pytest.raises(ValueError, match=r"routing has 34 entries; a dispatch of \(11, 3\) .* has 45"):
        combine(recv.clone(), recv, routing, EXPERTS, None, 1, torch.rand(TOKENS, 3), "")
    with pytest.raises(RuntimeError, match=r"world_size=2, but the group \(default\) has 1 ranks"):
        combine(recv.clone(), recv, routing, EXPERTS, None, 2, weights, "")
    with pytest.raises(RuntimeError, match=r"world_size=4, but the group \(default\) has 1 ranks"):
        dispatch(x, ids, EXPERTS, None, 4, None, False, "")


# ---------------------------------------------------------------------------
# Front doors
# ---------------------------------------------------------------------------


def test_front_doors_keep_the_installed_signatures_and_are_the_modules_functions():
    """Each door has its installed function's signature and docstring; that function drives its recipe's or twin's
    ``launch``; kraken's doors are also ``kraken.runtime.moe``'s functions (the twins' are made there by the same
    factories, not that module's own)."""
    for namespace, package in PACKAGES.items():
        for path, name in zip(RECIPES[namespace], moe_ops.NAMES):
            door = getattr(package, name)
            installed = door.__wrapped__
            assert inspect.signature(door) == inspect.signature(installed) and door.__doc__ == installed.__doc__
            assert door.op._opoverload is op(namespace, name)
            assert inspect.getclosurevars(installed).nonlocals["launch"] is importlib.import_module(path).launch
    for name in moe_ops.NAMES:
        assert getattr(moe, name) is getattr(kraken, name) and getattr(moe, name) is not getattr(helion_ports, name)


def test_eager_front_doors_call_the_recipes_and_cost_little():
    """In eager a door is its recipe plus one is_compiling() check: timed around a no-op recipe (op=None: an
    operator call would fail), beside the other recipes' door (``library.front_door``) around the same recipe, so
    that a busy host, which slows both, does not fail it."""
    seen = []

    def dispatch(tokens, expert_ids, num_experts, group=None, capacity=None, check_status=False, **config):
        seen.append((tokens, expert_ids, num_experts, group, capacity, check_status, config))
        return tokens

    def combine(expert_out, handle, weights, **config):
        seen.append((expert_out, handle, weights, config))
        return expert_out

    doors = (library.front_door(dispatch, moe_ops.DISPATCH, op=None), moe_ops.combine_door(combine, op=None))
    assert doors[0](1, 2, 3, capacity=4, rows=5) == 1 and doors[1](6, 7, 8, tokens=9) == 6
    assert seen == [(1, 2, 3, None, 4, False, {"rows": 5}), (6, 7, 8, {"tokens": 9})]

    def no_op(expert_out, handle, weights, **config):
        return expert_out

    x = torch.empty(4)
    functions = (no_op, moe_ops.combine_door(no_op, op=None),
                 library.front_door(no_op, library.Entry("no_op", library.like_first), op=None))
    best = [float("inf")] * 3
    for _ in range(5):  # interleaved: each function's best round under the same load
        for i, fn in enumerate(functions):
            best[i] = min(best[i], timeit.timeit(lambda: fn(x, x, x), number=20000) / 20000 * 1e6)
    direct, through, other = best
    print(f"moe_combine front door host cost: {through - direct:.3f} us per call (the other recipes' door "
          f"{other - direct:.3f} us; no-op recipe {direct:.3f} us)")
    assert through - direct < max(1.0, 2 * (other - direct))
