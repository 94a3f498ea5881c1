"""Helion twin of ``kraken.fused.rms_norm``: same function, same arguments.

One row per program (``hl.tile(tokens, block_size=1)`` on a flat grid), the row
as one ``next_power_of_2(hidden)`` tile: the ``:`` index becomes Helion's
persistent reduction dimension, as ``BLOCK_H`` is in the Triton kernel.

``rms_normalize`` is the row math the fused twins share. It is a plain Python
function that Helion inlines into the kernel; note that it broadcasts with
``keepdim=True``/``unsqueeze`` rather than ``t[:, None]``: Helion 1.5.0 fails to
lower a ``[:, None]`` subscript inside a called helper (InductorLoweringError on
``aten.slice``), while the same subscript in the kernel body works.
"""

from __future__ import annotations

import functools

import helion
import helion.language as hl
import torch

from kraken._blocks.helion import flat_kernel, run
from kraken.fused.rms_norm import plan, prepare  # shared with the Triton recipe
from kraken.runtime.launcher import jit_launch


def rms_normalize(h: torch.Tensor, weight_row: torch.Tensor, eps: float) -> torch.Tensor:
    """``h * rsqrt(mean(h^2) + eps) * weight`` for fp32 rows ``h`` ([rows, hidden]) and the fp32 ``weight_row``
    ([1, hidden], loaded by the caller before the reduction); mirrors the Triton helper."""
    inv_rms = torch.rsqrt(torch.mean(h * h, dim=-1, keepdim=True) + eps)
    return h * inv_rms * weight_row


def rms_norm_body(x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor, eps: float) -> torch.Tensor:
    for rows in hl.tile(x.size(0), block_size=1):
        weight_row = hl.load(weight, [slice(None)]).to(torch.float32).unsqueeze(0)
        h = hl.load(x, [rows, slice(None)]).to(torch.float32)
        hl.store(out, [rows, slice(None)], rms_normalize(h, weight_row, eps).to(out.dtype))
    return out


@functools.cache
def compiled(num_warps: int) -> helion.Kernel:
    """One Helion kernel per launch configuration, each with an explicit config."""
    return flat_kernel(rms_norm_body, (), num_warps)


def launch(
    x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor, eps: float, num_warps: int, launcher=jit_launch
) -> torch.Tensor:
    """Launch on prepared arguments (no checks); mirrors ``kraken.fused.rms_norm.launch``."""
    if x.shape[0] > 0:
        run(compiled(num_warps), (x, weight, out, float(eps)), launcher)
    return out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-5, **config) -> torch.Tensor:
    """RMSNorm over the last dimension of ``x`` (see the kraken recipe)."""
    x2d, launch_cfg = prepare(x, weight, eps, "helion rms_norm", config)
    out = torch.empty_like(x2d)
    return launch(x2d, weight, out, eps, **launch_cfg).view(x.shape)
