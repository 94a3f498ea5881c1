"""GPU test of the missing twin, ``helion_ports.comm.all_gather_with_progress``, against its recipe: the same
rows bitwise and every flag set, on odd shapes and dtypes, for the plain functions and the installed ones; 50
installed calls back to back alternating recipe and twin (both barriers self-reset on the same pad); CUDA-graph
replays equal to eager."""

from __future__ import annotations

import importlib

import torch
import torch.distributed as dist

from benchmark.launch import spawn
from gpu_utils import POISON, check_graph_replays, heartbeat, needs_gpus

pytestmark = needs_gpus
SHAPES = ((1, 8), (37, 65), (256, 1024))
MODULE = "comm.all_gather_with_progress"


def shard_values(seed: int, rank: int, shape, dtype) -> torch.Tensor:
    gen = torch.Generator(device="cuda").manual_seed(seed * 1000 + rank)
    return torch.randn(shape, device="cuda", generator=gen).to(dtype)


def worker() -> None:
    import helion_ports
    import kraken

    recipe, twin = (importlib.import_module(f"{p}.{MODULE}") for p in ("kraken", "helion_ports"))
    world_size = dist.get_world_size()
    seed = 0
    for dtype in (torch.bfloat16, torch.float32):
        for shape in SHAPES:
            seed += 1
            shard = kraken.symm_empty(shape, dtype)
            shard.copy_(shard_values(seed, dist.get_rank(), shape, dtype))
            expected = torch.cat([shard_values(seed, r, shape, dtype) for r in range(world_size)])
            for module in (recipe, twin, kraken, helion_ports):  # the plain functions, the installed ones
                what = f"{module.__name__} {dtype} {shape}"
                heartbeat(what)
                out = torch.full((world_size * shape[0], shape[1]), POISON, dtype=dtype, device="cuda")
                started = module.all_gather_with_progress(shard, out=out)
                started.wait()
                torch.cuda.synchronize()
                assert torch.equal(out, expected), what
                assert started.progress.tolist() == [1] * world_size, f"{what}: flags {started.progress.tolist()}"
    shape, dtype = (37, 65), torch.bfloat16
    shard = kraken.symm_empty(shape, dtype)
    srcs = [shard_values(100 + s, dist.get_rank(), shape, dtype) for s in range(5)]
    expected = [torch.cat([shard_values(100 + s, r, shape, dtype) for r in range(world_size)]) for s in range(5)]
    for i in range(50):
        module = (kraken, helion_ports)[i % 2]
        shard.copy_(srcs[i % 5])
        out = module.all_gather_with_progress(shard).wait()
        if i % 10 == 9:
            heartbeat(f"back to back {i + 1}")
            torch.cuda.synchronize()
            assert torch.equal(out, expected[i % 5]), f"call {i} ({module.__name__})"
    inputs = [(s,) for s in srcs[:3]]
    check_graph_replays("helion all_gather_with_progress",
                        lambda src: helion_ports.all_gather_with_progress(shard.copy_(src)).wait(), inputs, range(3))


def test_gather_twin_against_its_recipe():
    spawn(worker, name="helion all_gather_with_progress", stall_s=180.0)
