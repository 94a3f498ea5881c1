"""GPU tests of the all-reduce + bias + RMSNorm family (one process per GPU).

The whole file is one spawn: ``family_worker`` runs every check on every rank,
collects failures instead of stopping at the first one, and the tests below
each assert on their own section of the collected report. Checks:

* sweep: every backend of ``all_reduce_bias`` and ``all_reduce_bias_rms_norm``
  (but the reference-free ones, ``Op.reference_free``: a copy is a timing
  reference, not the op) against a float64 reference on fresh random inputs per
  rank, hidden 5120, 1000, 4096 x tokens 1, 3, 16, 256 x every dtype; the fused
  recipes through ``prepare``/``launch`` into a NaN-poisoned output *and* a
  NaN-poisoned workspace (every element read was written in this call), and
  through the public function (bitwise equal); the front doors
  (``triton_auto``/``helion_auto``: no ``prepare`` of their own) through their
  public call, bitwise equal to the recipe ``kraken.runtime.crossover`` chooses, called
  directly; every rank's result bitwise identical;
* rms_norm (single GPU, Triton and Helion) against float64, poisoned output;
* eps: a large eps changes the result exactly as the reference says;
* broadcast: a 3-D ``x`` (leading dims flattened), per-column bias and weight;
* 200 back-to-back launches per fused backend, then CUDA-graph capture and 20
  replays against eager, bitwise;
* bad input (a bias on the CPU; one rank alone with a short bias, a wrong dtype or eps) raises on every
  rank and the group still works, through the front doors too;
* plain: each recipe's and twin's own host function (``kraken.fused.<name>.<name>``: a workspace rendezvoused per
  call, no checks) against float64, identical on every rank.
"""

from __future__ import annotations

import importlib
import time
import traceback

import pytest
import torch
import torch.distributed as dist

from benchmark import registry
from benchmark.ops.all_reduce_bias import EPS, parameters, rank_values
from kraken.runtime import bias_norm, crossover
from gpu_utils import DTYPES, POISON, assert_close, heartbeat, needs_gpus, rel_err, run_on_gpus

pytestmark = needs_gpus

OPS = ("all_reduce_bias", "all_reduce_bias_rms_norm")
HIDDENS = (5120, 1000, 4096)
TOKENS = (1, 3, 16, 256)
RMS_NORM = ("kraken.fused.rms_norm", "helion_ports.fused.rms_norm")


# ---------------------------------------------------------------------------
# Helpers (run inside the spawned workers)
# ---------------------------------------------------------------------------


def checked_backends(op: registry.Op) -> list[str]:
    """The op's backends that compute the op, checked here: all but ``op.reference_free`` (a copy of the input,
    timed as the single-GPU floor, is not the op's result)."""
    return [backend for backend in op.backends if backend not in op.reference_free]


def fused_modules(op: registry.Op) -> dict[str, str]:
    """Backend name -> path, for the op's fused (Triton and Helion) backends: the recipes' and twins' modules, and
    the front doors that choose between them (``kraken.<op>``, ``helion_ports.<op>``: product code, no file)."""
    found = {}
    for pair in op.pairs:
        if pair.triton in checked_backends(op):
            found[pair.triton], found[pair.helion] = pair.triton_module, pair.helion_module
    for backend, package in (("triton_auto", "kraken"), ("helion_auto", "helion_ports")):
        if backend in checked_backends(op):
            found[backend] = f"{package}.{op.name}"
    return found


def is_front_door(path: str) -> bool:
    """A front door (``kraken.all_reduce_bias[_rms_norm]``, its twin): one-shot or two-shot by
    ``kraken.runtime.crossover``, with no ``launch`` of its own."""
    return path.rsplit(".", 1)[1] in crossover.FAMILY


def chosen_recipe(door_path: str, op_name: str, tokens: int) -> str:
    """The module of the recipe the front door ``door_path`` runs at ``tokens`` in this group."""
    shot = crossover.choose(op_name, tokens, dist.get_world_size())
    return f"{door_path.split('.')[0]}.fused.{shot}_shot_{op_name}"


def public(path: str):
    """The installed function of a recipe's or twin's module (``kraken.fused.x`` -> ``kraken.x``), or of a door."""
    return registry.public(path)


def reference(norm: bool, shape, dtype, seed: int, eps: float = EPS, params_seed: int | None = None) -> torch.Tensor:
    """float64: the sum of every rank's x (each rank rebuilds all of them), + bias, [RMSNorm]."""
    h = sum(rank_values(shape, dtype, seed, r).double() for r in range(dist.get_world_size()))
    bias, weight = parameters(shape[-1], dtype, seed if params_seed is None else params_seed)
    h = h + bias.double()
    if norm:
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps) * weight.double()
    return h


