"""FP8 GEMM + reduce-scatter without a GPU: both kernels compile for sm_90 to fp8 wgmma and match, plans fit the
signal pad and shared memory, bad input (scale shapes and dtypes included) is refused on the host and on every
rank, and every rank's band agrees with a float64 reference in the Triton interpreter."""

from __future__ import annotations

import importlib
import inspect
import os
import pathlib
import re
import subprocess
import sys

import pytest
import torch

from benchmark import registry, sm90
from benchmark.ops import gemm_reduce_scatter_fp8 as op_module
from fake_world import FakeWorld
from kraken.runtime import groups

RECIPE = "kraken.fused.gemm_reduce_scatter_fp8"
TWIN = "helion_ports.fused.gemm_reduce_scatter_fp8"
recipe = importlib.import_module(RECIPE)
twin = importlib.import_module(TWIN)
bf16_recipe = importlib.import_module("kraken.fused.gemm_reduce_scatter")
product = importlib.import_module("kraken.runtime.gemm_reduce_scatter_fp8")  # checks, prepared calls, forms
ROOT = pathlib.Path(__file__).resolve().parent.parent

OP = registry.get("gemm_reduce_scatter_fp8")
SHARED_MEMORY_BYTES = 232448  # what an H100/H200 SM offers one block (227 KiB)
FP8 = torch.float8_e4m3fn


def compile_stats(module, world_size: int, shape=None, out_dtype=torch.bfloat16, per_tensor=False) -> dict:
    with sm90.capture_launches() as launches:
        op_module.example(module, world_size, shape=shape, out_dtype=out_dtype, per_tensor=per_tensor)
    (launch,) = launches
    return sm90.kernel_stats(launch)


def fp8_wgmma(ptx: str) -> set[str]:
    return set(re.findall(r"wgmma\.mma_async\.sync\.aligned\.m64n\d+k32\.f32\.e4m3\.e4m3", ptx))


# The odd example at 1, 2, 4 and 8 ranks (and one default tile class at 1), per-tensor scales, fp32 out, and the default tile classes at 2 ranks
# (128x64 and 128x128 on one warpgroup, 128x128 and 128x256 on two) and bands of 1024 rows at 8 ranks.
CASES = [(1, None, torch.bfloat16, False), (1, (2048, 14336, 4096), torch.bfloat16, False),
         (2, None, torch.bfloat16, False), (4, None, torch.float32, True), (8, None, torch.bfloat16, False),
         (2, (256, 8192, 4096), torch.bfloat16, False), (2, (512, 8192, 4096), torch.bfloat16, True),
         (2, (2048, 14336, 4096), torch.bfloat16, False), (2, (8192, 14336, 4096), torch.bfloat16, False),
         (8, (8192, 14336, 4096), torch.float32, False)]


@pytest.mark.parametrize("world_size,shape,out_dtype,per_tensor", CASES,
                         ids=[f"ws{w}-{'x'.join(map(str, s)) if s else 'odd'}-{str(d)[6:]}{'-tensorwise' if p else ''}"
                              for w, s, d, p in CASES])
def test_both_kernels_compile_to_fp8_wgmma_and_match(world_size, shape, out_dtype, per_tensor):
    t = compile_stats(recipe, world_size, shape, out_dtype, per_tensor)
    h = compile_stats(twin, world_size, shape, out_dtype, per_tensor)
    for stats in (t, h):
        assert re.search(r"\.target\s+sm_90", stats["ptx"]), f"{stats['kernel']}: not compiled for sm_90"
        assert stats["spill_bytes"] == 0, f"{stats['kernel']} spills {stats['spill_bytes']} bytes"
        assert fp8_wgmma(stats["ptx"]), f"{stats['kernel']}: tl.dot did not become fp8 wgmma"
        assert stats["shared_bytes"] <= SHARED_MEMORY_BYTES
    # One epoch barrier round per launch, as the bf16 recipe (a group of one sends relaxed).
    epoch_ops = {"st.global.relaxed.sys.u32" if world_size == 1 else "st.global.release.sys.u32": 1,
                 "ld.global.acquire.sys.u32": 1}
    assert dict(sm90.barrier_opcodes(t["ptx"])) == epoch_ops
    assert sm90.barrier_opcodes(h["ptx"]) == sm90.barrier_opcodes(t["ptx"])
    assert h["shared_bytes"] == t["shared_bytes"]
    assert fp8_wgmma(h["ptx"]) == fp8_wgmma(t["ptx"])
    for instruction in ("wgmma.mma_async", "cp.async.bulk.tensor"):
        assert h["ptx"].count(instruction) == t["ptx"].count(instruction) > 0, instruction


