"""python -m benchmark.inspect OP: each Triton kernel of an op beside its Helion twin, compiled for sm_90.

Needs no GPU. For every registered pair it records the launches of the recipe and
of its twin on CPU stand-in tensors, compiles both for sm_90 and prints side by
side: generated Triton source length, kernel parameters, registers, spills,
shared memory, PTX instructions and the cross-GPU barrier atomics. It is the
first place to look when a twin is slower than its sibling.
"""

from __future__ import annotations

import argparse
import importlib

from tabulate import tabulate

from benchmark import registry, sm90

FIELDS = ["kernel", "source_chars", "params", "registers", "spill_bytes", "shared_bytes", "ptx_instructions",
          "barrier_atomics"]


def inspect_pair(pair: registry.Pair, world_size: int, shape: registry.Shape | None = None) -> list[list]:
    rows = []
    for side, module_path in (("triton", pair.triton_module), ("helion", pair.helion_module)):
        with sm90.capture_launches() as launches:
            module = importlib.import_module(module_path)
            pair.example(module, world_size) if shape is None else pair.example(module, world_size, shape=shape)
        for launch in launches:
            stats = sm90.kernel_stats(launch)
            rows.append([side] + [stats[f] for f in FIELDS])
    return rows


def main(argv: list[str] | None = None) -> None:
    ops = registry.load_all()
    parser = argparse.ArgumentParser(prog="python -m benchmark.inspect", description=__doc__.split("\n")[0])
    parser.add_argument("ops", nargs="*", metavar="OP", help=f"ops to inspect (default: all): {', '.join(ops)}")
    parser.add_argument("--world-size", type=int, default=2, help="world size of the example launch (2..8)")
    parser.add_argument("--shape", metavar="SHAPE", help="compile for this shape, in the op's format (one op only; "
                        "default: a small odd shape per op that exercises every tail)")
    args = parser.parse_args(argv)
    unknown = [o for o in args.ops if o not in ops]
    if unknown:
        parser.error(f"unknown op(s) {', '.join(unknown)}; registered: {', '.join(ops)}")
    if not 2 <= args.world_size <= 8:
        parser.error("--world-size must be between 2 and 8")
    shape = None
    if args.shape:
        if len(args.ops) != 1:
            parser.error("--shape needs exactly one op (shape formats differ between ops)")
        try:
            shape = registry.parse_shape(args.shape, ops[args.ops[0]].shape_format)
        except ValueError as exc:
            parser.error(str(exc))
    for name in args.ops or list(ops):
        for pair in ops[name].pairs:
            where = f"sm_90, world size {args.world_size}" + (f", shape {args.shape}" if shape else "")
            print(f"\n## {name}: {pair.triton} vs {pair.helion} ({where})\n")
            print(tabulate(inspect_pair(pair, args.world_size, shape), headers=["side"] + FIELDS, tablefmt="github"))


if __name__ == "__main__":
    main()
