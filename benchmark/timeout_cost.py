"""What the barrier timeout costs: the same measurement with it off and on, side by side, in one command.

    python -m benchmark.timeout_cost [--nproc N] [--json PATH]
    torchrun --standalone --nproc-per-node N -m benchmark.timeout_cost [--json PATH]

``KRAKEN_BARRIER_TIMEOUT_S`` is read when ``kraken`` is imported, so each setting runs in processes of its own:
this command starts the measurement as a child run with it ``0`` (off) and one with it ``300`` (on), ``--rounds``
times each, alternating (off, on, then on, off, ...) so that a drift over the run reaches both alike, and prints
one table. Standalone, each child spawns one rank per GPU (``benchmark.launch.spawn``); under torchrun, every
rank starts its own child and the children form a world of their own on a fresh port.

The measurement is the benchmark's own (``harness.run_op``): each backend checked against NCCL, then its GPU time
per call (CUDA events around bursts of 10 calls, the same iteration count on every rank, median over bursts, the
slowest rank's) and its eager-loop time per call (back-to-back calls, nothing queued in front). The cases:
``kraken.one_shot_all_reduce`` and ``kraken.two_shot_all_reduce`` at ``SIZES`` bf16 elements, and the fused
``gemm_reduce_scatter``, ``all_gather_matmul`` and ``gemm_one_shot_all_reduce`` at their benchmark default shapes.
The bar: on costs at most ``BAR_US`` or ``BAR_FRACTION`` of off per call, whichever is larger.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

import torch
import torch.distributed as dist

from benchmark import harness, registry
from benchmark.launch import _free_port, in_torchrun, init_from_env, require_gpus, spawn

ENV = "KRAKEN_BARRIER_TIMEOUT_S"  # kraken._ptx_utils.timeout.ENV (not imported here: the parent never imports kraken)
SETTINGS = {"off": "0", "on": "300"}
SIZES = (4096, 65536, 262144, 1048576)
# registry op -> (backends, shapes or None for the op's default shapes), and the name each backend is called by
CASES = {
    "all_reduce": (("triton_1shot", "triton_2shot"), [(n,) for n in SIZES]),
    "gemm_reduce_scatter": (("triton",), None),
    "all_gather_matmul": (("triton",), None),
    "gemm_all_reduce": (("triton",), None),
}
NAMES = {("all_reduce", "triton_1shot"): "kraken.one_shot_all_reduce",
         ("all_reduce", "triton_2shot"): "kraken.two_shot_all_reduce",
         ("gemm_reduce_scatter", "triton"): "kraken.gemm_reduce_scatter",
         ("all_gather_matmul", "triton"): "kraken.fused.all_gather_matmul",
         ("gemm_all_reduce", "triton"): "kraken.gemm_one_shot_all_reduce"}
BAR_US, BAR_FRACTION = 0.3, 0.01


# The table (pure: tested on CPU), the child runs (GPU), the parent (the child runs, then the table).


def verdict(off: float | None, on: float | None) -> tuple[float | None, float | None, str]:
    """(on - off, (on - off) / off in %, "ok" if on - off <= max(BAR_US, BAR_FRACTION * off) else "OVER")."""
    if off is None or on is None or off <= 0:
        return None, None, "-"
    diff = on - off
    return diff, 100.0 * diff / off, "ok" if diff <= max(BAR_US, BAR_FRACTION * off) + 1e-9 else "OVER"


def merge(runs: list[list[dict]]) -> dict[tuple, dict]:
    """One setting's child runs (record lists) -> per (op, backend, shape): the median of ``us`` and of ``loop_us``
    over the runs, and "ok" only if every run's check passed."""
    keyed: dict[tuple, list[dict]] = {}
    for records in runs:
        for r in records:
            keyed.setdefault((r["op"], r["backend"], r["shape"]), []).append(r)

    def median(values):
        values = [v for v in values if v is not None]
        return statistics.median(values) if values else None

    return {key: {"us": median(r["us"] for r in rs), "loop_us": median(r["loop_us"] for r in rs),
                  "status": next((r["status"] for r in rs if r["status"] != "ok"), "ok")} for key, rs in keyed.items()}


def table(off_runs: list[list[dict]], on_runs: list[list[dict]]) -> tuple[list[str], list[list[str]], list[dict]]:
    """Header, body and JSON rows: per case, GPU us and eager-loop us off, on, on - off, %, verdict."""
    off, on = merge(off_runs), merge(on_runs)
    header = ["op", "shape", "GPU us off", "on", "on-off", "(on-off)/off %", "verdict",
              "loop us off", "on", "on-off", "(on-off)/off %", "verdict"]
    body, rows = [], []
    for key in dict.fromkeys([*off, *on]):
        a, b = off.get(key, {}), on.get(key, {})
        row = {"op": NAMES.get(key[:2], f"{key[0]}/{key[1]}"), "shape": key[2],
               "status": {"off": a.get("status", "missing"), "on": b.get("status", "missing")}}
        line = [row["op"], row["shape"]]
        for metric in ("us", "loop_us"):
            diff, pct, word = verdict(a.get(metric), b.get(metric))
            row[metric] = {"off": a.get(metric), "on": b.get(metric), "diff": diff, "pct": pct, "verdict": word}
            line += [harness._fmt(a.get(metric), 2), harness._fmt(b.get(metric), 2), harness._fmt(diff, 2),
                     harness._fmt(pct, 2), word]
        if row["status"] != {"off": "ok", "on": "ok"}:
            line[-1] += f" (check: off {row['status']['off']}, on {row['status']['on']})"
        body.append(line)
        rows.append(row)
    return header, body, rows


