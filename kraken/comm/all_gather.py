"""All-gather: every rank gets every rank's shard, in rank order, in a new tensor.

Each rank's input is its shard, ``[M, ...]`` in symmetric memory; the output is
``[world_size * M, ...]`` with rank ``r``'s shard at rows ``r * M .. (r + 1) * M``.
Every rank pulls the ``world_size - 1`` peers' shards with SM loads (and copies
its own): ``(world_size - 1) / world_size`` of the output crosses NVLink once.

A persistent grid of ``num_blocks`` blocks splits the shard into contiguous
chunks. Block ``b`` of every rank copies chunk ``b`` of every rank's shard and
uses barrier slot ``b``:

1. barrier (acquire): block ``b`` of every peer has started, so every peer's
   shard is complete;
2. one pass per step: load the step's slice from every rank, then store them
   all, so a thread has its loads from every rank in flight at once (up to 64
   bytes: one NVLink round trip per step, not one per peer). The loads start with the next
   rank, ``rank + 1``, then ``rank + 2``, ... and end with this rank's own shard:
   the ranks do not all hit rank 0 first, and the local read, which is the
   quickest, is issued after the remote ones;
3. barrier (release): "I am done reading your shard", so when the kernel
   returns every rank may overwrite its input.

An ordinary tensor (not in symmetric memory) is staged (``kraken.runtime.staging``):
block ``b`` first copies chunk ``b`` of it into kraken's symmetric workspace,
and its first barrier releases those writes; the peers are the workspace.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import triton
import triton.language as tl

from kraken._blocks import copy_slice
from kraken._ptx_utils import symm_mem_sync
from kraken.comm.reduce_scatter import shard_plan
from kraken.runtime import agreement, groups, staging
from kraken.runtime.launcher import jit_launch

# Swept on 2x H200 (block/warps 4096/8, 8192/16, 16384/32 x 132, 264, 528 blocks): the best at 4M and 32M
# bf16 output elements (19.4 and 108.1 us).
DEFAULT_CONFIG = {"block_size": 8192, "num_warps": 16, "max_blocks": 132}
# A thread loads at most 64 bytes per step over all ranks, as in the reduce-scatter (``shard_plan``; twice
# that, an unaligned shard's scalar loads spilled at world size 8).


@triton.jit
def all_gather_kernel(
    sources,  # tuple of world_size pointers: ranks rank+1, rank+2, ..., rank (own shard last)
    out_ptr,  # world_size * shard elements
    x_ptr,  # STAGED: the ordinary input, copied into workspace_ptr first
    workspace_ptr,  # STAGED: this rank's workspace (= sources[world_size - 1])
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
    if STAGED:  # the peers' block b reads exactly chunk b
        copy_slice(x_ptr, workspace_ptr, start, end, BLOCK_SIZE)
    # Acquire: every peer's shard is complete (staged: release mine too).
    symm_mem_sync(signal_pad_ptrs, block_id, rank, world_size, hasPreviousMemAccess=STAGED, hasSubsequentMemAccess=True)
    for offset in tl.range(start, end, BLOCK_SIZE):
        offsets = offset + tl.arange(0, BLOCK_SIZE)
        mask = offsets < end
        values = ()
        for i in tl.static_range(world_size):  # every load in flight before the first store
            values = values + (tl.load(sources[i] + offsets, mask=mask),)
        for i in tl.static_range(world_size):
            source_rank = (rank + 1 + i) % world_size
            tl.store(out_ptr + source_rank * shard + offsets, values[i], mask=mask)
    symm_mem_sync(signal_pad_ptrs, block_id, rank, world_size, hasPreviousMemAccess=True, hasSubsequentMemAccess=False)


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
    launcher=jit_launch,
    x: torch.Tensor | None = None,
) -> torch.Tensor:
    """Launch on prepared arguments (no checks); the same signature as the Helion port's ``launch``.

    ``peers[r]`` is rank r's shard; ``out`` has ``world_size`` shards. ``wide``: more than 2**31 - 1
    elements to address (64-bit offsets). ``group_name`` is unused here; Helion takes it as its
    ``hl.ProcessGroupName``. ``x``: an ordinary input to stage into ``peers[rank]`` (the workspace) first; None
    when the peers are the input.
    """
    local = peers[rank]
    sources = peers[rank + 1:] + peers[:rank + 1]
    launcher(
        all_gather_kernel, (num_blocks,), sources, out, local if x is None else x, local, signal_pad_ptrs,
        local.numel(), chunk, rank, len(peers), BLOCK_SIZE=block_size, STAGED=x is not None, WIDE=wide,
        num_warps=num_warps,
    )
    return out


def plan(shard: int, world_size: int, config: dict, itemsize: int = 2) -> dict:
    """Resolve the launch configuration for a ``shard``-element input of ``itemsize``-byte elements
    (shared with the Helion port)."""
    return shard_plan(shard, world_size, groups.resolve_config(config, DEFAULT_CONFIG, "all_gather"), itemsize)


def check_shape(shape: tuple[int, ...], world_size: int, op: str) -> None:
    """At least one dimension."""
    if len(shape) == 0:
        raise ValueError(f"{op}: tensor must have at least one dimension (rows to gather), got a 0-d tensor")


def check(tensor: torch.Tensor, group, op: str, config: dict, staged: bool) -> dict:
    """Validate and agree (first call of a signature), plan."""
    with agreement.agreed(op, group, tensor=tensor, staged=staged, config=config):  # any rank's bad input: all raise
        groups.check_tensor(tensor, "tensor", op)
        world_size = groups.world_size_of(group, op)
        check_shape(tuple(tensor.shape), world_size, op)
        launch_cfg = plan(tensor.numel(), world_size, config, tensor.element_size())
        groups.check_barrier_blocks(launch_cfg["num_blocks"], world_size, op)
    return launch_cfg


# Kept per signature: (the peers' symmetric context, the launch configuration); see kraken.runtime.staging.
prepare, prepare_staged, prepare_call = staging.prepares(check)


def all_gather(tensor: torch.Tensor, group: dist.ProcessGroup | str | None = None, **config) -> torch.Tensor:
    """Every rank's ``tensor`` stacked along the first dimension in rank order, as a new
    ``[world_size * M, ...]`` tensor.

    ``tensor`` (this rank's shard, ``[M, ...]``): contiguous, bf16/fp16/fp32, on the GPU; in symmetric
    memory (``kraken.symm_empty``) it is read in place, otherwise staged inside the kernel; it is left
    unchanged. ``config`` overrides ``DEFAULT_CONFIG``.
    """
    ctx, launch_cfg, staged = prepare_call(tensor, group, "all_gather", config)
    out = staging.new_rows(tensor, ctx.world_size * tensor.shape[0])
    return staging.launched(launch, ctx, launch_cfg, staged, tensor, out)
