"""Helion twin of ``kraken/comm/all_gather_with_progress.py``: the same exchange, plan and arguments.

The recipe moves no data with an SM: the copies run on the copy engine and the flags are stream memory operations,
host code the twin repeats line for line. Its one kernel is the one-block barrier around the copies, and that is
what this file ports: ``hl.grid(1)`` is the single block, whose grid index 0 is the barrier's block id
(``BARRIER_BLOCK``), and the barrier is the kraken PTX through ``hl.inline_triton`` (release + acquire).
``helion_ports.all_gather_with_progress`` is the installed twin (``kraken.runtime.progress`` driving this
``launch``).

    torchrun --nproc-per-node 2 helion_ports/comm/all_gather_with_progress.py
"""

from __future__ import annotations

import functools
import os

import helion
import helion.language as hl
import torch
import torch.distributed as dist
import torch.distributed._symmetric_memory as symm_mem
from torch._C._distributed_c10d import _SymmetricMemory

from kraken._blocks.helion import flat_kernel, run
from kraken._ptx_utils.inline_source import SYMM_MEM_SYNC

BARRIER_BLOCK = 0  # the twin's one block (grid index 0) is the barrier's block id
BARRIER_WARPS = 1
LANDED = 1
# "Every write before this is visible to the peers, and theirs to everything after it on this stream."
SYNC = SYMM_MEM_SYNC[(True, True)]


def shard_barrier_body(anchor: torch.Tensor, signal_pad_ptrs: int, rank: int, world_size: hl.constexpr,
                       group_name: hl.ProcessGroupName) -> None:
    # ``anchor`` is never read: a Helion kernel takes its device from a tensor argument.
    for block in hl.grid(1):
        hl.inline_triton(SYNC, args={"signal_pad_ptrs": signal_pad_ptrs, "block_id": block, "rank": rank,
                                     "world_size": world_size}, output_like=None)


@functools.cache
def compiled() -> helion.Kernel:
    """The barrier kernel with an explicit config: one program (``pid_type="flat"``), one warp."""
    return flat_kernel(shard_barrier_body, (), BARRIER_WARPS)


_anchors: dict[int, torch.Tensor] = {}


def anchor() -> torch.Tensor:
    """An empty tensor on the current device (the CPU without one), made once per device: what the barrier kernel
    takes its device from."""
    index = torch._C._cuda_getDevice() if torch.cuda.is_available() else -1
    tensor = _anchors.get(index)
    if tensor is None:
        device = torch.device("cuda", index) if index >= 0 else torch.device("cpu")
        tensor = _anchors[index] = torch.empty(0, dtype=torch.int32, device=device)
    return tensor


def barrier(signal_pad_ptrs: int, rank: int, world_size: int, launcher=None, group_name: str = "") -> None:
    """One cross-rank barrier on the current stream (one block, one warp); the recipe's ``barrier``
    (``group_name``: Helion's ``hl.ProcessGroupName``, unused by the recipe)."""
    run(compiled(), (anchor(), signal_pad_ptrs, rank, world_size, group_name), launcher)


def set_flag(progress: torch.Tensor, index: int, value: int = LANDED) -> None:
    """``progress[index] = value`` on the current stream: a stream memory operation, as the recipe's."""
    _SymmetricMemory.stream_write_value32(progress.view(torch.uint32), index, value)


def plan(rank: int, world_size: int) -> dict:
    """The recipe's plan: its own rank first, then from rank + 1 on."""
    return {"order": tuple((rank + step) % world_size for step in range(world_size))}


def launch(
    peers: tuple[torch.Tensor, ...],
    out: torch.Tensor,
    progress: torch.Tensor,
    signal_pad_ptrs: int,
    rank: int,
    order: tuple[int, ...],
    group_name: str = "",
    launcher=None,
) -> torch.Tensor:
    """The exchange on the current stream, on planned arguments; the recipe's ``launch`` signature, the Helion
    barrier. ``launcher``: None for a plain call, or the installed package's (``run``)."""
    shard = peers[rank]
    rows = shard.shape[0]
    barrier(signal_pad_ptrs, rank, len(peers), launcher, group_name)
    for peer in order[1:]:
        out[peer * rows:(peer + 1) * rows].copy_(peers[peer])
        set_flag(progress, peer)
    if out.data_ptr() + rank * shard.nbytes != shard.data_ptr():
        out[rank * rows:(rank + 1) * rows].copy_(shard)
    set_flag(progress, rank)
    barrier(signal_pad_ptrs, rank, len(peers), launcher, group_name)
    return out


class GatherInProgress:
    """What ``all_gather_with_progress`` started: ``out``, its flags ``progress``, and ``wait()``, the join."""

    def __init__(self, out: torch.Tensor, progress: torch.Tensor, stream: torch.cuda.Stream):
        self.out, self.progress, self.stream = out, progress, stream

    def wait(self) -> torch.Tensor:
        torch.cuda.current_stream().wait_stream(self.stream)
        return self.out


_side_streams: dict[torch.device, torch.cuda.Stream] = {}


def all_gather_with_progress(
    shard: torch.Tensor,
    group: dist.ProcessGroup | str | None = None,
    *,
    out: torch.Tensor | None = None,
    progress: torch.Tensor | None = None,
) -> GatherInProgress:
    """Start gathering every rank's symmetric ``shard`` into ``out`` on the copy engine (see the recipe): the peers,
    the flags zeroed, a side stream forked from the current one, the exchange on it. It checks nothing."""
    group = dist.group.WORLD if group is None else group
    name = group if isinstance(group, str) else group.group_name
    handle = symm_mem.rendezvous(shard, name)
    world_size, rank = handle.world_size, handle.rank
    peers = tuple(shard if r == rank else handle.get_buffer(r, tuple(shard.shape), shard.dtype)
                  for r in range(world_size))
    out = shard.new_empty((world_size * shard.shape[0], *shard.shape[1:])) if out is None else out
    progress = shard.new_zeros(world_size, dtype=torch.int32) if progress is None else progress.zero_()
    if shard.device not in _side_streams:
        _side_streams[shard.device] = torch.cuda.Stream(device=shard.device, priority=-1)
    side = _side_streams[shard.device]
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        launch(peers, out, progress, handle.signal_pad_ptrs_dev, rank, **plan(rank, world_size), group_name=name)
    return GatherInProgress(out, progress, side)


def main(rows: int = 4096, cols: int = 4096) -> None:
    """Check against NCCL's all-gather (``torchrun``, or alone as a group of one)."""
    if "RANK" not in os.environ:
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
    if rank == 0:
        print(f"helion all_gather_with_progress: {rows}x{cols} bf16 x {world_size} ranks: matches NCCL")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
