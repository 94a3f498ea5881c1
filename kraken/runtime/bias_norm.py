"""The all-reduce + bias (+ RMSNorm) family's product layer, wrapped around its recipes from outside.

A recipe file (``kraken/fused/<name>.py``) holds the kernel, its pure ``plan``, its ``launch`` seam and a plain host
function. What the installed package adds lives here (the front doors that choose one-shot or two-shot:
``kraken.runtime.bias_doors``):

* the checks of a call's arguments (``check_inputs``): everything that needs no GPU (shapes, dtypes, ``eps``) before
  anything that does, so a bad argument names itself on any machine;
* ``rms_norm``'s prepared call per signature (checked and planned once, with its cached ``Launcher``);
* the distributed members' preparation per call signature (``staged_signature``): checks agreed across ranks
  (``agreement.agreed``: one rank's bad input raises on every rank), the recipe's plan, kraken's shared symmetric
  workspace (``symm.symm_workspace``: ``WORKSPACE_COPIES`` message-sized regions) and a launcher; and the call on it
  (``staged_call``): the aliasing check, a new output, the recipe's ``launch`` replayed from the signature's second
  call on (``prepared_launch``);
* the public functions, each a factory over a ``launch`` (``one_shot_all_reduce_bias_with`` and the like): the
  recipe's (``kraken.<name>``) or its Helion twin's (``helion_ports.<name>``, ``kraken.runtime.twins``). A twin's
  signatures are kept in the same caches, under its own op name ("helion <name>").
"""

from __future__ import annotations

import importlib
import math
from typing import Callable

import torch
import torch.distributed as dist

from kraken.runtime import agreement, groups, prepared, symm
from kraken.runtime.launcher import Launcher
from kraken.runtime.replay import prepared_launch

# The recipes' modules: their ``plan`` called through them (tests replace it there), their ``launch`` by name.
RMS_NORM = importlib.import_module("kraken.fused.rms_norm")
ONE_SHOT_BIAS = importlib.import_module("kraken.fused.one_shot_all_reduce_bias")
ONE_SHOT_NORM = importlib.import_module("kraken.fused.one_shot_all_reduce_bias_rms_norm")
TWO_SHOT_BIAS = importlib.import_module("kraken.fused.two_shot_all_reduce_bias")
TWO_SHOT_NORM = importlib.import_module("kraken.fused.two_shot_all_reduce_bias_rms_norm")

MAX_HIDDEN = 16384  # a row is one register tile; wider rows would spill
MAX_NUMEL = 1 << 30  # offsets are int32 and two-shot staging holds two copies of x
NO_EPS = object()  # check_inputs: the op takes no eps


# ---------------------------------------------------------------------------
# Checks
# ---------------------------------------------------------------------------


def check_eps(eps: object, op: str) -> None:
    if isinstance(eps, bool) or not isinstance(eps, (int, float)):
        raise TypeError(f"{op}: eps must be a float, got {type(eps).__name__}")
    if not math.isfinite(eps) or eps < 0:
        raise ValueError(f"{op}: eps must be a finite number >= 0, got {eps}")


def check_inputs(op: str, x: object, vectors: dict[str, object], eps: object = NO_EPS) -> int:
    """Validate ``x`` ([..., hidden]), the per-column ``vectors`` (bias, weight) and ``eps``; returns hidden.

    Shapes, dtypes and ``eps`` are checked before devices, so these errors are
    raised the same way on a machine without a GPU.
    """
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{op}: x must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in groups.SUPPORTED_DTYPES:
        groups.check_tensor(x, "x", op)  # words the dtype error (its first failing check)
    if x.dim() == 0 or x.shape[-1] == 0:
        raise ValueError(f"{op}: x must be [tokens, hidden] (any leading shape) with hidden >= 1, got {tuple(x.shape)}")
    hidden = x.shape[-1]
    if hidden > MAX_HIDDEN:
        raise ValueError(f"{op}: hidden size {hidden} is above {MAX_HIDDEN} (a row must fit one register tile)")
    if x.numel() > MAX_NUMEL:
        raise ValueError(f"{op}: x has {x.numel()} elements, above {MAX_NUMEL} (int32 offsets)")
    for name, vector in vectors.items():
        if not isinstance(vector, torch.Tensor):
            raise TypeError(f"{op}: {name} must be a torch.Tensor, got {type(vector).__name__}")
        if tuple(vector.shape) != (hidden,):
            raise ValueError(
                f"{op}: {name} must have shape ({hidden},), one value per column of x, got {tuple(vector.shape)}"
            )
        if vector.dtype != x.dtype:
            raise ValueError(
                f"{op}: {name} has dtype {str(vector.dtype).removeprefix('torch.')} but x has "
                f"{str(x.dtype).removeprefix('torch.')}; pass {name}.to(x.dtype)"
            )
    if eps is not NO_EPS:
        check_eps(eps, op)
    groups.check_tensor(x, "x", op)
    for name, vector in vectors.items():
        groups.check_tensor(vector, name, op)
        if vector.device != x.device:
            raise ValueError(f"{op}: {name} is on {vector.device} but x is on {x.device}")
    return hidden