def call(module_path: str, norm: bool, x, bias, weight, eps=EPS):
    fn = public(module_path)
    return fn(x, bias, weight, eps) if norm else fn(x, bias)


def poisoned_launch(module_path: str, norm: bool, x, bias, weight, eps=EPS) -> torch.Tensor:
    """``prepare`` + ``launch`` into a NaN output, with this rank's workspace NaN too.

    Poisoning the workspace here is race-free: peers touch it only after this
    launch's first barrier, which this rank reaches after the fill.
    """
    module = importlib.import_module(module_path)
    operands = (bias, weight, eps) if norm else (bias,)
    x2d, ctx, cfg = bias_norm.prepare(module_path.rsplit(".", 1)[1], x, operands, None, "test", {})
    ctx.peers[ctx.rank].fill_(POISON)
    out = torch.full_like(x2d, POISON)
    norm_args = (weight, eps) if norm else ()
    module.launch(
        x2d, bias, *norm_args, ctx.peers, out, ctx.signal_pad_ptrs, ctx.rank, **cfg, group_name=ctx.group_name
    )
    return out.view(x.shape)


def every_rank(out: torch.Tensor) -> list[torch.Tensor]:
    """Every rank's ``out``. Called before any assertion, so ranks never disagree on collectives."""
    torch.cuda.synchronize()
    gathered = [torch.empty_like(out) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, out.contiguous())
    return gathered


def assert_identical(out: torch.Tensor, gathered: list[torch.Tensor], what: str) -> None:
    for r, other in enumerate(gathered):
        assert torch.equal(other, out), f"{what}: rank {r}'s result differs bitwise from rank {dist.get_rank()}'s"


class Report:
    """Failures per section, with the time each section took."""

    def __init__(self):
        self.failures: dict[str, list[str]] = {}
        self.seconds: dict[str, float] = {}

    def check(self, section: str, what: str, fn) -> None:
        heartbeat(f"{section}: {what}")
        self.failures.setdefault(section, [])
        try:
            fn()
        # Collect and go on; a hang is the watchdog's business. ``pytest.fail`` (say, a ``pytest.raises`` that did
        # not raise) raises a BaseException: collected too, or it would end this rank's worker mid-file.
        except (Exception, pytest.fail.Exception):  # noqa: BLE001
            self.failures[section].append(f"{what}: {traceback.format_exc(limit=3)}")


# ---------------------------------------------------------------------------
# The worker: every section, one process group
# ---------------------------------------------------------------------------


def sweep(report: Report) -> None:
    seed = 1000
    for op_name in OPS:
        op = registry.get(op_name)
        norm = op_name.endswith("rms_norm")
        fused = fused_modules(op)
        for dtype in DTYPES:
            for hidden in HIDDENS:
                for tokens in TOKENS:
                    seed += 1
                    shape = (tokens, hidden)
                    ref = reference(norm, shape, dtype, seed)
                    for backend in checked_backends(op):
                        what = f"{op_name} {backend} {str(dtype).removeprefix('torch.')} {tokens}x{hidden}"

                        def one(backend=backend, what=what, tokens=tokens):
                            inputs = op.make_inputs(shape, dtype, seed)
                            x, bias, weight = inputs["x"], inputs["bias"], inputs["weight"]
                            again, disagree = None, ""
                            if backend in fused and is_front_door(fused[backend]):
                                out = op.backends[backend](inputs)
                                recipe = chosen_recipe(fused[backend], op_name, tokens)
                                again = call(recipe, norm, x, bias, weight)
                                disagree = f"the front door and the recipe it chose ({recipe}), called directly,"
                            elif backend in fused:
                                out = poisoned_launch(fused[backend], norm, x, bias, weight)
                                again = op.backends[backend](inputs)
                                disagree = "the public call and launch()"
                            else:
                                out = op.backends[backend](inputs)
                            gathered = every_rank(out)
                            assert_close(out, ref, what)
                            assert_identical(out, gathered, what)
                            if again is not None:
                                assert torch.equal(again, out), f"{what}: {disagree} disagree"

                        report.check("sweep", what, one)


def rms_norm_alone(report: Report) -> None:
    for module_path in RMS_NORM:
        module = importlib.import_module(module_path)
        for dtype in DTYPES:
            for hidden in HIDDENS:
                for tokens in TOKENS:
                    what = f"{module_path} {str(dtype).removeprefix('torch.')} {tokens}x{hidden}"

                    def one(module=module, dtype=dtype, hidden=hidden, tokens=tokens, what=what):
                        x = rank_values((tokens, hidden), dtype, 7, dist.get_rank())
                        _, weight = parameters(hidden, dtype, 7)
                        x2d, cfg = bias_norm.prepare_rms_norm(x, weight, EPS, "test", {})
                        out = module.launch(x2d, weight, torch.full_like(x2d, POISON), EPS, **cfg)
                        torch.cuda.synchronize()
                        h = x.double()
                        ref = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + EPS) * weight.double()
                        assert_close(out, ref, what)
                        assert torch.equal(public(module.__name__)(x, weight, EPS), out), f"{what}: public call differs"
                        assert torch.equal(module.rms_norm(x, weight, EPS), out), f"{what}: plain function differs"

                    report.check("rms_norm", what, one)


