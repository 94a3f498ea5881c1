"""One-shot all-reduce + bias: ``out = sum_r x_r + bias``, in one launch.

The epilogue of a tensor-parallel row-parallel linear layer, where ``x`` is the
rank's partial product ([tokens, hidden]) and ``bias`` is replicated. In a
decode step the message is a few KB to a few MB, so launch count and barrier
rounds dominate, not bandwidth: everything below happens in one kernel with two
barrier rounds, the same as the bare one-shot all-reduce.

``x`` may be any contiguous CUDA tensor. The kernel stages it through kraken's
shared symmetric workspace (``host.symm_workspace``) itself, before its first
barrier, so there is no separate copy launch. It always copies, even when ``x``
already lives in symmetric memory: finding out would take a rendezvous (a
collective) per new tensor, and the copy is one local read and write of the
message, well under a microsecond up to about a megabyte. ``x`` may even be the
workspace itself (the copy is then in place); a view overlapping it anywhere
else is refused.

A persistent grid of ``num_blocks`` blocks cuts the flattened message into
contiguous chunks; block ``b`` of every rank handles chunk ``b`` and barrier
slot ``b``:

1. copy chunk ``b`` of ``x`` into the workspace;
2. barrier (release + acquire): "my chunk is visible to you", "yours to me";
3. sum chunk ``b`` over every peer's workspace in rank order (fp32, so every
   rank computes the same bits), add ``bias`` (column = offset % hidden), store;
4. barrier (release): "done reading your workspace", so the next call may
   overwrite it.

This module also holds what the distributed members of the family share:
``prepare_staged`` (validation, workspace, plan) and the device helpers
``copy_slice`` (the plain collectives' staging copy, from ``kraken.comm.one_shot_all_reduce``) and
``sum_peers``.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist
import triton
import triton.language as tl

from kraken import host
from kraken._ptx_utils import symm_mem_sync
from kraken.comm.one_shot_all_reduce import DEFAULT_CONFIG as ONE_SHOT_CONFIG, copy_slice  # the family stages with it
from kraken.fused.rms_norm import NO_EPS, check_inputs

# Not tuned on its own: the tuned one-shot all-reduce's configuration (same loop plus a staging copy).
DEFAULT_CONFIG = dict(ONE_SHOT_CONFIG)


# ---------------------------------------------------------------------------
# Device helpers shared by the family
# ---------------------------------------------------------------------------


@triton.jit
def sum_peers(peers, offsets, mask, world_size: tl.constexpr):
    """``sum_r peers[r][offsets]`` in fp32, in rank order: every rank gets the same bits (0 where masked)."""
    acc = tl.load(peers[0] + offsets, mask=mask, other=0.0).to(tl.float32)
    for r in tl.static_range(1, world_size):
        acc += tl.load(peers[r] + offsets, mask=mask, other=0.0).to(tl.float32)
    return acc


@triton.jit
def one_shot_all_reduce_bias_kernel(
    x_ptr,
    bias_ptr,
    workspace_ptr,  # this rank's workspace (= peers[rank])
    peers,  # tuple of world_size pointers, peers[r] = rank r's workspace
    out_ptr,
    signal_pad_ptrs,
    numel,
    hidden,
    chunk,  # elements per block, a multiple of BLOCK_SIZE
    rank,
    world_size: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
):
    block_id = tl.program_id(0)
    start = block_id * chunk
    end = tl.minimum(start + chunk, numel)
    copy_slice(x_ptr, workspace_ptr, start, end, BLOCK_SIZE)
    # Release: my staged chunk is visible to peers. Acquire: theirs is visible to me.
    symm_mem_sync(signal_pad_ptrs, block_id, rank, world_size, hasPreviousMemAccess=True, hasSubsequentMemAccess=True)
    for offset in tl.range(start, end, BLOCK_SIZE):
        offsets = offset + tl.arange(0, BLOCK_SIZE)
        mask = offsets < end
        acc = sum_peers(peers, offsets, mask, world_size)
        acc += tl.load(bias_ptr + offsets % hidden, mask=mask, other=0.0).to(tl.float32)
        tl.store(out_ptr + offsets, acc.to(out_ptr.dtype.element_ty), mask=mask)
    # Done reading peers' workspaces: after this they may restage into them.
    symm_mem_sync(signal_pad_ptrs, block_id, rank, world_size, hasPreviousMemAccess=True, hasSubsequentMemAccess=False)


# ---------------------------------------------------------------------------
# Host
# ---------------------------------------------------------------------------


def _check_not_aliased(x: torch.Tensor, workspace: torch.Tensor, op: str) -> None:
    """Staging ``x`` into the workspace is safe in place, never into a shifted overlap."""
    x_start, w_start = x.data_ptr(), workspace.data_ptr()
    x_end = x_start + x.numel() * x.element_size()
    w_end = w_start + workspace.numel() * workspace.element_size()
    if x_start != w_start and x_start < w_end and w_start < x_end:
        raise ValueError(
            f"{op}: x overlaps kraken's shared symmetric workspace at another offset, which the kernel "
            "overwrites while staging; pass a separate tensor (or the workspace view itself)"
        )


def prepare_staged(
    op: str,
    x: torch.Tensor,
    vectors: dict[str, torch.Tensor],
    eps: object,
    group,
    config: dict,
    plan: Callable[[int, int, int, dict], dict],
    copies: int = 1,
) -> tuple[torch.Tensor, host.SymmContext, dict]:
    """Shared by the family: validate, flatten ``x`` to [tokens, hidden], get the workspace, plan.

    ``vectors`` are the [hidden] arguments (bias, weight); ``eps`` is
    ``rms_norm.NO_EPS`` for ops without one. The workspace holds ``copies``
    message-sized regions (two-shot kernels keep their results apart from the
    staged input). Returns ``x`` as a 2-D view, the workspace's symmetric
    context and the launch configuration. All but the view and the aliasing
    check (they depend on ``x``'s address) is kept per signature.
    """
    hidden, ctx, launch_cfg = staged_signature(op, x, vectors, eps, group, config, plan, copies)
    _check_not_aliased(x, ctx.peers[ctx.rank], op)
    return (x if x.dim() == 2 else x.view(-1, hidden)), ctx, launch_cfg  # a view costs ~1 us


@host.per_signature(lambda op, x, vectors, eps, group, config, plan, copies: (
    op, group, host.tensor_key(x), *map(host.tensor_key, vectors.values()), host.scalar_key(eps), plan, copies,
    host.config_key(config)))
def staged_signature(op, x, vectors, eps, group, config, plan, copies) -> tuple[int, host.SymmContext, dict]:
    """``prepare_staged``'s work that depends only on the signature: checks, agreement, plan, workspace."""
    with host.agreed(op, group, x=x, eps=eps, config=config, **vectors):  # every rank raises if any rank's input is bad
        hidden = check_inputs(op, x, vectors, eps)
        world_size = host.world_size_of(group, op)
        launch_cfg = plan(x.numel() // hidden, hidden, world_size, config)
        host.check_barrier_blocks(launch_cfg["num_blocks"], world_size, op)
    workspace = host.symm_workspace(max(copies * x.numel(), 1), x.dtype, x.device, group, op)
    ctx = host.symm_context(workspace, group, op, name="workspace")
    return hidden, ctx, {**launch_cfg, "launcher": host.Launcher(op)}


def plan(tokens: int, hidden: int, world_size: int, config: dict) -> dict:
    """Resolve the launch configuration (shared with the Helion port)."""
    cfg = host.resolve_config(config, DEFAULT_CONFIG, "one_shot_all_reduce_bias")
    numel, block_size = tokens * hidden, cfg["block_size"]
    num_blocks = host.persistent_grid(host.cdiv(numel, block_size), cfg["max_blocks"], world_size)
    chunk = host.round_up(host.cdiv(numel, num_blocks), block_size)
    return {"block_size": block_size, "num_warps": cfg["num_warps"], "num_blocks": num_blocks, "chunk": chunk}


def prepare(x: torch.Tensor, bias: torch.Tensor, group, op: str, config: dict):
    return prepare_staged(op, x, {"bias": bias}, NO_EPS, group, config, plan)


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
    chunk: int,
    group_name: str = "",
    launcher=host.jit_launch,
) -> torch.Tensor:
    """Launch on prepared arguments (no checks); the same signature as the Helion port's ``launch``.

    ``x``, ``out``: [tokens, hidden]; ``peers``: every rank's workspace
    (``tokens * hidden`` elements). ``group_name`` is unused here; Helion takes
    it as its ``hl.ProcessGroupName``.
    """
    launcher(
        one_shot_all_reduce_bias_kernel, (num_blocks,),
        x, bias, peers[rank], peers, out, signal_pad_ptrs, x.numel(), x.shape[1], chunk, rank, len(peers),
        BLOCK_SIZE=block_size, num_warps=num_warps,
    )
    return out


def one_shot_all_reduce_bias(
    x: torch.Tensor, bias: torch.Tensor, group: dist.ProcessGroup | str | None = None, **config
) -> torch.Tensor:
    """``sum over ranks of x`` + ``bias``; a new tensor of ``x``'s shape and dtype (``x`` is unchanged).

    ``x``: [..., hidden], contiguous, bf16/fp16/fp32, any CUDA tensor (staged
    through the symmetric workspace inside the kernel); ``bias``: [hidden] of
    ``x``'s dtype, the same on every rank. Bitwise identical on every rank.
    ``config`` overrides ``DEFAULT_CONFIG``.
    """
    x2d, ctx, launch_cfg = prepare(x, bias, group, "one_shot_all_reduce_bias", config)
    out = torch.empty_like(x2d)
    launch(x2d, bias, ctx.peers, out, ctx.signal_pad_ptrs, ctx.rank, **launch_cfg, group_name=ctx.group_name)
    return out if x.dim() == 2 else out.view(x.shape)
