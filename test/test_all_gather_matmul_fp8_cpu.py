"""FP8 all-gather + matmul without a GPU: both GEMMs compile for sm_90 to fp8 wgmma at 2, 4 and 8 ranks and
match (TMA, no spills, the same flag wait), the plan fits shared memory, bad input (scale shapes and dtypes
included) is refused on the host and, through ``agreement.agreed``, on every rank, and the kernels' numbers (the
gathered rows' scales, the epilogue) agree with a float64 reference in the Triton interpreter."""

from __future__ import annotations

import collections
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
from benchmark.ops import all_gather_matmul_fp8 as op
from fake_world import FakeWorld
from kraken._gemm_core import flattens
from kraken.runtime import gather_matmul, groups

RECIPE = "kraken.fused.all_gather_matmul_fp8"
TWIN = "helion_ports.fused.all_gather_matmul_fp8"
recipe = importlib.import_module(RECIPE)
twin = importlib.import_module(TWIN)
ROOT = pathlib.Path(__file__).resolve().parent.parent

H200_SHARED_BYTES = 232448  # 227 KiB per block
FP8 = torch.float8_e4m3fn
# (rows per rank, N, K): the 128x256 tiles (default shapes from M = 1024 on), the 128x128 tiles, the odd example.
SHAPES = {"large": (1024, 14336, 8192), "small": (128, 8192, 8192), "odd": op.EXAMPLE_SHAPE}


def compile_stats(module, world_size: int, shape, **config) -> dict:
    with sm90.capture_launches() as launches:
        op.example(module, world_size, shape=shape, **config)
    (launch,) = launches
    return sm90.kernel_stats(launch)


def fp8_wgmma(ptx: str) -> set[str]:
    return set(re.findall(r"wgmma\.mma_async\.sync\.aligned\.m64n\d+k32\.f32\.e4m3\.e4m3", ptx))


@pytest.mark.parametrize("world_size", [1, 2, 4, 8])
@pytest.mark.parametrize("shape_class", list(SHAPES))
def test_both_kernels_compile_to_fp8_wgmma_and_match(shape_class, world_size):
    shape = SHAPES[shape_class]
    cfg = recipe.plan(*shape, world_size, {}, sm90.H200_NUM_SMS)
    t = compile_stats(recipe, world_size, shape)
    h = compile_stats(twin, world_size, shape)
    for stats in (t, h):
        assert re.search(r"\.target\s+sm_90", stats["ptx"]), f"{stats['kernel']}: not compiled for sm_90"
        assert stats["spill_bytes"] == 0, f"{stats['kernel']} spills {stats['spill_bytes']} bytes"
        assert fp8_wgmma(stats["ptx"]), f"{stats['kernel']}: tl.dot did not become fp8 wgmma"
        # One flag wait per peer chunk: an acquire load at system scope, then the async-proxy fence before TMA.
        # A group of one has no peer chunk (its own rows come from a): no wait at all.
        waits = dict(sm90.barrier_opcodes(stats["ptx"]))
        assert waits == ({} if world_size == 1 else {"ld.global.acquire.sys.u32": 1}), waits
        assert ("fence.proxy.async.global" in stats["ptx"]) == (world_size > 1)
        assert stats["shared_bytes"] <= H200_SHARED_BYTES
    # Both walk the tiles in one loop per source of rows (a, then the gather buffer; the first alone in a group of
    # one), each with its own k loop, and the loops' pipelines share shared memory. On the 128x256 tiles the recipe's
    # first loop is flattened (``kraken._gemm_core.flattens``) and keeps more in flight; the twin asks Helion for the
    # same (``range_flattens``), which Triton leaves unfused on its deeper loop nest.
    if flattens(cfg["block_m"], cfg["block_n"]):
        assert t["shared_bytes"] >= h["shared_bytes"]
    else:
        assert h["shared_bytes"] == t["shared_bytes"]
    assert fp8_wgmma(h["ptx"]) == fp8_wgmma(t["ptx"])
    for instruction in ("wgmma.mma_async", "cp.async.bulk.tensor"):
        assert h["ptx"].count(instruction) == t["ptx"].count(instruction) > 0, instruction


