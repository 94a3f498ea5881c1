"""GPU tests of the fp8 all-gather + matmul and its Helion twin (one process per GPU).

One spawn per backend runs every check: float64 reference from the dequantised inputs (every rank's fp8 rows
times their scales, b times its scales) on odd and default-class shapes (M the rows per rank here), row/column
and per-tensor scales (each rank its own per-tensor scale), b column-major (``w.t()``, read in place),
row-major and strided, into NaN-poisoned outputs; agreement with ``torch._scaled_mm`` on the NCCL-gathered
operands; 200 back-to-back launches alternating shapes and scale layouts; CUDA-graph replays equal to eager;
bad input (scale dtypes and shapes included) raising on every rank.
"""

from __future__ import annotations

import functools
import importlib

import pytest
import torch
import torch.distributed as dist

from benchmark.ops.all_gather_matmul_fp8 import FP8, dequantized, rank_operands
from gpu_utils import POISON, check_graph_replays, heartbeat, needs_gpus, rel_err, run_on_gpus
from kraken.runtime import crossover, gather_matmul

OP = "all_gather_matmul_fp8"

pytestmark = needs_gpus

MODULES = {  # the recipe and its twin (``launch``, the plain function)
    "triton": "kraken.fused.all_gather_matmul_fp8",
    "helion": "helion_ports.fused.all_gather_matmul_fp8",
}
PACKAGES = {"triton": "kraken", "helion": "helion_ports"}  # the installed functions
BF16 = torch.bfloat16
# bf16 output of an exact (dequantised) product: the tensor cores' fp32 accumulation (Triton's fp8 dot on sm_90
# uses their reduced-precision accumulator over the whole k loop, ``max_num_imprecise_acc`` 2**30), one bf16 rounding.
TOLERANCE = 1e-2
# (rows per rank, N, K). Odd: one row per rank; tails everywhere; K not a multiple of 16 (b padded, the gathered
# rows' scales at byte 80 / 144 / 528); a chunk end inside a tile. Classes: the 128x128 and 128x256 tiles.
ODD_SHAPES = ((1, 8, 16), (37, 100, 72), (129, 257, 136), (300, 1000, 520))
CLASS_SHAPES = ((128, 4096, 1024), (1024, 4096, 1024))
STRESS_SHAPES = ((64, 1024, 512), (300, 2048, 256))


def total(shape) -> tuple[int, int, int]:
    rows, n, k = shape
    return (rows * dist.get_world_size(), n, k)


def operands(shape, seed: int, per_tensor: bool = False):
    """This rank's fp8 rows and scale_a, the shared column-major b and scale_b (``shape``: rows per rank)."""
    return rank_operands(total(shape), seed, dist.get_rank(), dist.get_world_size(), per_tensor=per_tensor)


def reference(shape, seed: int, per_tensor: bool = False) -> torch.Tensor:
    """all_gather(a * scale_a) @ (b * scale_b) in float64, every rank's rows rebuilt from their seeds."""
    world_size = dist.get_world_size()
    parts = [rank_operands(total(shape), seed, r, world_size, per_tensor=per_tensor) for r in range(world_size)]
    rows = torch.cat([dequantized(a, sa) for a, _, sa, _ in parts])
    return rows @ dequantized(parts[0][1], parts[0][3])


def check(out: torch.Tensor, ref: torch.Tensor, what: str, tolerance: float = TOLERANCE) -> None:
    assert out.dtype == BF16, f"{what}: output dtype {out.dtype}"
    assert out.shape == ref.shape, f"{what}: shape {tuple(out.shape)} != {tuple(ref.shape)}"
    assert not torch.isnan(out).any(), f"{what}: NaN in the output (an element was never written?)"
    err = rel_err(out, ref)
    assert err <= tolerance, f"{what}: relative error {err:.2e} > {tolerance:.0e}"


def launch_into(module, a, b, scale_a, scale_b, out: torch.Tensor, **config) -> torch.Tensor:
    """The public call's own prepare and the recipe's (or twin's) launch, but into a caller-owned (poisoned) output."""
    ctx, cfg = gather_matmul.prepare_fp8(a, b, scale_a, scale_b, None, "test", config)
    return module.launch(a, b, scale_a, scale_b, signal_pad_ptrs=ctx.signal_pad_ptrs, rank=ctx.rank, out=out, **cfg,
                         group_name=ctx.group_name)


