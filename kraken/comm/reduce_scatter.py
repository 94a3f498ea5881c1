"""Reduce-scatter: rank ``r`` gets shard ``r`` of the sum over ranks, in a new tensor.

The input is ``[M, ...]`` in symmetric memory, ``M`` divisible by the world
size; shard ``r`` is rows ``r * M / ws .. (r + 1) * M / ws``, i.e. the contiguous
elements ``r * shard .. (r + 1) * shard``. Each rank reads only its own shard
of every peer's buffer: ``(world_size - 1) / world_size`` of the data crosses
NVLink once, the least any reduce-scatter can move.

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

An ordinary tensor (not in symmetric memory) is staged (``kraken.runtime.staging``):
block ``b`` first copies chunk ``b`` of every shard (what each owner's block
``b`` reads) into kraken's symmetric workspace, and its first barrier releases
those writes; the peers are the workspace.

Tried and measured on 2x H200 (eager, bf16, commit 778521e): both barriers as
epoch barriers (a posted store, no compare-and-swap round trip) on a pad of their
own. No gain where the barriers dominate (4K elements: 7.1 against 7.3 us, NCCL
6.4) and slower from 128K (8.3 against 7.8 us; 1M: 10.9 against 9.9); the same
for the all-gather. So both keep the compare-and-swap barrier.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import triton
import triton.language as tl

from kraken._blocks import copy_slice
from kraken._ptx_utils import symm_mem_sync
from kraken.runtime import agreement, groups, staging
from kraken.runtime.launcher import jit_launch

# Swept on 2x H200 (block/warps 4096/8, 8192/16, 16384/32 x 132, 264, 528 blocks): within 0.3% of the best
# at 4M and 32M bf16 elements (19.4 and 109.1 us).
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

    ``out`` holds this rank's shard (``peers[r].numel() // world_size`` elements). ``wide``: more than
    2**31 - 1 elements to address (64-bit offsets). ``group_name`` is unused here; Helion takes it as its
    ``hl.ProcessGroupName``. ``x``: an ordinary input to stage into ``peers[rank]`` (the workspace) first; None
    when the peers are the input.
    """
    local = peers[rank]
    launcher(
        reduce_scatter_kernel, (num_blocks,), peers, out, local if x is None else x, local, signal_pad_ptrs,
        out.numel(), chunk, rank, len(peers), BLOCK_SIZE=block_size, STAGED=x is not None, WIDE=wide,
        num_warps=num_warps,
    )
    return out


def plan(numel: int, world_size: int, config: dict, itemsize: int = 2) -> dict:
    """Resolve the launch configuration for ``numel`` input elements of ``itemsize`` bytes
    (shared with the Helion port)."""
    cfg = groups.resolve_config(config, DEFAULT_CONFIG, "reduce_scatter")
    return shard_plan(numel // world_size, world_size, cfg, itemsize)


def shard_plan(shard: int, world_size: int, cfg: dict, itemsize: int) -> dict:
    """The persistent grid over a ``shard``-element shard read from every rank, for a resolved ``cfg``
    (block_size, num_warps, max_blocks): shared by reduce-scatter and all-gather, which load alike."""
    per_rank_bytes = 1 << ((MAX_BYTES_PER_THREAD // world_size).bit_length() - 1)  # a power of two
    per_peer = max(1, per_rank_bytes // itemsize)  # values per thread and rank
    block_size = min(cfg["block_size"], per_peer * 32 * cfg["num_warps"])
    num_blocks = groups.persistent_grid(groups.cdiv(shard, block_size), cfg["max_blocks"], world_size)
    chunk = groups.round_up(groups.cdiv(shard, num_blocks), CHUNK_ALIGN)
    return {"block_size": block_size, "num_warps": cfg["num_warps"], "num_blocks": num_blocks, "chunk": chunk,
            "wide": world_size * shard > MAX_INDEX}


def check_shape(shape: tuple[int, ...], world_size: int, op: str) -> None:
    """The input's rows must split evenly over the ranks (a ValueError naming M and the world size)."""
    if len(shape) == 0:
        raise ValueError(f"{op}: tensor must have at least one dimension (rows to scatter), got a 0-d tensor")
    if shape[0] % world_size != 0:
        raise ValueError(
            f"{op}: the first dimension M = {shape[0]} is not divisible by the world size {world_size}; "
            f"every rank gets M / {world_size} rows"
        )


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


def reduce_scatter(tensor: torch.Tensor, group: dist.ProcessGroup | str | None = None, **config) -> torch.Tensor:
    """This rank's ``[M / world_size, ...]`` rows of the sum of ``tensor`` over the group, as a new tensor.

    ``tensor``: ``[M, ...]`` with ``M`` divisible by the world size, contiguous, bf16/fp16/fp32, on the GPU;
    in symmetric memory (``kraken.symm_empty``) it is read in place, otherwise staged inside the kernel; it
    is left unchanged. The sum runs in rank order in fp32 and is rounded once. ``config`` overrides
    ``DEFAULT_CONFIG``.
    """
    ctx, launch_cfg, staged = prepare_call(tensor, group, "reduce_scatter", config)
    out = staging.new_rows(tensor, tensor.shape[0] // ctx.world_size)
    return staging.launched(launch, ctx, launch_cfg, staged, tensor, out)
