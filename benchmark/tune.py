"""python -m benchmark.tune OP: sweep the launch configs of a recipe, print the best per shape.

The sweep times each Triton recipe through its public ``**config`` overrides with
the harness's own timer (fixed iterations, slowest rank's median); the Helion
twins share ``plan`` and so the chosen config. Results feed ``DEFAULT_CONFIG`` /
``default_config`` in the recipes. Ops: ``all_reduce`` (both recipes) and
``gemm_all_reduce``. Configs that do not fit the GPU (shared memory) are skipped.
"""

from __future__ import annotations

import argparse
import itertools

import torch
import triton

from benchmark import harness
from benchmark.launch import heartbeat, print_rank0, require_gpus, spawn
from benchmark.registry import parse_shape

ALL_REDUCE_TILES = [(1024, 4), (2048, 8), (4096, 16), (8192, 16)]  # (block_size, num_warps): 8-16 per thread
ALL_REDUCE_MAX_BLOCKS = [8, 16, 32, 64, 132]
GEMM_SHAPES = ["64x4096x4096", "128x4096x4096", "256x4096x4096", "512x4096x4096", "128x8192x8192",
               "512x5120x5120", "1024x4096x4096", "2048x4096x4096"]
# (block_m, block_n, block_k) x num_warps x num_stages; reduce_m is min(32, block_m).
GEMM_TILES = [(64, 32, 128), (64, 32, 256), (64, 64, 128), (64, 64, 256), (64, 128, 64), (64, 128, 128),
              (128, 64, 64), (128, 64, 128), (128, 128, 64), (128, 256, 64), (32, 64, 256), (16, 64, 256)]
GEMM_WARPS = [4, 8]
GEMM_STAGES = [3, 4, 5]


def _time(call, settings: harness.Settings) -> float:
    for _ in range(settings.warmup):
        call()
    return harness._slowest(harness.device_time_us(call, settings, 30.0))


def _report(label: str, results: list[tuple[float, str]], default_us: float | None = None) -> None:
    results.sort(key=lambda r: r[0])
    best = ", ".join(f"{us:.1f}us {cfg}" for us, cfg in results[:4])
    tail = "" if default_us is None else f"   (default {default_us:.1f}us)"
    print_rank0(f"{label}: {best}   (worst {results[-1][0]:.1f}us){tail}")


def sweep_all_reduce(shapes: list[str], iters: int) -> None:
    from benchmark.ops.all_reduce import make_inputs
    from kraken import one_shot_all_reduce, two_shot_all_reduce

    settings = harness.Settings(iters=iters, warmup=5)
    for name, fn in (("1shot", one_shot_all_reduce), ("2shot", two_shot_all_reduce)):
        for shape in shapes:
            inputs = make_inputs(parse_shape(shape, "N"), torch.bfloat16, 1)
            results = []
            for (block_size, num_warps), max_blocks in itertools.product(ALL_REDUCE_TILES, ALL_REDUCE_MAX_BLOCKS):
                heartbeat(f"{name} {shape} {block_size} {num_warps} {max_blocks}")
                cfg = {"block_size": block_size, "num_warps": num_warps, "max_blocks": max_blocks}
                us = _time(lambda: fn(inputs["symm"], **cfg), settings)
                results.append((us, f"{block_size}/{num_warps}/{max_blocks}"))
            _report(f"{name} numel={shape:>8}", results)


def sweep_gemm(shapes: list[str], iters: int) -> None:
    from benchmark.ops.gemm_all_reduce import OUT_DTYPE, make_inputs
    from kraken import gemm_one_shot_all_reduce as fn  # the installed recipe

    settings = harness.Settings(iters=iters, warmup=3)
    inputs = {s: make_inputs(parse_shape(s, "MxNxK"), torch.bfloat16, 1) for s in shapes}
    results: dict[str, list] = {s: [] for s in shapes}
    defaults = {}
    for s, i in inputs.items():
        defaults[s] = _time(lambda: fn(i["a"], i["b"], out_dtype=OUT_DTYPE), settings)
        matmul = _time(lambda: torch.matmul(i["a"], i["b"]), settings)
        print_rank0(f"{s}: default config {defaults[s]:.1f}us, torch.matmul alone {matmul:.1f}us")
    for (bm, bn, bk), warps, stages in itertools.product(GEMM_TILES, GEMM_WARPS, GEMM_STAGES):
        cfg = {"block_m": bm, "block_n": bn, "block_k": bk,
               "num_warps": warps, "num_stages": stages}
        label = f"{bm}x{bn}x{bk}/w{warps}/s{stages}"
        heartbeat(label)
        for s, i in inputs.items():
            if bm > 64 and parse_shape(s, "MxNxK")[0] <= 64:
                continue
            try:
                us = _time(lambda: fn(i["a"], i["b"], out_dtype=OUT_DTYPE, **cfg), settings)
            except triton.runtime.errors.OutOfResources:  # the same on every rank: skip the config
                break
            results[s].append((us, label))
    for s in shapes:
        _report(s, results[s], defaults[s])


SWEEPS = {"all_reduce": (sweep_all_reduce, [str(1 << k) for k in range(12, 23, 2)]),
          "gemm_all_reduce": (sweep_gemm, GEMM_SHAPES)}


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmark.tune", description=__doc__.split("\n")[0])
    parser.add_argument("op", choices=sorted(SWEEPS), help="which recipe's configs to sweep")
    parser.add_argument("--shapes", nargs="+", help="shapes in the op's format (default: the op's tuning set)")
    parser.add_argument("--iters", type=int, default=30, help="timed iterations per config, same on every rank")
    args = parser.parse_args()
    count = require_gpus("python -m benchmark.tune")
    fn, default_shapes = SWEEPS[args.op]
    spawn(fn, (args.shapes or default_shapes, args.iters), world_size=count, stall_s=300.0, name="tune")


if __name__ == "__main__":
    main()
