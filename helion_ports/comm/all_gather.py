"""Helion twin of ``kraken/comm/all_gather.py``: the same algorithm, plan and arguments.

The structure mirrors the Triton recipe one to one:

* ``hl.grid(num_blocks)`` is the persistent grid; the grid index is the barrier's block id, identical on every
  rank (``pid_type="flat"``: exactly ``num_blocks`` programs);
* the barriers are the kraken PTX, pasted in with ``hl.inline_triton`` (``kraken._ptx_utils.inline_source``);
* the shards arrive as one tuple, rotated so that it starts with rank ``rank + 1`` and ends with this rank's own,
  and each step loads the tile from every shard (``hl.static_range(world_size)``) before it stores any.

An ordinary input is staged by a copy kernel before the gather (``kraken._blocks.helion.stage``): that copy
finished before the gather's first barrier, like any input written earlier on the stream.
``helion_ports.all_gather`` is the installed twin (checks agreed across ranks, prepared calls, replayed launches).
Set ``HELION_PRINT_OUTPUT_CODE=1`` to see the generated Triton.

    torchrun --nproc-per-node 2 helion_ports/comm/all_gather.py
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

from kraken._blocks.helion import flat_kernel, flat_view, run, stage, views
from kraken._ptx_utils import barrier_blocks
from kraken._ptx_utils.inline_source import SYMM_MEM_SYNC

# The recipe's tuned defaults and limits (kraken/comm/all_gather.py), kept equal by a test.
DEFAULT_CONFIG = {"block_size": 8192, "num_warps": 16, "max_blocks": 132}
MAX_BYTES_PER_THREAD = 64
CHUNK_ALIGN = 64

# The barriers: "peers' shards are ready" (acquire) and "done reading peers" (release).
SYNC_START = SYMM_MEM_SYNC[(False, True)]
SYNC_END = SYMM_MEM_SYNC[(True, False)]


def all_gather_body(
    out: torch.Tensor,
    local: torch.Tensor,
    sources: tuple[torch.Tensor, ...],
    signal_pad_ptrs: int,
    num_blocks: int,
    chunk: int,
    rank: int,
    world_size: hl.constexpr,
    group_name: hl.ProcessGroupName,
) -> torch.Tensor:
    # The size comes from the top-level ``local`` (this rank's shard, also the last source): Helion 1.5.0
    # does not re-specialise on the sizes of tensors that sit only inside a tuple (README, Helion notes).
    shard = local.size(0)
    for block in hl.grid(num_blocks):
        barrier = {"signal_pad_ptrs": signal_pad_ptrs, "block_id": block, "rank": rank, "world_size": world_size}
        hl.inline_triton(SYNC_START, args=barrier, output_like=None)
        start = block * chunk
        for tile in hl.tile(start, min(start + chunk, shard)):
            values = [hl.load(sources[i], [tile]) for i in hl.static_range(world_size)]
            for i in hl.static_range(world_size):
                hl.store(out, [tile.index + ((rank + 1 + i) % world_size) * shard], values[i])
        hl.inline_triton(SYNC_END, args=barrier, output_like=None)
    return out


@functools.cache
def compiled(block_size: int, num_warps: int) -> helion.Kernel:
    """One Helion kernel per launch configuration, each with an explicit config (``pid_type="flat"``)."""
    return flat_kernel(all_gather_body, (block_size,), num_warps)


def plan(shard: int, world_size: int, config: dict, itemsize: int = 2, pad_bytes: int | None = None) -> dict:
    """The recipe's plan for a ``shard``-element input of ``itemsize`` bytes: a block of at most
    ``MAX_BYTES_PER_THREAD`` per thread over all ranks, at most one block per ``block_size`` elements,
    ``max_blocks``, and the block ids the signal pad holds, each block an aligned chunk of the shard."""
    unknown = set(config) - set(DEFAULT_CONFIG)
    if unknown:
        raise TypeError(f"all_gather: unknown config keys {sorted(unknown)}; known: {sorted(DEFAULT_CONFIG)}")
    cfg = {**DEFAULT_CONFIG, **config}
    per_rank_bytes = 1 << ((MAX_BYTES_PER_THREAD // world_size).bit_length() - 1)  # a power of two
    per_peer = max(1, per_rank_bytes // itemsize)  # values per thread and rank
    block_size = min(cfg["block_size"], per_peer * 32 * cfg["num_warps"])
    pad_bytes = symm_mem.get_signal_pad_size() if pad_bytes is None else pad_bytes
    num_blocks = max(1, min(-(-shard // block_size), cfg["max_blocks"], barrier_blocks(world_size, pad_bytes)))
    chunk = -(-(-(-shard // num_blocks)) // CHUNK_ALIGN) * CHUNK_ALIGN  # (ceiling divisions)
    return {"block_size": block_size, "num_warps": cfg["num_warps"], "num_blocks": num_blocks, "chunk": chunk,
            "wide": world_size * shard > 2**31 - 1}


def launch(
    peers: tuple[torch.Tensor, ...],
    out: torch.Tensor,
    signal_pad_ptrs: int,
    rank: int,
    block_size: int,
    num_warps: int,
    num_blocks: int,
    chunk: int,
    wide: bool = False,  # unused: Helion picks 64-bit indices itself from the tensors' sizes
    group_name: str = "",
    launcher=None,
    x: torch.Tensor | None = None,
) -> torch.Tensor:
    """Launch on planned arguments (no checks); the recipe's ``launch`` signature. An ordinary ``x`` is staged
    into ``peers[rank]`` first. ``launcher``: None for a plain call, or the installed package's (``run``)."""
    if x is not None:
        stage(peers, rank, x, group_name, launcher)
    flat = views(peers, -1)
    sources = flat[rank + 1:] + flat[:rank + 1]
    args = (
        flat_view(out), flat[rank], sources, signal_pad_ptrs, num_blocks, chunk, rank, len(peers), group_name,
    )
    run(compiled(block_size, num_warps), args, launcher)
    return out


