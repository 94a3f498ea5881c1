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
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import triton
import triton.language as tl

from kraken import host
from kraken._ptx_utils import symm_mem_sync

# Tuned on 2x H200 with benchmark/tune.py (within 3% of the best config at every size, 4K..4M bf16).
DEFAULT_CONFIG = {"block_size": 4096, "num_warps": 16, "max_blocks": 132}
MAX_VALUES_PER_THREAD = 32
SHARD_ALIGN = 64  # elements: keeps every shard and chunk start 16-byte aligned for vector access


@triton.jit
def two_shot_all_reduce_kernel(
    peers,  # tuple of world_size pointers, peers[r] = rank r's buffer
    signal_pad_ptrs,
    numel,
    shard,  # elements per rank, a multiple of SHARD_ALIGN
    chunk,  # elements per block within a shard, a multiple of SHARD_ALIGN
    rank,
    world_size: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
):
    block_id = tl.program_id(0)
    symm_mem_sync(signal_pad_ptrs, block_id, rank, world_size, hasPreviousMemAccess=False, hasSubsequentMemAccess=True)
    shard_end = tl.minimum(rank * shard + shard, numel)
    start = rank * shard + block_id * chunk
    end = tl.minimum(start + chunk, shard_end)
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


def launch(
    peers: tuple[torch.Tensor, ...],
    signal_pad_ptrs: int,
    rank: int,
    block_size: int,
    num_warps: int,
    num_blocks: int,
    shard: int,
    chunk: int,
    group_name: str = "",
    launcher=host.jit_launch,
) -> torch.Tensor:
    """Launch on prepared arguments (no checks); the same signature as the Helion port's ``launch``.

    ``group_name`` is unused here; Helion takes it as its ``hl.ProcessGroupName``.
    """
    local = peers[rank]
    launcher(
        two_shot_all_reduce_kernel, (num_blocks,),
        peers, signal_pad_ptrs, local.numel(), shard, chunk, rank, len(peers),
        BLOCK_SIZE=block_size, num_warps=num_warps,
    )
    return local


def plan(numel: int, world_size: int, config: dict) -> dict:
    """Resolve the launch configuration (shared with the Helion port)."""
    cfg = host.resolve_config(config, DEFAULT_CONFIG, "two_shot_all_reduce")
    # A thread holds one load per peer in flight; past ~32 values per thread the compiler spills
    # (world size 8), so the block shrinks as the world grows.
    block_size = min(cfg["block_size"], MAX_VALUES_PER_THREAD * 32 * cfg["num_warps"] // world_size)
    shard = host.round_up(host.cdiv(numel, world_size), SHARD_ALIGN)
    num_blocks = host.persistent_grid(host.cdiv(shard, block_size), cfg["max_blocks"], world_size)
    chunk = host.round_up(host.cdiv(shard, num_blocks), SHARD_ALIGN)
    return {
        "block_size": block_size, "num_warps": cfg["num_warps"], "num_blocks": num_blocks,
        "shard": shard, "chunk": chunk,
    }


@host.per_signature(host.symmetric_key)
def prepare(tensor: torch.Tensor, group, op: str, config: dict) -> tuple[host.SymmContext, dict]:
    with host.agreed(op, group, tensor=tensor, config=config):  # every rank raises if any rank's input is bad
        host.check_tensor(tensor, "tensor", op)
        world_size = host.world_size_of(group, op)
        launch_cfg = plan(tensor.numel(), world_size, config)
        host.check_barrier_blocks(launch_cfg["num_blocks"], world_size, op)
    return host.symm_context(tensor, group, op), {**launch_cfg, "launcher": host.Launcher(op)}


def two_shot_all_reduce(
    tensor: torch.Tensor, group: dist.ProcessGroup | str | None = None, **config
) -> torch.Tensor:
    """Sum ``tensor`` over the group *in place* and return it.

    ``tensor`` must live in symmetric memory (``kraken.symm_empty``), any shape,
    bf16/fp16/fp32. ``config`` overrides ``DEFAULT_CONFIG``.
    """
    ctx, launch_cfg = prepare(tensor, group, "two_shot_all_reduce", config)
    return launch(ctx.peers, ctx.signal_pad_ptrs, ctx.rank, **launch_cfg, group_name=ctx.group_name)
