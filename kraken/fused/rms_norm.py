"""RMSNorm on one GPU: the building block of the all-reduce + bias + RMSNorm family.

    y = x * rsqrt(mean(x^2) + eps) * weight        (per row, in fp32)

One program normalises one row of ``x`` ([tokens, hidden], any leading shape
flattened into tokens). The whole row sits in registers as one
``next_power_of_2(hidden)`` tile, so the mean of squares is a single in-register
reduction and ``x`` is read exactly once.

``rms_normalize`` (``kraken._blocks``) is the row math every fused recipe of the family calls after its
all-reduce. No barrier, no peer: this kernel touches only local memory.

Layout: ``x`` [..., hidden], contiguous, bf16/fp16/fp32, hidden at most 16384 (a row is one register tile);
``weight`` [hidden] of ``x``'s dtype.

This file is the recipe: the kernel, ``plan`` (pure), ``launch`` (the seam the installed package's fast path
calls with its own ``launcher``) and a plain host function. ``kraken.rms_norm`` is the same kernel behind the
product layer (``kraken.runtime.bias_norm``: argument checks, a prepared call per signature, its launcher).

    python kraken/fused/rms_norm.py
"""

from __future__ import annotations

import os
import time

import torch
import triton
import triton.language as tl

from kraken._blocks import rms_normalize

DEFAULT_CONFIG = {"num_warps": None}  # None: from the row width


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


def next_power_of_2(n: int) -> int:
    """``triton.next_power_of_2`` without its host cost: triton 3.6 makes that a ``constexpr_function`` (about
    2 us a call), and ``launch`` runs on every call."""
    return 1 << (n - 1).bit_length() if n > 0 else 1


def plan(tokens: int, hidden: int, config: dict) -> dict:
    """The launch configuration: ``DEFAULT_CONFIG`` overridden by ``config``. One row per program, 16 elements
    per thread: 4 to 16 warps. Shared with the Helion twin."""
    unknown = set(config) - set(DEFAULT_CONFIG)
    if unknown:
        raise TypeError(f"rms_norm: unknown config keys {sorted(unknown)}; known: {sorted(DEFAULT_CONFIG)}")
    cfg = {**DEFAULT_CONFIG, **config}
    return {"num_warps": cfg["num_warps"] or max(4, min(16, next_power_of_2(hidden) // 512))}


def triton_launch(kernel, grid: tuple[int, ...], *args, **meta):
    """``launch``'s default launcher: Triton's own ``kernel[grid](...)``."""
    return kernel[grid](*args, **meta)


def launch(
    x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor, eps: float, num_warps: int, launcher=triton_launch
) -> torch.Tensor:
    """Launch on planned arguments (``x``, ``out``: [tokens, hidden]; no checks); the same signature as the Helion
    twin's. ``launcher(kernel, grid, *args, **meta)``: Triton's own launch, or the installed package's."""
    tokens, hidden = x.shape
    if tokens > 0:
        launcher(
            rms_norm_kernel, (tokens,), x, weight, out, hidden, float(eps), BLOCK_H=next_power_of_2(hidden),
            num_warps=num_warps,
        )
    return out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-5, **config) -> torch.Tensor:
    """RMSNorm over the last dimension of ``x``; a new tensor of ``x``'s shape and dtype (statistics in fp32).

    The recipe spelled out: ``x`` as rows, the plan, one launch. It checks nothing; ``kraken.rms_norm`` is the
    installed one (checks, a prepared call per signature)."""
    hidden = x.shape[-1]
    x2d = x.view(-1, hidden)
    out = torch.empty_like(x2d)
    return launch(x2d, weight, out, eps, **plan(x2d.shape[0], hidden, config)).view(x.shape)


def main(tokens: int = 4096, hidden: int = 5120, iters: int = 100) -> None:
    """Check against eager PyTorch (float64) and time the kernel."""
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
    torch.cuda.set_device(device)
    torch.manual_seed(0)
    x = torch.randn(tokens, hidden, dtype=torch.bfloat16, device=device)
    weight = (1 + 0.5 * torch.randn(hidden, device=device)).to(torch.bfloat16)
    h = x.double()
    expected = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-5) * weight.double()
    got = rms_norm(x, weight)
    torch.testing.assert_close(got.double(), expected, rtol=2e-2, atol=2e-2)

    out, cfg = torch.empty_like(x), plan(tokens, hidden, {})
    for _ in range(10):  # warm up (compile)
        launch(x, weight, out, 1e-5, **cfg)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(iters):
        launch(x, weight, out, 1e-5, **cfg)
    torch.cuda.synchronize()
    us = (time.perf_counter() - start) / iters * 1e6
    print(f"rms_norm: {tokens}x{hidden} bf16: matches float64, {us:.1f} us per call (eager launches; {cfg})")


if __name__ == "__main__":
    main()
