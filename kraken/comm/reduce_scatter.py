"""Reduce-scatter: rank ``r`` gets shard ``r`` of the sum over ranks, in a new tensor.

The input is ``[M, ...]``, ``M`` divisible by the world size; shard ``r`` is rows
``r * M / ws .. (r + 1) * M / ws``, i.e. the contiguous elements
``r * shard .. (r + 1) * shard``. Each rank reads only its own shard of every
peer's buffer: ``(world_size - 1) / world_size`` of the data crosses NVLink once,
the least any reduce-scatter can move.

A persistent grid of ``num_blocks`` blocks splits the shard into contiguous
chunks. Block ``b`` of every rank handles chunk ``b`` and uses barrier slot ``b``:

1. barrier (acquire): block ``b`` of every peer has started, so every peer's
   input is complete;
2. sum chunk ``b`` of this rank's shard over every peer's buffer in rank order
   (0, 1, ..., ws - 1), accumulating in fp32 and rounding once, so the result is
   bitwise what an fp32 rank-order sum gives; each thread issues its loads from
   every peer before its first add (one NVLink round trip per step);
3. barrier (release): "I am done reading your buffer", so when the kernel
   returns every rank may overwrite its input.

An ordinary tensor (not in symmetric memory) is staged (``STAGED``): block ``b``
first copies chunk ``b`` of every shard (what each owner's block ``b`` reads)
into this rank's symmetric buffer, and its first barrier releases those writes;
the peers are those buffers. A symmetric tensor is read in place.

Both barriers compare-and-swap: epoch barriers (a posted store, no
compare-and-swap round trip) on a pad of their own gained nothing where the
barriers dominate and lost from 128K elements on, here and in the all-gather.

Layout: ``[M, ...]``, contiguous, bf16/fp16/fp32, read as a flat array. Past
2**31 elements the kernel computes its offsets in 64 bits (``WIDE``).

This file is the recipe: the kernel, ``plan`` (pure), ``launch`` (the seam the
installed package's fast path calls with its own ``launcher``) and a plain host
function. ``kraken.reduce_scatter`` is the same kernel behind the product layer
(``kraken.runtime.collectives``: checks agreed across ranks, a prepared call per
signature, a shared workspace, replayed launches).

    torchrun --nproc-per-node 2 kraken/comm/reduce_scatter.py
"""

from __future__ import annotations

import os
import time

import torch
import torch.distributed as dist
import torch.distributed._symmetric_memory as symm_mem
import triton
import triton.language as tl

from kraken._blocks import copy_slice
from kraken._ptx_utils import barrier_blocks, symm_mem_sync

# Swept on 2x H200 (block/warps 4096/8, 8192/16, 16384/32 x 132, 264, 528 blocks): within 0.3% of the best
# at 4M and 32M bf16 elements.
DEFAULT_CONFIG = {"block_size": 8192, "num_warps": 16, "max_blocks": 132}
# Bytes a thread loads per step, over all peers: four 16-byte vectors. With more (fp32 at 2 ranks, or
# bf16 at 4, at 8192-element blocks), ptxas starts adding before it has issued every load, and a step
# pays two NVLink round trips; so the block shrinks as the world and the element grow.
MAX_BYTES_PER_THREAD = 64
CHUNK_ALIGN = 64  # elements: every block's chunk starts 16-byte aligned within the shard
MAX_INDEX = 2**31 - 1  # the largest offset 32-bit arithmetic reaches; past it the kernel runs WIDE


