"""GEMM + reduce-scatter without a GPU: both kernels compile for sm_90 and match, plans fit the signal
pad and shared memory, and bad input is refused on the host before anything needs CUDA or torch.distributed."""

from __future__ import annotations

import importlib
import inspect
import re

import pytest
import torch

from benchmark import registry, sm90
from benchmark.ops import gemm_reduce_scatter as op_module
from kraken._gemm_core import flattens
from kraken.runtime import groups

RECIPE = "kraken.fused.gemm_reduce_scatter"
TWIN = "helion_ports.fused.gemm_reduce_scatter"
recipe = importlib.import_module(RECIPE)
twin = importlib.import_module(TWIN)

OP = registry.get("gemm_reduce_scatter")
SHARED_MEMORY_BYTES = 232448  # what an H100/H200 SM offers one block (227 KiB)


def compile_stats(module, world_size: int, shape=None, out_dtype=torch.bfloat16, rank: int | None = None) -> dict:
    with sm90.capture_launches() as launches:
        op_module.example(module, world_size, shape=shape, out_dtype=out_dtype, rank=rank)
    (launch,) = launches
    return {**sm90.kernel_stats(launch), "flatten": launch.kwargs.get("FLATTEN", False)}


# One compile per world size of the registry's odd example (band rows 37, N = 200, K = 72: every tail), a group
# of one on large tiles (no sender: the same kernel with empty peer loops), the two large tile classes at 2 ranks
# (128x128 and 128x256 on 8 warps) and bands of 1024 rows at 8 ranks (128x128).
CASES = [(1, None, torch.bfloat16), (1, (2048, 14336, 4096), torch.bfloat16), (2, None, torch.bfloat16),
         (4, None, torch.float32), (8, None, torch.bfloat16),
         (2, (2048, 14336, 4096), torch.bfloat16), (2, (8192, 14336, 4096), torch.bfloat16),
         (8, (8192, 14336, 4096), torch.float32)]


@pytest.mark.parametrize("world_size,shape,out_dtype", CASES,
                         ids=[f"ws{w}-{'x'.join(map(str, s)) if s else 'odd'}-{str(d)[6:]}" for w, s, d in CASES])
def test_both_kernels_compile_for_sm90_and_match(world_size, shape, out_dtype):
    t = compile_stats(recipe, world_size, shape, out_dtype)
    h = compile_stats(twin, world_size, shape, out_dtype)
    for stats in (t, h):
        assert re.search(r"\.target\s+sm_90", stats["ptx"]), f"{stats['kernel']}: not compiled for sm_90"
        assert stats["spill_bytes"] == 0, f"{stats['kernel']} spills {stats['spill_bytes']} bytes"
        assert "wgmma.mma_async" in stats["ptx"], f"{stats['kernel']}: tl.dot did not become wgmma"
        assert stats["shared_bytes"] <= SHARED_MEMORY_BYTES
    # One epoch barrier round per launch (a release store to each peer's slot, an acquire spin on ours; a group of one
    # sends relaxed: it wrote nothing before); no CAS barrier and none at the end (symm.BlockWorkspace).
    send = "st.global.relaxed.sys" if world_size == 1 else "st.global.release.sys"
    epoch_ops = {f"{send}.u32": 1, "ld.global.acquire.sys.u32": 1}
    assert dict(sm90.barrier_opcodes(t["ptx"])) == epoch_ops
    assert sm90.barrier_opcodes(h["ptx"]) == sm90.barrier_opcodes(t["ptx"])
    # The twin generates the same GEMMs: the same pipeline buffers, wgmma and TMA loads (two GEMM loops each). On
    # 128x256 tiles with 2-byte partials the recipe flattens its band's tile loop (``kraken._gemm_core.flattens``):
    # the flattened loop's buffers beside its epilogue's and, with peers, its first tile (the barrier after it)
    # before the loop: a third GEMM. A group of one splits its barrier around its band and flattens all of it: two
    # GEMMs.
    t_planned = recipe.plan(*(shape or op_module.example_shape(world_size)), world_size, {}, sm90.H200_NUM_SMS)
    assert t["flatten"] == flattens(t_planned["block_m"], t_planned["block_n"], out_dtype.itemsize)
    assert (h["shared_bytes"] < t["shared_bytes"]) if t["flatten"] else (h["shared_bytes"] == t["shared_bytes"])
    if world_size == 1:  # the send before the first GEMM, the wait after the last, in both kernels
        for ptx in (t["ptx"], h["ptx"]):
            assert ptx.index(send) < ptx.index("wgmma.mma_async")
            assert ptx.rindex("ld.global.acquire.sys") > ptx.rindex("wgmma.mma_async")
    elif t["flatten"]:  # with peers, phase 1's GEMMs come first
        assert t["ptx"].index(send) > t["ptx"].index("wgmma.mma_async")
    for instruction in ("wgmma.mma_async", "cp.async.bulk.tensor"):
        if t["flatten"] and world_size > 1:
            assert t["ptx"].count(instruction) > h["ptx"].count(instruction) > 0, instruction
        else:
            assert h["ptx"].count(instruction) == t["ptx"].count(instruction) > 0, instruction