# ---------------------------------------------------------------------------
# rms_norm (one GPU)
# ---------------------------------------------------------------------------


def prepare_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, op: str, config: dict
                     ) -> tuple[torch.Tensor, dict]:
    """``x`` as [tokens, hidden] and the launch configuration with its launcher (checked and planned once per
    signature)."""
    hidden, launch_cfg = checked_rms_norm_plan(x, weight, eps, op, config)
    return (x if x.dim() == 2 else x.view(-1, hidden)), launch_cfg  # a view costs ~1 us


@prepared.per_signature(lambda x, weight, eps, op, config: (
    op, prepared.tensor_key(x), prepared.tensor_key(weight), prepared.scalar_key(eps), prepared.config_key(config)))
def checked_rms_norm_plan(x: torch.Tensor, weight: torch.Tensor, eps: float, op: str, config: dict
                          ) -> tuple[int, dict]:
    hidden = check_inputs(op, x, {"weight": weight}, eps)
    return hidden, {**RMS_NORM.plan(x.numel() // hidden, hidden, config), "launcher": Launcher(op)}


def rms_norm_with(launch: Callable, op: str) -> Callable:
    """The installed RMSNorm, driving ``launch``: the recipe's (``kraken.rms_norm``) or its twin's."""

    def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-5, **config) -> torch.Tensor:
        """RMSNorm over the last dimension of ``x``; returns a new tensor of ``x``'s shape and dtype.

        ``x``: [..., hidden], contiguous, bf16/fp16/fp32, on one GPU; ``weight``: [hidden] of ``x``'s dtype.
        Statistics in fp32. ``config`` overrides ``kraken.fused.rms_norm.DEFAULT_CONFIG``.
        """
        x2d, launch_cfg = prepare_rms_norm(x, weight, eps, op, config)
        out = torch.empty_like(x2d)
        return launch(x2d, weight, out, eps, **launch_cfg).view(x.shape)

    return rms_norm


# ---------------------------------------------------------------------------
# The distributed members: a preparation per call signature, a call on it
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
    """What a call adds to its signature's preparation (``prepared``: ``staged_signature``'s): the aliasing check
    (it depends on ``x``'s address) and ``x`` as [tokens, hidden]. Returns the view, the workspace's symmetric
    context and the launch configuration."""
    hidden, ctx, launch_cfg = prepared
    _check_not_aliased(x, ctx.peers[ctx.rank], op)
    return (x if x.dim() == 2 else x.view(-1, hidden)), ctx, launch_cfg  # a view costs ~1 us


def staged_call(launch: Callable, op: str, x: torch.Tensor, operands: tuple, prepared: tuple) -> torch.Tensor:
    """A call (a recipe's, a twin's, a front door's) on its signature's preparation: a new output of ``x``'s shape,
    ``launch(x, *operands, peers, out, ...)`` (``operands``: bias, or bias, weight and eps), replayed from the second
    call of the signature on (``prepared_launch``)."""
    x2d, ctx, launch_cfg = on_signature(op, x, prepared)
    out = prepared_launch(launch, (x2d, *operands), ctx, launch_cfg, torch.empty_like(x2d))
    return out if x.dim() == 2 else out.view(x.shape)


# ``prepared.per_signature``'s keys of ``signature(x, bias, group, op, config)`` and of the RMSNorm members'
# ``signature(x, bias, weight, eps, group, op, config)``.
BIAS_KEY = lambda x, bias, group, op, config: (  # noqa: E731
    op, group, prepared.tensor_key(x), prepared.tensor_key(bias), prepared.config_key(config))
NORM_KEY = lambda x, bias, weight, eps, group, op, config: (  # noqa: E731
    op, group, prepared.tensor_key(x), prepared.tensor_key(bias), prepared.tensor_key(weight), prepared.scalar_key(eps),
    prepared.config_key(config))


def staged_signature(op, x, vectors, eps, group, config, recipe) -> tuple[int, symm.SymmContext, dict]:
    """What a call signature of ``recipe`` (its module) needs, kept per signature by the callers. Validate, agree,
    plan (``recipe.plan``), and get the workspace (``recipe.WORKSPACE_COPIES`` message-sized regions). ``vectors``
    are the [hidden] arguments (bias, weight); ``eps`` is ``NO_EPS`` for ops without one. Returns (hidden, the
    workspace's symmetric context, the launch configuration)."""
    # every rank raises if any rank's input is bad
    with agreement.agreed(op, group, x=x, eps=eps, config=config, **vectors):
        hidden = check_inputs(op, x, vectors, eps)
        world_size = groups.world_size_of(group, op)
        launch_cfg = recipe.plan(x.numel() // hidden, hidden, world_size, config)
        groups.check_barrier_blocks(launch_cfg["num_blocks"], world_size, op)
    return staged_workspace(op, x, hidden, group, launch_cfg, recipe.WORKSPACE_COPIES)


def staged_workspace(op: str, x: torch.Tensor, hidden: int, group, launch_cfg: dict, copies: int) -> tuple:
    """A signature's preparation after its checks, agreement and plan (``launch_cfg``): the workspace of ``copies``
    message-sized regions, its symmetric context and a launcher. Returns (hidden, context, launch configuration)."""
    workspace = symm.symm_workspace(max(copies * x.numel(), 1), x.dtype, x.device, group, op)
    ctx = symm.symm_context(workspace, group, op, name="workspace")
    return hidden, ctx, {**launch_cfg, "launcher": Launcher(op)}


def bias_signature(recipe) -> Callable:
    """``signature(x, bias, group, op, config)``: ``recipe``'s preparation (``staged_signature``), kept per signature;
    shared by the recipe's installed function and its twin's (each under its own op name)."""

    @prepared.per_signature(BIAS_KEY)
    def signature(x: torch.Tensor, bias: torch.Tensor, group, op: str, config: dict) -> tuple:
        return staged_signature(op, x, {"bias": bias}, NO_EPS, group, config, recipe)

    return signature


def norm_signature(recipe) -> Callable:
    """``signature(x, bias, weight, eps, group, op, config)``: as ``bias_signature``, for an RMSNorm member."""

    @prepared.per_signature(NORM_KEY)
    def signature(x: torch.Tensor, bias: torch.Tensor, weight: torch.Tensor, eps: float, group, op: str,
                  config: dict) -> tuple:
        return staged_signature(op, x, {"bias": bias, "weight": weight}, eps, group, config, recipe)

    return signature


SIGNATURES = {  # recipe name -> its signature's preparation
    "one_shot_all_reduce_bias": bias_signature(ONE_SHOT_BIAS),
    "two_shot_all_reduce_bias": bias_signature(TWO_SHOT_BIAS),
    "one_shot_all_reduce_bias_rms_norm": norm_signature(ONE_SHOT_NORM),
    "two_shot_all_reduce_bias_rms_norm": norm_signature(TWO_SHOT_NORM),
}


def prepare(name: str, x: torch.Tensor, operands: tuple, group, op: str, config: dict):
    """Recipe ``name``'s preparation of a call, as its ``launch`` takes it: (``x`` as [tokens, hidden], the
    workspace's symmetric context, the launch configuration with its launcher). ``operands``: (bias,) or (bias,
    weight, eps)."""
    return on_signature(op, x, SIGNATURES[name](x, *operands, group, op, config))


# ---------------------------------------------------------------------------
# The public functions (``kraken.<name>``; the twins' from the same factories, ``kraken.runtime.twins``)
# ---------------------------------------------------------------------------


def one_shot_all_reduce_bias_with(launch: Callable, op: str) -> Callable:
    """The installed one-shot all-reduce + bias, driving ``launch`` (the recipe's or its twin's)."""
    signature = SIGNATURES["one_shot_all_reduce_bias"]

    def one_shot_all_reduce_bias(
        x: torch.Tensor, bias: torch.Tensor, group: dist.ProcessGroup | str | None = None, **config
    ) -> torch.Tensor:
        """``sum over ranks of x`` + ``bias``; a new tensor of ``x``'s shape and dtype (``x`` is unchanged).

        ``x``: [..., hidden], contiguous, bf16/fp16/fp32, any CUDA tensor (staged through kraken's shared symmetric
        workspace inside the kernel); ``bias``: [hidden] of ``x``'s dtype, the same on every rank. Bitwise
        identical on every rank. ``config`` overrides ``kraken.fused.one_shot_all_reduce_bias.DEFAULT_CONFIG``.
        """
        return staged_call(launch, op, x, (bias,), signature(x, bias, group, op, config))

    return one_shot_all_reduce_bias


def two_shot_all_reduce_bias_with(launch: Callable, op: str) -> Callable:
    """The installed two-shot all-reduce + bias, driving ``launch`` (the recipe's or its twin's)."""
    signature = SIGNATURES["two_shot_all_reduce_bias"]

    def two_shot_all_reduce_bias(
        x: torch.Tensor, bias: torch.Tensor, group: dist.ProcessGroup | str | None = None, **config
    ) -> torch.Tensor:
        """``sum over ranks of x`` + ``bias``; a new tensor of ``x``'s shape and dtype (``x`` is unchanged).

        Arguments as ``one_shot_all_reduce_bias``; the sharded reduction moves less data over NVLink for larger
        messages. Bitwise identical on every rank.
        """
        return staged_call(launch, op, x, (bias,), signature(x, bias, group, op, config))

    return two_shot_all_reduce_bias


def one_shot_all_reduce_bias_rms_norm_with(launch: Callable, op: str) -> Callable:
    """The installed one-shot all-reduce + bias + RMSNorm, driving ``launch`` (the recipe's or its twin's)."""
    signature = SIGNATURES["one_shot_all_reduce_bias_rms_norm"]

    def one_shot_all_reduce_bias_rms_norm(
        x: torch.Tensor,
        bias: torch.Tensor,
        weight: torch.Tensor,
        eps: float = 1e-5,
        group: dist.ProcessGroup | str | None = None,
        **config,
    ) -> torch.Tensor:
        """RMSNorm(``sum over ranks of x`` + ``bias``) * ``weight``; a new tensor of ``x``'s shape and dtype.

        ``x``: [..., hidden], contiguous, bf16/fp16/fp32, any CUDA tensor (staged through kraken's shared symmetric
        workspace inside the kernel); ``bias``, ``weight``: [hidden] of ``x``'s dtype, the same on every rank.
        Bitwise identical on every rank. ``config`` overrides the recipe's ``DEFAULT_CONFIG``.
        """
        return staged_call(launch, op, x, (bias, weight, eps), signature(x, bias, weight, eps, group, op, config))

    return one_shot_all_reduce_bias_rms_norm


def two_shot_all_reduce_bias_rms_norm_with(launch: Callable, op: str) -> Callable:
    """The installed two-shot all-reduce + bias + RMSNorm, driving ``launch`` (the recipe's or its twin's)."""
    signature = SIGNATURES["two_shot_all_reduce_bias_rms_norm"]

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
        return staged_call(launch, op, x, (bias, weight, eps), signature(x, bias, weight, eps, group, op, config))

    return two_shot_all_reduce_bias_rms_norm


rms_norm = rms_norm_with(RMS_NORM.launch, "rms_norm")
one_shot_all_reduce_bias = one_shot_all_reduce_bias_with(ONE_SHOT_BIAS.launch, "one_shot_all_reduce_bias")
two_shot_all_reduce_bias = two_shot_all_reduce_bias_with(TWO_SHOT_BIAS.launch, "two_shot_all_reduce_bias")
one_shot_all_reduce_bias_rms_norm = one_shot_all_reduce_bias_rms_norm_with(
    ONE_SHOT_NORM.launch, "one_shot_all_reduce_bias_rms_norm")
two_shot_all_reduce_bias_rms_norm = two_shot_all_reduce_bias_rms_norm_with(
    TWO_SHOT_NORM.launch, "two_shot_all_reduce_bias_rms_norm")