def eps_and_broadcast(report: Report) -> None:
    big_eps = 10.0  # mean(h^2) is about world_size + 1 here: eps of 10 must change every row
    for op_name in OPS:
        op = registry.get(op_name)
        norm = op_name.endswith("rms_norm")
        for backend, module_path in fused_modules(op).items():
            if norm:
                def eps_check(module_path=module_path, what=f"{backend} {op_name} eps={big_eps}"):
                    shape, dtype, seed = (16, 1000), torch.float32, 11
                    x = rank_values(shape, dtype, seed, dist.get_rank())
                    bias, weight = parameters(shape[-1], dtype, seed)
                    small = call(module_path, True, x, bias, weight, EPS)
                    big = call(module_path, True, x, bias, weight, big_eps)
                    torch.cuda.synchronize()
                    assert_close(big, reference(True, shape, dtype, seed, big_eps), what)
                    assert rel_err(big, small) > 0.1, f"{what}: eps barely changes the result"

                report.check("eps", f"{op_name} {backend}", eps_check)

            def broadcast(module_path=module_path, norm=norm, what=f"{op_name} {backend} x of shape (2, 3, 1000)"):
                shape, dtype, seed = (2, 3, 1000), torch.bfloat16, 12
                x = rank_values(shape, dtype, seed, dist.get_rank())
                bias, weight = parameters(shape[-1], dtype, seed)
                out = call(module_path, norm, x, bias, weight)
                torch.cuda.synchronize()
                assert out.shape == x.shape and out.dtype == x.dtype, f"{what}: got {tuple(out.shape)} {out.dtype}"
                assert_close(out, reference(norm, shape, dtype, seed), what)

            report.check("broadcast", f"{op_name} {backend}", broadcast)

    for module_path in RMS_NORM:
        def rms_eps(module_path=module_path, what=f"{module_path} eps={big_eps}, x of shape (2, 3, 1000)"):
            x = rank_values((2, 3, 1000), torch.float32, 13, dist.get_rank())
            _, weight = parameters(1000, torch.float32, 13)
            out = public(module_path)(x, weight, big_eps)
            torch.cuda.synchronize()
            h = x.double()
            assert out.shape == x.shape
            assert_close(out, h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + big_eps) * weight.double(), what)

        report.check("eps", module_path, rms_eps)


def stress_and_graphs(report: Report) -> None:
    shape, dtype, slots = (16, 5120), torch.bfloat16, 4
    for op_name in OPS:
        op = registry.get(op_name)
        norm = op_name.endswith("rms_norm")
        bias, weight = parameters(shape[-1], dtype, 0)
        xs = [rank_values(shape, dtype, 20 + k, dist.get_rank()) for k in range(slots)]
        refs = [reference(norm, shape, dtype, 20 + k, params_seed=0) for k in range(slots)]
        for backend, module_path in fused_modules(op).items():
            def back_to_back(module_path=module_path, what=f"{op_name} {backend}"):
                outs = [call(module_path, norm, xs[i % slots], bias, weight) for i in range(200)]
                torch.cuda.synchronize()
                for i, out in enumerate(outs):
                    assert_close(out, refs[i % slots], f"{what} launch {i + 1} of 200")

            report.check("back_to_back", f"{op_name} {backend}", back_to_back)

            def graph(module_path=module_path, what=f"{op_name} {backend}"):
                eager = [call(module_path, norm, x, bias, weight).clone() for x in xs]
                static_x = xs[0].clone()
                call(module_path, norm, static_x, bias, weight)  # warm-up with the captured tensors
                torch.cuda.synchronize()
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g):
                    static_out = call(module_path, norm, static_x, bias, weight)
                mismatches = []
                for i in range(20):
                    static_x.copy_(xs[i % slots])
                    static_out.fill_(POISON)
                    g.replay()
                    torch.cuda.synchronize()
                    if not torch.equal(static_out, eager[i % slots]):
                        mismatches.append(i)
                gathered = every_rank(static_out)
                assert not mismatches, f"{what}: replays {mismatches} differ from eager"
                assert_identical(static_out, gathered, f"{what} graph")

            report.check("cuda_graph", f"{op_name} {backend}", graph)


