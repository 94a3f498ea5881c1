"""All-gather on the copy engine, with a progress flag per rank's chunk.

For a consumer kernel that starts on the chunks that have landed while the rest are still in flight (the
all-gather + matmul recipes). Every rank holds a symmetric ``shard`` [M, ...]; ``out`` [world_size * M, ...] gets
rank r's shard at rows ``r * M ...``, and ``progress[r]`` turns from 0 to 1 (``LANDED``) once they are there.

No SM moves data: on a side stream, ``tensor.copy_`` of each peer's shard (a ``cudaMemcpyAsync`` from its
NVLink-mapped buffer, run by the copy engine), one chunk at a time starting with rank + 1 (so no two ranks read the
same peer at once), each followed by a stream memory operation that writes the chunk's flag
(``cuStreamWriteValue32``, with a system-scope fence before the write; a memory-operation node under CUDA-graph
capture). A consumer on the current stream that spins on a flag therefore cannot starve the producer, whatever SMs
it holds.

The protocol (CUDA-graph safe, no host round trip):

* flags: ``progress`` is zeroed on the current stream *before* the side stream forks from it, and only ever goes
  0 -> 1 within a call. A consumer launched on the current stream after the fork sees 0 until the chunk has landed;
  it waits with an acquire load (``kraken._ptx_utils.wait`` / ``wait_async`` for TMA readers) and reads the chunk
  after;
* peers' shards are complete before I copy them: a one-block barrier kernel (``symm_mem_sync``, release + acquire,
  block id ``BARRIER_BLOCK`` of the shard's signal pad) on the side stream, which follows every write to ``shard``
  that the current stream ordered before the fork;
* I must not overwrite my shard while a peer still copies it: a second barrier after the last copy ("done
  reading"). A peer's side stream reaches it only after its copies of my shard; the caller's next write to the
  shard comes after ``wait()``, which joins the side stream behind that barrier;
* my own rows: copied locally to ``out`` after the peers' chunks (those are what a consumer waits for; it can read
  its own rows from ``shard`` without waiting) and flagged like the others. Where my shard is my own chunk of
  ``out`` (a gather in place), there is nothing to copy.

The barrier kernels are single one-warp blocks with no shared memory: a persistent consumer must leave them room
on some SM. Both use the shard's signal pad at block id ``BARRIER_BLOCK``: no other kernel may use that block's
slots of that pad at the same time. Flags are int32 tensors; the stream operations see the same bytes as uint32.

This file is the recipe: the barrier kernel, ``plan`` (the copy order), ``launch`` (the exchange on the current
stream: barrier, copies and flags, barrier) and a plain host function. ``kraken.all_gather_with_progress`` is the
same exchange behind the product layer (``kraken.runtime.progress``: checks, prepared calls, kept events, the
exchange replayed from CUDA graphs).

    torchrun --nproc-per-node 2 kraken/comm/all_gather_with_progress.py
"""

from __future__ import annotations

import os
import time

import torch
import torch.distributed as dist
import torch.distributed._symmetric_memory as symm_mem
import triton
import triton.language as tl
from torch._C._distributed_c10d import _SymmetricMemory

from kraken._ptx_utils import symm_mem_sync

BARRIER_BLOCK = 0
BARRIER_WARPS = 1
LANDED = 1  # the value of a chunk's flag once its rows are in ``out``


@triton.jit
def shard_barrier_kernel(signal_pad_ptrs, rank, world_size: tl.constexpr, BLOCK_ID: tl.constexpr):
    # Every write before this (the copies of this side stream, and the current stream's before the fork)
    # is visible to the peers, and theirs to everything after it on this stream.
    symm_mem_sync(signal_pad_ptrs, BLOCK_ID, rank, world_size, hasPreviousMemAccess=True, hasSubsequentMemAccess=True)


def triton_launch(kernel, grid: tuple[int, ...], *args, **meta):
    """``launch``'s default launcher: Triton's own ``kernel[grid](...)``."""
    return kernel[grid](*args, **meta)


def barrier(signal_pad_ptrs: int, rank: int, world_size: int, launcher=triton_launch) -> None:
    """One cross-rank barrier on the current stream (one block, one warp)."""
    launcher(shard_barrier_kernel, (1,), signal_pad_ptrs, rank, world_size, BLOCK_ID=BARRIER_BLOCK,
             num_warps=BARRIER_WARPS)


def set_flag(progress: torch.Tensor, index: int, value: int = LANDED) -> None:
    """``progress[index] = value`` on the current stream without a kernel: a stream memory operation
    (``cuStreamWriteValue32``, which fences the stream's earlier writes system-wide first)."""
    _SymmetricMemory.stream_write_value32(progress.view(torch.uint32), index, value)


def plan(rank: int, world_size: int) -> dict:
    """The ranks in the order ``rank`` copies their chunks: its own first, then from rank + 1 on (so no two ranks
    read the same peer at once)."""
    return {"order": tuple((rank + step) % world_size for step in range(world_size))}


