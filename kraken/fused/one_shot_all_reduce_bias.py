"""One-shot all-reduce + bias: ``out = sum_r x_r + bias``, in one launch.

The epilogue of a tensor-parallel row-parallel linear layer, where ``x`` is the
rank's partial product ([tokens, hidden]) and ``bias`` is replicated. In a
decode step the message is a few KB to a few MB, so launch count and barrier
rounds dominate, not bandwidth: everything below happens in one kernel with two
barrier rounds, the same as the bare one-shot all-reduce.

``x`` may be any contiguous CUDA tensor. The kernel stages it through a
symmetric workspace (``peers[rank]``) itself, before its first barrier, so
there is no separate copy launch. It always copies, even when ``x`` already
lives in symmetric memory: finding out would take a rendezvous (a collective)
per new tensor, and the copy is one local read and write of the message, well
under a microsecond up to about a megabyte. ``x`` may even be the workspace
itself (the copy is then in place), never a view overlapping it elsewhere.

A persistent grid of ``num_blocks`` blocks cuts the flattened message into
contiguous chunks; block ``b`` of every rank handles chunk ``b`` and barrier
slot ``b``:

1. copy chunk ``b`` of ``x`` into the workspace;
2. barrier (release + acquire): "my chunk is visible to you", "yours to me";
3. sum chunk ``b`` over every peer's workspace in rank order (fp32, so every
   rank computes the same bits), add ``bias`` (column = offset % hidden), store;
4. barrier (release): "done reading your workspace", so the next call may
   overwrite it.

Layout: ``x`` [..., hidden] (any leading shape flattened into tokens), contiguous, bf16/fp16/fp32; ``bias``
[hidden] of ``x``'s dtype; the workspace holds ``tokens * hidden`` elements (``WORKSPACE_COPIES`` = 1).

This file is the recipe: the kernel, ``plan`` (pure), ``launch`` (the seam the installed package's fast path
calls with its own ``launcher``) and a plain host function. ``kraken.one_shot_all_reduce_bias`` is the same
kernel behind the product layer (``kraken.runtime.bias_norm``: checks agreed across ranks, a prepared call per
signature on a shared workspace, replayed launches).

    torchrun --nproc-per-node 2 kraken/fused/one_shot_all_reduce_bias.py
"""

from __future__ import annotations

import os
import time

import torch
import torch.distributed as dist
import torch.distributed._symmetric_memory as symm_mem
import triton
import triton.language as tl

from kraken._blocks import copy_slice, sum_peers
from kraken._ptx_utils import barrier_blocks, symm_mem_sync

# Not tuned on its own: the tuned one-shot all-reduce's configuration (same loop plus a staging copy).
DEFAULT_CONFIG = {"block_size": 8192, "num_warps": 16, "max_blocks": 64}
WORKSPACE_COPIES = 1  # the staged input


@triton.jit
def one_shot_all_reduce_bias_kernel(
    x_ptr,
    bias_ptr,
    workspace_ptr,  # this rank's workspace (= peers[rank])
    peers,  # tuple of world_size pointers, peers[r] = rank r's workspace
    out_ptr,
    signal_pad_ptrs,
    numel,
    hidden,
    chunk,  # elements per block, a multiple of BLOCK_SIZE
    rank,
    world_size: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
):
    block_id = tl.program_id(0)
    start = block_id * chunk
    end = tl.minimum(start + chunk, numel)
    copy_slice(x_ptr, workspace_ptr, start, end, BLOCK_SIZE)
    # Release: my staged chunk is visible to peers. Acquire: theirs is visible to me.
    symm_mem_sync(signal_pad_ptrs, block_id, rank, world_size, hasPreviousMemAccess=True, hasSubsequentMemAccess=True)
    for offset in tl.range(start, end, BLOCK_SIZE):
        offsets = offset + tl.arange(0, BLOCK_SIZE)
        mask = offsets < end
        acc = sum_peers(peers, offsets, mask, world_size)
        acc += tl.load(bias_ptr + offsets % hidden, mask=mask, other=0.0).to(tl.float32)
        tl.store(out_ptr + offsets, acc.to(out_ptr.dtype.element_ty), mask=mask)
    # Done reading peers' workspaces: after this they may restage into them.
    symm_mem_sync(signal_pad_ptrs, block_id, rank, world_size, hasPreviousMemAccess=True, hasSubsequentMemAccess=False)


