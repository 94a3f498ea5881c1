"""FP8 GEMM + reduce-scatter's product layer, wrapped around its recipe from outside.

The recipe (``kraken/fused/gemm_reduce_scatter_fp8.py``) holds the kernel, its pure ``plan``, its ``launch`` seam
and a plain host function. What the installed package adds lives here, as for the bf16 recipe
(``kraken.runtime.gemm_reduce_scatter``, whose ``planned`` and ``with_workspace`` it shares): the fp8 argument
checks agreed across ranks, the form (the fused kernel, or ``torch._scaled_mm`` then the SM-driven
reduce-scatter), the prepared call per signature and its replayed launch. The Helion twin's installed function is
this product code driving the twin's ``launch`` (``gemm_reduce_scatter_fp8_with``).
"""

from __future__ import annotations

import importlib

import torch
import torch.distributed as dist

from kraken._gemm_core import MAX_INDEX
from kraken.runtime import agreement, crossover, prepared, replay, symm
from kraken.runtime.gemm_checks import check_fp8_inputs, check_out_dtype
from kraken.runtime.gemm_reduce_scatter import installed, planned, with_workspace

# The recipe's module: its ``plan``, ``rounds_of`` and ``chunk_tile`` called through it, its ``launch`` by name.
RECIPE = importlib.import_module("kraken.fused.gemm_reduce_scatter_fp8")
OP = RECIPE.OP


def check_inputs(a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor,
                 out_dtype: torch.dtype, op: str) -> None:
    """Argument checks that need neither a GPU nor torch.distributed (``kraken.runtime.gemm_checks``' fp8 checks,
    and the output dtype)."""
    check_out_dtype(out_dtype, op)
    check_fp8_inputs(a, b, scale_a, scale_b, op)
    if max(a.numel(), b.numel(), a.shape[0] * b.shape[1]) > MAX_INDEX:
        raise ValueError(f"{op}: a, b or the output has more than 2**31 - 1 elements (32-bit offsets)")


@prepared.per_signature(lambda a, b, scale_a, scale_b, group, out_dtype, op, config: (
    op, group, prepared.tensor_key(a), prepared.tensor_key(b), prepared.tensor_key(scale_a),
    prepared.tensor_key(scale_b), out_dtype, prepared.config_key(config)))
def prepare(
    a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor, group, out_dtype: torch.dtype,
    op: str, config: dict,
) -> tuple[symm.SymmContext, dict]:
    """Validate, plan, and find the workspace: the context's ``peers`` are every rank's
    ``symm.BlockWorkspace`` viewed as [2, chunks, rounds, world_size - 1, BLOCK_M, BLOCK_N] of ``out_dtype``."""
    # Local checks; the first call of each signature also agrees on them (and on the shapes) across ranks.
    with agreement.agreed(op, group, a=a, b=b, scale_a=scale_a, scale_b=scale_b, out_dtype=out_dtype, config=config):
        check_inputs(a, b, scale_a, scale_b, out_dtype, op)
        world_size, cfg = planned(a, b, group, config, op, RECIPE.plan)
    return with_workspace(a, b.shape[1], world_size, cfg, out_dtype, group, op, RECIPE)


