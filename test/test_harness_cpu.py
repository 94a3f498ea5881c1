"""The harness's arithmetic, tables and command line, and the launcher's GPU check (no GPU needed)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from benchmark import cli, harness, registry
from benchmark.cli import parse_args


def rows_for(shape: str, times: dict[str, float | None], status: dict[str, str] | None = None):
    status = status or {}
    return [
        harness.Row("all_reduce", shape, "bfloat16", 2, b, status.get(b, "ok"), us=t, gbps=None if t is None else 100.0 / t,
                    floor_us=3.5)
        for b, t in times.items()
    ]


def test_speedup_and_ratio():
    assert harness.speedup(20.0, 10.0) == 2.0
    assert harness.speedup(10.0, 20.0) == 0.5
    assert harness.speedup(None, 1.0) is None and harness.speedup(1.0, None) is None
    assert harness.ratio(10.5, 10.0) == pytest.approx(1.05)
    assert harness.ratio(1.0, 0.0) is None


def test_table_columns_and_values():
    op = registry.get("all_reduce")
    backends = ["nccl", "triton_1shot", "helion_1shot"]
    rows = rows_for("4096", {"nccl": 20.0, "triton_1shot": 8.0, "helion_1shot": 8.4})
    rows += rows_for("8192", {"nccl": 22.0, "triton_1shot": 11.0, "helion_1shot": None},
                     {"helion_1shot": "FAIL (rel err 1.0e+00)"})
    header, body = harness.table_rows(op, rows, backends)
    assert header == [
        "shape", "nccl us", "triton_1shot us", "helion_1shot us",
        "triton_1shot vs nccl", "helion_1shot vs nccl", "helion_1shot/triton_1shot",
        "nccl GB/s", "triton_1shot GB/s", "helion_1shot GB/s", "floor us",
    ]
    assert body[0] == ["4096", "20.0", "8.0", "8.4", "2.50x", "2.38x", "1.050", "5", "12", "12", "3.5"]
    assert body[1][:7] == ["8192", "22.0", "11.0", "FAIL", "2.00x", "-", "-"]
    assert harness.failures(rows) == ["8192 helion_1shot: FAIL (rel err 1.0e+00)"]


def test_reference_free_backend_is_marked_in_the_header():
    op = registry.Op("demo", "demo", None, {"nccl": None, "matmul": None, "triton": None}, [(1,)], "NUMEL",
                     lambda *a: 1.0, lambda *a: 1.0, reference_free=frozenset({"matmul"}))
    rows = rows_for("1", {"nccl": 20.0, "matmul": 5.0, "triton": 10.0})
    header, body = harness.table_rows(op, rows, ["nccl", "matmul", "triton"])
    assert header[:4] == ["shape", "nccl us", "matmul us (not checked)", "triton us"]
    assert body[0][:6] == ["1", "20.0", "5.0", "10.0", "4.00x", "2.00x"]
    assert registry.get("all_reduce").reference_free == frozenset({"copy"})  # the one-GPU library column only


def test_reference_free_backend_is_run_not_compared(monkeypatch):
    monkeypatch.setattr(harness, "_slowest", lambda value: value)  # one rank, no process group
    ref = torch.ones(4)
    backends = {"nccl": lambda i: ref, "matmul": lambda i: torch.full((2,), 7.0),
                "bad": lambda i: torch.full((2,), float("nan")), "wrong": lambda i: 2 * ref}
    op = registry.Op("demo", "demo", lambda *a: {}, backends, [(1,)], "NUMEL", lambda *a: 1.0, lambda *a: 1.0,
                     reference_free=frozenset({"matmul", "bad"}))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    assert harness.check_backend(op, "matmul", (1,), torch.float32, 0, ref) == "ok"
    assert harness.check_backend(op, "bad", (1,), torch.float32, 0, ref) == "FAIL (not finite)"
    assert harness.check_backend(op, "wrong", (1,), torch.float32, 0, ref).startswith("FAIL (rel err")


def test_an_error_on_one_rank_alone_fails_the_check_on_every_rank(monkeypatch):
    """The ranks agree on the largest of their verdicts: this rank's error (-1) against another rank's pass (0) must
    fail on both, this rank naming its error, not pass as the larger 0."""
    seen = []
    monkeypatch.setattr(harness, "_slowest", lambda value: seen.append(value) or max(value, 0.0))  # the other: ok
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)

    def bad_input(inputs):
        raise ValueError("bad input on this rank")

    op = registry.Op("demo", "demo", lambda *a: {}, {"nccl": lambda i: torch.ones(2), "mine": bad_input}, [(1,)],
                     "NUMEL", lambda *a: 1.0, lambda *a: 1.0)
    assert harness.check_backend(op, "mine", (1,), torch.float32, 0, torch.ones(2)) == "error (bad input on this rank)"
    assert seen == [1.0]


def test_host_table_takes_the_median():
    rows = rows_for("1", {"nccl": 1.0}) + rows_for("2", {"nccl": 1.0}) + rows_for("3", {"nccl": 1.0})
    for row, cost in zip(rows, (5.0, 50.0, 7.0)):
        row.host_us = cost
    assert harness.host_table(rows, ["nccl"]) == (["backend", "host us/call"], [["nccl", "7.0"]])


def test_floor_and_bytes_for_all_reduce():
    op = registry.get("all_reduce")
    n = 1 << 20
    assert op.nvlink_bytes((n,), torch.bfloat16, 2) == n * 2  # 2 (ws-1)/ws * N * 2 bytes at ws=2
    assert op.floor_us((n,), torch.bfloat16, 2) == pytest.approx(n * 2 / 361e3 + 2 * registry.SYNC_US)


def test_parse_shape():
    assert registry.parse_shape("128x4096x4096", "MxNxK") == (128, 4096, 4096)
    assert registry.parse_shape("4096", "NUMEL") == (4096,)
    for bad in ("12a", "0", "4096x4096"):
        with pytest.raises(ValueError, match="bad shape"):
            registry.parse_shape(bad, "NUMEL")


def test_cli_parses_and_rejects():
    args = parse_args(["all_reduce", "--sizes", "4096", "65536", "--backends", "nccl,triton_1shot", "--cuda-graph"])
    assert args.ops == ["all_reduce"] and args.shapes == [(4096,), (65536,)]
    assert args.backends == ["nccl", "triton_1shot"] and args.cuda_graph
    assert parse_args([]).ops == list(registry.load_all())
    for argv in (["no_such_op"], ["all_reduce", "--backends", "mpi"], ["all_reduce", "--shapes", "x"],
                 ["all_reduce", "--iters", "0"]):
        with pytest.raises(SystemExit) as exc:
            parse_args(argv)
        assert exc.value.code == 2


def test_every_op_is_complete():
    for op in registry.load_all().values():
        assert op.baseline.startswith("nccl"), op.name  # NCCL first (context-parallel attention names its SDPA)
        assert op.default_shapes and all(len(s) == len(op.shape_format.split("x")) for s in op.default_shapes)
        for pair in op.pairs:
            assert pair.triton_module.startswith("kraken.") and pair.helion_module.startswith("helion_ports.")
            assert pair.triton_module.split(".", 1)[1] == pair.helion_module.split(".", 1)[1], "twins share a name"


@pytest.mark.skipif(torch.cuda.device_count() >= 1, reason="checks the message shown on machines without a GPU")
def test_benchmark_without_gpus_exits_with_one_clear_sentence():
    result = subprocess.run([sys.executable, "-m", "benchmark", "all_reduce"], capture_output=True, text=True)
    assert result.returncode != 0
    assert "needs at least 1 CUDA GPU" in result.stderr and "found no CUDA GPU" in result.stderr
    assert "Traceback" not in result.stderr


def test_inspector_prints_both_sides(capsys):
    from benchmark import inspect as inspector

    inspector.main(["all_reduce"])
    out = capsys.readouterr().out
    assert "triton_1shot vs helion_1shot" in out and "triton_2shot vs helion_2shot" in out
    lines = [line for line in out.splitlines() if line.startswith("| triton") or line.startswith("| helion")]
    assert len(lines) == 2 * len(registry.get("all_reduce").pairs)
    assert all(line.rstrip(" |").split("|")[-1].strip() == "4" for line in lines), "4 barrier atomics each"


def test_inspector_compiles_a_given_shape(capsys):
    from benchmark import inspect as inspector

    inspector.main(["gemm_all_reduce", "--shape", "64x4096x4096"])
    out = capsys.readouterr().out
    assert "shape 64x4096x4096" in out
    rows = [[c.strip() for c in line.strip(" |").split("|")] for line in out.splitlines() if line.startswith(("| triton", "| helion"))]
    assert [r[0] for r in rows] == ["triton", "helion"]
    shared = [int(r[6]) for r in rows]
    # 64x64 tiles (world size 2 pushes), 128-deep k steps, 5 stages: (64 x 128 + 128 x 64) bf16 x 5 (+ barriers),
    # on both sides.
    assert shared[0] == shared[1] >= (64 * 128 + 128 * 64) * 2 * 5
    with pytest.raises(SystemExit):
        inspector.main(["--shape", "64x4096x4096"])  # a shape needs its op
    with pytest.raises(SystemExit):
        inspector.main(["gemm_all_reduce", "--shape", "64x4096"])
    assert "expected MxNxK" in capsys.readouterr().err


def test_only_helions_autotuner_cap_warning_is_silenced():
    """Importing the twins' building blocks (``kraken._blocks.helion``) silences Helion's autotuner-cap warning
    (printed on every twin compile) and nothing else. In a fresh process: pytest resets warning filters around each
    test."""
    code = (
        "import warnings, kraken._blocks.helion\n"
        "warnings.warn('max_num_sm_multipler is reduced from 64 to 8 due to the restriction of "
        "_SymmetricMemory.signal_pad_size=9216.', UserWarning)\n"
        "warnings.warn('something else', UserWarning)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert "something else" in result.stderr and "max_num_sm_multipler" not in result.stderr


def test_world_size_env_is_checked(monkeypatch):
    from benchmark import launch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.delenv(launch.WORLD_SIZE_ENV, raising=False)
    assert launch.default_world_size() == 1
    monkeypatch.setenv(launch.WORLD_SIZE_ENV, "4")
    assert launch.default_world_size() == 4
    for bad in ("0", "two", "-2"):
        monkeypatch.setenv(launch.WORLD_SIZE_ENV, bad)
        with pytest.raises(ValueError, match="KRAKEN_WORLD_SIZE must be a positive integer"):
            launch.default_world_size()


def test_ranks_share_a_gpu_only_when_asked_and_never_for_timings(monkeypatch):
    """Two ranks on one GPU: gloo and overlapping symmetric memory with KRAKEN_WORLD_SIZE set; without it, an
    error naming the variable; the benchmark refuses it either way (its timings would mean nothing)."""
    from benchmark import launch

    calls = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: calls.append(("device", device)))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: calls[-1][1])
    monkeypatch.setattr(launch.dist, "init_process_group", lambda backend, **kw: calls.append((backend, kw)))
    monkeypatch.delenv("TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES", raising=False)
    monkeypatch.delenv(launch.WORLD_SIZE_ENV, raising=False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    with pytest.raises(RuntimeError, match="rank 1: no CUDA GPU is visible"):
        launch.init(1, 2)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(RuntimeError, match="2 ranks on this node but 1 GPU.*KRAKEN_WORLD_SIZE=2"):
        launch.init(1, 2)
    assert not any(call[0] in ("gloo", "nccl") for call in calls)
    assert "TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES" not in os.environ

    monkeypatch.setenv(launch.WORLD_SIZE_ENV, "2")
    calls.clear()
    launch.init(1, 2)
    assert calls == [("device", 0), ("gloo", {"rank": 1, "world_size": 2})]
    assert os.environ["TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES"] == "1"
    with pytest.raises(SystemExit, match="times kernels, one rank per GPU"):
        launch.require_gpus("python -m benchmark")  # 2 ranks on 1 GPU
    monkeypatch.delenv(launch.WORLD_SIZE_ENV)
    assert launch.require_gpus("python -m benchmark") == 1  # one GPU: world size 1
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    with pytest.raises(SystemExit, match="needs at least 1 CUDA GPU"):
        launch.require_gpus("python -m benchmark")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    with pytest.raises(SystemExit, match="times kernels, one rank per GPU: unset KRAKEN_WORLD_SIZE"):
        monkeypatch.setenv(launch.WORLD_SIZE_ENV, "4")
        launch.require_gpus("python -m benchmark")
    monkeypatch.setenv(launch.WORLD_SIZE_ENV, "2")
    assert launch.require_gpus("python -m benchmark") == 2
    calls.clear()
    monkeypatch.delenv("TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES")
    launch.init(1, 2)
    assert calls[0] == ("device", 1) and calls[1][0] == "nccl"
    assert "TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES" not in os.environ


def test_core_table_at_world_size_1():
    """World size 1: per shape and recipe/twin pair, the library column, ratios, the rate and the eager loop's
    distance from the GPU time; no core table at 2+ ranks."""
    op = registry.get("gemm_all_reduce")
    times = {"nccl": 30.0, "matmul": 10.0, "triton": 12.0, "helion": 12.6}
    rows = [harness.Row(op.name, "256x4096x4096", "bfloat16", 1, b, "ok", us=t, loop_us=t + 5.0) for b, t in times.items()]
    header, body = harness.core_rows(op, rows, list(times))
    assert header[:8] == ["shape", "recipe", "matmul us", "recipe us", "twin us", "recipe TFLOP/s", "recipe/library",
                          "twin/recipe"]
    tflops = 2 * 256 * 4096 * 4096 / 12.0 / 1e6
    assert body == [["256x4096x4096", "triton", "10.0", "12.0", "12.6", f"{tflops:.1f}", "1.20", "1.050",
                     "15.0", "17.0", "17.6", "5.0", "5.0"]]
    assert harness.CORE_LABEL in harness.tables_markdown(op, rows, list(times))
    # With the loop's own GPU time (long loops of big kernels run at lower clocks than the timed bursts), the
    # host's share is the loop over that, not over ``us``.
    rows[2].loop_gpu_us, rows[3].loop_gpu_us = 16.5, 12.6
    assert harness.core_rows(op, rows, list(times))[1][0][-2:] == ["0.5", "5.0"]
    for row in rows:
        row.world_size = 2
    assert harness.CORE_LABEL not in harness.tables_markdown(op, rows, list(times))


def test_a_composed_op_pairs_its_triton_and_helion_backends_in_the_core_table():
    """tp_mlp has no kernel of its own (no ``pairs``): its core table pairs ``triton`` with ``helion`` and
    ``triton_compiled`` with ``helion_compiled`` against the library's matmul."""
    op = registry.get("tp_mlp")
    assert not op.pairs and harness.core_pairs(op) == [("triton", "helion"), ("triton_compiled", "helion_compiled")]
    times = {"matmul": 100.0, "triton": 110.0, "helion": 121.0, "triton_compiled": 99.0, "helion_compiled": 99.0}
    rows = [harness.Row(op.name, "2048x4096x14336", "bfloat16", 1, b, "ok", us=t) for b, t in times.items()]
    _, body = harness.core_rows(op, rows, list(times))
    assert [(r[1], r[6], r[7]) for r in body] == [("triton", "1.10", "1.100"), ("triton_compiled", "0.99", "1.000")]
    assert harness.core_pairs(registry.get("all_reduce"))[0] == ("triton_1shot", "helion_1shot")