def shared_traffic(ptx: str) -> collections.Counter:
    counts = collections.Counter(line.split()[0] for line in sm90.ptx_instructions(ptx))
    return collections.Counter({k: v for k, v in counts.items() if k.startswith(("st.shared", "prmt"))})


def test_tma_fp8_pads_odd_k_and_few_rows():
    """``tma_fp8(a, block_m)``: ``a`` itself when TMA can read it; a zero-padded copy, read through its [M', K] view,
    for a K that is not 16-byte aligned, and (up to ``SKINNY_M`` rows) for rows that are not whole ``block_m`` tiles
    (both GEMMs then read every box of my rows inside ``a``)."""
    from kraken._gemm_core import tma_fp8

    a = torch.randn(37, 64).to(FP8)
    assert tma_fp8(a) is a and tma_fp8(a[:32], 32).data_ptr() == a.data_ptr()  # whole tiles already: no copy
    padded = tma_fp8(a, 64)
    assert padded.shape == (64, 64) and padded.dtype == FP8
    assert torch.equal(padded[:37].view(torch.uint8), a.view(torch.uint8)) and not padded[37:].view(torch.uint8).any()
    odd = torch.randn(37, 72).to(FP8)  # 72 bytes a row: padded to 80, read as [rows, 72]
    padded = tma_fp8(odd, 32)
    assert padded.shape == (64, 72) and padded.stride(0) == 80
    assert torch.equal(padded[:37].view(torch.uint8), odd.view(torch.uint8)) and not padded[37:].view(torch.uint8).any()
    big = torch.randn(300, 64).to(FP8)  # above SKINNY_M rows: the partial tile stays, no copy
    assert tma_fp8(big, 128) is big


def test_column_major_b_feeds_wgmma_from_shared_memory():
    """``w.t()`` (read as [N, K]): wgmma reads b's TMA tile as is. A row-major b also becomes fp8 wgmma, but
    through a byte-wise transposed copy in shared memory per k step (the layout note in the recipe)."""
    shape = SHAPES["large"]
    nk, kn = compile_stats(recipe, 2, shape), compile_stats(recipe, 2, shape, b_layout="kn")
    assert fp8_wgmma(nk["ptx"]) and fp8_wgmma(kn["ptx"])
    assert shared_traffic(nk["ptx"])["prmt.b32"] == 0 and shared_traffic(nk["ptx"])["st.shared.b8"] == 0
    assert shared_traffic(kn["ptx"])["prmt.b32"] > 0 and shared_traffic(kn["ptx"])["st.shared.b8"] > 0
    assert nk["registers"] < kn["registers"]


def test_b_layouts():
    w = torch.randn(32, 64).to(FP8)  # [N, K]
    b, trans = recipe.b_operand(w.t(), "auto")  # column-major: in place
    assert trans and b.data_ptr() == w.data_ptr() and b.shape == (32, 64)
    row_major = w.t().contiguous()
    b, trans = recipe.b_operand(row_major, "auto")
    assert not trans and b.data_ptr() == row_major.data_ptr()
    b, trans = recipe.b_operand(row_major, "nk")  # forced: a transposed copy
    assert trans and torch.equal(b.view(torch.uint8), w.view(torch.uint8))
    # K = 72 is not 16-byte aligned: a zero-padded copy, read through its [N, K] view.
    w72 = torch.randn(32, 72).to(FP8)
    b, trans = recipe.b_operand(w72.t(), "auto")
    assert trans and b.shape == (32, 72) and b.stride() == (80, 1)
    assert torch.equal(b.view(torch.uint8), w72.view(torch.uint8))
    # Column-major forced to "kn": a row-major [K, N] copy. A base off the 16-byte grid: a copy, whatever the strides.
    b, trans = recipe.b_operand(w.t(), "kn")
    assert not trans and b.shape == (64, 32) and b.stride(1) == 1 and b.data_ptr() != w.data_ptr()
    assert torch.equal(b.view(torch.uint8), w.t().contiguous().view(torch.uint8))
    shifted = torch.randn(64 * 32 + 1).to(FP8)[1:].view(64, 32)  # row-major [K, N], one byte past an aligned base
    b, trans = recipe.b_operand(shifted, "auto")
    assert not trans and b.data_ptr() % 16 == 0 and torch.equal(b.view(torch.uint8), shifted.view(torch.uint8))


