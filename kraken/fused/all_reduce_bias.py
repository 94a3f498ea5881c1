"""The all-reduce + bias front door: the one-shot or two-shot fused recipe, chosen for the caller.

``all_reduce_bias(x, bias, group)`` runs ``one_shot_all_reduce_bias`` or ``two_shot_all_reduce_bias``,
whichever wins at ``x``'s token count and the world size (``kraken.runtime.crossover``, the bias family's
row). Both return a new tensor and leave ``x`` as it was, so the choice changes only the time.
``shot="one"`` / ``shot="two"`` forces either; every other config key goes to the chosen recipe.

The door's first call of each call signature checks the inputs as the recipes do and agrees across ranks
(``choose``), so one rank's bad input raises on every rank before any launch, even on a signature the
chosen recipe, called directly, has run before (its prepared call would skip the agreement), and keeps with
the choice what the chosen recipe's launch needs (its plan, the workspace, a launcher: ``staged_workspace``);
later calls of the signature: one lookup, then that launch (``door_call``). While Dynamo traces, the chosen
recipe's operator.
"""

from __future__ import annotations

import importlib

import torch
import torch.distributed as dist

from kraken.fused.one_shot_all_reduce_bias import door_call, staged_workspace
from kraken.fused.rms_norm import check_inputs
from kraken.runtime import agreement, crossover, prepared
from kraken.runtime.launcher import jit_launch

OP = "all_reduce_bias"
ONE_SHOT = importlib.import_module("kraken.fused.one_shot_all_reduce_bias")
TWO_SHOT = importlib.import_module("kraken.fused.two_shot_all_reduce_bias")


def plan(tokens: int, hidden: int, world_size: int, config: dict) -> dict:
    """The chosen recipe's launch configuration, the choice under ``"shot"`` (shared with the twin)."""
    return crossover.plan(OP, ONE_SHOT, TWO_SHOT, tokens, world_size, config, tokens, hidden)


def checked_choice(name: str):
    """``choose(x, bias, group, config)``: (the recipe for this call signature, its preparation of the signature
    under ``name``), checked and agreed on its first call (a lookup after). ``name``: the op its errors name, this
    door's or its twin's: each door agrees on its own first calls (``agreement.agreed`` remembers agreed signatures per
    op name)."""

    @prepared.per_signature(lambda x, bias, group, config: (
        name, group, prepared.tensor_key(x), prepared.tensor_key(bias), prepared.config_key(config)))
    def choose(x, bias, group, config: dict) -> tuple[str, tuple]:
        with agreement.agreed(name, group, x=x, config=config, bias=bias):  # one rank's bad input: every rank raises
            hidden = check_inputs(name, x, {"bias": bias})
            launch_cfg = crossover.checked_plan(name, plan, (x.numel() // hidden, hidden), group, config)
        shot = launch_cfg.pop("shot")
        copies = (ONE_SHOT if shot == crossover.ONE else TWO_SHOT).WORKSPACE_COPIES
        return shot, staged_workspace(name, x, hidden, group, launch_cfg, copies)

    return choose


choose = checked_choice(OP)


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
    """Launch the recipe ``plan`` chose on prepared arguments (its workspace: ``peers``)."""
    recipe = ONE_SHOT if shot == crossover.ONE else TWO_SHOT
    return recipe.launch(x, bias, peers, out, signal_pad_ptrs, rank, **launch_cfg, group_name=group_name,
                         launcher=launcher)


def all_reduce_bias(
    x: torch.Tensor, bias: torch.Tensor, group: dist.ProcessGroup | str | None = None, **config
) -> torch.Tensor:
    """``sum over ranks of x`` + ``bias``, a new tensor, one-shot or two-shot as ``kraken.runtime.crossover`` says.

    Arguments as ``one_shot_all_reduce_bias`` (``x`` [..., hidden], any contiguous CUDA tensor; ``bias``
    [hidden], the same on every rank). ``config``: ``shot="one"|"two"`` forces a recipe; the rest
    overrides its config.
    """
    return door_call(OP, OP, (ONE_SHOT, TWO_SHOT), choose, x, (bias,), group, config)
