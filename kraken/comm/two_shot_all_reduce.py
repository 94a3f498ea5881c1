"""Two-shot all-reduce, in place: reduce-scatter then all-gather, fused in one kernel.

Rank ``r`` owns shard ``r`` of the tensor (``shard`` elements, 64-aligned).

1. barrier (acquire): every peer's input is complete;
2. reduce: sum shard ``r`` over every peer's buffer (rank order, fp32
   accumulation) and *push* the result into shard ``r`` of every rank's buffer,
   its own included. Only rank ``r`` ever reads or writes shard ``r``, so the
   pushes cannot race with another rank's reads;
3. barrier (release + acquire): "my pushes are visible to you" and "yours to
   me", so when the kernel returns every rank's buffer holds the full sum.

Each rank moves ``2 (world_size - 1) / world_size * N`` elements over NVLink
(half in, half out) against one-shot's ``(world_size - 1) * N``, for the same two
barrier rounds: the bandwidth winner for large messages.

Block ``b`` of every rank covers the same slice of its own shard and uses
barrier slot ``b``; a block's final barrier therefore waits for exactly the
peers' blocks that pushed into the slices it covers.

An ordinary tensor (not in symmetric memory) is staged (``STAGED``): block ``b``
first copies slice ``b`` of every shard into this rank's symmetric buffer (what
the owners' block ``b`` reads), the kernel reduces in place in that buffer, and
block ``b`` ends by copying slice ``b`` of every shard of the sum back into the
tensor. One region suffices, as in place: only the owner touches a shard between
the barriers, and the next call stages a slice only after its owner's pushes
into it have passed this call's final barrier.

Layout: any shape, contiguous, bf16/fp16/fp32, read as a flat array. Past 2**31
elements the kernel computes its offsets in 64 bits (``WIDE``).

This file is the recipe: the kernel, ``plan`` (pure), ``launch`` (the seam the
installed package's fast path calls with its own ``launcher``) and a plain host
function. ``kraken.two_shot_all_reduce`` is the same kernel behind the product
layer (``kraken.runtime.collectives``: checks agreed across ranks, a prepared
call per signature, a shared workspace, replayed launches).

    torchrun --nproc-per-node 2 kraken/comm/two_shot_all_reduce.py
"""

from __future__ import annotations

import os
import time

import torch
import torch.distributed as dist
import torch.distributed._symmetric_memory as symm_mem
import triton
import triton.language as tl

from kraken._blocks import block_range, copy_slice
from kraken._ptx_utils import barrier_blocks, symm_mem_sync

# Tuned on 2x H200 with benchmark/tune.py (within 3% of the best config at every size, 4K..4M bf16).
DEFAULT_CONFIG = {"block_size": 4096, "num_warps": 16, "max_blocks": 132}
# A thread holds one load per peer in flight; past ~32 values per thread the compiler spills (world size 8),
# so the block shrinks as the world grows.
MAX_VALUES_PER_THREAD = 32
SHARD_ALIGN = 64  # elements: keeps every shard and chunk start 16-byte aligned for vector access
MAX_INDEX = 2**31 - 1  # the largest offset 32-bit arithmetic reaches; past it the kernel runs WIDE


