"""The command line of ``python -m benchmark [OP ...]``: NCCL vs torch symmetric memory vs kraken Triton vs Helion twins.

Run standalone (one process per visible GPU is spawned) or under
``torchrun --standalone --nproc-per-node N -m benchmark ...``.
"""

from __future__ import annotations

import argparse
import csv
import json
import sys

import torch

from benchmark import harness, provenance, registry
from benchmark.launch import in_torchrun, init_from_env, print_rank0, require_gpus, spawn

# Without an OP (or with --quick) a quick look: QUICK_SHAPES shapes per op (harness.quick_shapes), few iterations
# and a tight row budget; with an OP (or with --full) every default shape, as many iterations as the tables want.
QUICK = {"iters": 20, "warmup": 3, "row_budget_s": 20.0}
FULL = {"iters": 200, "warmup": 20, "row_budget_s": 120.0}
DTYPES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16,
          "fp32": torch.float32, "float32": torch.float32}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ops = registry.load_all()
    listing = "\n".join(
        f"  {op.name:<26} {op.description}; shapes {op.shape_format}; backends: {', '.join(op.backends)}"
        for op in ops.values()
    )
    parser = argparse.ArgumentParser(
        prog="python -m benchmark",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description=(
            "Check every backend against the NCCL baseline on fresh random data, then time it with a fixed\n"
            "number of iterations on every rank (CUDA events around bursts of calls, slowest rank's median;\n"
            "a shape's backends take turns burst by burst, each burst after a GPU rest three times its length,\n"
            "so every backend runs at the clocks of a rested GPU)\n"
            "and print per op, under a line saying where it was measured (GPUs, driver, NVLinks, versions, commit):\n"
            "the GPU time per call of each backend, speedup over NCCL, helion/triton ratio, achieved NVLink\n"
            "bandwidth (the op's minimum bytes per rank / time) and the floor (those bytes at 361 GB/s + barrier\n"
            "latency; for GEMMs the matmul at 790 TFLOP/s); then the time per call in an eager loop of back-to-back\n"
            "calls (what a Python loop sees: the host launch path included) and the host cost per call.\n"
            "Standalone it spawns one process per visible GPU; under torchrun it uses that world.\n\n"
            "On one GPU it runs world size 1 (a peer set of one: the same kernels, workspaces and barriers) and\n"
            "prints first, per op, the core table: the recipe and its Helion twin beside the fastest single-GPU\n"
            "library op (cuBLAS, torch._scaled_mm, SDPA cuDNN/flash, a device-to-device copy of the same bytes),\n"
            "with TFLOP/s or GB/s, recipe/library, twin/recipe and the eager loop per call. World size 1 measures\n"
            "the cores and the host path, not the exchange.\n\n"
            f"Without an OP it is a quick look at every op (meant to finish within 15 minutes on 4 GPUs): "
            f"{harness.QUICK_SHAPES} of each\nop's default shapes (the smallest, the middle and the largest by work "
            f"per call), {QUICK['iters']} iterations after {QUICK['warmup']} warm-up\ncalls and a "
            f"{QUICK['row_budget_s']:g} s row budget. --full runs every default shape with {FULL['iters']} iterations "
            f"after {FULL['warmup']} warm-up calls\nand a {FULL['row_budget_s']:g} s row budget; it is the default "
            "when OPs are named (--quick makes that a quick look too).\n--shapes, --iters, --warmup and "
            "--row-budget-s, when given, win over either. Rank 0 prints a line as each\nshape finishes, with the "
            "time so far and an estimate of the time left, and at the end a summary: each\nTriton recipe over the "
            "best library backend, and for the fused GEMMs the share of the exchange they hide."
        ),
        epilog="registered ops:\n" + listing,
    )
    parser.add_argument("ops", nargs="*", metavar="OP", help="ops to run (default: every registered op)")
    parser.add_argument("--backends", help="comma-separated backends to run (default: all of the op's)")
    parser.add_argument("--shapes", "--sizes", nargs="+", metavar="SHAPE",
                        help="shapes in the op's format, e.g. 4096 65536 (all_reduce) or 128x4096x4096 (gemm)")
    parser.add_argument("--dtype", default="bf16", choices=sorted(DTYPES), help="element type (default bf16)")
    look = parser.add_mutually_exclusive_group()
    look.add_argument("--quick", action="store_true",
                      help=f"a quick look (the default without an OP): {harness.QUICK_SHAPES} shapes per op, --iters "
                           f"{QUICK['iters']} --warmup {QUICK['warmup']} --row-budget-s {QUICK['row_budget_s']:g}")
    look.add_argument("--full", action="store_true",
                      help=f"the full sweep (the default with an OP): every default shape, --iters {FULL['iters']} "
                           f"--warmup {FULL['warmup']} --row-budget-s {FULL['row_budget_s']:g}")
    parser.add_argument("--iters", type=int,
                        help=f"timed iterations per backend, same on every rank (default {QUICK['iters']} quick, "
                             f"{FULL['iters']} full)")
    parser.add_argument("--warmup", type=int, help=f"warm-up calls per backend (default {QUICK['warmup']} quick, "
                                                   f"{FULL['warmup']} full; fewer where they would take more than a "
                                                   "quarter of the row budget)")
    parser.add_argument("--row-budget-s", type=float, metavar="S",
                        help="GPU seconds one backend's row may take (default "
                             f"{QUICK['row_budget_s']:g} quick, {FULL['row_budget_s']:g} full; 0: no limit): a "
                             "backend whose call, timed in its warm-up (the slowest rank's), projects its row over "
                             "it is timed in shorter bursts without its eager loop, or skipped with a cell that says "
                             "so; every rank decides alike")
    parser.add_argument("--cuda-graph", action="store_true", help="time CUDA-graph replays instead of eager calls")
    parser.add_argument("--burst", type=int, default=10,
                        help="back-to-back calls between two CUDA events (or per CUDA graph); 1 puts events around "
                             "every call, which adds ~2.5 us of event overhead to each (default 10)")
    parser.add_argument("--l2-flush", action="store_true", help="flush L2 (256 MB write) before every timed call")
    parser.add_argument("--csv", metavar="PATH", help="also write every row to this CSV file")
    parser.add_argument("--json", metavar="PATH", help="also write every row to this JSON file (the input of "
                        "python -m benchmark.report)")
    parser.add_argument("--plot", metavar="DIR", help="also draw one PNG per op into DIR: time per call against size "
                        "for every backend with the floor, and the speedup over NCCL (needs matplotlib: "
                        'pip install -e ".[plot]")')
    parser.add_argument("--nproc", type=int, help="processes to spawn when standalone (default: visible GPUs)")
    args = parser.parse_args(argv)

    unknown = [name for name in args.ops if name not in ops]
    if unknown:
        parser.error(f"unknown op(s) {', '.join(unknown)}; registered: {', '.join(ops)}")
    args.quick = args.quick or not (args.full or args.ops)
    for key, value in (QUICK if args.quick else FULL).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    args.row_budget_s = args.row_budget_s or None  # 0: no limit
    args.ops = args.ops or list(ops)
    if args.iters < 1 or args.warmup < 0 or args.burst < 1 or (args.row_budget_s or 0) < 0:
        parser.error("--iters and --burst must be >= 1, --warmup and --row-budget-s >= 0")
    if args.backends:
        args.backends = [b.strip() for b in args.backends.split(",") if b.strip()]
        known = {b for name in args.ops for b in ops[name].backends}
        bad = [b for b in args.backends if b not in known]
        if bad:
            parser.error(f"unknown backend(s) {', '.join(bad)}; the chosen ops have: {', '.join(sorted(known))}")
    if args.shapes:
        if len(args.ops) != 1:
            parser.error("--shapes needs exactly one op (shape formats differ between ops)")
        op = ops[args.ops[0]]
        try:
            args.shapes = [registry.parse_shape(s, op.shape_format) for s in args.shapes]
        except ValueError as exc:
            parser.error(str(exc))
    return args


