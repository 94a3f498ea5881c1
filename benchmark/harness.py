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

A row budget (``Settings.row_budget_s``) bounds what one backend's row may cost: its warm-up tells the time of one
call (the slowest rank's, so every rank decides alike and launches the same calls), and a backend whose row would
take longer is timed in shorter bursts without the eager loop, or, if even one call per burst is too much, skipped
with a row that says so (``row_plan``). After each shape, rank 0 prints how long it took and an estimate of the
time left (``Progress``).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
import math
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
    # What one backend's row (host cost, timed bursts, eager loops) may cost on the GPU, in seconds; None: no limit.
    row_budget_s: float | None = None


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
    note: str = ""  # how the row budget shortened its measurement (``row_plan``), if it did


# ---------------------------------------------------------------------------
# Planning a run (pure: tested on CPU)
# ---------------------------------------------------------------------------

QUICK_SHAPES = 3  # shapes per op of a quick look: the smallest, the middle and the largest by work


def work_of(op: Op, shape: Shape, dtype: torch.dtype) -> float:
    """What one call does (``op.work``: flop or bytes), or the product of the shape's dimensions without it."""
    return op.work(shape, dtype)[0] if op.work is not None else float(math.prod(shape))


def by_work(op: Op, shapes: list[Shape], dtype: torch.dtype) -> list[Shape]:
    """``shapes`` from the least work per call to the most (ties by the shape itself)."""
    return sorted(shapes, key=lambda shape: (work_of(op, shape, dtype), shape))


def texts_by_work(op: Op, texts: list[str], dtype: str) -> list[str]:
    """Rows' shape texts (``128x4096x4096``) of a ``dtype`` (``bfloat16``) in ``by_work``'s order."""
    shapes = {tuple(int(d) for d in text.split("x")): text for text in texts}
    return [shapes[shape] for shape in by_work(op, list(shapes), getattr(torch, dtype))]


def quick_shapes(op: Op, dtype: torch.dtype, count: int = QUICK_SHAPES) -> list[Shape]:
    """A quick look's shapes: ``count`` of the op's default shapes spread evenly over them ordered by work (the
    smallest, the middle and the largest for three), in that order; all of them if there are no more."""
    ordered = by_work(op, op.default_shapes, dtype)
    if len(ordered) <= count:
        return ordered
    if count == 1:
        return [ordered[len(ordered) // 2]]
    picks = dict.fromkeys(round(i * (len(ordered) - 1) / (count - 1)) for i in range(count))
    return [ordered[i] for i in picks]


def eta_s(elapsed_s: float, done: int, total: int) -> float | None:
    """The time left if every unit still to come takes the mean time of those done; None before the first."""
    if done <= 0:
        return None
    return elapsed_s / done * max(total - done, 0)


def duration(seconds: float | None) -> str:
    """``42 s``, ``3m05s``, ``1h02m``; ``?`` for None."""
    if seconds is None:
        return "?"
    seconds = round(seconds)
    if seconds < 60:
        return f"{seconds} s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"


class Progress:
    """The progress line of a run: its units are (op, shape, backend) rows, ``total`` of them; ``advance`` after
    each shape says how long that shape took, how many rows are done, the time so far and an estimate of the
    time left (``eta_s``: the mean time per row so far, times the rows left)."""

    def __init__(self, total: int, clock: Callable[[], float] = time.monotonic):
        self.total, self.done, self.clock = total, 0, clock
        self.start = self.last = clock()

    def advance(self, units: int, label: str) -> str:
        now = self.clock()
        took, self.last = now - self.last, now
        self.done += units
        elapsed = now - self.start
        return (f"  [{label}] done in {duration(took)}: {self.done}/{self.total} rows, {duration(elapsed)} elapsed, "
                f"about {duration(eta_s(elapsed, self.done, self.total))} left")


SKIPPED = "skipped:"  # the status of a row over the row budget even at one call per burst
# The warm-up may take this share of the row budget (at least one call after the first, to time a warm call).
WARMUP_SHARE = 0.25


def warmup_calls(first_us: float, settings: Settings) -> int:
    """Warm-up calls after the first one, which took ``first_us`` (the slowest rank's: the same count on every
    rank): ``settings.warmup``, or fewer where they would take more than ``WARMUP_SHARE`` of the row budget."""
    if settings.row_budget_s is None or settings.warmup == 0:
        return settings.warmup
    fits = int(WARMUP_SHARE * settings.row_budget_s * 1e6 // max(first_us, 1e-3))
    return min(settings.warmup, max(1, fits))


@dataclass
class RowPlan:
    """How one backend's row is measured: calls per timed burst, host-cost calls, whether the eager loop runs;
    or ``skip``, the row's status, when it is not timed at all. ``note`` says what was shortened, if anything."""

    burst: int
    host_calls: int
    eager_loop: bool
    skip: str | None = None
    note: str = ""


def row_plan(call_us: float, settings: Settings) -> RowPlan:
    """The plan of a backend's row whose call takes ``call_us`` (the slowest rank's warm-up: every rank plans
    alike, so barrier kernels always pair up). The whole row, its host-cost calls, its ``timing_bursts`` (one
    more burst to replay a captured CUDA graph) and its eager loops (``loop_repeats`` x 2 x ``loop_calls``),
    within ``settings.row_budget_s``: as asked. Over it: one host-cost call, no eager loop (at seconds a call the
    host's launch path is out of sight) and as many calls per burst as fit, down to one; if even that is over,
    the row is skipped and says why."""
    burst, bursts = timing_bursts(settings)
    bursts += 1 if settings.cuda_graph else 0
    loop = 0 if settings.cuda_graph else 2 * settings.loop_repeats * loop_calls(call_us, settings)
    asked = RowPlan(burst, settings.host_calls, not settings.cuda_graph)
    if settings.row_budget_s is None:
        return asked
    calls = settings.row_budget_s * 1e6 / max(call_us, 1e-3)  # how many calls the budget holds
    if settings.host_calls + bursts * burst + loop <= calls:
        return asked
    why = f"{call_us / 1e6:.2g} s/call over the {settings.row_budget_s:g} s row budget"
    fitted = min(burst, int((calls - 1) // bursts))
    if fitted < 1:
        return RowPlan(0, 0, False, skip=f"{SKIPPED} {why}")
    shorter = [f"bursts of {fitted}"] if fitted < burst else []
    shorter += [] if settings.cuda_graph else ["no eager loop"]
    return RowPlan(fitted, 1, False, note=f"{', '.join(shorter or ['one host-cost call'])}: {why}")


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


def timing_bursts(settings: Settings) -> tuple[int, int]:
    """(calls per burst, bursts per function) of ``device_times_us``: the bursts asked for (``iters`` / ``burst``,
    at least 5), rounded up to whole pairs of rounds. A flush belongs before every call: bursts of one with it."""
    burst = settings.burst if not settings.l2_flush else 1
    return burst, 2 * ((max(settings.iters // burst, 5) + 1) // 2)


def device_times_us(fns: list[Callable[[], object]], settings: Settings, host_us: list[float],
                    gpu_us: list[float], bursts: list[int] | None = None) -> list[float]:
    """Median GPU time per call of each of ``fns`` on this rank, their bursts interleaved: every round times one
    burst of every function, in turn, in the given order and then reversed in the next round. A pair of rounds
    gives each function the same average place in them; the time is the median over pairs of the pair's mean.

    Each burst is queued behind a GPU sleep that covers the host enqueueing it (twice its ``host_us`` per call)
    and rests the GPU ``REST`` times the burst's GPU time (``gpu_us`` per call, an estimate), so that every burst
    starts at the clocks a rested GPU runs (see ``REST``), whatever ran before it. ``bursts`` gives each function
    its own calls per burst (a backend shortened by the row budget: ``row_plan``), else ``timing_bursts``'s. The
    same number of bursts, of the same sizes, in the same order, on every rank."""
    flush = torch.empty(L2_FLUSH_BYTES, dtype=torch.uint8, device="cuda") if settings.l2_flush else None
    burst, rounds = timing_bursts(settings)
    sizes = bursts or [burst] * len(fns)
    steps = [_burst_step(fn, n, settings.cuda_graph) for fn, n in zip(fns, sizes)]
    sleeps = [min(MAX_SLEEP_US, n * max(2.0 * h, REST * g)) + 10.0 for n, h, g in zip(sizes, host_us, gpu_us)]
    events = [[(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in fns]
              for _ in range(rounds)]
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
    us = [[start.elapsed_time(end) * 1e3 / n for (start, end), n in zip(per_round, sizes)] for per_round in events]
    pairs = rounds // 2
    return [statistics.median((us[2 * p][j] + us[2 * p + 1][j]) / 2 for p in range(pairs)) for j in range(len(fns))]


def timed_calls(fn: Callable[[], object], calls: int) -> float:
    """GPU time per call of ``calls`` back-to-back calls of ``fn`` (host gaps included, so at least the call's own
    GPU time): the warm-up, and ``device_times_us``'s estimate."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
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
    worst = _slowest(abs(local))  # an error on one rank alone (-1) must outweigh the others' 0 in the maximum
    if worst == 0.0:
        return "ok"
    return message if local != 0.0 else "FAIL (on another rank)"


EAGER_ONLY = "not timed (eager only: it cannot be captured in a CUDA graph)"


def run_op(op: Op, shapes: list[Shape], backends: list[str], dtype: torch.dtype, settings: Settings,
           meta: dict | None = None, progress: Progress | None = None) -> list[Row]:
    """Check, warm up and time each of ``backends`` at each of ``shapes`` (module docstring); after each shape,
    rank 0 prints ``progress``'s line."""
    world_size = dist.get_world_size()
    rows = []
    for shape in shapes:
        timed = []  # (row, call, warm-up us per call, plan) of the shape's backends that passed their check
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
            rows.append(row)
            if settings.cuda_graph and name in op.eager_only:  # the same on every rank: no collective skipped alone
                row.status = EAGER_ONLY
                continue
            row.status = check_backend(op, name, shape, dtype, settings.seed, ref)
            if row.status != "ok":
                continue
            call = _bound(op.backends[name], op.make_inputs(shape, dtype, settings.seed + 1))
            # The first call on these inputs (compiled by the check) caps the warm-up; the warm-up's time per call,
            # the slowest rank's, plans the row: the same plan on every rank.
            first_us = _slowest(timed_calls(call, 1))
            warm = warmup_calls(first_us, settings)
            warm_us = _slowest(timed_calls(call, warm)) if warm else first_us
            plan = row_plan(warm_us, settings)
            if plan.skip:
                row.status = plan.skip
                continue
            row.note = plan.note
            row.host_us = _slowest(host_cost_us(call, plan.host_calls))
            timed.append((row, call, warm_us, plan))
        if timed:  # the same backends on every rank: each one's status is agreed
            print_rank0(f"  [{op.name} {shape_text}] timing {len(timed)} backends, interleaved ...", file=sys.stderr)
            heartbeat(f"{op.name} {shape_text} timing")
            times = device_times_us([call for _, call, _, _ in timed], settings,
                                    [row.host_us for row, _, _, _ in timed], [warm_us for _, _, warm_us, _ in timed],
                                    [plan.burst for _, _, _, plan in timed])
            for (row, call, _, plan), us in zip(timed, times):
                row.us = _slowest(us)
                row.gbps = nbytes / (row.us * 1e3)
                if plan.eager_loop:
                    heartbeat(f"{op.name} {shape_text} {row.backend} eager loop")
                    loop_us, loop_gpu_us = eager_loop_us(call, loop_calls(row.us, settings), row.us,
                                                          settings.loop_repeats)
                    row.loop_us, row.loop_gpu_us = _slowest(loop_us), _slowest(loop_gpu_us)
        if progress is not None:
            print_rank0(progress.advance(len(backends), f"{op.name} {shape_text}"), file=sys.stderr)
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


def status_cell(status: str) -> str:
    """A row that was not timed, in its table cell: the first word (FAIL, error), or a skip with its reason."""
    return status if status.startswith(SKIPPED) else status.split(" ")[0]


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
            line.append(_fmt(us[b]) if r is None or r.status == "ok" else status_cell(r.status))
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


def shortened(rows: list[Row]) -> list[str]:
    """The rows the row budget measured with fewer calls (``row_plan``), and how."""
    return [f"{r.shape} {r.backend}: {r.note}" for r in rows if r.note]


def records(rows: list[Row]) -> list[dict]:
    """Flat dicts for JSON/CSV: the row's fields, then where it was measured."""
    out = []
    for r in rows:
        record = asdict(r)
        meta = record.pop("meta")
        out.append({**record, **meta})
    return out
