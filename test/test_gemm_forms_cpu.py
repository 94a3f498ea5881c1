"""The fused GEMM recipes' forms (``crossover``): fused or sequential by total rows and world size, forced by
``form``, agreed across ranks, and the sequential form's result: the collective, then the GEMM. No GPU needed."""

from __future__ import annotations

import importlib
import re
from types import SimpleNamespace

import pytest
import torch

from fake_world import FakeWorld
from kraken.runtime import crossover, groups, prepared

BF16 = torch.bfloat16
RECIPES = {  # op -> (kraken module, helion module, whether a holds one rank's rows)
    "all_gather_matmul": ("kraken.fused.all_gather_matmul", "helion_ports.fused.all_gather_matmul", True),
    "gemm_reduce_scatter": ("kraken.fused.gemm_reduce_scatter", "helion_ports.fused.gemm_reduce_scatter", False),
    "gemm_one_shot_all_reduce": ("kraken.fused.gemm_one_shot_all_reduce",
                                 "helion_ports.fused.gemm_one_shot_all_reduce", False),
}
# op -> the product module that holds its ``call``, ``chosen``, ``check_sequential`` and ``prepare``.
PRODUCTS = {"gemm_reduce_scatter": "kraken.runtime.gemm_reduce_scatter",
            "gemm_one_shot_all_reduce": "kraken.runtime.gemm_all_reduce",
            "all_gather_matmul": "kraken.runtime.gather_matmul"}


def product_of(op: str):
    return importlib.import_module(PRODUCTS.get(op, RECIPES[op][0]))


@pytest.mark.parametrize("op", sorted(crossover.FUSED_FROM) + ["helion gemm_reduce_scatter"])
@pytest.mark.parametrize("world_size", [2, 3, 4, 8])
def test_form_follows_the_table(op, world_size):
    """Sequential below the entry of the smallest measured world size at or above ``world_size``, fused from it;
    a group of one is always fused."""
    entry = crossover.FUSED_FROM[op.removeprefix("helion ")][4 if world_size == 3 else world_size]
    assert crossover.choose_form(op, entry, world_size, {}) == "fused"
    assert crossover.choose_form(op, 1 << 20, world_size, {}) == "fused"
    if entry:
        assert crossover.choose_form(op, entry - 1, world_size, {}) == "sequential"
    assert crossover.choose_form(op, 1, 1, {}) == "fused"


def test_forced_forms_and_fused_only_calls():
    op = "all_gather_matmul"
    assert crossover.choose_form(op, 1 << 20, 4, {"form": "sequential"}) == "sequential"
    assert crossover.choose_form(op, 8, 4, {"form": "fused"}) == "fused"
    assert crossover.choose_form(op, 8, 4, {"block_m": 64}) == "fused"  # tiles configure the fused kernel
    assert crossover.choose_form(op, 8, 4, {}, sequential_ok=False) == "fused"
    with pytest.raises(ValueError, match=r"form='sequential' cannot run this call: config \['block_m'\]"):
        crossover.choose_form(op, 8, 4, {"form": "sequential", "block_m": 64})
    with pytest.raises(ValueError, match="its dtypes need the fused kernel"):
        crossover.choose_form(op, 8, 4, {"form": "sequential"}, sequential_ok=False)
    with pytest.raises(ValueError, match=r"form must be 'fused' or 'sequential'.*got 'seq'"):
        crossover.choose_form(op, 8, 4, {"form": "seq"})
    with pytest.raises(ValueError, match="no form crossover for world size 9"):
        crossover.fused_from(op, 9)


@pytest.fixture
def two_ranks(monkeypatch):
    prepared.forget_prepared_calls()
    world = FakeWorld(monkeypatch)
    monkeypatch.setattr(groups, "world_size_of", lambda group, op: 2)
    yield world
    prepared.forget_prepared_calls()


