"""all_gather_matmul: ``all_gather(a) @ b``, the column-parallel linear layer of sequence parallelism.

Shapes are ``MxNxK`` with M the TOTAL rows (divisible by the world size): every
rank holds ``a`` [M / world_size, K] and the same ``b`` [K, N]; every rank needs the
[M, N] product. Backends:

* ``nccl``: ``dist.all_gather_into_tensor`` then ``torch.matmul`` (cuBLAS);
* ``torch_fused``: ``torch.ops.symm_mem.fused_all_gather_matmul`` (torch's async-TP
  decomposition: copy-engine copies on a side stream, one cuBLAS GEMM per chunk); it
  takes the plain ``a`` shard and stages it into its own symmetric workspace;
* ``matmul``: ``torch.matmul`` on an already gathered ``a`` alone, the floor the fused
  kernels aim for (timed, not compared: it does no exchange);
* ``triton`` / ``helion``: the kraken recipe and its Helion twin.
"""

from __future__ import annotations


import torch
import torch.distributed as dist

from benchmark.registry import Op, Pair, gemm_us, public, register
from benchmark.sm90 import H200_NUM_SMS, example_rank

RECIPE = "fused.all_gather_matmul"
# Rows per rank, N and K not multiples of the tiles (N and K multiples of 8: TMA-aligned, no padding copy),
# every TMA box inside its tensor (Helion loads a box larger than its tensor through pointers).
EXAMPLE_SHAPE = (100, 200, 72)  # rows per rank, N, K
DEFAULT_SHAPES = [(1024, 6656, 5120), (2048, 14336, 8192), (8192, 14336, 8192), (256, 8192, 8192), (512, 8192, 8192)]


# ---------------------------------------------------------------------------
# Inputs
# ---------------------------------------------------------------------------


def rank_operands(shape, dtype, seed: int, rank: int, world_size: int, device="cuda") -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s ``a`` shard and the shared ``b``; any rank can rebuild any other's (float64 references)."""
    m, n, k = shape
    gen = torch.Generator(device=device).manual_seed(seed * 1000 + rank)
    a = torch.randn(m // world_size, k, dtype=torch.float32, device=device, generator=gen).to(dtype)
    gen.manual_seed(seed * 1000 + 999)
    b = torch.randn(k, n, dtype=torch.float32, device=device, generator=gen).to(dtype)
    return a, b


def make_inputs(shape, dtype, seed):
    if dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"all_gather_matmul: inputs must be bf16 or fp16, got {dtype}")
    world_size = dist.get_world_size()
    if shape[0] % world_size:
        raise ValueError(f"all_gather_matmul: M = {shape[0]} (total rows) must be divisible by the world size {world_size}")
    a, b = rank_operands(shape, dtype, seed, dist.get_rank(), world_size)
    gathered = torch.empty(shape[0], shape[2], dtype=dtype, device="cuda")
    dist.all_gather_into_tensor(gathered, a)  # for the matmul-alone backend only
    return {"a": a, "b": b, "gathered": gathered}


# ---------------------------------------------------------------------------
# Backends
# ---------------------------------------------------------------------------


def nccl(i):
    gathered = torch.empty(i["a"].shape[0] * dist.get_world_size(), i["a"].shape[1], dtype=i["a"].dtype, device="cuda")
    dist.all_gather_into_tensor(gathered, i["a"])
    return torch.matmul(gathered, i["b"])


def torch_fused(i):
    _, (out,) = torch.ops.symm_mem.fused_all_gather_matmul(i["a"], [i["b"]], 0, dist.group.WORLD.group_name,
                                                           return_A=False)
    return out


def matmul(i):
    return torch.matmul(i["gathered"], i["b"])


def fused(package: str, form: str | None = None):
    """The recipe (``package`` kraken) or its twin (helion_ports) in the form ``kraken.runtime.crossover`` chooses, or
    ``form`` ("fused": the overlapping kernel; "sequential": the SM-driven collective and cuBLAS one after the
    other)."""
    path = f"{package}.{RECIPE}"
    fn = public(path)
    if form is None:
        return lambda i: fn(i["a"], i["b"])
    return lambda i: fn(i["a"], i["b"], form=form)


# ---------------------------------------------------------------------------
# CPU compile example (benchmark.sm90)
# ---------------------------------------------------------------------------


def example(module, world_size: int, shape=EXAMPLE_SHAPE, dtype=torch.bfloat16, b_layout: str = "auto", **config) -> None:
    """Launch the GEMM (``module.launch_matmul``, the consumer; the gather needs no kernel but one-block
    barriers) on CPU stand-ins; ``shape`` is (rows per rank, N, K)."""
    m, n, k = shape
    a = torch.randn(m, k, dtype=dtype)
    b = torch.randn(k, n, dtype=dtype) if b_layout != "nk" else torch.randn(n, k, dtype=dtype).t()
    cfg = module.plan(m, n, k, world_size, {"b_layout": b_layout, **config}, H200_NUM_SMS)
    a, b, b_trans = module.tma_inputs(a, b, cfg.pop("b_layout"), cfg["block_m"])
    gathered = torch.empty(world_size * m, a.shape[1], dtype=dtype)
    out = torch.empty(world_size * m, n, dtype=dtype)
    progress = torch.zeros(world_size, dtype=torch.int32)
    module.launch_matmul(a, gathered, b, out, progress, example_rank(world_size), world_size, b_trans, **cfg)


# ---------------------------------------------------------------------------
# Registration
# ---------------------------------------------------------------------------


def nvlink_bytes(shape, dtype, world_size):
    # Every rank receives the other ranks' rows of a.
    m, _, k = shape
    return (world_size - 1) / world_size * m * k * dtype.itemsize


def floor_us(shape, dtype, world_size):
    # The GEMM at the measured peak; the gather can hide under it.
    m, n, k = shape
    return gemm_us(2 * m * n * k)


register(
    Op(
        name="all_gather_matmul",
        description="all_gather(a) @ b (a [M/ws, K] per rank, b [K, N]); shapes MxNxK with M the total rows",
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
