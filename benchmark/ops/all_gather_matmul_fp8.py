"""all_gather_matmul_fp8: ``_scaled_mm(all_gather(a), b, all_gather(scale_a), scale_b)``, bf16 out.

Shapes are ``MxNxK`` with M the TOTAL rows (divisible by the world size): every rank holds ``a``
[M / world_size, K] in ``float8_e4m3fn`` with row-wise scales ``scale_a`` [M / ws, 1] (its own rows'
amax / 448) and the same column-major ``b`` [K, N] (``w.t()`` of an [N, K] weight, the layout
``torch._scaled_mm`` takes) with column-wise ``scale_b`` [1, N]. ``--dtype`` is the output's and must
be bf16 (the default). Backends:

* ``nccl``: ``dist.all_gather_into_tensor`` of ``a`` (its bytes) and of ``scale_a``, then
  ``torch._scaled_mm`` (cuBLASLt fp8, fp32 accumulation, bf16 out);
* ``torch_fused``: ``torch.ops.symm_mem.fused_all_gather_scaled_matmul`` (torch 2.11 has it and
  takes fp8 with row-wise ``A_scale`` sharded like ``A``: the async-TP decomposition, one
  ``_scaled_mm`` per chunk);
* ``scaled_mm``: ``torch._scaled_mm`` alone on the already gathered ``a`` and scales, the floor the fused
  kernels aim for (timed, not compared: it does no exchange);
* ``triton`` / ``helion``: ``kraken.fused.all_gather_matmul_fp8`` and its Helion twin.
"""

from __future__ import annotations


import torch
import torch.distributed as dist

from benchmark.ops.all_gather_matmul import DEFAULT_SHAPES
from benchmark.registry import Op, Pair, public, register
from benchmark.sm90 import H200_NUM_SMS
from kraken._gemm_core import tma_fp8

RECIPE = "fused.all_gather_matmul_fp8"
FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
OUT_DTYPE = torch.bfloat16
FP8_TFLOPS = 1580.0  # dense fp8 matmul on H200, assumed twice the measured bf16 rate (790 TFLOP/s)
# Rows per rank, N and K not multiples of the tiles, K not a multiple of 16 (b padded for TMA), every TMA box
# inside its tensor (Helion loads a box larger than its tensor through pointers): K >= the 128-wide k step.
EXAMPLE_SHAPE = (100, 200, 136)  # rows per rank, N, K


# ---------------------------------------------------------------------------
# Inputs
# ---------------------------------------------------------------------------


