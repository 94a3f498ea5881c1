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

An ordinary tensor (not in symmetric memory) is staged (``kraken.runtime.staging``):
block ``b`` first copies slice ``b`` of every shard into kraken's symmetric
workspace (what the owners' block ``b`` reads), the kernel reduces in place in
the workspace, and block ``b`` ends by copying slice ``b`` of every shard of the
sum back into the tensor. One region suffices, as in place: only the owner
touches a shard between the barriers, and the next call stages a slice only
after its owner's pushes into it have passed this call's final barrier.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import triton
import triton.language as tl

from kraken._blocks import block_range, copy_slice
from kraken._ptx_utils import symm_mem_sync
from kraken.runtime import agreement, groups, staging
from kraken.runtime.launcher import jit_launch

# Tuned on 2x H200 with benchmark/tune.py (within 3% of the best config at every size, 4K..4M bf16).
DEFAULT_CONFIG = {"block_size": 4096, "num_warps": 16, "max_blocks": 132}
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
    launcher=jit_launch,
    x: torch.Tensor | None = None,
) -> torch.Tensor:
    """Launch on prepared arguments (no checks); the same signature as the Helion port's ``launch``.

    ``wide``: more than 2**31 - 1 elements to address (64-bit offsets). ``group_name`` is unused here; Helion
    takes it as its ``hl.ProcessGroupName``. ``x``: an ordinary input, staged into ``peers[rank]`` (the workspace)
    and given the sum; None when the peers are the input.
    Returns the summed tensor (``x``, or ``peers[rank]``).
    """
    local = peers[rank]
    launcher(
        two_shot_all_reduce_kernel, (num_blocks,),
        peers, local if x is None else x, local, signal_pad_ptrs, local.numel(), shard, chunk, rank, len(peers),
        BLOCK_SIZE=block_size, STAGED=x is not None, WIDE=wide, num_warps=num_warps,
    )
    return local if x is None else x


def plan(numel: int, world_size: int, config: dict) -> dict:
    """Resolve the launch configuration (shared with the Helion port)."""
    cfg = groups.resolve_config(config, DEFAULT_CONFIG, "two_shot_all_reduce")
    # A thread holds one load per peer in flight; past ~32 values per thread the compiler spills
    # (world size 8), so the block shrinks as the world grows.
    block_size = min(cfg["block_size"], MAX_VALUES_PER_THREAD * 32 * cfg["num_warps"] // world_size)
    shard = groups.round_up(groups.cdiv(numel, world_size), SHARD_ALIGN)
    num_blocks = groups.persistent_grid(groups.cdiv(shard, block_size), cfg["max_blocks"], world_size)
    chunk = groups.round_up(groups.cdiv(shard, num_blocks), SHARD_ALIGN)
    return {
        "block_size": block_size, "num_warps": cfg["num_warps"], "num_blocks": num_blocks,
        "shard": shard, "chunk": chunk, "wide": world_size * shard > MAX_INDEX,
    }


def check(tensor: torch.Tensor, group, op: str, config: dict, staged: bool) -> dict:
    """Validate and agree (first call of a signature), plan."""
    with agreement.agreed(op, group, tensor=tensor, staged=staged, config=config):  # any rank's bad input: all raise
        groups.check_tensor(tensor, "tensor", op)
        world_size = groups.world_size_of(group, op)
        launch_cfg = plan(tensor.numel(), world_size, config)
        groups.check_barrier_blocks(launch_cfg["num_blocks"], world_size, op)
    return launch_cfg


# Kept per signature: (the peers' symmetric context, the launch configuration); see kraken.runtime.staging.
prepare, prepare_staged, prepare_call = staging.prepares(check)


def two_shot_all_reduce(
    tensor: torch.Tensor, group: dist.ProcessGroup | str | None = None, **config
) -> torch.Tensor:
    """Sum ``tensor`` over the group *in place* and return it.

    ``tensor``: any shape, contiguous, bf16/fp16/fp32, on the GPU; in symmetric memory
    (``kraken.symm_empty``) it is reduced where it lies, otherwise staged through the workspace inside the
    kernel (and the sum written back). ``config`` overrides ``DEFAULT_CONFIG``.
    """
    ctx, launch_cfg, staged = prepare_call(tensor, group, "two_shot_all_reduce", config)
    return staging.launched(launch, ctx, launch_cfg, staged, tensor)
