"""Helion twin of ``kraken/fused/rms_norm.py``: the same kernel, plan and arguments.

One row per program (``hl.tile(tokens, block_size=1)`` on a flat grid), the row
as one ``next_power_of_2(hidden)`` tile: the ``:`` index becomes Helion's
persistent reduction dimension, as ``BLOCK_H`` is in the Triton kernel. The row
math is ``kraken._blocks.norm.rms_normalize``, which Helion inlines.

``helion_ports.rms_norm`` is the installed twin (checks, a prepared call per signature, replayed launches). Set
``HELION_PRINT_OUTPUT_CODE=1`` to see the generated Triton.

    python helion_ports/fused/rms_norm.py
"""

from __future__ import annotations

import functools
import os
import time

import helion
import helion.language as hl
import torch

from kraken._blocks.helion import flat_kernel, run
from kraken._blocks.norm import rms_normalize

# The recipe's defaults (kraken/fused/rms_norm.py), kept equal by a test.
DEFAULT_CONFIG = {"num_warps": None}  # None: from the row width


def rms_norm_body(x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor, eps: float) -> torch.Tensor:
    for rows in hl.tile(x.size(0), block_size=1):
        weight_row = hl.load(weight, [slice(None)]).to(torch.float32).unsqueeze(0)
        h = hl.load(x, [rows, slice(None)]).to(torch.float32)
        hl.store(out, [rows, slice(None)], rms_normalize(h, weight_row, eps).to(out.dtype))
    return out


@functools.cache
def compiled(num_warps: int) -> helion.Kernel:
    """One Helion kernel per launch configuration, each with one explicit config (``flat_kernel``)."""
    return flat_kernel(rms_norm_body, (), num_warps)


def plan(tokens: int, hidden: int, config: dict) -> dict:
    """The recipe's plan: one row per program, 16 elements per thread: 4 to 16 warps."""
    unknown = set(config) - set(DEFAULT_CONFIG)
    if unknown:
        raise TypeError(f"rms_norm: unknown config keys {sorted(unknown)}; known: {sorted(DEFAULT_CONFIG)}")
    cfg = {**DEFAULT_CONFIG, **config}
    block_h = 1 << (hidden - 1).bit_length() if hidden > 0 else 1
    return {"num_warps": cfg["num_warps"] or max(4, min(16, block_h // 512))}


def launch(
    x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor, eps: float, num_warps: int, launcher=None
) -> torch.Tensor:
    """Launch on planned arguments (``x``, ``out``: [tokens, hidden]; no checks); the recipe's ``launch`` signature.
    ``launcher``: None for a plain call, or the installed package's (``run``)."""
    if x.shape[0] > 0:
        run(compiled(num_warps), (x, weight, out, float(eps)), launcher)
    return out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-5, **config) -> torch.Tensor:
    """RMSNorm over the last dimension of ``x``; a new tensor of ``x``'s shape and dtype. Checks nothing."""
    hidden = x.shape[-1]
    x2d = x.view(-1, hidden)
    out = torch.empty_like(x2d)
    return launch(x2d, weight, out, eps, **plan(x2d.shape[0], hidden, config)).view(x.shape)


def main(tokens: int = 4096, hidden: int = 5120, iters: int = 100) -> None:
    """Check against eager PyTorch (float64) and time the twin."""
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
    torch.cuda.set_device(device)
    torch.manual_seed(0)
    x = torch.randn(tokens, hidden, dtype=torch.bfloat16, device=device)
    weight = (1 + 0.5 * torch.randn(hidden, device=device)).to(torch.bfloat16)
    h = x.double()
    expected = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-5) * weight.double()
    for _ in range(3):  # compile, then warm
        got = rms_norm(x, weight)
    torch.testing.assert_close(got.double(), expected, rtol=2e-2, atol=2e-2)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(iters):
        rms_norm(x, weight)
    torch.cuda.synchronize()
    us = (time.perf_counter() - start) / iters * 1e6
    print(f"helion rms_norm: {tokens}x{hidden} bf16: matches float64, {us:.1f} us per call")


if __name__ == "__main__":
    main()
