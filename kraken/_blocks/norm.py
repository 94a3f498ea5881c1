"""The RMSNorm row math of the bias/RMSNorm family's Helion twins (the Triton recipes' is
``kraken._blocks.rms_normalize``).

A plain Python function of torch operations that Helion inlines into the kernel that calls it. It broadcasts
with ``keepdim=True`` rather than ``t[:, None]``: Helion 1.5.0 fails to lower a ``[:, None]`` subscript inside a
called helper (InductorLoweringError on ``aten.slice``), while the same subscript in the kernel body works.
"""

from __future__ import annotations

import torch


def rms_normalize(h: torch.Tensor, weight_row: torch.Tensor, eps: float) -> torch.Tensor:
    """``h * rsqrt(mean(h^2) + eps) * weight`` for fp32 rows ``h`` ([rows, hidden]) and the fp32 ``weight_row``
    ([1, hidden], loaded by the caller before the reduction); mirrors the Triton helper."""
    inv_rms = torch.rsqrt(torch.mean(h * h, dim=-1, keepdim=True) + eps)
    return h * inv_rms * weight_row
