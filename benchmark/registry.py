"""The op registry: one ``Op`` per benchmarked operation, defined in ``benchmark/ops/<name>.py``.

An op names its input maker, its backends (the NCCL baseline first, then torch
built-ins, then each Triton recipe and its Helion twin), its default shapes, the
bytes and floor used for the bandwidth columns, and the Triton/Helion pairs.
The harness, the tests and the code inspector all read this registry, so adding
an op is one file here plus its two kernel files.
"""

from __future__ import annotations

from dataclasses import dataclass, field
import importlib
import pkgutil
from typing import Callable

import torch

NVLINK_GBPS = 361.0  # measured peer read bandwidth on 2x H200, GB/s
BF16_TFLOPS = 790.0  # measured dense bf16 matmul rate on H200, TFLOP/s
SYNC_US = 1.0  # one cross-GPU barrier round (send + wait over NVLink), measured on 2x H200

Shape = tuple[int, ...]


def public(path: str) -> Callable:
    """The installed function of a recipe or twin module path: ``kraken.comm.all_gather`` -> ``kraken.all_gather``
    (the recipe behind the product layer), ``helion_ports.fused.x`` -> ``helion_ports.x``."""
    top, name = path.split(".", 1)[0], path.rsplit(".", 1)[1]
    return getattr(importlib.import_module(top), name)


@dataclass
class Pair:
    """A Triton recipe and its Helion twin, as benchmark backends and as modules.

    ``example(module, world_size, shape=...)`` calls ``module.launch(...)`` with CPU
    stand-in tensors (of a small odd default shape, or the op's ``shape``); run under
    ``benchmark.sm90.capture_launches()`` it yields the kernels to compile for sm_90 without
    a GPU (CPU tests, ``python -m benchmark.inspect``).
    """

    triton: str  # backend name, e.g. "triton_1shot"
    helion: str  # backend name, e.g. "helion_1shot"
    triton_module: str  # e.g. "kraken.comm.one_shot_all_reduce"
    helion_module: str  # e.g. "helion_ports.comm.one_shot_all_reduce"
    example: Callable[..., None]


@dataclass
class Op:
    name: str
    description: str
    # make_inputs(shape, dtype, seed) -> dict; runs on every rank after init; may allocate symmetric memory.
    make_inputs: Callable[[Shape, torch.dtype, int], dict]
    # backend name -> fn(inputs) -> output tensor. The first one is the baseline (NCCL).
    backends: dict[str, Callable[[dict], torch.Tensor]]
    default_shapes: list[Shape]
    shape_format: str  # how --shapes are written, e.g. "NUMEL" or "MxNxK"
    # Bytes that must cross NVLink per rank (bandwidth column) and the floor in microseconds.
    nvlink_bytes: Callable[[Shape, torch.dtype, int], float]
    floor_us: Callable[[Shape, torch.dtype, int], float]
    pairs: list[Pair] = field(default_factory=list)
    # Backends that are timed but not compared with the baseline: they compute only part of the op
    # (e.g. the matmul alone, the floor under a fused GEMM + exchange). They must still run without
    # error and give finite values; the table marks their column "(not checked)".
    reference_free: frozenset[str] = frozenset()
    # Backends that cannot be captured in a CUDA graph (torch's context_parallel copies its load-balancing
    # indices from host memory on every call): under --cuda-graph they are not run, and say so in the table.
    eager_only: frozenset[str] = frozenset()
    # The one-GPU core table (world size 1): ``library`` names the backend that is the fastest single-GPU
    # library path for the op's core (cuBLAS ``matmul``, ``scaled_mm``, ``sdpa_cudnn``, a ``copy`` of the
    # same bytes); ``work(shape, dtype)`` is what one call does, as (amount, "flop" or "byte"), for the
    # TFLOP/s or GB/s column. At world size 1 the exchange is empty: the table measures the cores and the
    # host path.
    library: str | None = None
    work: Callable[[Shape, torch.dtype], tuple[float, str]] | None = None
    # Relative tolerance of a backend against the baseline's result, per dtype.
    rtol: dict[torch.dtype, float] = field(
        default_factory=lambda: {torch.bfloat16: 2e-2, torch.float16: 5e-3, torch.float32: 1e-5}
    )

    @property
    def baseline(self) -> str:
        return next(iter(self.backends))


REGISTRY: dict[str, Op] = {}


def register(op: Op) -> Op:
    if op.name in REGISTRY:
        raise ValueError(f"op {op.name!r} is registered twice")
    REGISTRY[op.name] = op
    return op


def load_all() -> dict[str, Op]:
    """Import every module in ``benchmark.ops`` (each registers its ops)."""
    from benchmark import ops

    for name in sorted(info.name for info in pkgutil.iter_modules(ops.__path__)):
        importlib.import_module(f"benchmark.ops.{name}")
    return REGISTRY


def get(name: str) -> Op:
    ops = load_all()
    if name not in ops:
        raise SystemExit(f"unknown op {name!r}; registered ops: {', '.join(sorted(ops))}")
    return ops[name]


def parse_shape(text: str, shape_format: str) -> Shape:
    """'4096' or '128x4096x4096' -> a tuple, checked against the op's shape format."""
    try:
        shape = tuple(int(part) for part in text.lower().replace(",", "x").split("x"))
    except ValueError:
        raise ValueError(f"bad shape {text!r}: expected {shape_format} (integers joined by 'x')") from None
    if len(shape) != len(shape_format.split("x")) or any(d <= 0 for d in shape):
        raise ValueError(f"bad shape {text!r}: expected {shape_format} with positive integers")
    return shape


def copy_backend(source: str | Callable[[dict], torch.Tensor]) -> Callable[[dict], torch.Tensor]:
    """A device-to-device copy of ``inputs[source]`` (or of ``source(inputs)``) into a buffer kept in the
    inputs: the single-GPU library floor of a collective (or of the MoE pair) at world size 1, which moves the
    same bytes through HBM."""

    def copy(inputs: dict) -> torch.Tensor:
        src = inputs[source] if isinstance(source, str) else source(inputs)
        out = inputs.get("_copy_out")
        if out is None:
            out = inputs["_copy_out"] = torch.empty_like(src)
        return out.copy_(src)

    return copy


def copy_work(numel: int, dtype: torch.dtype) -> tuple[float, str]:
    """``Op.work`` of a copy of ``numel`` elements: the bytes it moves through HBM, read once and written once."""
    return 2.0 * numel * dtype.itemsize, "byte"


def nvlink_us(nbytes: float) -> float:
    return nbytes / (NVLINK_GBPS * 1e3)


def gemm_us(flops: float) -> float:
    return flops / (BF16_TFLOPS * 1e6)
