"""GPU tests of the recipes inside ``torch.compile`` (``kraken/runtime/library.py``, ``kraken/runtime/moe_ops.py``),
one process per GPU.

* The two-layer sequence-parallel MLP (``all_gather_matmul`` -> SiLU -> ``gemm_one_shot_all_reduce``),
  recipes and twins: ``torch._dynamo.explain`` finds one graph and no break; ``fullgraph=True`` under
  ``aot_eager`` gives eager's bits, and with Inductor's ``mode="reduce-overhead"`` (CUDA graphs) eager's up
  to Inductor's own SiLU kernel's rounding (whether the bits match is printed), on several inputs, each
  several times through the CUDA graphs.
* A MoE layer (router, ``moe_dispatch``, one linear per local expert, ``moe_combine``, residual), recipes and
  twins: eager against a plain-torch reference with every rank's experts; ``torch._dynamo.explain`` finds one
  graph holding both MoE operators and no break; ``fullgraph=True`` under ``aot_eager`` gives eager's bits,
  under Inductor (default, then ``mode="reduce-overhead"``) eager's result up to Inductor's softmax rounding.
* ``torch.library.opcheck`` of every operator, both namespaces (schema and mutation, fake against real
  outputs, AOT dispatch with dynamic shapes), the MoE pair's too.
* Every collective from an ordinary tensor equals it from a symmetric one, bitwise, on odd shapes; the staged
  path over 200 back-to-back launches on rotating inputs and in CUDA-graph replays.
"""

from __future__ import annotations

import importlib

import pytest
import torch
import torch.distributed as dist

from gpu_utils import assert_close, check_graph_replays, heartbeat, needs_gpus, run_on_gpus

pytestmark = needs_gpus

PACKAGES = {"triton": ("kraken", "kraken"), "helion": ("helion_ports", "kraken_helion")}  # package, op namespace
# The modules of the public functions (``kraken.<name>``, ``helion_ports.<name>`` load them on first use): loading
# one registers its package's operators.
PUBLIC = {"triton": "kraken.runtime.api", "helion": "kraken.runtime.twins"}
BF16 = torch.bfloat16


def rank_values(seed: int, rank: int, shape, dtype=BF16) -> torch.Tensor:
    gen = torch.Generator(device="cuda").manual_seed(seed * 131 + rank)
    return torch.randn(shape, generator=gen, device="cuda", dtype=torch.float32).to(dtype)


# ---------------------------------------------------------------------------
# The compiled MLP
# ---------------------------------------------------------------------------

ROWS, HIDDEN, FFN = 128, 512, 1024  # rows per rank; the FFN width is this rank's column shard


class SequenceParallelMLP(torch.nn.Module):
    def __init__(self, fused, seed: int):
        super().__init__()
        self.fused = fused
        gen = torch.Generator(device="cuda").manual_seed(seed + dist.get_rank())
        self.w1 = torch.nn.Parameter(torch.randn(HIDDEN, FFN, generator=gen, device="cuda").div(HIDDEN**0.5).to(BF16))
        self.w2 = torch.nn.Parameter(torch.randn(FFN, HIDDEN, generator=gen, device="cuda").div(FFN**0.5).to(BF16))

    def forward(self, x):
        h = torch.nn.functional.silu(self.fused.all_gather_matmul(x, self.w1))
        return self.fused.gemm_one_shot_all_reduce(h, self.w2, out_dtype=BF16)


