"""Argument checks of the GEMM recipes' inputs (the product layer's, raised before any launch): the
bf16/fp16 operands and output dtype (``check_inputs``, ``check_out_dtype``; ``all_gather_matmul``'s with
``any_b``) and the fp8 operands and their scales (``check_fp8_inputs``, ``check_scale``). None needs a GPU or
torch.distributed.
"""

from __future__ import annotations

import torch

from kraken._gemm_core import FP8, INPUT_DTYPES, MAX_INDEX, OUT_DTYPES
from kraken.runtime import groups


def check_out_dtype(out_dtype: torch.dtype, op: str) -> None:
    if out_dtype not in OUT_DTYPES:
        allowed = ", ".join(str(d).removeprefix("torch.") for d in OUT_DTYPES)
        raise ValueError(f"{op}: out_dtype {out_dtype} is not supported; supported: {allowed}")


def check_inputs(a: torch.Tensor, b: torch.Tensor, out_dtype: torch.dtype | None, op: str, wide: bool = False,
                 any_b: bool = False) -> None:
    """Checks of a bf16/fp16 GEMM's arguments that need neither a GPU nor torch.distributed. ``out_dtype``: the
    output's (checked), or None where it is ``a``'s. ``wide``: the recipe addresses its output with 64-bit offsets
    past ``MAX_INDEX`` (its operands load through TMA). ``any_b``: ``b`` in any layout (``all_gather_matmul``, which
    copies what TMA cannot read), a CUDA ``a``, and no empty operand."""
    if out_dtype is not None:
        check_out_dtype(out_dtype, op)
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        if a.dtype != b.dtype:
            raise ValueError(f"{op}: a and b must have the same dtype, got {a.dtype} and {b.dtype}")
        if a.dim() == 2 and b.dim() == 2 and a.shape[1] != b.shape[0]:
            raise ValueError(
                f"{op}: inner dimensions differ: a is {tuple(a.shape)}, b is {tuple(b.shape)} (need a [M, K], b [K, N])"
            )
        if a.dim() == 2 and b.dim() == 2 and any_b and (a.numel() == 0 or b.numel() == 0):
            raise ValueError(f"{op}: empty operand (a is {tuple(a.shape)}, b is {tuple(b.shape)})")
        if a.dim() == 2 and b.dim() == 2 and not any_b and (a.shape[0] == 0 or b.shape[1] == 0):
            raise ValueError(f"{op}: the output would be empty (a is {tuple(a.shape)}, b is {tuple(b.shape)})")
    if any_b:
        if not isinstance(b, torch.Tensor):
            raise TypeError(f"{op}: b must be a torch.Tensor, got {type(b).__name__}")
        groups.check_tensor(a, "a", op, INPUT_DTYPES, ndim=2)
        if b.dtype not in INPUT_DTYPES or b.dim() != 2:
            raise ValueError(f"{op}: b must be a 2-D bfloat16 or float16 tensor, got {b.dtype} of shape {tuple(b.shape)}")
        if a.device.type != "cuda" or b.device != a.device:
            raise ValueError(f"{op}: a and b must be on the same CUDA device, got {a.device} and {b.device}")
    else:
        groups.check_tensor(a, "a", op, INPUT_DTYPES, ndim=2)
        groups.check_tensor(b, "b", op, INPUT_DTYPES, ndim=2)
        if a.device != b.device:
            raise ValueError(f"{op}: a and b are on different devices ({a.device}, {b.device})")
    if not wide and max(a.numel(), b.numel(), a.shape[0] * b.shape[1]) > MAX_INDEX:
        raise ValueError(f"{op}: a, b or the output has more than 2**31 - 1 elements (32-bit offsets)")


def check_scale(scale: object, name: str, rows: int, cols: int, device: torch.device, op: str) -> None:
    """A ``torch._scaled_mm`` scale: float32 on ``device`` (a's), one element (per tensor) or [rows, cols]."""
    if not isinstance(scale, torch.Tensor):
        raise TypeError(f"{op}: {name} must be a torch.Tensor, got {type(scale).__name__}")
    if scale.dtype != torch.float32:
        raise ValueError(f"{op}: {name} must be float32, got {str(scale.dtype).removeprefix('torch.')}")
    if scale.numel() != 1 and tuple(scale.shape) != (rows, cols):
        raise ValueError(f"{op}: {name} must have one element (per tensor) or shape ({rows}, {cols}), "
                         f"got {tuple(scale.shape)}")
    if not scale.is_contiguous():
        raise ValueError(f"{op}: {name} must be contiguous (got strides {scale.stride()})")
    if scale.device != device:
        raise ValueError(f"{op}: {name} must be on {device} (with a), got {scale.device}")


def check_fp8_inputs(a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor, op: str) -> None:
    """Checks of an fp8 GEMM's arguments that need neither a GPU nor torch.distributed: fp8 e4m3 ``a`` [M, K]
    (contiguous) and ``b`` [K, N] (any layout), float32 scales per tensor or ``scale_a`` [M, 1], ``scale_b``
    [1, N]."""
    for name, tensor in (("a", a), ("b", b)):
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"{op}: {name} must be a torch.Tensor, got {type(tensor).__name__}")
        if tensor.dtype != FP8 or tensor.dim() != 2:
            raise ValueError(f"{op}: {name} must be a 2-D float8_e4m3fn tensor, got "
                             f"{str(tensor.dtype).removeprefix('torch.')} of shape {tuple(tensor.shape)}")
    if not a.is_contiguous():
        raise ValueError(f"{op}: a must be contiguous (got strides {a.stride()}); call .contiguous() first")
    if a.shape[1] != b.shape[0]:
        raise ValueError(f"{op}: inner dimensions differ: a is {tuple(a.shape)}, b is {tuple(b.shape)} "
                         "(need a [M, K], b [K, N])")
    if a.numel() == 0 or b.numel() == 0:
        raise ValueError(f"{op}: empty operand (a is {tuple(a.shape)}, b is {tuple(b.shape)})")
    check_scale(scale_a, "scale_a", a.shape[0], 1, a.device, op)
    check_scale(scale_b, "scale_b", 1, b.shape[1], a.device, op)
    if a.device.type != "cuda" or b.device != a.device:
        raise ValueError(f"{op}: a and b must be on the same CUDA device, got {a.device} and {b.device}")
