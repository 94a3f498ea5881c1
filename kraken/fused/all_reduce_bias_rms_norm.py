"""The all-reduce + bias + RMSNorm front door: the one-shot or two-shot fused recipe, chosen for the caller.

``all_reduce_bias_rms_norm(x, bias, weight, eps, group)`` runs ``one_shot_all_reduce_bias_rms_norm`` or
``two_shot_all_reduce_bias_rms_norm``, whichever wins at ``x``'s token count and the world size
(``kraken.runtime.crossover``, the bias family's row). Both return a new tensor and leave ``x`` as it was.
``shot="one"`` / ``shot="two"`` forces either; every other config key goes to the chosen recipe.
Checked and agreed across ranks on the door's own first call of each signature, as
``kraken.fused.all_reduce_bias`` says.
"""

from __future__ import annotations

import importlib

import torch
import torch.distributed as dist

from kraken.fused.one_shot_all_reduce_bias import door_call, staged_workspace
from kraken.fused.rms_norm import check_inputs
from kraken.runtime import agreement, crossover, prepared
from kraken.runtime.launcher import jit_launch

OP = "all_reduce_bias_rms_norm"
ONE_SHOT = importlib.import_module("kraken.fused.one_shot_all_reduce_bias_rms_norm")
TWO_SHOT = importlib.import_module("kraken.fused.two_shot_all_reduce_bias_rms_norm")


def plan(tokens: int, hidden: int, world_size: int, config: dict) -> dict:
    """The chosen recipe's launch configuration, the choice under ``"shot"`` (shared with the twin)."""
    return crossover.plan(OP, ONE_SHOT, TWO_SHOT, tokens, world_size, config, tokens, hidden)


def checked_choice(name: str):
    """``choose(x, bias, weight, eps, group, config)``: (the recipe for this call signature, its preparation of the
    signature under ``name``), checked and agreed on its first call (a lookup after); ``name``: the op its errors
    name (see ``kraken.fused.all_reduce_bias``)."""

    @prepared.per_signature(lambda x, bias, weight, eps, group, config: (
        name, group, prepared.tensor_key(x), prepared.tensor_key(bias), prepared.tensor_key(weight),
        prepared.scalar_key(eps), prepared.config_key(config)))
    def choose(x, bias, weight, eps, group, config: dict) -> tuple[str, tuple]:
        with agreement.agreed(name, group, x=x, eps=eps, config=config, bias=bias, weight=weight):
            hidden = check_inputs(name, x, {"bias": bias, "weight": weight}, eps)
            launch_cfg = crossover.checked_plan(name, plan, (x.numel() // hidden, hidden), group, config)
        shot = launch_cfg.pop("shot")
        copies = (ONE_SHOT if shot == crossover.ONE else TWO_SHOT).WORKSPACE_COPIES
        return shot, staged_workspace(name, x, hidden, group, launch_cfg, copies)

    return choose


choose = checked_choice(OP)


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
    """Launch the recipe ``plan`` chose on prepared arguments (its workspace: ``peers``)."""
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
    """RMSNorm(``sum over ranks of x`` + ``bias``) * ``weight``, a new tensor, one-shot or two-shot as
    ``kraken.runtime.crossover`` says.

    Arguments as ``one_shot_all_reduce_bias_rms_norm``. ``config``: ``shot="one"|"two"`` forces a recipe;
    the rest overrides its config.
    """
    return door_call(OP, OP, (ONE_SHOT, TWO_SHOT), choose, x, (bias, weight, eps), group, config)
