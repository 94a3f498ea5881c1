"""All-gather + matmul without a GPU: both GEMMs compile for sm_90 at 2, 4 and 8 ranks and match (wgmma, TMA,
no spills, the same flag wait), the plan fits shared memory and leaves room for the gather's barrier kernel,
and bad input is refused on the host before anything needs CUDA or torch.distributed."""

from __future__ import annotations

import contextlib
import importlib
import inspect
import re
from types import SimpleNamespace

import pytest
import torch

from benchmark import sm90
from benchmark.ops import all_gather_matmul as op
from kraken._gemm_core import balanced_grid, flattens
from kraken._ptx_utils import inline_source
from kraken._ptx_utils.gmem_barrier import FENCE_PROXY_ASYNC_PTX, GMEM_WAIT_PTX
from kraken.runtime import graphs, groups

RECIPE = "kraken.fused.all_gather_matmul"
TWIN = "helion_ports.fused.all_gather_matmul"
recipe = importlib.import_module(RECIPE)
twin = importlib.import_module(TWIN)
gather = importlib.import_module("kraken.comm.all_gather_with_progress")
progress = importlib.import_module("kraken.runtime.progress")

H200_SHARED_BYTES = 232448  # 227 KiB per block
# (rows per rank, N, K): the 128x256 tiles (default shapes from M = 1024 on), the 128x128 tiles (256 and 512
# rows in all), the skinny tiles (too few rows for those to fill the SMs), and the registry's odd example.
SHAPES = {"large": (1024, 14336, 8192), "small": (128, 8192, 8192), "skinny": (40, 4096, 4096),
          "odd": op.EXAMPLE_SHAPE}


def compile_stats(module, world_size: int, shape, **config) -> dict:
    with sm90.capture_launches() as launches:
        op.example(module, world_size, shape=shape, **config)
    (launch,) = launches
    return sm90.kernel_stats(launch)


def barrier_kernel_stats(world_size: int) -> dict:
    with sm90.capture_launches() as launches:
        recipe.barrier(sm90.FAKE_SIGNAL_PADS, 1, world_size)
    (launch,) = launches
    return sm90.kernel_stats(launch)


@pytest.mark.parametrize("world_size", [1, 2, 4, 8])
@pytest.mark.parametrize("shape_class", list(SHAPES))
def test_both_kernels_compile_for_sm90_and_match(shape_class, world_size):
    shape = SHAPES[shape_class]
    cfg = recipe.plan(*shape, world_size, {}, sm90.H200_NUM_SMS)
    t = compile_stats(recipe, world_size, shape)
    h = compile_stats(twin, world_size, shape)
    for stats in (t, h):
        assert re.search(r"\.target\s+sm_90", stats["ptx"]), f"{stats['kernel']}: not compiled for sm_90"
        assert stats["spill_bytes"] == 0, f"{stats['kernel']} spills {stats['spill_bytes']} bytes"
        assert "wgmma.mma_async" in stats["ptx"], f"{stats['kernel']}: tl.dot did not become wgmma"
        # One flag wait, at a peer's chunk: an acquire load at system scope, then the async-proxy fence before
        # TMA. A group of one has no peer: my rows were written before the launch, nothing to wait for.
        waits = {"ld.global.acquire.sys.u32": 1} if world_size > 1 else {}
        assert dict(sm90.barrier_opcodes(stats["ptx"])) == waits
        assert ("fence.proxy.async.global" in stats["ptx"]) == (world_size > 1)
        assert stats["shared_bytes"] <= H200_SHARED_BYTES
    # The gather's barrier kernel (one warp, no shared memory) runs on the SM the GEMM leaves free
    # (``RESERVED_SMS``): the twin's block takes up to 255 registers a thread, all of an SM's with 8 warps.
    barrier = barrier_kernel_stats(world_size)
    assert barrier["shared_bytes"] == 0 and sm90.signal_rounds(barrier["ptx"]) == 1
    assert cfg["num_blocks"] <= sm90.H200_NUM_SMS - recipe.RESERVED_SMS
    # Both walk the tiles in one loop per source of rows (a, then the gather buffer; the first alone in a group of
    # one), each with its own k loop, and the loops' pipelines share shared memory. On the 128x256 tiles the recipe's
    # first loop is flattened (``kraken._gemm_core.flattens``) and keeps more in flight; the twin asks Helion for the
    # same (``range_flattens``), which Triton leaves unfused on its deeper loop nest.
    if flattens(cfg["block_m"], cfg["block_n"]):
        assert t["shared_bytes"] >= h["shared_bytes"]
    else:
        assert h["shared_bytes"] == t["shared_bytes"]
    for instruction in ("wgmma.mma_async", "cp.async.bulk.tensor"):
        assert h["ptx"].count(instruction) == t["ptx"].count(instruction) > 0, instruction