def quantize(x: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` (float32) as fp8 e4m3 and the float32 scales along ``dim`` (amax / 448 per row or column):
    ``x ~= fp8 * scale``."""
    scale = x.abs().amax(dim=dim, keepdim=True).clamp_min(1e-12) / FP8_MAX
    return (x / scale).to(FP8), scale.float()


def rank_operands(shape, seed: int, rank: int, world_size: int, device="cuda", per_tensor: bool = False):
    """Rank ``rank``'s ``a`` shard [M / ws, K] and ``scale_a``, and the shared column-major ``b`` [K, N] and
    ``scale_b``: row- and column-wise scales, or one per tensor (the largest of them). Any rank can rebuild
    any other's (float64 references)."""
    m, n, k = shape
    gen = torch.Generator(device=device).manual_seed(seed * 1000 + rank)
    x = torch.randn(m // world_size, k, dtype=torch.float32, device=device, generator=gen)
    x = x * (1 + torch.rand(m // world_size, 1, device=device, generator=gen) * 7)  # rows of different ranges
    gen.manual_seed(seed * 1000 + 999)
    w = torch.randn(n, k, dtype=torch.float32, device=device, generator=gen)
    w = w * (1 + torch.rand(n, 1, device=device, generator=gen) * 3)
    if per_tensor:
        scale_a = x.abs().amax().clamp_min(1e-12).reshape(()) / FP8_MAX
        scale_b = w.abs().amax().clamp_min(1e-12).reshape(()) / FP8_MAX
        a, w8 = (x / scale_a).to(FP8), (w / scale_b).to(FP8)
        return a, w8.t(), scale_a.float(), scale_b.float()
    a, scale_a = quantize(x, 1)
    w8, scale_w = quantize(w, 1)
    return a, w8.t(), scale_a, scale_w.t().contiguous()


def dequantized(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``x * scale`` in float64 (``scale`` per tensor, [rows, 1] or [1, cols]): the operand the fp8 values stand for."""
    return x.double() * scale.double()


def make_inputs(shape, dtype, seed):
    if dtype != OUT_DTYPE:
        raise ValueError(f"all_gather_matmul_fp8: --dtype is the output's and must be bf16, got {dtype}")
    world_size = dist.get_world_size()
    if shape[0] % world_size:
        raise ValueError(f"all_gather_matmul_fp8: M = {shape[0]} (total rows) must be divisible by the world size "
                         f"{world_size}")
    a, b, scale_a, scale_b = rank_operands(shape, seed, dist.get_rank(), world_size)
    gathered, gathered_scale = gather(a, scale_a)  # for the scaled_mm-alone backend only
    return {"a": a, "b": b, "scale_a": scale_a, "scale_b": scale_b, "gathered": gathered,
            "gathered_scale": gathered_scale}


# ---------------------------------------------------------------------------
# Backends
# ---------------------------------------------------------------------------


def gather(a: torch.Tensor, scale_a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """NCCL all-gathers of ``a`` (as bytes) and of its row scales."""
    world_size = dist.get_world_size()
    gathered = torch.empty(world_size * a.shape[0], a.shape[1], dtype=torch.uint8, device=a.device)
    dist.all_gather_into_tensor(gathered, a.view(torch.uint8))
    scales = torch.empty(world_size * a.shape[0], 1, dtype=torch.float32, device=a.device)
    dist.all_gather_into_tensor(scales, scale_a)
    return gathered.view(FP8), scales


def nccl(i):
    gathered, scales = gather(i["a"], i["scale_a"])
    return torch._scaled_mm(gathered, i["b"], scales, i["scale_b"], out_dtype=OUT_DTYPE)


def unsupported_as_error(fn):
    """A torch op that refuses these inputs at run time (a RuntimeError, the same on every rank) becomes the
    harness's "error (...)" cell instead of ending the run."""
    def call(i):
        try:
            return fn(i)
        except RuntimeError as exc:
            raise NotImplementedError(str(exc).splitlines()[0]) from exc
    return call


@unsupported_as_error
def torch_fused(i):
    _, (out,) = torch.ops.symm_mem.fused_all_gather_scaled_matmul(
        i["a"], [i["b"]], i["scale_a"], [i["scale_b"]], 0, dist.group.WORLD.group_name, [None], [None], [OUT_DTYPE],
        [False])
    return out


def scaled_mm(i):
    return torch._scaled_mm(i["gathered"], i["b"], i["gathered_scale"], i["scale_b"], out_dtype=OUT_DTYPE)


def fused(package: str, form: str | None = None):
    """The recipe (``package`` kraken) or its twin in the form ``kraken.runtime.crossover`` chooses, or ``form``."""
    path = f"{package}.{RECIPE}"
    fn = public(path)
    if form is None:
        return lambda i: fn(i["a"], i["b"], i["scale_a"], i["scale_b"])
    return lambda i: fn(i["a"], i["b"], i["scale_a"], i["scale_b"], form=form)


# ---------------------------------------------------------------------------
# CPU compile example (benchmark.sm90)
# ---------------------------------------------------------------------------


def example(module, world_size: int, shape=EXAMPLE_SHAPE, b_layout: str = "auto", per_tensor_b: bool = False,
            **config) -> None:
    """Launch the GEMM (``module.launch_matmul``; staging and the gather are host code and one-block barriers)
    on CPU stand-ins; ``shape`` is (rows per rank, N, K), ``b`` column-major (``w.t()``)."""
    m, n, k = shape
    w = torch.randn(n, k).to(FP8)
    b = w.t() if b_layout != "kn" else w.t().contiguous()
    cfg = module.plan(m, n, k, world_size, {"b_layout": b_layout, **config}, H200_NUM_SMS)
    b, b_trans = module.b_operand(b, cfg.pop("b_layout"))
    a = tma_fp8(torch.randn(m, k).to(FP8), cfg["block_m"])  # my rows as TMA reads them (padded: odd K, M)
    gathered = torch.zeros(world_size * m, module.row_bytes(k), dtype=torch.uint8)
    scale_b = torch.ones(()) if per_tensor_b else torch.ones(1, n)
    out = torch.empty(world_size * m, n, dtype=OUT_DTYPE)
    progress = torch.zeros(world_size + 4, dtype=torch.int32)
    module.launch_matmul(a, torch.ones(m, 1), gathered, b, scale_b, out, progress, min(1, world_size - 1), world_size,
                         k, b_trans, **cfg)


# ---------------------------------------------------------------------------
# Registration
# ---------------------------------------------------------------------------


def nvlink_bytes(shape, dtype, world_size):
    # Every rank receives the other ranks' rows of a (one byte per value) and their scales.
    m, _, k = shape
    return (world_size - 1) / world_size * m * (k + 4)


def floor_us(shape, dtype, world_size):
    # The fp8 GEMM at FP8_TFLOPS; the gather can hide under it.
    m, n, k = shape
    return 2 * m * n * k / (FP8_TFLOPS * 1e6)


register(
    Op(
        name="all_gather_matmul_fp8",
        description="_scaled_mm(all_gather(a), b) in fp8 e4m3 (a [M/ws, K] per rank, row scales gathered too; "
                    "b [K, N] column-major, column scales), bf16 out; shapes MxNxK with M the total rows",
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
