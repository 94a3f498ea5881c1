"""GPU tests of the front doors (``kraken.all_reduce``, ``kraken.all_reduce_bias[_rms_norm]``) and their
twins: against float64 on both sides of the crossover at this world size, with ``shot`` forced both ways; the
same bits as the recipe the table names, called directly; CUDA-graph replays equal to eager."""

from __future__ import annotations

import functools
import importlib

import torch
import torch.distributed as dist

from check_all import check_all
from benchmark.launch import spawn
from gpu_utils import assert_close, check_graph_replays, heartbeat, needs_gpus

pytestmark = needs_gpus
BF16 = torch.bfloat16
EPS = 1e-5
HIDDEN = 520  # not a multiple of any block: every row has a tail


def rank_tensor(seed: int, rank: int, shape) -> torch.Tensor:
    gen = torch.Generator(device="cuda").manual_seed(seed * 1000 + rank)
    return torch.randn(shape, device="cuda", generator=gen).to(BF16)


def every_rank(seed: int, shape) -> torch.Tensor:
    return sum(rank_tensor(seed, r, shape).double() for r in range(dist.get_world_size()))


def sizes_around(op: str, world_size: int) -> tuple[int, ...]:
    """1, an odd size, and the last size the table runs one-shot and the next (capped for a shared GPU)."""
    from kraken.runtime import crossover

    last = min(crossover.one_shot_up_to(op, world_size), 1 << 20 if op == "all_reduce" else 256)
    return (1, 37, int(last), int(last) + 1)


def all_reduce_worker(package: str) -> None:
    import kraken
    from kraken.runtime import crossover

    comm = importlib.import_module(package)
    world_size, seed = dist.get_world_size(), 0
    for numel in sizes_around("all_reduce", world_size):
        chosen = crossover.choose("all_reduce", numel, world_size)
        buf = kraken.symm_empty(numel, BF16)
        for shot in (None, "one", "two"):
            seed += 1
            what = f"{package} all_reduce numel={numel} shot={shot} (table: {chosen})"
            heartbeat(what)
            mine = rank_tensor(seed, dist.get_rank(), numel)
            out = comm.all_reduce(buf.copy_(mine), **({} if shot is None else {"shot": shot})).clone()
            torch.cuda.synchronize()
            assert_close(out, every_rank(seed, numel).to(BF16), what)
            direct = getattr(comm, f"{shot or chosen}_shot_all_reduce")(buf.copy_(mine))
            assert torch.equal(out, direct), f"{what}: differs from the {shot or chosen}-shot recipe called directly"
    numel = sizes_around("all_reduce", world_size)[-1]
    buf = kraken.symm_empty(numel, BF16)
    inputs = [(rank_tensor(100 + s, dist.get_rank(), numel),) for s in range(3)]
    # A clone: the two-shot sums in place, so every eager call would return ``buf`` itself.
    check_graph_replays(f"{package} all_reduce", lambda src: comm.all_reduce(buf.copy_(src)).clone(), inputs, range(3))


def bias_worker(package: str) -> None:
    from kraken.runtime import crossover

    fused = importlib.import_module(package)
    world_size, seed = dist.get_world_size(), 0
    bias, weight = rank_tensor(7, 99, HIDDEN), (1 + 0.5 * rank_tensor(8, 99, HIDDEN).float()).to(BF16)
    for name, args in (("all_reduce_bias", (bias,)), ("all_reduce_bias_rms_norm", (bias, weight, EPS))):
        for tokens in sizes_around(name, world_size):
            chosen = crossover.choose(name, tokens, world_size)
            for shot in (None, "one", "two"):
                seed += 1
                what = f"{package} {name} tokens={tokens} shot={shot} (table: {chosen})"
                heartbeat(what)
                mine = rank_tensor(seed, dist.get_rank(), (tokens, HIDDEN))
                out = getattr(fused, name)(mine, *args, **({} if shot is None else {"shot": shot}))
                torch.cuda.synchronize()
                total = every_rank(seed, (tokens, HIDDEN)) + bias.double()
                if len(args) > 1:
                    total = total * torch.rsqrt(total.pow(2).mean(-1, keepdim=True) + EPS) * weight.double()
                assert_close(out, total.to(BF16), what)
                recipe = getattr(fused, f"{shot or chosen}_shot_{name}")
                assert torch.equal(out, recipe(mine, *args)), f"{what}: differs from the recipe called directly"
        tokens = sizes_around(name, world_size)[-1]
        inputs = [(rank_tensor(200 + s, dist.get_rank(), (tokens, HIDDEN)),) for s in range(3)]
        check_graph_replays(f"{package} {name}", lambda x: getattr(fused, name)(x, *args), inputs, range(3))


def front_doors_worker() -> None:
    check_all([(f"{package} {kind}", functools.partial(worker, package))
               for package in ("kraken", "helion_ports")
               for kind, worker in (("all_reduce", all_reduce_worker), ("bias family", bias_worker))])


def test_front_doors_and_twins():
    spawn(front_doors_worker, name="front doors", stall_s=180.0)  # Helion compiles with ranks sharing a host
