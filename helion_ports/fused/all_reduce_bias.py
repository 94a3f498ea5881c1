"""Helion twin of ``kraken.fused.all_reduce_bias``: the same choice (``kraken.runtime.crossover``, the same ``plan``)
between the Helion twins of the one-shot and two-shot recipes; same arguments, same result."""

from __future__ import annotations

import importlib

import torch
import torch.distributed as dist

from kraken.fused.all_reduce_bias import OP, checked_choice, plan  # the choice and the plans are the recipe's
from kraken.fused.one_shot_all_reduce_bias import door_call
from kraken.runtime import crossover
from kraken.runtime.launcher import jit_launch

ONE_SHOT = importlib.import_module("helion_ports.fused.one_shot_all_reduce_bias")
TWO_SHOT = importlib.import_module("helion_ports.fused.two_shot_all_reduce_bias")

# Checked and agreed on this door's own first call of each signature, under its own name (see the kraken door).
NAME = f"helion {OP}"
choose = checked_choice(NAME)


def launch(
    x: torch.Tensor,
    bias: torch.Tensor,
    peers: tuple[torch.Tensor, ...],
    out: torch.Tensor,
    signal_pad_ptrs: int,
    rank: int,
    shot: str,
    group_name: str = "",
    launcher=jit_launch,
    **launch_cfg,
) -> torch.Tensor:
    """Launch the twin ``plan`` chose; mirrors ``kraken.fused.all_reduce_bias.launch``."""
    recipe = ONE_SHOT if shot == crossover.ONE else TWO_SHOT
    return recipe.launch(x, bias, peers, out, signal_pad_ptrs, rank, **launch_cfg, group_name=group_name,
                         launcher=launcher)


def all_reduce_bias(
    x: torch.Tensor, bias: torch.Tensor, group: dist.ProcessGroup | str | None = None, **config
) -> torch.Tensor:
    """``sum over ranks of x`` + ``bias``, one-shot or two-shot (see the kraken front door)."""
    return door_call(OP, NAME, (ONE_SHOT, TWO_SHOT), choose, x, (bias,), group, config)