def test_copy_column_moves_the_same_bytes():
    op = registry.get("all_reduce")
    assert op.library == "copy" and "copy" in op.reference_free
    inputs = {"plain": torch.arange(10.0)}
    out = op.backends["copy"](inputs)
    assert torch.equal(out, inputs["plain"]) and out.data_ptr() != inputs["plain"].data_ptr()
    assert op.backends["copy"](inputs) is out  # the buffer is kept: no allocation inside the timed loop
    assert op.work((1 << 20,), torch.bfloat16) == (2.0 * (1 << 20) * 2, "byte")
    rows = [harness.Row("all_reduce", "1048576", "bfloat16", 1, b, "ok", us=t) for b, t in
            {"copy": 2.0, "triton_1shot": 4.0, "helion_1shot": 4.0}.items()]
    _, body = harness.core_rows(op, rows, ["copy", "triton_1shot", "helion_1shot"])
    assert body[0][5] == f"{4 * (1 << 20) / 4.0 / 1e3:.1f}" and body[0][6] == "2.00"  # GB/s, recipe/library


def test_every_op_names_its_single_gpu_library():
    """Every registered op has a core-table library column (the core alone or a copy, timed but not compared;
    or SDPA, which computes the whole op and is compared), and the work for its TFLOP/s or GB/s column."""
    for op in registry.load_all().values():
        assert op.library in op.backends, op.name
        amount, kind = op.work(op.default_shapes[0], torch.bfloat16)
        assert amount > 0 and kind in ("flop", "byte"), op.name