def collective(op: str, seen: list):
    """A stand-in for the SM-driven collective of ``op``'s sequential form at two ranks, rank 1 holding twice
    rank 0's values: what it would return, and each call recorded in ``seen``."""
    def gather(x, group):
        seen.append(x)
        return torch.cat([x, 2 * x])

    def reduce_scatter(x, group):
        seen.append(x)
        return (3 * x.double())[:x.shape[0] // 2].to(x.dtype)

    def all_reduce(x, group):
        seen.append(x)
        return (3 * x.double()).to(x.dtype)

    return {"all_gather_matmul": gather, "gemm_reduce_scatter": reduce_scatter,
            "gemm_one_shot_all_reduce": all_reduce}[op]


@pytest.mark.parametrize("package", [0, 1])
@pytest.mark.parametrize("op", sorted(RECIPES))
def test_sequential_form_is_the_collective_and_the_gemm(two_ranks, monkeypatch, op, package):
    """Below the crossover the call is the collective and cuBLAS, with the same result as the float64 reference
    (rank 1's operand twice rank 0's); no fused kernel is prepared."""
    module = importlib.import_module(RECIPES[op][package])
    recipe = product_of(op)
    monkeypatch.setattr(recipe, "check_sequential", lambda a, b, world_size, op: None)  # CPU tensors
    monkeypatch.setattr(recipe, "prepare", lambda *args: pytest.fail("the fused form was prepared"))
    if op == "gemm_one_shot_all_reduce":  # by rows always fused: forced here (its fill rule has a test of its own)
        monkeypatch.setattr(recipe, "fills_poorly", lambda a, b, world_size: True)
    rows = 4 if op != "all_gather_matmul" else 2
    a, b = torch.randn(rows, 24, dtype=BF16), torch.randn(24, 40, dtype=BF16)
    seen = []
    args = (a, b, None, False) if op == "all_gather_matmul" else (a, b, None, BF16)
    name = f"helion {op}" if package else op  # as the twin names itself
    out = recipe.call(module.launch, name, *args, {}, collective(op, seen))
    reference = a.double() @ b.double()
    if op == "all_gather_matmul":
        assert seen == [a] and out.shape == (2 * rows, 40)
        expected = torch.cat([reference, 2 * reference])
    else:
        assert len(seen) == 1 and seen[0].shape == (rows, 40)
        expected = 3 * reference if op == "gemm_one_shot_all_reduce" else (3 * reference)[:rows // 2]
    torch.testing.assert_close(out.double(), expected, rtol=2e-2, atol=2e-2)
    # A warm call is one lookup (the recipe's ``chosen``): the form is neither chosen nor agreed again.
    monkeypatch.setattr(crossover, "form", lambda *args: pytest.fail("the form was chosen again"))
    again = recipe.call(module.launch, name, *args, {}, collective(op, seen))
    assert torch.equal(again, out) and len(seen) == 2


@pytest.mark.parametrize("op", sorted(RECIPES))
def test_forms_that_differ_between_ranks_raise_on_every_rank(two_ranks, monkeypatch, op):
    """``form`` is part of the agreed signature: rank 0 forcing sequential while rank 1 forces fused would launch
    different kernels against each other; both raise instead, and nothing runs."""
    recipe = product_of(op)
    two_ranks.other = lambda mine: (tuple((n, (("form", "fused"),) if n == "config" else s) for n, s in mine[0]),
                                    None)
    a, b = torch.randn(4, 24, dtype=BF16), torch.randn(24, 40, dtype=BF16)
    args = (a, b, None, False) if op == "all_gather_matmul" else (a, b, None, BF16)
    differs = "config: rank 0 (('form', 'sequential'),), rank 1 (('form', 'fused'),)"
    with pytest.raises(ValueError, match=re.escape(f"ranks disagree on the input's shape/dtype ({differs})")):
        recipe.call(None, op, *args, {"form": "sequential"}, lambda *rest: pytest.fail("a collective ran"))


@pytest.mark.parametrize("op", sorted(RECIPES))
def test_one_rank_bad_input_in_the_sequential_form_raises_on_every_rank(two_ranks, op):
    """The sequential form's checks run inside the agreement: rank 1's bad input raises on rank 0 too."""
    recipe = product_of(op)
    two_ranks.other = lambda mine: (mine[0], ("ValueError", "a is bad"))
    a, b = torch.randn(4, 24, dtype=BF16), torch.randn(24, 40, dtype=BF16)
    args = (a, b, None, False) if op == "all_gather_matmul" else (a, b, None, BF16)
    with pytest.raises(ValueError, match=rf"^{op} \(form\): bad input on rank"):
        recipe.call(None, op, *args, {}, lambda *rest: pytest.fail("a collective ran"))


@pytest.mark.parametrize("shape,world_size,poor", [
    ((512, 5120, 5120), 4, True), ((512, 5120, 5120), 2, True), ((512, 4096, 4096), 4, False),
    ((2048, 4096, 4096), 4, False), ((64, 4096, 4096), 2, False), ((128, 8192, 8192), 4, False),
])
def test_gemm_all_reduce_prefers_sequential_where_its_tiles_fill_poorly(monkeypatch, shape, world_size, poor):
    """80 tiles of 128x256 on 132 SMs (512x5120x5120) leave 39% of the wave idle: sequential; the other default
    shapes fill at least 97%, or have at most ``SKINNY_M`` rows (64 tiles at 64 rows and 2 ranks: still fused)."""
    recipe = product_of("gemm_one_shot_all_reduce")
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: SimpleNamespace(multi_processor_count=132))
    m, n, k = shape
    assert recipe.fills_poorly(torch.empty(m, k, dtype=BF16), torch.empty(k, n, dtype=BF16), world_size) is poor


def test_ranks_whose_rows_differ_raise_on_every_rank(two_ranks, monkeypatch):
    """What decides the form is agreed: rank 1 with other rows than rank 0 (one side of the crossover each) raises
    on every rank before anything runs."""
    recipe = importlib.import_module("kraken.runtime.gather_matmul")
    monkeypatch.setattr(recipe, "check_sequential_fp8", lambda *args: None)
    a, b = torch.zeros(4, 32).to(torch.float8_e4m3fn), torch.zeros(32, 48).to(torch.float8_e4m3fn)
    two_ranks.other = lambda mine: (tuple((n, 4096 if n == "rows" else s) for n, s in mine[0]), None)
    with pytest.raises(ValueError, match=r"ranks disagree on the input's shape/dtype \(rows: rank 0 8, rank 1 4096\)"):
        recipe.call_fp8(None, "all_gather_matmul_fp8", a, b, torch.ones(()), torch.ones(()), None, {},
                    lambda *rest: pytest.fail("a collective ran"))


@pytest.mark.parametrize("package", ["kraken", "helion_ports"])
@pytest.mark.parametrize("per_tensor", [True, False])
def test_fp8_reduce_scatter_sequential_form_is_scaled_mm_and_the_collective(two_ranks, monkeypatch, package,
                                                                             per_tensor):
    """``gemm_reduce_scatter_fp8`` below its crossover: ``torch._scaled_mm`` with row-wise scales (a per-tensor scale
    spread over the rows or columns) on a column-major ``b``, bf16 out, then the reduce-scatter; an fp32 output only
    the fused kernel gives, so it is prepared instead."""
    recipe = importlib.import_module("kraken.runtime.gemm_reduce_scatter_fp8")  # the product: call, prepare, ...
    module = importlib.import_module(f"{package}.fused.gemm_reduce_scatter_fp8")  # whose launch it drives
    monkeypatch.setattr(recipe, "check_sequential", lambda *args: None)  # CPU tensors
    monkeypatch.setattr(recipe, "prepare", lambda *args: (_ for _ in ()).throw(LookupError("fused form prepared")))
    m, k, n = 4, 32, 48
    a = torch.randn(m, k).to(torch.float8_e4m3fn)
    b = torch.randn(n, k).to(torch.float8_e4m3fn).t()  # column-major, as _scaled_mm takes it
    scale_a = torch.full((), 0.5) if per_tensor else torch.rand(m, 1) + 0.5
    scale_b = torch.full((), 2.0) if per_tensor else torch.rand(1, n) + 0.5
    calls = []

    def scaled_mm(x, y, rows, cols, out_dtype):
        calls.append((rows.shape, cols.shape, y.stride(0), out_dtype))
        return ((x.double() * rows.double()) @ (y.double() * cols.double())).to(out_dtype)

    monkeypatch.setattr(torch, "_scaled_mm", scaled_mm)
    seen = []
    op = "gemm_reduce_scatter_fp8" if package == "kraken" else "helion gemm_reduce_scatter_fp8"
    out = recipe.call(module.launch, op, a, b, scale_a, scale_b, None, BF16, {},
                      collective("gemm_reduce_scatter", seen))
    assert calls == [((m, 1), (1, n), 1, BF16)] and len(seen) == 1
    reference = (a.double() * scale_a.double().reshape(-1, 1)) @ (b.double() * scale_b.double().reshape(1, -1))
    torch.testing.assert_close(out.double(), (3 * reference)[:m // 2], rtol=2e-2, atol=2e-2)
    with pytest.raises(LookupError, match="fused form prepared"):
        recipe.call(module.launch, op, a, b, scale_a, scale_b, None, torch.float32, {},
                    lambda *args: pytest.fail("the sequential form ran"))