def parameters(fn) -> list:
    """``fn``'s parameters, their kinds and defaults, but ``launcher``'s default (Triton's launch in a recipe, None in
    a twin)."""
    return [(p.name, p.kind, p.default if p.name != "launcher" else None)
            for p in inspect.signature(fn).parameters.values()]


PLAN_SHAPES = [(1, 8, 16), (37 * 8, 200, 72), (256, 8192, 4096), (1024, 6656, 2560), (8192, 14336, 4096),
               (65536, 16384, 1024)]
PLAN_CONFIGS = [{}, {"max_blocks": 7}, {"block_m": 64, "block_n": 64, "group_m": 2}, {"num_stages": 2}]


def test_twin_plans_as_the_recipe_with_its_signatures():
    """The twin's plan, rounds and chunk tile are copies of the recipe's: equal on every input here (several world
    sizes, configs, SM counts and signal pads); its ``launch`` and plain host function take the recipe's arguments."""
    for world_size in (1, 2, 3, 8):
        for m, n, k in PLAN_SHAPES:
            m = max(m - m % world_size, world_size)
            for config in PLAN_CONFIGS:
                for sms, pad in ((132, None), (100_000, 256)):
                    cfg = recipe.plan(m, n, k, world_size, config, sms, pad)
                    assert twin.plan(m, n, k, world_size, config, sms, pad) == cfg
                    assert twin.rounds_of(m, n, world_size, cfg) == recipe.rounds_of(m, n, world_size, cfg)
                    assert twin.chunk_tile(cfg, world_size) == recipe.chunk_tile(cfg, world_size)
    assert twin.DEFAULT_CONFIG == recipe.DEFAULT_CONFIG
    assert parameters(twin.launch) == parameters(recipe.launch)
    assert parameters(twin.gemm_reduce_scatter) == parameters(recipe.gemm_reduce_scatter)
    import helion_ports
    import kraken
    from kraken.runtime import gemm_reduce_scatter as product, twins

    assert kraken.gemm_reduce_scatter is product.gemm_reduce_scatter
    assert helion_ports.gemm_reduce_scatter is twins.gemm_reduce_scatter
    assert parameters(kraken.gemm_reduce_scatter) == parameters(recipe.gemm_reduce_scatter)