def test_eager_loop_length_follows_the_gpu_time():
    settings = harness.Settings()
    assert harness.loop_calls(4.0, settings) == settings.max_loop_calls  # a small collective: 200 calls
    assert harness.loop_calls(100.0, settings) == 50
    assert harness.loop_calls(300000.0, settings) == settings.loop_calls  # a long attention: the minimum


def test_a_backend_that_cannot_compile_is_an_error_row_not_a_crash(monkeypatch):
    monkeypatch.setattr(harness, "_slowest", lambda value: value)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)

    def recompiles(inputs):
        raise torch._dynamo.exc.FailOnRecompileLimitHit("Hard failure due to fullgraph=True")

    op = registry.Op("demo", "demo", lambda *a: {}, {"nccl": lambda i: torch.ones(2), "compiled": recompiles}, [(1,)],
                     "NUMEL", lambda *a: 1.0, lambda *a: 1.0)
    assert harness.check_backend(op, "compiled", (1,), torch.float32, 0, torch.ones(2)).startswith("error (Hard failure")


def test_an_eager_only_backend_is_a_row_that_says_so_under_cuda_graphs(monkeypatch):
    """A backend that cannot be captured in a CUDA graph (torch's context parallelism) is not run under
    ``--cuda-graph``: its row says why, and the op's table still comes out (it took the whole op down before)."""
    monkeypatch.setattr(harness.dist, "get_world_size", lambda group=None: 1)

    def captured(inputs):
        raise RuntimeError("Cannot copy between CPU and CUDA tensors during CUDA graph capture")

    op = registry.Op("demo", "demo", lambda *a: {}, {"nccl": lambda i: torch.ones(2), "torch_cp": captured}, [(1,)],
                     "NUMEL", lambda *a: 1.0, lambda *a: 1.0, eager_only=frozenset({"torch_cp"}))
    (row,) = harness.run_op(op, [(1,)], ["torch_cp"], torch.float32, harness.Settings(cuda_graph=True))
    assert row.status == harness.EAGER_ONLY and row.us is None and row.mode == "cuda-graph"
    assert harness.failures([row]) == [f"1 torch_cp: {harness.EAGER_ONLY}"]
    cp = registry.get("context_parallel_attention")
    assert cp.eager_only == {"torch_cp"} and cp.eager_only <= cp.backends.keys()
    # The NCCL MoE dispatch brings its splits to the host: still the baseline (the reference is computed eagerly).
    dispatch = registry.get("moe_dispatch")
    assert dispatch.eager_only == {"nccl"} and dispatch.baseline == "nccl"


