"""python -m benchmark.tune: sweep launch configs of the all-reduce recipes, print the best per size.

The sweep times each Triton recipe through its public ``**config`` overrides with
the harness's own timer (fixed iterations, slowest rank's median); the Helion
twins share ``plan`` and so the chosen config. Results feed ``DEFAULT_CONFIG`` /
``plan`` in the recipes.
"""

from __future__ import annotations

import argparse
import itertools

import torch

from benchmark import harness
from benchmark.launch import heartbeat, print_rank0, require_gpus, spawn
from benchmark.ops.all_reduce import make_inputs
from kraken.comm import one_shot_all_reduce, two_shot_all_reduce

TILES = [(1024, 4), (2048, 8), (4096, 16), (8192, 16)]  # (block_size, num_warps): 8-16 elements per thread
MAX_BLOCKS = [8, 16, 32, 64, 132]


def sweep(sizes: list[int], iters: int) -> None:
    settings = harness.Settings(iters=iters, warmup=5)
    for name, fn in (("1shot", one_shot_all_reduce), ("2shot", two_shot_all_reduce)):
        for numel in sizes:
            inputs = make_inputs((numel,), torch.bfloat16, 1)
            results = []
            for (block_size, num_warps), max_blocks in itertools.product(TILES, MAX_BLOCKS):
                heartbeat(f"{name} {numel} {block_size} {num_warps} {max_blocks}")
                cfg = {"block_size": block_size, "num_warps": num_warps, "max_blocks": max_blocks}
                call = lambda: fn(inputs["symm"], **cfg)  # noqa: E731
                for _ in range(settings.warmup):
                    call()
                us = harness._slowest(harness.device_time_us(call, settings, 30.0))
                results.append((us, cfg))
            results.sort(key=lambda r: r[0])
            best = ", ".join(f"{us:.1f}us {c['block_size']}/{c['num_warps']}/{c['max_blocks']}" for us, c in results[:3])
            print_rank0(f"{name} numel={numel:>8}: {best}   (worst {results[-1][0]:.1f}us)")


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmark.tune", description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", nargs="+", type=int, default=[1 << k for k in range(12, 23, 2)])
    parser.add_argument("--iters", type=int, default=50)
    args = parser.parse_args()
    require_gpus("python -m benchmark.tune")
    spawn(sweep, (args.sizes, args.iters), stall_s=300.0, name="tune")


if __name__ == "__main__":
    main()
