"""Helion twin of ``kraken/fused/two_shot_all_reduce_bias.py``: the same algorithm, plan and arguments.

Same five steps as the Triton recipe. The workspaces arrive as ``[2, numel]``
views (row 0: staged input, row 1: pushed result), so "the result region" is
index ``1`` rather than a pointer offset, and their result rows once more as
views of their own (``results``: see ``kraken._blocks.helion.views``), which the pushes
``hl.store(results[r], ...)`` write. ``hl.static_range(world_size)`` over the
shard owners unrolls the staging and gathering loops exactly like
``tl.static_range`` in the Triton kernel.

``helion_ports.two_shot_all_reduce_bias`` is the installed twin (checks agreed across ranks, prepared calls,
replayed launches). Set ``HELION_PRINT_OUTPUT_CODE=1`` to see the generated Triton.

    torchrun --nproc-per-node 2 helion_ports/fused/two_shot_all_reduce_bias.py
"""

from __future__ import annotations

import functools
import os
import time

import helion
import helion.language as hl
import torch
import torch.distributed as dist
import torch.distributed._symmetric_memory as symm_mem

from kraken._blocks.helion import flat_kernel, own_storage, run, views
from kraken._ptx_utils import barrier_blocks
from kraken._ptx_utils.inline_source import SYMM_MEM_SYNC

# The recipe's defaults (kraken/fused/two_shot_all_reduce_bias.py), kept equal by a test.
DEFAULT_CONFIG = {"block_size": 4096, "num_warps": 16, "max_blocks": 132}
SHARD_ALIGN = 64  # elements: keeps every shard and chunk start 16-byte aligned for vector access
WORKSPACE_COPIES = 2  # staged input, then the pushed result

# Both barriers: "my writes are visible to you" (release) and "yours to me" (acquire).
SYNC = SYMM_MEM_SYNC[(True, True)]


def two_shot_all_reduce_bias_body(
    x: torch.Tensor,
    bias: torch.Tensor,
    workspace: torch.Tensor,
    peers: tuple[torch.Tensor, ...],
    results: tuple[torch.Tensor, ...],
    out: torch.Tensor,
    signal_pad_ptrs: int,
    num_blocks: int,
    shard: int,
    chunk: int,
    rank: int,
    world_size: hl.constexpr,
    group_name: hl.ProcessGroupName,
) -> torch.Tensor:
    numel = x.size(0)
    hidden = bias.size(0)
    for block in hl.grid(num_blocks):
        barrier = {"signal_pad_ptrs": signal_pad_ptrs, "block_id": block, "rank": rank, "world_size": world_size}
        for owner in hl.static_range(world_size):
            start = owner * shard + block * chunk
            # Ranges are clipped, as in the recipe, rather than masked per element: with one bound ptxas
            # batches the peers' loads as it does for the recipe (the CPU tests compare the schedules).
            for tile in hl.tile(start, min(start + chunk, min(owner * shard + shard, numel))):
                hl.store(workspace, [0, tile], hl.load(x, [tile]))
        hl.inline_triton(SYNC, args=barrier, output_like=None)
        start = rank * shard + block * chunk
        for tile in hl.tile(start, min(start + chunk, min(rank * shard + shard, numel))):
            acc = hl.load(peers[0], [0, tile]).to(torch.float32)
            for r in hl.static_range(world_size):  # not (1, world_size): docs/helion-notes.md
                if r > 0:  # rank order, from rank 0's value, as in the recipe (folded at compile time)
                    acc = acc + hl.load(peers[r], [0, tile]).to(torch.float32)
            acc = acc + hl.load(bias, [tile.index % hidden]).to(torch.float32)
            result = acc.to(out.dtype)
            # Into views of the result regions, not peers[r][1, ...]: ptxas then issued 3 of the 4 peers' loads
            # before the first add at 4 ranks (the recipe 4) and 3 of 8 at 8 (the recipe 5); see kraken._blocks.helion.views.
            for r in hl.static_range(world_size):
                hl.store(results[r], [tile], result)
        hl.inline_triton(SYNC, args=barrier, output_like=None)
        for owner in hl.static_range(world_size):
            start = owner * shard + block * chunk
            for tile in hl.tile(start, min(start + chunk, min(owner * shard + shard, numel))):
                hl.store(out, [tile], hl.load(workspace, [1, tile]))
    return out


@functools.cache
def compiled(block_size: int, num_warps: int) -> helion.Kernel:
    """One Helion kernel per launch configuration, each with an explicit config.

    ``pid_type="flat"``: the recipe's grid, one program per block (see ``helion_ports``).
    """
    return flat_kernel(two_shot_all_reduce_bias_body, (block_size,) * 3, num_warps)


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def plan(tokens: int, hidden: int, world_size: int, config: dict, pad_bytes: int | None = None) -> dict:
    """The recipe's plan: ``world_size`` shards of whole ``SHARD_ALIGN`` runs, a persistent grid of at most one
    block per ``block_size`` elements of a shard, ``max_blocks``, and the block ids the signal pad holds."""
    unknown = set(config) - set(DEFAULT_CONFIG)
    if unknown:
        raise TypeError(
            f"two_shot_all_reduce_bias: unknown config keys {sorted(unknown)}; known: {sorted(DEFAULT_CONFIG)}")
    cfg = {**DEFAULT_CONFIG, **config}
    numel, block_size = tokens * hidden, cfg["block_size"]
    shard = cdiv(cdiv(numel, world_size), SHARD_ALIGN) * SHARD_ALIGN
    pad_bytes = symm_mem.get_signal_pad_size() if pad_bytes is None else pad_bytes
    num_blocks = max(1, min(cdiv(shard, block_size), cfg["max_blocks"], barrier_blocks(world_size, pad_bytes)))
    chunk = cdiv(cdiv(shard, num_blocks), SHARD_ALIGN) * SHARD_ALIGN
    return {
        "block_size": block_size, "num_warps": cfg["num_warps"], "num_blocks": num_blocks,
        "shard": shard, "chunk": chunk,
    }


