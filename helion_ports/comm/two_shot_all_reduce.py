"""Helion twin of ``kraken/comm/two_shot_all_reduce.py``: in place, the same algorithm, plan and arguments.

The structure mirrors the Triton recipe one to one:

* ``hl.grid(num_blocks)`` is the persistent grid; the grid index is the barrier's block id, identical on every
  rank (``pid_type="flat"``: exactly ``num_blocks`` programs);
* the barriers are the kraken PTX, pasted in with ``hl.inline_triton`` (``kraken._ptx_utils.inline_source``);
* the peers arrive as one tuple, read and written (``hl.store`` into ``peers[r]``) under
  ``hl.static_range(world_size)``.

An ordinary input is staged by a copy kernel before the sum (``kraken._blocks.helion.stage``) and the sum copied
back into it by another (``copy_into``): each copy finishes before the next kernel starts, like any input written
earlier on the stream. Past 2**31 elements the twin refuses (the recipe takes them). ``helion_ports.two_shot_all_reduce``
is the installed twin (checks agreed across ranks, prepared calls, replayed launches). Set
``HELION_PRINT_OUTPUT_CODE=1`` to see the generated Triton.

    torchrun --nproc-per-node 2 helion_ports/comm/two_shot_all_reduce.py
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

from kraken._blocks.helion import copy_into, flat_kernel, run, stage, views
from kraken._ptx_utils import barrier_blocks
from kraken._ptx_utils.inline_source import SYMM_MEM_SYNC

# The recipe's tuned defaults and limits (kraken/comm/two_shot_all_reduce.py), kept equal by a test.
DEFAULT_CONFIG = {"block_size": 4096, "num_warps": 16, "max_blocks": 132}
MAX_VALUES_PER_THREAD = 32
SHARD_ALIGN = 64

# "Peers' inputs are ready" (acquire), then "my pushes are visible / yours are" (release + acquire).
SYNC_START = SYMM_MEM_SYNC[(False, True)]
SYNC_END = SYMM_MEM_SYNC[(True, True)]


def two_shot_all_reduce_body(
    local: torch.Tensor,
    peers: tuple[torch.Tensor, ...],
    signal_pad_ptrs: int,
    num_blocks: int,
    shard: int,
    chunk: int,
    rank: int,
    world_size: hl.constexpr,
    group_name: hl.ProcessGroupName,
) -> None:
    # The size comes from the top-level ``local`` (this rank's buffer, also peers[rank]): Helion 1.5.0
    # does not re-specialize on the sizes of tensors that are only inside a tuple, so a kernel first
    # compiled for numel=1 was reused for numel=7 (see the README's Helion notes).
    numel = local.size(0)
    for block in hl.grid(num_blocks):
        barrier = {"signal_pad_ptrs": signal_pad_ptrs, "block_id": block, "rank": rank, "world_size": world_size}
        hl.inline_triton(SYNC_START, args=barrier, output_like=None)
        start = rank * shard + block * chunk
        # The range is clipped here, as in the recipe, rather than masked per element: with one bound,
        # ptxas issues the peers' loads as the recipe's do (see the one-shot twin).
        for tile in hl.tile(start, min(start + chunk, min(rank * shard + shard, numel))):
            acc = hl.zeros([tile], dtype=torch.float32)
            for r in hl.static_range(world_size):
                acc = acc + hl.load(peers[r], [tile]).to(torch.float32)
            result = acc.to(local.dtype)
            for r in hl.static_range(world_size):
                hl.store(peers[r], [tile], result)
        hl.inline_triton(SYNC_END, args=barrier, output_like=None)


@functools.cache
def compiled(block_size: int, num_warps: int) -> helion.Kernel:
    """One Helion kernel per launch configuration, each with one explicit config (``flat_kernel``,
    ``pid_type="flat"``: the recipe's grid, one program per block)."""
    return flat_kernel(two_shot_all_reduce_body, (block_size,), num_warps)


def plan(numel: int, world_size: int, config: dict, pad_bytes: int | None = None) -> dict:
    """The recipe's plan: shards of ``SHARD_ALIGN``-aligned length, one per rank; a persistent grid of at most one
    block per ``block_size`` elements of a shard, ``max_blocks``, and the block ids the signal pad holds."""
    unknown = set(config) - set(DEFAULT_CONFIG)
    if unknown:
        raise TypeError(f"two_shot_all_reduce: unknown config keys {sorted(unknown)}; known: {sorted(DEFAULT_CONFIG)}")
    cfg = {**DEFAULT_CONFIG, **config}
    block_size = min(cfg["block_size"], MAX_VALUES_PER_THREAD * 32 * cfg["num_warps"] // world_size)
    pad_bytes = symm_mem.get_signal_pad_size() if pad_bytes is None else pad_bytes
    shard = -(-(-(-numel // world_size)) // SHARD_ALIGN) * SHARD_ALIGN  # (ceiling divisions)
    num_blocks = max(1, min(-(-shard // block_size), cfg["max_blocks"], barrier_blocks(world_size, pad_bytes)))
    chunk = -(-(-(-shard // num_blocks)) // SHARD_ALIGN) * SHARD_ALIGN
    return {
        "block_size": block_size, "num_warps": cfg["num_warps"], "num_blocks": num_blocks,
        "shard": shard, "chunk": chunk, "wide": world_size * shard > 2**31 - 1,
    }


def launch(
    peers: tuple[torch.Tensor, ...],
    signal_pad_ptrs: int,
    rank: int,
    block_size: int,
    num_warps: int,
    num_blocks: int,
    shard: int,
    chunk: int,
    wide: bool = False,
    group_name: str = "",
    launcher=None,
    x: torch.Tensor | None = None,
) -> torch.Tensor:
    """Launch on planned arguments (no checks); the recipe's ``launch`` signature. An ordinary ``x`` is staged into
    ``peers[rank]`` first and given the sum after. ``launcher``: None for a plain call, or the installed package's
    (``run``). ``wide`` (past 2**31 elements) is refused on every rank before any launch: the shard's start,
    ``rank * shard``, is a product of scalars that Triton types 32-bit from their values, whatever index width
    Helion picks for the tensors."""
    if wide:
        raise ValueError(f"helion two_shot_all_reduce: {len(peers)} shards of {shard} elements pass 2**31 - 1; the "
                         "twin addresses 32 bits (kraken.comm.two_shot_all_reduce takes such tensors)")
    if x is not None:
        stage(peers, rank, x, group_name, launcher)
    flat_peers = views(peers, -1)
    args = (
        flat_peers[rank], flat_peers, signal_pad_ptrs, num_blocks, shard, chunk, rank, len(peers), group_name,
    )
    run(compiled(block_size, num_warps), args, launcher)
    if x is None:
        return peers[rank]
    copy_into(x, peers[rank][:x.numel()], group_name, launcher)
    return x


def symmetric_peers(numel: int, dtype: torch.dtype, device: torch.device, group) -> tuple:
    """A symmetric buffer of ``numel`` elements on every rank of ``group`` (a collective: every rank calls it):
    (every rank's buffer as this rank sees it, the signal pads' pointer array, this rank)."""
    buf = symm_mem.empty(numel, dtype=dtype, device=device)
    handle = symm_mem.rendezvous(buf, group if isinstance(group, str) else group.group_name)
    peers = tuple(buf if r == handle.rank else handle.get_buffer(r, (numel,), dtype)
                  for r in range(handle.world_size))
    return peers, handle.signal_pad_ptrs_dev, handle.rank


def two_shot_all_reduce(
    tensor: torch.Tensor, group: dist.ProcessGroup | str | None = None, **config
) -> torch.Tensor:
    """Sum ``tensor`` over ``group`` (the default group when None) *in place* and return it.

    The twin spelled out: a symmetric buffer on every rank (``symm_mem.empty``, ``rendezvous``), the plan, a
    staging copy, the sum and the copy back. It allocates and rendezvouses on every call and checks nothing."""
    group = dist.group.WORLD if group is None else group
    name = group if isinstance(group, str) else group.group_name
    peers, signal_pad_ptrs, rank = symmetric_peers(tensor.numel(), tensor.dtype, tensor.device, name)
    cfg = plan(tensor.numel(), len(peers), config)
    return launch(peers, signal_pad_ptrs, rank, **cfg, group_name=name, x=tensor)


def main(numel: int = 1 << 20, iters: int = 100) -> None:
    """Check against NCCL's all-reduce and time the twin (``torchrun``, or alone as a group of one)."""
    if "RANK" not in os.environ:
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT="29501")
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", device_id=device)
    torch.manual_seed(dist.get_rank())
    x = torch.randn(numel, dtype=torch.bfloat16, device="cuda")
    expected = x.float()
    dist.all_reduce(expected)
    for _ in range(3):  # compile, then warm
        got = two_shot_all_reduce(x.clone())
    torch.testing.assert_close(got.float(), expected, rtol=2e-2, atol=2e-2 * dist.get_world_size())

    # The plain call's buffers, plan and arguments, prepared once: the loop times the launches alone.
    name = dist.group.WORLD.group_name
    peers, signal_pad_ptrs, rank = symmetric_peers(numel, x.dtype, x.device, name)
    cfg = plan(numel, len(peers), {})
    summed = x.clone()
    launch(peers, signal_pad_ptrs, rank, **cfg, group_name=name, x=summed)  # in place: summed now holds the sum
    torch.testing.assert_close(summed.float(), expected, rtol=2e-2, atol=2e-2 * dist.get_world_size())
    for _ in range(3):  # warm up (the sums grow: timing only from here, no check after the loop)
        launch(peers, signal_pad_ptrs, rank, **cfg, group_name=name, x=summed)
    dist.barrier()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(iters):
        launch(peers, signal_pad_ptrs, rank, **cfg, group_name=name, x=summed)
    torch.cuda.synchronize()
    us = (time.perf_counter() - start) / iters * 1e6
    if rank == 0:
        print(f"helion two_shot_all_reduce: {numel} bf16 x {len(peers)} ranks: matches NCCL, "
              f"{us:.1f} us per call (eager launches, in place; {cfg})")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