def compiled_mlp(backend: str) -> None:
    package, namespace = PACKAGES[backend]
    fused = importlib.import_module(package)
    rank = dist.get_rank()
    model = SequenceParallelMLP(fused, seed=7)
    inputs = [rank_values(seed, rank, (ROWS, HIDDEN)) for seed in range(4)]
    with torch.no_grad():
        eager = []
        for x in inputs:  # the first call compiles each recipe (a Helion twin: most of a minute on a busy host)
            eager.append(model(x).clone())
            heartbeat(f"{backend} eager call {len(eager)}")
        assert eager[0].shape == (dist.get_world_size() * ROWS, HIDDEN) and not torch.isnan(eager[0]).any()

        explained = torch._dynamo.explain(model)(inputs[0])
        assert explained.graph_break_count == 0 and explained.graph_count == 1, explained.break_reasons
        targets = {str(n.target) for g in explained.graphs for n in g.graph.nodes if n.op == "call_function"}
        for name in ("all_gather_matmul", "gemm_one_shot_all_reduce"):
            assert f"{namespace}.{name}.default" in targets, targets
        heartbeat(f"{backend} explain: 1 graph, 0 breaks")

        torch._dynamo.reset()
        plain = torch.compile(model, backend="aot_eager", fullgraph=True)
        for x, ref in zip(inputs, eager):
            assert torch.equal(plain(x), ref), f"{backend} aot_eager differs from eager"
        heartbeat(f"{backend} aot_eager")

        graphs = torch.compile(model, mode="reduce-overhead", fullgraph=True)  # Inductor with CUDA graphs
        bitwise = []
        for step in range(3 * len(inputs)):  # warm-up, recording, then replays, on fresh inputs
            k = step % len(inputs)
            out = graphs(inputs[k].clone()).clone()
            assert_close(out, eager[k], f"{backend} reduce-overhead call {step}")
            bitwise.append(torch.equal(out, eager[k]))
        print(f"rank {rank} {backend} reduce-overhead bitwise equal to eager, per call: {bitwise}")
        heartbeat(f"{backend} reduce-overhead")
        torch._dynamo.reset()


@pytest.mark.parametrize("backend", list(PACKAGES))
def test_mlp_compiles_with_no_graph_break(backend):
    run_on_gpus(compiled_mlp, backend, name=f"compiled MLP {backend}")


# ---------------------------------------------------------------------------
# The compiled MoE layer
# ---------------------------------------------------------------------------

TOKENS, MOE_HIDDEN, EXPERTS_PER_RANK, TOP_K = 200, 512, 4, 2


class MoELayer(torch.nn.Module):
    """Router (top-k of an fp32 softmax), dispatch, one linear per local expert on its rows of ``recv`` (masks: no
    shape depends on the routing), combine, residual. The capacity holds every pair a rank can receive."""

    def __init__(self, comm, seed: int):
        super().__init__()
        self.comm = comm
        ws, rank = dist.get_world_size(), dist.get_rank()
        self.num_experts, self.capacity = EXPERTS_PER_RANK * ws, ws * TOKENS * TOP_K
        gen = torch.Generator(device="cuda").manual_seed(seed)  # the router: the same on every rank
        self.router = torch.nn.Parameter(torch.randn(MOE_HIDDEN, self.num_experts, generator=gen, device="cuda"))
        gen = torch.Generator(device="cuda").manual_seed(seed + 1 + rank)  # this rank's experts
        self.experts = torch.nn.Parameter(torch.randn(EXPERTS_PER_RANK, MOE_HIDDEN, MOE_HIDDEN, generator=gen,
                                                      device="cuda").div(MOE_HIDDEN**0.5).to(BF16))

    def route(self, x):
        return torch.topk(torch.softmax(x.float() @ self.router, dim=-1), TOP_K)

    def forward(self, x):
        weights, ids = self.route(x)
        recv, counts, handle = self.comm.moe_dispatch(x, ids, self.num_experts, capacity=self.capacity)
        rows = torch.arange(recv.shape[0], device=recv.device)[:, None]
        first, last = handle.recv_offsets, handle.recv_offsets + counts
        out = torch.zeros_like(recv)
        for e in range(EXPERTS_PER_RANK):  # rows no dispatch wrote hold anything: where(), not a product with a mask
            out = torch.where((rows >= first[e]) & (rows < last[e]), recv @ self.experts[e], out)
        return x + self.comm.moe_combine(out, handle, weights)


def moe_reference(model: MoELayer, x: torch.Tensor) -> torch.Tensor:
    """The layer in plain torch on this rank's tokens, with every rank's experts all-gathered (fp32 sums)."""
    weights, ids = model.route(x)
    parts = [torch.empty_like(model.experts) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, model.experts.detach().contiguous())
    out = x.float()
    for e, expert in enumerate(torch.cat(parts)):  # global expert e lives on rank e // EXPERTS_PER_RANK
        chosen = ((ids == e) * weights).sum(1, keepdim=True)
        out = out + chosen * (x @ expert).float()
    return out.to(x.dtype)


