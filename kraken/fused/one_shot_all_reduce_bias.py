"""One-shot all-reduce + bias: ``out = sum_r x_r + bias``, in one launch.

The epilogue of a tensor-parallel row-parallel linear layer, where ``x`` is the
rank's partial product ([tokens, hidden]) and ``bias`` is replicated. In a
decode step the message is a few KB to a few MB, so launch count and barrier
rounds dominate, not bandwidth: everything below happens in one kernel with two
barrier rounds, the same as the bare one-shot all-reduce.

``x`` may be any contiguous CUDA tensor. The kernel stages it through kraken's
shared symmetric workspace (``symm.symm_workspace``) itself, before its first
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

This module also holds what the distributed members of the family share: ``staged_signature``
(validation, agreement, plan, workspace; each member's ``signature`` keeps it per signature), ``staged_call``
(a call on it) and ``door_call`` (the front doors' call); its device helpers (``copy_slice``, the staging copy,
and ``sum_peers``) are ``kraken._blocks``'.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist
import triton
import triton.language as tl

from kraken._blocks import copy_slice, sum_peers
from kraken._ptx_utils import symm_mem_sync
from kraken.comm.one_shot_all_reduce import DEFAULT_CONFIG as ONE_SHOT_CONFIG
from kraken.fused.rms_norm import NO_EPS, check_inputs
from kraken.runtime import agreement, crossover, groups, prepared, symm
from kraken.runtime.launcher import Launcher, jit_launch
from kraken.runtime.replay import prepared_launch

# Not tuned on its own: the tuned one-shot all-reduce's configuration (same loop plus a staging copy).
DEFAULT_CONFIG = dict(ONE_SHOT_CONFIG)
WORKSPACE_COPIES = 1  # the staged input


# ---------------------------------------------------------------------------
# Device helpers shared by the family
# ---------------------------------------------------------------------------


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
    x_start, w_start = x.data_ptr(), workspace.data_ptr()  # (both contiguous: checked)
    if x_start != w_start and x_start < w_start + workspace.nbytes and w_start < x_start + x.nbytes:
        raise ValueError(
            f"{op}: x overlaps kraken's shared symmetric workspace at another offset, which the kernel "
            "overwrites while staging; pass a separate tensor (or the workspace view itself)"
        )


def on_signature(op: str, x: torch.Tensor, prepared: tuple) -> tuple[torch.Tensor, symm.SymmContext, dict]:
    """What a family member's call adds to its signature's preparation (``prepared``: ``staged_signature``'s):
    the aliasing check (it depends on ``x``'s address) and ``x`` as [tokens, hidden]. Returns the view, the
    workspace's symmetric context and the launch configuration."""
    hidden, ctx, launch_cfg = prepared
    _check_not_aliased(x, ctx.peers[ctx.rank], op)
    return (x if x.dim() == 2 else x.view(-1, hidden)), ctx, launch_cfg  # a view costs ~1 us


def staged_call(launch: Callable, op: str, x: torch.Tensor, operands: tuple, prepared: tuple) -> torch.Tensor:
    """A family member's call (a recipe's, a twin's, a front door's) on its signature's preparation: a new output
    of ``x``'s shape, ``launch(x, *operands, peers, out, ...)`` (``operands``: bias, or bias, weight and eps),
    replayed from the second call of the signature on (``replayed``)."""
    x2d, ctx, launch_cfg = on_signature(op, x, prepared)
    out = prepared_launch(launch, (x2d, *operands), ctx, launch_cfg, torch.empty_like(x2d))
    return out if x.dim() == 2 else out.view(x.shape)


# ``prepared.per_signature``'s keys of the members' ``signature(x, bias, group, op, config)`` and of the RMSNorm ones'
# ``signature(x, bias, weight, eps, group, op, config)``.
BIAS_KEY = lambda x, bias, group, op, config: (  # noqa: E731
    op, group, prepared.tensor_key(x), prepared.tensor_key(bias), prepared.config_key(config))
NORM_KEY = lambda x, bias, weight, eps, group, op, config: (  # noqa: E731
    op, group, prepared.tensor_key(x), prepared.tensor_key(bias), prepared.tensor_key(weight), prepared.scalar_key(eps),
    prepared.config_key(config))


def door_call(op: str, name: str, recipes: tuple, choose: Callable, x: torch.Tensor, operands: tuple, group,
              config: dict) -> torch.Tensor:
    """A front door of the family (``all_reduce_bias``, ``all_reduce_bias_rms_norm``, their twins; ``name``: the
    op its errors name) over ``recipes``, its (one-shot, two-shot) modules. In eager: ``choose``'s (choice,
    preparation) for the call signature, then the chosen one's launch. While Dynamo traces: the chosen one's
    operator (``crossover.traced_call``)."""
    if torch.compiler.is_dynamo_compiling():
        return crossover.traced_call(op, recipes, x, operands, group, config)
    shot, prepared = choose(x, *operands, group, config)
    return staged_call((recipes[0] if shot == crossover.ONE else recipes[1]).launch, name, x, operands, prepared)


def staged_signature(op, x, vectors, eps, group, config, plan, copies) -> tuple[int, symm.SymmContext, dict]:
    """Shared by the family: what a call signature needs (each member's ``signature`` keeps it per signature,
    ``prepared.per_signature``). Validate, agree, plan, and get the workspace. ``vectors`` are the [hidden]
    arguments (bias, weight); ``eps`` is ``rms_norm.NO_EPS`` for ops without one. The workspace holds ``copies``
    message-sized regions (two-shot kernels keep their results apart from the staged input). Returns (hidden,
    the workspace's symmetric context, the launch configuration)."""
    # every rank raises if any rank's input is bad
    with agreement.agreed(op, group, x=x, eps=eps, config=config, **vectors):
        hidden = check_inputs(op, x, vectors, eps)
        world_size = groups.world_size_of(group, op)
        launch_cfg = plan(x.numel() // hidden, hidden, world_size, config)
        groups.check_barrier_blocks(launch_cfg["num_blocks"], world_size, op)
    return staged_workspace(op, x, hidden, group, launch_cfg, copies)


def staged_workspace(op: str, x: torch.Tensor, hidden: int, group, launch_cfg: dict, copies: int) -> tuple:
    """A signature's preparation after its checks, agreement and plan (``launch_cfg``): the workspace of ``copies``
    message-sized regions, its symmetric context and a launcher. Returns (hidden, context, launch configuration)."""
    workspace = symm.symm_workspace(max(copies * x.numel(), 1), x.dtype, x.device, group, op)
    ctx = symm.symm_context(workspace, group, op, name="workspace")
    return hidden, ctx, {**launch_cfg, "launcher": Launcher(op)}


def plan(tokens: int, hidden: int, world_size: int, config: dict) -> dict:
    """Resolve the launch configuration (shared with the Helion port)."""
    cfg = groups.resolve_config(config, DEFAULT_CONFIG, "one_shot_all_reduce_bias")
    numel, block_size = tokens * hidden, cfg["block_size"]
    num_blocks = groups.persistent_grid(groups.cdiv(numel, block_size), cfg["max_blocks"], world_size)
    chunk = groups.round_up(groups.cdiv(numel, num_blocks), block_size)
    return {"block_size": block_size, "num_warps": cfg["num_warps"], "num_blocks": num_blocks, "chunk": chunk}


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
    chunk: int,
    group_name: str = "",
    launcher=jit_launch,
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
    op = "one_shot_all_reduce_bias"
    return staged_call(launch, op, x, (bias,), signature(x, bias, group, op, config))
