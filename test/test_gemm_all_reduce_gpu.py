"""GPU tests of GEMM + all-reduce and its Helion twin (one process per GPU).

One spawn per backend runs every check, to keep the file to a few minutes: float64
reference on odd and default-class shapes, bf16/fp16 in, bf16/fp32 out, into a
NaN-poisoned output; bitwise agreement across ranks; 200 back-to-back launches;
CUDA-graph replays; and bad input (ranks disagreeing on shapes) raising on every rank,
all in the form the recipe picks for each shape. A second spawn per backend forces each
form (``shot="one"``, ``"push"``, ``"two"``) on odd shapes (tails in M, N and K, several
rounds of tiles, a k split), launches the forms back to back on one workspace, and
replays each under a CUDA graph. Any world size: 1, 2, 4 or 8 ranks (sharing one GPU
with ``KRAKEN_WORLD_SIZE``).
"""

from __future__ import annotations

import functools
import importlib

import pytest
import torch
import torch.distributed as dist

from benchmark.ops.gemm_all_reduce import rank_operands
from gpu_utils import POISON, check_graph_replays, heartbeat, needs_gpus, rel_err, run_on_gpus

pytestmark = needs_gpus

MODULES = {
    "triton": "kraken.fused.gemm_one_shot_all_reduce",
    "helion": "helion_ports.fused.gemm_one_shot_all_reduce",
}
PACKAGES = {"triton": "kraken", "helion": "helion_ports"}  # where the installed functions are
PRODUCT = importlib.import_module("kraken.runtime.gemm_all_reduce")  # the prepared calls the installed recipe and twin share
BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32
# Odd shapes (every tail masked; K and N not multiples of 16: the unaligned class), each in every dtype pair.
ODD_SHAPES = ((1, 8, 16), (37, 100, 72), (129, 257, 136), (1000, 3000, 520))
# Default-class shapes: small M, small M and N with a 4-way and (tails everywhere) a 2-way k split, several
# tiles per block, large M, a partial edge.
CLASS_SHAPES = ((64, 4096, 4096), (64, 1024, 4096), (37, 500, 1000), (256, 8192, 512), (512, 4096, 1024),
                (1024, 4096, 1024), (1000, 3008, 512))
# The stress test alternates a 4-way k split on 64 blocks (pushing at 2 ranks) with two rounds of tiles on 132
# (pulling): launches whose grids and workspace layouts differ back to back.
STRESS_SHAPES = ((64, 1024, 2048), (2048, 4096, 128))
ALL_DTYPE_PAIRS = ((BF16, BF16), (BF16, FP32), (FP16, BF16), (FP16, FP32))
CLASS_DTYPE_PAIRS = ((BF16, BF16), (FP16, FP32))
# ||out - ref|| / ||ref|| against float64. bf16 out: the bf16 partials and the final rounding. fp32 out:
# fp32 accumulation over K in the tensor cores (looser than a plain fp32 sum's 1e-5, far below bf16's 1e-3).
TOLERANCE = {BF16: 1e-2, FP32: 1e-4}


def reference(shape, dtype, seed: int) -> torch.Tensor:
    """sum over ranks of a_r @ b_r in float64, every rank's operands rebuilt from their seeds."""
    total = None
    for r in range(dist.get_world_size()):
        a, b = rank_operands(shape, dtype, seed, r)
        product = a.double() @ b.double()
        total = product if total is None else total + product
    return total


def check(out: torch.Tensor, ref: torch.Tensor, what: str) -> None:
    assert out.shape == ref.shape, f"{what}: shape {tuple(out.shape)} != {tuple(ref.shape)}"
    assert not torch.isnan(out).any(), f"{what}: NaN in the output (an element was never written?)"
    err = rel_err(out, ref)
    assert err <= TOLERANCE[out.dtype], f"{what}: relative error {err:.2e} > {TOLERANCE[out.dtype]:.0e}"


def check_same_on_every_rank(out: torch.Tensor, what: str) -> None:
    gathered = [torch.empty_like(out) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, out)
    for r, other in enumerate(gathered):
        assert torch.equal(other, out), f"{what}: rank {r}'s result differs bitwise from rank {dist.get_rank()}'s"


def launch_into(module, a, b, out_dtype, out: torch.Tensor, config: dict | None = None) -> torch.Tensor:
    """The public call's own prepare/launch, but into a caller-owned (poisoned) output."""
    ctx, cfg = PRODUCT.prepare(a, b, None, out_dtype, "test", config or {})
    return module.launch(a, b, ctx.peers, out, ctx.signal_pad_ptrs, ctx.rank, **cfg, group_name=ctx.group_name)


