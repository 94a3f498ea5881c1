"""The all-reduce front door: one-shot or two-shot, chosen for the caller.

``all_reduce(tensor, group)`` sums a symmetric tensor over the group with the recipe that wins at
its size and world size (``kraken.crossover``: one-shot while the message is latency-bound, two-shot
from the crossover on). ``shot="one"`` / ``shot="two"`` forces either; every other config key goes to
the chosen recipe. Nothing here launches a kernel of its own: a recipe's whole fast path runs as if
it had been called directly. Before it, the door's first call of each call signature checks the input
as the recipes do and agrees across ranks (``choose``), so one rank's bad input raises on every rank
before any launch, even on a signature the chosen recipe, called directly, has run before (its prepared
call would skip the agreement); later calls of the signature: one lookup.

The two recipes differ in where the sum lands: one-shot writes a new tensor and leaves the input as
it was, two-shot sums in place. The front door returns the sum either way, and its input is spent:
read the result, not the input (and write fresh values into the input before the next call, as
before any all-reduce).
"""

from __future__ import annotations

import importlib

import torch
import torch.distributed as dist

from kraken import crossover, host

OP = "all_reduce"
# The recipes' modules (``kraken.comm`` exports their functions under the modules' names).
ONE_SHOT = importlib.import_module("kraken.comm.one_shot_all_reduce")
TWO_SHOT = importlib.import_module("kraken.comm.two_shot_all_reduce")


def plan(numel: int, world_size: int, config: dict) -> dict:
    """The chosen recipe's launch configuration, the choice under ``"shot"`` (shared with the twin)."""
    return crossover.plan(OP, ONE_SHOT, TWO_SHOT, numel, world_size, config, numel)


def checked_choice(name: str):
    """``choose(tensor, group, config)``: the recipe for this call signature, checked and agreed on its first
    call (a lookup after). ``name``: the op its errors name, this door's or its twin's: each door agrees on
    its own first calls (``host.agreed`` remembers agreed signatures per op name)."""

    @host.per_signature(lambda tensor, group, config: (name, group, host.tensor_key(tensor), host.config_key(config)))
    def choose(tensor, group, config: dict) -> str:
        with host.agreed(name, group, tensor=tensor, config=config):  # one rank's bad input: every rank raises
            host.check_tensor(tensor, "tensor", name)
            return crossover.checked_plan(name, plan, (tensor.numel(),), group, config)["shot"]

    return choose


choose = checked_choice(OP)


def launch(
    peers: tuple[torch.Tensor, ...],
    out: torch.Tensor,
    signal_pad_ptrs: int,
    rank: int,
    shot: str,
    group_name: str = "",
    launcher=host.jit_launch,
    **launch_cfg,
) -> torch.Tensor:
    """Launch the recipe ``plan`` chose on prepared arguments; returns the sum: ``out`` (one-shot), or
    ``peers[rank]`` summed in place (two-shot, which leaves ``out`` alone)."""
    if shot == crossover.ONE:
        return ONE_SHOT.launch(peers, out, signal_pad_ptrs, rank, **launch_cfg, group_name=group_name,
                               launcher=launcher)
    return TWO_SHOT.launch(peers, signal_pad_ptrs, rank, **launch_cfg, group_name=group_name, launcher=launcher)


def all_reduce(tensor: torch.Tensor, group: dist.ProcessGroup | str | None = None, **config) -> torch.Tensor:
    """The sum of ``tensor`` over the group, one-shot or two-shot as ``kraken.crossover`` says.

    ``tensor``: any shape, contiguous, bf16/fp16/fp32, on the GPU; in symmetric memory (``kraken.symm_empty``,
    with ``group``) it is read in place, otherwise staged inside the kernel, as the recipes do. Returns the
    sum: a new tensor (one-shot) or ``tensor`` itself (two-shot, in place); afterwards treat ``tensor``'s
    values as spent. ``config``: ``shot="one"|"two"`` forces a recipe; the rest overrides its config.
    """
    shot = crossover.route(OP, choose, (tensor,), group, config)
    if shot == crossover.ONE:
        return ONE_SHOT.one_shot_all_reduce(tensor, group, **config)
    return TWO_SHOT.two_shot_all_reduce(tensor, group, **config)