def parameters(fn) -> list:
    """``fn``'s parameters, their kinds and defaults, but ``launcher``'s default (Triton's launch in a recipe, None in
    a twin)."""
    return [(p.name, p.kind, p.default if p.name != "launcher" else None)
            for p in inspect.signature(fn).parameters.values()]


def test_twin_plans_as_the_recipe_with_its_signatures():
    """The twin's plan, rounds and chunk tile are copies of the recipe's (and its rounds and chunk tile the bf16
    recipe's): equal on every input here; its ``launch`` and plain host function take the recipe's arguments."""
    configs = [{}, {"max_blocks": 7}, {"block_m": 64, "block_n": 64, "block_k": 128, "group_m": 2},
               {"b_layout": "kn", "num_stages": 2}]
    for world_size in (1, 2, 3, 8):
        for m, n, k in [(1, 16, 32), (37 * 8, 200, 144), (256, 8192, 4096), (8192, 14336, 4096)]:
            m = max(m - m % world_size, world_size)
            for config in configs:
                for sms, pad in ((132, None), (100_000, 256)):
                    cfg = recipe.plan(m, n, k, world_size, config, sms, pad)
                    assert twin.plan(m, n, k, world_size, config, sms, pad) == cfg
                    rounds = recipe.rounds_of(m, n, world_size, cfg)
                    assert twin.rounds_of(m, n, world_size, cfg) == rounds == bf16_recipe.rounds_of(m, n, world_size,
                                                                                                   cfg)
                    assert twin.chunk_tile(cfg, world_size) == recipe.chunk_tile(cfg, world_size)
    assert twin.DEFAULT_CONFIG == recipe.DEFAULT_CONFIG
    assert parameters(twin.launch) == parameters(recipe.launch)
    assert parameters(twin.gemm_reduce_scatter_fp8) == parameters(recipe.gemm_reduce_scatter_fp8)
    import helion_ports
    import kraken
    from kraken.runtime import twins

    assert kraken.gemm_reduce_scatter_fp8 is product.gemm_reduce_scatter_fp8
    assert helion_ports.gemm_reduce_scatter_fp8 is twins.gemm_reduce_scatter_fp8
    assert parameters(kraken.gemm_reduce_scatter_fp8) == parameters(recipe.gemm_reduce_scatter_fp8)


