"""FP8 GEMM + reduce-scatter: this rank's rows of ``sum over ranks of _scaled_mm(a, b, scale_a, scale_b)``.

``kraken.fused.gemm_reduce_scatter`` for ``torch.float8_e4m3fn`` operands with scales, in the layouts
``torch._scaled_mm`` takes: ``scale_a`` per tensor (one element) or per row ([M, 1]), ``scale_b`` per
tensor or per column ([1, N]), all float32. Each rank's partial is scaled in the epilogue, before it
leaves the SM (``acc * scale_a[rows, None] * scale_b[None, cols]``, fp32), so the ranks' scales may all
differ; the partials cross NVLink in ``out_dtype`` (bf16 by default, as the bf16 recipe's) and are
summed in fp32. fp8 doubles the tensor cores' rate: the exchange has half the GEMM time to hide under.

The kernel is the bf16 recipe's ``gemm_reduce_scatter_kernel`` (its docstring tells the protocol) with
``SCALED`` and the scale pointers set, and ``B_TRANS`` for a column-major ``b``; the host code shares its
checks, grid, workspace and tiles (``check_tiles``, ``with_grid``, ``planned``, ``with_workspace``,
``default_config``). In short: a persistent grid, block ``b``
takes band-local tiles ``b, b + blocks, ...`` of every band; the peers' bands first (owner ``rank + 1``
first), each tile pushed into this rank's slot of chunk ``b`` of the owner's ``symm.BlockWorkspace``;
then the own band, one epoch barrier after its first GEMM, the peers' partials added from local memory.

* Accumulation as in ``kraken.fused.all_gather_matmul_fp8`` (the tensor cores' accumulator over the
  whole k loop, like ``_scaled_mm``'s ``use_fast_accum=True``).
* k steps are twice as long as the bf16 recipe's (up to 128: 128 fp8 bytes, one TMA swizzle row):
  the same bytes per pipeline stage, the same tile shapes (``plan``).
* ``b``: Hopper's fp8 wgmma takes both operands K-major from shared memory, so a column-major ``b``
  (``w.t()`` of an [N, K] weight, what ``_scaled_mm`` wants) is read in place as [N, K] and each tile
  is transposed as a shared-memory view (``B_TRANS``); a row-major ``b`` is read as stored, at the cost
  that ``kraken.fused.all_gather_matmul_fp8`` measures in its docstring (``b_layout``: ``kraken._gemm_core.fp8_b_operand``).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from kraken._gemm_core import FP8_B_LAYOUTS as B_LAYOUTS
from kraken._gemm_core import FP8_MAX_BLOCK_K as MAX_BLOCK_K
from kraken._gemm_core import MAX_INDEX, SKINNY_STAGE_BYTES, check_tiles
from kraken._gemm_core import fp8_b_operand as b_operand
from kraken._gemm_core import tma_fp8 as tma_a
from kraken.fused.gemm_reduce_scatter import (  # the bf16 recipe's kernel and host plan: the same recipe in fp8
    GROUP_M, LAUNCH_KEYS, chunk_tile, default_config, gemm_reduce_scatter_kernel, planned, rounds_of, with_grid,
    with_workspace,
)
from kraken.runtime.collectives import reduce_scatter as sm_reduce_scatter
from kraken.runtime import agreement, crossover, groups, prepared, replay, symm
from kraken.runtime.gemm_checks import check_fp8_inputs, check_out_dtype
from kraken.runtime.launcher import jit_launch, tma_operand

OP = "gemm_reduce_scatter_fp8"
# The skinny tiles (up to 256 rows per band) in fp8: two warpgroups and 4 stages (M = 256, 8192 x 4096 on one
# H200: 16.6 us against 19.7 for bf16's one warpgroup and 3 stages, 19.9 for two warpgroups and 3).
SKINNY_WARPS = 8
SKINNY_STAGES = 4
DEFAULT_CONFIG = {"block_m": None, "block_n": None, "block_k": None, "group_m": GROUP_M, "num_warps": None,
                  "num_stages": None, "max_blocks": None, "b_layout": "auto"}

__all__ = ["call", "chunk_tile", "gemm_reduce_scatter_fp8", "launch", "plan", "prepare", "rounds_of"]


def launch(
    a: torch.Tensor,
    b: torch.Tensor,
    scale_a: torch.Tensor,
    scale_b: torch.Tensor,
    peers: tuple[torch.Tensor, ...],
    out: torch.Tensor,
    signal_pad_ptrs: int,
    rank: int,
    parity: torch.Tensor,
    epochs: torch.Tensor,
    b_layout: str,
    block_m: int,
    block_n: int,
    block_k: int,
    group_m: int,
    num_warps: int,
    num_stages: int,
    num_blocks: int,
    group_name: str = "",
    launcher=jit_launch,
) -> torch.Tensor:
    """Launch on prepared arguments (no checks); the same signature as the Helion port's ``launch``.

    ``peers`` are every rank's workspace as ``prepare`` views it, ``peers[rank]`` this rank's; ``out``
    is this rank's band [M / world_size, N]; ``group_name`` is unused here (Helion's ``hl.ProcessGroupName``).
    """
    band_m, n = out.shape
    a = tma_a(a)
    b, b_trans = b_operand(b, b_layout)
    workspace = peers[rank]
    b_box = [block_n, block_k] if b_trans else [block_k, block_n]
    launcher(
        gemm_reduce_scatter_kernel, (num_blocks,),
        tma_operand(a, [block_m, block_k]), tma_operand(b, b_box),
        scale_a, scale_b, workspace, peers, parity, epochs, out, signal_pad_ptrs, band_m, n, a.shape[1],
        *workspace.stride()[:2], num_blocks, rank, len(peers),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, GROUP_M=group_m, B_TRANS=b_trans, SCALED=True,
        A_ROWWISE=int(scale_a.numel() > 1), B_COLWISE=int(scale_b.numel() > 1), num_warps=num_warps,
        num_stages=num_stages,
    )
    return out


def plan(m: int, n: int, k: int, world_size: int, config: dict, num_sms: int) -> dict:
    """Resolve the launch configuration (shared with the Helion port): the bf16 recipe's tiles for the band
    (``gemm_reduce_scatter.default_config``) with k steps twice as long, up to ``MAX_BLOCK_K`` (the same
    bytes per stage), and its persistent grid (``with_grid``)."""
    groups.resolve_config(config, DEFAULT_CONFIG, OP)  # rejects unknown keys
    chosen = {key: value for key, value in config.items() if value is not None}
    tiles = default_config(m, n, k, num_sms, world_size)
    tiles["block_k"] = min(2 * tiles["block_k"], MAX_BLOCK_K)
    if tiles["num_warps"] == 4:  # the skinny tiles: fp8 stages hold half the bytes of bf16's, so more of them
        stage = (tiles["block_m"] + tiles["block_n"]) * tiles["block_k"]
        tiles.update(num_warps=SKINNY_WARPS, num_stages=min(SKINNY_STAGE_BYTES // stage, SKINNY_STAGES))
    cfg = {**DEFAULT_CONFIG, **tiles, **chosen}
    check_tiles(cfg, OP, least_block_k=32)
    if cfg["block_k"] > MAX_BLOCK_K:
        raise ValueError(f"{OP}: block_k must be <= {MAX_BLOCK_K} (one TMA swizzle row of fp8), got {cfg['block_k']}")
    if cfg["b_layout"] not in B_LAYOUTS:
        raise ValueError(f"{OP}: b_layout must be one of {B_LAYOUTS}, got {cfg['b_layout']!r}")
    return with_grid(cfg, m, n, world_size, num_sms, ("b_layout", *LAUNCH_KEYS))


def check_inputs(a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor,
                 out_dtype: torch.dtype, op: str) -> None:
    """Argument checks that need neither a GPU nor torch.distributed (``kraken._gemm_core``'s fp8 checks, and
    the output dtype)."""
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
        world_size, cfg = planned(a, b, group, config, op, plan)
    return with_workspace(a, b.shape[1], world_size, cfg, out_dtype, group, op)


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
    ``config`` overrides the tiles, ``group_m``, ``max_blocks`` and ``b_layout`` (see ``plan``); ``form="fused"``
    or ``"sequential"`` forces the form ``kraken.crossover`` would choose by size.
    """
    return call(launch, OP, a, b, scale_a, scale_b, group, out_dtype, config, sm_reduce_scatter)