def test_spawn_retries_a_taken_rendezvous_port(monkeypatch):
    """A port taken between ``_free_port`` and rank 0's store (many launches side by side): fresh ports, up to
    ``PORT_ATTEMPTS``, then a clear error."""
    from benchmark import launch

    tries = []

    def once(fn, args, world_size, stall_s, name):
        tries.append(world_size)
        if len(tries) < 3:
            raise launch._PortTaken()
        return ["ok"] * world_size

    monkeypatch.setattr(launch, "_spawn_once", once)
    assert launch.spawn(print, world_size=2) == ["ok", "ok"] and tries == [2, 2, 2]
    tries.clear()
    monkeypatch.setattr(launch, "PORT_ATTEMPTS", 2)
    with pytest.raises(launch.WorkerError, match="port was taken 2 times"):
        launch.spawn(print, world_size=2)
    assert len(tries) == 2


class FakeClock:
    """CUDA events on a fake GPU: each call of a timed function costs its ``cost`` us, plus ``drift`` us more for
    every call made before it (clocks slowing down over a run); an event reads the time of the calls so far."""

    def __init__(self, drift: float = 0.0):
        self.now, self.calls, self.drift, self.log = 0.0, 0, drift, []

    def fn(self, name: str, cost: float):
        def call():
            self.now += cost + self.drift * self.calls
            self.calls += 1
            self.log.append(name)
        return call

    def event(self, enable_timing=False):
        clock = self

        class Event:
            def record(self):
                self.t = clock.now

            def elapsed_time(self, end):  # milliseconds, as CUDA's
                return (end.t - self.t) * 1e-3

        return Event()


