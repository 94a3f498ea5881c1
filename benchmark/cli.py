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
            "the cores and the host path, not the exchange."
        ),
        epilog="registered ops:\n" + listing,
    )
    parser.add_argument("ops", nargs="*", metavar="OP", help="ops to run (default: every registered op)")
    parser.add_argument("--backends", help="comma-separated backends to run (default: all of the op's)")
    parser.add_argument("--shapes", "--sizes", nargs="+", metavar="SHAPE",
                        help="shapes in the op's format, e.g. 4096 65536 (all_reduce) or 128x4096x4096 (gemm)")
    parser.add_argument("--dtype", default="bf16", choices=sorted(DTYPES), help="element type (default bf16)")
    parser.add_argument("--iters", type=int, default=200, help="timed iterations per backend, same on every rank")
    parser.add_argument("--warmup", type=int, default=20, help="untimed warm-up calls per backend")
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
    args.ops = args.ops or list(ops)
    if args.iters < 1 or args.warmup < 0 or args.burst < 1:
        parser.error("--iters and --burst must be >= 1 and --warmup >= 0")
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


def run(args: argparse.Namespace) -> list[harness.Row]:
    """Every rank runs this; rank 0 prints."""
    from tabulate import tabulate

    dtype = DTYPES[args.dtype]
    settings = harness.Settings(iters=args.iters, warmup=args.warmup, cuda_graph=args.cuda_graph,
                                burst=args.burst, l2_flush=args.l2_flush)
    world_size = torch.distributed.get_world_size()
    meta = provenance.collect(args.iters, args.warmup, 1 if args.l2_flush else args.burst)
    all_rows = []
    for name in args.ops:
        op = registry.get(name)
        backends = [b for b in op.backends if not args.backends or b in args.backends]
        shapes = args.shapes or op.default_shapes
        mode = "CUDA graph" if args.cuda_graph else "eager"
        print_rank0(f"\n## {op.name}: {op.description} ({args.dtype}, world size {world_size}, {mode}, "
                    f"{args.iters} iters in bursts of {1 if args.l2_flush else args.burst}, {torch.cuda.get_device_name()})\n")
        print_rank0(f"Measured on {provenance.describe(meta)}.\n")
        rows = harness.run_op(op, shapes, backends, dtype, settings, meta)
        print_rank0(harness.tables_markdown(op, rows, backends))
        host_header, host_body = harness.host_table(rows, backends)
        print_rank0("\nEager host launch cost (median over shapes):\n")
        print_rank0(tabulate(host_body, headers=host_header, tablefmt="github", disable_numparse=True))
        for line in harness.failures(rows):
            print_rank0(f"  not timed: {line}")
        all_rows += rows
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
