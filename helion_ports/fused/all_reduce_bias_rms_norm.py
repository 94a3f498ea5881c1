"""Helion twin of ``kraken.fused.all_reduce_bias_rms_norm``: the same choice (``crossover``, the same ``plan``)
between the Helion twins of the one-shot and two-shot recipes; same arguments, same result."""

from __future__ import annotations

import importlib

import torch
import torch.distributed as dist

from kraken.fused.all_reduce_bias_rms_norm import OP, checked_choice, plan  # the choice and the plans are the recipe's
from kraken.fused.one_shot_all_reduce_bias import door_call
from kraken.runtime import crossover
from kraken.runtime.launcher import jit_launch

ONE_SHOT = importlib.import_module("helion_ports.fused.one_shot_all_reduce_bias_rms_norm")
TWO_SHOT = importlib.import_module("helion_ports.fused.two_shot_all_reduce_bias_rms_norm")

# Checked and agreed on this door's own first call of each signature, under its own name (see the kraken door).
NAME = f"helion {OP}"
choose = checked_choice(NAME)


def launch(
    x: torch.Tensor,
    bias: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    peers: tuple[torch.Tensor, ...],
    out: torch.Tensor,
    signal_pad_ptrs: int,
    rank: int,
    shot: str,
    group_name: str = "",
    launcher=jit_launch,
    **launch_cfg,
) -> torch.Tensor:
    """Launch the twin ``plan`` chose; mirrors ``kraken.fused.all_reduce_bias_rms_norm.launch``."""
    recipe = ONE_SHOT if shot == crossover.ONE else TWO_SHOT
    return recipe.launch(x, bias, weight, eps, peers, out, signal_pad_ptrs, rank, **launch_cfg,
                         group_name=group_name, launcher=launcher)


def all_reduce_bias_rms_norm(
    x: torch.Tensor,
    bias: torch.Tensor,
    weight: torch.Tensor,
    eps: float = 1e-5,
    group: dist.ProcessGroup | str | None = None,
    **config,
) -> torch.Tensor:
    """RMSNorm(``sum over ranks of x`` + ``bias``) * ``weight``, one-shot or two-shot (see the kraken front door)."""
    return door_call(OP, NAME, (ONE_SHOT, TWO_SHOT), choose, x, (bias, weight, eps), group, config)