def test_backends_take_turns_burst_by_burst_and_drift_reaches_each_alike(monkeypatch):
    clock, sleeps = FakeClock(drift=0.01), []
    monkeypatch.setattr(torch.cuda, "Event", clock.event)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(harness.dist, "barrier", lambda: None)
    monkeypatch.setattr(harness, "_sleep_us", sleeps.append)
    settings = harness.Settings(iters=60, burst=3)
    fast, slow = clock.fn("fast", 10.0), clock.fn("slow", 12.0)
    fast_us, slow_us = harness.device_times_us([fast, slow], settings, [5.0, 1.0], [10.0, 1e6])
    # 10 pairs of rounds (20 bursts asked): a burst of 3 calls of each, the order reversed every other round
    assert clock.log == (["fast"] * 3 + ["slow"] * 3 + ["slow"] * 3 + ["fast"] * 3) * 10
    # Each pair's mean has the same drift in it for both: exactly their cost apart.
    assert 10.0 < fast_us < 11.5 and abs((slow_us - fast_us) - 2.0) < 1e-9
    # Before each burst a rest: REST x its GPU time (fast: 3 x 3 x 10 us), or what covers the host enqueueing it
    # (2 x 3 x 5 us) if more, at most MAX_SLEEP_US (slow's estimate is a second a call); plus 10 us.
    fast_rest, slow_rest = 3 * 3 * 10.0 + 10.0, harness.MAX_SLEEP_US + 10.0
    assert sleeps == [fast_rest, slow_rest, slow_rest, fast_rest] * 10
    clock.log.clear()
    sleeps.clear()
    (alone,) = harness.device_times_us([fast], harness.Settings(iters=2, burst=1), [5.0], [1.0])
    assert clock.log == ["fast"] * 6 and alone > 10.0  # at least 5 bursts, rounded up to 3 pairs
    assert sleeps == [2 * 5.0 + 10.0] * 6  # the host's enqueueing is the longer
    assert harness.device_time_us(fast, harness.Settings(iters=10, burst=10), 5.0) > 10.0