def symmetric_peers(numel: int, dtype: torch.dtype, device: torch.device, group) -> tuple:
    """A symmetric buffer of ``numel`` elements on every rank of ``group`` (a collective: every rank calls it):
    (every rank's buffer as this rank sees it, the signal pads' pointer array, this rank)."""
    buf = symm_mem.empty(numel, dtype=dtype, device=device)
    handle = symm_mem.rendezvous(buf, group if isinstance(group, str) else group.group_name)
    peers = tuple(buf if r == handle.rank else handle.get_buffer(r, (numel,), dtype)
                  for r in range(handle.world_size))
    return peers, handle.signal_pad_ptrs_dev, handle.rank


def all_gather(tensor: torch.Tensor, group: dist.ProcessGroup | str | None = None, **config) -> torch.Tensor:
    """Every rank's ``tensor`` stacked along the first dimension in rank order, as a new ``[world_size * M, ...]``
    tensor (``group``: the default group when None).

    The twin spelled out: a symmetric buffer on every rank (``symm_mem.empty``, ``rendezvous``), the plan, a
    staging copy and the gather. It allocates and rendezvouses on every call and checks nothing."""
    group = dist.group.WORLD if group is None else group
    name = group if isinstance(group, str) else group.group_name
    peers, signal_pad_ptrs, rank = symmetric_peers(tensor.numel(), tensor.dtype, tensor.device, name)
    out = tensor.new_empty((len(peers) * tensor.shape[0], *tensor.shape[1:]))
    cfg = plan(tensor.numel(), len(peers), config, tensor.element_size())
    return launch(peers, out, signal_pad_ptrs, rank, **cfg, group_name=name, x=tensor)


def main(rows: int = 1 << 20, iters: int = 100) -> None:
    """Check against NCCL's all-gather and time the twin (``torchrun``, or alone as a group of one)."""
    if "RANK" not in os.environ:
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT="29501")
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", device_id=device)
    world_size = dist.get_world_size()
    torch.manual_seed(dist.get_rank())
    x = torch.randn(rows, dtype=torch.bfloat16, device="cuda")
    expected = torch.empty(world_size * rows, dtype=x.dtype, device="cuda")
    dist.all_gather_into_tensor(expected, x)
    for _ in range(3):  # compile, then warm
        got = all_gather(x)
    assert torch.equal(got, expected), "helion all_gather differs from NCCL's"

    # The plain call's buffers, plan and arguments, prepared once: the loop times the launches alone.
    name = dist.group.WORLD.group_name
    peers, signal_pad_ptrs, rank = symmetric_peers(x.numel(), x.dtype, x.device, name)
    out, cfg = torch.empty_like(expected), plan(x.numel(), world_size, {}, x.element_size())
    for _ in range(3):  # warm up
        launch(peers, out, signal_pad_ptrs, rank, **cfg, group_name=name, x=x)
    dist.barrier()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(iters):
        launch(peers, out, signal_pad_ptrs, rank, **cfg, group_name=name, x=x)
    torch.cuda.synchronize()
    us = (time.perf_counter() - start) / iters * 1e6
    assert torch.equal(out, expected), "helion all_gather (buffers prepared once) differs from NCCL's"
    if rank == 0:
        print(f"helion all_gather: {rows} bf16 x {world_size} ranks: matches NCCL, {us:.1f} us per call "
              f"(eager launches; {cfg})")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
