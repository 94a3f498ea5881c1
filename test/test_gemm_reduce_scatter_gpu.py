"""GPU tests of GEMM + reduce-scatter and its Helion twin (one process per GPU).

One spawn per backend runs every check: float64 reference on odd and default-class
shapes, bf16/fp16 in, bf16/fp32 out, into a NaN-poisoned output; 200 back-to-back
launches alternating shapes; CUDA-graph replays equal to eager, bitwise; and bad
input (ranks disagreeing on shapes, M not divisible by the world size) raising on
every rank.
"""

from __future__ import annotations

import functools
import importlib

import pytest
import torch
import torch.distributed as dist

from benchmark.ops.gemm_all_reduce import rank_operands
from gpu_utils import POISON, check_graph_replays, heartbeat, needs_gpus, rel_err, run_on_gpus
from kraken.runtime import crossover

OP = "gemm_reduce_scatter"

pytestmark = needs_gpus

MODULES = {
    "triton": "kraken.fused.gemm_reduce_scatter",
    "helion": "helion_ports.fused.gemm_reduce_scatter",
}
PACKAGES = {"triton": "kraken", "helion": "helion_ports"}  # where the installed functions are
PRODUCT = importlib.import_module("kraken.runtime.gemm_reduce_scatter")  # the prepared calls the installed recipe and twin share
BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32
# (rows per band, N, K): M is the band times the world size. Odd shapes (every tail masked; K and N not
# multiples of 16: the unaligned class; a band of one row; bands that end inside a tile).
ODD_SHAPES = ((1, 8, 16), (37, 100, 72), (129, 257, 136), (500, 3000, 520))
ODD_ALL_DTYPES = ((37, 100, 72),)  # also in every dtype pair (each is a Helion compile: few, for time)
# Default-class shapes (each tile config of ``default_config``, several rounds per block, short K).
CLASS_SHAPES = ((128, 8192, 512), (256, 4096, 1024), (512, 6656, 640), (2048, 4096, 256))
# The stress test alternates one round of skinny tiles with several rounds of 128x256 tiles.
STRESS_SHAPES = ((64, 1024, 2048), (2048, 4096, 128))
ALL_DTYPE_PAIRS = ((BF16, BF16), (BF16, FP32), (FP16, BF16), (FP16, FP32))
# ||out - ref|| / ||ref|| against float64. bf16 out: the bf16 partials and the final rounding. fp32 out:
# fp32 accumulation over K in the tensor cores.
TOLERANCE = {BF16: 1e-2, FP32: 1e-4}


def full_shape(band_shape) -> tuple[int, int, int]:
    band, n, k = band_shape
    return (band * dist.get_world_size(), n, k)


def reference(shape, dtype, seed: int) -> torch.Tensor:
    """This rank's band of sum over ranks of a_r @ b_r in float64, every rank's operands rebuilt from their seeds."""
    total = None
    for r in range(dist.get_world_size()):
        a, b = rank_operands(shape, dtype, seed, r)
        product = a.double() @ b.double()
        total = product if total is None else total + product
    return total.chunk(dist.get_world_size())[dist.get_rank()]


def check(out: torch.Tensor, ref: torch.Tensor, what: str) -> None:
    assert out.shape == ref.shape, f"{what}: shape {tuple(out.shape)} != {tuple(ref.shape)}"
    assert not torch.isnan(out).any(), f"{what}: NaN in the output (an element was never written?)"
    err = rel_err(out, ref)
    assert err <= TOLERANCE[out.dtype], f"{what}: relative error {err:.2e} > {TOLERANCE[out.dtype]:.0e}"


def launch_into(module, a, b, out_dtype, out: torch.Tensor) -> torch.Tensor:
    """The public call's own prepare/launch, but into a caller-owned (poisoned) output."""
    ctx, cfg = PRODUCT.prepare(a, b, None, out_dtype, "test", {})
    return module.launch(a, b, ctx.peers, out, ctx.signal_pad_ptrs, ctx.rank, **cfg, group_name=ctx.group_name)


def correctness(backend: str, module, fn) -> None:
    rank, seed = dist.get_rank(), 0
    cases = [(s, (BF16, BF16)) for s in ODD_SHAPES + CLASS_SHAPES]
    cases += [(s, d) for s in ODD_ALL_DTYPES for d in ALL_DTYPE_PAIRS[1:]]
    cases += [(CLASS_SHAPES[-1], (FP16, FP32))]
    for band_shape, (in_dtype, out_dtype) in cases:
        seed += 1
        shape = full_shape(band_shape)
        what = f"{backend} {'x'.join(map(str, shape))} {in_dtype} -> {out_dtype}"
        heartbeat(what)
        a, b = rank_operands(shape, in_dtype, seed, rank)
        out = torch.full((band_shape[0], shape[1]), POISON, dtype=out_dtype, device="cuda")
        launch_into(module, a, b, out_dtype, out)
        public = fn(a, b, out_dtype=out_dtype)
        torch.cuda.synchronize()
        assert torch.equal(public, out), f"{what}: the public call and launch() disagree"
        check(out, reference(shape, in_dtype, seed), what)


