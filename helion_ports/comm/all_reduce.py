"""Helion twin of ``kraken.comm.all_reduce``: the same choice (``kraken.runtime.crossover``, the same ``plan``)
between the Helion twins of the one-shot and two-shot all-reduce; same arguments, same result."""

from __future__ import annotations

import importlib

import torch
import torch.distributed as dist

from kraken.comm.all_reduce import OP, door_call, plan  # the choice, the plans and the call are the recipe door's
from kraken.runtime import crossover
from kraken.runtime.launcher import jit_launch

ONE_SHOT = importlib.import_module("helion_ports.comm.one_shot_all_reduce")
TWO_SHOT = importlib.import_module("helion_ports.comm.two_shot_all_reduce")

# This door's prepared calls are kept, and its first calls agreed, under its own name (see the kraken door).
NAME = f"helion {OP}"


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
    """Launch the twin ``plan`` chose; mirrors ``kraken.comm.all_reduce.launch``."""
    if shot == crossover.ONE:
        return ONE_SHOT.launch(peers, out, signal_pad_ptrs, rank, **launch_cfg, group_name=group_name,
                               launcher=launcher)
    return TWO_SHOT.launch(peers, signal_pad_ptrs, rank, **launch_cfg, group_name=group_name, launcher=launcher)


def all_reduce(tensor: torch.Tensor, group: dist.ProcessGroup | str | None = None, **config) -> torch.Tensor:
    """The sum of ``tensor`` over the group, one-shot or two-shot (see the kraken front door)."""
    return door_call(NAME, launch, (ONE_SHOT, TWO_SHOT), tensor, group, config)
