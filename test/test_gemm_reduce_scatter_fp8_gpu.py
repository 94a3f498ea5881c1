"""GPU tests of the fp8 GEMM + reduce-scatter and its Helion twin (one process per GPU).

One spawn per backend runs every check: float64 reference from the dequantised inputs (every rank's a and b
times its own scales, summed) on odd and default-class shapes, row/column and per-tensor scales, b column-major
(read in place) and row-major, bf16 and fp32 out, into a NaN-poisoned output; agreement with NCCL's
reduce-scatter of ``torch._scaled_mm``; 200 back-to-back launches alternating shapes and scale layouts;
CUDA-graph replays equal to eager, bitwise; bad input (scale dtypes and shapes included) raising on every rank.
"""

from __future__ import annotations

import functools
import importlib

import pytest
import torch
import torch.distributed as dist

from benchmark.ops.all_gather_matmul_fp8 import dequantized
from benchmark.ops.gemm_reduce_scatter_fp8 import operands
from gpu_utils import POISON, check_graph_replays, heartbeat, needs_gpus, rel_err, run_on_gpus
from kraken.runtime import crossover

pytestmark = needs_gpus

MODULES = {
    "triton": "kraken.fused.gemm_reduce_scatter_fp8",
    "helion": "helion_ports.fused.gemm_reduce_scatter_fp8",
}
PACKAGES = {"triton": "kraken", "helion": "helion_ports"}  # where the installed functions are
PRODUCT = importlib.import_module("kraken.runtime.gemm_reduce_scatter_fp8")  # the prepared calls the installed recipe and twin share
BF16, FP32 = torch.bfloat16, torch.float32
# (rows per band, N, K): M is the band times the world size. Odd shapes (every tail masked; K not a multiple of
# 16: a padded for TMA; a band of one row; bands that end inside a tile).
ODD_SHAPES = ((1, 8, 16), (37, 100, 72), (129, 257, 136), (500, 3000, 520))
# Default-class shapes (each tile config of the plan, several rounds per block, short K).
CLASS_SHAPES = ((128, 8192, 512), (256, 4096, 1024), (512, 6656, 640), (2048, 4096, 256))
STRESS_SHAPES = ((64, 1024, 2048), (2048, 4096, 128))
# ||out - ref|| / ||ref|| against float64: bf16 out (bf16 partials, then the final rounding); fp32 out: Triton's
# fp8 dot on sm_90 accumulates in the tensor cores' own (reduced-precision) fp32 accumulator over the whole k loop
# (``max_num_imprecise_acc`` 2**30, like ``_scaled_mm``'s use_fast_accum=True), not bit-exact fp32 adds.
TOLERANCE = {BF16: 1e-2, FP32: 5e-3}


def full_shape(band_shape) -> tuple[int, int, int]:
    band, n, k = band_shape
    return (band * dist.get_world_size(), n, k)


def reference(shape, seed: int, per_tensor: bool = False) -> torch.Tensor:
    """This rank's band of sum over ranks of (a_r * scale_a_r) @ (b_r * scale_b_r) in float64."""
    total = None
    for r in range(dist.get_world_size()):
        a, b, sa, sb = operands(shape, seed, r, per_tensor=per_tensor)
        product = dequantized(a, sa) @ dequantized(b, sb)
        total = product if total is None else total + product
    return total.chunk(dist.get_world_size())[dist.get_rank()]


def check(out: torch.Tensor, ref: torch.Tensor, what: str, tolerance: float | None = None) -> None:
    assert out.shape == ref.shape, f"{what}: shape {tuple(out.shape)} != {tuple(ref.shape)}"
    assert not torch.isnan(out).any(), f"{what}: NaN in the output (an element was never written?)"
    err = rel_err(out, ref)
    tolerance = TOLERANCE[out.dtype] if tolerance is None else tolerance
    assert err <= tolerance, f"{what}: relative error {err:.2e} > {tolerance:.0e}"