@triton.jit
def reduce_scatter_kernel(
    peers,  # tuple of world_size pointers, peers[r] = rank r's whole input
    out_ptr,  # this rank's shard of the sum, shard elements
    x_ptr,  # STAGED: the ordinary input, copied into workspace_ptr first
    workspace_ptr,  # STAGED: this rank's workspace (= peers[rank])
    signal_pad_ptrs,
    shard,  # elements per rank
    chunk,  # elements per block, a multiple of CHUNK_ALIGN
    rank,
    world_size: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    STAGED: tl.constexpr,
    WIDE: tl.constexpr = False,  # past 2**31 elements: 64-bit offsets (32-bit ones are cheaper where they reach)
):
    block_id = tl.program_id(0)
    block = block_id  # the barrier slot is block_id; offsets are made from block and shard
    if WIDE:
        block = block.to(tl.int64)
        shard = shard.to(tl.int64)
    start = block * chunk
    end = tl.minimum(start + chunk, shard)
    if STAGED:  # chunk b of every shard: what each owner's block b reads
        for owner in tl.static_range(world_size):
            copy_slice(x_ptr + owner * shard, workspace_ptr + owner * shard, start, end, BLOCK_SIZE)
    # Acquire: every peer's input is complete (staged: release mine too).
    symm_mem_sync(signal_pad_ptrs, block_id, rank, world_size, hasPreviousMemAccess=STAGED, hasSubsequentMemAccess=True)
    shard_start = rank * shard
    for offset in tl.range(start, end, BLOCK_SIZE):
        offsets = offset + tl.arange(0, BLOCK_SIZE)
        mask = offsets < end
        # Rank order from rank 0's value (not from 0.0: ptxas then started adding before its last load
        # at 4 ranks in fp32): the same sum, bit for bit, on every rank.
        acc = tl.load(peers[0] + shard_start + offsets, mask=mask).to(tl.float32)
        for r in tl.static_range(1, world_size):
            acc += tl.load(peers[r] + shard_start + offsets, mask=mask).to(tl.float32)
        tl.store(out_ptr + offsets, acc.to(out_ptr.dtype.element_ty), mask=mask)
    symm_mem_sync(signal_pad_ptrs, block_id, rank, world_size, hasPreviousMemAccess=True, hasSubsequentMemAccess=False)


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def plan(numel: int, world_size: int, config: dict, itemsize: int = 2, pad_bytes: int | None = None) -> dict:
    """The launch configuration for ``numel`` input elements of ``itemsize`` bytes: ``DEFAULT_CONFIG`` overridden
    by ``config``, then ``shard_plan`` over this rank's shard. Shared with the Helion twin."""
    unknown = set(config) - set(DEFAULT_CONFIG)
    if unknown:
        raise TypeError(f"reduce_scatter: unknown config keys {sorted(unknown)}; known: {sorted(DEFAULT_CONFIG)}")
    return shard_plan(numel // world_size, world_size, {**DEFAULT_CONFIG, **config}, itemsize, pad_bytes)


def shard_plan(shard: int, world_size: int, cfg: dict, itemsize: int, pad_bytes: int | None = None) -> dict:
    """The persistent grid over a ``shard``-element shard read from every rank, for a resolved ``cfg``
    (block_size, num_warps, max_blocks): a block of at most ``MAX_BYTES_PER_THREAD`` per thread over all ranks, at
    most one block per ``block_size`` elements, ``max_blocks``, and the block ids the signal pad holds
    (``pad_bytes``; by default torch's pad size), each block an aligned chunk of the shard."""
    per_rank_bytes = 1 << ((MAX_BYTES_PER_THREAD // world_size).bit_length() - 1)  # a power of two
    per_peer = max(1, per_rank_bytes // itemsize)  # values per thread and rank
    block_size = min(cfg["block_size"], per_peer * 32 * cfg["num_warps"])
    pad_bytes = symm_mem.get_signal_pad_size() if pad_bytes is None else pad_bytes
    num_blocks = max(1, min(cdiv(shard, block_size), cfg["max_blocks"], barrier_blocks(world_size, pad_bytes)))
    chunk = cdiv(cdiv(shard, num_blocks), CHUNK_ALIGN) * CHUNK_ALIGN
    return {"block_size": block_size, "num_warps": cfg["num_warps"], "num_blocks": num_blocks, "chunk": chunk,
            "wide": world_size * shard > MAX_INDEX}


def triton_launch(kernel, grid: tuple[int, ...], *args, **meta):
    """``launch``'s default launcher: Triton's own ``kernel[grid](...)``."""
    return kernel[grid](*args, **meta)


def launch(
    peers: tuple[torch.Tensor, ...],
    out: torch.Tensor,
    signal_pad_ptrs: int,
    rank: int,
    block_size: int,
    num_warps: int,
    num_blocks: int,
    chunk: int,
    wide: bool = False,
    group_name: str = "",
    launcher=triton_launch,
    x: torch.Tensor | None = None,
) -> torch.Tensor:
    """Launch on planned arguments (no checks); the same signature as the Helion twin's ``launch``.

    ``out`` holds this rank's shard (``peers[r].numel() // world_size`` elements). ``wide``: more than
    2**31 - 1 elements to address (64-bit offsets). ``group_name`` is unused here; Helion takes it as its
    ``hl.ProcessGroupName``. ``launcher(kernel, grid, *args, **meta)``: Triton's own launch, or the one the
    installed package's prepared call passes (its host fast path). ``x``: an ordinary input to stage into
    ``peers[rank]`` first; None when the peers are the input.
    """
    local = peers[rank]
    launcher(
        reduce_scatter_kernel, (num_blocks,), peers, out, local if x is None else x, local, signal_pad_ptrs,
        out.numel(), chunk, rank, len(peers), BLOCK_SIZE=block_size, STAGED=x is not None, WIDE=wide,
        num_warps=num_warps,
    )
    return out


def symmetric_peers(numel: int, dtype: torch.dtype, device: torch.device, group) -> tuple:
    """A symmetric buffer of ``numel`` elements on every rank of ``group`` (a collective: every rank calls it):
    (every rank's buffer as this rank sees it, the signal pads' pointer array, this rank)."""
    buf = symm_mem.empty(numel, dtype=dtype, device=device)
    handle = symm_mem.rendezvous(buf, group if isinstance(group, str) else group.group_name)
    peers = tuple(buf if r == handle.rank else handle.get_buffer(r, (numel,), dtype)
                  for r in range(handle.world_size))
    return peers, handle.signal_pad_ptrs_dev, handle.rank


def reduce_scatter(tensor: torch.Tensor, group: dist.ProcessGroup | str | None = None, **config) -> torch.Tensor:
    """This rank's ``[M / world_size, ...]`` rows of the sum of ``tensor`` over ``group`` (the default group when
    None), as a new tensor; ``tensor`` is left unchanged.

    The recipe spelled out: a symmetric buffer on every rank, the plan, one launch that stages ``tensor`` into the
    buffer and sums this rank's shard over the peers' buffers. It allocates and rendezvouses on every call and
    checks nothing (``M`` must divide by the world size); ``kraken.reduce_scatter`` is the installed one (checks
    agreed across ranks, prepared calls, a symmetric tensor read in place)."""
    group = dist.group.WORLD if group is None else group
    peers, signal_pad_ptrs, rank = symmetric_peers(tensor.numel(), tensor.dtype, tensor.device, group)
    out = tensor.new_empty((tensor.shape[0] // len(peers), *tensor.shape[1:]))
    cfg = plan(tensor.numel(), len(peers), config, tensor.element_size())
    return launch(peers, out, signal_pad_ptrs, rank, **cfg, x=tensor)


def main(rows: int = 1 << 20, iters: int = 100) -> None:
    """Check against NCCL's reduce-scatter and time the kernel on a symmetric input (``torchrun``, or alone)."""
    if "RANK" not in os.environ:  # run alone: a group of one
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT="29501")
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", device_id=device)
    rank, world_size = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(rank)
    numel = rows * world_size
    x = torch.randn(numel, dtype=torch.bfloat16, device="cuda")
    expected = torch.empty(rows, dtype=torch.float32, device="cuda")
    dist.reduce_scatter_tensor(expected, x.float())
    got = reduce_scatter(x)
    torch.testing.assert_close(got.float(), expected, rtol=2e-2, atol=2e-2 * world_size)

    peers, signal_pad_ptrs, rank = symmetric_peers(numel, x.dtype, x.device, dist.group.WORLD)
    peers[rank].copy_(x)
    out, cfg = torch.empty(rows, dtype=x.dtype, device=x.device), plan(numel, world_size, {}, x.element_size())
    for _ in range(10):  # warm up (compile)
        launch(peers, out, signal_pad_ptrs, rank, **cfg)
    dist.barrier()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(iters):
        launch(peers, out, signal_pad_ptrs, rank, **cfg)
    torch.cuda.synchronize()
    us = (time.perf_counter() - start) / iters * 1e6
    torch.testing.assert_close(out.float(), expected, rtol=2e-2, atol=2e-2 * world_size)
    if rank == 0:
        print(f"reduce_scatter: {numel} bf16 x {world_size} ranks: matches NCCL, {us:.1f} us per call "
              f"(eager launches; {cfg})")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
