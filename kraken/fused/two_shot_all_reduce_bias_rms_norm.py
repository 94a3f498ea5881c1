"""Two-shot all-reduce + bias + RMSNorm: each rank reduces and normalises a shard of rows.

    h = sum_r x_r + bias
    y = h * rsqrt(mean(h^2) + eps) * weight          (per row, all in fp32)

``two_shot_all_reduce_bias`` with RMSNorm folded in, so the shards must hold
whole rows: rank ``r`` owns rows ``[r * shard, (r + 1) * shard)`` with
``shard = cdiv(tokens, world_size)``, reduces them from every peer, normalises
them and pushes the finished rows to every rank. Only the owner computes a row,
so every rank holds the same bits.

With fewer tokens than ranks (a single decode token, say) the last ranks own no
rows: they still stage, take part in both barriers and gather, but reduce
nothing, and the call costs about what one-shot does plus one push. Splitting a
row across ranks would need a third barrier round to combine partial sums of
squares, which is a worse trade at these sizes.

Same five steps, workspace layout ([staged x | result]) and barrier reasoning
as ``two_shot_all_reduce_bias``, in units of rows.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import triton
import triton.language as tl

from kraken._blocks import block_range, copy_slice, rms_normalize, sum_peers
from kraken._ptx_utils import symm_mem_sync
from kraken.comm.two_shot_all_reduce import DEFAULT_CONFIG as TWO_SHOT_CONFIG
from kraken.fused.one_shot_all_reduce_bias import NORM_KEY, on_signature, staged_call, staged_signature
from kraken.fused.rms_norm import row_warps
from kraken.fused.two_shot_all_reduce_bias import WORKSPACE_COPIES
from kraken.runtime import groups, prepared
from kraken.runtime.launcher import jit_launch

# Not tuned on its own: the tuned two-shot all-reduce's grid cap; num_warps None: from the row width
# (rms_norm.row_warps: at most one 16-byte vector per thread, so a row's loads go out together).
DEFAULT_CONFIG = {"num_warps": None, "max_blocks": TWO_SHOT_CONFIG["max_blocks"]}


# Row counts are not specialized: one binary per (dtype, hidden) serves every token count, and
# alignment comes from `hidden` alone.
@triton.jit(do_not_specialize=["tokens", "shard", "chunk"])
def two_shot_all_reduce_bias_rms_norm_kernel(
    x_ptr,
    bias_ptr,
    weight_ptr,
    workspace_ptr,  # this rank's workspace (= peers[rank]): [staged x | result]
    peers,  # tuple of world_size pointers, peers[r] = rank r's workspace
    out_ptr,
    signal_pad_ptrs,
    tokens,
    hidden,
    shard,  # rows per rank
    chunk,  # rows per block within a shard
    eps,
    rank,
    world_size: tl.constexpr,
    BLOCK_H: tl.constexpr,  # next_power_of_2(hidden): one row per tile
):
    block_id = tl.program_id(0)
    result_offset = tokens * hidden  # where the result region starts in every workspace
    for owner in tl.static_range(world_size):
        row_start, row_end = block_range(owner, block_id, shard, chunk, tokens)
        copy_slice(x_ptr, workspace_ptr, row_start * hidden, row_end * hidden, BLOCK_H)
    # The same for every row, and not written by peers: loaded once, while the barrier waits.
    cols = tl.arange(0, BLOCK_H)
    mask = cols < hidden
    bias = tl.load(bias_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    # Release: my staged rows are visible to their owners. Acquire: peers' rows of my shard are visible to me.
    symm_mem_sync(signal_pad_ptrs, block_id, rank, world_size, hasPreviousMemAccess=True, hasSubsequentMemAccess=True)
    row_start, row_end = block_range(rank, block_id, shard, chunk, tokens)
    for row in tl.range(row_start, row_end):
        offsets = row * hidden + cols
        h = sum_peers(peers, offsets, mask, world_size) + bias
        y = rms_normalize(h, weight, eps, hidden).to(out_ptr.dtype.element_ty)
        for r in tl.static_range(world_size):
            tl.store(peers[r] + result_offset + offsets, y, mask=mask)
    # Release: my pushed rows are visible to every rank. Acquire: every owner's rows are visible to me.
    symm_mem_sync(signal_pad_ptrs, block_id, rank, world_size, hasPreviousMemAccess=True, hasSubsequentMemAccess=True)
    for owner in tl.static_range(world_size):
        row_start, row_end = block_range(owner, block_id, shard, chunk, tokens)
        copy_slice(workspace_ptr + result_offset, out_ptr, row_start * hidden, row_end * hidden, BLOCK_H)


def plan(tokens: int, hidden: int, world_size: int, config: dict) -> dict:
    """Resolve the launch configuration (shared with the Helion port)."""
    cfg = groups.resolve_config(config, DEFAULT_CONFIG, "two_shot_all_reduce_bias_rms_norm")
    shard = max(1, groups.cdiv(tokens, world_size))
    num_blocks = groups.persistent_grid(shard, cfg["max_blocks"], world_size)
    chunk = groups.cdiv(shard, num_blocks)
    num_blocks = groups.cdiv(shard, chunk)  # no block left without rows
    num_warps = cfg["num_warps"] or row_warps(hidden)
    return {"num_warps": num_warps, "num_blocks": num_blocks, "shard": shard, "chunk": chunk}


@prepared.per_signature(NORM_KEY)
def signature(x: torch.Tensor, bias: torch.Tensor, weight: torch.Tensor, eps: float, group, op: str, config: dict
              ) -> tuple:
    """This call signature's preparation (``staged_signature``), kept per signature; shared with the twin."""
    return staged_signature(op, x, {"bias": bias, "weight": weight}, eps, group, config, plan, WORKSPACE_COPIES)


def prepare(x: torch.Tensor, bias: torch.Tensor, weight: torch.Tensor, eps: float, group, op: str, config: dict):
    """(``x`` as [tokens, hidden], the workspace's symmetric context, the launch configuration)."""
    return on_signature(op, x, signature(x, bias, weight, eps, group, op, config))


def launch(
    x: torch.Tensor,
    bias: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    peers: tuple[torch.Tensor, ...],
    out: torch.Tensor,
    signal_pad_ptrs: int,
    rank: int,
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
    tokens, hidden = x.shape
    launcher(
        two_shot_all_reduce_bias_rms_norm_kernel, (num_blocks,),
        x, bias, weight, peers[rank], peers, out, signal_pad_ptrs, tokens, hidden, shard, chunk, float(eps),
        rank, len(peers), BLOCK_H=groups.next_power_of_2(hidden), num_warps=num_warps,
    )
    return out


def two_shot_all_reduce_bias_rms_norm(
    x: torch.Tensor,
    bias: torch.Tensor,
    weight: torch.Tensor,
    eps: float = 1e-5,
    group: dist.ProcessGroup | str | None = None,
    **config,
) -> torch.Tensor:
    """RMSNorm(``sum over ranks of x`` + ``bias``) * ``weight``, rows sharded over ranks; a new tensor.

    Arguments as ``one_shot_all_reduce_bias_rms_norm``. Bitwise identical on every rank.
    """
    op = "two_shot_all_reduce_bias_rms_norm"
    return staged_call(launch, op, x, (bias, weight, eps), signature(x, bias, weight, eps, group, op, config))
