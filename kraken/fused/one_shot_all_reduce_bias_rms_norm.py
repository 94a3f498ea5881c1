"""One-shot all-reduce + bias + RMSNorm: the fusion after every tensor-parallel linear layer.

    h = sum_r x_r + bias
    y = h * rsqrt(mean(h^2) + eps) * weight          (per row, all in fp32)

Same shape as ``one_shot_all_reduce_bias`` (staging, two barrier rounds, rank-
order sums), but the unit of work is a whole row: RMSNorm needs the row's sum of
squares, so each row is reduced as one ``next_power_of_2(hidden)`` register tile
and normalised on the spot, with no second pass over memory and no extra launch.

Block ``b`` of every rank owns ``rows_per_block`` consecutive rows and barrier
slot ``b``:

1. copy its rows of ``x`` into the symmetric workspace, and load ``bias`` and
   ``weight`` (once: they are the same for every row);
2. barrier (release + acquire): staged rows are visible both ways;
3. for each row: sum the peers' rows (rank order, fp32), add ``bias``,
   normalise (``kraken._blocks.rms_normalize``), store the local output;
4. barrier (release): "done reading your workspace".

The row is spread so that no thread holds more than one 16-byte vector of it
(``rms_norm.row_warps``): at world size 2 a row costs one NVLink round trip,
both peers' loads in flight together.

Every rank computes every row itself, so the results are bitwise identical on
all ranks. Staging: see ``one_shot_all_reduce_bias`` (``x`` is always copied).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import triton
import triton.language as tl

from kraken._blocks import copy_slice, rms_normalize, sum_peers
from kraken._ptx_utils import symm_mem_sync
from kraken.comm.one_shot_all_reduce import DEFAULT_CONFIG as ONE_SHOT_CONFIG
from kraken.fused.one_shot_all_reduce_bias import NORM_KEY, WORKSPACE_COPIES, on_signature, staged_call, staged_signature
from kraken.fused.rms_norm import row_warps
from kraken.runtime import groups, prepared
from kraken.runtime.launcher import jit_launch

# Not tuned on its own: the tuned one-shot all-reduce's grid cap; num_warps None: from the row width
# (rms_norm.row_warps: at most one 16-byte vector per thread, so a row's loads go out together).
DEFAULT_CONFIG = {"num_warps": None, "max_blocks": ONE_SHOT_CONFIG["max_blocks"]}


# Row counts are not specialized: one binary per (dtype, hidden) serves every token count, and
# alignment comes from `hidden` alone.
@triton.jit(do_not_specialize=["tokens", "rows_per_block"])
def one_shot_all_reduce_bias_rms_norm_kernel(
    x_ptr,
    bias_ptr,
    weight_ptr,
    workspace_ptr,  # this rank's workspace (= peers[rank])
    peers,  # tuple of world_size pointers, peers[r] = rank r's workspace
    out_ptr,
    signal_pad_ptrs,
    tokens,
    hidden,
    rows_per_block,
    eps,
    rank,
    world_size: tl.constexpr,
    BLOCK_H: tl.constexpr,  # next_power_of_2(hidden): one row per tile
):
    block_id = tl.program_id(0)
    row_start = block_id * rows_per_block
    row_end = tl.minimum(row_start + rows_per_block, tokens)
    copy_slice(x_ptr, workspace_ptr, row_start * hidden, row_end * hidden, BLOCK_H)
    # The same for every row, and not written by peers: loaded once, while the barrier waits.
    cols = tl.arange(0, BLOCK_H)
    mask = cols < hidden
    bias = tl.load(bias_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    # Release: my staged rows are visible to peers. Acquire: theirs are visible to me.
    symm_mem_sync(signal_pad_ptrs, block_id, rank, world_size, hasPreviousMemAccess=True, hasSubsequentMemAccess=True)
    for row in tl.range(row_start, row_end):
        offsets = row * hidden + cols
        h = sum_peers(peers, offsets, mask, world_size) + bias
        y = rms_normalize(h, weight, eps, hidden)
        tl.store(out_ptr + offsets, y.to(out_ptr.dtype.element_ty), mask=mask)
    # Done reading peers' workspaces: after this they may restage into them.
    symm_mem_sync(signal_pad_ptrs, block_id, rank, world_size, hasPreviousMemAccess=True, hasSubsequentMemAccess=False)


def plan(tokens: int, hidden: int, world_size: int, config: dict) -> dict:
    """Resolve the launch configuration (shared with the Helion port)."""
    cfg = groups.resolve_config(config, DEFAULT_CONFIG, "one_shot_all_reduce_bias_rms_norm")
    num_blocks = groups.persistent_grid(tokens, cfg["max_blocks"], world_size)
    rows_per_block = max(1, groups.cdiv(tokens, num_blocks))
    num_blocks = max(1, groups.cdiv(tokens, rows_per_block))  # no block left without rows
    num_warps = cfg["num_warps"] or row_warps(hidden)
    return {"num_warps": num_warps, "num_blocks": num_blocks, "rows_per_block": rows_per_block}


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
    rows_per_block: int,
    group_name: str = "",
    launcher=jit_launch,
) -> torch.Tensor:
    """Launch on prepared arguments (no checks); the same signature as the Helion port's ``launch``.

    ``x``, ``out``: [tokens, hidden]; ``peers``: every rank's workspace
    (``tokens * hidden`` elements). ``group_name`` is unused here.
    """
    tokens, hidden = x.shape
    launcher(
        one_shot_all_reduce_bias_rms_norm_kernel, (num_blocks,),
        x, bias, weight, peers[rank], peers, out, signal_pad_ptrs, tokens, hidden, rows_per_block, float(eps),
        rank, len(peers), BLOCK_H=groups.next_power_of_2(hidden), num_warps=num_warps,
    )
    return out


def one_shot_all_reduce_bias_rms_norm(
    x: torch.Tensor,
    bias: torch.Tensor,
    weight: torch.Tensor,
    eps: float = 1e-5,
    group: dist.ProcessGroup | str | None = None,
    **config,
) -> torch.Tensor:
    """RMSNorm(``sum over ranks of x`` + ``bias``) * ``weight``; a new tensor of ``x``'s shape and dtype.

    ``x``: [..., hidden], contiguous, bf16/fp16/fp32, any CUDA tensor (staged
    through the symmetric workspace inside the kernel); ``bias``, ``weight``:
    [hidden] of ``x``'s dtype, the same on every rank. Bitwise identical on
    every rank. ``config`` overrides ``DEFAULT_CONFIG``.
    """
    op = "one_shot_all_reduce_bias_rms_norm"
    return staged_call(launch, op, x, (bias, weight, eps), signature(x, bias, weight, eps, group, op, config))