@pytest.mark.parametrize("module", [recipe, twin], ids=["triton", "helion"])
def test_transposed_b_is_read_in_place(module):
    """A b stored as ``w.t()`` loads through a descriptor over w itself ([N, K], BLOCK_N x BLOCK_K boxes)."""
    shape = SHAPES["small"]
    stats = compile_stats(module, 2, shape, b_layout="nk")
    assert stats["spill_bytes"] == 0 and "wgmma.mma_async" in stats["ptx"]
    assert stats["ptx"].count("cp.async.bulk.tensor") == compile_stats(module, 2, shape)["ptx"].count("cp.async.bulk.tensor")


def test_b_layouts_need_no_copy_when_tma_can_read_them():
    a = torch.randn(16, 64, dtype=torch.bfloat16)
    b = torch.randn(64, 32, dtype=torch.bfloat16)
    w = torch.randn(32, 64, dtype=torch.bfloat16)
    _, b_kn, trans = recipe.tma_inputs(a, b, "auto")
    assert not trans and b_kn.data_ptr() == b.data_ptr()
    _, b_nk, trans = recipe.tma_inputs(a, w.t(), "auto")
    assert trans and b_nk.data_ptr() == w.data_ptr() and b_nk.shape == (32, 64)
    _, b_nk, trans = recipe.tma_inputs(a, b, "nk")  # forced: a transposed copy
    assert trans and torch.equal(b_nk, b.t())
    strided = torch.randn(64, 64, dtype=torch.bfloat16)[:, ::2]
    _, b_copy, trans = recipe.tma_inputs(a, strided, "auto")
    assert not trans and b_copy.is_contiguous() and torch.equal(b_copy, strided)
    # K = 60 is not 16-byte aligned in bf16: a and b are zero-padded in k (and b stays transposed).
    a60, w60 = torch.randn(16, 60, dtype=torch.bfloat16), torch.randn(32, 60, dtype=torch.bfloat16)
    a_pad, b_pad, trans = recipe.tma_inputs(a60, w60.t(), "auto")
    assert trans and a_pad.shape == (16, 64) and b_pad.shape == (32, 64)
    assert torch.equal(a_pad[:, :60], a60) and torch.equal(b_pad[:, :60], w60) and not b_pad[:, 60:].any()


def parameters(fn) -> list:
    """A signature's parameters but the launcher's default (Triton's launch in a recipe, None in a twin)."""
    return [(p.name, p.kind, p.default if p.name != "launcher" else None)
            for p in inspect.signature(fn).parameters.values()]