def test_eager_loops_start_on_a_rested_gpu(monkeypatch):
    """Both eager loops follow a rest of REST x their GPU work (at most MAX_SLEEP_US); the unqueued one waits for
    its rest to end before it launches, so the host is not hidden, and the two run at the same clocks."""
    clock, events = FakeClock(), []
    monkeypatch.setattr(torch.cuda, "Event", clock.event)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: events.append("sync"))
    monkeypatch.setattr(harness.dist, "barrier", lambda: None)
    monkeypatch.setattr(harness, "_sleep_us", events.append)
    gemm = clock.fn("gemm", 100.0)
    loop_us, gpu_us = harness.eager_loop_us(lambda: (events.append("call"), gemm()), 4, 100.0)
    rest = harness.REST * 100.0 * 4
    assert events == ["sync", rest, "sync", *["call"] * 4, "sync", "sync", rest, *["call"] * 4, "sync"]
    assert loop_us == gpu_us == 100.0
    events.clear()
    harness.eager_loop_us(lambda: (events.append("call"), gemm()), 4, 1e9)
    assert [e for e in events if not isinstance(e, str)] == [harness.MAX_SLEEP_US] * 2


def test_eager_loops_keep_the_median_of_their_repeats(monkeypatch):
    """``repeats`` pairs of loops, each pair as above; a host hiccup in one loop does not move the figure."""
    clock, events = FakeClock(), []
    monkeypatch.setattr(torch.cuda, "Event", clock.event)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(harness.dist, "barrier", lambda: None)
    monkeypatch.setattr(harness, "_sleep_us", events.append)
    # per call, loop by loop: (unqueued, queued) x 3, with a hiccup in the second unqueued loop
    costs = iter([10.0] * 4 + [10.0] * 4 + [90.0] * 4 + [10.0] * 4 + [11.0] * 4 + [12.0] * 4)
    step = clock.fn("step", 0.0)

    def call():
        clock.now += next(costs)
        step()

    loop_us, gpu_us = harness.eager_loop_us(call, 4, 10.0, repeats=3)
    assert len(events) == 6  # a rest before each of the six loops
    assert loop_us == 11.0 and gpu_us == 10.0  # medians of (10, 90, 11) and (10, 10, 12)


def test_run_op_times_a_shapes_backends_together(monkeypatch):
    """run_op checks, warms up and host-times each backend, then times them all in one interleaved run
    (device_times_us), then runs each one's eager loop: every row gets its own time."""
    clock = FakeClock()
    monkeypatch.setattr(torch.cuda, "Event", clock.event)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(harness.dist, "barrier", lambda: None)
    monkeypatch.setattr(harness.dist, "get_world_size", lambda group=None: 1)
    monkeypatch.setattr(harness, "_sleep_us", lambda us: None)
    monkeypatch.setattr(harness, "_slowest", lambda value: value)
    calls = {"nccl": clock.fn("nccl", 10.0), "triton": clock.fn("triton", 8.0)}
    backends = {name: (lambda inputs, call=call: (call(), torch.ones(2))[1]) for name, call in calls.items()}
    op = registry.Op("demo", "demo", lambda *a: {}, backends, [(1,)], "NUMEL", lambda *a: 100.0, lambda *a: 1.0)
    settings = harness.Settings(iters=20, burst=2, warmup=1, host_calls=1, loop_calls=3, max_loop_calls=3)
    rows = harness.run_op(op, [(1,), (2,)], ["nccl", "triton"], torch.float32, settings)
    assert [(r.shape, r.backend, r.status) for r in rows] == [
        (s, b, "ok") for s in ("1", "2") for b in ("nccl", "triton")]
    assert [r.us for r in rows] == [10.0, 8.0, 10.0, 8.0] and [r.loop_us for r in rows] == [10.0, 8.0, 10.0, 8.0]
    assert all(r.gbps == 100.0 / (r.us * 1e3) for r in rows)
    interleaved = (["nccl"] * 2 + ["triton"] * 4 + ["nccl"] * 2) * 5  # 10 bursts asked: 5 pairs of rounds
    text, pattern = " ".join(clock.log), " ".join(interleaved)
    assert text.count(pattern) == 2  # once per shape
    # per shape: the reference and 2 checks, 2 x 2 warm-ups (one untimed), 2 host calls, 40 timed, 3 repeats of
    # 6 + 6 in the loops
    assert len(clock.log) == 2 * (1 + 2 + 4 + 2 + 40 + 3 * (6 + 6))


def work_op(shapes, work=None):
    """An op whose work per call is the first dimension (or ``work``'s), for the shape-order tests."""
    return registry.Op("demo", "demo", None, {"nccl": None}, shapes, "MxN", lambda *a: 1.0, lambda *a: 1.0,
                       work=work or (lambda shape, dtype: (float(shape[0]), "flop")))