def launch(
    x: torch.Tensor,
    bias: torch.Tensor,
    peers: tuple[torch.Tensor, ...],
    out: torch.Tensor,
    signal_pad_ptrs: int,
    rank: int,
    block_size: int,
    num_warps: int,
    num_blocks: int,
    shard: int,
    chunk: int,
    group_name: str = "",
    launcher=None,
) -> torch.Tensor:
    """Launch on planned arguments (no checks); the recipe's ``launch`` signature. ``launcher``: None for a plain
    call, or the installed package's (``run``)."""
    # `workspace` through its own storage object: see kraken._blocks.helion.own_storage.
    args = (x, bias, own_storage(peers[rank]), peers, out, signal_pad_ptrs, num_blocks, shard, chunk, rank, len(peers),
            group_name)
    run(compiled(block_size, num_warps), args, launcher, region_args)
    return out


def region_args(args: tuple) -> tuple:
    """``launch``'s arguments as the kernel takes them (``kraken._blocks.helion.run``): ``x`` and ``out`` flat, the
    workspaces as their two regions [2, numel] (staged input, reduced shard), and the peers' second regions."""
    x, bias, workspace, peers, out, *rest = args
    regions = (2, x.numel())
    return (x.view(-1), bias, workspace.view(regions), views(peers, regions), views(peers, regions, 1), out.view(-1),
            *rest)


def symmetric_peers(numel: int, dtype: torch.dtype, device: torch.device, group) -> tuple:
    """A symmetric buffer of ``numel`` elements on every rank of ``group`` (a collective: every rank calls it):
    (every rank's buffer as this rank sees it, the signal pads' pointer array, this rank)."""
    buf = symm_mem.empty(numel, dtype=dtype, device=device)
    handle = symm_mem.rendezvous(buf, group if isinstance(group, str) else group.group_name)
    peers = tuple(buf if r == handle.rank else handle.get_buffer(r, (numel,), dtype)
                  for r in range(handle.world_size))
    return peers, handle.signal_pad_ptrs_dev, handle.rank


def two_shot_all_reduce_bias(
    x: torch.Tensor, bias: torch.Tensor, group: dist.ProcessGroup | str | None = None, **config
) -> torch.Tensor:
    """``sum over ranks of x`` + ``bias``, sharded reduction; a new tensor of ``x``'s shape and dtype.

    The twin spelled out: a symmetric workspace of two regions on every rank (``symm_mem.empty``, ``rendezvous``),
    the plan, one launch. It allocates and rendezvouses on every call and checks nothing."""
    group = dist.group.WORLD if group is None else group
    name = group if isinstance(group, str) else group.group_name
    hidden = x.shape[-1]
    x2d = x.view(-1, hidden)
    peers, signal_pad_ptrs, rank = symmetric_peers(max(WORKSPACE_COPIES * x.numel(), 1), x.dtype, x.device, name)
    out = torch.empty_like(x2d)
    cfg = plan(x2d.shape[0], hidden, len(peers), config)
    launch(x2d, bias, peers, out, signal_pad_ptrs, rank, **cfg, group_name=name)
    return out.view(x.shape)


def main(tokens: int = 256, hidden: int = 5120, iters: int = 100) -> None:
    """Check against NCCL's all-reduce plus the bias and time the twin (``torchrun``, or alone as a group of one)."""
    if "RANK" not in os.environ:
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT="29501")
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", device_id=device)
    torch.manual_seed(1234)  # the bias: the same on every rank
    bias = torch.randn(hidden, dtype=torch.bfloat16, device=device)
    torch.manual_seed(dist.get_rank())
    x = torch.randn(tokens, hidden, dtype=torch.bfloat16, device=device)
    expected = x.float()
    dist.all_reduce(expected)
    expected += bias.float()
    for _ in range(3):  # compile, then warm
        got = two_shot_all_reduce_bias(x, bias)
    torch.testing.assert_close(got.float(), expected, rtol=2e-2, atol=2e-2 * dist.get_world_size())

    # The plain call's buffers, plan and arguments, prepared once: the loop times the launches alone.
    name = dist.group.WORLD.group_name
    peers, signal_pad_ptrs, rank = symmetric_peers(max(WORKSPACE_COPIES * x.numel(), 1), x.dtype, device, name)
    out, cfg = torch.empty_like(x), plan(tokens, hidden, len(peers), {})
    for _ in range(3):  # warm up
        launch(x, bias, peers, out, signal_pad_ptrs, rank, **cfg, group_name=name)
    dist.barrier()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(iters):
        launch(x, bias, peers, out, signal_pad_ptrs, rank, **cfg, group_name=name)
    torch.cuda.synchronize()
    us = (time.perf_counter() - start) / iters * 1e6
    torch.testing.assert_close(out.float(), expected, rtol=2e-2, atol=2e-2 * dist.get_world_size())
    if rank == 0:
        print(f"helion two_shot_all_reduce_bias: {tokens}x{hidden} bf16 x {dist.get_world_size()} ranks: matches "
              f"NCCL + bias, {us:.1f} us per call (eager launches; {cfg})")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
