"""gemm_reduce_scatter: this rank's rows of ``sum over ranks of a_r @ b_r``, the row-parallel linear layer
of sequence parallelism.

Every rank holds ``a`` [M, K] and ``b`` [K, N] (its slice of the reduction dimension) and keeps rows
``[rank * M / ws, (rank + 1) * M / ws)`` of the summed [M, N] product, here in bf16. Backends:

* ``nccl``: ``torch.matmul`` (cuBLAS, the partial in the input dtype), then
  ``dist.reduce_scatter_tensor`` on it in that dtype;
* ``torch_fused``: ``torch.ops.symm_mem.fused_matmul_reduce_scatter`` (torch's own decomposition into
  per-chunk matmuls and symmetric-memory copies);
* ``matmul``: ``torch.matmul`` alone, the floor column: it computes every rank's partial product and
  exchanges nothing, so its result is not this op's and the harness times it without checking it
  (``Op.reference_free``);
* ``triton`` / ``helion``: the fused kraken recipe and its Helion twin, ``out_dtype=bf16`` (bf16
  partials over NVLink, the same bytes as the baselines).

For fp16 inputs the baselines reduce in fp16 and cast the result to bf16 at the end.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from benchmark.ops.gemm_all_reduce import HBM_GBPS, rank_operands, sequential
from benchmark.registry import Op, Pair, gemm_us, public, register
from benchmark.sm90 import FAKE_SIGNAL_PADS, H200_NUM_SMS

RECIPE = "fused.gemm_reduce_scatter"
OUT_DTYPE = torch.bfloat16
# Odd N and K (unaligned: TMA operands padded), band rows not a multiple of the tile: every tail masked.
# M is picked per world size (``example_shape``): 24 bands of 5 rows plus a tail make M = 120 + ...
EXAMPLE_N, EXAMPLE_K = 200, 72
DEFAULT_SHAPES = [(1024, 6656, 2560), (2048, 14336, 4096), (8192, 14336, 4096), (256, 8192, 4096), (512, 8192, 4096)]


def example_shape(world_size: int) -> tuple[int, int, int]:
    """An odd-tailed shape whose M splits over ``world_size`` ranks: 37 rows per band (a group of one: 74, so
    that M is not smaller than a 64-row tile, which the Helion twin would load through pointers, not TMA)."""
    return (37 * max(world_size, 2), EXAMPLE_N, EXAMPLE_K)


# ---------------------------------------------------------------------------
# Inputs and backends
# ---------------------------------------------------------------------------


def make_inputs(shape, dtype, seed):
    if dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"gemm_reduce_scatter: inputs must be bf16 or fp16, got {dtype}")
    m, n, _ = shape
    world_size = dist.get_world_size()
    if m % world_size:
        raise ValueError(f"gemm_reduce_scatter: M = {m} does not split over {world_size} ranks")
    a, b = rank_operands(shape, dtype, seed, dist.get_rank())
    return {"a": a, "b": b, "band": torch.empty(m // world_size, n, dtype=dtype, device="cuda")}


def nccl(i):
    partial = torch.matmul(i["a"], i["b"])
    dist.reduce_scatter_tensor(i["band"], partial)
    return i["band"].to(OUT_DTYPE)


def torch_fused(i):
    out = torch.ops.symm_mem.fused_matmul_reduce_scatter(i["a"], i["b"], "sum", 0, dist.group.WORLD.group_name)
    return out.to(OUT_DTYPE)


def matmul(i):
    return torch.matmul(i["a"], i["b"])


def fused(package: str, form: str | None = None):
    """The recipe (``package`` kraken) or its twin (helion_ports) in the form ``kraken.runtime.crossover`` chooses, or
    ``form`` ("fused": the overlapping kernel; "sequential": the SM-driven collective and cuBLAS one after the
    other)."""
    path = f"{package}.{RECIPE}"
    fn = public(path)
    if form is None:
        return lambda i: fn(i["a"], i["b"], out_dtype=OUT_DTYPE)
    if form == "sequential":
        return sequential(fn)
    return lambda i: fn(i["a"], i["b"], out_dtype=OUT_DTYPE, form=form)


# ---------------------------------------------------------------------------
# CPU compile example (benchmark.sm90)
# ---------------------------------------------------------------------------


def example(module, world_size: int, shape=None, dtype=torch.bfloat16, out_dtype=OUT_DTYPE, rank: int | None = None,
            config: dict | None = None) -> None:
    """Call ``module.launch`` on CPU stand-ins (the recipe and its twin: the same ``plan`` and ``launch`` arguments)."""
    m, n, k = shape or example_shape(world_size)
    a, b = torch.randn(m, k, dtype=dtype), torch.randn(k, n, dtype=dtype)
    cfg = module.plan(m, n, k, world_size, config or {}, H200_NUM_SMS)
    module.launch(a, b, *stand_ins(module, m, n, world_size, cfg, out_dtype, rank), **cfg)


def stand_ins(module, m: int, n: int, world_size: int, cfg: dict, out_dtype, rank: int | None) -> tuple:
    """CPU stand-ins for ``launch``'s (peers, out, signal_pad_ptrs, rank, parity, epochs): every rank's
    workspace as ``prepare`` views it (``module.rounds_of``, ``module.chunk_tile``), this rank's band; ``rank``
    None: 1, or 0 in a group of one."""
    rank = min(1, world_size - 1) if rank is None else rank
    rounds = module.rounds_of(m, n, world_size, cfg)
    tile = module.chunk_tile(cfg, world_size)
    peers = tuple(torch.empty(2, H200_NUM_SMS, rounds, *tile, dtype=out_dtype) for _ in range(world_size))
    parity, epochs = torch.zeros(H200_NUM_SMS, dtype=torch.int32), torch.zeros(H200_NUM_SMS, dtype=torch.int32)
    out = torch.empty(m // world_size, n, dtype=out_dtype)
    return peers, out, FAKE_SIGNAL_PADS, rank, parity, epochs


# ---------------------------------------------------------------------------
# Registration
# ---------------------------------------------------------------------------


def nvlink_bytes(shape, dtype, world_size):
    # What any reduce-scatter of the [M, N] bf16 partial must receive per rank: (ws-1)/ws of its band's worth.
    m, n, _ = shape
    return (world_size - 1) / world_size * m * n * OUT_DTYPE.itemsize


def floor_us(shape, dtype, world_size):
    # The matmul alone (at 790 TFLOP/s, or reading a and b at HBM speed): the exchange can hide under it.
    m, n, k = shape
    return max(gemm_us(2 * m * n * k), (m * k + k * n) * dtype.itemsize / (HBM_GBPS * 1e3))


register(
    Op(
        name="gemm_reduce_scatter",
        description="this rank's M / ws rows of sum over ranks of a @ b (a [M, K], b [K, N]), bf16 out",
        make_inputs=make_inputs,
        backends={"nccl": nccl, "torch_fused": torch_fused, "matmul": matmul, "triton": fused("kraken"),
                  "helion": fused("helion_ports"), "triton_fused": fused("kraken", "fused"),
                  "triton_seq": fused("kraken", "sequential")},
        default_shapes=DEFAULT_SHAPES,
        shape_format="MxNxK",
        nvlink_bytes=nvlink_bytes,
        floor_us=floor_us,
        pairs=[Pair("triton", "helion", f"kraken.{RECIPE}", f"helion_ports.{RECIPE}", example)],
        reference_free=frozenset({"matmul"}),
        library="matmul",  # the one-GPU core table's library column (world size 1)
        work=lambda shape, dtype: (2.0 * shape[0] * shape[1] * shape[2], "flop"),
    )
)