def test_gather_buffer_rows_hold_values_and_scale():
    """A row: K fp8 values, padding to 16 bytes, the fp32 scale, padding to 128 bytes (``stage`` fills them: the
    interpreter test checks its bytes; here it compiles for sm_90 with 16-byte accesses)."""
    k, m = 72, 5
    assert recipe.row_bytes(k) == 128 and recipe.row_bytes(112) == 128 and recipe.row_bytes(113) == 256
    assert recipe.row_bytes(8192) == 8320  # 128-byte lines: a TMA box row never straddles two
    gathered = torch.zeros(2 * m, recipe.row_bytes(k), dtype=torch.uint8)
    values, scales = recipe.buffer_views(gathered, k)
    assert values.shape == (2 * m, k) and values.stride() == (128, 1) and values.dtype == FP8
    assert scales.shape == (2 * m,) and scales.stride() == (32,)
    assert values.data_ptr() == gathered.data_ptr() and scales.data_ptr() == gathered.data_ptr() + 80
    # Kept per buffer and K: every call of a prepared call gets the same two views; another K gets its own.
    assert all(x is y for x, y in zip(recipe.buffer_views(gathered, k), (values, scales)))
    assert recipe.buffer_views(gathered, 64)[0].shape == (2 * m, 64)
    a = torch.randn(1024, 4096).to(FP8)
    gathered = torch.zeros(2 * 1024, recipe.row_bytes(4096), dtype=torch.uint8)
    values, scales = recipe.buffer_views(gathered, 4096)
    with sm90.capture_launches() as launches:
        recipe.stage(a, torch.ones(1024, 1), values[1024:], scales[1024:])
    (launch,) = launches
    stats = sm90.kernel_stats(launch)
    assert stats["spill_bytes"] == 0 and "ld.global.v4" in stats["ptx"] and "st.global.v4" in stats["ptx"]


def parameters(fn) -> list:
    """A signature's parameters but the launcher's default (Triton's launch in a recipe, None in a twin)."""
    return [(p.name, p.kind, p.default if p.name != "launcher" else None)
            for p in inspect.signature(fn).parameters.values()]


def test_twin_copies_the_plan_and_signatures():
    """The twin holds its own copies of the plan and the buffer layout (no import of the recipe): equal everywhere."""
    assert twin.plan is not recipe.plan and twin.buffer_views is not recipe.buffer_views
    for name in ("TILE_CONFIGS", "DEFAULT_CONFIG", "B_LAYOUTS", "GROUP_M", "RESERVED_SMS", "MIN_TILES_PER_SM", "OP",
                 "OUT_DTYPE", "SCALE_BYTES", "ROW_ALIGN", "STAGE_BLOCK_M", "STAGE_BLOCK_K", "STAGE_WARPS"):
        assert getattr(twin, name) == getattr(recipe, name), name
    for world_size in (1, 2, 3, 8):
        for m, n, k in [(1, 8, 16), (37, 100, 72), (128, 8192, 8192), (1024, 14336, 8192), (16, 8192, 8192)]:
            for config in ({}, {"max_blocks": 7}, {"block_m": 64, "block_n": 64, "block_k": 64, "group_m": 1}):
                got = twin.plan(m, n, k, world_size, config, sm90.H200_NUM_SMS)
                assert got == recipe.plan(m, n, k, world_size, config, sm90.H200_NUM_SMS), (m, n, k, config)
    for k in (16, 72, 112, 113, 8192):
        assert twin.row_bytes(k) == recipe.row_bytes(k)
        gathered = torch.zeros(4, recipe.row_bytes(k), dtype=torch.uint8)
        for got, want in zip(twin.buffer_views(gathered, k), recipe.buffer_views(gathered, k)):
            assert (got.shape, got.stride(), got.dtype, got.data_ptr()) == (want.shape, want.stride(), want.dtype,
                                                                          want.data_ptr())
    for name in ("launch", "launch_matmul", "stage", "all_gather_matmul_fp8"):
        assert parameters(getattr(twin, name)) == parameters(getattr(recipe, name)), name