@triton.jit
def two_shot_all_reduce_kernel(
    peers,  # tuple of world_size pointers, peers[r] = rank r's buffer
    x_ptr,  # STAGED: the ordinary input, staged into workspace_ptr and given the sum at the end
    workspace_ptr,  # STAGED: this rank's workspace (= peers[rank])
    signal_pad_ptrs,
    numel,
    shard,  # elements per rank, a multiple of SHARD_ALIGN
    chunk,  # elements per block within a shard, a multiple of SHARD_ALIGN
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
    if STAGED:  # slice b of every shard: what each owner's block b reads
        for owner in tl.static_range(world_size):
            start, end = block_range(owner, block, shard, chunk, numel)
            copy_slice(x_ptr, workspace_ptr, start, end, BLOCK_SIZE)
    # Acquire: every peer's input is complete (staged: release mine too).
    symm_mem_sync(signal_pad_ptrs, block_id, rank, world_size, hasPreviousMemAccess=STAGED, hasSubsequentMemAccess=True)
    start, end = block_range(rank, block, shard, chunk, numel)
    for offset in tl.range(start, end, BLOCK_SIZE):
        offsets = offset + tl.arange(0, BLOCK_SIZE)
        mask = offsets < end
        acc = tl.zeros([BLOCK_SIZE], dtype=tl.float32)
        for r in tl.static_range(world_size):
            acc += tl.load(peers[r] + offsets, mask=mask).to(tl.float32)
        result = acc.to(peers[0].dtype.element_ty)
        for r in tl.static_range(world_size):
            tl.store(peers[r] + offsets, result, mask=mask)
    symm_mem_sync(signal_pad_ptrs, block_id, rank, world_size, hasPreviousMemAccess=True, hasSubsequentMemAccess=True)
    if STAGED:  # every owner's pushes into slice b of its shard are visible: the sum goes back to x
        for owner in tl.static_range(world_size):
            start, end = block_range(owner, block, shard, chunk, numel)
            copy_slice(workspace_ptr, x_ptr, start, end, BLOCK_SIZE)


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def plan(numel: int, world_size: int, config: dict, pad_bytes: int | None = None) -> dict:
    """The launch configuration: ``DEFAULT_CONFIG`` overridden by ``config``; shards of ``SHARD_ALIGN``-aligned
    length, one per rank; a persistent grid of at most one block per ``block_size`` elements of a shard,
    ``max_blocks``, and the block ids the signal pad holds (``pad_bytes``; by default torch's pad size), each block
    an aligned chunk of every shard. Shared with the Helion twin."""
    unknown = set(config) - set(DEFAULT_CONFIG)
    if unknown:
        raise TypeError(f"two_shot_all_reduce: unknown config keys {sorted(unknown)}; known: {sorted(DEFAULT_CONFIG)}")
    cfg = {**DEFAULT_CONFIG, **config}
    block_size = min(cfg["block_size"], MAX_VALUES_PER_THREAD * 32 * cfg["num_warps"] // world_size)
    pad_bytes = symm_mem.get_signal_pad_size() if pad_bytes is None else pad_bytes
    shard = cdiv(cdiv(numel, world_size), SHARD_ALIGN) * SHARD_ALIGN
    num_blocks = max(1, min(cdiv(shard, block_size), cfg["max_blocks"], barrier_blocks(world_size, pad_bytes)))
    chunk = cdiv(cdiv(shard, num_blocks), SHARD_ALIGN) * SHARD_ALIGN
    return {
        "block_size": block_size, "num_warps": cfg["num_warps"], "num_blocks": num_blocks,
        "shard": shard, "chunk": chunk, "wide": world_size * shard > MAX_INDEX,
    }


def triton_launch(kernel, grid: tuple[int, ...], *args, **meta):
    """``launch``'s default launcher: Triton's own ``kernel[grid](...)``."""
    return kernel[grid](*args, **meta)


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
    launcher=triton_launch,
    x: torch.Tensor | None = None,
) -> torch.Tensor:
    """Launch on planned arguments (no checks); the same signature as the Helion twin's ``launch``.

    ``wide``: more than 2**31 - 1 elements to address (64-bit offsets). ``group_name`` is unused here; Helion
    takes it as its ``hl.ProcessGroupName``. ``launcher(kernel, grid, *args, **meta)``: Triton's own launch, or
    the one the installed package's prepared call passes (its host fast path). ``x``: an ordinary input, staged
    into ``peers[rank]`` and given the sum; None when the peers are the input.
    Returns the summed tensor (``x``, or ``peers[rank]``).
    """
    local = peers[rank]
    launcher(
        two_shot_all_reduce_kernel, (num_blocks,),
        peers, local if x is None else x, local, signal_pad_ptrs, local.numel(), shard, chunk, rank, len(peers),
        BLOCK_SIZE=block_size, STAGED=x is not None, WIDE=wide, num_warps=num_warps,
    )
    return local if x is None else x


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

    The recipe spelled out: a symmetric buffer on every rank, the plan, one launch that stages ``tensor`` into the
    buffer, sums it there and copies the sum back. It allocates and rendezvouses on every call and checks nothing;
    ``kraken.two_shot_all_reduce`` is the installed one (checks agreed across ranks, prepared calls, a symmetric
    tensor reduced where it lies)."""
    group = dist.group.WORLD if group is None else group
    peers, signal_pad_ptrs, rank = symmetric_peers(tensor.numel(), tensor.dtype, tensor.device, group)
    return launch(peers, signal_pad_ptrs, rank, **plan(tensor.numel(), len(peers), config), x=tensor)


def main(numel: int = 1 << 20, iters: int = 100) -> None:
    """Check against NCCL's all-reduce and time the kernel on a symmetric input (``torchrun``, or alone)."""
    if "RANK" not in os.environ:  # run alone: a group of one
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT="29501")
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", device_id=device)
    rank = dist.get_rank()
    torch.manual_seed(rank)
    x = torch.randn(numel, dtype=torch.bfloat16, device="cuda")
    expected = x.float()
    dist.all_reduce(expected)
    got = two_shot_all_reduce(x.clone())
    torch.testing.assert_close(got.float(), expected, rtol=2e-2, atol=2e-2 * dist.get_world_size())

    peers, signal_pad_ptrs, rank = symmetric_peers(numel, x.dtype, x.device, dist.group.WORLD)
    cfg = plan(numel, len(peers), {})
    peers[rank].copy_(x)
    dist.barrier()
    launch(peers, signal_pad_ptrs, rank, **cfg)  # in place: the symmetric buffer now holds the sum
    torch.testing.assert_close(peers[rank].float(), expected, rtol=2e-2, atol=2e-2 * dist.get_world_size())
    for _ in range(10):  # warm up (the sums grow: timing only from here)
        peers[rank].copy_(x)
        launch(peers, signal_pad_ptrs, rank, **cfg)
    dist.barrier()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(iters):
        launch(peers, signal_pad_ptrs, rank, **cfg)
    torch.cuda.synchronize()
    us = (time.perf_counter() - start) / iters * 1e6
    if rank == 0:
        print(f"two_shot_all_reduce: {numel} bf16 x {len(peers)} ranks: matches NCCL, {us:.1f} us per call "
              f"(eager launches, in place; {cfg})")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
