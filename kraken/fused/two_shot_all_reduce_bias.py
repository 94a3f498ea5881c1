"""Two-shot all-reduce + bias: reduce-scatter, add bias, all-gather, in one launch.

    out = sum_r x_r + bias

Rank ``r`` owns shard ``r`` of the flattened message (``shard`` elements,
64-aligned) and is the only rank that reduces it: it reads that shard from every
peer, adds ``bias`` (column = offset % hidden) and *pushes* the result to every
rank. Each rank receives ``2 (world_size - 1) / world_size`` of the message
instead of one-shot's ``world_size - 1``, for the same two barrier rounds.

The output is an ordinary tensor peers cannot write to, so the workspace has
two regions: the staged input ``[0, numel)`` and the pushed result
``[numel, 2 numel)``; the kernel ends by copying the result region into
``out``. ``x`` is always copied into the workspace (see ``one_shot_all_reduce_bias``).

Block ``b`` of every rank covers slice ``b`` of every shard and barrier slot ``b``:

1. copy slice ``b`` of *every* shard of ``x`` into the workspace: exactly what
   block ``b`` of each shard's owner will read;
2. barrier (release + acquire): staged slices are visible both ways;
3. reduce slice ``b`` of my shard (rank order, fp32), add bias, push the result
   into every rank's result region (my own included);
4. barrier (release + acquire): "my pushes are visible to you", "yours to me";
5. copy slice ``b`` of every shard of my result region into ``out``.

Why two rounds suffice across calls: a peer reads my input region only before
its pushes, and writes my result region only after the next call's first
barrier, which I reach only after step 5 of this call.

Layout: ``x`` [..., hidden] (any leading shape flattened into tokens), contiguous, bf16/fp16/fp32; ``bias``
[hidden] of ``x``'s dtype; the workspace holds ``2 * tokens * hidden`` elements (``WORKSPACE_COPIES``).

This file is the recipe: the kernel, ``plan`` (pure), ``launch`` (the seam the installed package's fast path
calls with its own ``launcher``) and a plain host function. ``kraken.two_shot_all_reduce_bias`` is the same
kernel behind the product layer (``kraken.runtime.bias_norm``).

    torchrun --nproc-per-node 2 kraken/fused/two_shot_all_reduce_bias.py
"""

from __future__ import annotations

import os
import time

import torch
import torch.distributed as dist
import torch.distributed._symmetric_memory as symm_mem
import triton
import triton.language as tl

from kraken._blocks import block_range, copy_slice, sum_peers
from kraken._ptx_utils import barrier_blocks, symm_mem_sync

# Not tuned on its own: the tuned two-shot all-reduce's configuration.
DEFAULT_CONFIG = {"block_size": 4096, "num_warps": 16, "max_blocks": 132}
SHARD_ALIGN = 64  # elements: keeps every shard and chunk start 16-byte aligned for vector access
WORKSPACE_COPIES = 2  # staged input, then the pushed result


@triton.jit
def two_shot_all_reduce_bias_kernel(
    x_ptr,
    bias_ptr,
    workspace_ptr,  # this rank's workspace (= peers[rank]): [staged x | result]
    peers,  # tuple of world_size pointers, peers[r] = rank r's workspace
    out_ptr,
    signal_pad_ptrs,
    numel,
    hidden,
    shard,  # elements per rank, a multiple of SHARD_ALIGN
    chunk,  # elements per block within a shard, a multiple of SHARD_ALIGN
    rank,
    world_size: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
):
    block_id = tl.program_id(0)
    for owner in tl.static_range(world_size):
        start, end = block_range(owner, block_id, shard, chunk, numel)
        copy_slice(x_ptr, workspace_ptr, start, end, BLOCK_SIZE)
    # Release: my staged slices are visible to their owners. Acquire: peers' slices of my shard are visible to me.
    symm_mem_sync(signal_pad_ptrs, block_id, rank, world_size, hasPreviousMemAccess=True, hasSubsequentMemAccess=True)
    start, end = block_range(rank, block_id, shard, chunk, numel)
    for offset in tl.range(start, end, BLOCK_SIZE):
        offsets = offset + tl.arange(0, BLOCK_SIZE)
        mask = offsets < end
        acc = sum_peers(peers, offsets, mask, world_size)
        acc += tl.load(bias_ptr + offsets % hidden, mask=mask, other=0.0).to(tl.float32)
        result = acc.to(out_ptr.dtype.element_ty)
        for r in tl.static_range(world_size):
            tl.store(peers[r] + numel + offsets, result, mask=mask)
    # Release: my pushes are visible to every rank. Acquire: every owner's pushes are visible to me.
    symm_mem_sync(signal_pad_ptrs, block_id, rank, world_size, hasPreviousMemAccess=True, hasSubsequentMemAccess=True)
    for owner in tl.static_range(world_size):
        start, end = block_range(owner, block_id, shard, chunk, numel)
        copy_slice(workspace_ptr + numel, out_ptr, start, end, BLOCK_SIZE)


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def plan(tokens: int, hidden: int, world_size: int, config: dict, pad_bytes: int | None = None) -> dict:
    """The launch configuration: ``DEFAULT_CONFIG`` overridden by ``config``; ``world_size`` shards of whole
    ``SHARD_ALIGN`` runs, a persistent grid of at most one block per ``block_size`` elements of a shard,
    ``max_blocks``, and the block ids the signal pad holds (``pad_bytes``; by default torch's pad size). Shared
    with the Helion twin."""
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