@pytest.mark.parametrize("world_size", [1, 2, 8])
def test_twin_barrier_compiles_to_the_recipes_barrier(world_size):
    """The gather's barrier: one block, one warp, no shared memory, the same system-scope CAS release/acquire pair in
    the twin's Helion kernel as in the recipe's Triton one."""
    with sm90.capture_launches() as launches:
        recipe.barrier(sm90.FAKE_SIGNAL_PADS, world_size - 1, world_size)
        twin.barrier(torch.zeros(world_size, dtype=torch.int32), sm90.FAKE_SIGNAL_PADS, world_size - 1, world_size, "")
    assert [(tuple(launch.grid), launch.kwargs.get("num_warps")) for launch in launches] == [((1,), 1)] * 2
    t, h = (sm90.kernel_stats(launch) for launch in launches)
    assert sm90.barrier_opcodes(h["ptx"]) == sm90.barrier_opcodes(t["ptx"])
    assert dict(sm90.barrier_opcodes(t["ptx"])) == {
        "atom.global.release.sys.cas.b32": 1, "atom.global.acquire.sys.cas.b32": 1}
    assert t["shared_bytes"] == h["shared_bytes"] == 0


def test_op_registration():
    reg = registry.get("all_gather_matmul_fp8")
    # triton_fused / triton_seq: the recipe's two forms forced (``kraken.runtime.crossover``)
    assert list(reg.backends) == ["nccl", "torch_fused", "scaled_mm", "triton", "helion", "triton_fused",
                                  "triton_seq"]
    assert reg.reference_free == frozenset({"scaled_mm"})
    assert reg.nvlink_bytes((1024, 8, 100), torch.bfloat16, 2) == 512 * 104


# ---------------------------------------------------------------------------
# Plans
# ---------------------------------------------------------------------------


def stage_bytes(cfg: dict) -> int:
    return cfg["num_stages"] * (cfg["block_m"] + cfg["block_n"]) * cfg["block_k"]  # one byte per fp8 value