def call(launch, op: str, a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor, group,
         out_dtype: torch.dtype, config: dict, reduce_scatter) -> torch.Tensor:
    """``gemm_reduce_scatter_fp8`` with a given ``launch`` and ``reduce_scatter`` (the recipe's or its twin's) under
    the name ``op``, in the form ``kraken.crossover`` chooses: sequential, ``scaled_mm_then_reduce_scatter``; else the
    prepared call and its launch."""
    prepared = chosen(a, b, scale_a, scale_b, group, out_dtype, op, config)
    if prepared == crossover.SEQUENTIAL:
        return scaled_mm_then_reduce_scatter(reduce_scatter, a, b, scale_a, scale_b, group)
    ctx, launch_cfg = prepared
    out = torch.empty(a.shape[0] // ctx.world_size, b.shape[1], dtype=out_dtype, device=a.device)
    return replay.prepared_launch(launch, (a, b, scale_a, scale_b), ctx, launch_cfg, out)


@prepared.per_signature(lambda a, b, scale_a, scale_b, group, out_dtype, op, config: (
    op, group, prepared.tensor_key(a), prepared.tensor_key(b), prepared.tensor_key(scale_a), prepared.tensor_key(scale_b),
    out_dtype, prepared.config_key(config)))
def chosen(a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor, group,
           out_dtype: torch.dtype, op: str, config: dict):
    """``kraken.crossover.SEQUENTIAL`` or the fused form's ``prepare``, kept per signature (``crossover.fused_prepared``);
    sequential only for a bf16 output (``torch._scaled_mm``'s with row-wise scales) and K and N multiples of 16."""
    sequential_ok = out_dtype == torch.bfloat16 and all(
        isinstance(t, torch.Tensor) and t.dim() == 2 and t.shape[1] % 16 == 0 for t in (a, b))
    return crossover.fused_prepared(
        op, a, b, group, False, sequential_ok, config, check_sequential,
        lambda fused_config: prepare(a, b, scale_a, scale_b, group, out_dtype, op, fused_config), None,
        (scale_a, scale_b))


def check_sequential(a: torch.Tensor, b: torch.Tensor, world_size: int, op: str, scale_a: torch.Tensor,
                     scale_b: torch.Tensor) -> None:
    """The sequential form's checks (``kraken.crossover.form`` runs them inside its agreement)."""
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
