"""all_reduce_bias and all_reduce_bias_rms_norm: the epilogue of a tensor-parallel linear layer.

Each rank holds a partial product ``x`` ([tokens, hidden]); the op sums it over
the ranks, adds the (replicated) bias and, for the second op, applies RMSNorm.
Decode-sized messages, so launches and barrier rounds dominate. Backends:

* ``nccl``: ``dist.all_reduce`` then the bias add (then RMSNorm) in eager PyTorch;
* ``chain``: this project's unfused chain, ``kraken.one_shot_all_reduce`` on an
  input already in symmetric memory, a torch bias add, then the kraken
  ``rms_norm`` kernel: what fusion alone buys (it skips the fused kernels'
  staging copy, so the gap is, if anything, understated);
* the fused kraken recipes and their Helion twins, one-shot and two-shot, which
  take ordinary tensors and stage them inside the kernel.
"""

from __future__ import annotations

import importlib

import torch
import torch.distributed as dist

from benchmark.registry import Op, Pair, SYNC_US, copy_backend, copy_work, nvlink_us, public, register
from kraken.runtime import crossover
from kraken.runtime.symm import symm_workspace
from benchmark.sm90 import FAKE_SIGNAL_PADS, example_rank
from kraken import one_shot_all_reduce
from kraken import rms_norm

EPS = 1e-5
FUSED = "fused.{shot}_shot_all_reduce_bias{norm}"
AUTO = "fused.all_reduce_bias{norm}"  # the front doors, kraken.all_reduce_bias[_rms_norm] (kraken.runtime.crossover)
EXAMPLE_SHAPE = (7, 1000)  # odd in both dimensions: row and column tails


# ---------------------------------------------------------------------------
# Inputs
# ---------------------------------------------------------------------------


def rank_values(shape, dtype, seed: int, rank: int, device="cuda") -> torch.Tensor:
    """Rank ``rank``'s ``x``: any rank can rebuild any other's (the GPU tests' float64 reference does)."""
    gen = torch.Generator(device=device).manual_seed(seed * 1000 + rank)
    return torch.randn(shape, dtype=torch.float32, device=device, generator=gen).to(dtype)


def parameters(hidden: int, dtype, seed: int, device="cuda") -> tuple[torch.Tensor, torch.Tensor]:
    """``bias`` and ``weight``: replicated parameters, the same on every rank."""
    gen = torch.Generator(device=device).manual_seed(seed * 1000 + 999)
    bias = torch.randn(hidden, dtype=torch.float32, device=device, generator=gen).to(dtype)
    weight = (1.0 + 0.5 * torch.randn(hidden, dtype=torch.float32, device=device, generator=gen)).to(dtype)
    return bias, weight


def make_inputs(shape, dtype, seed):
    tokens, hidden = shape
    x = rank_values(shape, dtype, seed, dist.get_rank())
    bias, weight = parameters(hidden, dtype, seed)
    # The chain's input in symmetric memory. The fused kernels stage x into this same workspace,
    # so it keeps holding x's values between backends.
    symm = symm_workspace(x.numel(), dtype, x.device, None, "all_reduce_bias").view(shape)
    symm.copy_(x)
    return {"x": x, "bias": bias, "weight": weight, "eps": EPS, "symm": symm, "nccl": x.clone()}


# ---------------------------------------------------------------------------
# Backends
# ---------------------------------------------------------------------------


def eager_rms_norm(h: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    h = h.float()
    return (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps) * weight.float()).to(weight.dtype)


def nccl_bias(i):
    dist.all_reduce(i["nccl"])  # in place on the backend's own copy, as after a real linear layer
    return i["nccl"] + i["bias"]


def nccl_bias_rms_norm(i):
    dist.all_reduce(i["nccl"])
    return eager_rms_norm(i["nccl"] + i["bias"], i["weight"], i["eps"])


def chain_bias(i):
    out = one_shot_all_reduce(i["symm"])
    out += i["bias"]
    return out


def chain_bias_rms_norm(i):
    return rms_norm(chain_bias(i), i["weight"], i["eps"])


def recipe_name(shot: str, norm: bool) -> str:
    """The module of the ``shot`` recipe ("one", "two"), under kraken or helion_ports; "auto": the front door's name
    as such a path (``registry.public`` maps it to ``kraken.all_reduce_bias[_rms_norm]`` or the twin's)."""
    norm_tag = "_rms_norm" if norm else ""
    return AUTO.format(norm=norm_tag) if shot == "auto" else FUSED.format(shot=shot, norm=norm_tag)


def fused(package: str, shot: str, norm: bool):
    path = f"{package}.{recipe_name(shot, norm)}"
    fn = public(path)
    if norm:
        return lambda i: fn(i["x"], i["bias"], i["weight"], i["eps"])
    return lambda i: fn(i["x"], i["bias"])