def test_default_tiles_per_shape():
    """The bf16 recipe's tiles with 128-wide k steps: the same bytes per stage."""
    picks = {}
    for total, n, k in registry.get("all_gather_matmul_fp8").default_shapes:
        cfg = recipe.plan(total // 2, n, k, 2, {}, sm90.H200_NUM_SMS)
        picks[(total, n, k)] = (cfg["block_m"], cfg["block_n"], cfg["block_k"], cfg["num_warps"], cfg["num_stages"])
        assert cfg["num_blocks"] <= sm90.H200_NUM_SMS - recipe.RESERVED_SMS
        assert stage_bytes(cfg) <= 192 * 1024
    assert picks == {(1024, 6656, 5120): (128, 256, 128, 8, 4), (2048, 14336, 8192): (128, 256, 128, 8, 4),
                     (8192, 14336, 8192): (128, 256, 128, 8, 4), (256, 8192, 8192): (128, 128, 128, 8, 6),
                     (512, 8192, 8192): (128, 256, 128, 8, 4)}


@pytest.mark.parametrize("world_size", range(1, 9))
def test_plan_is_well_formed(world_size):
    for m, n, k in [(1, 8, 16), (37, 100, 72), (4096, 14336, 8192)]:
        for config in ({}, {"max_blocks": 7}, {"block_m": 64, "block_n": 64, "block_k": 64, "group_m": 1}):
            cfg = recipe.plan(m, n, k, world_size, config, sm90.H200_NUM_SMS)
            tiles = world_size * groups.cdiv(m, cfg["block_m"]) * groups.cdiv(n, cfg["block_n"])
            assert 1 <= cfg["num_blocks"] <= min(tiles, config.get("max_blocks", 132))


def test_plan_refuses_bad_config():
    with pytest.raises(TypeError, match="unknown config keys"):
        recipe.plan(64, 64, 64, 2, {"stage": "sm"}, 132)  # no such key (the bf16 recipe had one once)
    with pytest.raises(ValueError, match="block_k must be a power of two >= 32"):
        recipe.plan(64, 64, 64, 2, {"block_k": 16}, 132)
    with pytest.raises(ValueError, match="block_k must be <= 128"):
        recipe.plan(64, 64, 64, 2, {"block_k": 256}, 132)
    with pytest.raises(ValueError, match="b_layout must be one of"):
        recipe.plan(64, 64, 64, 2, {"b_layout": "kk"}, 132)


# ---------------------------------------------------------------------------
# Input validation
# ---------------------------------------------------------------------------


def fp8_inputs(m=8, n=32, k=16):
    return torch.zeros(m, k, dtype=FP8), torch.zeros(n, k, dtype=FP8).t(), torch.ones(m, 1), torch.ones(1, n)


@pytest.mark.parametrize("package", ["kraken", "helion_ports"])
def test_bad_input_is_refused_on_the_host(package):
    fn = importlib.import_module(package).all_gather_matmul_fp8  # the installed one
    a, b, sa, sb = fp8_inputs()
    with pytest.raises(ValueError, match=r"a must be a 2-D float8_e4m3fn tensor, got bfloat16"):
        fn(a.to(torch.bfloat16), b, sa, sb)
    with pytest.raises(ValueError, match=r"b must be a 2-D float8_e4m3fn tensor, got float8_e5m2"):
        fn(a, b.to(torch.float8_e5m2), sa, sb)
    with pytest.raises(ValueError, match=r"inner dimensions differ: a is \(8, 16\), b is \(32, 16\)"):
        fn(a, b.t(), sa, sb)
    with pytest.raises(ValueError, match="a must be contiguous"):
        fn(torch.zeros(16, 8, dtype=FP8).t(), b, sa, sb)
    with pytest.raises(TypeError, match="a must be a torch.Tensor"):
        fn([[1.0]], b, sa, sb)
    with pytest.raises(ValueError, match="empty operand"):
        fn(torch.zeros(0, 16, dtype=FP8), b, torch.ones(()), sb)
    # Scales: float32, one element or the _scaled_mm shape ([M, 1] for a, [1, N] for b), contiguous.
    with pytest.raises(ValueError, match="scale_a must be float32, got bfloat16"):
        fn(a, b, sa.bfloat16(), sb)
    with pytest.raises(ValueError, match=r"scale_a must have one element \(per tensor\) or shape \(8, 1\), got \(1, 8\)"):
        fn(a, b, sa.t(), sb)
    with pytest.raises(ValueError, match=r"scale_a must have one element .* got \(8,\)"):
        fn(a, b, sa.view(8), sb)
    with pytest.raises(ValueError, match=r"scale_b must have one element \(per tensor\) or shape \(1, 32\), got \(32, 1\)"):
        fn(a, b, sa, sb.t().contiguous())
    with pytest.raises(ValueError, match="scale_b must be contiguous"):
        fn(a, b, sa, torch.ones(1, 64)[:, ::2])
    with pytest.raises(TypeError, match="scale_b must be a torch.Tensor"):
        fn(a, b, sa, 1.0)
    # Past every shape, dtype and scale check, the first thing that needs more is the device.
    with pytest.raises(ValueError, match="a and b must be on the same CUDA device"):
        fn(a, b, sa, sb)
    with pytest.raises(ValueError, match="a and b must be on the same CUDA device"):
        fn(a, b, torch.ones(()), torch.ones(1, 1))  # per-tensor scales pass


def test_bad_scale_raises_on_every_rank(monkeypatch):
    """Rank 0's bad scale and rank 1's (another error) become one error naming both, on both ranks; ranks that
    disagree on a scale's layout (row-wise here, per tensor there) raise too, before any launch."""
    a, b, sa, sb = fp8_inputs()
    rank1 = ("ValueError", "scale_b must be float32, got float16")
    world = FakeWorld(monkeypatch, other=lambda mine: (mine[0], rank1))
    with pytest.raises(ValueError, match=r"bad input on rank 0: scale_a must be float32.*; rank 1: scale_b must be"):
        gather_matmul.prepare_fp8.uncached(a, b, sa.double(), sb, None, recipe.OP, {})
    assert world.exchanges == 1
    # Rank 1 passed a per-tensor scale_a where rank 0 passed a row-wise one.
    other = lambda mine: (tuple((n, ("tensor", (), "float32", "cpu", True)) if n == "scale_a" else (n, v)  # noqa: E731
                                for n, v in mine[0]), mine[1])
    FakeWorld(monkeypatch, other=other)
    with pytest.raises(ValueError, match=r"ranks disagree on the input's shape/dtype \(scale_a: rank 0 .*\(8, 1\).*rank 1"):
        gather_matmul.prepare_fp8.uncached(a, b, sa, sb, None, recipe.OP, {})


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_the_gather_stages_for_the_peers_and_flags_only_their_chunks(monkeypatch, world_size):
    """The recipe's launch on CPU stand-ins (this process the last rank): the flags reset before the fork (not in a
    group of one), the staging kernel on the side stream only for the peers, two barriers around each peer's chunk
    copied and then flagged (rank + 1 first; my chunk never: the GEMM reads my rows from ``a``), the GEMM on the
    current stream, the join last."""
    from types import SimpleNamespace

    events: list = []

    class Stream:
        def __init__(self, name):
            self.name = name

        def wait_stream(self, other):
            events.append("fork" if self.name == "side" else "join")

    class Flags:
        def zero_(self):
            events.append("reset")

        def view(self, dtype):
            return self

    monkeypatch.setattr(recipe, "side_stream", lambda device: Stream("side"))
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: Stream("current"))
    monkeypatch.setattr(torch.cuda, "set_stream", lambda stream: None)
    monkeypatch.setattr(recipe, "_SymmetricMemory", SimpleNamespace(
        stream_write_value32=lambda flags, index, value: events.append(("flag", index, value))))

    def launcher(kernel, grid, *args, **meta):
        events.append("barrier" if "barrier" in kernel.fn.__name__ else kernel.fn.__name__)

    rows, n, k, rank = 3, 32, 64, world_size - 1
    width = recipe.row_bytes(k)
    buffers = [torch.randint(0, 255, (world_size * rows, width), dtype=torch.uint8) for _ in range(world_size)]
    peers = tuple(buffers[r][r * rows:(r + 1) * rows] for r in range(world_size))
    gathered = buffers[rank]
    own_values, own_scales = recipe.buffer_views(peers[rank], k)
    a, b = torch.randn(rows, k).to(FP8), torch.randn(n, k).to(FP8).t()
    cfg = recipe.plan(rows, n, k, world_size, {}, sm90.H200_NUM_SMS)
    out = torch.empty(world_size * rows, n, dtype=torch.bfloat16)
    recipe.launch(a, b, torch.ones(rows, 1), torch.ones(1, n), peers, gathered, own_values, own_scales, out, Flags(),
                  0, rank, **cfg, launcher=launcher)
    order = [(rank + step) % world_size for step in range(1, world_size)]
    staged = ["reset", "fork", "stage_kernel"] if world_size > 1 else ["fork"]
    assert events == staged + ["barrier"] + [("flag", peer, 1) for peer in order] + [
        "barrier", "all_gather_matmul_kernel", "join"], events
    for peer in order:  # values and scales, each peer's whole rows
        assert torch.equal(gathered[peer * rows:(peer + 1) * rows], peers[peer])