def test_twin_copies_the_plan_and_signatures():
    """The twin holds its own copy of the plan (no import of the recipe): the same configuration everywhere."""
    assert twin.plan is not recipe.plan and twin.tma_inputs is not recipe.tma_inputs
    for name in ("TILE_CONFIGS", "DEFAULT_CONFIG", "B_LAYOUTS", "GROUP_M", "RESERVED_SMS", "MIN_TILES_PER_SM", "OP"):
        assert getattr(twin, name) == getattr(recipe, name), name
    for world_size in (1, 2, 3, 8):
        for m, n, k in [(1, 8, 16), (40, 4096, 4096), (128, 8192, 8192), (1024, 14336, 8192), (37, 100, 72)]:
            for config in ({}, {"max_blocks": 7}, {"block_m": 64, "block_n": 64, "group_m": 1, "b_layout": "nk"}):
                got = twin.plan(m, n, k, world_size, config, sm90.H200_NUM_SMS)
                assert got == recipe.plan(m, n, k, world_size, config, sm90.H200_NUM_SMS), (m, n, k, config)
    for module in (recipe, twin):
        with pytest.raises(TypeError, match="unknown config keys"):
            module.plan(64, 64, 64, 2, {"blockm": 64}, 132)
    a60, w60 = torch.randn(16, 60, dtype=torch.bfloat16), torch.randn(32, 60, dtype=torch.bfloat16)
    for layout in ("auto", "nk", "kn"):
        for got, want in zip(twin.tma_inputs(a60, w60.t(), layout, 64), recipe.tma_inputs(a60, w60.t(), layout, 64)):
            assert torch.equal(got, want) if isinstance(got, torch.Tensor) else got == want
    for name in ("launch", "launch_matmul", "all_gather_matmul"):
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


def test_wait_async_is_the_gmem_wait_plus_the_proxy_fence():
    """The twin's wait snippet is built from the same PTX strings as ``gmem_barrier.wait_async``."""
    snippet = twin.WAIT_FLAG.format(progress="p", index="i", value=1)
    assert repr(GMEM_WAIT_PTX) in snippet and repr(FENCE_PROXY_ASYNC_PTX) in snippet
    assert snippet.index("debug_barrier") < snippet.index("fence.proxy.async")
    assert inline_source.GMEM_WAIT_ASYNC.startswith(inline_source.GMEM_WAIT)


# ---------------------------------------------------------------------------
# Plans
# ---------------------------------------------------------------------------


def test_tile_loop_flattens_on_the_large_tiles():
    """The planner's 128x256 tiles (from 1024 rows per rank on the default shapes) flatten my rows' tile loop
    (``kraken._gemm_core.flattens``); the 128x128 and skinny tiles of fewer rows do not; at world size 1 the
    flattened kernel compiles and keeps more in flight than the twin's."""
    def flat(m, n, k, world_size=1):
        cfg = recipe.plan(m, n, k, world_size, {}, sm90.H200_NUM_SMS)
        return flattens(cfg["block_m"], cfg["block_n"])

    assert flat(1024, 6656, 5120) and flat(2048, 14336, 8192) and flat(512, 8192, 8192) and flat(256, 8192, 8192, 8)
    assert not flat(256, 8192, 8192) and not flat(40, 4096, 4096)
    t = compile_stats(recipe, 1, (1024, 6656, 5120))
    h = compile_stats(twin, 1, (1024, 6656, 5120))
    assert t["spill_bytes"] == 0 and t["shared_bytes"] > h["shared_bytes"]