def compiled_moe(backend: str) -> None:
    package, namespace = PACKAGES[backend]
    comm = importlib.import_module(package)
    rank = dist.get_rank()
    model = MoELayer(comm, seed=11)
    inputs = [rank_values(20 + seed, rank, (TOKENS, MOE_HIDDEN)) for seed in range(4)]
    with torch.no_grad():
        eager = []
        for x in inputs:  # the first call compiles each recipe (a Helion twin: most of a minute on a busy host)
            eager.append(model(x).clone())
            heartbeat(f"{backend} moe eager call {len(eager)}")
        for x, out in zip(inputs, eager):
            assert_close(out, moe_reference(model, x), f"{backend} moe eager against the reference")

        torch._dynamo.reset()
        explained = torch._dynamo.explain(model)(inputs[0])
        assert explained.graph_break_count == 0 and explained.graph_count == 1, explained.break_reasons
        targets = {str(n.target) for g in explained.graphs for n in g.graph.nodes if n.op == "call_function"}
        for name in ("moe_dispatch", "moe_combine"):
            assert f"{namespace}.{name}.default" in targets, targets
        heartbeat(f"{backend} moe explain: 1 graph, 0 breaks")

        torch._dynamo.reset()
        plain = torch.compile(model, backend="aot_eager", fullgraph=True)
        for x, ref in zip(inputs, eager):
            assert torch.equal(plain(x), ref), f"{backend} moe aot_eager differs from eager"
        heartbeat(f"{backend} moe aot_eager")

        torch._dynamo.reset()
        inductor = torch.compile(model, fullgraph=True)
        for step, (x, ref) in enumerate(zip(inputs, eager)):
            assert_close(inductor(x), ref, f"{backend} moe inductor call {step}")
        heartbeat(f"{backend} moe inductor")

        torch._dynamo.reset()
        graphs = torch.compile(model, mode="reduce-overhead", fullgraph=True)  # Inductor with CUDA graphs
        for step in range(3 * len(inputs)):  # warm-up, recording, then replays, on fresh inputs
            k = step % len(inputs)
            assert_close(graphs(inputs[k].clone()).clone(), eager[k], f"{backend} moe reduce-overhead call {step}")
        heartbeat(f"{backend} moe reduce-overhead")
        torch._dynamo.reset()


@pytest.mark.parametrize("backend", list(PACKAGES))
def test_moe_layer_compiles_with_no_graph_break(backend):
    run_on_gpus(compiled_moe, backend, name=f"compiled MoE {backend}")


# ---------------------------------------------------------------------------
# opcheck
# ---------------------------------------------------------------------------


def operator_cases() -> dict[str, list[tuple]]:
    """Per operator, argument tuples in schema order (the group, None: the default, then its size; ``""``: no
    config)."""
    ws = dist.get_world_size()
    x, bias, weight = rank_values(1, dist.get_rank(), (37, 129)), rank_values(2, 0, (129,)), rank_values(3, 0, (129,))
    a, b = rank_values(4, dist.get_rank(), (128, 256)), rank_values(5, 0, (256, 128))
    fp8 = lambda t: t.to(torch.float8_e4m3fn)  # noqa: E731
    one = torch.ones(1, device="cuda")
    q, kv = rank_values(6, dist.get_rank(), (1, 4, 128, 64)), rank_values(7, dist.get_rank(), (1, 2, 128, 64))
    return {
        "one_shot_all_reduce": [(x, None, ws, "")],
        "two_shot_all_reduce": [(x.clone(), None, ws, "")],
        "reduce_scatter": [(rank_values(8, dist.get_rank(), (ws * 37, 3)), None, ws, "")],
        "all_gather": [(rank_values(9, dist.get_rank(), (37, 3)), None, ws, "(('max_blocks', 4),)")],
        "one_shot_all_reduce_bias": [(x, bias, None, ws, "")],
        "two_shot_all_reduce_bias": [(x, bias, None, ws, "")],
        "one_shot_all_reduce_bias_rms_norm": [(x, bias, weight, 1e-5, None, ws, "")],
        "two_shot_all_reduce_bias_rms_norm": [(x, bias, weight, 1e-5, None, ws, "")],
        "rms_norm": [(x, weight, 1e-5, "")],
        "gemm_one_shot_all_reduce": [(a, b, None, ws, BF16, "")],
        "gemm_reduce_scatter": [(rank_values(10, dist.get_rank(), (ws * 128, 256)), b, None, ws, BF16, "")],
        "gemm_reduce_scatter_fp8": [(fp8(rank_values(11, dist.get_rank(), (ws * 128, 256))), fp8(b.t().contiguous()).t(),
                                     one, one, None, ws, BF16, "")],
        "all_gather_matmul": [(a, b, None, ws, False, ""), (a, b, None, ws, True, "")],
        "all_gather_matmul_fp8": [(fp8(a), fp8(b.t().contiguous()).t(), one, one, None, ws, "")],
        "context_parallel_attention": [(q, kv, kv.clone(), None, ws, False, None, "")],
    }