def plan(tokens: int, hidden: int, world_size: int, config: dict, pad_bytes: int | None = None) -> dict:
    """The launch configuration: ``DEFAULT_CONFIG`` overridden by ``config``, a persistent grid of at most one block
    per ``block_size`` elements, ``max_blocks``, and the block ids the signal pad holds (``pad_bytes``; by default
    torch's pad size), each block a chunk of whole ``block_size`` tiles. Shared with the Helion twin."""
    unknown = set(config) - set(DEFAULT_CONFIG)
    if unknown:
        raise TypeError(
            f"one_shot_all_reduce_bias: unknown config keys {sorted(unknown)}; known: {sorted(DEFAULT_CONFIG)}")
    cfg = {**DEFAULT_CONFIG, **config}
    numel, block_size = tokens * hidden, cfg["block_size"]
    pad_bytes = symm_mem.get_signal_pad_size() if pad_bytes is None else pad_bytes
    num_blocks = max(1, min(-(-numel // block_size), cfg["max_blocks"], barrier_blocks(world_size, pad_bytes)))
    per_block = -(-numel // num_blocks)  # (ceiling divisions)
    chunk = -(-per_block // block_size) * block_size  # whole tiles: every chunk starts on a tile
    return {"block_size": block_size, "num_warps": cfg["num_warps"], "num_blocks": num_blocks, "chunk": chunk}


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
    chunk: int,
    group_name: str = "",
    launcher=triton_launch,
) -> torch.Tensor:
    """Launch on planned arguments (no checks); the same signature as the Helion twin's ``launch``.

    ``x``, ``out``: [tokens, hidden]; ``peers``: every rank's workspace (``tokens * hidden`` elements).
    ``group_name`` is unused here; Helion takes it as its ``hl.ProcessGroupName``. ``launcher(kernel, grid,
    *args, **meta)``: Triton's own launch, or the one the installed package's prepared call passes.
    """
    launcher(
        one_shot_all_reduce_bias_kernel, (num_blocks,),
        x, bias, peers[rank], peers, out, signal_pad_ptrs, x.numel(), x.shape[1], chunk, rank, len(peers),
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


def one_shot_all_reduce_bias(
    x: torch.Tensor, bias: torch.Tensor, group: dist.ProcessGroup | str | None = None, **config
) -> torch.Tensor:
    """``sum over ranks of x`` + ``bias``; a new tensor of ``x``'s shape and dtype (``x`` is unchanged).

    The recipe spelled out: a symmetric workspace on every rank, the plan, one launch that stages ``x`` into it
    and sums. It allocates and rendezvouses on every call and checks nothing; ``kraken.one_shot_all_reduce_bias``
    is the installed one (checks agreed across ranks, a shared workspace, prepared calls)."""
    group = dist.group.WORLD if group is None else group
    hidden = x.shape[-1]
    x2d = x.view(-1, hidden)
    peers, signal_pad_ptrs, rank = symmetric_peers(max(WORKSPACE_COPIES * x.numel(), 1), x.dtype, x.device, group)
    out = torch.empty_like(x2d)
    launch(x2d, bias, peers, out, signal_pad_ptrs, rank, **plan(x2d.shape[0], hidden, len(peers), config))
    return out.view(x.shape)


def main(tokens: int = 16, hidden: int = 5120, iters: int = 100) -> None:
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
    got = one_shot_all_reduce_bias(x, bias)
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
        print(f"one_shot_all_reduce_bias: {tokens}x{hidden} bf16 x {world_size} ranks: matches NCCL + bias, "
              f"{us:.1f} us per call (eager launches; {cfg})")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