def call(launch, op: str, a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor, group,
         out_dtype: torch.dtype, config: dict, reduce_scatter) -> torch.Tensor:
    """``gemm_reduce_scatter_fp8`` with a given ``launch`` and ``reduce_scatter`` (the recipe's or its twin's) under
    the name ``op``, in the form ``kraken.runtime.crossover`` chooses: sequential, ``scaled_mm_then_reduce_scatter``;
    else the prepared call and its launch."""
    prepared = chosen(a, b, scale_a, scale_b, group, out_dtype, op, config)
    if prepared == crossover.SEQUENTIAL:
        return scaled_mm_then_reduce_scatter(reduce_scatter, a, b, scale_a, scale_b, group)
    ctx, launch_cfg = prepared
    out = torch.empty(a.shape[0] // ctx.world_size, b.shape[1], dtype=out_dtype, device=a.device)
    return replay.prepared_launch(launch, (a, b, scale_a, scale_b), ctx, launch_cfg, out)


@prepared.per_signature(lambda a, b, scale_a, scale_b, group, out_dtype, op, config: (
    op, group, prepared.tensor_key(a), prepared.tensor_key(b), prepared.tensor_key(scale_a),
    prepared.tensor_key(scale_b), out_dtype, prepared.config_key(config)))
def chosen(a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor, group,
           out_dtype: torch.dtype, op: str, config: dict):
    """``crossover.SEQUENTIAL`` or the fused form's ``prepare``, kept per signature (``crossover.fused_prepared``);
    sequential only for a bf16 output (``torch._scaled_mm``'s with row-wise scales) and K and N multiples of 16."""
    sequential_ok = out_dtype == torch.bfloat16 and all(
        isinstance(t, torch.Tensor) and t.dim() == 2 and t.shape[1] % 16 == 0 for t in (a, b))
    return crossover.fused_prepared(
        op, a, b, group, False, sequential_ok, config, check_sequential,
        lambda fused_config: prepare(a, b, scale_a, scale_b, group, out_dtype, op, fused_config), None,
        (scale_a, scale_b))


def check_sequential(a: torch.Tensor, b: torch.Tensor, world_size: int, op: str, scale_a: torch.Tensor,
                     scale_b: torch.Tensor) -> None:
    """The sequential form's checks (``kraken.runtime.crossover.form`` runs them inside its agreement)."""
    check_inputs(a, b, scale_a, scale_b, torch.bfloat16, op)
    if a.shape[0] % world_size:
        raise ValueError(f"{op}: M = {a.shape[0]} rows do not split evenly over {world_size} ranks (a is "
                         f"{tuple(a.shape)})")


def scaled_mm_then_reduce_scatter(reduce_scatter, a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor,
                                  scale_b: torch.Tensor, group) -> torch.Tensor:
    """The sequential form (bf16 out, K and N multiples of 16): ``torch._scaled_mm`` with row-wise scales (a
    per-tensor scale becomes every row's or column's) on a column-major ``b``, each rank's partial rounded to bf16
    once, then ``reduce_scatter`` (the SM-driven collective: the sum in fp32 in rank order, rounded once), as the
    fused kernel's partials cross NVLink in bf16 and are summed in fp32."""
    rows = scale_a.reshape(-1, 1).expand(a.shape[0], 1).contiguous()
    cols = scale_b.reshape(1, -1).expand(1, b.shape[1]).contiguous()
    b_cols = b if b.stride(0) == 1 else b.t().contiguous().t()
    return reduce_scatter(torch._scaled_mm(a, b_cols, rows, cols, out_dtype=torch.bfloat16), group)


def gemm_reduce_scatter_fp8_with(launch, op: str, package: str):
    """The installed fp8 GEMM + reduce-scatter, driving ``launch``: the recipe's (``kraken.gemm_reduce_scatter_fp8``)
    or its Helion twin's (``helion_ports.gemm_reduce_scatter_fp8``), whose sequential form runs ``package``'s
    installed reduce-scatter (``kraken`` or ``helion_ports``)."""

    def reduce_scatter(tensor: torch.Tensor, group) -> torch.Tensor:
        return installed(package, "reduce_scatter")(tensor, group)

    def gemm_reduce_scatter_fp8(
        a: torch.Tensor,
        b: torch.Tensor,
        scale_a: torch.Tensor,
        scale_b: torch.Tensor,
        group: dist.ProcessGroup | str | None = None,
        out_dtype: torch.dtype = torch.bfloat16,
        **config,
    ) -> torch.Tensor:
        """This rank's rows ``[rank * M / ws, (rank + 1) * M / ws)`` of ``sum over ranks of (a * scale_a) @
        (b * scale_b)``, accumulated in fp32, a new [M / ws, N] tensor of ``out_dtype`` (bf16 or fp32).

        ``a`` [M, K]: a contiguous ``float8_e4m3fn`` CUDA tensor, the same shape on every rank, M divisible by
        the world size; ``b`` [K, N] fp8 in any layout (column-major, ``w.t()``, is read in place); ``scale_a``
        float32, one element or [M, 1]; ``scale_b`` float32, one element or [1, N] (each rank its own).
        ``config`` overrides the tiles, ``group_m``, ``max_blocks`` and ``b_layout`` (see the recipe's ``plan``);
        ``form="fused"`` or ``"sequential"`` forces the form ``kraken.runtime.crossover`` would choose by size.
        """
        return call(launch, op, a, b, scale_a, scale_b, group, out_dtype, config, reduce_scatter)

    return gemm_reduce_scatter_fp8


gemm_reduce_scatter_fp8 = gemm_reduce_scatter_fp8_with(RECIPE.launch, OP, "kraken")
