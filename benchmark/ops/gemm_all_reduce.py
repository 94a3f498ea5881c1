"""gemm_all_reduce: ``sum over ranks of a_r @ b_r``, the row-parallel linear layer of tensor parallelism.

Every rank holds ``a`` [M, K] and ``b`` [K, N] (its slice of the reduction
dimension) and all need the summed [M, N] product, here in bf16. Backends:

* ``nccl``: ``torch.matmul`` (cuBLAS; the partial product comes out in the
  input dtype, rounded once), then ``dist.all_reduce`` on it in that dtype;
* ``symm_mem``: ``torch.matmul`` straight into a symmetric buffer (input dtype),
  then torch's ``one_shot_all_reduce`` kernel;
* ``matmul``: ``torch.matmul`` alone (cuBLAS), the floor column: this rank's partial
  with no exchange, so the harness times it without checking it (``Op.reference_free``);
* ``triton`` / ``helion``: the fused kraken recipe and its Helion twin, one
  launch each, ``out_dtype=bf16`` (so their workspace partials are bf16 too, the
  same bytes over NVLink as the baselines), in the form the recipe picks for the shape;
* ``triton_1shot`` / ``helion_1shot`` and ``triton_2shot`` / ``helion_2shot``: the same with the form
  forced (``shot`` in ``config``): one-shot (pushing or pulling, as the recipe would for M rows) and two-shot.
  ``--backends nccl,triton,helion`` keeps the table to the default form.

bf16 inputs give a bf16 result everywhere. For fp16 inputs the two baselines
reduce in fp16 and cast the sum to bf16 at the end (one extra small kernel).
"""

from __future__ import annotations

import importlib

import torch
import torch.distributed as dist

from benchmark.registry import Op, Pair, SYNC_US, gemm_us, nvlink_us, public, register
from kraken.runtime.symm import symm_empty
from benchmark.sm90 import FAKE_SIGNAL_PADS, H200_NUM_SMS

RECIPE = "fused.gemm_one_shot_all_reduce"
OUT_DTYPE = torch.bfloat16
HBM_GBPS = 4800.0  # H200 HBM3e peak (spec sheet, not measured): the floor of a GEMM bound by reading b
EXAMPLE_SHAPE = (100, 200, 72)  # odd M and N, K not a multiple of the tile: every tail is masked

_symm_buffers: dict[tuple, torch.Tensor] = {}


# ---------------------------------------------------------------------------
# Inputs
# ---------------------------------------------------------------------------


