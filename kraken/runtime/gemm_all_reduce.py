"""GEMM + all-reduce's product layer, wrapped around its recipe from outside.

The recipe (``kraken/fused/gemm_one_shot_all_reduce.py``) holds the kernel, its pure ``plan`` (tiles and form:
one-shot pulling or pushing, or two-shot), its ``launch`` seam and a plain host function. What the installed
package adds lives here:

* the checks of a call's arguments (``kraken.runtime.gemm_checks``), agreed across ranks on the first call of each
  signature (``agreement.agreed``: one rank's bad input raises on every rank), the grid inside the signal pad;
* the form (``kraken.runtime.crossover``): the fused kernel, or cuBLAS then the SM-driven all-reduce (one- or
  two-shot by size: the sum in fp32, rounded once), where the output dtype is ``a``'s and the fused plan's tiles
  fill the SMs' waves poorly (``fills_poorly``), agreed across ranks per signature;
* the prepared call per signature: the shared ``symm.BlockWorkspace`` viewed as the kernel takes it, the k split's
  local scratch and barrier pads, the launch configuration and its cached ``Launcher``, replayed from its second
  call on (``replay.prepared_launch``).

The Helion twin's installed function is this product code driving the twin's ``launch``
(``gemm_one_shot_all_reduce_with``).
"""

from __future__ import annotations

import importlib
import math

import torch
import torch.distributed as dist

from kraken._gemm_core import SKINNY_M
from kraken.runtime import agreement, crossover, groups, prepared, symm
from kraken.runtime.gemm_checks import check_inputs
from kraken.runtime.gemm_reduce_scatter import installed
from kraken.runtime.launcher import Launcher
from kraken.runtime.replay import prepared_launch

# The recipe's module: its ``plan``, ``rounds_of`` and ``chunk_tile`` called through it, its ``launch`` by name.
RECIPE = importlib.import_module("kraken.fused.gemm_one_shot_all_reduce")
OP = RECIPE.OP


@prepared.per_signature(lambda a, b, group, out_dtype, op, config: (
    op, group, prepared.tensor_key(a), prepared.tensor_key(b), out_dtype, prepared.config_key(config)))
def prepare(
    a: torch.Tensor, b: torch.Tensor, group, out_dtype: torch.dtype, op: str, config: dict
) -> tuple[symm.SymmContext, dict]:
    """Validate, plan, and find the workspace: the context's ``peers`` are every rank's
    ``symm.BlockWorkspace`` viewed as [2, chunks, tiles per chunk, slots, BLOCK_M, BLOCK_N] of
    ``out_dtype`` (the recipe's ``chunk_tile``)."""
    # The first call of each signature checks that every rank passes the same shapes and valid ones.
    with agreement.agreed(op, group, a=a, b=b, out_dtype=out_dtype, config=config):
        check_inputs(a, b, out_dtype, op)
        (m, k), n = a.shape, b.shape[1]
        num_sms = torch.cuda.get_device_properties(a.device).multi_processor_count
        world_size = groups.world_size_of(group, op)
        cfg = RECIPE.plan(m, n, k, world_size, config, num_sms, groups.signal_pad_bytes())
        groups.check_barrier_blocks(cfg["num_blocks"], world_size, op)
    tile = RECIPE.chunk_tile(cfg, world_size)
    chunk_bytes = RECIPE.rounds_of(m, n, cfg) * math.prod(tile) * out_dtype.itemsize
    workspace = symm.block_workspace(chunk_bytes, a.device, group, op)
    ctx = workspace.context(out_dtype, tile)
    split_args = {
        "parity": workspace.parity,
        "epochs": workspace.epochs,
        "partials": symm.local_scratch((workspace.num_chunks, 2, *tile[1:]) if cfg["split_k"] > 1 else (1,),
                                       torch.float32, a.device),
        "split_pad_ptrs": symm.local_barrier_pads(a.device),
    }
    return ctx, {**split_args, **cfg, "launcher": Launcher(op)}


def call(launch, op: str, a: torch.Tensor, b: torch.Tensor, group, out_dtype: torch.dtype, config: dict,
         all_reduce) -> torch.Tensor:
    """``gemm_one_shot_all_reduce`` with a given ``launch`` and ``all_reduce`` (the recipe's or its twin's front door)
    under the name ``op``, in the form ``crossover`` chooses: sequential, cuBLAS then ``all_reduce`` (one- or
    two-shot by size: the sum in fp32, rounded once), only where the output dtype is ``a``'s; else the prepared
    call and its launch."""
    prepared = chosen(a, b, group, out_dtype, op, config)
    if prepared == crossover.SEQUENTIAL:
        return all_reduce(torch.matmul(a, b), group)
    ctx, launch_cfg = prepared
    out = torch.empty(a.shape[0], b.shape[1], dtype=out_dtype, device=a.device)
    return prepared_launch(launch, (a, b), ctx, launch_cfg, out)