def backends(norm: bool) -> dict:
    table = {"nccl": nccl_bias_rms_norm if norm else nccl_bias, "chain": chain_bias_rms_norm if norm else chain_bias}
    for shot, tag in (("one", "1shot"), ("two", "2shot"), ("auto", "auto")):
        table[f"triton_{tag}"] = fused("kraken", shot, norm)
        table[f"helion_{tag}"] = fused("helion_ports", shot, norm)
    return table


# ---------------------------------------------------------------------------
# CPU compile examples (benchmark.sm90)
# ---------------------------------------------------------------------------


def example_launch(module, world_size: int, shape=EXAMPLE_SHAPE, dtype=torch.bfloat16) -> None:
    """Call ``module.launch`` on CPU stand-ins; works for every module of the family and its twin."""
    tokens, hidden = shape
    x = torch.randn(shape, dtype=dtype)
    bias, weight, out = torch.randn(hidden, dtype=dtype), torch.randn(hidden, dtype=dtype), torch.empty_like(x)
    if module.__name__.endswith(".rms_norm"):
        module.launch(x, weight, out, EPS, **module.plan(tokens, hidden, {}))
        return
    cfg = module.plan(tokens, hidden, world_size, {})
    copies = 2 if "shard" in cfg else 1  # two-shot workspaces: [staged x | result]
    peers = tuple(torch.empty(copies * x.numel(), dtype=dtype) for _ in range(world_size))
    norm_args = (weight, EPS) if module.__name__.endswith("_rms_norm") else ()
    module.launch(x, bias, *norm_args, peers, out, FAKE_SIGNAL_PADS, example_rank(world_size), **cfg)


def auto_example(module, world_size: int, shape=EXAMPLE_SHAPE, dtype=torch.bfloat16) -> None:
    """A front door's launch on CPU stand-ins: the recipe (or twin) its plan chooses at ``shape``. The doors are
    product code (``kraken.runtime.bias_doors``) with no module of their own: ``module`` is the one-shot recipe's
    (or twin's), the two-shot one its namesake."""
    op = "all_reduce_bias_rms_norm" if module.__name__.endswith("_rms_norm") else "all_reduce_bias"
    if crossover.choose(op, shape[0], world_size) == crossover.TWO:
        module = importlib.import_module(module.__name__.replace(".one_shot_", ".two_shot_"))
    example_launch(module, world_size, shape, dtype)


def pairs(norm: bool) -> list[Pair]:
    found = []
    for shot, tag in (("one", "1shot"), ("two", "2shot")):
        name = recipe_name(shot, norm)
        found.append(Pair(f"triton_{tag}", f"helion_{tag}", f"kraken.{name}", f"helion_ports.{name}", example_launch))
    name = recipe_name("one", norm)  # the doors: the one-shot modules, and the two-shot ones where the plan says
    found.append(Pair("triton_auto", "helion_auto", f"kraken.{name}", f"helion_ports.{name}", auto_example))
    if norm:
        # The single-GPU building block: not a backend of the op, listed so compile tests and the inspector see it.
        found.append(Pair("triton_rms_norm", "helion_rms_norm", "kraken.fused.rms_norm",
                          "helion_ports.fused.rms_norm", example_launch))
    return found


# ---------------------------------------------------------------------------
# Registration
# ---------------------------------------------------------------------------


def nvlink_bytes(shape, dtype, world_size):
    # The least any all-reduce must receive per rank: (ws-1)/ws of the data, twice.
    tokens, hidden = shape
    return 2 * (world_size - 1) / world_size * tokens * hidden * dtype.itemsize


def floor_us(shape, dtype, world_size):
    return nvlink_us(nvlink_bytes(shape, dtype, world_size)) + 2 * SYNC_US


DEFAULT_SHAPES = [(1 << k, 5120) for k in range(9)] + [(t, h) for h in (4096, 8192) for t in (1, 16, 256)]

for norm in (False, True):
    register(
        Op(
            name="all_reduce_bias_rms_norm" if norm else "all_reduce_bias",
            description="sum [tokens, hidden] over ranks, add a bias" + (", RMSNorm each row" if norm else ""),
            make_inputs=make_inputs,
            backends={**backends(norm), "copy": copy_backend("x")},
            default_shapes=DEFAULT_SHAPES,
            shape_format="TOKENSxHIDDEN",
            library="copy",
            work=lambda shape, dtype: copy_work(shape[0] * shape[1], dtype),
            reference_free=frozenset({"copy"}),
            nvlink_bytes=nvlink_bytes,
            floor_us=floor_us,
            pairs=pairs(norm),
        )
    )