def rank_operands(shape, dtype, seed: int, rank: int, device="cuda") -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s ``a`` and ``b``; any rank can rebuild any other's (the GPU tests' float64 reference does)."""
    m, n, k = shape
    gen = torch.Generator(device=device).manual_seed(seed * 1000 + rank)
    a = torch.randn(m, k, dtype=torch.float32, device=device, generator=gen).to(dtype)
    b = torch.randn(k, n, dtype=torch.float32, device=device, generator=gen).to(dtype)
    return a, b


def make_inputs(shape, dtype, seed):
    if dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"gemm_all_reduce: inputs must be bf16 or fp16, got {dtype}")
    m, n, k = shape
    a, b = rank_operands(shape, dtype, seed, dist.get_rank())
    key = (m, n, dtype)
    if key not in _symm_buffers:  # collective on first use; every rank asks for the same shapes
        _symm_buffers[key] = symm_empty((m, n), dtype)
    # The one-shot form the recipe would pick at M rows (what "1shot" forces): worked out here, not per timed call.
    one_shot = importlib.import_module(f"kraken.{RECIPE}").one_shot_form(m, dist.get_world_size())
    return {"a": a, "b": b, "symm": _symm_buffers[key], "one_shot_form": one_shot}


# ---------------------------------------------------------------------------
# Backends
# ---------------------------------------------------------------------------


def nccl(i):
    partial = torch.matmul(i["a"], i["b"])
    dist.all_reduce(partial)
    return partial.to(OUT_DTYPE)


def symm_mem(i):
    torch.matmul(i["a"], i["b"], out=i["symm"])
    return torch.ops.symm_mem.one_shot_all_reduce(i["symm"], "sum", dist.group.WORLD.group_name).to(OUT_DTYPE)


def matmul(i):
    return torch.matmul(i["a"], i["b"])


def sequential(fn):
    """``fn``'s sequential form (cuBLAS, then the SM-driven collective), which sums in ``a``'s dtype: unsupported
    (``NotImplementedError``, a skipped row, not an error) where the output dtype is another."""
    def call(i):
        if i["a"].dtype != OUT_DTYPE:
            raise NotImplementedError(f"the sequential form returns a's dtype ({i['a'].dtype}), not {OUT_DTYPE}")
        return fn(i["a"], i["b"], out_dtype=OUT_DTYPE, form="sequential")
    return call


def fused(package: str, shot: str | None = None):
    """The recipe (``package`` kraken) or its twin (helion_ports) in the form it picks, or ``shot``: "1shot" (one-shot,
    pushing or pulling as the recipe would for M rows), "2shot" or "seq" (cuBLAS, then the SM-driven all-reduce)."""
    fn = public(f"{package}.{RECIPE}")
    if shot is None:
        return lambda i: fn(i["a"], i["b"], out_dtype=OUT_DTYPE)
    if shot == "seq":
        return sequential(fn)
    if shot == "2shot":
        return lambda i: fn(i["a"], i["b"], out_dtype=OUT_DTYPE, shot="two")
    # the twin takes the recipe's forms, and has no chooser: make_inputs worked out the recipe's one-shot form
    return lambda i: fn(i["a"], i["b"], out_dtype=OUT_DTYPE, shot=i["one_shot_form"])


# ---------------------------------------------------------------------------
# CPU compile example (benchmark.sm90)
# ---------------------------------------------------------------------------


def example(module, world_size: int, shape=EXAMPLE_SHAPE, dtype=torch.bfloat16, out_dtype=OUT_DTYPE,
            rank: int | None = None, config: dict | None = None) -> None:
    """Call ``module.launch`` on CPU stand-ins (the recipe and its twin: the same ``plan`` and ``launch`` arguments) as
    ``rank`` (default 1, or 0 in a group of one), with ``config`` (default: the recipe's choices)."""
    m, n, k = shape
    a, b = torch.randn(m, k, dtype=dtype), torch.randn(k, n, dtype=dtype)
    cfg = module.plan(m, n, k, world_size, config or {}, H200_NUM_SMS)
    tile = module.chunk_tile(cfg, world_size)
    rounds = module.rounds_of(m, n, cfg)
    peers = tuple(torch.empty(2, H200_NUM_SMS, rounds, *tile, dtype=out_dtype) for _ in range(world_size))
    parity, epochs = torch.zeros(H200_NUM_SMS, dtype=torch.int32), torch.zeros(H200_NUM_SMS, dtype=torch.int32)
    partials = torch.empty(H200_NUM_SMS, 2, *tile[1:])
    out = torch.empty(m, n, dtype=out_dtype)
    rank = min(1, world_size - 1) if rank is None else rank
    module.launch(a, b, peers, out, FAKE_SIGNAL_PADS, rank, parity, epochs, partials, FAKE_SIGNAL_PADS, **cfg)


# ---------------------------------------------------------------------------
# Registration
# ---------------------------------------------------------------------------


def nvlink_bytes(shape, dtype, world_size):
    # The least any all-reduce of the [M, N] bf16 result must receive per rank: (ws-1)/ws of it, twice.
    m, n, _ = shape
    return 2 * (world_size - 1) / world_size * m * n * OUT_DTYPE.itemsize


def floor_us(shape, dtype, world_size):
    m, n, k = shape
    compute = max(gemm_us(2 * m * n * k), (m * k + k * n) * dtype.itemsize / (HBM_GBPS * 1e3))
    return compute + nvlink_us(nvlink_bytes(shape, dtype, world_size)) + 2 * SYNC_US


register(
    Op(
        name="gemm_all_reduce",
        description="sum over ranks of a @ b (a [M, K], b [K, N]), bf16 out",
        make_inputs=make_inputs,
        backends={"nccl": nccl, "symm_mem": symm_mem, "matmul": matmul, "triton": fused("kraken"),
                  "helion": fused("helion_ports"), "triton_1shot": fused("kraken", "1shot"),
                  "helion_1shot": fused("helion_ports", "1shot"), "triton_2shot": fused("kraken", "2shot"),
                  "helion_2shot": fused("helion_ports", "2shot"), "triton_seq": fused("kraken", "seq")},
        default_shapes=[(m, 4096, 4096) for m in (64, 128, 256, 512, 1024, 2048)] + [(128, 8192, 8192),
                                                                                     (512, 5120, 5120)],
        shape_format="MxNxK",
        nvlink_bytes=nvlink_bytes,
        floor_us=floor_us,
        # One pair: the forced forms are the same two modules (``example``'s ``config`` compiles them).
        pairs=[Pair("triton", "helion", f"kraken.{RECIPE}", f"helion_ports.{RECIPE}", example)],
        reference_free=frozenset({"matmul"}),  # this rank's partial alone: timed, not compared
        library="matmul",  # the one-GPU core table's library column (world size 1)
        work=lambda shape, dtype: (2.0 * shape[0] * shape[1] * shape[2], "flop"),
    )
)