def shapes_of(args: argparse.Namespace, op: registry.Op) -> list[registry.Shape]:
    """The shapes to run: ``--shapes``, else a quick look's (``harness.quick_shapes``), else the op's defaults."""
    if args.shapes:
        return args.shapes
    return harness.quick_shapes(op, DTYPES[args.dtype]) if args.quick else op.default_shapes


def run(args: argparse.Namespace) -> list[harness.Row]:
    """Every rank runs this; rank 0 prints."""
    from tabulate import tabulate

    from benchmark import report

    dtype = DTYPES[args.dtype]
    settings = harness.Settings(iters=args.iters, warmup=args.warmup, cuda_graph=args.cuda_graph,
                                burst=args.burst, l2_flush=args.l2_flush, row_budget_s=args.row_budget_s)
    world_size = torch.distributed.get_world_size()
    meta = provenance.collect(args.iters, args.warmup, 1 if args.l2_flush else args.burst)
    plan = []  # (op, its backends, its shapes)
    for name in args.ops:
        op = registry.get(name)
        plan.append((op, [b for b in op.backends if not args.backends or b in args.backends], shapes_of(args, op)))
    progress = harness.Progress(sum(len(backends) * len(shapes) for _, backends, shapes in plan))
    budget = f"{args.row_budget_s:g} s row budget" if args.row_budget_s else "no row budget"
    look = "quick look" if args.quick else "full sweep"
    print_rank0(f"{look}: {len(plan)} ops, {progress.total} (op, shape, backend) rows, {args.iters} iters after "
                f"{args.warmup} warm-up calls, {budget}" + ("; --full for every default shape" if args.quick else ""),
                file=sys.stderr)
    all_rows = []
    for op, backends, shapes in plan:
        mode = "CUDA graph" if args.cuda_graph else "eager"
        of_shapes = f"{len(shapes)} of {len(op.default_shapes)} default shapes, "
        of_shapes = of_shapes if args.quick and not args.shapes else ""
        print_rank0(f"\n## {op.name}: {op.description} ({args.dtype}, world size {world_size}, {mode}, {of_shapes}"
                    f"{args.iters} iters in bursts of {1 if args.l2_flush else args.burst}, {torch.cuda.get_device_name()})\n")
        print_rank0(f"Measured on {provenance.describe(meta)}.\n")
        rows = harness.run_op(op, shapes, backends, dtype, settings, meta, progress)
        print_rank0(harness.tables_markdown(op, rows, backends))
        host_header, host_body = harness.host_table(rows, backends)
        print_rank0("\nEager host launch cost (median over shapes):\n")
        print_rank0(tabulate(host_body, headers=host_header, tablefmt="github", disable_numparse=True))
        for line in harness.failures(rows):
            print_rank0(f"  not timed: {line}")
        for line in harness.shortened(rows):
            print_rank0(f"  shortened by the row budget: {line}")
        all_rows += rows
    overview = report.summary_markdown(all_rows)
    if overview:
        print_rank0(f"\n## Summary\n\n{overview}")
    print_rank0(f"\n{look} done in {harness.duration(progress.clock() - progress.start)}", file=sys.stderr)
    return all_rows


def write_outputs(args: argparse.Namespace, rows: list[harness.Row]) -> None:
    records = harness.records(rows)
    if args.csv and records:
        with open(args.csv, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(records[0]))
            writer.writeheader()
            writer.writerows(records)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(records, f, indent=1)
    if args.plot and rows:
        from benchmark import report

        for path in report.plot_all(rows, args.plot):
            print(f"wrote {path}", file=sys.stderr)


def _spawned_main(args: argparse.Namespace):
    rows = run(args)
    return rows if torch.distributed.get_rank() == 0 else None


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if in_torchrun():
        require_gpus("python -m benchmark")
        init_from_env()
        rows = run(args)
        if torch.distributed.get_rank() == 0:
            write_outputs(args, rows)
        torch.distributed.destroy_process_group()
        return
    count = require_gpus("python -m benchmark")
    nproc = args.nproc or count
    if not 1 <= nproc <= count:
        sys.exit(f"--nproc must be between 1 and the {count} visible GPU(s), got {nproc}.")
    # Ample stall limit: the first call of each backend compiles (Triton and Helion).
    rows = spawn(_spawned_main, (args,), world_size=nproc, stall_s=600.0, name="benchmark")[0]
    write_outputs(args, rows)


if __name__ == "__main__":
    main()