def test_op_registration():
    # triton_fused / triton_seq: the recipe's two forms forced (``kraken.runtime.crossover``)
    assert list(OP.backends) == ["nccl", "torch_fused", "matmul", "triton", "helion", "triton_fused", "triton_seq"]
    assert OP.reference_free == frozenset({"matmul"})  # timed, not compared: it computes every rank's partial
    assert OP.default_shapes == [(1024, 6656, 2560), (2048, 14336, 4096), (8192, 14336, 4096), (256, 8192, 4096),
                                 (512, 8192, 4096)]
    # The floor is the matmul alone: 2 M N K flops at 790 TFLOP/s (or a and b read at HBM speed).
    assert OP.floor_us((8192, 14336, 4096), torch.bfloat16, 2) == pytest.approx(2 * 8192 * 14336 * 4096 / 790e6)
    for world_size in (1, 2, 3, 8):
        m, _, _ = op_module.example_shape(world_size)
        assert m % world_size == 0 and (m // world_size) % 64 != 0


# ---------------------------------------------------------------------------
# Plans
# ---------------------------------------------------------------------------


def stage_bytes(cfg: dict) -> int:
    return cfg["num_stages"] * (cfg["block_m"] + cfg["block_n"]) * cfg["block_k"] * 2


@pytest.mark.parametrize("world_size", range(1, 9))
def test_plan_fits_the_signal_pad_and_shared_memory(world_size):
    shapes = OP.default_shapes + [(8, 8, 16), (37 * 8, 200, 72), (65536, 16384, 1024)]
    for m, n, k in shapes:
        m -= m % world_size
        for config in ({}, {"max_blocks": 100_000}, {"block_m": 16, "block_n": 16}):
            for sms in (sm90.H200_NUM_SMS, 100_000):  # an absurd SM count: the pad must bind
                cfg = recipe.plan(m, n, k, world_size, config, sms)
                groups.check_barrier_blocks(cfg["num_blocks"], world_size, "test")
                band_tiles = groups.cdiv(m // world_size, cfg["block_m"]) * groups.cdiv(n, cfg["block_n"])
                assert 1 <= cfg["num_blocks"] <= min(sms, band_tiles, groups.max_barrier_blocks(world_size))
                assert recipe.rounds_of(m, n, world_size, cfg) == groups.cdiv(band_tiles, cfg["num_blocks"])
                assert stage_bytes(cfg) <= 200 * 1024, (m, n, k, cfg)  # + the epilogue's layout conversion
        assert recipe.chunk_tile(recipe.plan(m, n, k, world_size, {}, 132), world_size)[0] == max(world_size - 1, 1)


def test_plan_with_a_small_signal_pad():
    # 64 slots: 8 block ids at world size 8
    assert recipe.plan(8192, 8192, 8192, 8, {}, sm90.H200_NUM_SMS, pad_bytes=256)["num_blocks"] == 8


def test_default_config_per_band_size():
    """Bands up to 256 rows take the all-reduce recipe's skinny tiles on one warpgroup; above, its 128x256 tiles
    on two, or 128x128 where those fill the waves of 132 blocks 5% better (bands of 1024 rows and N = 14336:
    97% against 85%). The grid is balanced (``balanced_grid``): 896 tiles take 7 rounds on 128 blocks, 1792 take
    14."""
    tiles = {shape: (c["block_m"], c["block_n"], c["num_warps"], c["num_blocks"])
             for shape in OP.default_shapes for c in [recipe.plan(*shape, 2, {}, 132)]}
    assert tiles == {(1024, 6656, 2560): (128, 256, 8, 104), (2048, 14336, 4096): (128, 128, 8, 128),
                     (8192, 14336, 4096): (128, 256, 8, 128), (256, 8192, 4096): (128, 64, 4, 128),
                     (512, 8192, 4096): (128, 128, 4, 128)}
    # Per band, so 8 ranks of 8192 rows (bands of 1024) take the 128x128 tiles too.
    assert recipe.plan(8192, 14336, 4096, 8, {}, 132)["block_n"] == 128
    cfg = recipe.plan(8192, 14336, 4096, 2, {"block_n": 128, "num_stages": 4, "group_m": 4}, 132)
    assert (cfg["block_n"], cfg["num_stages"], cfg["group_m"]) == (128, 4, 4)


def test_plan_refuses_bad_config():
    with pytest.raises(TypeError, match="unknown config keys"):
        recipe.plan(64, 64, 64, 2, {"blockm": 64}, 132)
    with pytest.raises(ValueError, match="block_k must be a power of two >= 16"):
        recipe.plan(64, 64, 64, 2, {"block_k": 48}, 132)
    with pytest.raises(ValueError, match="group_m must be >= 1"):
        recipe.plan(64, 64, 64, 2, {"group_m": 0}, 132)


# Input validation on the host: test_gemm_all_reduce_cpu.test_bad_input_is_refused_on_the_host covers this
# recipe and its twin too (the two GEMM recipes share ``check_inputs``).