def test_quick_shapes_are_the_smallest_the_middle_and_the_largest_by_work():
    op = work_op([(8, 1), (1, 1), (64, 1), (2, 1), (16, 1), (4, 1), (32, 1)])
    assert harness.by_work(op, op.default_shapes, torch.bfloat16)[:3] == [(1, 1), (2, 1), (4, 1)]
    assert harness.quick_shapes(op, torch.bfloat16) == [(1, 1), (8, 1), (64, 1)]
    assert harness.quick_shapes(op, torch.bfloat16, count=2) == [(1, 1), (64, 1)]
    assert harness.quick_shapes(op, torch.bfloat16, count=1) == [(8, 1)]
    assert harness.quick_shapes(work_op([(4, 1), (2, 1)]), torch.bfloat16) == [(2, 1), (4, 1)]  # all, by work
    # Ties by the shape; without ``work``, the product of the dimensions.
    plain = registry.Op("demo", "demo", None, {}, [(4, 4), (2, 8), (1, 2)], "MxN", None, None)
    assert harness.by_work(plain, plain.default_shapes, torch.bfloat16) == [(1, 2), (2, 8), (4, 4)]
    assert harness.texts_by_work(op, ["64x1", "2x1", "16x1"], "bfloat16") == ["2x1", "16x1", "64x1"]
    for entry in registry.load_all().values():
        quick = harness.quick_shapes(entry, torch.bfloat16)
        ordered = harness.by_work(entry, entry.default_shapes, torch.bfloat16)
        assert len(quick) == min(3, len(ordered)) and set(quick) <= set(entry.default_shapes), entry.name
        assert quick[0] == ordered[0] and quick[-1] == ordered[-1], entry.name


def test_no_op_is_a_quick_look_and_full_or_an_op_is_the_sweep():
    quick = parse_args([])
    assert quick.quick and (quick.iters, quick.warmup, quick.row_budget_s) == (20, 3, 20.0)
    full = parse_args(["--full"])
    assert not full.quick and (full.iters, full.warmup, full.row_budget_s) == (200, 20, 120.0)
    assert full.ops == quick.ops == list(registry.load_all())
    named = parse_args(["all_reduce"])
    assert not named.quick and named.iters == 200
    assert parse_args(["all_reduce", "--quick"]).quick
    explicit = parse_args(["--iters", "7", "--warmup", "0", "--row-budget-s", "0"])  # given values win
    assert explicit.quick and (explicit.iters, explicit.warmup, explicit.row_budget_s) == (7, 0, None)
    op = registry.get("all_reduce")
    assert cli.shapes_of(quick, op) == harness.quick_shapes(op, torch.bfloat16)
    assert cli.shapes_of(named, op) == op.default_shapes
    assert cli.shapes_of(parse_args(["all_reduce", "--quick", "--shapes", "4096"]), op) == [(4096,)]
    for argv in (["--quick", "--full"], ["--row-budget-s", "-1"]):
        with pytest.raises(SystemExit):
            parse_args(argv)


def test_progress_estimates_the_time_left_from_the_rows_done():
    assert harness.eta_s(30.0, 10, 40) == 90.0 and harness.eta_s(30.0, 0, 40) is None
    assert harness.eta_s(30.0, 40, 40) == 0.0
    assert [harness.duration(s) for s in (None, 4.4, 65, 3725)] == ["?", "4 s", "1m05s", "1h02m"]
    now = [100.0]
    progress = harness.Progress(12, clock=lambda: now[0])
    now[0] += 60.0
    assert progress.advance(3, "all_reduce 4096") == (
        "  [all_reduce 4096] done in 1m00s: 3/12 rows, 1m00s elapsed, about 3m00s left")
    now[0] += 30.0
    assert progress.advance(3, "all_reduce 8192").endswith("done in 30 s: 6/12 rows, 1m30s elapsed, about 1m30s left")


def test_the_row_budget_shortens_or_skips_a_slow_backend():
    settings = harness.Settings(iters=20, burst=10, host_calls=20, loop_calls=20, loop_repeats=3, row_budget_s=20)
    assert harness.timing_bursts(settings) == (10, 6)
    # 10 ms a call: 20 host + 60 timed + 2 x 3 x 20 loop calls = 2 s, within 20 s: as asked
    assert harness.row_plan(10e3, settings) == harness.RowPlan(10, 20, True)
    # 200 ms a call: 40 s asked; 100 calls fit: one host call, no eager loop, bursts of 10 still fit (61 calls)
    plan = harness.row_plan(200e3, settings)
    assert (plan.burst, plan.host_calls, plan.eager_loop, plan.skip) == (10, 1, False, None)
    assert plan.note == "no eager loop: 0.2 s/call over the 20 s row budget"
    # 1 s a call: 20 calls fit: bursts of 3 (6 x 3 + 1 = 19)
    plan = harness.row_plan(1e6, settings)
    assert (plan.burst, plan.host_calls, plan.eager_loop) == (3, 1, False)
    assert plan.note == "bursts of 3, no eager loop: 1 s/call over the 20 s row budget"
    # 3.2 s a call: not even 6 bursts of one call fit
    assert harness.row_plan(3.2e6, settings).skip == "skipped: 3.2 s/call over the 20 s row budget"
    assert harness.row_plan(3.2e6, harness.Settings(row_budget_s=None)) == harness.RowPlan(10, 20, True)
    graph = harness.Settings(iters=20, burst=10, cuda_graph=True, row_budget_s=20)  # + one replay after capture
    assert harness.row_plan(200e3, graph) == harness.RowPlan(10, 20, False)  # 20 + 70 calls fit
    assert harness.row_plan(300e3, graph).note == "bursts of 9: 0.3 s/call over the 20 s row budget"  # 1 + 7 x 9
    # The warm-up: at most a quarter of the budget, at least one call after the first
    assert harness.warmup_calls(10e3, settings) == 20
    assert harness.warmup_calls(1e6, harness.Settings(warmup=20, row_budget_s=20)) == 5
    assert harness.warmup_calls(9e6, harness.Settings(warmup=20, row_budget_s=20)) == 1
    assert harness.warmup_calls(9e6, harness.Settings(warmup=0, row_budget_s=20)) == 0
    assert harness.warmup_calls(9e6, harness.Settings(warmup=20)) == 20


