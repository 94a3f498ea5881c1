"""all_reduce: NCCL vs torch's symmetric-memory kernels vs the kraken recipes and their Helion twins."""

from __future__ import annotations

import importlib

import torch
import torch.distributed as dist

from benchmark.registry import Op, Pair, SYNC_US, copy_backend, copy_work, nvlink_us, public, register
from kraken.runtime.symm import symm_workspace
from benchmark.sm90 import FAKE_SIGNAL_PADS, example_rank

ONE_SHOT = "comm.one_shot_all_reduce"
TWO_SHOT = "comm.two_shot_all_reduce"
AUTO = "all_reduce"  # the front door (kraken.all_reduce): one-shot or two-shot by kraken.runtime.crossover


def make_inputs(shape, dtype, seed):
    """A symmetric buffer of random values (different on every rank) and an ordinary copy for NCCL."""
    (numel,) = shape
    rank = dist.get_rank()
    gen = torch.Generator(device="cuda").manual_seed(seed * 1000 + rank)
    values = torch.randn(numel, dtype=torch.float32, device="cuda", generator=gen).to(dtype)
    symm = symm_workspace(numel, dtype, values.device, None, "all_reduce")
    symm.copy_(values)
    return {"symm": symm, "plain": values}


def nccl(inputs):
    dist.all_reduce(inputs["plain"])
    return inputs["plain"]


def group_name():
    return dist.group.WORLD.group_name


def backend(module_path: str):
    fn = public(module_path)
    return lambda inputs: fn(inputs["symm"])


def example(module, world_size: int, shape=(10007,)) -> None:
    """A CPU stand-in launch of a 1-shot or 2-shot module (both share ``plan``/``launch`` signatures);
    the default size is odd, to exercise the tails."""
    (numel,) = shape
    peers = tuple(torch.randn(numel, dtype=torch.bfloat16) for _ in range(world_size))
    cfg = module.plan(numel, world_size, {})
    if "shard" in cfg:
        module.launch(peers, FAKE_SIGNAL_PADS, example_rank(world_size), **cfg)
    else:
        module.launch(peers, torch.empty_like(peers[0]), FAKE_SIGNAL_PADS, example_rank(world_size), **cfg)


def auto_example(module, world_size: int, shape=(10007,)) -> None:
    """A CPU stand-in launch of the front door (``kraken.all_reduce``, or its twin): the recipe of ``module``'s
    package (``kraken`` or ``helion_ports``) that the door's plan (``kraken.runtime.collectives.all_reduce_plan``)
    picks at this size. The door is no module of its own: its pair names the two-shot recipes."""
    from kraken.runtime.collectives import all_reduce_plan

    (numel,) = shape
    shot = all_reduce_plan(numel, world_size, {})["shot"]
    package = module.__name__.split(".", 1)[0]
    example(importlib.import_module(f"{package}.{ONE_SHOT if shot == 'one' else TWO_SHOT}"), world_size, shape)


def nvlink_bytes(shape, dtype, world_size):
    # The least any all-reduce must receive per rank: (ws-1)/ws of the data, twice.
    return 2 * (world_size - 1) / world_size * shape[0] * dtype.itemsize


register(
    Op(
        name="all_reduce",
        description="sum a 1-D tensor over all ranks",
        make_inputs=make_inputs,
        backends={
            "nccl": nccl,
            "symm_mem_1shot": lambda i: torch.ops.symm_mem.one_shot_all_reduce(i["symm"], "sum", group_name()),
            "symm_mem_2shot": lambda i: torch.ops.symm_mem.two_shot_all_reduce_(i["symm"], "sum", group_name()),
            "triton_1shot": backend(f"kraken.{ONE_SHOT}"),
            "helion_1shot": backend(f"helion_ports.{ONE_SHOT}"),
            "triton_2shot": backend(f"kraken.{TWO_SHOT}"),
            "helion_2shot": backend(f"helion_ports.{TWO_SHOT}"),
            "triton_auto": backend(f"kraken.{AUTO}"),
            "helion_auto": backend(f"helion_ports.{AUTO}"),
            "copy": copy_backend("plain"),
        },
        default_shapes=[(1 << k,) for k in range(12, 23)],  # 4K .. 4M elements
        shape_format="NUMEL",
        library="copy",
        work=lambda shape, dtype: copy_work(shape[0], dtype),
        reference_free=frozenset({"copy"}),
        nvlink_bytes=nvlink_bytes,
        floor_us=lambda shape, dtype, ws: nvlink_us(nvlink_bytes(shape, dtype, ws)) + 2 * SYNC_US,
        pairs=[
            Pair("triton_1shot", "helion_1shot", f"kraken.{ONE_SHOT}", f"helion_ports.{ONE_SHOT}", example),
            Pair("triton_2shot", "helion_2shot", f"kraken.{TWO_SHOT}", f"helion_ports.{TWO_SHOT}", example),
            Pair("triton_auto", "helion_auto", f"kraken.{TWO_SHOT}", f"helion_ports.{TWO_SHOT}", auto_example),
        ],
    )
)