OPCHECKS = ("test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")


def check_fp8_schema(op, args) -> None:
    """What opcheck's schema check asks, by bytes: no input written (the schema declares none) and no output
    sharing an input's storage."""
    inputs = [a for a in args if isinstance(a, torch.Tensor)]
    before = [a.view(torch.uint8).clone() if a.dtype == torch.float8_e4m3fn else a.clone() for a in inputs]
    result = op(*args)
    outputs = result if isinstance(result, (list, tuple)) else [result]
    for a, saved in zip(inputs, before):
        assert torch.equal(a.view(torch.uint8) if a.dtype == torch.float8_e4m3fn else a, saved), "an input was written"
    storages = {a.untyped_storage().data_ptr() for a in inputs}
    assert all(o.untyped_storage().data_ptr() not in storages for o in outputs), "an output aliases an input"


def opcheck_every_operator(backend: str) -> None:
    from kraken.runtime import library

    _, namespace = PACKAGES[backend]
    importlib.import_module(PUBLIC[backend])  # loading the public functions registers their operators
    cases = operator_cases()
    assert set(cases) == set(library.ENTRIES)
    failures = []
    for name, argument_sets in cases.items():
        op = getattr(getattr(torch.ops, namespace), name).default
        for args in argument_sets:
            try:
                if any(isinstance(a, torch.Tensor) and a.dtype == torch.float8_e4m3fn for a in args):
                    # opcheck's schema check compares inputs with allclose, which fp8 does not have
                    torch.library.opcheck(op, args, test_utils=[u for u in OPCHECKS if u != "test_schema"])
                    check_fp8_schema(op, args)
                else:
                    torch.library.opcheck(op, args)
            except Exception as exc:  # every operator is checked; the failures are listed together
                cause = exc.__cause__ or exc
                failures.append(f"{namespace}::{name}: {type(exc).__name__}: {str(exc)[:300]} | "
                                f"{type(cause).__name__}: {str(cause)[:600]}")
                print(f"rank {dist.get_rank()} opcheck failure: {failures[-1]}", flush=True)
        heartbeat(f"opcheck {namespace}::{name}")
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("backend", list(PACKAGES))
def test_opcheck_every_operator(backend):
    run_on_gpus(opcheck_every_operator, backend, name=f"opcheck {backend}")


def opcheck_moe_operators(backend: str) -> None:
    """The MoE pair (``kraken/runtime/moe_ops.py``). The dispatch's ``recv`` is the recipe's receive buffer (the same
    tensor in every call of the shape) and ``routing`` has two ints of padding after the status that no kernel
    writes, so its AOT check compares the written parts by hand; the combine takes all four checks (its AOT check
    passes it copies of ``recv``, which it must tell from the buffer)."""
    _, namespace = PACKAGES[backend]
    importlib.import_module(PUBLIC[backend])
    dispatch, combine = (getattr(getattr(torch.ops, namespace), name).default
                         for name in ("moe_dispatch", "moe_combine"))
    ws, rank = dist.get_world_size(), dist.get_rank()
    tokens, top_k, experts = 37, 2, 2 * ws
    x = rank_values(30, rank, (tokens, 129))
    gen = torch.Generator(device="cuda").manual_seed(31 + rank)
    ids = torch.randint(0, experts, (tokens, top_k), generator=gen, device="cuda")
    weights = torch.rand(tokens, top_k, generator=gen, device="cuda")
    args = (x, ids, experts, None, ws, ws * tokens * top_k, False, "")
    buffer, _ = dispatch(*args)
    buffer.zero_()  # the rows no dispatch writes: defined for the comparisons (no peer writes it before our next call)
    torch.library.opcheck(dispatch, args, test_utils=[u for u in OPCHECKS if u != "test_aot_dispatch_dynamic"])
    recv, routing = (t.clone() for t in dispatch(*args))
    compiled = torch.compile(lambda *a: dispatch(*a), backend="aot_eager", dynamic=True, fullgraph=True)
    recv_aot, routing_aot = compiled(*args)
    assert recv_aot.data_ptr() == buffer.data_ptr(), "the receive buffer itself"
    assert torch.equal(recv_aot, recv), f"{namespace}::moe_dispatch: aot_eager received other rows"
    for part in (slice(0, 2), slice(4, None)):  # status, then slots, counts, offsets
        assert torch.equal(routing_aot[part], routing[part]), f"{namespace}::moe_dispatch: aot_eager routing {part}"
    heartbeat(f"opcheck {namespace}::moe_dispatch")
    torch._dynamo.reset()
    recv, routing = dispatch(*args)
    expert_out = (recv.float() * 2 + 1).to(recv.dtype)
    torch.library.opcheck(combine, (expert_out, recv, routing, experts, None, ws, weights, ""))
    heartbeat(f"opcheck {namespace}::moe_combine")