def launch_into(module, a, b, scale_a, scale_b, out_dtype, out: torch.Tensor, **config) -> torch.Tensor:
    """The public call's own prepare/launch, but into a caller-owned (poisoned) output."""
    ctx, cfg = PRODUCT.prepare(a, b, scale_a, scale_b, None, out_dtype, "test", config)
    return module.launch(a, b, scale_a, scale_b, ctx.peers, out, ctx.signal_pad_ptrs, ctx.rank, **cfg,
                         group_name=ctx.group_name)


def correctness(backend: str, module, fn) -> None:
    rank, seed = dist.get_rank(), 0
    # (band shape, per-tensor scales, b row-major, out dtype)
    cases = [(s, False, False, BF16) for s in ODD_SHAPES + CLASS_SHAPES]
    cases += [(ODD_SHAPES[1], True, False, BF16), (CLASS_SHAPES[1], True, False, BF16),
              (ODD_SHAPES[2], False, True, BF16), (CLASS_SHAPES[0], False, True, FP32),
              (ODD_SHAPES[1], False, False, FP32), (CLASS_SHAPES[-1], True, False, FP32)]
    for band_shape, per_tensor, row_major, out_dtype in cases:
        seed += 1
        shape = full_shape(band_shape)
        what = (f"{backend} {'x'.join(map(str, shape))} {'per-tensor' if per_tensor else 'row/column'} "
                f"b {'row-major' if row_major else 'column-major'} -> {out_dtype}")
        heartbeat(what)
        a, b, sa, sb = operands(shape, seed, rank, per_tensor=per_tensor)
        b = b.contiguous() if row_major else b
        out = torch.full((band_shape[0], shape[1]), POISON, dtype=out_dtype, device="cuda")
        launch_into(module, a, b, sa, sb, out_dtype, out)
        public = fn(a, b, sa, sb, out_dtype=out_dtype)
        torch.cuda.synchronize()
        assert torch.equal(public, out), f"{what}: the public call and launch() disagree"
        check(out, reference(shape, seed, per_tensor), what)
        if not row_major and all(d % 16 == 0 for d in shape):  # what torch._scaled_mm takes
            # What the NCCL baseline computes: cuBLASLt's fp8 GEMM (bf16 out), then a bf16 reduce-scatter.
            band = torch.empty(band_shape[0], shape[1], dtype=BF16, device="cuda")
            dist.reduce_scatter_tensor(band, torch._scaled_mm(a, b, sa, sb, out_dtype=BF16))
            check(out, band.double(), f"{what} against _scaled_mm + reduce_scatter", 1e-2)


def stress_and_cuda_graph(backend: str, module, fn) -> None:
    """200 back-to-back launches on rotating inputs, alternating shapes and scale layouts (a workspace
    overwritten while a peer still reads it shows up here), then CUDA-graph capture and 20 replays against
    eager, bitwise."""
    rank = dist.get_rank()
    shapes = [full_shape(STRESS_SHAPES[s % 2]) for s in range(10)]
    per_tensor = [s % 4 == 3 for s in range(10)]
    inputs = [operands(shape, 100 + s, rank, per_tensor=per_tensor[s]) for s, shape in enumerate(shapes)]
    refs = [reference(shape, 100 + s, per_tensor[s]) for s, shape in enumerate(shapes)]
    outs = [torch.full(ref.shape, POISON, dtype=BF16, device="cuda") for ref in refs]
    for i in range(200):
        launch_into(module, *inputs[i % 10], BF16, outs[i % 10])
        if i % 50 == 49:
            heartbeat(f"{backend} launch {i + 1}")
            torch.cuda.synchronize()
            for k in range(10):
                check(outs[k], refs[k], f"{backend} after {i + 1} launches (slot {k}, {shapes[k]})")
                outs[k].fill_(POISON)

    check_graph_replays(backend, fn, inputs, range(0, 10, 2))  # one shape, row/column scales


