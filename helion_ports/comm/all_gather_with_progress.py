"""Helion twin of ``kraken.comm.all_gather_with_progress``: same function, same arguments.

The recipe moves no data with an SM: the copies run on the copy engine and the flags are stream memory
operations, all host code, which the twin shares (``start``'s protocol, ``GatherInProgress``,
``set_flag``, the side stream). Its one kernel is the one-block barrier around the copies, and that is
what this file ports: ``hl.grid(1)`` is the single block, whose grid index 0 is the barrier's block id
(``BARRIER_BLOCK``), and the barrier is the kraken PTX through ``hl.inline_triton`` (release + acquire).
The twin hands the recipe's ``start`` a launcher that runs this kernel wherever the recipe launches its
Triton barrier, so the copy order, the flags and both barriers stay exactly the recipe's.
"""

from __future__ import annotations

import functools
from typing import Callable

import helion
import helion.language as hl
import torch
import torch.distributed as dist

from kraken._blocks.helion import flat_kernel, run
from kraken._ptx_utils.inline_source import SYMM_MEM_SYNC
from kraken.comm.all_gather_with_progress import (  # shared with the Triton recipe
    BARRIER_BLOCK, BARRIER_WARPS, GatherInProgress, barrier_launcher, prepare, shard_barrier_kernel,
)
from kraken.comm.all_gather_with_progress import start as recipe_start
from kraken.runtime import prepared
from kraken.runtime.launcher import jit_launch

# "Every write before this is visible to the peers, and theirs to everything after it on this stream."
SYNC = SYMM_MEM_SYNC[(True, True)]
assert BARRIER_BLOCK == 0, "the twin's one block (grid index 0) is the barrier's block id"


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


def barrier(signal_pad_ptrs: int, rank: int, world_size: int, launcher=jit_launch, group_name: str = "") -> None:
    """One cross-rank barrier on the current stream (one block, one warp); mirrors the recipe's ``barrier``
    (``group_name``: Helion's ``hl.ProcessGroupName``, unused by the recipe)."""
    run(compiled(), (anchor(), signal_pad_ptrs, rank, world_size, group_name), launcher)


class HelionBarrier:
    """A launcher for the recipe's ``start``: where it launches its Triton barrier (the only kernel it
    launches), run the Helion barrier instead, through ``launcher``."""

    def __init__(self, launcher, group_name: str = ""):
        self.launcher, self.group_name = launcher, group_name

    def __call__(self, kernel, grid, signal_pad_ptrs, rank, world_size, **meta):
        assert kernel is shard_barrier_kernel and tuple(grid) == (1,) and meta["BLOCK_ID"] == BARRIER_BLOCK, kernel
        barrier(signal_pad_ptrs, rank, world_size, self.launcher, self.group_name)


@functools.lru_cache(maxsize=prepared.MAX_PREPARED)
def helion_barrier(launcher, group_name: str = "") -> HelionBarrier:
    """The ``HelionBarrier`` over ``launcher``, one per (launcher, group name): the recipe's exchange replays a
    graph kept per launcher object (``graphs.graphed``), which a new object per call would never find. Bounded as
    the prepared calls are (``prepared.MAX_PREPARED``): the all-gather + matmul twins pass their prepared calls'
    launchers, which must not outlive those calls here."""
    return HelionBarrier(launcher, group_name)


def start(
    peers: tuple[torch.Tensor, ...],
    signal_pad_ptrs: int,
    rank: int,
    out: torch.Tensor,
    progress: torch.Tensor,
    stage_from: torch.Tensor | None = None,
    snapshot: torch.Tensor | None = None,
    stage_launch: Callable[[], None] | None = None,
    launcher=jit_launch,
    flag_own: bool = True,
) -> GatherInProgress:
    """The recipe's ``start`` with the Helion barrier; mirrors ``kraken.comm.all_gather_with_progress.start``."""
    return recipe_start(peers, signal_pad_ptrs, rank, out, progress, stage_from=stage_from, snapshot=snapshot,
                        stage_launch=stage_launch, launcher=helion_barrier(launcher), flag_own=flag_own)


def all_gather_with_progress(
    shard: torch.Tensor,
    group: dist.ProcessGroup | str | None = None,
    *,
    out: torch.Tensor | None = None,
    progress: torch.Tensor | None = None,
) -> GatherInProgress:
    """Start gathering every rank's ``shard`` into ``out`` on the copy engine (see the kraken recipe)."""
    ctx, out, progress = prepare(shard, group, out, progress)
    return recipe_start(ctx.peers, ctx.signal_pad_ptrs, ctx.rank, out, progress,
                        launcher=helion_barrier(barrier_launcher(ctx), ctx.group_name))
