"""reduce_scatter: NCCL vs torch's symmetric-memory reduce-scatter vs the kraken recipe and its Helion twin.

The shape is the input's element count (1-D, divisible by the world size); every
rank gets its ``NUMEL / world_size`` elements of the sum over ranks.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from benchmark.registry import Op, Pair, SYNC_US, copy_backend, copy_work, nvlink_us, public, register
from kraken.runtime.symm import symm_workspace
from benchmark.sm90 import FAKE_SIGNAL_PADS, example_rank

RECIPE = "comm.reduce_scatter"
EXAMPLE_SHARD = 10007  # odd: every tail is masked and nothing is 16-byte aligned


def make_inputs(shape, dtype, seed):
    """A symmetric buffer of random values (different on every rank) and an ordinary copy for NCCL."""
    (numel,) = shape
    world_size, rank = dist.get_world_size(), dist.get_rank()
    if numel % world_size:
        raise ValueError(f"reduce_scatter: NUMEL = {numel} is not divisible by the world size {world_size}")
    gen = torch.Generator(device="cuda").manual_seed(seed * 1000 + rank)
    values = torch.randn(numel, dtype=torch.float32, device="cuda", generator=gen).to(dtype)
    symm = symm_workspace(numel, dtype, values.device, None, "reduce_scatter")
    symm.copy_(values)
    return {"symm": symm, "plain": values}


def nccl(inputs):
    plain = inputs["plain"]
    out = plain.new_empty(plain.numel() // dist.get_world_size())
    dist.reduce_scatter_tensor(out, plain)
    return out


def symm_mem(inputs):
    """torch's copy-engine reduce-scatter: it runs on a side stream and registers its result as pending
    work; ``wait_tensor`` makes the caller's stream wait for it (and so the timing include it)."""
    out = torch.ops.symm_mem._low_contention_reduce_scatter(inputs["symm"], "sum", dist.group.WORLD.group_name)
    return torch.ops._c10d_functional.wait_tensor(out)


def backend(module_path: str):
    fn = public(module_path)
    return lambda inputs: fn(inputs["symm"])


def example(module, world_size: int, shape=None) -> None:
    """A CPU stand-in launch (rank 1); the default input is ``world_size`` odd shards."""
    (numel,) = shape if shape is not None else (world_size * EXAMPLE_SHARD,)
    if numel % world_size:
        raise ValueError(f"reduce_scatter example: NUMEL = {numel} is not divisible by the world size {world_size}")
    peers = tuple(torch.randn(numel, dtype=torch.bfloat16) for _ in range(world_size))
    out = torch.empty(numel // world_size, dtype=torch.bfloat16)
    module.launch(peers, out, FAKE_SIGNAL_PADS, example_rank(world_size), **module.plan(numel, world_size, {}))


def nvlink_bytes(shape, dtype, world_size):
    # Each rank must receive its shard from every peer: (ws-1)/ws of the input, once.
    return (world_size - 1) / world_size * shape[0] * dtype.itemsize


register(
    Op(
        name="reduce_scatter",
        description="sum a 1-D tensor over all ranks, each rank keeps its 1/ws shard",
        make_inputs=make_inputs,
        backends={
            "nccl": nccl,
            "symm_mem": symm_mem,
            "triton": backend(f"kraken.{RECIPE}"),
            "helion": backend(f"helion_ports.{RECIPE}"),
            "copy": copy_backend("plain"),
        },
        default_shapes=[(1 << k,) for k in range(12, 26)],  # 4K .. 32M elements (64 MB of bf16)
        shape_format="NUMEL",
        library="copy",
        work=lambda shape, dtype: copy_work(shape[0], dtype),
        reference_free=frozenset({"copy"}),
        nvlink_bytes=nvlink_bytes,
        floor_us=lambda shape, dtype, ws: nvlink_us(nvlink_bytes(shape, dtype, ws)) + 2 * SYNC_US,
        pairs=[Pair("triton", "helion", f"kraken.{RECIPE}", f"helion_ports.{RECIPE}", example)],
    )
)
