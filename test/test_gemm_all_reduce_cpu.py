"""GEMM + one-shot all-reduce without a GPU: both kernels compile for sm_90 and match, plans fit the
signal pad, and bad input is refused on the host before anything needs CUDA or torch.distributed."""

from __future__ import annotations

import importlib
import os
import pathlib
import re
import subprocess
import sys

import pytest
import torch

from benchmark import sm90
from benchmark.ops import gemm_all_reduce
from kraken.runtime import groups

RECIPE = "kraken.fused.gemm_one_shot_all_reduce"
TWIN = "helion_ports.fused.gemm_one_shot_all_reduce"
recipe = importlib.import_module(RECIPE)
twin = importlib.import_module(TWIN)
ROOT = pathlib.Path(__file__).resolve().parent.parent

# One shape per class, with the output dtype each is most used with: small M (decode) with bf16 out,
# large M with fp32 out. The unaligned class is the registry's example, compiled by test_compile_cpu.
SHAPE_CLASSES = {"small_m": ((64, 4096, 4096), torch.bfloat16), "large_m": ((1024, 4096, 4096), torch.float32),
                 "small_n_split_k": ((64, 1024, 4096), torch.bfloat16)}


def compile_stats(module, shape, world_size: int, out_dtype, config=None) -> dict:
    with sm90.capture_launches() as launches:
        gemm_all_reduce.example(module, world_size, shape=shape, out_dtype=out_dtype, config=config)
    (launch,) = launches
    return sm90.kernel_stats(launch)


# (shape class, world size, config): each class by default at 1, 2, 4 and 8 ranks (small M: push at 1-2, pull at 4,
# two-shot at 8; large M: two-shot from 4), and every form forced where the default is another.
COMPILE_CASES = [(c, ws, {}) for c in SHAPE_CLASSES for ws in (1, 2, 4, 8)] + [
    ("small_m", 4, {"shot": "two"}), ("small_n_split_k", 4, {"shot": "two"}), ("small_n_split_k", 8, {"shot": "two"}),
    ("large_m", 8, {"shot": "one"}), ("small_m", 4, {"shot": "push"}), ("large_m", 2, {"shot": "two"}),
]


@pytest.mark.parametrize("shape_class,world_size,config", COMPILE_CASES,
                         ids=[f"{c}-{ws}-{cfg.get('shot', 'default')}" for c, ws, cfg in COMPILE_CASES])
def test_both_kernels_compile_for_sm90_and_match(shape_class, world_size, config):
    shape, out_dtype = SHAPE_CLASSES[shape_class]
    t = compile_stats(recipe, shape, world_size, out_dtype, config)
    h = compile_stats(twin, shape, world_size, out_dtype, config)
    for stats in (t, h):
        assert re.search(r"\.target\s+sm_90", stats["ptx"]), f"{stats['kernel']}: not compiled for sm_90"
        assert stats["spill_bytes"] == 0, f"{stats['kernel']} spills {stats['spill_bytes']} bytes"
        assert "wgmma.mma_async" in stats["ptx"], f"{stats['kernel']}: tl.dot did not become wgmma"
    # One epoch barrier round per launch (a release store to each peer's slot, an acquire spin on ours), two for
    # two-shot, plus the k-split group's CAS round over local pads; none at the end (symm.BlockWorkspace). A group
    # of one that keeps its last tile in registers splits its round around the block, the send relaxed.
    cfg = recipe.plan(*shape, world_size, config, sm90.H200_NUM_SMS)
    assert sm90.signal_rounds(t["ptx"]) == (1 if cfg["split_k"] > 1 else 0), dict(sm90.barrier_opcodes(t["ptx"]))
    rounds = 2 if cfg["shot"] == "two" else 1
    alone = world_size == 1 and recipe.keeps_last(cfg["split_k"], world_size, out_dtype, cfg["shot"])
    send = "st.global.relaxed.sys" if alone else "st.global.release.sys"
    epoch_ops = {f"{send}.u32": rounds, "ld.global.acquire.sys.u32": rounds}
    if alone:  # the send before the GEMM, its wait after it, in both kernels
        for ptx in (t["ptx"], h["ptx"]):
            assert ptx.index(send) < ptx.index("wgmma.mma_async") < ptx.rindex("ld.global.acquire.sys")
    assert {op: n for op, n in sm90.barrier_opcodes(t["ptx"]).items() if ".cas." not in op} == epoch_ops
    assert sm90.barrier_opcodes(h["ptx"]) == sm90.barrier_opcodes(t["ptx"])
    # The twin generates the same GEMM: the same pipeline buffers, wgmma and TMA loads, and about as much code.
    # It keeps more int32 index math live (20-40% more registers: free at one block per SM, no spills), and
    # computes each peer's reduce offsets from that peer's own strides (up to 1.4x the PTX at world size 8).
    assert h["shared_bytes"] == t["shared_bytes"]
    for instruction in ("wgmma.mma_async", "cp.async.bulk.tensor"):
        assert h["ptx"].count(instruction) == t["ptx"].count(instruction) > 0, instruction
    assert h["ptx_instructions"] <= 1.5 * t["ptx_instructions"], (h["ptx_instructions"], t["ptx_instructions"])


