"""The all-reduce front door: one-shot or two-shot, chosen for the caller.

``all_reduce(tensor, group)`` sums a symmetric tensor over the group with the recipe that wins at
its size and world size (``kraken.runtime.crossover``: one-shot while the message is latency-bound, two-shot
from the crossover on). ``shot="one"`` / ``shot="two"`` forces either; every other config key goes to
the chosen recipe. Nothing here launches a kernel of its own: the door keeps its own prepared call per
call signature (``door_call``; symmetric or staged, as the recipes do), whose first call checks the input
as the recipes do and agrees across ranks, so one rank's bad input raises on every rank before any
launch, even on a signature the chosen recipe, called directly, has run before (its prepared call would
skip the agreement). Later calls: one lookup, then the chosen recipe's launch, as its own call makes it.

The two recipes differ in where the sum lands: one-shot writes a new tensor and leaves the input as
it was, two-shot sums in place. The front door returns the sum either way, and its input is spent:
read the result, not the input (and write fresh values into the input before the next call, as
before any all-reduce).
"""

from __future__ import annotations

import importlib
from typing import Callable

import torch
import torch.distributed as dist

from kraken.runtime import agreement, crossover, groups, staging
from kraken.runtime.launcher import jit_launch

OP = "all_reduce"
# The recipes' modules (``kraken.comm`` exports their functions under the modules' names).
ONE_SHOT = importlib.import_module("kraken.comm.one_shot_all_reduce")
TWO_SHOT = importlib.import_module("kraken.comm.two_shot_all_reduce")


def plan(numel: int, world_size: int, config: dict) -> dict:
    """The chosen recipe's launch configuration, the choice under ``"shot"`` (shared with the twin)."""
    return crossover.plan(OP, ONE_SHOT, TWO_SHOT, numel, world_size, config, numel)


def check(tensor: torch.Tensor, group, op: str, config: dict, staged: bool) -> dict:
    """A door's first call of a signature under ``op`` (its own name, or its twin's: each door agrees on its own
    first calls): the input checked as the recipes check it and agreed across ranks (``staged`` included), then
    the choice and the chosen recipe's plan (``crossover.checked_plan``: the launch configuration with ``shot``)."""
    # one rank's bad input: every rank raises
    with agreement.agreed(op, group, tensor=tensor, staged=staged, config=config):
        groups.check_tensor(tensor, "tensor", op)
        return crossover.checked_plan(op, plan, (tensor.numel(),), group, config)


# The doors' own prepared calls, per signature and door name (``kraken.runtime.staging``): (the peers' symmetric
# context, the chosen recipe's launch configuration with ``shot`` and a ``Launcher``, staged or not).
_, _, prepare_call = staging.prepares(check)


def door_call(name: str, launch: Callable, recipes: tuple, tensor: torch.Tensor, group, config: dict) -> torch.Tensor:
    """This door's call or its twin's (``name``: the op its errors name; ``launch``: the door's ``launch``;
    ``recipes``: its (one-shot, two-shot) modules). In eager: the door's prepared call of this signature, then the
    chosen recipe's launch, as the recipe's own call would make it. While Dynamo traces: the chosen recipe's
    operator (``crossover.traced_call``)."""
    if torch.compiler.is_dynamo_compiling():
        return crossover.traced_call(OP, recipes, tensor, (), group, config)
    ctx, launch_cfg, staged = prepare_call(tensor, group, name, config)
    out = torch.empty_like(tensor) if launch_cfg["shot"] == crossover.ONE else None
    return staging.launched(launch, ctx, launch_cfg, staged, tensor, out)


def launch(
    peers: tuple[torch.Tensor, ...],
    out: torch.Tensor,
    signal_pad_ptrs: int,
    rank: int,
    shot: str,
    group_name: str = "",
    launcher=jit_launch,
    **launch_cfg,
) -> torch.Tensor:
    """Launch the recipe ``plan`` chose on prepared arguments; returns the sum: ``out`` (one-shot), or
    ``peers[rank]`` summed in place (two-shot, which leaves ``out`` alone)."""
    if shot == crossover.ONE:
        return ONE_SHOT.launch(peers, out, signal_pad_ptrs, rank, **launch_cfg, group_name=group_name,
                               launcher=launcher)
    return TWO_SHOT.launch(peers, signal_pad_ptrs, rank, **launch_cfg, group_name=group_name, launcher=launcher)


def all_reduce(tensor: torch.Tensor, group: dist.ProcessGroup | str | None = None, **config) -> torch.Tensor:
    """The sum of ``tensor`` over the group, one-shot or two-shot as ``kraken.runtime.crossover`` says.

    ``tensor``: any shape, contiguous, bf16/fp16/fp32, on the GPU; in symmetric memory (``kraken.symm_empty``,
    with ``group``) it is read in place, otherwise staged inside the kernel, as the recipes do. Returns the
    sum: a new tensor (one-shot) or ``tensor`` itself (two-shot, in place); afterwards treat ``tensor``'s
    values as spent. ``config``: ``shot="one"|"two"`` forces a recipe; the rest overrides its config.
    """
    return door_call(OP, launch, (ONE_SHOT, TWO_SHOT), tensor, group, config)
