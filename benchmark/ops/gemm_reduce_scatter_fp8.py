"""gemm_reduce_scatter_fp8: this rank's rows of ``sum over ranks of _scaled_mm(a_r, b_r, scale_a_r, scale_b_r)``.

Every rank holds ``a`` [M, K] in ``float8_e4m3fn`` with row-wise ``scale_a`` [M, 1] and a column-major ``b``
[K, N] (``w.t()``, the layout ``torch._scaled_mm`` takes) with column-wise ``scale_b`` [1, N], its slice of the
reduction dimension, and keeps rows ``[rank * M / ws, (rank + 1) * M / ws)`` of the summed product in bf16.
``--dtype`` is the output's and must be bf16 (the default). Backends:

* ``nccl``: ``torch._scaled_mm`` (cuBLASLt fp8, bf16 out), then ``dist.reduce_scatter_tensor`` in bf16;
* ``torch_fused``: ``torch.ops.symm_mem.fused_scaled_matmul_reduce_scatter`` (torch 2.11 has it and takes
  fp8 with row-wise ``A_scale``: per-chunk ``_scaled_mm`` and symmetric-memory copies), bf16 out;
* ``scaled_mm``: ``torch._scaled_mm`` alone, the floor column (every rank's partial, no exchange: timed,
  not compared);
* ``triton`` / ``helion``: ``kraken.gemm_reduce_scatter_fp8`` (the installed recipe) and its Helion twin,
  bf16 partials over NVLink (the same bytes as the baselines).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from benchmark.ops.all_gather_matmul_fp8 import FP8_TFLOPS, OUT_DTYPE, rank_operands, unsupported_as_error
from benchmark.ops.gemm_all_reduce import HBM_GBPS
from benchmark.ops.gemm_reduce_scatter import DEFAULT_SHAPES, stand_ins
from benchmark.registry import Op, Pair, public, register
from benchmark.sm90 import H200_NUM_SMS

RECIPE = "fused.gemm_reduce_scatter_fp8"
# Odd N and K (K not a multiple of 16: a padded for TMA), band rows not a multiple of the tile: every tail
# masked; K >= the 128-wide k step (every TMA box inside its tensor, for the twin).
EXAMPLE_N, EXAMPLE_K = 200, 136


def example_shape(world_size: int) -> tuple[int, int, int]:
    """An odd-tailed shape whose M splits over ``world_size`` ranks: 37 rows per band (a group of one: 74, so
    that M is not smaller than a 64-row tile, which the Helion twin would load through pointers, not TMA)."""
    return (37 * max(world_size, 2), EXAMPLE_N, EXAMPLE_K)


def operands(shape, seed: int, rank: int, device="cuda", per_tensor: bool = False):
    """Rank ``rank``'s ``a`` [M, K], column-major ``b`` [K, N] and their scales (any rank can rebuild any other's)."""
    m, n, k = shape
    return rank_operands((m, n, k), seed + 7919 * rank, 0, 1, device=device, per_tensor=per_tensor)


# ---------------------------------------------------------------------------
# Inputs and backends
# ---------------------------------------------------------------------------


def make_inputs(shape, dtype, seed):
    if dtype != OUT_DTYPE:
        raise ValueError(f"gemm_reduce_scatter_fp8: --dtype is the output's and must be bf16, got {dtype}")
    m, n, _ = shape
    world_size = dist.get_world_size()
    if m % world_size:
        raise ValueError(f"gemm_reduce_scatter_fp8: M = {m} does not split over {world_size} ranks")
    a, b, scale_a, scale_b = operands(shape, seed, dist.get_rank())
    return {"a": a, "b": b, "scale_a": scale_a, "scale_b": scale_b,
            "band": torch.empty(m // world_size, n, dtype=OUT_DTYPE, device="cuda")}


def nccl(i):
    partial = torch._scaled_mm(i["a"], i["b"], i["scale_a"], i["scale_b"], out_dtype=OUT_DTYPE)
    dist.reduce_scatter_tensor(i["band"], partial)
    return i["band"]


@unsupported_as_error
def torch_fused(i):
    m, n = i["a"].shape[0], i["b"].shape[1]
    return torch.ops.symm_mem.fused_scaled_matmul_reduce_scatter(
        i["a"], i["b"], i["scale_a"], i["scale_b"], "sum", 0, 0, dist.group.WORLD.group_name, [m, n],
        out_dtype=OUT_DTYPE)


def scaled_mm(i):
    return torch._scaled_mm(i["a"], i["b"], i["scale_a"], i["scale_b"], out_dtype=OUT_DTYPE)


def fused(package: str, form: str | None = None):
    """The recipe (``package`` kraken) or its twin (helion_ports) in the form ``kraken.crossover`` chooses, or
    ``form`` ("fused": the overlapping kernel; "sequential": ``torch._scaled_mm``, then the SM-driven
    reduce-scatter)."""
    path = f"{package}.{RECIPE}"
    fn = public(path)
    extra = {} if form is None else {"form": form}
    return lambda i: fn(i["a"], i["b"], i["scale_a"], i["scale_b"], out_dtype=OUT_DTYPE, **extra)


# ---------------------------------------------------------------------------
# CPU compile example (benchmark.sm90)
# ---------------------------------------------------------------------------


def example(module, world_size: int, shape=None, out_dtype=OUT_DTYPE, rank: int | None = None, per_tensor: bool = False,
            config: dict | None = None) -> None:
    """Call ``module.launch`` on CPU stand-ins (the recipe and its twin: the same ``plan`` and ``launch`` arguments)."""
    m, n, k = shape or example_shape(world_size)
    a, b = torch.randn(m, k).to(torch.float8_e4m3fn), torch.randn(n, k).to(torch.float8_e4m3fn).t()
    scale_a, scale_b = (torch.ones(()), torch.ones(())) if per_tensor else (torch.ones(m, 1), torch.ones(1, n))
    cfg = module.plan(m, n, k, world_size, config or {}, H200_NUM_SMS)
    module.launch(a, b, scale_a, scale_b, *stand_ins(module, m, n, world_size, cfg, out_dtype, rank), **cfg)


# ---------------------------------------------------------------------------
# Registration
# ---------------------------------------------------------------------------


def nvlink_bytes(shape, dtype, world_size):
    # What any reduce-scatter of the [M, N] bf16 partial must receive per rank.
    m, n, _ = shape
    return (world_size - 1) / world_size * m * n * OUT_DTYPE.itemsize


def floor_us(shape, dtype, world_size):
    # The fp8 matmul alone (at FP8_TFLOPS, or reading a and b at HBM speed): the exchange can hide under it.
    m, n, k = shape
    return max(2 * m * n * k / (FP8_TFLOPS * 1e6), (m * k + k * n) / (HBM_GBPS * 1e3))


register(
    Op(
        name="gemm_reduce_scatter_fp8",
        description="this rank's M / ws rows of sum over ranks of _scaled_mm(a, b) in fp8 e4m3 (a [M, K] row "
                    "scales, b [K, N] column-major, column scales), bf16 out",
        make_inputs=make_inputs,
        backends={"nccl": nccl, "torch_fused": torch_fused, "scaled_mm": scaled_mm, "triton": fused("kraken"),
                  "helion": fused("helion_ports"), "triton_fused": fused("kraken", "fused"),
                  "triton_seq": fused("kraken", "sequential")},
        default_shapes=list(DEFAULT_SHAPES),  # the bf16 op's
        shape_format="MxNxK",
        nvlink_bytes=nvlink_bytes,
        floor_us=floor_us,
        pairs=[Pair("triton", "helion", f"kraken.{RECIPE}", f"helion_ports.{RECIPE}", example)],
        reference_free=frozenset({"scaled_mm"}),
        library="scaled_mm",  # the one-GPU core table's library column (world size 1)
        work=lambda shape, dtype: (2.0 * shape[0] * shape[1] * shape[2], "flop"),
    )
)