@pytest.mark.parametrize("backend", list(PACKAGES))
def test_opcheck_moe_operators(backend):
    run_on_gpus(opcheck_moe_operators, backend, name=f"opcheck moe {backend}")


# ---------------------------------------------------------------------------
# Ordinary and symmetric inputs
# ---------------------------------------------------------------------------

COLLECTIVES = ("one_shot_all_reduce", "two_shot_all_reduce", "reduce_scatter", "all_gather")


def shape_of(name: str, ws: int, rows: int, inner: int) -> tuple[int, ...]:
    return (ws * rows, inner) if name == "reduce_scatter" else (rows, inner)


def ordinary_equals_symmetric(backend: str) -> None:
    import kraken

    package, _ = PACKAGES[backend]
    comm = importlib.import_module(package)
    ws, rank = dist.get_world_size(), dist.get_rank()
    for dtype in (BF16, torch.float32):
        for rows, inner in ((1, 1), (37, 129), (1000, 33)):
            for name in COLLECTIVES:
                fn = getattr(comm, name)
                shape = shape_of(name, ws, rows, inner)
                values = [rank_values(rows * inner, r, shape, dtype) for r in range(ws)]
                symmetric = kraken.symm_empty(shape, dtype)
                symmetric.copy_(values[rank])
                ordinary = values[rank].clone()
                from_symmetric = fn(symmetric).clone()
                from_ordinary = fn(ordinary)
                what = f"{backend} {name} {tuple(shape)} {dtype}"
                assert torch.equal(from_ordinary, from_symmetric), f"{what}: ordinary != symmetric"
                if name == "all_gather":
                    assert torch.equal(from_ordinary, torch.cat(values)), what
                else:
                    total = sum(v.double() for v in values)
                    if name == "reduce_scatter":
                        total = total[rank * rows:(rank + 1) * rows]
                    assert_close(from_ordinary, total.to(dtype), what)
                if name != "two_shot_all_reduce":
                    assert torch.equal(ordinary, values[rank]), f"{what}: the input changed"
            heartbeat(f"{backend} ordinary == symmetric {dtype} {rows}x{inner}")
    stress_staged(comm, backend)


def stress_staged(comm, backend: str) -> None:
    """200 back-to-back staged launches of each collective on rotating fresh inputs (a race shows as a wrong
    sum), then CUDA-graph replays of the staged path."""
    ws, rank = dist.get_world_size(), dist.get_rank()
    for name in ("one_shot_all_reduce", "reduce_scatter", "all_gather"):
        fn = getattr(comm, name)
        shape = shape_of(name, ws, 257, 64)
        inputs = [[rank_values(100 + k, rank, shape)] for k in range(4)]
        expected = [fn(x.clone()).clone() for x, in inputs]
        outs = [fn(inputs[i % 4][0]) for i in range(200)]
        torch.cuda.synchronize()
        for i, out in enumerate(outs):
            assert torch.equal(out, expected[i % 4]), f"{backend} {name} staged launch {i} differs"
        check_graph_replays(f"{backend} {name} staged", fn, inputs, range(4))
    two_shot = comm.two_shot_all_reduce
    values = [rank_values(200 + k, rank, (257, 64)) for k in range(4)]
    expected = [two_shot(v.clone()) for v in values]
    for i in range(200):
        x = values[i % 4].clone()
        x_out = two_shot(x)
        assert x_out is x
        if i % 20 == 0 or i > 190:
            assert torch.equal(x, expected[i % 4]), f"{backend} two_shot_all_reduce staged launch {i} differs"
    heartbeat(f"{backend} staged stress")


@pytest.mark.parametrize("backend", list(PACKAGES))
def test_collectives_take_ordinary_tensors(backend):
    run_on_gpus(ordinary_equals_symmetric, backend, name=f"ordinary inputs {backend}")