def parameters(fn) -> list:
    """``fn``'s parameters, their kinds and defaults, but ``launcher``'s default (Triton's launch in a recipe, None in
    a twin)."""
    import inspect

    return [(p.name, p.kind, p.default if p.name != "launcher" else None)
            for p in inspect.signature(fn).parameters.values()]


def test_twin_plans_as_the_recipe_with_its_signatures():
    """The twin's plan and its helpers are copies of the recipe's: equal on every input here (every form, world
    sizes 1 to 8, SM counts and signal pads); its ``launch`` and plain host function take the recipe's arguments."""
    configs = [{}, {"shot": "one"}, {"shot": "push"}, {"shot": "two"}, {"split_k": 2}, {"max_blocks": 9},
               {"block_m": 64, "block_n": 64, "reduce_m": 8}]
    for world_size in (1, 2, 3, 4, 8):
        for m, n, k in [(1, 8, 16), (37, 100, 72), (64, 1024, 4096), (256, 4096, 4096), (4096, 8192, 8192)]:
            for config in configs:
                for sms, pad in ((132, None), (100_000, 256)):
                    cfg = recipe.plan(m, n, k, world_size, config, sms, pad)
                    assert twin.plan(m, n, k, world_size, config, sms, pad) == cfg, (m, n, k, world_size, config)
                    assert twin.rounds_of(m, n, cfg) == recipe.rounds_of(m, n, cfg)
                    assert twin.chunk_tile(cfg, world_size) == recipe.chunk_tile(cfg, world_size)
                    for shot in recipe.SHOTS:
                        args = (cfg["split_k"], world_size, torch.bfloat16, shot)
                        assert twin.keeps_last(*args) == recipe.keeps_last(*args)
                        assert twin.shards_of(shot, world_size) == recipe.shards_of(shot, world_size)
    assert twin.DEFAULT_CONFIG == recipe.DEFAULT_CONFIG and twin.ONE_SHOT_UP_TO == recipe.ONE_SHOT_UP_TO
    assert parameters(twin.launch) == parameters(recipe.launch)
    assert parameters(twin.gemm_one_shot_all_reduce) == parameters(recipe.gemm_one_shot_all_reduce)
    import helion_ports
    import kraken
    from kraken.runtime import gemm_all_reduce, twins

    assert kraken.gemm_one_shot_all_reduce is gemm_all_reduce.gemm_one_shot_all_reduce
    assert helion_ports.gemm_one_shot_all_reduce is twins.gemm_one_shot_all_reduce
    assert parameters(kraken.gemm_one_shot_all_reduce) == parameters(recipe.gemm_one_shot_all_reduce)


def test_helion_prints_its_generated_triton():
    code = (
        "import importlib\n"
        "from benchmark.ops import gemm_all_reduce\n"
        "from benchmark import sm90\n"
        f"module = importlib.import_module({TWIN!r})\n"
        "with sm90.capture_launches():\n"
        "    gemm_all_reduce.example(module, 2)\n"
    )
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "HELION_PRINT_OUTPUT_CODE": "1", "PYTHONPATH": root}
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "def _helion_gemm_one_shot_all_reduce_body" in result.stdout + result.stderr


# ---------------------------------------------------------------------------
# Every address in bounds, every number right: the Triton interpreter
# ---------------------------------------------------------------------------

