"""One-shot all-reduce: every rank reads every peer's whole buffer and sums.

Each rank moves ``(world_size - 1) * N`` elements over NVLink, the most of any
all-reduce, but needs only two barrier rounds and no intermediate writes, so it
is the latency winner for small messages.

A persistent grid of ``num_blocks`` blocks splits the tensor into contiguous
chunks. Block ``b`` of every rank handles chunk ``b`` and uses barrier slot
``b`` of the signal pad (``world_size`` slots per block id: ``plan`` keeps the
grid inside the pad):

1. barrier (acquire): block ``b`` of every peer has started, so every peer's
   input is complete (it was written by kernels earlier in that rank's stream,
   which finished and reached the peer's L2 before this kernel began);
2. sum chunk ``b`` of every peer's buffer, in rank order (bitwise identical on
   every rank), accumulate in fp32, write the local output;
3. barrier (release): "I am done reading your buffer", so when the kernel
   returns every rank may overwrite its input.

An ordinary tensor (not in symmetric memory) is staged (``STAGED``): block ``b``
copies chunk ``b`` of it into this rank's symmetric buffer before its first
barrier, which then also releases those writes; the peers are those buffers. A
symmetric tensor is read in place.

Layout: any shape, contiguous, bf16/fp16/fp32, read as a flat array. Past 2**31
elements the kernel computes its offsets in 64 bits (``WIDE``).

This file is the recipe: the kernel, ``plan`` (pure), ``launch`` (the seam the
installed package's fast path calls with its own ``launcher``) and a plain host
function. ``kraken.one_shot_all_reduce`` is the same kernel behind the product
layer (``kraken.runtime.collectives``: checks agreed across ranks, a prepared
call per signature, a shared workspace, replayed launches).

    torchrun --nproc-per-node 2 kraken/comm/one_shot_all_reduce.py
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

# Tuned on 2x H200 with benchmark/tune.py (within 3% of the best config at every size, 4K..4M bf16).
DEFAULT_CONFIG = {"block_size": 8192, "num_warps": 16, "max_blocks": 64}
MAX_INDEX = 2**31 - 1  # the largest offset 32-bit arithmetic reaches; past it the kernel runs WIDE


@triton.jit
def one_shot_all_reduce_kernel(
    peers,  # tuple of world_size pointers, peers[r] = rank r's buffer
    out_ptr,
    x_ptr,  # STAGED: the ordinary input, copied into workspace_ptr first
    workspace_ptr,  # STAGED: this rank's workspace (= peers[rank])
    signal_pad_ptrs,
    numel,
    chunk,  # elements per block, a multiple of BLOCK_SIZE
    rank,
    world_size: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    STAGED: tl.constexpr,
    WIDE: tl.constexpr = False,  # past 2**31 elements: 64-bit offsets (32-bit ones are cheaper where they reach)
):
    block_id = tl.program_id(0)
    start = (block_id.to(tl.int64) if WIDE else block_id) * chunk
    end = tl.minimum(start + chunk, numel)
    if STAGED:  # the peers' block b reads exactly chunk b
        copy_slice(x_ptr, workspace_ptr, start, end, BLOCK_SIZE)
    # Acquire: every peer's input is complete (staged: release mine too).
    symm_mem_sync(signal_pad_ptrs, block_id, rank, world_size, hasPreviousMemAccess=STAGED, hasSubsequentMemAccess=True)
    for offset in tl.range(start, end, BLOCK_SIZE):
        offsets = offset + tl.arange(0, BLOCK_SIZE)
        mask = offsets < end
        acc = tl.zeros([BLOCK_SIZE], dtype=tl.float32)
        for r in tl.static_range(world_size):
            acc += tl.load(peers[r] + offsets, mask=mask).to(tl.float32)
        tl.store(out_ptr + offsets, acc.to(out_ptr.dtype.element_ty), mask=mask)
    symm_mem_sync(signal_pad_ptrs, block_id, rank, world_size, hasPreviousMemAccess=True, hasSubsequentMemAccess=False)


def plan(numel: int, world_size: int, config: dict, pad_bytes: int | None = None) -> dict:
    """The launch configuration: ``DEFAULT_CONFIG`` overridden by ``config``, a persistent grid of at most one
    block per ``block_size`` elements, ``max_blocks``, and the block ids the signal pad holds (``pad_bytes``;
    by default torch's pad size), each block a chunk of whole ``block_size`` tiles. Shared with the Helion twin."""
    unknown = set(config) - set(DEFAULT_CONFIG)
    if unknown:
        raise TypeError(f"one_shot_all_reduce: unknown config keys {sorted(unknown)}; known: {sorted(DEFAULT_CONFIG)}")
    cfg = {**DEFAULT_CONFIG, **config}
    block_size = cfg["block_size"]
    pad_bytes = symm_mem.get_signal_pad_size() if pad_bytes is None else pad_bytes
    num_blocks = max(1, min(-(-numel // block_size), cfg["max_blocks"], barrier_blocks(world_size, pad_bytes)))
    per_block = -(-numel // num_blocks)  # (ceiling divisions)
    chunk = -(-per_block // block_size) * block_size  # whole tiles: every chunk starts on a tile
    return {"block_size": block_size, "num_warps": cfg["num_warps"], "num_blocks": num_blocks, "chunk": chunk,
            "wide": numel > MAX_INDEX}


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

    ``wide``: the tensor has more than 2**31 - 1 elements (64-bit offsets). ``group_name`` is unused here;
    Helion takes it as its ``hl.ProcessGroupName``. ``launcher(kernel, grid, *args, **meta)``: Triton's own
    launch, or the one the installed package's prepared call passes (its host fast path). ``x``: an ordinary
    input to stage into ``peers[rank]`` first; None when the peers are the input.
    """
    local = peers[rank]
    launcher(
        one_shot_all_reduce_kernel, (num_blocks,), peers, out, local if x is None else x, local, signal_pad_ptrs,
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


def one_shot_all_reduce(
    tensor: torch.Tensor, group: dist.ProcessGroup | str | None = None, **config
) -> torch.Tensor:
    """Sum ``tensor`` over ``group`` (the default group when None); returns a new tensor, the input unchanged.

    The recipe spelled out: a symmetric buffer on every rank, the plan, one launch that stages ``tensor`` into
    the buffer and sums the peers' buffers. It allocates and rendezvouses on every call and checks nothing;
    ``kraken.one_shot_all_reduce`` is the installed one (checks agreed across ranks, prepared calls, a
    symmetric tensor read in place)."""
    group = dist.group.WORLD if group is None else group
    peers, signal_pad_ptrs, rank = symmetric_peers(tensor.numel(), tensor.dtype, tensor.device, group)
    out = torch.empty_like(tensor)
    return launch(peers, out, signal_pad_ptrs, rank, **plan(tensor.numel(), len(peers), config), x=tensor)


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
    got = one_shot_all_reduce(x)
    torch.testing.assert_close(got.float(), expected, rtol=2e-2, atol=2e-2 * dist.get_world_size())

    peers, signal_pad_ptrs, rank = symmetric_peers(numel, x.dtype, x.device, dist.group.WORLD)
    peers[rank].copy_(x)
    out, cfg = torch.empty_like(x), plan(numel, len(peers), {})
    for _ in range(10):  # warm up (compile)
        launch(peers, out, signal_pad_ptrs, rank, **cfg)
    dist.barrier()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(iters):
        launch(peers, out, signal_pad_ptrs, rank, **cfg)
    torch.cuda.synchronize()
    us = (time.perf_counter() - start) / iters * 1e6
    torch.testing.assert_close(out.float(), expected, rtol=2e-2, atol=2e-2 * dist.get_world_size())
    if rank == 0:
        print(f"one_shot_all_reduce: {numel} bf16 x {len(peers)} ranks: matches NCCL, {us:.1f} us per call "
              f"(eager launches; {cfg})")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
