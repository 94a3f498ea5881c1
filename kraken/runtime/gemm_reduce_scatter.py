"""GEMM + reduce-scatter's product layer, wrapped around its recipe from outside.

The recipe (``kraken/fused/gemm_reduce_scatter.py``) holds the kernel, its pure ``plan``, its ``launch`` seam and
a plain host function. What the installed package adds lives here:

* the checks of a call's arguments (``kraken.runtime.gemm_checks``), agreed across ranks on the first call of each
  signature (``agreement.agreed``: one rank's bad input raises on every rank), M split evenly over the ranks, the
  grid inside the signal pad;
* the form (``kraken.runtime.crossover``): the fused kernel, or cuBLAS then the SM-driven reduce-scatter (the sum in
  fp32 in rank order, rounded once, as the fused kernel's), each a per-signature choice agreed across ranks;
* the prepared call per signature: the shared ``symm.BlockWorkspace`` viewed as the kernel takes it, the launch
  configuration and its cached ``Launcher`` (TMA maps encoded once per address), replayed from its second call
  on (``replay.prepared_launch``).

``planned`` and ``with_workspace`` serve the fp8 recipe's product layer too
(``kraken.runtime.gemm_reduce_scatter_fp8``).
The Helion twin's installed function is this product code driving the twin's ``launch``
(``gemm_reduce_scatter_with``).
"""

from __future__ import annotations

import functools
import importlib
import math

import torch
import torch.distributed as dist

from kraken.runtime import agreement, crossover, groups, prepared, symm
from kraken.runtime.gemm_checks import check_inputs
from kraken.runtime.launcher import Launcher
from kraken.runtime.replay import prepared_launch

# The recipe's module: its ``plan``, ``rounds_of`` and ``chunk_tile`` called through it, its ``launch`` by name.
RECIPE = importlib.import_module("kraken.fused.gemm_reduce_scatter")
OP = RECIPE.OP


@functools.cache
def installed(package: str, name: str):
    """The installed ``package.name`` (``kraken.reduce_scatter``, ``helion_ports.reduce_scatter``), found on first use:
    the sequential forms' collective, whichever module the package exports it from."""
    return getattr(importlib.import_module(package), name)


def planned(a: torch.Tensor, b: torch.Tensor, group, config: dict, op: str, plan) -> tuple[int, dict]:
    """The checks after the argument checks, inside ``agreement.agreed``: M splits over the ranks, ``plan(m, n, k,
    world_size, config, num_sms, pad_bytes)``, and the grid fits the signal pad. (world_size, launch config)."""
    (m, k), n = a.shape, b.shape[1]
    world_size = groups.world_size_of(group, op)
    if m % world_size:
        raise ValueError(f"{op}: M = {m} rows do not split evenly over {world_size} ranks (a is {tuple(a.shape)})")
    num_sms = torch.cuda.get_device_properties(a.device).multi_processor_count
    cfg = plan(m, n, k, world_size, config, num_sms, groups.signal_pad_bytes())
    groups.check_barrier_blocks(cfg["num_blocks"], world_size, op)
    return world_size, cfg


def with_workspace(a: torch.Tensor, n: int, world_size: int, cfg: dict, out_dtype: torch.dtype, group, op: str,
                   recipe=RECIPE) -> tuple[symm.SymmContext, dict]:
    """The context of every rank's ``symm.BlockWorkspace`` viewed as [2, chunks, rounds, world_size - 1, BLOCK_M,
    BLOCK_N] of ``out_dtype`` (``recipe``'s ``rounds_of`` and ``chunk_tile``), and the launch arguments but the
    tensors."""
    tile = recipe.chunk_tile(cfg, world_size)
    chunk_bytes = recipe.rounds_of(a.shape[0], n, world_size, cfg) * math.prod(tile) * out_dtype.itemsize
    workspace = symm.block_workspace(chunk_bytes, a.device, group, op)
    ctx = workspace.context(out_dtype, tile)
    return ctx, {"parity": workspace.parity, "epochs": workspace.epochs, **cfg, "launcher": Launcher(op)}


@prepared.per_signature(lambda a, b, group, out_dtype, op, config: (
    op, group, prepared.tensor_key(a), prepared.tensor_key(b), out_dtype, prepared.config_key(config)))
