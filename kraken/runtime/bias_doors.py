"""The bias family's front doors: ``kraken.all_reduce_bias`` and ``kraken.all_reduce_bias_rms_norm`` (and their twins,
``helion_ports.<name>``), each running its one-shot or two-shot recipe, chosen for the caller.

``all_reduce_bias(x, bias, group)`` runs ``one_shot_all_reduce_bias`` or ``two_shot_all_reduce_bias``, whichever wins
at ``x``'s token count and the world size (``kraken.runtime.crossover``, the bias family's row); likewise
``all_reduce_bias_rms_norm(x, bias, weight, eps, group)`` with the RMSNorm recipes. Both recipes return a new tensor
and leave ``x`` as it was, so the choice changes only the time. ``shot="one"`` / ``shot="two"`` forces either; every
other config key goes to the chosen recipe.

A door's first call of each call signature checks the inputs as the recipes do and agrees across ranks (its
``choose``), so one rank's bad input raises on every rank before any launch, even on a signature the chosen recipe,
called directly, has run before (its prepared call would skip the agreement), and keeps with the choice what the
chosen recipe's launch needs (its plan, the workspace, a launcher: ``bias_norm.staged_workspace``); later calls of
the signature: one lookup, then that launch (``door_call``). While Dynamo traces, the chosen recipe's operator. The
twin's door is the same code over the twins' modules, under its own name ("helion <op>"): it agrees on its own first
calls. Both doors plan with the recipes' ``plan`` (the twins' are copies of them).
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist

from kraken.runtime import agreement, crossover, prepared
from kraken.runtime.bias_norm import (
    ONE_SHOT_BIAS, ONE_SHOT_NORM, TWO_SHOT_BIAS, TWO_SHOT_NORM, check_inputs, staged_call, staged_workspace)


def door_call(op: str, name: str, recipes: tuple, choose: Callable, x: torch.Tensor, operands: tuple, group,
              config: dict) -> torch.Tensor:
    """A front door's call (``op``: the door's table row; ``name``: the op its errors name) over ``recipes``, its
    (one-shot, two-shot) modules. In eager: ``choose``'s (choice, preparation) for the call signature, then the
    chosen one's launch. While Dynamo traces: the chosen one's operator (``crossover.traced_call``)."""
    if torch.compiler.is_dynamo_compiling():
        return crossover.traced_call(op, recipes, x, operands, group, config)
    shot, prepared = choose(x, *operands, group, config)
    return staged_call((recipes[0] if shot == crossover.ONE else recipes[1]).launch, name, x, operands, prepared)


def plan_all_reduce_bias(tokens: int, hidden: int, world_size: int, config: dict) -> dict:
    """``all_reduce_bias``'s plan: the chosen recipe's launch configuration, the choice under ``"shot"``."""
    return crossover.plan("all_reduce_bias", ONE_SHOT_BIAS, TWO_SHOT_BIAS, tokens, world_size, config, tokens, hidden)


def plan_all_reduce_bias_rms_norm(tokens: int, hidden: int, world_size: int, config: dict) -> dict:
    """``all_reduce_bias_rms_norm``'s plan: the chosen recipe's launch configuration, the choice under ``"shot"``."""
    return crossover.plan("all_reduce_bias_rms_norm", ONE_SHOT_NORM, TWO_SHOT_NORM, tokens, world_size, config, tokens,
                          hidden)


def chosen(name: str, recipes: tuple, x: torch.Tensor, hidden: int, group, launch_cfg: dict) -> tuple[str, tuple]:
    """The choice in ``launch_cfg`` (a door's plan) between ``recipes`` (the one-shot and two-shot modules) and the
    chosen recipe's preparation of the signature."""
    shot = launch_cfg.pop("shot")
    copies = (recipes[0] if shot == crossover.ONE else recipes[1]).WORKSPACE_COPIES
    return shot, staged_workspace(name, x, hidden, group, launch_cfg, copies)


def bias_choice(name: str) -> Callable:
    """``choose(x, bias, group, config)``: (the recipe for this call signature, its preparation of the signature
    under ``name``), checked and agreed on its first call (a lookup after). ``name``: the op its errors name, this
    door's or its twin's: each door agrees on its own first calls (``agreement.agreed`` remembers agreed signatures per
    op name)."""

    @prepared.per_signature(lambda x, bias, group, config: (
        name, group, prepared.tensor_key(x), prepared.tensor_key(bias), prepared.config_key(config)))
    def choose(x, bias, group, config: dict) -> tuple[str, tuple]:
        with agreement.agreed(name, group, x=x, config=config, bias=bias):  # one rank's bad input: every rank raises
            hidden = check_inputs(name, x, {"bias": bias})
            launch_cfg = crossover.checked_plan(name, plan_all_reduce_bias, (x.numel() // hidden, hidden), group,
                                                config)
        return chosen(name, (ONE_SHOT_BIAS, TWO_SHOT_BIAS), x, hidden, group, launch_cfg)

    return choose


def norm_choice(name: str) -> Callable:
    """``choose(x, bias, weight, eps, group, config)``: as ``bias_choice``, for ``all_reduce_bias_rms_norm``."""

    @prepared.per_signature(lambda x, bias, weight, eps, group, config: (
        name, group, prepared.tensor_key(x), prepared.tensor_key(bias), prepared.tensor_key(weight),
        prepared.scalar_key(eps), prepared.config_key(config)))
    def choose(x, bias, weight, eps, group, config: dict) -> tuple[str, tuple]:
        with agreement.agreed(name, group, x=x, eps=eps, config=config, bias=bias, weight=weight):
            hidden = check_inputs(name, x, {"bias": bias, "weight": weight}, eps)
            launch_cfg = crossover.checked_plan(name, plan_all_reduce_bias_rms_norm, (x.numel() // hidden, hidden),
                                                group, config)
        return chosen(name, (ONE_SHOT_NORM, TWO_SHOT_NORM), x, hidden, group, launch_cfg)

    return choose


def all_reduce_bias_with(recipes: tuple, name: str) -> Callable:
    """The installed ``all_reduce_bias`` door over ``recipes``, its (one-shot, two-shot) modules: the recipes'
    (``kraken.all_reduce_bias``) or the twins' (``helion_ports.all_reduce_bias``, ``name`` "helion all_reduce_bias")."""
    choose = bias_choice(name)

    def all_reduce_bias(
        x: torch.Tensor, bias: torch.Tensor, group: dist.ProcessGroup | str | None = None, **config
    ) -> torch.Tensor:
        """``sum over ranks of x`` + ``bias``, a new tensor, one-shot or two-shot as ``kraken.runtime.crossover`` says.

        Arguments as ``one_shot_all_reduce_bias`` (``x`` [..., hidden], any contiguous CUDA tensor; ``bias``
        [hidden], the same on every rank). ``config``: ``shot="one"|"two"`` forces a recipe; the rest
        overrides its config.
        """
        return door_call("all_reduce_bias", name, recipes, choose, x, (bias,), group, config)

    return all_reduce_bias


def all_reduce_bias_rms_norm_with(recipes: tuple, name: str) -> Callable:
    """The installed ``all_reduce_bias_rms_norm`` door over ``recipes`` (see ``all_reduce_bias_with``)."""
    choose = norm_choice(name)

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
        return door_call("all_reduce_bias_rms_norm", name, recipes, choose, x, (bias, weight, eps), group, config)

    return all_reduce_bias_rms_norm


all_reduce_bias = all_reduce_bias_with((ONE_SHOT_BIAS, TWO_SHOT_BIAS), "all_reduce_bias")
all_reduce_bias_rms_norm = all_reduce_bias_rms_norm_with((ONE_SHOT_NORM, TWO_SHOT_NORM), "all_reduce_bias_rms_norm")