def test_device_times_take_each_backends_own_burst(monkeypatch):
    clock, sleeps = FakeClock(), []
    monkeypatch.setattr(torch.cuda, "Event", clock.event)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(harness.dist, "barrier", lambda: None)
    monkeypatch.setattr(harness, "_sleep_us", sleeps.append)
    fast, slow = clock.fn("fast", 10.0), clock.fn("slow", 1000.0)
    times = harness.device_times_us([fast, slow], harness.Settings(iters=20, burst=4), [1.0, 1.0], [10.0, 1000.0],
                                    [4, 1])
    assert times == [10.0, 1000.0]
    assert clock.log == (["fast"] * 4 + ["slow"] + ["slow"] + ["fast"] * 4) * 3  # 6 bursts of each, own sizes
    assert sleeps[:2] == [4 * 3 * 10.0 + 10.0, 1 * 3 * 1000.0 + 10.0]


def test_run_op_agrees_on_the_row_budget_with_the_slowest_rank(monkeypatch):
    """The row plan follows the slowest rank's warm-up (here another rank, 1 s a call, while this one takes 1 ms):
    this rank times that backend in bursts of 3 with no eager loop, launching what the other rank launches; a
    backend at 5 s a call on the other rank is skipped, its cell says why; the progress line follows each shape."""
    clock = FakeClock()
    monkeypatch.setattr(torch.cuda, "Event", clock.event)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(harness.dist, "barrier", lambda: None)
    monkeypatch.setattr(harness.dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(harness, "_sleep_us", lambda us: None)
    other_rank = {"slow": 1e6, "slower": 5e6}
    current = []
    # The other rank's time per call of the backend that ran last (checks agree: 0 is a pass)
    monkeypatch.setattr(harness, "_slowest", lambda value: value and max(value, other_rank.get(current[-1], 0.0)))
    printed = []
    monkeypatch.setattr(harness, "print_rank0", lambda *args, **kwargs: printed.append(args[0]))
    calls = {name: clock.fn(name, 1000.0) for name in ("nccl", "slow", "slower")}

    def backend(name):
        def run(inputs):
            current.append(name)
            calls[name]()
            return torch.ones(2)
        return run

    op = registry.Op("demo", "demo", lambda *a: {}, {n: backend(n) for n in calls}, [(1,)], "NUMEL",
                     lambda *a: 100.0, lambda *a: 1.0)
    settings = harness.Settings(iters=20, burst=10, warmup=3, host_calls=20, loop_calls=20, loop_repeats=3,
                                row_budget_s=20)
    now = [0.0]
    progress = harness.Progress(3, clock=lambda: now[0])
    rows = harness.run_op(op, [(1,)], list(calls), torch.float32, settings, progress=progress)
    nccl, slow, slower = rows
    assert nccl.status == slow.status == "ok" and nccl.note == "" and nccl.loop_us == nccl.us == 1000.0
    assert slow.note == "bursts of 3, no eager loop: 1 s/call over the 20 s row budget" and slow.loop_us is None
    assert slower.status == "skipped: 5 s/call over the 20 s row budget" and slower.us is None
    log = clock.log
    # slow: the check, the first call, 3 warm-up calls (a quarter of 20 s holds 5), one host call and 6 bursts of 3;
    # slower: the check, the first call and 1 warm-up call (a quarter of 20 s holds none: at least 1)
    assert log.count("slow") == 1 + 1 + 3 + 1 + 6 * 3 and log.count("slower") == 1 + 1 + 1
    header, body = harness.table_rows(op, rows, list(calls))
    assert body[0][3] == "skipped: 5 s/call over the 20 s row budget"
    assert harness.shortened(rows) == ["1 slow: bursts of 3, no eager loop: 1 s/call over the 20 s row budget"]
    assert printed[-1] == "  [demo 1] done in 0 s: 3/3 rows, 0 s elapsed, about 0 s left"