def prepare(
    a: torch.Tensor, b: torch.Tensor, group, out_dtype: torch.dtype, op: str, config: dict
) -> tuple[symm.SymmContext, dict]:
    """Validate, plan, and find the workspace: the context's ``peers`` are every rank's
    ``symm.BlockWorkspace`` viewed as [2, chunks, rounds, world_size - 1, BLOCK_M, BLOCK_N] of ``out_dtype``."""
    # Local checks; the first call of each signature also agrees on them (and on the shapes) across ranks.
    with agreement.agreed(op, group, a=a, b=b, out_dtype=out_dtype, config=config):
        check_inputs(a, b, out_dtype, op, wide=True)
        world_size, cfg = planned(a, b, group, config, op, RECIPE.plan)
    return with_workspace(a, b.shape[1], world_size, cfg, out_dtype, group, op)


def call(launch, op: str, a: torch.Tensor, b: torch.Tensor, group, out_dtype: torch.dtype, config: dict,
         reduce_scatter) -> torch.Tensor:
    """``gemm_reduce_scatter`` with a given ``launch`` and ``reduce_scatter`` (the recipe's or its twin's) under the
    name ``op``, in the form ``kraken.runtime.crossover`` chooses: sequential, cuBLAS then ``reduce_scatter`` (the
    SM-driven collective: the sum in fp32 in rank order, rounded once, as the fused kernel's), only where the
    output dtype is ``a``'s; else the prepared call and its launch."""
    prepared = chosen(a, b, group, out_dtype, op, config)
    if prepared == crossover.SEQUENTIAL:
        return reduce_scatter(torch.matmul(a, b), group)
    ctx, launch_cfg = prepared
    out = torch.empty(a.shape[0] // ctx.world_size, b.shape[1], dtype=out_dtype, device=a.device)
    return prepared_launch(launch, (a, b), ctx, launch_cfg, out)


@prepared.per_signature(lambda a, b, group, out_dtype, op, config: (
    op, group, prepared.tensor_key(a), prepared.tensor_key(b), out_dtype, prepared.config_key(config)))
def chosen(a: torch.Tensor, b: torch.Tensor, group, out_dtype: torch.dtype, op: str, config: dict):
    """``crossover.SEQUENTIAL`` or the fused form's ``prepare``, kept per signature (``crossover.fused_prepared``);
    sequential only where the output dtype is ``a``'s."""
    sequential_ok = isinstance(a, torch.Tensor) and a.dtype == out_dtype
    return crossover.fused_prepared(op, a, b, group, False, sequential_ok, config, check_sequential,
                                    lambda fused_config: prepare(a, b, group, out_dtype, op, fused_config))


def check_sequential(a: torch.Tensor, b: torch.Tensor, world_size: int, op: str) -> None:
    """The sequential form's checks (``kraken.runtime.crossover.form`` runs them inside its agreement)."""
    check_inputs(a, b, a.dtype, op, wide=True)
    if a.shape[0] % world_size:
        raise ValueError(f"{op}: M = {a.shape[0]} rows do not split evenly over {world_size} ranks (a is "
                         f"{tuple(a.shape)})")


def gemm_reduce_scatter_with(launch, op: str, package: str):
    """The installed GEMM + reduce-scatter, driving ``launch``: the recipe's (``kraken.gemm_reduce_scatter``) or its
    Helion twin's (``helion_ports.gemm_reduce_scatter``, ``op`` "helion gemm_reduce_scatter"), whose sequential form
    runs ``package``'s installed reduce-scatter (``kraken`` or ``helion_ports``)."""

    def reduce_scatter(tensor: torch.Tensor, group) -> torch.Tensor:
        return installed(package, "reduce_scatter")(tensor, group)

    def gemm_reduce_scatter(
        a: torch.Tensor,
        b: torch.Tensor,
        group: dist.ProcessGroup | str | None = None,
        out_dtype: torch.dtype = torch.bfloat16,
        **config,
    ) -> torch.Tensor:
        """This rank's rows ``[rank * M / ws, (rank + 1) * M / ws)`` of ``sum over ranks of a @ b``, a new
        [M / ws, N] tensor of ``out_dtype`` (bf16 or fp32).

        ``a`` [M, K] and ``b`` [K, N] are ordinary contiguous CUDA tensors, bf16 or fp16, the same shapes on
        every rank, M divisible by the world size. ``config`` overrides the tiles of the recipe's
        ``default_config``, ``group_m`` and ``max_blocks`` (see its ``plan``); ``form="fused"`` or
        ``"sequential"`` forces the form ``kraken.runtime.crossover`` would choose by size.
        """
        return call(launch, op, a, b, group, out_dtype, config, reduce_scatter)

    return gemm_reduce_scatter


gemm_reduce_scatter = gemm_reduce_scatter_with(RECIPE.launch, OP, "kraken")