def test_default_tiles_per_shape():
    """128x256 tiles while they give 90% of the SMs a tile, else 128x128."""
    picks = {}
    for total, n, k in [(1024, 6656, 5120), (2048, 14336, 8192), (8192, 14336, 8192), (256, 8192, 8192), (512, 8192, 8192)]:
        cfg = recipe.plan(total // 2, n, k, 2, {}, sm90.H200_NUM_SMS)
        picks[(total, n, k)] = (cfg["block_m"], cfg["block_n"], cfg["num_warps"], cfg["num_stages"])
        assert cfg["num_blocks"] <= sm90.H200_NUM_SMS - recipe.RESERVED_SMS
    assert picks == {(1024, 6656, 5120): (128, 256, 8, 3), (2048, 14336, 8192): (128, 256, 8, 3),
                     (8192, 14336, 8192): (128, 256, 8, 3), (256, 8192, 8192): (128, 128, 8, 6),
                     (512, 8192, 8192): (128, 256, 8, 3)}


@pytest.mark.parametrize("module", ["kraken.fused.all_gather_matmul", "kraken.fused.all_gather_matmul_fp8"])
def test_skinny_tiles_where_large_ones_leave_sms_idle(module):
    """Up to SKINNY_M rows, where not even 128x128 tiles give 90% of the SMs a tile, the reduce recipes' skinny
    tiles: one warpgroup, 128-deep k steps (bf16 tiles from 128x64 on 64-deep: ``SKINNY_WIDE``), tiles narrow enough
    to fill a wave of the SMs."""
    plan = importlib.import_module(module).plan
    for (m, n, k, world_size), tiles in {
        (32, 4096, 4096, 1): (64, 32, 128, 4),  # 128 tiles
        (40, 4096, 4096, 2): (64, 32, 128, 4),  # 128 tiles a chunk, two chunks
        (160, 4096, 4096, 1): (128, 64, 64 if module.endswith("matmul") else 128, 4),  # 2 x 64 tiles
        (16, 8192, 8192, 1): (64, 64, 128, 4),  # 128 tiles
        (300, 4096, 4096, 1): (128, 128, 64 if module.endswith("matmul") else 128, 8),  # above SKINNY_M: the smallest
    }.items():
        cfg = plan(m, n, k, world_size, {}, sm90.H200_NUM_SMS)
        assert (cfg["block_m"], cfg["block_n"], cfg["block_k"], cfg["num_warps"]) == tiles, (m, n, k, cfg)
        assert cfg["num_blocks"] <= sm90.H200_NUM_SMS - recipe.RESERVED_SMS


def test_the_persistent_grid_is_balanced():
    """``balanced_grid``: the fewest rounds (``max_blocks`` tiles at once), on the fewest blocks that take them, so
    every round runs as many tiles. Both GEMM recipes' plans use it: 208 tiles of 128x256 (1024 x 6656) on an H200
    run on 104 blocks, two tiles each, not 131 or 132 and a short second round."""
    for tiles in range(1, 1500):
        for most in (1, 7, 104, 131, 132):
            blocks = balanced_grid(tiles, most)
            rounds = groups.cdiv(tiles, most)
            assert blocks <= most and groups.cdiv(tiles, blocks) == rounds, (tiles, most, blocks)
            assert blocks == 1 or groups.cdiv(tiles, blocks - 1) > rounds, (tiles, most, blocks)
    grs = importlib.import_module("kraken.fused.gemm_reduce_scatter")
    assert recipe.plan(1024, 6656, 5120, 1, {}, sm90.H200_NUM_SMS)["num_blocks"] == 104
    assert grs.plan(1024, 6656, 2560, 1, {}, sm90.H200_NUM_SMS)["num_blocks"] == 104
    assert grs.plan(8192, 14336, 4096, 1, {}, sm90.H200_NUM_SMS)["num_blocks"] == 128  # 3584 tiles: 28 rounds


@pytest.mark.parametrize("world_size", range(1, 9))
def test_plan_is_well_formed(world_size):
    for m, n, k in [(1, 8, 16), (37, 100, 72), (4096, 14336, 8192), (100, 200, 72)]:
        for config in ({}, {"max_blocks": 7}, {"block_m": 64, "block_n": 64, "group_m": 1}):
            cfg = recipe.plan(m, n, k, world_size, config, sm90.H200_NUM_SMS)
            tiles = world_size * groups.cdiv(m, cfg["block_m"]) * groups.cdiv(n, cfg["block_n"])
            assert 1 <= cfg["num_blocks"] <= min(tiles, config.get("max_blocks", 132))


def test_plan_refuses_bad_config():
    with pytest.raises(TypeError, match="unknown config keys"):
        recipe.plan(64, 64, 64, 2, {"blockm": 64}, 132)
    with pytest.raises(ValueError, match="block_k must be a power of two >= 16"):
        recipe.plan(64, 64, 64, 2, {"block_k": 48}, 132)
    with pytest.raises(ValueError, match="group_m must be a power of two"):
        recipe.plan(64, 64, 64, 2, {"group_m": 3}, 132)
    with pytest.raises(ValueError, match="b_layout must be one of"):
        recipe.plan(64, 64, 64, 2, {"b_layout": "kk"}, 132)
    with pytest.raises(TypeError, match="unknown config keys"):  # my rows are no longer staged in pieces
        recipe.plan(64, 64, 64, 2, {"stage": "sm"}, 132)


# ---------------------------------------------------------------------------
# Input validation: CPU tensors, no process group; every error is raised before either is needed
# ---------------------------------------------------------------------------

BF16 = torch.bfloat16


@pytest.mark.parametrize("package", ["kraken", "helion_ports"])
def test_bad_input_is_refused_on_the_host(package):
    fn = importlib.import_module(package).all_gather_matmul  # the installed one
    a, b = torch.zeros(8, 16, dtype=BF16), torch.zeros(16, 32, dtype=BF16)
    with pytest.raises(ValueError, match=r"inner dimensions differ: a is \(8, 16\), b is \(32, 8\)"):
        fn(a, torch.zeros(32, 8, dtype=BF16))
    with pytest.raises(ValueError, match="a has dtype float32; supported: bfloat16, float16"):
        fn(a.float(), b.float())
    with pytest.raises(ValueError, match="a and b must have the same dtype"):
        fn(a, b.half())
    with pytest.raises(ValueError, match="a must be contiguous"):
        fn(torch.zeros(16, 8, dtype=BF16).t(), b)
    with pytest.raises(ValueError, match="a must be 2-D"):
        fn(torch.zeros(16, dtype=BF16), b)
    with pytest.raises(TypeError, match="a must be a torch.Tensor"):
        fn([[1.0]], b)
    with pytest.raises(TypeError, match="b must be a torch.Tensor"):
        fn(a, [[1.0]])
    with pytest.raises(ValueError, match="empty operand"):
        fn(torch.zeros(0, 16, dtype=BF16), b)
    # b in any layout passes the checks (a transposed view here); the first thing that needs more is the device.
    with pytest.raises(ValueError, match="a must be on a CUDA device"):
        fn(a, torch.zeros(32, 16, dtype=BF16).t())


def test_gather_refuses_bad_input_on_the_host():
    with pytest.raises(TypeError, match="shard must be a torch.Tensor"):
        progress.all_gather_with_progress([1, 2])
    with pytest.raises(ValueError, match="shard must be contiguous"):
        progress.all_gather_with_progress(torch.zeros(4, 4).t())
    with pytest.raises(ValueError, match="shard must be on a CUDA device"):
        progress.all_gather_with_progress(torch.zeros(4, 4))


class Events:
    """CPU stand-ins for what a gather does on the GPU, each noted in ``events``: the side stream's fork and the
    join (``wait_stream``), the flags' reset (``zero_``) and writes (``stream_write_value32``), the launches."""

    def __init__(self, monkeypatch, module):
        self.events: list = []
        events = self.events

        class Stream:
            def __init__(self, name):
                self.name = name

            def wait_stream(self, other):
                events.append("fork" if self.name == "side" else "join")

        class Flags:  # the progress flags: their reset and their writes (the stream operations' uint32 view)
            def zero_(self):
                events.append("reset")

            def view(self, dtype):
                return self

        self.flags = Flags()
        monkeypatch.setattr(module, "side_stream", lambda device: Stream("side"))
        monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: Stream("current"))
        monkeypatch.setattr(torch.cuda, "set_stream", lambda stream: None)
        monkeypatch.setattr(module, "_SymmetricMemory", SimpleNamespace(
            stream_write_value32=lambda flags, index, value: events.append(("flag", index, value))))

    def launcher(self, kernel, grid, *args, **meta):
        self.events.append("barrier" if "barrier" in kernel.fn.__name__ else kernel.fn.__name__)