def measure(iters: int, warmup: int) -> dict | None:
    """Every rank runs this; rank 0 returns the records and the timeout this process read at import."""
    from kraken._ptx_utils import timeout

    settings = harness.Settings(iters=iters, warmup=warmup)
    rows = []
    for name, (backends, shapes) in CASES.items():
        op = registry.get(name)
        rows += harness.run_op(op, shapes or op.default_shapes, list(backends), torch.bfloat16, settings)
    if dist.get_rank() != 0:
        return None
    return {"timeout_s": timeout.TIMEOUT_S, "world_size": dist.get_world_size(), "records": harness.records(rows)}


def child(args: argparse.Namespace) -> None:
    if in_torchrun():
        init_from_env()
        result = measure(args.iters, args.warmup)
        dist.destroy_process_group()
    else:
        result = spawn(measure, (args.iters, args.warmup), world_size=args.nproc, stall_s=600.0, name="timeout_cost")[0]
    if result is not None:
        with open(args.child, "w") as f:
            json.dump(result, f)


def run_child(setting: str, args: argparse.Namespace, path: str, port: int | None) -> dict | None:
    env = {**os.environ, ENV: SETTINGS[setting]}
    if port is not None:  # under torchrun: the children's own world, its store hosted by the child of rank 0
        env["MASTER_PORT"] = str(port)
        env.pop("TORCHELASTIC_USE_AGENT_STORE", None)
    cmd = [sys.executable, "-m", "benchmark.timeout_cost", "--child", path, "--iters", str(args.iters),
           "--warmup", str(args.warmup), "--nproc", str(args.nproc or 0)]
    print(f"timeout_cost: child run with {ENV}={SETTINGS[setting]} ({setting}) ...", file=sys.stderr, flush=True)
    code = subprocess.run(cmd, env=env).returncode
    if code != 0:
        sys.exit(f"timeout_cost: the child run with {ENV}={SETTINGS[setting]} failed (exit code {code}); its output "
                 "is above")
    if not os.path.exists(path):
        return None  # not rank 0's child
    with open(path) as f:
        result = json.load(f)
    if result["timeout_s"] != float(SETTINGS[setting]):
        sys.exit(f"timeout_cost: the child run meant to have {ENV}={SETTINGS[setting]} read {result['timeout_s']} s")
    return result


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmark.timeout_cost", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nproc", type=int, help="ranks to spawn when standalone (default: visible GPUs)")
    parser.add_argument("--rounds", type=int, default=1, help="child runs per setting, alternating (default 1)")
    parser.add_argument("--iters", type=int, default=200, help="timed iterations per case, the same on every rank")
    parser.add_argument("--warmup", type=int, default=20, help="untimed warm-up calls per case")
    parser.add_argument("--json", metavar="PATH", help="also write the table's rows and every child run to PATH")
    parser.add_argument("--child", metavar="PATH", help=argparse.SUPPRESS)  # internal: one setting's run
    args = parser.parse_args(argv)
    if args.child:
        args.nproc = args.nproc or None
        return child(args)
    if args.rounds < 1 or args.iters < 1 or args.warmup < 0:
        parser.error("--rounds and --iters must be >= 1 and --warmup >= 0")
    count = require_gpus("python -m benchmark.timeout_cost")
    ports = None
    if in_torchrun():
        dist.init_process_group("gloo")  # the parents' own group, on the CPU: the children's ports, and barriers
        ports = [_free_port() for _ in range(2 * args.rounds)] if dist.get_rank() == 0 else None
        box = [ports]
        dist.broadcast_object_list(box, src=0)
        ports = box[0]
    elif not 1 <= (args.nproc or count) <= count:
        sys.exit(f"--nproc must be between 1 and the {count} visible GPU(s), got {args.nproc}.")
    runs: dict[str, list[dict]] = {"off": [], "on": []}
    workdir = tempfile.mkdtemp(prefix="timeout_cost-")
    for i in range(2 * args.rounds):
        setting = ("off", "on")[(i + i // 2) % 2]  # off, on, on, off, off, on, ...
        result = run_child(setting, args, os.path.join(workdir, f"run{i}.json"), ports and ports[i])
        if ports is not None:
            dist.barrier()
        if result is not None:
            runs[setting].append(result)
    if ports is not None:
        dist.destroy_process_group()
    if not runs["off"]:
        return  # not rank 0
    from tabulate import tabulate

    header, body, rows = table([r["records"] for r in runs["off"]], [r["records"] for r in runs["on"]])
    world_size = runs["off"][0]["world_size"]
    print(f"\nBarrier timeout off ({ENV}=0) vs on ({ENV}=300), bf16, world size {world_size}, {args.rounds} run(s) "
          f"each: us per call (GPU: slowest rank's median burst; loop: back-to-back eager calls). Bar: on - off <= "
          f"max({BAR_US} us, {BAR_FRACTION:.0%} of off).\n")
    print(tabulate(body, headers=header, tablefmt="github", disable_numparse=True))
    over = [f"{r['op']} {r['shape']} ({m})" for r in rows for m in ("us", "loop_us") if r[m]["verdict"] == "OVER"]
    print(f"\n{'Over the bar: ' + ', '.join(over) if over else 'Every row is within the bar.'}")
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump({"bar_us": BAR_US, "bar_fraction": BAR_FRACTION, "settings": SETTINGS, "world_size": world_size,
                       "rows": rows, "runs": runs}, f, indent=1)
        print(f"wrote {args.json}", file=sys.stderr)


if __name__ == "__main__":
    main()