def layouts(b: torch.Tensor, which: str) -> torch.Tensor:
    """The same values of b (column-major as made) stored column-major, row-major or strided (every other column
    of a wider row-major one)."""
    if which == "row-major":
        return b.contiguous()
    if which == "strided":
        wide = torch.zeros(b.shape[0], 2 * b.shape[1], dtype=torch.uint8, device=b.device)
        wide[:, ::2] = b.view(torch.uint8)
        return wide.view(FP8)[:, ::2]
    return b


def correctness(backend: str, module, fn) -> None:
    world_size, seed = dist.get_world_size(), 0
    cases = [(s, False, "column-major", {}) for s in ODD_SHAPES + CLASS_SHAPES]
    cases += [(ODD_SHAPES[1], True, "column-major", {}), (CLASS_SHAPES[0], True, "column-major", {}),
              (ODD_SHAPES[2], False, "row-major", {}), (CLASS_SHAPES[0], False, "row-major", {}),
              (ODD_SHAPES[1], True, "strided", {}), (ODD_SHAPES[3], False, "row-major", {"b_layout": "nk"}),
              (CLASS_SHAPES[1], False, "column-major", {"block_n": 128, "num_stages": 4, "max_blocks": 40})]
    for shape, per_tensor, layout, config in cases:
        seed += 1
        what = f"{backend} {'x'.join(map(str, shape))} {'per-tensor' if per_tensor else 'row/column'} b {layout} {config}"
        heartbeat(what)
        a, b, scale_a, scale_b = operands(shape, seed, per_tensor)
        b = layouts(b, layout)
        out = torch.full((world_size * shape[0], shape[1]), POISON, dtype=BF16, device="cuda")
        launch_into(module, a, b, scale_a, scale_b, out, **config)
        public = fn(a, b, scale_a, scale_b, **config)
        torch.cuda.synchronize()
        check(out, reference(shape, seed, per_tensor), what)
        assert torch.equal(public, out), f"{what}: the public call and launch() disagree"
        if not per_tensor and layout == "column-major" and all(d % 16 == 0 for d in total(shape)):
            # The same operands through NCCL and cuBLASLt (both fp32 accumulation): what the baseline computes.
            rows = torch.empty(world_size * shape[0], shape[2], dtype=torch.uint8, device="cuda")
            dist.all_gather_into_tensor(rows, a.view(torch.uint8))
            scales = torch.empty(world_size * shape[0], 1, dtype=torch.float32, device="cuda")
            dist.all_gather_into_tensor(scales, scale_a)
            baseline = torch._scaled_mm(rows.view(FP8), b, scales, scale_b, out_dtype=BF16)
            check(out, baseline.double(), f"{what} against torch._scaled_mm")


def stress_and_cuda_graph(backend: str, module, fn) -> None:
    """200 back-to-back launches on rotating inputs, alternating shapes and scale layouts (a chunk overwritten while
    a peer still copies it, or a flag left over, shows up here), then CUDA-graph capture and 20 replays against
    eager, bitwise."""
    world_size = dist.get_world_size()
    shapes = [STRESS_SHAPES[s % 2] for s in range(6)]
    per_tensor = [s in (1, 3) for s in range(6)]  # the graph below replays the row/column slots 0, 2, 4
    inputs = [operands(shape, 100 + s, per_tensor[s]) for s, shape in enumerate(shapes)]
    refs = [reference(shape, 100 + s, per_tensor[s]) for s, shape in enumerate(shapes)]
    outs = [torch.full((world_size * shape[0], shape[1]), POISON, dtype=BF16, device="cuda") for shape in shapes]
    for i in range(200):
        launch_into(module, *inputs[i % 6], outs[i % 6])
        if i % 50 == 49:
            heartbeat(f"{backend} launch {i + 1}")
            torch.cuda.synchronize()
            for k in range(6):
                check(outs[k], refs[k], f"{backend} after {i + 1} launches (slot {k}, {shapes[k]})")
                outs[k].fill_(POISON)

    check_graph_replays(backend, fn, inputs, range(0, 6, 2))  # one shape, row/column scales