@pytest.mark.parametrize("world_size,return_a", [(1, False), (1, True), (2, False), (2, True), (4, False)])
def test_the_gather_flags_only_what_the_gemm_waits_for(monkeypatch, world_size, return_a):
    """The recipe's launch on CPU stand-ins (this process the last rank, every rank's own chunk of its buffer as the
    prepared call gives it): the flags are reset before the fork (not in a group of one: no flag is written), my rows
    are staged into my chunk for the peers (and the snapshot), each peer's chunk is copied and then flagged, rank + 1
    first; my own chunk is never flagged (the GEMM reads my rows from ``a``); two barriers around the copies; the GEMM
    on the current stream; the join last."""
    fake = Events(monkeypatch, recipe)
    rows, k, rank = 3, 16, world_size - 1
    buffers = [torch.full((world_size * rows, k), float("nan"), dtype=torch.bfloat16) for _ in range(world_size)]
    for r in range(world_size - 1):  # the peers' rows, staged in their own chunks
        buffers[r][r * rows:(r + 1) * rows] = torch.randn(rows, k).to(torch.bfloat16)
    peers = tuple(buffers[r][r * rows:(r + 1) * rows] for r in range(world_size))
    gathered = buffers[rank]
    a, b = torch.randn(rows, k).to(torch.bfloat16), torch.randn(k, 8).to(torch.bfloat16)
    a_out = torch.empty_like(gathered) if return_a else None
    cfg = recipe.plan(rows, 8, k, world_size, {}, sm90.H200_NUM_SMS)
    out = torch.empty(world_size * rows, 8, dtype=torch.bfloat16)
    recipe.launch(a, b, peers, gathered, out, fake.flags, 0, rank, a_out, **cfg, launcher=fake.launcher)
    order = [(rank + step) % world_size for step in range(1, world_size)]
    reset = ["reset"] if world_size > 1 else []
    assert fake.events == reset + ["fork", "barrier"] + [("flag", peer, 1) for peer in order] + [
        "barrier", "all_gather_matmul_kernel", "join"], fake.events
    for peer in order:
        assert torch.equal(gathered[peer * rows:(peer + 1) * rows], peers[peer])
    staged = torch.equal(gathered[rank * rows:(rank + 1) * rows], a)  # for the peers, and the snapshot
    assert staged == (world_size > 1 or return_a)
    if return_a:
        assert torch.equal(a_out, gathered)