def bad_input(report: Report) -> None:
    for op_name in OPS:
        op = registry.get(op_name)
        norm = op_name.endswith("rms_norm")
        for backend, module_path in fused_modules(op).items():
            def one(module_path=module_path, what=f"{op_name} {backend}"):
                x = rank_values((4, 1000), torch.bfloat16, 30, dist.get_rank())
                bias, weight = parameters(1000, torch.bfloat16, 30)
                with pytest.raises(ValueError, match="bias must be on a CUDA device"):
                    call(module_path, norm, x, bias.cpu(), weight)
                with pytest.raises(ValueError, match=r"bias must have shape \(1000,\)"):
                    call(module_path, norm, x, bias[:999], weight)
                # One rank alone wrong, on a call signature no rank has used yet: every rank raises, naming it.
                x7 = rank_values((7, 1000), torch.bfloat16, 31, dist.get_rank())
                bias7, weight7 = parameters(1000, torch.bfloat16, 31)
                last = dist.get_world_size() - 1  # the rank that alone passes bad input
                bad = dist.get_rank() == last
                with pytest.raises(ValueError, match=rf"bad input on rank {last}: bias must have shape \(1000,\)"):
                    call(module_path, norm, x7, bias7[:999] if bad else bias7, weight7)
                with pytest.raises(ValueError, match=f"bad input on rank {last}: bias has dtype float16"):
                    call(module_path, norm, x7, bias7.half() if bad else bias7, weight7)
                if norm:
                    with pytest.raises(ValueError, match=f"bad input on rank {last}: eps must be a finite number"):
                        call(module_path, norm, x7, bias7, weight7, -1.0 if bad else EPS)
                out7 = call(module_path, norm, x7, bias7, weight7)
                torch.cuda.synchronize()
                assert_close(out7, reference(norm, (7, 1000), torch.bfloat16, 31), f"{what} after one rank's errors")
                out = call(module_path, norm, x, bias, weight)  # the group still works
                torch.cuda.synchronize()
                assert_close(out, reference(norm, (4, 1000), torch.bfloat16, 30), f"{what} after errors")

            report.check("bad_input", f"{op_name} {backend}", one)


def plain(report: Report) -> None:
    """Each recipe's and twin's plain host function: its own workspace, plan and launch, no product layer."""
    for op_name in OPS:
        op = registry.get(op_name)
        norm = op_name.endswith("rms_norm")
        for backend, module_path in fused_modules(op).items():
            if is_front_door(module_path):
                continue

            def one(module_path=module_path, what=f"{op_name} {backend} plain"):
                shape, dtype, seed = (3, 1000), torch.bfloat16, 40
                x = rank_values(shape, dtype, seed, dist.get_rank())
                bias, weight = parameters(shape[-1], dtype, seed)
                fn = getattr(importlib.import_module(module_path), module_path.rsplit(".", 1)[1])
                out = fn(x, bias, weight, EPS) if norm else fn(x, bias)
                gathered = every_rank(out)
                assert_close(out, reference(norm, shape, dtype, seed), what)
                assert_identical(out, gathered, what)

            report.check("plain", f"{op_name} {backend}", one)


def family_worker() -> dict:
    report = Report()
    for section in (sweep, rms_norm_alone, eps_and_broadcast, stress_and_graphs, bad_input, plain):
        start = time.perf_counter()
        section(report)
        report.seconds[section.__name__] = round(time.perf_counter() - start, 1)
    return {"failures": report.failures, "seconds": report.seconds}


# ---------------------------------------------------------------------------
# Tests: one spawn, one assertion per section
# ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def reports():
    results = run_on_gpus(family_worker, name="all-reduce + bias + RMSNorm family")
    print("seconds per section (rank 0):", results[0]["seconds"])
    return results


def assert_section(reports, section: str) -> None:
    problems = [f"rank {r}: {msg}" for r, rep in enumerate(reports) for msg in rep["failures"].get(section, [])]
    ran = all(section in rep["failures"] for rep in reports)
    assert ran, f"section {section!r} did not run"
    assert not problems, f"{len(problems)} failure(s) in {section}:\n" + "\n".join(problems[:20])


def test_every_backend_matches_float64_and_is_identical_on_every_rank(reports):
    assert_section(reports, "sweep")


def test_rms_norm_alone_matches_float64(reports):
    assert_section(reports, "rms_norm")


def test_eps_is_respected(reports):
    assert_section(reports, "eps")


def test_leading_dims_and_per_column_bias_weight(reports):
    assert_section(reports, "broadcast")


def test_200_back_to_back_launches(reports):
    assert_section(reports, "back_to_back")


def test_cuda_graph_replays_match_eager(reports):
    assert_section(reports, "cuda_graph")


def test_bad_input_raises_on_every_rank_and_the_group_survives(reports):
    assert_section(reports, "bad_input")


def test_plain_host_functions_match_float64(reports):
    assert_section(reports, "plain")