def correctness(backend: str, module, fn) -> None:
    rank, seed = dist.get_rank(), 0
    # From 3 ranks on (sharing one GPU: every rank compiles every kernel, every barrier waits for time slices) the
    # odd shapes take two dtype pairs, every input and every output dtype once.
    pairs = ALL_DTYPE_PAIRS if dist.get_world_size() <= 2 else ((BF16, FP32), (FP16, BF16))
    cases = [(s, d) for s in ODD_SHAPES for d in pairs]
    cases += [(s, d) for s in CLASS_SHAPES for d in CLASS_DTYPE_PAIRS]
    for shape, (in_dtype, out_dtype) in cases:
        seed += 1
        what = f"{backend} {'x'.join(map(str, shape))} {in_dtype} -> {out_dtype}"
        heartbeat(what)
        a, b = rank_operands(shape, in_dtype, seed, rank)
        out = torch.full((shape[0], shape[1]), POISON, dtype=out_dtype, device="cuda")
        launch_into(module, a, b, out_dtype, out)
        public = fn(a, b, out_dtype=out_dtype)
        torch.cuda.synchronize()
        assert torch.equal(public, out), f"{what}: the public call and launch() disagree"
        check(out, reference(shape, in_dtype, seed), what)
        check_same_on_every_rank(out, what)


def stress_and_cuda_graph(backend: str, module, fn) -> None:
    """200 back-to-back launches on rotating inputs and alternating shapes (a workspace overwritten while a
    peer still reads it shows up here), then CUDA-graph capture and 20 replays against eager, bitwise."""
    rank, out_dtype = dist.get_rank(), BF16
    shapes = [STRESS_SHAPES[s % 2] for s in range(10)]
    inputs = [rank_operands(shape, BF16, 100 + s, rank) for s, shape in enumerate(shapes)]
    refs = [reference(shape, BF16, 100 + s) for s, shape in enumerate(shapes)]
    outs = [torch.full(shape[:2], POISON, dtype=out_dtype, device="cuda") for shape in shapes]
    for i in range(200):
        a, b = inputs[i % 10]
        launch_into(module, a, b, out_dtype, outs[i % 10])
        if i % 50 == 49:
            heartbeat(f"{backend} launch {i + 1}")
            torch.cuda.synchronize()
            for k in range(10):
                check(outs[k], refs[k], f"{backend} after {i + 1} launches (slot {k}, {shapes[k]})")
                outs[k].fill_(POISON)

    slots = range(0, 10, 2)  # the graph replays one shape
    eager = {k: fn(*inputs[k], out_dtype=out_dtype) for k in slots}
    static_a, static_b = (t.clone() for t in inputs[0])
    fn(static_a, static_b, out_dtype=out_dtype)  # warm-up before capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = fn(static_a, static_b, out_dtype=out_dtype)
    for i in range(20):
        k = slots[i % len(slots)]
        static_a.copy_(inputs[k][0])
        static_b.copy_(inputs[k][1])
        static_out.fill_(POISON)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(static_out, eager[k]), f"{backend} graph replay {i} differs from eager"
    heartbeat(f"{backend} graph replays done")


def bad_input(backend: str, module, fn) -> None:
    rank = dist.get_rank()
    if dist.get_world_size() > 1:  # a group of one cannot disagree
        # Ranks disagreeing on M (fresh shapes, so this is the first use): every rank raises, nothing hangs.
        a, b = rank_operands((40 + rank, 48, 32), BF16, 7, rank)
        with pytest.raises(ValueError, match="ranks disagree"):
            fn(a, b)
        # Same M and N, different K: the workspace is the same shape, its name carries K.
        a, b = rank_operands((44, 48, 32 + 16 * rank), BF16, 7, rank)
        with pytest.raises(ValueError, match="ranks disagree"):
            fn(a, b)
    a, b = rank_operands((44, 48, 32), BF16, 7, rank)
    with pytest.raises(TypeError, match="unknown config"):
        fn(a, b, bogus=1)
    with pytest.raises(ValueError, match="inner dimensions differ"):
        fn(a, b.t().contiguous())
    # The group still works after all that.
    out = fn(a, b)
    torch.cuda.synchronize()
    check(out, reference((44, 48, 32), BF16, 7), f"{backend} after bad input")
    heartbeat(f"{backend} bad input done")


def sequential_form(backend: str, fn) -> None:
    """The sequential form (``crossover``: cuBLAS, then the SM all-reduce), what the recipe runs where its
    tiles fill the SMs poorly: against float64 on odd shapes, the same on every rank, and replayed from a CUDA graph
    bitwise against eager."""
    for seed, shape in enumerate(ODD_SHAPES[1:], start=900):
        what = f"{backend} sequential {'x'.join(map(str, shape))}"
        heartbeat(what)
        a, b = rank_operands(shape, BF16, seed, dist.get_rank())
        out = fn(a, b, out_dtype=BF16, form="sequential")
        torch.cuda.synchronize()
        check(out, reference(shape, BF16, seed), what)
        check_same_on_every_rank(out, what)
    inputs = [rank_operands(STRESS_SHAPES[0], BF16, seed, dist.get_rank()) for seed in (950, 951)]
    check_graph_replays(f"{backend} sequential", fn, inputs, [0, 1], out_dtype=BF16, form="sequential")