INTERPRETED = r'''
import importlib, math, sys
import numpy as np
import torch
import triton
import triton.language as tl
import triton.runtime.interpreter as interpreter

from benchmark.sm90 import fix_interpreter_scalars  # Triton 3.6's interpreter and numpy 2
fix_interpreter_scalars()

# Every load and store a launch makes must fall inside the storage of one of its tensor arguments (descriptors'
# bases included): on the GPU an address past them reads whatever is there, or faults.
storages, escapes = [], []
_init_args = interpreter.GridExecutor._init_args_hst
def _init_args_hst(self, args, kwargs):
    storages.clear()
    def walk(arg):
        if isinstance(arg, (tuple, list)):
            for item in arg:
                walk(item)
        elif hasattr(arg, "block_shape") and hasattr(arg, "base"):
            walk(arg.base)
        elif isinstance(arg, torch.Tensor):
            storage = arg.untyped_storage()
            storages.append((storage.data_ptr(), storage.data_ptr() + storage.nbytes()))
    walk(list(args) + list(kwargs.values()))
    return _init_args(self, args, kwargs)
interpreter.GridExecutor._init_args_hst = _init_args_hst

def checked(access, what):
    def run(self, ptrs, *rest, **kwargs):
        mask = rest[0] if what == "load" else rest[1]
        addresses = np.asarray(ptrs.data).astype(np.uint64)
        active = addresses[np.broadcast_to(np.asarray(mask.data), addresses.shape)]
        size = ptrs.get_element_ty().primitive_bitwidth // 8
        inside = np.zeros(active.shape, dtype=bool)
        for begin, end in storages:
            inside |= (active >= begin) & (active + size <= end)
        if not inside.all():
            escapes.append(f"{what} of {int((~inside).sum())} elements outside every argument")
        return access(self, ptrs, *rest, **kwargs)
    return run
Builder = interpreter.InterpreterBuilder
Builder.create_masked_load = checked(Builder.create_masked_load, "load")
Builder.create_masked_store = checked(Builder.create_masked_store, "store")

from benchmark import sm90
recipe = importlib.import_module("kraken.fused.gemm_one_shot_all_reduce")
twin = importlib.import_module("helion_ports.fused.gemm_one_shot_all_reduce")

@triton.jit
def no_epoch(signal_pad_ptrs, block_id, rank, world_size: tl.constexpr, epoch):
    pass  # the inline-PTX barriers cannot run here: every rank runs twice instead (below)

@triton.jit
def no_sync(signal_pad_ptrs, block_id, rank, world_size: tl.constexpr, hasPreviousMemAccess: tl.constexpr = False,
            hasSubsequentMemAccess: tl.constexpr = False):
    pass

recipe.epoch_sync, recipe.epoch_send, recipe.epoch_wait, recipe.symm_mem_sync = no_epoch, no_epoch, no_epoch, no_sync
twin.EPOCH_SYNC = twin.EPOCH_SEND = twin.EPOCH_WAIT = twin.SPLIT_SYNC = "tl.debug_barrier()"

def workspaces(chunk_bytes, dtype, tile, world_size):
    """Every rank's BlockWorkspace as ``symm.BlockWorkspace.context`` views it (132 chunks), NaN-poisoned."""
    size = 1 << max(16, math.ceil(math.log2(chunk_bytes)))
    tile_elems, chunk_elems = math.prod(tile), size // dtype.itemsize
    shape = (2, 132, chunk_elems // tile_elems, *tile)
    strides = (132 * chunk_elems, chunk_elems, tile_elems, *(math.prod(tile[i + 1:]) for i in range(len(tile))))
    return tuple(torch.full((2 * 132 * chunk_elems,), float("nan"), dtype=dtype).as_strided(shape, strides)
                 for _ in range(world_size))

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32
# (module, (M, N, K), world size, out dtype, config): every form, tails everywhere, M = 1, a and b smaller than
# one tile, k splits, two-shot at a world size that is no power of two (rank 0 owns two slices), every rank's
# launch (fp16 in: the interpreter's bf16 dot is wrong in Triton 3.6).
cases = [(module, shape, ws, out_dtype, config) for module in (recipe, twin) for shape, ws, out_dtype, config in [
    ((1, 8, 16), 1, BF16, {}), ((37, 100, 72), 1, FP32, {}), ((44, 48, 32), 2, BF16, {}),
    ((37, 100, 72), 2, FP32, {"shot": "one"}), ((37, 100, 512), 2, BF16, {"split_k": 2}),
    ((20, 48, 80), 3, FP32, {}), ((37, 100, 72), 1, BF16, {"shot": "two"}), ((1, 40, 48), 2, FP32, {"shot": "two"}),
    ((20, 48, 80), 3, FP32, {"shot": "two"}), ((37, 100, 512), 4, BF16, {"shot": "two", "split_k": 2}),
    ((44, 48, 32), 4, FP32, {"shot": "push"}), ((65, 40, 48), 8, BF16, {"shot": "two"}),
]]
for module, (m, n, k), world_size, out_dtype, config in cases:
    cfg = module.plan(m, n, k, world_size, config, 132)
    tile = module.chunk_tile(cfg, world_size)
    peers = workspaces(module.rounds_of(m, n, cfg) * math.prod(tile) * out_dtype.itemsize, out_dtype, tile, world_size)
    gen = torch.Generator().manual_seed(m + n + k)
    operands = [(torch.randn(m, k, generator=gen).half(), torch.randn(k, n, generator=gen).half())
                for _ in range(world_size)]
    ref = sum(a.double() @ b.double() for a, b in operands)
    outs = [torch.full((m, n), float("nan"), dtype=out_dtype) for _ in range(world_size)]
    scratch = [torch.full((132, 2, *tile[1:]) if cfg["split_k"] > 1 else (1,), float("nan")) for _ in range(world_size)]
    escapes.clear()
    # Pass 1 leaves every rank's partials where the barrier would have found them; the last pass (the same half of
    # the workspace) reads them all. A k split's group sums its scratch at its local barrier, and two-shot gathers
    # the owners' sums from their second barrier: each of those takes one more pass.
    for _ in range(2 + (cfg["split_k"] > 1) + (cfg["shot"] == "two")):
        for rank, (a, b) in enumerate(operands):
            parity, epochs = torch.zeros(132, dtype=torch.int32), torch.zeros(132, dtype=torch.int32)
            with sm90.capture_launches():  # Helion's host-built descriptors on the CPU
                module.launch(a, b, peers, outs[rank], sm90.FAKE_SIGNAL_PADS, rank, parity, epochs, scratch[rank],
                              sm90.FAKE_SIGNAL_PADS, **cfg)
    what = f"{module.__name__} {m}x{n}x{k} ws{world_size} {out_dtype} {config}"
    assert not escapes, f"{what}: {escapes[:3]}"
    for rank, out in enumerate(outs):
        assert not torch.isnan(out).any(), f"{what}: rank {rank}: an output element was never written"
        err = ((out.double() - ref).norm() / ref.norm()).item()
        assert err < (1e-2 if out_dtype == BF16 else 1e-5), f"{what}: rank {rank}: relative error {err:.2e}"
    print(what, "ok")
print("ok")
'''