# ---------------------------------------------------------------------------
# The numbers, in the Triton interpreter
# ---------------------------------------------------------------------------

INTERPRETED = r'''
import importlib, sys
import numpy as np
import torch
import triton
import triton.language as tl
import triton.runtime.interpreter as interpreter

from benchmark.sm90 import fix_interpreter_scalars  # Triton 3.6's interpreter and numpy 2
fix_interpreter_scalars()

m = importlib.import_module("kraken.fused.all_gather_matmul_fp8")  # the package exports the function by that name
twin = importlib.import_module("helion_ports.fused.all_gather_matmul_fp8")
from benchmark import sm90
from benchmark.ops.all_gather_matmul_fp8 import dequantized, rank_operands

@triton.jit
def count_wait(flag_ptr, value):
    tl.atomic_add(flag_ptr, 1)  # the inline-PTX wait cannot run here: count who waits for which chunk instead

m.wait_async = count_wait  # the recipe's kernel (its own copy of the bf16 recipe's)
twin.WAIT_FLAG = "tl.debug_barrier()"  # the twin's body (its own copy of the bf16 twin's)

worst = 0.0
# (rows per rank, N, K, world size, per-tensor scales, b layout, config, module)
cases = [
    (37, 100, 72, 2, False, "auto", {"block_m": 32, "block_n": 32, "block_k": 32}, m),
    (37, 100, 72, 3, True, "auto", {"block_m": 16, "block_n": 64, "block_k": 64, "max_blocks": 5}, m),
    (1, 40, 48, 2, False, "kn", {"block_m": 16, "block_n": 32, "block_k": 32}, m),
    (20, 48, 80, 4, False, "nk", {"block_m": 16, "block_n": 16, "block_k": 32, "group_m": 2, "max_blocks": 3}, m),
    (37, 100, 72, 2, False, "auto", {"block_m": 32, "block_n": 32, "block_k": 32}, twin),
    (20, 48, 80, 3, True, "auto", {"block_m": 16, "block_n": 16, "block_k": 32, "max_blocks": 4}, twin),
    (1, 40, 48, 2, False, "kn", {"block_m": 16, "block_n": 32, "block_k": 32}, twin),
    (37, 100, 72, 1, False, "auto", {"block_m": 32, "block_n": 32, "block_k": 32}, m),
    (37, 100, 72, 1, True, "auto", {"block_m": 32, "block_n": 64, "block_k": 32, "max_blocks": 3}, twin),
]
for rows, n, k, world_size, per_tensor, layout, config, module in cases:
    shape = (world_size * rows, n, k)
    parts = [rank_operands(shape, rows + k, r, world_size, device="cpu", per_tensor=per_tensor)
             for r in range(world_size)]
    b, scale_b = parts[0][1], parts[0][3]
    if layout != "auto":
        b = b.contiguous() if layout == "kn" else b
    ref = torch.cat([dequantized(a, sa) for a, _, sa, _ in parts]) @ dequantized(b, scale_b)
    # The staging kernel: values and scale (a per-tensor one in every row) in each row, the padding untouched.
    staged = torch.full((world_size * rows, m.row_bytes(k)), 0x7F, dtype=torch.uint8)
    values, scales = m.buffer_views(staged, k)
    for r, (a, _, sa, _) in enumerate(parts):
        m.stage(a, sa, values[r * rows:(r + 1) * rows], scales[r * rows:(r + 1) * rows])
        assert torch.equal(staged[r * rows:(r + 1) * rows, :k], a.view(torch.uint8))
        assert torch.equal(scales[r * rows:(r + 1) * rows], sa.reshape(-1).expand(rows))
    scale_at = -(-k // 16) * 16
    assert (staged[:, k:scale_at] == 0x7F).all() and (staged[:, scale_at + 4:] == 0x7F).all()
    for rank in range(world_size):
        cfg = m.plan(rows, n, k, world_size, {"b_layout": layout, **config}, 132)
        b_op, b_trans = m.b_operand(b, cfg.pop("b_layout"))
        gathered = torch.full((world_size * rows, m.row_bytes(k)), 0x7F, dtype=torch.uint8)  # padding: NaN bytes
        values, scales = m.buffer_views(gathered, k)
        for r, (a, _, sa, _) in enumerate(parts):  # what staging and the copy engine leave in the buffer
            if r != rank:  # both GEMMs read my rows from a: my chunk stays NaN bytes
                m.stage(a, sa, values[r * rows:(r + 1) * rows], scales[r * rows:(r + 1) * rows])
        out = torch.full((world_size * rows, n), float("nan"), dtype=torch.bfloat16)
        progress = torch.zeros(world_size + 4, dtype=torch.int32)
        with sm90.capture_launches():  # Helion's host-built descriptors on the CPU
            a_mine, _, sa_mine, _ = parts[rank]
            module.launch_matmul(m.tma_fp8(a_mine, cfg["block_m"]), sa_mine, gathered, b_op, scale_b, out, progress,
                                 rank, world_size, k, b_trans, **cfg)
        assert not torch.isnan(out).any(), "an output element was never written"
        err = ((out.double() - ref).norm() / ref.norm()).item()
        worst = max(worst, err)
        if module is m:  # every block that has tiles of a peer's chunk waits for it once; none waits for my rows
            chunk_tiles = -(-rows // cfg["block_m"]) * -(-n // cfg["block_n"])
            expected = [0] * (world_size + 4)
            for block in range(cfg["num_blocks"]):
                for step in {t // chunk_tiles for t in range(block, world_size * chunk_tiles, cfg["num_blocks"])} - {0}:
                    expected[(rank + step) % world_size] += 1
            assert progress.tolist() == expected, (progress.tolist(), expected)
    print(module.__name__, rows, n, k, world_size, per_tensor, layout, config, f"relative error {err:.2e}")
assert worst < 5e-3, worst
# Staging over several blocks of rows and of bytes (the GEMM cases above fit one): every byte and scale, no padding.
a = torch.randn(37, 1100).to(torch.float8_e4m3fn)
sa = torch.rand(37, 1) + 0.5
staged = torch.full((37, m.row_bytes(1100)), 0x7F, dtype=torch.uint8)
values, scales = m.buffer_views(staged, 1100)
m.stage(a, sa, values, scales)
assert torch.equal(staged[:, :1100], a.view(torch.uint8)) and torch.equal(scales, sa.reshape(-1))
assert (staged[:, 1100:1104] == 0x7F).all() and (staged[:, 1108:] == 0x7F).all()
print("ok")
'''


def test_gemm_and_scales_in_the_triton_interpreter():
    """The recipe's GEMM on every rank of worlds of 2 to 4 (row-wise and per-tensor scales, every b layout, tails
    in M, N and K, a chunk end inside a tile, padding bytes of NaNs in the buffer), and the twin's on two of those,
    against float64 on the dequantised inputs; the recipe's flag waits counted per chunk."""
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    result = subprocess.run([sys.executable, "-c", INTERPRETED], env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0 and result.stdout.strip().endswith("ok"), result.stdout + result.stderr