def worker(backend: str) -> None:
    module = importlib.import_module(MODULES[backend])  # the recipe or twin: its launch
    public = getattr(importlib.import_module(PACKAGES[backend]), "gemm_one_shot_all_reduce")
    sequential_form(backend, public)
    fn = functools.partial(public, form="fused")  # the fused kernel, at every shape
    correctness(backend, module, fn)
    stress_and_cuda_graph(backend, module, fn)
    bad_input(backend, module, fn)


@pytest.mark.parametrize("backend", list(MODULES))
def test_gemm_one_shot_all_reduce(backend):
    run_on_gpus(worker, backend, name=f"gemm_all_reduce {backend}")


# ---------------------------------------------------------------------------
# Every form, forced
# ---------------------------------------------------------------------------

SHOTS = ("one", "push", "two")
# (shape, (in, out dtype), config): tails in M, N and K with operands smaller than one tile; tails and three rounds
# of tiles on five blocks; a 4-way k split (two-shot at 8 ranks: 2 rows per rank's slice of a block's 16); more
# tiles than SMs with tails (at one rank one-shot takes a block per tile, two-shot stays persistent: ``plan``).
FORM_CASES = (((37, 100, 72), (FP16, FP32), {}), ((129, 257, 136), (BF16, BF16), {"max_blocks": 5}),
              ((64, 1024, 4096), (BF16, BF16), {}), ((1100, 4200, 200), (BF16, BF16), {}))


def forms_worker(backend: str) -> None:
    module = importlib.import_module(MODULES[backend])
    fn = importlib.import_module(PACKAGES[backend]).gemm_one_shot_all_reduce
    rank = dist.get_rank()
    for shot in SHOTS:
        for seed, (shape, (in_dtype, out_dtype), extra) in enumerate(FORM_CASES, start=500):
            config = {"shot": shot, **extra}
            what = f"{backend} {shot} {'x'.join(map(str, shape))} {in_dtype} -> {out_dtype} {extra}"
            heartbeat(what)
            assert module.plan(*shape, dist.get_world_size(), config, 132)["shot"] == shot
            a, b = rank_operands(shape, in_dtype, seed, rank)
            out = torch.full(shape[:2], POISON, dtype=out_dtype, device="cuda")
            launch_into(module, a, b, out_dtype, out, config)
            public = fn(a, b, out_dtype=out_dtype, **config)
            torch.cuda.synchronize()
            assert torch.equal(public, out), f"{what}: the public call and launch() disagree"
            check(out, reference(shape, in_dtype, seed), what)
            check_same_on_every_rank(out, what)

    # The forms back to back on one workspace (their epoch counts advance by one or two barrier rounds a launch),
    # alternating two shapes: every result against float64 after each 30 launches.
    cases = [(shot, case) for case in FORM_CASES[1:] for shot in SHOTS]
    inputs = [rank_operands(shape, in_dtype, 600 + i, rank) for i, (_, (shape, (in_dtype, _), _)) in enumerate(cases)]
    refs = [reference(shape, in_dtype, 600 + i) for i, (_, (shape, (in_dtype, _), _)) in enumerate(cases)]
    outs = [torch.full(shape[:2], POISON, dtype=out_dtype, device="cuda") for _, (shape, (_, out_dtype), _) in cases]
    for i in range(60):
        k = i % len(cases)
        shot, (shape, (_, out_dtype), extra) = cases[k]
        launch_into(module, *inputs[k], out_dtype, outs[k], {"shot": shot, **extra})
        if i % 30 == 29:
            heartbeat(f"{backend} forms launch {i + 1}")
            torch.cuda.synchronize()
            for j, (shot_j, (shape_j, _, _)) in enumerate(cases):
                check(outs[j], refs[j], f"{backend} {shot_j} after {i + 1} launches ({shape_j})")
                outs[j].fill_(POISON)

    # CUDA-graph replays of each form, bitwise against eager.
    shape, (in_dtype, out_dtype), extra = FORM_CASES[1]
    graph_inputs = [rank_operands(shape, in_dtype, 700 + s, rank) for s in range(3)]
    for shot in SHOTS:
        check_graph_replays(f"{backend} {shot}", fn, graph_inputs, range(3), out_dtype=out_dtype, shot=shot, **extra)


@pytest.mark.parametrize("backend", list(MODULES))
def test_gemm_all_reduce_forms(backend):
    run_on_gpus(forms_worker, backend, name=f"gemm_all_reduce forms {backend}")
