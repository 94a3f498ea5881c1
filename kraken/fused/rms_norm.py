"""RMSNorm on one GPU: the building block of the all-reduce + bias + RMSNorm family.

    y = x * rsqrt(mean(x^2) + eps) * weight        (per row, in fp32)

One program normalises one row of ``x`` ([tokens, hidden], any leading shape
flattened into tokens). The whole row sits in registers as one
``next_power_of_2(hidden)`` tile, so the mean of squares is a single in-register
reduction and ``x`` is read exactly once.

``rms_normalize`` (``kraken._blocks``) is the row math every fused recipe of the family calls
after its all-reduce, and ``check_inputs`` the validation they all share: everything
that needs no GPU (shapes, dtypes, ``eps``) is checked before anything that does,
so a bad argument names itself on any machine.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from kraken._blocks import rms_normalize
from kraken.runtime import groups, prepared
from kraken.runtime.launcher import Launcher, jit_launch

DEFAULT_CONFIG = {"num_warps": None}  # None: from the row width
MAX_HIDDEN = 16384  # a row is one register tile; wider rows would spill
MAX_NUMEL = 1 << 30  # offsets are int32 and two-shot staging holds two copies of x
NO_EPS = object()  # check_inputs: the op takes no eps


# ---------------------------------------------------------------------------
# Device: the row math, shared by every kernel of the family
# ---------------------------------------------------------------------------


@triton.jit
def rms_norm_kernel(x_ptr, weight_ptr, out_ptr, hidden, eps, BLOCK_H: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK_H)
    mask = cols < hidden
    offsets = row * hidden + cols
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    h = tl.load(x_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    y = rms_normalize(h, weight, eps, hidden)
    tl.store(out_ptr + offsets, y.to(out_ptr.dtype.element_ty), mask=mask)


# ---------------------------------------------------------------------------
# Host: validation and configuration shared by the family
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


def row_warps(hidden: int) -> int:
    """Warps for the fused kernels' one-row tile: at most one 16-byte vector (8 bf16) per thread, 16 to 32.

    Then a thread's share of a row is one load per peer, so (at world size 2)
    the first add of the peers' rows needs every load the thread issued, and
    they are all in flight at once. With two vectors per thread (16 warps for a
    5120-wide row), ptxas may hold back a thread's last load until the first
    ones have arrived, and did so in one of each pair of twins: a second NVLink
    round trip on every row, about 1 us.
    """
    return max(16, min(32, triton.next_power_of_2(hidden) // (8 * 32)))


def plan(tokens: int, hidden: int, config: dict) -> dict:
    """Resolve the launch configuration (shared with the Helion port)."""
    cfg = groups.resolve_config(config, DEFAULT_CONFIG, "rms_norm")
    # One row per program, 16 elements per thread: 4 to 16 warps.
    return {"num_warps": cfg["num_warps"] or max(4, min(16, triton.next_power_of_2(hidden) // 512))}


def prepare(x: torch.Tensor, weight: torch.Tensor, eps: float, op: str, config: dict) -> tuple[torch.Tensor, dict]:
    """``x`` as [tokens, hidden] and the launch configuration (checked and planned once per signature)."""
    hidden, launch_cfg = checked_plan(x, weight, eps, op, config)
    return (x if x.dim() == 2 else x.view(-1, hidden)), launch_cfg  # a view costs ~1 us


@prepared.per_signature(lambda x, weight, eps, op, config: (
    op, prepared.tensor_key(x), prepared.tensor_key(weight), prepared.scalar_key(eps), prepared.config_key(config)))
def checked_plan(x: torch.Tensor, weight: torch.Tensor, eps: float, op: str, config: dict) -> tuple[int, dict]:
    hidden = check_inputs(op, x, {"weight": weight}, eps)
    return hidden, {**plan(x.numel() // hidden, hidden, config), "launcher": Launcher(op)}


def launch(
    x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor, eps: float, num_warps: int, launcher=jit_launch
) -> torch.Tensor:
    """Launch on prepared arguments (``x``, ``out``: [tokens, hidden]; no checks); same signature as the port's."""
    tokens, hidden = x.shape
    if tokens > 0:
        launcher(
            rms_norm_kernel, (tokens,), x, weight, out, hidden, float(eps), BLOCK_H=groups.next_power_of_2(hidden),
            num_warps=num_warps,
        )
    return out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-5, **config) -> torch.Tensor:
    """RMSNorm over the last dimension of ``x``; returns a new tensor of ``x``'s shape and dtype.

    ``x``: [..., hidden], contiguous, bf16/fp16/fp32, on one GPU; ``weight``:
    [hidden] of ``x``'s dtype. Statistics in fp32. ``config`` overrides
    ``DEFAULT_CONFIG``.
    """
    x2d, launch_cfg = prepare(x, weight, eps, "rms_norm", config)
    out = torch.empty_like(x2d)
    return launch(x2d, weight, out, eps, **launch_cfg).view(x.shape)