def launch(
    peers: tuple[torch.Tensor, ...],
    out: torch.Tensor,
    progress: torch.Tensor,
    signal_pad_ptrs: int,
    rank: int,
    order: tuple[int, ...],
    group_name: str = "",
    launcher=triton_launch,
) -> torch.Tensor:
    """The exchange on the current stream (the side stream, in a caller that overlaps it), on planned arguments and
    zeroed flags: the first barrier, each peer's chunk and its flag in ``order``, my own rows (unless my shard is my
    chunk of ``out``) and flag, the closing barrier. ``group_name`` is unused here (Helion's process-group name)."""
    shard = peers[rank]
    rows = shard.shape[0]
    barrier(signal_pad_ptrs, rank, len(peers), launcher)  # every rank's shard is complete
    for peer in order[1:]:
        out[peer * rows:(peer + 1) * rows].copy_(peers[peer])
        set_flag(progress, peer)
    # My own rows last: the consumer can read them from the shard, the peers' are the ones it waits for.
    if out.data_ptr() + rank * shard.nbytes != shard.data_ptr():
        out[rank * rows:(rank + 1) * rows].copy_(shard)
    set_flag(progress, rank)
    barrier(signal_pad_ptrs, rank, len(peers), launcher)  # done reading: peers may write their shards again
    return out


class GatherInProgress:
    """What ``all_gather_with_progress`` started: ``out``, its flags ``progress``, and ``wait()``, the join."""

    def __init__(self, out: torch.Tensor, progress: torch.Tensor, stream: torch.cuda.Stream):
        self.out, self.progress, self.stream = out, progress, stream

    def wait(self) -> torch.Tensor:
        """The current stream waits for every copy and the closing barrier; returns ``out``. Call it after
        launching the consumer and before anything else uses ``out`` or writes the shard."""
        torch.cuda.current_stream().wait_stream(self.stream)
        return self.out


def symmetric_peers(shard: torch.Tensor, group) -> tuple:
    """Every rank's ``shard`` (a symmetric tensor, the same shape on every rank) as this rank sees it, the signal
    pads' pointer array, this rank (a collective: every rank calls it)."""
    handle = symm_mem.rendezvous(shard, group if isinstance(group, str) else group.group_name)
    shape = tuple(shard.shape)
    peers = tuple(shard if r == handle.rank else handle.get_buffer(r, shape, shard.dtype)
                  for r in range(handle.world_size))
    return peers, handle.signal_pad_ptrs_dev, handle.rank


_side_streams: dict[torch.device, torch.cuda.Stream] = {}


def all_gather_with_progress(
    shard: torch.Tensor,
    group: dist.ProcessGroup | str | None = None,
    *,
    out: torch.Tensor | None = None,
    progress: torch.Tensor | None = None,
) -> GatherInProgress:
    """Start gathering every rank's ``shard`` (a contiguous tensor in symmetric memory, the same shape on every rank)
    into ``out`` [world_size * M, ...] on the copy engine, with ``progress`` int32[world_size] (each allocated if
    None). Launch the consumer on the current stream, then call ``.wait()`` on the result.

    The recipe spelled out: the shard's peers (``rendezvous``), the flags zeroed, a side stream forked from the
    current one, the exchange on it. It checks nothing; ``kraken.all_gather_with_progress`` is the installed one."""
    group = dist.group.WORLD if group is None else group
    peers, signal_pad_ptrs, rank = symmetric_peers(shard, group)
    world_size = len(peers)
    out = shard.new_empty((world_size * shard.shape[0], *shard.shape[1:])) if out is None else out
    progress = shard.new_zeros(world_size, dtype=torch.int32) if progress is None else progress.zero_()
    if shard.device not in _side_streams:  # high priority, as torch's async-TP backend stream
        _side_streams[shard.device] = torch.cuda.Stream(device=shard.device, priority=-1)
    side = _side_streams[shard.device]
    side.wait_stream(torch.cuda.current_stream())  # the fork: after the flags' reset and the shard's writes
    with torch.cuda.stream(side):
        launch(peers, out, progress, signal_pad_ptrs, rank, **plan(rank, world_size))
    return GatherInProgress(out, progress, side)


def main(rows: int = 4096, cols: int = 4096, iters: int = 50) -> None:
    """Check against NCCL's all-gather and time the gather (``torchrun``, or alone as a group of one)."""
    if "RANK" not in os.environ:  # run alone: a group of one
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT="29501")
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", device_id=device)
    rank, world_size = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(rank)
    shard = symm_mem.empty(rows, cols, dtype=torch.bfloat16, device=device)
    shard.copy_(torch.randn(rows, cols, dtype=torch.bfloat16, device=device))
    expected = torch.empty(world_size * rows, cols, dtype=torch.bfloat16, device=device)
    dist.all_gather_into_tensor(expected, shard)
    started = all_gather_with_progress(shard)
    got = started.wait()
    torch.cuda.synchronize()
    assert torch.equal(got, expected) and started.progress.tolist() == [LANDED] * world_size

    # The plain call's peers, flags and plan, prepared once: the loop times the exchange itself, on the current
    # stream (no side stream to fork and join), with the flags zeroed before each one as the plain call does.
    peers, signal_pad_ptrs, rank = symmetric_peers(shard, dist.group.WORLD)
    out, cfg = torch.empty_like(expected), plan(rank, world_size)
    progress = torch.zeros(world_size, dtype=torch.int32, device=device)
    for _ in range(5):  # warm up (compile)
        launch(peers, out, progress.zero_(), signal_pad_ptrs, rank, **cfg)
    dist.barrier()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(iters):
        launch(peers, out, progress.zero_(), signal_pad_ptrs, rank, **cfg)
    torch.cuda.synchronize()
    us = (time.perf_counter() - start) / iters * 1e6
    assert torch.equal(out, expected) and progress.tolist() == [LANDED] * world_size
    if rank == 0:
        print(f"all_gather_with_progress: {rows}x{cols} bf16 x {world_size} ranks: matches NCCL, {us:.1f} us per call "
              f"(eager launches; {cfg})")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
