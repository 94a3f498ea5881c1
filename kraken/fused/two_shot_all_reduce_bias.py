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
``out``. Staging: see ``one_shot_all_reduce_bias`` (``x`` is always copied).

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
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import triton
import triton.language as tl

from kraken._blocks import block_range, copy_slice, sum_peers
from kraken._ptx_utils import symm_mem_sync
from kraken.comm.two_shot_all_reduce import DEFAULT_CONFIG as TWO_SHOT_CONFIG, SHARD_ALIGN
from kraken.fused.one_shot_all_reduce_bias import BIAS_KEY, on_signature, staged_call, staged_signature
from kraken.fused.rms_norm import NO_EPS
from kraken.runtime import groups, prepared
from kraken.runtime.launcher import jit_launch

# Not tuned on its own: the tuned two-shot all-reduce's configuration.
DEFAULT_CONFIG = dict(TWO_SHOT_CONFIG)
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


def plan(tokens: int, hidden: int, world_size: int, config: dict) -> dict:
    """Resolve the launch configuration (shared with the Helion port)."""
    cfg = groups.resolve_config(config, DEFAULT_CONFIG, "two_shot_all_reduce_bias")
    numel, block_size = tokens * hidden, cfg["block_size"]
    shard = groups.round_up(groups.cdiv(numel, world_size), SHARD_ALIGN)
    num_blocks = groups.persistent_grid(groups.cdiv(shard, block_size), cfg["max_blocks"], world_size)
    chunk = groups.round_up(groups.cdiv(shard, num_blocks), SHARD_ALIGN)
    return {
        "block_size": block_size, "num_warps": cfg["num_warps"], "num_blocks": num_blocks,
        "shard": shard, "chunk": chunk,
    }


@prepared.per_signature(BIAS_KEY)
def signature(x: torch.Tensor, bias: torch.Tensor, group, op: str, config: dict) -> tuple:
    """This call signature's preparation (``staged_signature``), kept per signature; shared with the twin."""
    return staged_signature(op, x, {"bias": bias}, NO_EPS, group, config, plan, WORKSPACE_COPIES)


def prepare(x: torch.Tensor, bias: torch.Tensor, group, op: str, config: dict):
    """(``x`` as [tokens, hidden], the workspace's symmetric context, the launch configuration)."""
    return on_signature(op, x, signature(x, bias, group, op, config))


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
    launcher=jit_launch,
) -> torch.Tensor:
    """Launch on prepared arguments (no checks); the same signature as the Helion port's ``launch``.

    ``x``, ``out``: [tokens, hidden]; ``peers``: every rank's workspace
    (``2 * tokens * hidden`` elements). ``group_name`` is unused here.
    """
    launcher(
        two_shot_all_reduce_bias_kernel, (num_blocks,),
        x, bias, peers[rank], peers, out, signal_pad_ptrs, x.numel(), x.shape[1], shard, chunk, rank, len(peers),
        BLOCK_SIZE=block_size, num_warps=num_warps,
    )
    return out


def two_shot_all_reduce_bias(
    x: torch.Tensor, bias: torch.Tensor, group: dist.ProcessGroup | str | None = None, **config
) -> torch.Tensor:
    """``sum over ranks of x`` + ``bias``; a new tensor of ``x``'s shape and dtype (``x`` is unchanged).

    Arguments as ``one_shot_all_reduce_bias``; the sharded reduction moves less
    data over NVLink for larger messages. Bitwise identical on every rank.
    """
    op = "two_shot_all_reduce_bias"
    return staged_call(launch, op, x, (bias,), signature(x, bias, group, op, config))