def triton_launch(kernel, grid: tuple[int, ...], *args, **meta):
    """``launch``'s default launcher: Triton's own ``kernel[grid](...)``."""
    return kernel[grid](*args, **meta)


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
    launcher=triton_launch,
) -> torch.Tensor:
    """Launch on planned arguments (no checks); the same signature as the Helion twin's ``launch``.

    ``x``, ``out``: [tokens, hidden]; ``peers``: every rank's workspace (``2 * tokens * hidden`` elements).
    ``group_name`` is unused here. ``launcher``: Triton's own launch, or the installed package's.
    """
    launcher(
        two_shot_all_reduce_bias_kernel, (num_blocks,),
        x, bias, peers[rank], peers, out, signal_pad_ptrs, x.numel(), x.shape[1], shard, chunk, rank, len(peers),
        BLOCK_SIZE=block_size, num_warps=num_warps,
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


def two_shot_all_reduce_bias(
    x: torch.Tensor, bias: torch.Tensor, group: dist.ProcessGroup | str | None = None, **config
) -> torch.Tensor:
    """``sum over ranks of x`` + ``bias``; a new tensor of ``x``'s shape and dtype (``x`` is unchanged).

    The recipe spelled out: a symmetric workspace of two regions on every rank, the plan, one launch. It
    allocates and rendezvouses on every call and checks nothing; ``kraken.two_shot_all_reduce_bias`` is the
    installed one (checks agreed across ranks, a shared workspace, prepared calls)."""
    group = dist.group.WORLD if group is None else group
    hidden = x.shape[-1]
    x2d = x.view(-1, hidden)
    peers, signal_pad_ptrs, rank = symmetric_peers(max(WORKSPACE_COPIES * x.numel(), 1), x.dtype, x.device, group)
    out = torch.empty_like(x2d)
    launch(x2d, bias, peers, out, signal_pad_ptrs, rank, **plan(x2d.shape[0], hidden, len(peers), config))
    return out.view(x.shape)


def main(tokens: int = 256, hidden: int = 5120, iters: int = 100) -> None:
    """Check against NCCL's all-reduce plus the bias and time the kernel (``torchrun``, or alone)."""
    if "RANK" not in os.environ:  # run alone: a group of one
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT="29501")
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", device_id=device)
    rank, world_size = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(1234)  # the bias: the same on every rank
    bias = torch.randn(hidden, dtype=torch.bfloat16, device=device)
    torch.manual_seed(rank)
    x = torch.randn(tokens, hidden, dtype=torch.bfloat16, device=device)
    expected = x.float()
    dist.all_reduce(expected)
    expected += bias.float()
    got = two_shot_all_reduce_bias(x, bias)
    torch.testing.assert_close(got.float(), expected, rtol=2e-2, atol=2e-2 * world_size)

    peers, signal_pad_ptrs, rank = symmetric_peers(WORKSPACE_COPIES * x.numel(), x.dtype, device, dist.group.WORLD)
    out, cfg = torch.empty_like(x), plan(tokens, hidden, len(peers), {})
    for _ in range(10):  # warm up (compile)
        launch(x, bias, peers, out, signal_pad_ptrs, rank, **cfg)
    dist.barrier()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(iters):
        launch(x, bias, peers, out, signal_pad_ptrs, rank, **cfg)
    torch.cuda.synchronize()
    us = (time.perf_counter() - start) / iters * 1e6
    torch.testing.assert_close(out.float(), expected, rtol=2e-2, atol=2e-2 * world_size)
    if rank == 0:
        print(f"two_shot_all_reduce_bias: {tokens}x{hidden} bf16 x {world_size} ranks: matches NCCL + bias, "
              f"{us:.1f} us per call (eager launches; {cfg})")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