def test_op_registration():
    assert list(OP.backends) == ["nccl", "torch_fused", "scaled_mm", "triton", "helion", "triton_fused", "triton_seq"]
    assert OP.reference_free == frozenset({"scaled_mm"})
    assert OP.floor_us((8192, 14336, 4096), torch.bfloat16, 2) == pytest.approx(2 * 8192 * 14336 * 4096 / 1580e6)
    for world_size in (2, 3, 8):
        m, _, k = op_module.example_shape(world_size)
        assert m % world_size == 0 and (m // world_size) % 64 != 0 and k % 16 != 0 and k >= 128


# ---------------------------------------------------------------------------
# Plans
# ---------------------------------------------------------------------------


def stage_bytes(cfg: dict) -> int:
    return cfg["num_stages"] * (cfg["block_m"] + cfg["block_n"]) * cfg["block_k"]  # one byte per fp8 value


@pytest.mark.parametrize("world_size", range(1, 9))
def test_plan_fits_the_signal_pad_and_shared_memory(world_size):
    shapes = OP.default_shapes + [(8, 8, 16), (37 * 8, 200, 136), (65536, 16384, 1024)]
    for m, n, k in shapes:
        m -= m % world_size
        for config in ({}, {"max_blocks": 100_000}, {"block_m": 16, "block_n": 16, "block_k": 32}):
            for sms in (sm90.H200_NUM_SMS, 100_000):
                cfg = recipe.plan(m, n, k, world_size, config, sms)
                groups.check_barrier_blocks(cfg["num_blocks"], world_size, "test")
                band_tiles = groups.cdiv(m // world_size, cfg["block_m"]) * groups.cdiv(n, cfg["block_n"])
                assert 1 <= cfg["num_blocks"] <= min(sms, band_tiles, groups.max_barrier_blocks(world_size))
                assert 32 <= cfg["block_k"] <= 128
                assert stage_bytes(cfg) <= 200 * 1024, (m, n, k, cfg)


def test_tiles_are_the_bf16_recipes_with_twice_the_k_step():
    for shape in OP.default_shapes:
        fp8, bf16 = recipe.plan(*shape, 2, {}, 132), bf16_recipe.plan(*shape, 2, {}, 132)
        assert fp8["block_k"] == min(2 * bf16["block_k"], 128)
        for key in ("block_m", "block_n", "group_m", "num_blocks"):
            assert fp8[key] == bf16[key], (shape, key)
        # The skinny tiles (one warpgroup in bf16) take two and 4 stages in fp8 (recipe.SKINNY_WARPS/STAGES).
        skinny = bf16["num_warps"] == 4
        assert fp8["num_warps"] == (recipe.SKINNY_WARPS if skinny else bf16["num_warps"]), shape
        assert fp8["num_stages"] == (recipe.SKINNY_STAGES if skinny else bf16["num_stages"]), shape
    assert recipe.plan(8192, 14336, 4096, 2, {"block_k": 64}, 132)["block_k"] == 64


def test_plan_refuses_bad_config():
    with pytest.raises(TypeError, match="unknown config keys"):
        recipe.plan(64, 64, 64, 2, {"blockm": 64}, 132)
    with pytest.raises(ValueError, match="block_k must be a power of two >= 32"):
        recipe.plan(64, 64, 64, 2, {"block_k": 48}, 132)
    with pytest.raises(ValueError, match="block_k must be <= 128"):
        recipe.plan(64, 64, 64, 2, {"block_k": 256}, 132)
    with pytest.raises(ValueError, match="group_m must be >= 1"):
        recipe.plan(64, 64, 64, 2, {"group_m": 0}, 132)
    with pytest.raises(ValueError, match="b_layout must be one of"):
        recipe.plan(64, 64, 64, 2, {"b_layout": "t"}, 132)


# ---------------------------------------------------------------------------
# Input validation
# ---------------------------------------------------------------------------


def fp8_inputs(m=8, n=32, k=16):
    return torch.zeros(m, k, dtype=FP8), torch.zeros(n, k, dtype=FP8).t(), torch.ones(m, 1), torch.ones(1, n)


@pytest.mark.parametrize("package", ["kraken", "helion_ports"])
def test_bad_input_is_refused_on_the_host(package):
    fn = importlib.import_module(package).gemm_reduce_scatter_fp8
    a, b, sa, sb = fp8_inputs()
    with pytest.raises(ValueError, match="out_dtype torch.float16 is not supported; supported: bfloat16, float32"):
        fn(a, b, sa, sb, out_dtype=torch.float16)
    with pytest.raises(ValueError, match=r"a must be a 2-D float8_e4m3fn tensor, got float32"):
        fn(a.float(), b, sa, sb)
    with pytest.raises(ValueError, match=r"inner dimensions differ"):
        fn(a, b.t(), sa, sb)
    with pytest.raises(ValueError, match="scale_a must be float32, got float64"):
        fn(a, b, sa.double(), sb)
    with pytest.raises(ValueError, match=r"scale_a must have one element \(per tensor\) or shape \(8, 1\), got \(4, 1\)"):
        fn(a, b, sa[:4], sb)
    with pytest.raises(ValueError, match=r"scale_b must have one element \(per tensor\) or shape \(1, 32\), got \(1, 16\)"):
        fn(a, b, sa, sb[:, :16])
    with pytest.raises(ValueError, match="a and b must be on the same CUDA device"):
        fn(a, b, torch.ones(1), torch.ones(()))


def test_bad_scale_raises_on_every_rank(monkeypatch):
    a, b, sa, sb = fp8_inputs()
    rank1 = ("ValueError", "scale_a must have one element (per tensor) or shape (8, 1), got (8,)")
    world = FakeWorld(monkeypatch, other=lambda mine: (mine[0], rank1))
    with pytest.raises(ValueError, match=r"bad input on rank 0: scale_b must be float32.*; rank 1: scale_a must have"):
        product.prepare.uncached(a, b, sa, sb.half(), None, torch.bfloat16, recipe.OP, {})
    assert world.exchanges == 1
    # Only rank 0 is wrong: the exchange still happens (so rank 1, whose checks passed, raises the same error).
    world = FakeWorld(monkeypatch, other=lambda mine: (mine[0], None))
    with pytest.raises(ValueError, match=r"bad input on rank 0: scale_b must have one element") as error:
        product.prepare.uncached(a, b, sa, sb.view(32, 1), None, torch.bfloat16, recipe.OP, {})
    assert "rank 1" not in str(error.value) and world.exchanges == 1


# ---------------------------------------------------------------------------
# The numbers, in the Triton interpreter
# ---------------------------------------------------------------------------

INTERPRETED = r'''
import importlib
import numpy as np
import torch
import triton
import triton.language as tl
import triton.runtime.interpreter as interpreter

from benchmark.sm90 import fix_interpreter_scalars  # Triton 3.6's interpreter and numpy 2
fix_interpreter_scalars()

m = importlib.import_module("kraken.fused.gemm_reduce_scatter_fp8")
twin = importlib.import_module("helion_ports.fused.gemm_reduce_scatter_fp8")
from benchmark import sm90
from benchmark.ops.all_gather_matmul_fp8 import dequantized
from benchmark.ops.gemm_reduce_scatter_fp8 import operands

@triton.jit
def no_barrier(signal_pad_ptrs, block_id, rank, world_size: tl.constexpr, epoch):
    pass  # the inline-PTX barrier cannot run here: every rank runs twice instead (below)

m.epoch_sync = m.epoch_send = m.epoch_wait = no_barrier
twin.EPOCH_SYNC = twin.EPOCH_SEND = twin.EPOCH_WAIT = "tl.debug_barrier()"

# (rows per band, N, K, world size, per-tensor scales, out dtype, config, module)
cases = [
    (37, 100, 72, 2, False, torch.bfloat16, {"block_m": 32, "block_n": 32, "block_k": 32}, m),
    (37, 100, 72, 3, True, torch.float32, {"block_m": 16, "block_n": 64, "block_k": 64, "max_blocks": 5}, m),
    (1, 40, 48, 2, False, torch.bfloat16, {"block_m": 16, "block_n": 16, "block_k": 32, "b_layout": "kn"}, m),
    (20, 48, 80, 4, False, torch.float32, {"block_m": 16, "block_n": 16, "block_k": 32, "group_m": 2, "max_blocks": 3}, m),
    (37, 100, 72, 2, False, torch.bfloat16, {"block_m": 32, "block_n": 32, "block_k": 32}, twin),
    (20, 48, 80, 3, True, torch.float32, {"block_m": 16, "block_n": 16, "block_k": 32, "max_blocks": 4}, twin),
    (1, 40, 48, 2, False, torch.bfloat16, {"block_m": 16, "block_n": 16, "block_k": 32, "b_layout": "kn"}, twin),
]
for band, n, k, world_size, per_tensor, out_dtype, config, module in cases:
    shape = (band * world_size, n, k)
    parts = [operands(shape, band + k, r, device="cpu", per_tensor=per_tensor) for r in range(world_size)]
    if config.get("b_layout") == "kn":
        parts = [(a, b.contiguous(), sa, sb) for a, b, sa, sb in parts]
    ref = sum(dequantized(a, sa) @ dequantized(b, sb) for a, b, sa, sb in parts)
    cfg = m.plan(*shape, world_size, config, 132)
    rounds, tile = m.rounds_of(*shape[:2], world_size, cfg), m.chunk_tile(cfg, world_size)
    peers = tuple(torch.full((2, 132, rounds, *tile), float("nan"), dtype=out_dtype) for _ in range(world_size))
    epochs = [torch.zeros(132, dtype=torch.int32) for _ in range(world_size)]
    outs = [torch.full((band, n), float("nan"), dtype=out_dtype) for _ in range(world_size)]
    # Pass 1 pushes every rank's partials (early ranks read slots not yet written); pass 2, on the same half of the
    # workspace, reads them all: every band is then complete.
    for _ in range(2):
        for rank, (a, b, sa, sb) in enumerate(parts):
            parity = torch.zeros(132, dtype=torch.int32)
            with sm90.capture_launches():  # Helion's host-built descriptors on the CPU
                module.launch(a, b, sa, sb, peers, outs[rank], sm90.FAKE_SIGNAL_PADS, rank, parity, epochs[rank],
                              **cfg)
            assert parity[:cfg["num_blocks"]].tolist() == [1] * cfg["num_blocks"]
    for rank in range(world_size):
        out = outs[rank]
        assert not torch.isnan(out).any(), "an output element was never written"
        expected = ref[rank * band:(rank + 1) * band]
        err = ((out.double() - expected).norm() / expected.norm()).item()
        # bf16: each partial rounded before the sum, then the sum; fp32: the accumulation order only.
        assert err < (1e-2 if out_dtype == torch.bfloat16 else 1e-6), (module.__name__, rank, err)
    assert epochs[0][:cfg["num_blocks"]].tolist() == [2] * cfg["num_blocks"]
    print(module.__name__, band, n, k, world_size, per_tensor, out_dtype, config, f"relative error {err:.2e}")
print("ok")
'''


def test_every_band_in_the_triton_interpreter():
    """Every rank's launch of the recipe on worlds of 2 to 4 (row-wise and per-tensor scales, each b layout, bf16
    and fp32 out, tails in the band, N and K, NaN-poisoned workspaces and outputs), and the twin's on two of those,
    against float64 on the dequantised inputs."""
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    result = subprocess.run([sys.executable, "-c", INTERPRETED], env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0 and result.stdout.strip().endswith("ok"), result.stdout + result.stderr
