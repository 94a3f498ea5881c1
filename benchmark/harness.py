"""The one benchmark harness: check every backend, time it, print the side-by-side table.

For each op, shape and backend, on every rank:

1. check: run the backend once on fresh random inputs (the same seed the
   baseline got) and compare with the baseline's result; a backend that fails on
   any rank is marked FAIL on all and not timed (an op's ``reference_free``
   backends, which compute only part of the op, are run but not compared: their
   column says "not checked");
2. host cost: the wall time of a burst of calls queued behind a GPU sleep, i.e.
   what eager dispatch costs per call (Helion's wrapper included);
3. time: warm up, then a fixed number of iterations (identical on every rank,
   so barrier kernels always pair up) queued behind a short GPU sleep so the GPU
   rather than the Python launch path is measured. Iterations run in bursts of
   ``burst`` back-to-back calls with CUDA events around each burst (optionally
   after an L2 flush), or around a CUDA graph of one burst with ``--cuda-graph``;
   the median burst / ``burst`` per rank, then the slowest rank's median. A
   shape's backends take turns, one burst each per round, in an order reversed
   every other round (``device_times_us``), so a drift of the GPU's clocks over
   the run reaches every backend alike instead of whichever was timed last, and
   each burst follows a GPU rest three times its length (``REST``: a sustained
   load of big kernels lowers the H200's clocks by a quarter after ~60 ms). Events
   around every single call would add their own ~2.5 us to each call (measured
   on H200: a 1-us ``add_`` reads 5.0 us that way, 2.4 us in bursts), for every
   backend alike, NCCL included;
4. eager loop (eager mode only): ``loop_calls`` back-to-back calls with no sleep
   in front, what a user's Python loop sees: where the host's launch path is
   slower than the GPU work, this is slower than step 3. The median of
   ``loop_repeats`` such loops, beside the median GPU time of the same loops.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
import statistics
import sys
import time
from typing import Callable

import torch
import torch.distributed as dist

from benchmark.launch import heartbeat, print_rank0
from benchmark.registry import Op, Shape

SM_CLOCK_GHZ = 1.98  # H200 boost clock, to turn a sleep in microseconds into cycles
L2_FLUSH_BYTES = 256 << 20


@dataclass
class Settings:
    iters: int = 200
    warmup: int = 20
    cuda_graph: bool = False
    burst: int = 10  # back-to-back calls between two events (or in one CUDA graph); time / burst = one call
    l2_flush: bool = False
    seed: int = 0
    host_calls: int = 20
    # Back-to-back calls of the eager-loop measurement (what a Python loop sees): about LOOP_US of GPU work,
    # between loop_calls and max_loop_calls (a few calls of a 300-ms attention, 200 of a 5-us collective).
    loop_calls: int = 20
    max_loop_calls: int = 200
    # Each eager loop is run this many times (each after its own rest) and the median kept: one loop of a 5-us op
    # lasts a few milliseconds, and one host hiccup in it moved its per-call figure by 5 us.
    loop_repeats: int = 3


@dataclass
class Row:
    op: str
    shape: str
    dtype: str
    world_size: int
    backend: str
    status: str  # "ok", "FAIL (...)", "error (...)"
    us: float | None = None
    host_us: float | None = None
    loop_us: float | None = None  # eager only: per call in a loop of back-to-back calls with no sleep in front
    # eager only: the GPU time of that same loop, its calls queued behind a GPU sleep (the host hidden): what
    # ``loop_us`` would be with a free host. A long loop of big kernels can run slower on the GPU than the bursts
    # of ``us`` (cuBLAS: 595 us in bursts, 665 in a 20-call loop), so the host's share is ``loop_us - loop_gpu_us``.
    loop_gpu_us: float | None = None
    gbps: float | None = None
    floor_us: float | None = None
    mode: str = "eager"
    checked: bool = True  # False for the op's reference_free backends (timed, not compared)
    meta: dict = field(default_factory=dict)  # where it was measured (benchmark.provenance.FIELDS)


# ---------------------------------------------------------------------------
# Measuring (GPU)
# ---------------------------------------------------------------------------


def _sleep_us(us: float) -> None:
    torch.cuda._sleep(int(us * SM_CLOCK_GHZ * 1e3))


def _slowest(value: float) -> float:
    """The largest value over all ranks."""
    t = torch.tensor([value], dtype=torch.float64, device="cuda")
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def host_cost_us(fn: Callable[[], object], calls: int) -> float:
    """Host wall time per call while the GPU is busy (so launches never block on it)."""
    torch.cuda.synchronize()
    dist.barrier()
    _sleep_us(20000)
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    elapsed = time.perf_counter() - start
    torch.cuda.synchronize()
    return elapsed / calls * 1e6


LOOP_US = 5000.0


def loop_calls(gpu_us: float, settings: Settings) -> int:
    """How many calls the eager loop makes: about ``LOOP_US`` of GPU work, within the settings' bounds (the same
    on every rank: ``gpu_us`` is the slowest rank's)."""
    return int(min(settings.max_loop_calls, max(settings.loop_calls, LOOP_US // max(gpu_us, 1e-3))))


def eager_loop_us(fn: Callable[[], object], calls: int, gpu_us: float, repeats: int = 1) -> tuple[float, float]:
    """What a user's eager Python loop sees per call, and its GPU time: ``calls`` back-to-back calls with CUDA
    events around them and nothing queued in front, so the host's launch path shows wherever it is slower than
    the GPU; then the same calls queued behind a GPU sleep (the host hidden), for the GPU time of that loop. The
    pair is run ``repeats`` times; each figure is its median.

    Both loops start on a GPU rested ``REST`` times the loop's work (``gpu_us`` per call; at most ``MAX_SLEEP_US``):
    the first waits for its rest to end before it launches anything, the second is queued behind it. Unrested, a
    loop of big GEMMs run right after another one starts at a hot GPU's lower clocks (up to 13% longer per call)
    and the difference would read as host time."""
    rest_us = min(MAX_SLEEP_US, REST * gpu_us * calls)
    unqueued, queued_times = [], []
    for _ in range(repeats):
        for queued in (False, True):
            torch.cuda.synchronize()
            dist.barrier()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            if queued:  # the rest, or a sleep that covers the host enqueueing every call twice over (at most 200 ms)
                _sleep_us(max(rest_us, min(MAX_SLEEP_US, 2.0 * unqueued[-1] * calls + 100.0)))
            elif rest_us > 0:
                _sleep_us(rest_us)
                torch.cuda.synchronize()
            start.record()
            for _ in range(calls):
                fn()
            end.record()
            torch.cuda.synchronize()
            (queued_times if queued else unqueued).append(start.elapsed_time(end) * 1e3 / calls)
    return statistics.median(unqueued), statistics.median(queued_times)


# Rest before each timed burst, in multiples of the burst's own GPU time (at most MAX_SLEEP_US). On the H200, a
# cuBLAS GEMM run back to back held 1980 MHz for about 60 ms, then 1485 MHz (594 -> 705 us per call at
# 2048x14336x8192, at 160-390 W), while 20-ms rests after each 6-ms burst kept it at 1980 MHz throughout.
REST = 3.0
MAX_SLEEP_US = 200000.0


def device_time_us(fn: Callable[[], object], settings: Settings, host_us: float, gpu_us: float | None = None) -> float:
    """Median GPU time per call of ``fn`` on this rank (see module docstring)."""
    return device_times_us([fn], settings, [host_us], [host_us if gpu_us is None else gpu_us])[0]


def device_times_us(fns: list[Callable[[], object]], settings: Settings, host_us: list[float],
                    gpu_us: list[float]) -> list[float]:
    """Median GPU time per call of each of ``fns`` on this rank, their bursts interleaved: every round times one
    burst of every function, in turn, in the given order and then reversed in the next round. A pair of rounds
    gives each function the same average place in them; the time is the median over pairs of the pair's mean.

    Each burst is queued behind a GPU sleep that covers the host enqueueing it (twice its ``host_us`` per call)
    and rests the GPU ``REST`` times the burst's GPU time (``gpu_us`` per call, an estimate), so that every burst
    starts at the clocks a rested GPU runs (see ``REST``), whatever ran before it. The same number of bursts, in
    the same order, on every rank."""
    flush = torch.empty(L2_FLUSH_BYTES, dtype=torch.uint8, device="cuda") if settings.l2_flush else None
    burst = settings.burst if not settings.l2_flush else 1  # a flush belongs before every call
    steps = [_burst_step(fn, burst, settings.cuda_graph) for fn in fns]
    sleeps = [min(MAX_SLEEP_US, burst * max(2.0 * h, REST * g)) + 10.0 for h, g in zip(host_us, gpu_us)]
    pairs = (max(settings.iters // burst, 5) + 1) // 2  # the bursts asked for, rounded up to whole pairs
    events = [[(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in fns]
              for _ in range(2 * pairs)]
    torch.cuda.synchronize()
    dist.barrier()
    for i, per_round in enumerate(events):
        turns = list(zip(steps, sleeps, per_round))
        for step, sleep, (start, end) in (turns if i % 2 == 0 else reversed(turns)):
            _sleep_us(sleep)
            if flush is not None:
                flush.zero_()
            start.record()
            step()
            end.record()
    torch.cuda.synchronize()
    us = [[start.elapsed_time(end) * 1e3 / burst for start, end in per_round] for per_round in events]
    return [statistics.median((us[2 * p][j] + us[2 * p + 1][j]) / 2 for p in range(pairs)) for j in range(len(fns))]


def warm_up(fn: Callable[[], object], calls: int) -> float:
    """Run ``fn`` ``calls`` times (compiles, caches, first-touch allocations); returns the GPU time per call seen
    (host gaps included, so at least the call's own GPU time): ``device_times_us``'s estimate."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    fn()  # the first call may compile: not timed
    start.record()
    for _ in range(calls):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / max(calls, 1)


def _burst_step(fn: Callable[[], object], burst: int, cuda_graph: bool) -> Callable[[], object]:
    """``burst`` back-to-back calls of ``fn``: called plainly, or captured once in a CUDA graph and replayed."""

    def calls() -> None:
        for _ in range(burst):
            fn()

    if not cuda_graph:
        return calls
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        calls()
    graph.replay()
    return graph.replay


def check_backend(op: Op, name: str, shape: Shape, dtype: torch.dtype, seed: int, ref: torch.Tensor) -> str:
    """'ok' or why not, agreed across ranks. A reference_free backend only has to run and be finite."""
    try:
        out = op.backends[name](op.make_inputs(shape, dtype, seed))
        torch.cuda.synchronize()
        if name in op.reference_free:
            finite = bool(torch.isfinite(out).all())
            local, message = (0.0 if finite else float("inf")), "FAIL (not finite)"
        else:
            err = ((out.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-30)).item()
            local = 0.0 if err <= op.rtol[dtype] else (err if err == err else float("inf"))
            message = f"FAIL (rel err {err:.1e})"
    # Raised the same way on every rank: bad input, and a backend that torch.compile cannot compile.
    except (ValueError, TypeError, NotImplementedError, torch._dynamo.exc.TorchDynamoException,
            torch._dynamo.exc.FailOnRecompileLimitHit) as exc:
        local, message = -1.0, f"error ({exc})"
    worst = _slowest(local)
    if worst == 0.0:
        return "ok"
    return message if local != 0.0 else "FAIL (on another rank)"


EAGER_ONLY = "not timed (eager only: it cannot be captured in a CUDA graph)"


def run_op(op: Op, shapes: list[Shape], backends: list[str], dtype: torch.dtype, settings: Settings,
           meta: dict | None = None) -> list[Row]:
    world_size = dist.get_world_size()
    rows = []
    for shape in shapes:
        timed = []  # (row, call, warm-up us per call) of the shape's backends that passed their check
        shape_text = "x".join(map(str, shape))
        floor = op.floor_us(shape, dtype, world_size)
        nbytes = op.nvlink_bytes(shape, dtype, world_size)
        ref = op.backends[op.baseline](op.make_inputs(shape, dtype, settings.seed)).clone()
        for name in backends:
            print_rank0(f"  [{op.name} {shape_text}] {name} ...", file=sys.stderr)
            heartbeat(f"{op.name} {shape_text} {name}")
            row = Row(op.name, shape_text, str(dtype).removeprefix("torch."), world_size, name, "ok",
                      floor_us=floor, mode="cuda-graph" if settings.cuda_graph else "eager",
                      checked=name not in op.reference_free, meta=dict(meta or {}))
            if settings.cuda_graph and name in op.eager_only:  # the same on every rank: no collective skipped alone
                row.status = EAGER_ONLY
                rows.append(row)
                continue
            row.status = check_backend(op, name, shape, dtype, settings.seed, ref)
            if row.status == "ok":
                call = _bound(op.backends[name], op.make_inputs(shape, dtype, settings.seed + 1))
                warm_us = _slowest(warm_up(call, settings.warmup))
                row.host_us = _slowest(host_cost_us(call, settings.host_calls))
                timed.append((row, call, warm_us))
            rows.append(row)
        if timed:  # the same backends on every rank: each one's status is agreed
            print_rank0(f"  [{op.name} {shape_text}] timing {len(timed)} backends, interleaved ...", file=sys.stderr)
            heartbeat(f"{op.name} {shape_text} timing")
            times = device_times_us([call for _, call, _ in timed], settings, [row.host_us for row, _, _ in timed],
                                    [warm_us for _, _, warm_us in timed])
            for (row, call, _), us in zip(timed, times):
                row.us = _slowest(us)
                row.gbps = nbytes / (row.us * 1e3)
                if not settings.cuda_graph:
                    heartbeat(f"{op.name} {shape_text} {row.backend} eager loop")
                    loop_us, loop_gpu_us = eager_loop_us(call, loop_calls(row.us, settings), row.us,
                                                          settings.loop_repeats)
                    row.loop_us, row.loop_gpu_us = _slowest(loop_us), _slowest(loop_gpu_us)
    return rows


def _bound(fn: Callable[[dict], object], inputs: dict) -> Callable[[], object]:
    """``fn`` on ``inputs``, as a call without arguments (a function per backend, not a closure over the loop's)."""
    return lambda: fn(inputs)


# ---------------------------------------------------------------------------
# Tables (pure: tested on CPU)
# ---------------------------------------------------------------------------


def speedup(baseline_us: float | None, us: float | None) -> float | None:
    """How many times faster than the baseline (>1 is faster)."""
    if baseline_us is None or us is None or us <= 0:
        return None
    return baseline_us / us


def ratio(helion_us: float | None, triton_us: float | None) -> float | None:
    """Helion time over Triton time (<= 1.05 meets the twins' bar)."""
    if helion_us is None or triton_us is None or triton_us <= 0:
        return None
    return helion_us / triton_us


def _fmt(value: float | None, digits: int = 1, suffix: str = "") -> str:
    return "-" if value is None else f"{value:.{digits}f}{suffix}"


def table_rows(op: Op, rows: list[Row], backends: list[str]) -> tuple[list[str], list[list[str]]]:
    """Header and body of the main table: one row per shape."""
    pairs = [p for p in op.pairs if p.triton in backends and p.helion in backends]
    baseline = op.baseline if op.baseline in backends else None
    others = [b for b in backends if b != baseline]
    header = ["shape"] + [f"{b} us" + (" (not checked)" if b in op.reference_free else "") for b in backends]
    if baseline:
        header += [f"{b} vs {baseline}" for b in others]
    header += [f"{p.helion}/{p.triton}" for p in pairs]
    header += [f"{b} GB/s" for b in backends] + ["floor us"]
    body = []
    for shape in dict.fromkeys(r.shape for r in rows):
        by_backend = {r.backend: r for r in rows if r.shape == shape}
        us = {b: by_backend[b].us if b in by_backend else None for b in backends}
        line = [shape]
        for b in backends:
            r = by_backend.get(b)
            line.append(_fmt(us[b]) if r is None or r.status == "ok" else r.status.split(" ")[0])
        if baseline:
            line += [_fmt(speedup(us[baseline], us[b]), 2, "x") for b in others]
        line += [_fmt(ratio(us[p.helion], us[p.triton]), 3) for p in pairs]
        line += [_fmt(by_backend[b].gbps if b in by_backend else None, 0) for b in backends]
        floors = [r.floor_us for r in by_backend.values() if r.floor_us is not None]
        line.append(_fmt(floors[0] if floors else None))
        body.append(line)
    return header, body


def host_table(rows: list[Row], backends: list[str]) -> tuple[list[str], list[list[str]]]:
    """Eager host cost per call, per backend (median over shapes)."""
    body = []
    for b in backends:
        costs = [r.host_us for r in rows if r.backend == b and r.host_us is not None]
        body.append([b, _fmt(statistics.median(costs) if costs else None)])
    return ["backend", "host us/call"], body


def loop_table(rows: list[Row], backends: list[str]) -> tuple[list[str], list[list[str]]]:
    """Eager rows only: microseconds per call in a loop of back-to-back calls (no sleep), per shape and backend."""
    if not any(r.loop_us is not None for r in rows):
        return [], []
    body = []
    for shape in dict.fromkeys(r.shape for r in rows):
        loop = {r.backend: r.loop_us for r in rows if r.shape == shape}
        body.append([shape] + [_fmt(loop.get(b)) for b in backends])
    return ["shape"] + [f"{b} loop us" for b in backends], body


def rate(op: Op, shape_text: str, dtype: str, us: float | None) -> tuple[float | None, str]:
    """The op's ``work`` per call over ``us``: (TFLOP/s or GB/s, its unit), or (None, "") without ``work``."""
    if op.work is None or us is None or us <= 0:
        return None, ""
    amount, kind = op.work(tuple(int(d) for d in shape_text.split("x")), getattr(torch, dtype))
    return (amount / us / 1e6, "TFLOP/s") if kind == "flop" else (amount / us / 1e3, "GB/s")


def host_share(row: Row | None) -> float | None:
    """How much longer an eager loop takes per call than its GPU work: ``loop_us`` minus the same loop's GPU time
    (``us`` for rows measured before ``loop_gpu_us`` existed)."""
    if row is None or row.loop_us is None:
        return None
    gpu = row.loop_gpu_us if row.loop_gpu_us is not None else row.us
    return None if gpu is None else row.loop_us - gpu


def core_pairs(op: Op) -> list[tuple[str, str]]:
    """(recipe, twin) backend names of the core table: the op's pairs, or, for an op composed of recipes with no
    kernel of its own (``tp_mlp``), each ``triton...`` backend with its ``helion...`` namesake."""
    if op.pairs:
        return [(p.triton, p.helion) for p in op.pairs]
    return [(b, "helion" + b.removeprefix("triton")) for b in op.backends
            if b.startswith("triton") and "helion" + b.removeprefix("triton") in op.backends]


def core_rows(op: Op, rows: list[Row], backends: list[str]) -> tuple[list[str], list[list[str]]]:
    """The one-GPU core table (world size 1): per shape and recipe/twin pair, the op's library backend, the
    recipe and the twin in us, the recipe's TFLOP/s or GB/s, recipe/library, twin/recipe, and the eager loop
    per call of each with how far it is above the GPU time of that loop (``host_share``: the host path's cost)."""
    library = op.library if op.library in backends else None
    pairs = [p for p in core_pairs(op) if p[0] in backends or p[1] in backends]
    if library is None or not pairs:
        return [], []
    unit = rate(op, rows[0].shape, rows[0].dtype, 1.0)[1] or "rate"
    header = ["shape", "recipe", f"{library} us", "recipe us", "twin us", f"recipe {unit}", "recipe/library",
              "twin/recipe", "loop us: library", "recipe", "twin", "loop over its GPU us: recipe", "twin"]
    body = []
    for shape in dict.fromkeys(r.shape for r in rows):
        by_backend = {r.backend: r for r in rows if r.shape == shape and r.status == "ok"}
        us = {b: r.us for b, r in by_backend.items()}
        loop = {b: r.loop_us for b, r in by_backend.items()}
        dtype = next(r.dtype for r in rows if r.shape == shape)
        for recipe, twin in pairs:
            over = [host_share(by_backend.get(b)) for b in (recipe, twin)]
            body.append([shape, recipe, _fmt(us.get(library)), _fmt(us.get(recipe)), _fmt(us.get(twin)),
                         _fmt(rate(op, shape, dtype, us.get(recipe))[0]),
                         _fmt(ratio(us.get(recipe), us.get(library)), 2),
                         _fmt(ratio(us.get(twin), us.get(recipe)), 3),
                         _fmt(loop.get(library)), _fmt(loop.get(recipe)), _fmt(loop.get(twin)),
                         _fmt(over[0]), _fmt(over[1])])
    return header, body


CORE_LABEL = ("World size 1: a peer set of one, so the exchange is empty and this measures the cores and the host "
              "path, not the exchange. Recipe and Helion twin beside the fastest single-GPU library op:")
GPU_TIME_LABEL = ("GPU time per call (calls queued behind a GPU sleep, so the launch path is hidden; slowest "
                  "rank's median):")
LOOP_LABEL = "Eager loop (back-to-back calls, no sleep in front: what a Python loop sees), us per call:"


def tables_markdown(op: Op, rows: list[Row], backends: list[str]) -> str:
    """At world size 1 the core table first (``core_rows``); then the GPU-time table and, for eager rows, the
    eager-loop table, each under its label (printed by the benchmark and written into docs/results.md alike)."""
    from tabulate import tabulate

    lines = []
    core_header, core_body = core_rows(op, rows, backends) if rows and rows[0].world_size == 1 else ([], [])
    if core_body:
        lines += [CORE_LABEL, "", tabulate(core_body, headers=core_header, tablefmt="github", disable_numparse=True), ""]
    header, body = table_rows(op, rows, backends)
    lines += [GPU_TIME_LABEL, "", tabulate(body, headers=header, tablefmt="github", disable_numparse=True)]
    loop_header, loop_body = loop_table(rows, backends)
    if loop_body:
        lines += ["", LOOP_LABEL, "", tabulate(loop_body, headers=loop_header, tablefmt="github", disable_numparse=True)]
    return "\n".join(lines)


def failures(rows: list[Row]) -> list[str]:
    return [f"{r.shape} {r.backend}: {r.status}" for r in rows if r.status != "ok"]


def records(rows: list[Row]) -> list[dict]:
    """Flat dicts for JSON/CSV: the row's fields, then where it was measured."""
    out = []
    for r in rows:
        record = asdict(r)
        meta = record.pop("meta")
        out.append({**record, **meta})
    return out
