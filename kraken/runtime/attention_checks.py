"""Context-parallel attention's argument checks (``kraken.runtime.attention`` runs them, agreed across ranks on the
first call of each signature): the recipe's dtypes and head sizes, shapes, layout and 32-bit offsets."""

from __future__ import annotations

import importlib
import math

import torch

from kraken.runtime import groups

CP = importlib.import_module("kraken.fused.context_parallel_attention")  # (its plan's limits, read through it)


def check_inputs(q, k, v, causal, scale, op: str) -> None:
    """Argument checks that need neither a GPU nor torch.distributed."""
    named = (("q", q), ("k", k), ("v", v))
    for name, tensor in named:
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"{op}: {name} must be a torch.Tensor, got {type(tensor).__name__}")
    # groups.check_tensor's checks, but every one on all three before the device (the last, below).
    for name, tensor in named:
        if tensor.dtype not in CP.INPUT_DTYPES:
            groups.check_tensor(tensor, name, op, CP.INPUT_DTYPES)  # raises, naming the dtype
    for name, tensor in named:
        if tensor.dim() != 4:
            raise ValueError(f"{op}: {name} must be 4-D, got shape {tuple(tensor.shape)}")
        if not tensor.is_contiguous():
            raise ValueError(f"{op}: {name} must be contiguous (got strides {tensor.stride()}); call .contiguous() first")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"{op}: q, k and v must have the same dtype, got {q.dtype}, {k.dtype} and {v.dtype}")
    if k.shape != v.shape:
        raise ValueError(f"{op}: k and v must have the same shape, got {tuple(k.shape)} and {tuple(v.shape)}")
    (batch, heads, s_local, head_dim), (kv_batch, kv_heads, kv_len, kv_dim) = q.shape, k.shape
    if kv_batch != batch or kv_len != s_local or kv_dim != head_dim:
        raise ValueError(f"{op}: q is [batch, heads, S_local, head_dim] = {tuple(q.shape)} but k and v are "
                         f"{tuple(k.shape)}: batch, S_local and head_dim must match")
    if head_dim not in CP.HEAD_DIMS:
        raise ValueError(f"{op}: head_dim must be one of {CP.HEAD_DIMS}, got {head_dim}")
    if kv_heads == 0 or heads % kv_heads:
        raise ValueError(f"{op}: the kv heads ({kv_heads}) must divide the query heads ({heads})")
    if q.numel() == 0:
        raise ValueError(f"{op}: empty input (q is {tuple(q.shape)})")
    if not isinstance(causal, bool):
        raise TypeError(f"{op}: causal must be a bool, got {type(causal).__name__}")
    if causal and s_local % 2:
        raise ValueError(f"{op}: causal=True needs an even S_local (two equal chunks per rank, the load-balanced "
                         f"layout), got {s_local}")
    if scale is not None and (isinstance(scale, bool) or not isinstance(scale, (int, float))
                              or not math.isfinite(scale) or scale <= 0):
        raise ValueError(f"{op}: scale must be a positive finite number or None, got {scale!r}")
    for name, tensor in named:
        groups.check_tensor(tensor, name, op, CP.INPUT_DTYPES, ndim=4)  # the device
    if k.device != q.device or v.device != q.device:
        raise ValueError(f"{op}: q, k and v must be on the same device, got {q.device}, {k.device} and {v.device}")


def check_sizes(q: torch.Tensor, k: torch.Tensor, world_size: int, op: str) -> None:
    if max(q.numel(), world_size * 2 * k.numel()) > CP.MAX_INDEX:
        raise ValueError(f"{op}: q or the gathered K/V has more than 2**31 - 1 elements (32-bit offsets)")


def check_gathered(gathered, k, rank: int, op: str) -> None:
    if not isinstance(gathered, torch.Tensor):
        raise TypeError(f"{op}: gathered must be a torch.Tensor, got {type(gathered).__name__}")
    shape = (2, k.shape[0] * k.shape[1], k.shape[2], k.shape[3])
    if gathered.dim() != 5 or tuple(gathered.shape[1:]) != shape:
        raise ValueError(f"{op}: gathered must be [world_size, 2, batch * kv_heads, S_local, head_dim] = "
                         f"[world_size, {', '.join(map(str, shape))}], got {tuple(gathered.shape)}")
    if not 0 <= rank < gathered.shape[0]:
        raise ValueError(f"{op}: rank {rank} is not in 0 .. {gathered.shape[0] - 1}")
    groups.check_tensor(gathered, "gathered", op, (k.dtype,), ndim=5)
    if gathered.device != k.device:
        raise ValueError(f"{op}: gathered must be on {k.device}, got {gathered.device}")