def bad_input(backend: str, module, fn) -> None:
    rank, world_size = dist.get_rank(), dist.get_world_size()
    if world_size > 1:  # a group of one cannot disagree, and any M splits over it
        # Ranks disagreeing on M (fresh shapes, so this is the first use): every rank raises, nothing hangs.
        a, b, sa, sb = operands((4 * world_size + rank, 48, 32), 7, rank)
        with pytest.raises(ValueError, match="ranks disagree"):
            fn(a, b, sa, sb)
        # M not divisible by the world size, the same on every rank.
        a, b, sa, sb = operands((4 * world_size + 1, 48, 32), 7, rank)
        with pytest.raises(ValueError, match="do not split evenly"):
            fn(a, b, sa, sb)
    shape = (4 * world_size, 48, 32)
    a, b, sa, sb = operands(shape, 7, rank)
    with pytest.raises(TypeError, match="unknown config"):
        fn(a, b, sa, sb, bogus=1)
    # The same bad scale on every rank, then one rank's alone: every rank raises.
    with pytest.raises(ValueError, match=r"scale_b must have one element \(per tensor\) or shape \(1, 48\)"):
        fn(a, b, sa, sb.t().contiguous())
    with pytest.raises(ValueError, match=f"bad input on rank {world_size - 1}: scale_b must be float32"):
        fn(a, b, sa, sb if rank != world_size - 1 else sb.half())
    with pytest.raises(ValueError, match="bad input on rank 0: scale_a must have one element"):
        fn(a, b, sa if rank else sa[:3], sb)
    with pytest.raises(ValueError, match="bad input on rank 0: b must be a 2-D float8_e4m3fn tensor"):
        fn(a, b if rank else b.to(BF16), sa, sb)
    # The group still works after all that.
    out = fn(a, b, sa, sb)
    torch.cuda.synchronize()
    check(out, reference(shape, 7), f"{backend} after bad input")
    heartbeat(f"{backend} bad input done")


def sequential_form(backend: str, fn) -> None:
    """The sequential form (``kraken.crossover``: ``torch._scaled_mm`` with row-wise scales, then the SM
    reduce-scatter), what the recipe runs below its crossover at more than one rank: against float64 on shapes
    ``_scaled_mm`` takes (K and N multiples of 16), per-tensor and row/column scales, and replayed from a CUDA graph
    bitwise against eager."""
    world_size = dist.get_world_size()
    for seed, (band_shape, per_tensor) in enumerate([((1, 16, 32), False), ((37, 112, 80), True),
                                                      ((129, 272, 144), False)], start=900):
        shape = full_shape(band_shape)
        what = f"{backend} sequential {'x'.join(map(str, shape))} {'per-tensor' if per_tensor else 'row/column'}"
        heartbeat(what)
        a, b, sa, sb = operands(shape, seed, dist.get_rank(), per_tensor=per_tensor)
        out = fn(a, b, sa, sb, out_dtype=BF16, form="sequential")
        torch.cuda.synchronize()
        check(out, reference(shape, seed, per_tensor), what)
        if world_size > 1 and shape[0] < crossover.fused_from("gemm_reduce_scatter_fp8", world_size):
            assert torch.equal(fn(a, b, sa, sb, out_dtype=BF16), out), f"{what}: the form by size is not sequential"
    shape = full_shape(STRESS_SHAPES[0])
    inputs = [operands(shape, seed, dist.get_rank()) for seed in (950, 951)]
    check_graph_replays(f"{backend} sequential", fn, inputs, [0, 1], out_dtype=BF16, form="sequential")


def worker(backend: str) -> None:
    module = importlib.import_module(MODULES[backend])  # the recipe or twin: its launch
    public = getattr(importlib.import_module(PACKAGES[backend]), "gemm_reduce_scatter_fp8")
    sequential_form(backend, public)
    fn = functools.partial(public, form="fused")  # the fused kernel, at every size
    correctness(backend, module, fn)
    stress_and_cuda_graph(backend, module, fn)
    bad_input(backend, module, fn)


@pytest.mark.parametrize("backend", list(MODULES))
def test_gemm_reduce_scatter_fp8(backend):
    run_on_gpus(worker, backend, name=f"gemm_reduce_scatter_fp8 {backend}")