def bad_input(backend: str, module, fn) -> None:
    rank, world_size = dist.get_rank(), dist.get_world_size()
    if world_size > 1:  # a group of one cannot disagree
        # Ranks disagreeing on M (fresh shapes, so this is the first use): every rank raises, nothing hangs.
        a, b, sa, sb = rank_operands(((40 + rank) * world_size, 48, 32), 7, rank, world_size)
        with pytest.raises(ValueError, match="ranks disagree"):
            fn(a, b, sa, sb)
    a, b, sa, sb = operands((44, 48, 32), 7)
    with pytest.raises(TypeError, match="unknown config"):
        fn(a, b, sa, sb, bogus=1)
    # The same bad scale on every rank.
    with pytest.raises(ValueError, match=r"scale_a must have one element \(per tensor\) or shape \(44, 1\)"):
        fn(a, b, sa.view(1, 44), sb)
    with pytest.raises(ValueError, match="scale_b must be float32"):
        fn(a, b, sa, sb.bfloat16())
    # One rank alone passes a bad scale dtype, or a scale of the wrong shape: every rank raises.
    with pytest.raises(ValueError, match=f"bad input on rank {world_size - 1}: scale_a must be float32"):
        fn(a, b, sa if rank != world_size - 1 else sa.double(), sb)
    with pytest.raises(ValueError, match="bad input on rank 0: scale_b must have one element"):
        fn(a, b, sa, sb if rank else sb[:, :24])
    # One rank's a is bf16, not fp8.
    with pytest.raises(ValueError, match="bad input on rank 0: a must be a 2-D float8_e4m3fn tensor"):
        fn(a if rank else a.to(BF16), b, sa, sb)
    # The group still works after all that.
    out = fn(a, b, sa, sb)
    torch.cuda.synchronize()
    check(out, reference((44, 48, 32), 7), f"{backend} after bad input")
    heartbeat(f"{backend} bad input done")


def sequential_form(backend: str, fn) -> None:
    """The sequential form (``kraken.runtime.crossover``: SM all-gathers of the values and the row scales, then
    ``torch._scaled_mm``), what the recipe runs below its crossover at more than one rank: against float64 with
    per-row and per-tensor scales (each rank its own), and replayed from a CUDA graph bitwise against eager."""
    world_size = dist.get_world_size()
    for seed, (shape, per_tensor) in enumerate((((48, 96, 64), False), ((37, 160, 144), True)), start=900):
        what = f"{backend} sequential {'x'.join(map(str, shape))} per_tensor={per_tensor}"
        heartbeat(what)
        a, b, scale_a, scale_b = operands(shape, seed, per_tensor)
        out = fn(a, b, scale_a, scale_b, form="sequential")
        torch.cuda.synchronize()
        check(out, reference(shape, seed, per_tensor), what)
        if world_size > 1 and shape[0] * world_size < crossover.fused_from(OP, world_size):
            assert torch.equal(fn(a, b, scale_a, scale_b), out), f"{what}: the form chosen by size is not sequential"
    inputs = [operands((64, 256, 128), seed) for seed in (950, 951)]
    check_graph_replays(f"{backend} sequential", fn, inputs, [0, 1], form="sequential")


def plain_function(backend: str, module) -> None:
    """The recipe's (or twin's) plain host function against float64, row-wise and per-tensor scales."""
    for seed, (shape, per_tensor) in enumerate((((37, 100, 72), False), ((129, 257, 136), True)), start=700):
        what = f"{backend} plain {'x'.join(map(str, shape))} per_tensor={per_tensor}"
        heartbeat(what)
        a, b, scale_a, scale_b = operands(shape, seed, per_tensor)
        out = module.all_gather_matmul_fp8(a, b, scale_a, scale_b)
        torch.cuda.synchronize()
        check(out, reference(shape, seed, per_tensor), what)


def worker(backend: str) -> None:
    module = importlib.import_module(MODULES[backend])
    public = importlib.import_module(PACKAGES[backend]).all_gather_matmul_fp8
    plain_function(backend, module)
    sequential_form(backend, public)
    fn = functools.partial(public, form="fused")  # the fused kernel, at every size
    correctness(backend, module, fn)
    stress_and_cuda_graph(backend, module, fn)
    bad_input(backend, module, fn)


@pytest.mark.parametrize("backend", list(MODULES))
def test_all_gather_matmul_fp8(backend):
    run_on_gpus(worker, backend, name=f"all_gather_matmul_fp8 {backend}")