@pytest.mark.parametrize("world_size,return_a", [(1, False), (1, True), (2, False), (2, True), (4, False)])
def test_the_installed_call_in_pieces_keeps_the_recipes_protocol(monkeypatch, world_size, return_a):
    """``gather_matmul.in_pieces`` (a call on new addresses) on the same CPU stand-ins as the recipe's launch above:
    the same events in the same order and the same buffers (but a group of one without ``return_a``: the GEMM alone);
    the exchange under a key of the prepared call alone (no address of the call's tensors), the GEMM replayed from
    the call's out, a and b."""
    product = importlib.import_module("kraken.runtime.gather_matmul")
    fake = Events(monkeypatch, recipe)
    events, keys, replays = fake.events, [], []
    monkeypatch.setattr(product, "copy_stream", lambda device: "side")
    monkeypatch.setattr(product, "fork", lambda side: events.append("fork"))
    monkeypatch.setattr(product, "join", lambda side: events.append("join"))
    monkeypatch.setattr(product, "on_stream", lambda side: contextlib.nullcontext())
    monkeypatch.setattr(product, "reset_flags", lambda flags: events.append("reset"))
    monkeypatch.setattr(product.graphs, "graphed", lambda key, run, device: (keys.append(key), run()))
    monkeypatch.setattr(product.replay, "replayed", lambda launcher, launch, args, host_code, keep: (
        replays.append((launch, args)), host_code()))
    rows, k, rank = 3, 16, world_size - 1
    results = []
    for run in ("recipe", "pieces"):
        events.clear()
        torch.manual_seed(0)
        buffers = [torch.full((world_size * rows, k), float("nan"), dtype=torch.bfloat16) for _ in range(world_size)]
        for r in range(world_size - 1):
            buffers[r][r * rows:(r + 1) * rows] = torch.randn(rows, k).to(torch.bfloat16)
        peers = tuple(buffers[r][r * rows:(r + 1) * rows] for r in range(world_size))
        a, b = torch.randn(rows, k).to(torch.bfloat16), torch.randn(k, 8).to(torch.bfloat16)
        a_out = torch.empty_like(buffers[rank]) if return_a else None
        cfg = recipe.plan(rows, 8, k, world_size, {}, sm90.H200_NUM_SMS)
        out = torch.empty(world_size * rows, 8, dtype=torch.bfloat16)
        if run == "recipe":
            recipe.launch(a, b, peers, buffers[rank], out, fake.flags, 0, rank, a_out, **cfg, launcher=fake.launcher)
        else:
            ctx = SimpleNamespace(rank=rank, signal_pad_ptrs=0, group_name="")
            cfg = {**cfg, "peers": peers, "gathered": buffers[rank], "progress": fake.flags, "launcher": fake.launcher}
            product.in_pieces(recipe, ctx, cfg, a, b, out, a_out)
        results.append((list(events), buffers[rank].clone(), a_out))
    (recipe_events, recipe_buffer, recipe_a_out), (events, buffer, a_out) = results
    if world_size == 1 and not return_a:
        assert events == ["all_gather_matmul_kernel"] and keys == [], events
    else:
        assert events == recipe_events, (events, recipe_events)
        assert keys == [(("gather", fake.launcher),)]
        assert torch.equal(buffer.nan_to_num(7), recipe_buffer.nan_to_num(7))
    if return_a:
        assert torch.equal(a_out, recipe_a_out)
    assert [(launch, len(args), args[0].shape) for launch, args in replays] == [(recipe.launch_matmul, 3, out.shape)]


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_a_standalone_gather_flags_every_chunk(monkeypatch, world_size):
    """The installed gather's protocol on CPU stand-ins (``kraken.runtime.progress.start`` with the recipe's exchange,
    this process the last rank): the flags reset before the fork, each peer's chunk copied then flagged (rank + 1
    first), my own rows copied and flagged last, two barriers, the join when the caller waits."""
    import contextlib

    events: list = []

    def forked(key, head, tail, plain, side):  # what graphs.forked launches: the head, the fork, the tail
        head()
        events.append("fork")
        tail()
        return SimpleNamespace(join=lambda device_index: events.append("join"))

    monkeypatch.setattr(progress, "copy_stream", lambda device: SimpleNamespace(device_index=0))
    monkeypatch.setattr(progress, "on_stream", lambda stream: contextlib.nullcontext())
    monkeypatch.setattr(progress, "reset_flags", lambda flags: events.append("reset"))
    monkeypatch.setattr(gather, "set_flag", lambda flags, index, value=1: events.append(("flag", index)))
    monkeypatch.setattr(graphs, "forked", forked)
    rows, rank = 3, world_size - 1
    peers = tuple(torch.randn(rows, 5) for _ in range(world_size))
    out = torch.full((world_size * rows, 5), float("nan"))
    barrier = lambda kernel, grid, *args, **meta: events.append("barrier")  # noqa: E731
    progress.start(gather.launch, peers, 0, rank, out, torch.zeros(world_size, dtype=torch.int32),
                   launcher=barrier).wait()
    order = [(rank + step) % world_size for step in range(1, world_size)]
    assert events == ["reset", "fork", "barrier"] + [("flag", peer) for peer in order] + [
        ("flag", rank), "barrier", "join"], events
    assert torch.equal(out, torch.cat(peers))