def test_every_access_in_bounds_and_every_sum_right_in_the_triton_interpreter():
    """The recipe and its twin, every form, on every rank of worlds of 1 to 8, odd shapes (M = 1, operands smaller
    than one tile, k splits), against float64, with every load and store checked against its launch's tensors. The twin
    once loaded ``a`` through pointers past its last row when the tile was taller than ``a`` (the GPU test
    crashed at world size 1: an illegal memory access); ``boxed_operands`` pads such operands instead."""
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    result = subprocess.run([sys.executable, "-c", INTERPRETED], env=env, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0 and result.stdout.strip().endswith("ok"), result.stdout[-3000:] + result.stderr[-3000:]


# ---------------------------------------------------------------------------
# Plans
# ---------------------------------------------------------------------------


def well_formed(cfg: dict, m: int, n: int, k: int, world_size: int) -> bool:
    """Groups of ``split_k`` blocks, at least one tile each; the splits cover k in whole k steps (a forced
    split may leave the last ones empty: they add zeros); every block's slice of rows (two-shot: every rank's
    slice of them) is whole reduce steps."""
    tiles = groups.cdiv(m, cfg["block_m"]) * groups.cdiv(n, cfg["block_n"])
    split, per_split = cfg["split_k"], cfg["k_per_split"]
    shards = recipe.shards_of(cfg["shot"], world_size)
    return (
        1 <= cfg["num_groups"] <= tiles
        and cfg["num_blocks"] == cfg["num_groups"] * split
        and per_split % cfg["block_k"] == 0 and per_split * split >= k
        and cfg["block_m"] % (split * shards) == 0 and (cfg["block_m"] // split // shards) % cfg["reduce_m"] == 0
    )


@pytest.mark.parametrize("world_size", range(1, 9))
def test_plan_stays_inside_the_signal_pad(world_size):
    shapes = [(8192, 8192, 8192), (65536, 16384, 1024), (1, 8, 16), (100, 200, 72), (2048, 4096, 4096), (64, 1024, 4096)]
    for m, n, k in shapes:
        for config in ({}, {"max_blocks": 100_000}, {"block_m": 16, "block_n": 16, "split_k": 1}, {"split_k": 2},
                       *({"shot": shot} for shot in recipe.SHOTS), {"shot": "two", "block_m": 16, "block_n": 16}):
            cfg = recipe.plan(m, n, k, world_size, config, 100_000)  # an absurd SM count: the pad must bind
            assert 1 <= cfg["num_blocks"] <= groups.max_barrier_blocks(world_size), (m, n, k, config, cfg)
            groups.check_barrier_blocks(cfg["num_blocks"], world_size, "test")
            assert well_formed(cfg, m, n, k, world_size), (m, n, k, config, cfg)
            cfg = recipe.plan(m, n, k, world_size, config, sm90.H200_NUM_SMS)
            tiles = groups.cdiv(m, cfg["block_m"]) * groups.cdiv(n, cfg["block_n"])
            one_per_tile = world_size == 1 and cfg["split_k"] == 1 and "max_blocks" not in config
            most = tiles if one_per_tile and tiles <= groups.max_barrier_blocks(1) else sm90.H200_NUM_SMS
            assert cfg["num_blocks"] <= most and well_formed(cfg, m, n, k, world_size), (m, n, k, config, cfg)


def test_plan_with_a_small_signal_pad():
    # 64 slots: 8 block ids at world size 8
    cfg = recipe.plan(8192, 8192, 8192, 8, {}, sm90.H200_NUM_SMS, pad_bytes=256)
    assert cfg["num_blocks"] <= 8 and well_formed(cfg, 8192, 8192, 8192, 8)


def test_plan_splits_k_only_when_tiles_leave_sms_idle():
    # 64 tiles of 64x64 give SKINNY_FILL of the SMs a tile: no split, one block per tile.
    cfg = recipe.plan(64, 4096, 4096, 2, {}, 132)
    assert (cfg["block_m"], cfg["block_n"], cfg["split_k"], cfg["num_blocks"]) == (64, 64, 1, 64)
    # 16 tiles: a 4-way split, 8 k steps of 128 each; each block reduces 16 of the 64 rows.
    cfg = recipe.plan(64, 1024, 4096, 2, {}, 132)
    assert (cfg["split_k"], cfg["num_groups"], cfg["num_blocks"], cfg["k_per_split"]) == (4, 16, 64, 1024)
    assert cfg["reduce_m"] == 16
    # An explicit split_k still wins over the skinny default.
    assert recipe.plan(64, 4096, 4096, 2, {"split_k": 2}, 132)["num_blocks"] == 128
    # 16 tiles, k = 1000 in 8 steps: 2 ways (4 would leave 2 steps a split, under MIN_K_TILES_PER_SPLIT).
    assert recipe.plan(37, 500, 1000, 2, {}, 132)["split_k"] == 2
    # Too short a k for any split.
    assert recipe.plan(37, 500, 256, 2, {}, 132)["split_k"] == 1
    # 256 tiles over 132 SMs: 132 groups, two rounds, no split.
    cfg = recipe.plan(2048, 4096, 4096, 2, {}, 132)
    assert (cfg["split_k"], cfg["num_groups"]) == (1, 132)


def test_one_rank_takes_one_block_per_tile():
    """At world size 1 with no k split no block waits for another: one block per tile (``ONE_RANK_TILE_PER_BLOCK``),
    so no tile goes through the workspace; a k split, ``max_blocks``, two-shot or two ranks keep the persistent grid."""
    cfg = recipe.plan(2048, 4096, 4096, 1, {}, 132)
    assert (cfg["split_k"], cfg["num_groups"], cfg["num_blocks"]) == (1, 256, 256)
    assert recipe.rounds_of(2048, 4096, cfg) == 1
    assert recipe.plan(8192, 4096, 4096, 1, {}, 132)["num_blocks"] == 1024
    assert recipe.plan(2048, 4096, 4096, 2, {}, 132)["num_blocks"] == 132
    assert recipe.plan(2048, 4096, 4096, 1, {"max_blocks": 132}, 132)["num_blocks"] == 132
    # Two-shot writes every tile to its block's chunk of the workspace (one per SM): persistent.
    assert recipe.plan(2048, 4096, 4096, 1, {"shot": "two"}, 132)["num_blocks"] == 132
    assert recipe.plan(2048, 4096, 4096, 1, {"shot": "push"}, 132)["num_blocks"] == 256
    assert recipe.plan(64, 1024, 4096, 1, {}, 132)["split_k"] > 1  # a k split: the persistent grid (<= 132)
    assert recipe.plan(64, 1024, 4096, 1, {}, 132)["num_blocks"] <= 132
    # More tiles than the pad has block ids: persistent.
    assert recipe.plan(65536, 16384, 1024, 1, {}, 132)["num_blocks"] <= 132


def test_default_config_per_shape_class():
    """The tuned picks on H200 (132 SMs): up to 256 rows the narrowest one-warpgroup tile (64 wide below 128
    rows) that fits one wave, pushing partials; above, the largest tile that keeps more than half the SMs busy,
    pulling them."""
    tiles = {shape: (c["block_m"], c["block_n"], c["num_warps"]) for shape in [
             (64, 4096, 4096), (128, 4096, 4096), (256, 4096, 4096), (512, 4096, 4096), (2048, 4096, 4096),
             (128, 8192, 8192), (512, 5120, 5120), (16, 65536, 4096)] for c in [recipe.default_config(*shape, 132, 2)]}
    assert tiles == {(64, 4096, 4096): (64, 64, 4), (128, 4096, 4096): (128, 32, 4), (256, 4096, 4096): (128, 64, 4),
                     (512, 4096, 4096): (128, 128, 8), (2048, 4096, 4096): (128, 256, 8), (128, 8192, 8192): (128, 64, 4),
                     (512, 5120, 5120): (128, 256, 8), (16, 65536, 4096): (64, 256, 4)}
    shots = {(shape, ws): recipe.plan(*shape, ws, {}, 132)["shot"] for shape in [(64, 4096, 4096), (256, 4096, 4096),
             (512, 4096, 4096)] for ws in (2, 4)}
    assert shots == {((64, 4096, 4096), 2): "push", ((256, 4096, 4096), 2): "push", ((512, 4096, 4096), 2): "one",
                     ((64, 4096, 4096), 4): "one", ((256, 4096, 4096), 4): "two", ((512, 4096, 4096), 4): "two"}
    # Pulling, 64-row tiles are 32 wide again (128 blocks, as before pushing).
    assert recipe.default_config(64, 4096, 4096, 132, 4)["block_n"] == 32
    # The pipeline fits shared memory: 5 stages of 64x128 + 128x64 bf16 (128-deep k steps); the 128x64 tiles step 64
    # deep (``SKINNY_WIDE``), 8 stages of 128x64 + 64x64, and 128x128 ones 6 of 128x64 + 64x128.
    assert recipe.default_config(64, 4096, 4096, 132, 2)["num_stages"] == 5
    assert recipe.default_config(64, 4096, 4096, 132, 2)["block_k"] == 128
    assert [recipe.default_config(256, 4096, 4096, 132, 2)[key] for key in ("block_k", "num_stages")] == [64, 8]
    assert [recipe.default_config(256, 8192, 8192, 132, 1)[key] for key in ("block_n", "block_k", "num_stages")] == [
        128, 64, 6]
    cfg = recipe.plan(2048, 4096, 4096, 2, {"block_n": 128, "num_stages": 3}, 132)
    assert (cfg["block_m"], cfg["block_n"], cfg["num_stages"]) == (128, 128, 3)


def test_plan_refuses_bad_config():
    with pytest.raises(TypeError, match="unknown config keys"):
        recipe.plan(64, 64, 64, 2, {"blockm": 64}, 132)
    with pytest.raises(ValueError, match="block_k must be a power of two >= 16"):
        recipe.plan(64, 64, 64, 2, {"block_k": 48}, 132)
    with pytest.raises(ValueError, match="reduce_m must be a power of two <= block_m / split_k = 64, got 128"):
        recipe.plan(64, 64, 64, 2, {"block_m": 64, "reduce_m": 128}, 132)
    with pytest.raises(ValueError, match="split_k must be a power of two"):
        recipe.plan(64, 64, 64, 2, {"split_k": 3}, 132)
    with pytest.raises(ValueError, match="shot must be one of 'one', 'push', 'two'"):
        recipe.plan(64, 64, 64, 2, {"shot": "2"}, 132)
    # Two-shot cuts each block's rows into a slice per rank (8 at 5-8 ranks): 16 rows split 4 ways do not cut 8 ways.
    with pytest.raises(ValueError, match=r"split_k must be a power of two <= min\(8, block_m / 8 \(two-shot slices\)"):
        recipe.plan(64, 4096, 4096, 8, {"shot": "two", "block_m": 16, "split_k": 4}, 132)
    with pytest.raises(ValueError, match=r"reduce_m must be a power of two <= block_m / split_k / 4 \(two-shot slices\) = 16"):
        recipe.plan(64, 4096, 4096, 4, {"shot": "two", "reduce_m": 32}, 132)


def test_plan_picks_the_form_by_output_size_and_world_size(monkeypatch):
    """One-shot up to the recipe's ONE_SHOT_UP_TO entry (M x N output elements), two-shot above, at 4-8
    ranks (3 takes 4's entry); at 1-2 ranks always one-shot (two-shot reads as much there), pushing up to
    SKINNY_M rows. ``shot`` forces any form at any world size; the tiles follow the form (pushing: 64 wide)."""
    from kraken.runtime import crossover

    def shot(m, n, ws, config=None):
        return recipe.plan(m, n, 4096, ws, config or {}, 132)["shot"]

    assert [shot(m, 4096, 1) for m in (1, 256, 512, 65536)] == ["push", "push", "one", "one"]
    assert [shot(m, 4096, 2) for m in (1, 256, 512, 65536)] == ["push", "push", "one", "one"]
    up_to = {ws: crossover.one_shot_up_to(recipe.OP, ws) for ws in (3, 4, 8)}
    for ws in (3, 4, 5, 8):
        limit = up_to[4] if ws <= 4 else up_to[8]
        assert shot(limit // 4096, 4096, ws) == "one" and shot(limit // 4096 * 2, 4096, ws) == "two", ws
        assert shot(1, limit, ws) == "one" and shot(1, limit + 1, ws) == "two", ws  # elements, not rows
    # At 8 ranks one-shot lost to matmul + NCCL from M = 128 at N = 4096: two-shot there, and at 4 from M = 128.
    assert shot(128, 4096, 8) == shot(128, 4096, 4) == "two" and shot(64, 4096, 4) == "one"
    for ws in (1, 2, 4, 8):
        for form in recipe.SHOTS:
            assert shot(64, 4096, ws, {"shot": form}) == form
    assert recipe.plan(64, 4096, 4096, 4, {"shot": "push"}, 132)["block_n"] == 64
    assert recipe.plan(64, 4096, 4096, 4, {"shot": "two"}, 132)["block_n"] == 32
    # The choice reads the recipe's table, which is kraken.runtime.crossover's gemm_all_reduce row.
    assert recipe.ONE_SHOT_UP_TO == crossover.ONE_SHOT_UP_TO["gemm_all_reduce"]
    monkeypatch.setattr(recipe, "ONE_SHOT_UP_TO", {1: 0, 2: 0, 4: 0, 8: 0})
    assert shot(1, 16, 1) == shot(1, 16, 8) == "two"


def test_two_shot_slices_and_k_split():
    """Two-shot: SHARDS is the world size rounded up to a power of two (a world of 3 has 4 slices, rank 0 owns
    two), the default k split leaves every rank's slice at least one row, and each slice is whole reduce steps."""
    assert [recipe.shards_of("two", ws) for ws in range(1, 9)] == [1, 2, 4, 4, 8, 8, 8, 8]
    assert [recipe.shards_of(form, 8) for form in ("one", "push")] == [1, 1]
    cfg = recipe.plan(64, 1024, 4096, 8, {"shot": "two"}, 132)  # 64-row tiles, 16 of them: a 4-way split
    assert cfg["block_m"] // cfg["split_k"] // 8 >= 1 and cfg["reduce_m"] == cfg["block_m"] // cfg["split_k"] // 8
    cfg = recipe.plan(64, 1024, 4096, 8, {"shot": "two", "block_m": 16}, 132)
    assert cfg["split_k"] <= 2
    # Two barrier rounds, no last partial kept in registers.
    assert recipe.keeps_last(1, 1, torch.bfloat16, "two") == 0 and recipe.keeps_last(1, 1, torch.bfloat16, "push") == 1


# ---------------------------------------------------------------------------
# Input validation: CPU tensors, no process group; every error is raised before either is needed
# ---------------------------------------------------------------------------

BF16 = torch.bfloat16


GEMM_ENTRY_POINTS = [("kraken", "gemm_one_shot_all_reduce"), ("helion_ports", "gemm_one_shot_all_reduce"),
                     ("kraken", "gemm_reduce_scatter"), ("helion_ports", "gemm_reduce_scatter")]


@pytest.mark.parametrize("path,name", GEMM_ENTRY_POINTS, ids=[f"{p}.{n}" for p, n in GEMM_ENTRY_POINTS])
def test_bad_input_is_refused_on_the_host(path, name):
    """Both installed fused GEMM recipes and their twins share ``check_inputs``: every error on the host."""
    fn = getattr(importlib.import_module(path), name)
    a, b = torch.zeros(8, 16, dtype=BF16), torch.zeros(16, 32, dtype=BF16)
    with pytest.raises(ValueError, match=r"inner dimensions differ: a is \(8, 16\), b is \(32, 8\)"):
        fn(a, torch.zeros(32, 8, dtype=BF16))
    with pytest.raises(ValueError, match="a has dtype float32; supported: bfloat16, float16"):
        fn(a.float(), b.float())
    with pytest.raises(ValueError, match="a has dtype int32"):
        fn(a.int(), b.int())
    with pytest.raises(ValueError, match="a and b must have the same dtype"):
        fn(a, b.half())
    with pytest.raises(ValueError, match="a must be contiguous"):
        fn(torch.zeros(16, 8, dtype=BF16).t(), b)
    with pytest.raises(ValueError, match="out_dtype torch.float16 is not supported; supported: bfloat16, float32"):
        fn(a, b, out_dtype=torch.float16)
    with pytest.raises(ValueError, match="a must be 2-D"):
        fn(torch.zeros(16, dtype=BF16), b)
    with pytest.raises(TypeError, match="a must be a torch.Tensor"):
        fn([[1.0]], b)
    with pytest.raises(ValueError, match="the output would be empty"):
        fn(torch.zeros(0, 16, dtype=BF16), b)
    # Past every shape/dtype check, the first thing that needs more is the device.
    with pytest.raises(ValueError, match="a must be on a CUDA device"):
        fn(a, b)


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_every_forced_form_backend_calls_its_function_with_the_recipes_form(monkeypatch, world_size):
    """The benchmark's forced-form backends (``triton_1shot`` ... ``helion_2shot``) call the recipe or the twin
    with the form the recipe would pick for one-shot at M rows (the twin has no chooser of its own), or two-shot;
    ``triton_seq`` forces the sequential form (``kraken.runtime.crossover``)."""
    recipe = importlib.import_module("kraken.fused.gemm_one_shot_all_reduce")
    monkeypatch.setattr(gemm_all_reduce.dist, "get_world_size", lambda group=None: world_size)
    monkeypatch.setattr(gemm_all_reduce.dist, "get_rank", lambda group=None: 0)
    monkeypatch.setattr(gemm_all_reduce, "rank_operands", lambda shape, dtype, seed, rank: (
        torch.zeros(shape[0], shape[2], dtype=dtype), torch.zeros(shape[2], shape[1], dtype=dtype)))
    monkeypatch.setattr(gemm_all_reduce, "symm_empty", lambda shape, dtype: torch.zeros(shape, dtype=dtype))
    monkeypatch.setattr(gemm_all_reduce, "_symm_buffers", {})
    inputs = gemm_all_reduce.make_inputs((64, 32, 16), torch.bfloat16, 0)  # works out the form, once
    monkeypatch.setattr(gemm_all_reduce.dist, "get_world_size", lambda group=None: pytest.fail("asked per call"))
    for package in ("kraken", "helion_ports"):
        module = importlib.import_module(package)  # the installed function (``benchmark.registry.public``)
        calls = []
        monkeypatch.setattr(module, "gemm_one_shot_all_reduce", lambda a, b, **kw: calls.append(kw))
        for shot in ("1shot", "2shot", "seq", None):
            gemm_all_reduce.fused(package, shot)(inputs)
        assert [c.get("shot") for c in calls] == [recipe.one_shot_form(64, world_size), "two", None, None], package
        assert [c.get("form") for c in calls] == [None, None, "sequential", None], package


def test_tma_operands_pad_rows_to_whole_tiles():
    """``tma_operands(a, b, block_m)``: up to ``SKINNY_M`` rows, ``a``'s rows zero-padded to a multiple of
    ``block_m`` (a box past the last row is slow), ``b`` untouched when aligned; without ``block_m``, aligned
    operands come back as they are."""
    from kraken._gemm_core import tma_operands

    a, b = torch.randn(37, 64, dtype=torch.bfloat16), torch.randn(64, 48, dtype=torch.bfloat16)
    same_a, same_b = tma_operands(a, b)
    assert same_a is a and same_b is b
    padded, same_b = tma_operands(a, b, 64)
    assert same_b is b and padded.shape == (64, 64)
    assert torch.equal(padded[:37], a) and not padded[37:].any()
    assert tma_operands(a[:32], b, 32)[0].data_ptr() == a.data_ptr()  # whole tiles already: no copy
    big = torch.randn(300, 64, dtype=torch.bfloat16)  # above SKINNY_M rows: the partial tile stays, no copy
    assert tma_operands(big, b, 128)[0] is big
    # K not 16-byte aligned (k = 60): both padded in k, a's rows to the tile as well.
    a60, b60 = torch.randn(37, 60, dtype=torch.bfloat16), torch.randn(60, 48, dtype=torch.bfloat16)
    pa, pb = tma_operands(a60, b60, 128)
    assert pa.shape == (128, 64) and pb.shape == (64, 48)
    assert torch.equal(pa[:37, :60], a60) and not pa[37:].any() and not pa[:, 60:].any()
    assert torch.equal(pb[:60], b60) and not pb[60:].any()