@prepared.per_signature(lambda a, b, group, out_dtype, op, config: (
    op, group, prepared.tensor_key(a), prepared.tensor_key(b), out_dtype, prepared.config_key(config)))
def chosen(a: torch.Tensor, b: torch.Tensor, group, out_dtype: torch.dtype, op: str, config: dict):
    """``crossover.SEQUENTIAL`` or the fused form's ``prepare``, kept per signature (``crossover.fused_prepared``);
    sequential only where the output dtype is ``a``'s."""
    sequential_ok = isinstance(a, torch.Tensor) and a.dtype == out_dtype
    return crossover.fused_prepared(op, a, b, group, False, sequential_ok, config, check_sequential,
                                    lambda fused_config: prepare(a, b, group, out_dtype, op, fused_config),
                                    fills_poorly)


def check_sequential(a: torch.Tensor, b: torch.Tensor, world_size: int, op: str) -> None:
    """The sequential form's checks (``kraken.runtime.crossover.form`` runs them inside its agreement)."""
    check_inputs(a, b, a.dtype, op)


# The fused kernel runs one block per output tile (or per k slice of one). Above ``SKINNY_M`` rows the tensor
# cores bind, and where its tiles leave more than a quarter of the SMs' last wave idle (512x5120x5120: 80 tiles
# of 128x256 on 132 SMs), cuBLAS, which splits such shapes its own way, then the all-reduce is the faster form
# (``kraken.runtime.crossover``). Up to ``SKINNY_M`` rows streaming ``b`` binds, whatever the wave's fill.
MIN_WAVE_FILL = 0.75


def fills_poorly(a: torch.Tensor, b: torch.Tensor, world_size: int) -> bool:
    """Whether the fused plan for ``a @ b`` (more than ``SKINNY_M`` rows) fills less than ``MIN_WAVE_FILL`` of its
    waves of SMs."""
    (m, k), n = a.shape, b.shape[1]
    if m <= SKINNY_M:
        return False
    num_sms = torch.cuda.get_device_properties(a.device).multi_processor_count
    cfg = RECIPE.plan(m, n, k, world_size, {}, num_sms, groups.signal_pad_bytes())
    units = groups.cdiv(m, cfg["block_m"]) * groups.cdiv(n, cfg["block_n"]) * cfg["split_k"]
    return units / (groups.cdiv(units, num_sms) * num_sms) < MIN_WAVE_FILL


def gemm_one_shot_all_reduce_with(launch, op: str, package: str):
    """The installed GEMM + all-reduce, driving ``launch``: the recipe's (``kraken.gemm_one_shot_all_reduce``) or its
    Helion twin's (``helion_ports.gemm_one_shot_all_reduce``), whose sequential form runs ``package``'s installed
    all-reduce (``kraken`` or ``helion_ports``)."""

    def all_reduce(tensor: torch.Tensor, group) -> torch.Tensor:
        return installed(package, "all_reduce")(tensor, group)

    def gemm_one_shot_all_reduce(
        a: torch.Tensor,
        b: torch.Tensor,
        group: dist.ProcessGroup | str | None = None,
        out_dtype: torch.dtype = torch.float32,
        **config,
    ) -> torch.Tensor:
        """``sum over ranks of a @ b`` as a new [M, N] tensor of ``out_dtype`` (bf16 or fp32).

        ``a`` [M, K] and ``b`` [K, N] are ordinary contiguous CUDA tensors, bf16 or fp16, the same shapes on every
        rank. ``config`` overrides the recipe's ``default_config(M, N, K, num_sms, world_size)`` (the form,
        ``shot="one"`` / ``"push"`` / ``"two"``, and tiles) and the chosen ``split_k``/``reduce_m``/``max_blocks``
        (see its ``plan``); ``form="fused"`` or ``"sequential"`` forces the form ``crossover`` would choose by size.
        """
        return call(launch, op, a, b, group, out_dtype, config, all_reduce)

    return gemm_one_shot_all_reduce


gemm_one_shot_all_reduce = gemm_one_shot_all_reduce_with(RECIPE.launch, OP, "kraken")