def stress_and_cuda_graph(backend: str, module, fn) -> None:
    """200 back-to-back launches on rotating inputs and alternating shapes (a workspace overwritten while a
    peer still reads it shows up here), then CUDA-graph capture and 20 replays against eager, bitwise."""
    rank, out_dtype = dist.get_rank(), BF16
    shapes = [full_shape(STRESS_SHAPES[s % 2]) for s in range(10)]
    inputs = [rank_operands(shape, BF16, 100 + s, rank) for s, shape in enumerate(shapes)]
    refs = [reference(shape, BF16, 100 + s) for s, shape in enumerate(shapes)]
    outs = [torch.full(ref.shape, POISON, dtype=out_dtype, device="cuda") for ref in refs]
    for i in range(200):
        a, b = inputs[i % 10]
        launch_into(module, a, b, out_dtype, outs[i % 10])
        if i % 50 == 49:
            heartbeat(f"{backend} launch {i + 1}")
            torch.cuda.synchronize()
            for k in range(10):
                check(outs[k], refs[k], f"{backend} after {i + 1} launches (slot {k}, {shapes[k]})")
                outs[k].fill_(POISON)

    check_graph_replays(backend, fn, inputs, range(0, 10, 2), out_dtype=out_dtype)  # one shape


def bad_input(backend: str, module, fn) -> None:
    rank, world_size = dist.get_rank(), dist.get_world_size()
    if world_size > 1:  # a group of one cannot disagree, and any M splits over it
        # Ranks disagreeing on M (fresh shapes, so this is the first use): every rank raises, nothing hangs,
        # whether or not a rank's own M would split evenly.
        a, b = rank_operands((4 * world_size + rank, 48, 32), BF16, 7, rank)
        with pytest.raises(ValueError, match="ranks disagree"):
            fn(a, b)
        # Same M and N, different K.
        a, b = rank_operands((4 * world_size, 48, 32 + 16 * rank), BF16, 7, rank)
        with pytest.raises(ValueError, match="ranks disagree"):
            fn(a, b)
        # M not divisible by the world size, the same on every rank: every rank raises before any launch.
        a, b = rank_operands((4 * world_size + 1, 48, 32), BF16, 7, rank)
        with pytest.raises(ValueError, match="do not split evenly"):
            fn(a, b)
    a, b = rank_operands((4 * world_size, 48, 32), BF16, 7, rank)
    with pytest.raises(TypeError, match="unknown config"):
        fn(a, b, bogus=1)
    with pytest.raises(ValueError, match="inner dimensions differ"):
        fn(a, b.t().contiguous())
    # The group still works after all that.
    out = fn(a, b)
    torch.cuda.synchronize()
    check(out, reference((4 * world_size, 48, 32), BF16, 7), f"{backend} after bad input")
    heartbeat(f"{backend} bad input done")


def sequential_form(backend: str, fn) -> None:
    """The sequential form (``crossover``: cuBLAS, then the SM reduce-scatter), what the recipe runs below
    its crossover at more than one rank: against float64 on odd shapes, and replayed from a CUDA graph bitwise
    against eager."""
    world_size = dist.get_world_size()
    for seed, band_shape in enumerate(ODD_SHAPES[1:], start=900):
        shape = full_shape(band_shape)
        what = f"{backend} sequential {'x'.join(map(str, shape))}"
        heartbeat(what)
        a, b = rank_operands(shape, BF16, seed, dist.get_rank())
        out = fn(a, b, out_dtype=BF16, form="sequential")
        torch.cuda.synchronize()
        check(out, reference(shape, BF16, seed), what)
        if world_size > 1 and shape[0] < crossover.fused_from(OP, world_size):
            assert torch.equal(fn(a, b, out_dtype=BF16), out), f"{what}: the form chosen by size is not sequential"
    shape = full_shape(STRESS_SHAPES[0])
    inputs = [rank_operands(shape, BF16, seed, dist.get_rank()) for seed in (950, 951)]
    check_graph_replays(f"{backend} sequential", fn, inputs, [0, 1], out_dtype=BF16, form="sequential")


def worker(backend: str) -> None:
    module = importlib.import_module(MODULES[backend])  # the recipe or twin: its launch
    public = getattr(importlib.import_module(PACKAGES[backend]), "gemm_reduce_scatter")
    sequential_form(backend, public)
    fn = functools.partial(public, form="fused")  # the fused kernel, at every size
    correctness(backend, module, fn)
    stress_and_cuda_graph(backend, module, fn)
    bad_input(backend, module, fn)


@pytest.mark.parametrize("backend", list(MODULES))
def test_gemm_reduce_scatter(backend):
    run_on_gpus(worker, backend, name=f"gemm_reduce_scatter {backend}")
