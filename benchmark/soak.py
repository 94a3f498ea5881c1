"""Soak: every registered op and backend in one seeded random order on every rank, each call checked.

    python -m benchmark.soak --nproc 4 --launches 10000 --graph-every 0.1 --json results/h200x4/soak.json
    torchrun --standalone --nproc-per-node 4 -m benchmark.soak --seconds 600

Each step, alike on every rank (``random.Random(--seed)``): an op, a backend, a shape from a pool around the op's
defaults (odd tails, multiples of 16, within the op's rules), a dtype, eager (one call) or a CUDA graph (a warm-up
on a side stream, a capture, replays with fresh input values where the inputs allow), each call checked against
the baseline as the harness checks a backend, the verdicts agreed over the ranks. Exit code 1 on any mismatch or
error (a CUDA error stops the run). A hang: the barrier timeout (on by default) reports and exits, and the last line
of each rank's trace file (``<json>-rank<R>.log``) names the step, op/backend, shape and phase it was in.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
import inspect
import itertools
import json
import os
import random
import sys
import time
import traceback
from typing import Iterator

from tabulate import tabulate
import torch
import torch.distributed as dist

from benchmark import registry
from benchmark.launch import heartbeat, in_torchrun, init_from_env, require_gpus, spawn

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
WIDE, HALF = ("bf16", "fp16", "fp32"), ("bf16", "fp16")
# The dtypes each op takes (make_inputs and recipes); an op not listed runs bf16.
OP_DTYPES = {"all_reduce": WIDE, "all_gather": WIDE, "reduce_scatter": WIDE, "all_reduce_bias": WIDE,
             "all_reduce_bias_rms_norm": WIDE, "moe_dispatch": WIDE, "moe_combine": WIDE, "all_gather_matmul": HALF,
             "gemm_reduce_scatter": HALF, "gemm_all_reduce": HALF, "context_parallel_attention": HALF}
# Each field of an op's shape_format: "keep" the default's; "any" size; "split": divisible by the group size; "seq":
# by it, twice under MASK (the last field) 2; "x16": a multiple of 16 (cuBLASLt's fp8). An op not here: defaults.
FIELDS = {"all_reduce": "any", "all_gather": "split", "reduce_scatter": "split", "all_reduce_bias": "any any",
          "all_reduce_bias_rms_norm": "any any", "all_gather_matmul": "split any any",
          "gemm_reduce_scatter": "split any any", "all_gather_matmul_fp8": "split x16 x16",
          "gemm_reduce_scatter_fp8": "split x16 x16", "gemm_all_reduce": "any any any",
          "moe_dispatch": "any any keep keep keep", "moe_combine": "any any keep keep keep",
          "tp_mlp": "split any split", "context_parallel_attention": "keep seq keep keep keep keep"}
COUNTS = ("launches", "replays", "mismatches", "errors", "unsupported")
POOL = 6  # distinct shapes per op and group size
OURS = ("triton", "helion", "chain")  # the default backends (this project's), but not the *_compiled ones
MAX_SKIPS_IN_A_ROW = 1000  # then the shape rules, not the draw, are wrong: stop
MAX_FAILURES = 200  # mismatches kept for the JSON
FATAL = tuple(getattr(m, n) for m, n in ((torch, "AcceleratorError"), (dist, "DistError")) if hasattr(m, n))
STALL_S = 900.0  # the spawn watchdog: longer than the barrier timeout (300 s) and a torch.compile


def vary(value: int, rng: random.Random) -> int:
    """The value itself, or a size a quarter to all of it: a multiple of 16, or odd (an odd tail)."""
    kind, size = rng.random(), max(1, int(value * rng.uniform(0.25, 1.0)))
    return value if kind < 1 / 3 else (size - size % 16 if size >= 16 else size) if kind < 2 / 3 else size | 1


def draw_shape(name: str, default: tuple, world_size: int, rng: random.Random) -> tuple:
    """A shape around ``default`` within op ``name``'s rules (``FIELDS``) at this group size."""
    shape = []
    for rule, value in zip(FIELDS[name].split(), default):
        if rule in ("split", "seq"):
            n = world_size * (2 if rule == "seq" and default[-1] == 2 else 1)  # what the field must divide by
            shape.append(n * vary(max(1, value // n), rng))
        elif rule == "x16":
            shape.append(max(16, vary(value, rng) // 16 * 16))
        else:
            shape.append(value if rule == "keep" else vary(value, rng))
    return tuple(shape)


def fits(name: str, shape: tuple, world_size: int) -> bool:
    """Whether ``shape`` meets op ``name``'s divisibility and alignment rules at this group size."""
    parts = {"split": world_size, "seq": world_size * (2 if shape[-1] == 2 else 1), "x16": 16}
    rules = FIELDS.get(name, "").split()
    return all(value >= 1 and value % parts.get(rule, 1) == 0 for rule, value in zip(rules, shape))


def scaled(name: str, shape: tuple, scale: float) -> tuple:
    """``shape`` with every field op ``name`` lets vary (``FIELDS``) times ``scale`` (at least 1)."""
    if scale == 1.0 or name not in FIELDS:
        return shape
    return tuple(v if rule == "keep" else max(1, round(v * scale)) for rule, v in zip(FIELDS[name].split(), shape))


def shape_pool(op: registry.Op, world_size: int, seed: int, size: int = POOL, scale: float = 1.0) -> list[tuple]:
    """The shapes op ``op`` is soaked at, at this group size: a third of them default shapes that fit, the rest
    drawn around random defaults; ``scale`` shrinks the defaults first (fewer seconds per check at the largest).
    Bounded: every new shape may allocate symmetric memory for good, and may compile a kernel."""
    rng = random.Random(f"{seed}/{op.name}/{world_size}")  # a string seed hashes alike in every process
    defaults = [scaled(op.name, tuple(s), scale) for s in op.default_shapes]
    if op.name not in FIELDS:
        return defaults[:size]
    fitting = [s for s in defaults if fits(op.name, s, world_size)]
    pool = rng.sample(fitting, min(len(fitting), max(1, size // 3)))
    for _ in range(50 * size):
        if len(pool) >= size:
            break
        shape = draw_shape(op.name, rng.choice(defaults), world_size, rng)
        if shape not in pool:
            pool.append(shape)
    return pool


def subjects(op: registry.Op, backends: list[str] | None = None) -> list[str]:
    """The op's backends to soak: ``backends`` (["all"]: every one but the baseline), by default ``OURS``."""
    return [b for b in op.backends if b != op.baseline
            and (backends == ["all"] or b in (backends or ()) or (not backends and b.startswith(OURS)
                                                                  and not b.endswith("_compiled")))]


def takes_group(op: registry.Op) -> bool:
    """Whether the op's inputs (and so its backends) take a process group: ``make_inputs(..., group=)``."""
    return "group" in inspect.signature(op.make_inputs).parameters


@dataclass(frozen=True)
class Step:
    index: int
    op: str
    backend: str
    shape: tuple
    dtype: str
    group: str  # "world", or "half" (--subgroup)
    graph: bool
    seed: int
    label: str  # op/backend, with "@half" on the sub-group


def schedule(ops: dict, world_size: int, seed: int, graph_every: float = 0.0, subgroup: bool = False,
             backends: list | None = None, dtypes: tuple = tuple(DTYPES), pool: int = POOL,
             scale: float = 1.0) -> Iterator[Step]:
    """The steps, drawn from one ``random.Random(seed)``: the same sequence wherever the arguments are the same."""
    rng, pools = random.Random(seed), {}
    chosen = {name: subjects(ops[name], backends) for name in sorted(ops)}
    types = {name: [d for d in OP_DTYPES.get(name, ("bf16",)) if d in dtypes] for name in chosen}
    names = [name for name in chosen if chosen[name] and types[name]]
    if not names:
        raise ValueError("soak: no op has a backend and a dtype left to run (see --ops, --backends, --dtypes)")
    for index in itertools.count(1):
        name = rng.choice(names)
        op, backend = ops[name], rng.choice(chosen[name])
        group = "half" if subgroup and takes_group(op) and rng.random() < 0.5 else "world"
        key = (name, world_size // 2 if group == "half" else world_size)  # a pool per op and group size
        if key not in pools:
            pools[key] = shape_pool(op, key[1], seed, pool, scale)
        shape = rng.choice(pools[key])
        dtype = rng.choice(types[name])
        graph = rng.random() < graph_every and backend not in op.eager_only
        label = f"{name}/{backend}" + ("@half" if group == "half" else "")
        yield Step(index, name, backend, shape, dtype, group, graph, rng.randrange(1, 1 << 30), label)


def summarize(counts: dict[str, dict]) -> tuple[list[str], list[list], dict]:
    """Header, one row per op/backend (sorted) and a total row, and the totals."""
    totals = {c: sum(row[c] for row in counts.values()) for c in COUNTS}
    body = [[label, *(counts[label][c] for c in COUNTS)] for label in sorted(counts)]
    return ["op/backend", *COUNTS], body + [["total", *totals.values()]], totals


def report(counts: dict, skipped: dict, failures: list, world_size: int, args: dict, elapsed_s: float) -> dict:
    """The JSON: the totals, the exit code (1 on any mismatch or error), the counts per op/backend."""
    totals = summarize(counts)[2]
    return {"world_size": world_size, "elapsed_s": round(elapsed_s, 1), "args": args, "totals": totals,
            "exit_code": int(bool(totals["mismatches"] or totals["errors"])), "skipped_shapes": skipped,
            "failures": failures, "per_backend": [{"label": label, **row} for label, row in sorted(counts.items())]}


class Skip(Exception):
    """make_inputs refused the drawn shape or dtype (a ValueError)."""


def check(op: registry.Op, name: str, dtype: torch.dtype, out: torch.Tensor, ref: torch.Tensor) -> float:
    """``harness.check_backend``'s test on a result: 0.0 if it passes, else the relative error (inf: not finite)."""
    if name in op.reference_free:
        return 0.0 if bool(torch.isfinite(out).all()) else float("inf")
    err = ((out.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-30)).item()
    return 0.0 if err <= op.rtol[dtype] else (err if err == err else float("inf"))


def refreshable(captured: dict, fresh: dict) -> bool:
    """Whether another seed's inputs can be copied into the captured ones: the same keys, tensors of the same
    shape and dtype, and every other value equal (a plain value, or the very same object, like a group)."""
    def same(a, b):
        if isinstance(a, torch.Tensor):
            return isinstance(b, torch.Tensor) and (a.shape, a.dtype, a.device) == (b.shape, b.dtype, b.device)
        if isinstance(a, (list, tuple)):
            return type(a) is type(b) and len(a) == len(b) and all(map(same, a, b))
        return a is b or (isinstance(a, (bool, int, float, str, torch.dtype)) and type(a) is type(b) and a == b)
    return captured.keys() == fresh.keys() and all(same(captured[k], fresh[k]) for k in captured)


class Soak:
    def __init__(self, args: argparse.Namespace, ops: dict):
        self.args, self.rank, self.world_size = args, dist.get_rank(), dist.get_world_size()
        self.groups = {"world": None}
        if args.subgroup:  # every rank makes both groups, in the same order
            half = self.world_size // 2
            low, high = dist.new_group(list(range(half))), dist.new_group(list(range(half, self.world_size)))
            self.groups["half"] = low if self.rank < half else high
        self.ops, self.steps = ops, schedule(ops, self.world_size, args.seed, args.graph_every, args.subgroup,
                                             args.backends, args.dtypes, args.pool, args.scale)
        self.counts, self.skipped, self.failures, self.told, self.skips_in_a_row = {}, {}, [], set(), 0
        self.json = args.json or os.path.join("results", f"soak-ws{self.world_size}.json")
        os.makedirs(os.path.dirname(os.path.abspath(self.json)), exist_ok=True)
        self.trace_file = open(f"{os.path.splitext(self.json)[0]}-rank{self.rank}.log", "w")

    def trace(self, step: Step, phase: str) -> None:
        """The call about to be made, on this rank's trace file (and to the spawn watchdog)."""
        shape = "x".join(map(str, step.shape))
        line = f"{time.time():.3f} rank {self.rank} step {step.index} {step.label} {shape} {step.dtype} {phase}"
        print(line, file=self.trace_file, flush=True)
        heartbeat(line)

    def inputs(self, op: registry.Op, step: Step, seed: int) -> dict:
        kwargs = {"group": self.groups[step.group]} if step.group == "half" else {}
        try:
            return op.make_inputs(step.shape, DTYPES[step.dtype], seed, **kwargs)
        except ValueError as exc:
            raise Skip(str(exc)) from exc

    def reference(self, op: registry.Op, step: Step, seed: int) -> torch.Tensor:
        self.trace(step, f"baseline seed {seed}")
        inputs = self.inputs(op, step, seed)
        try:
            return op.backends[op.baseline](inputs).clone()
        except Exception as exc:
            exc.add_note(f"(raised by the baseline, {op.baseline}, not by {step.backend})")
            raise

    def calls(self, op: registry.Op, step: Step) -> list[float]:
        """Run the step; the check of each call (eager: 1; graph: the warm-up, then each replay)."""
        dtype, fn = DTYPES[step.dtype], op.backends[step.backend]
        probe = self.inputs(op, step, step.seed + 1) if step.graph else None  # first: it may reuse their buffers
        ref, inputs = self.reference(op, step, step.seed), self.inputs(op, step, step.seed)
        self.trace(step, "graph warm-up (side stream)" if step.graph else "eager")
        if not step.graph:
            return [check(op, step.backend, dtype, fn(inputs), ref)]
        fresh_ok, probe, side = refreshable(inputs, probe), None, torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            out = fn(inputs)
        torch.cuda.current_stream().wait_stream(side)
        results, graph = [check(op, step.backend, dtype, out, ref)], torch.cuda.CUDAGraph()
        self.trace(step, "capture")
        with torch.cuda.graph(graph):
            out = fn(inputs)
        for k in range(self.args.replays):
            if fresh_ok:
                ref, fresh = self.reference(op, step, step.seed + 1 + k), self.inputs(op, step, step.seed + 1 + k)
                for key, value in fresh.items():
                    if isinstance(value, torch.Tensor) and value.data_ptr() != inputs[key].data_ptr():
                        inputs[key].copy_(value)
            self.trace(step, f"replay {k + 1}/{self.args.replays}" + ("" if fresh_ok else " (captured values)"))
            graph.replay()
            results.append(check(op, step.backend, dtype, out, ref))
        return results

    def run(self) -> int:
        start = last = time.monotonic()
        done = 0
        while not self.args.launches or done < self.args.launches:
            step = next(self.steps)
            op, n = self.ops[step.op], 1 + (self.args.replays if step.graph else 0)
            flags, results, message = [0.0, 0.0, 0.0], [0.0] * n, None  # skipped, error, unsupported
            try:
                results = (self.calls(op, step) + results)[:n]
            except Skip as exc:
                flags[0], message = 1.0, str(exc)
            except NotImplementedError as exc:
                flags[2], message = 1.0, f"NotImplementedError: {exc}"
            except Exception as exc:
                if isinstance(exc, FATAL) or "CUDA error" in str(exc):  # the context, or the group, is gone
                    print(f"soak: rank {self.rank}: {type(exc).__name__} in step {step.index} ({step.label} "
                          f"{step.shape} {step.dtype}, {'graph' if step.graph else 'eager'}): stopping, the CUDA "
                          "context or the process group is unusable", file=sys.stderr, flush=True)
                    raise
                flags[1], message = 1.0, "".join(traceback.format_exception(exc)[-6:])
            stop = self.args.seconds is not None and time.monotonic() - start >= self.args.seconds
            agreed = torch.tensor(flags + [float(stop)] + results, dtype=torch.float64,
                                  device="cuda" if torch.cuda.is_available() else "cpu")
            dist.all_reduce(agreed, op=dist.ReduceOp.MAX)
            skipped, error, unsupported, stop, *worst = agreed.tolist()
            done += self.record(step, op, skipped, error, unsupported, worst, message)
            if stop:
                break
            if self.rank == 0 and time.monotonic() - last >= self.args.progress_every:
                last, t = time.monotonic(), summarize(self.counts)[2]
                print(f"soak: {last - start:.0f} s, {t['launches']} launches, {t['replays']} replays, "
                      f"{t['mismatches']} mismatches, {t['errors']} errors, {sum(self.skipped.values())} skipped "
                      f"shapes; last {step.label} {step.shape} {step.dtype}", file=sys.stderr, flush=True)
        return self.finish(time.monotonic() - start)

    def record(self, step: Step, op: registry.Op, skipped, error, unsupported, worst, message) -> int:
        """Count an agreed step; returns its calls (towards --launches). Rank 0 prints the first mismatch of each
        op/backend and the first error and unsupported of each op, with every rank's message."""
        where = {"step": step.index, "label": step.label, "shape": "x".join(map(str, step.shape)),
                 "dtype": step.dtype, "mode": "graph" if step.graph else "eager", "seed": step.seed}
        if skipped and not error:
            self.skipped[step.op] = self.skipped.get(step.op, 0) + 1
            self.skips_in_a_row += 1
            if self.skips_in_a_row > MAX_SKIPS_IN_A_ROW:  # the same on every rank: all stop
                raise RuntimeError(f"soak: {MAX_SKIPS_IN_A_ROW} steps in a row refused ({where}: {message})")
            return 0
        self.skips_in_a_row = 0
        row = self.counts.setdefault(step.label, dict.fromkeys(COUNTS, 0))
        if error or unsupported:
            kind, messages = "errors" if error else "unsupported", [None] * self.world_size
            row[kind] += 1
            dist.all_gather_object(messages, message)  # a collective, but only once every rank agreed on it
            first = (kind, step.op) not in self.told  # told once per op
            self.told.add((kind, step.op))
            new = [{**where, "kind": kind.rstrip("s"), "messages": messages}] if first else []
        else:
            rtol = op.rtol.get(DTYPES[step.dtype])
            row["launches"], row["replays"] = row["launches"] + 1, row["replays"] + len(worst) - 1
            row["mismatches"] += sum(err > 0 for err in worst)
            new = [{**where, "kind": "mismatch", "call": call, "rel_err": err, "rtol": rtol}
                   for call, err in enumerate(worst) if err > 0][:max(0, MAX_FAILURES - len(self.failures))]
        if self.rank == 0 and new:
            self.failures += new
            if (new[0]["kind"], step.label) not in self.told:  # print the first of each op/backend
                self.told.add((new[0]["kind"], step.label))
                said = "".join(f"\n  rank {r}: {m}" for r, m in enumerate(new[0].get("messages", ())) if m)
                calls = " (call 0: the eager call or the warm-up, then the replays)" if not said else ""
                print(f"soak: {new[0]['kind'].upper()}{calls}: {({k: v for k, v in new[0].items() if k != 'messages'})}"
                      f"{said}", file=sys.stderr, flush=True)
        return len(worst)

    def finish(self, elapsed_s: float) -> int:
        header, body, _ = summarize(self.counts)
        out = report(self.counts, self.skipped, self.failures, self.world_size, vars(self.args), elapsed_s)
        self.trace_file.close()
        if self.rank == 0:
            print(f"\nSoak: world size {self.world_size}, seed {self.args.seed}, {elapsed_s:.0f} s; skipped shapes "
                  f"(refused by make_inputs): {self.skipped or 'none'}\n")
            print(tabulate(body, headers=header, tablefmt="github"), flush=True)
            with open(self.json, "w") as f:
                json.dump(out, f, indent=1)
            print(f"\nwrote {self.json} (traces: {os.path.splitext(self.json)[0]}-rank*.log); "
                  f"{'FAILED' if out['exit_code'] else 'passed'}", file=sys.stderr, flush=True)
        return out["exit_code"]


def run(args: argparse.Namespace) -> int:
    """Every rank runs this; returns the exit code (the same on every rank)."""
    return Soak(args, {name: op for name, op in registry.load_all().items() if name in args.ops}).run()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ops = registry.load_all()
    grouped = ", ".join(name for name, op in ops.items() if takes_group(op)) or "none"
    parser = argparse.ArgumentParser(prog="python -m benchmark.soak", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add = parser.add_argument
    add("--ops", nargs="+", metavar="OP", help="ops to soak (default: every registered op)")
    add("--backends", help="comma-separated backends to soak, or 'all' (every one but the baseline); default: this "
        "project's, the recipes and their twins (names starting with triton or helion, and chain), except those "
        "under torch.compile (*_compiled: a compile per shape)")
    add("--dtypes", type=lambda text: tuple(text.split(",")), default=tuple(DTYPES),
        help="comma-separated dtypes to draw from, of those each op takes (default: bf16,fp16,fp32)")
    add("--seconds", type=float, help="stop after this long (agreed across ranks)")
    add("--launches", type=int, help="stop after this many calls, replays included (default 1000 without --seconds)")
    add("--graph-every", type=float, default=0.1, help="fraction of steps run as CUDA graph replays (default 0.1)")
    add("--replays", type=int, default=4, help="replays per CUDA graph step (default 4)")
    add("--pool", type=int, default=POOL, help=f"distinct shapes per op and group size (default {POOL}); each may "
        "compile kernels, which the first minutes of a soak spend most of their time on")
    add("--scale", type=float, default=1.0, help="shrink the ops' default shapes by this factor before drawing around "
        "them (default 1.0; 0.25: a quarter of each dimension that varies), for more checked calls a second")
    add("--seed", type=int, default=0, help="the schedule's seed, the same on every rank (default 0)")
    add("--subgroup", action="store_true", help="also run ops on half of the world (two halves by dist.new_group; "
        f"an even world size). Only ops whose make_inputs takes a group can ({grouped}); the other ops' backends "
        "take no group (they use the default one), so they run on the whole world only")
    add("--progress-every", type=float, default=30.0, help="seconds between progress lines (default 30)")
    add("--nproc", type=int, help="processes to spawn when standalone (default: visible GPUs)")
    add("--json", metavar="PATH", help="where to write the counts (default: results/soak-ws<N>.json)")
    args = parser.parse_args(argv)
    args.ops = [name for text in args.ops or list(ops) for name in text.split(",") if name]
    args.backends = [b for b in (args.backends or "").split(",") if b] or None
    names = {"all", *(b for op in ops.values() for b in op.backends)}
    unknown = set(args.ops) - set(ops) or set(args.backends or ()) - names or set(args.dtypes) - set(DTYPES)
    if unknown:
        parser.error(f"unknown op(s), backend(s) or dtype(s): {', '.join(sorted(unknown))}; ops: {', '.join(ops)}")
    if args.seconds is None and args.launches is None:
        args.launches = 1000
    if not 0.0 <= args.graph_every <= 1.0 or args.replays < 1 or (args.launches is not None and args.launches < 1):
        parser.error("--graph-every must be in [0, 1], --replays and --launches >= 1")
    if args.pool < 1 or not 0.0 < args.scale <= 1.0:
        parser.error("--pool must be >= 1 and --scale in (0, 1]")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    count = require_gpus("python -m benchmark.soak")
    nproc = int(os.environ["WORLD_SIZE"]) if in_torchrun() else args.nproc or count
    if not 1 <= nproc <= count and not in_torchrun():
        sys.exit(f"--nproc must be between 1 and the {count} visible GPU(s), got {nproc}.")
    if args.subgroup and nproc % 2:
        sys.exit(f"--subgroup needs an even world size (two halves), got {nproc}")
    if not in_torchrun():
        sys.exit(max(spawn(run, (args,), world_size=nproc, stall_s=STALL_S, name="soak")))
    init_from_env()
    code = run(args)
    dist.destroy_process_group()
    sys.exit(code)


if __name__ == "__main__":
    main()
