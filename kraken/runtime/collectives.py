"""The collectives' product layer, wrapped around their recipes from outside.

A recipe file (``kraken/comm/<name>.py``) holds the kernel, its pure ``plan``, its ``launch`` seam and a plain host
function. What the installed package adds lives here: the checks of a call's arguments, agreed across ranks on the
first call of each signature (``agreement.agreed``: one rank's bad input raises on every rank); the prepared calls
per signature, symmetric (a symmetric tensor read in place) or staged (an ordinary tensor copied by the kernel into
the shared workspace), each with its cached ``Launcher`` (``staging.prepares``); and the public function, whose warm
call is one lookup and the recipe's ``launch`` replayed (``staging.launched``). ``kraken.comm`` exports these
public functions under the recipes' names, and ``kraken.runtime.library`` makes each a ``torch.library`` operator.

* ``one_shot_all_reduce`` (``kraken.comm.one_shot_all_reduce``'s recipe): the same kernel, plan and launch.
"""

from __future__ import annotations

import importlib

import torch
import torch.distributed as dist

from kraken.runtime import agreement, groups, staging

# The recipe's module: its ``plan`` called through it (tests replace it there), its ``launch`` by name (the hot path).
ONE_SHOT = importlib.import_module("kraken.comm.one_shot_all_reduce")
one_shot_launch = ONE_SHOT.launch


# ---------------------------------------------------------------------------
# one_shot_all_reduce
# ---------------------------------------------------------------------------


def check(tensor: torch.Tensor, group, op: str, config: dict, staged: bool) -> dict:
    """Validate and agree (first call of a signature), plan."""
    with agreement.agreed(op, group, tensor=tensor, staged=staged, config=config):  # any rank's bad input: all raise
        groups.check_tensor(tensor, "tensor", op)
        world_size = groups.world_size_of(group, op)
        launch_cfg = ONE_SHOT.plan(tensor.numel(), world_size, config)
        groups.check_barrier_blocks(launch_cfg["num_blocks"], world_size, op)
    return launch_cfg


# Kept per signature: (the peers' symmetric context, the launch configuration); see kraken.runtime.staging.
# Shared with the Helion twin (``helion_ports.comm.one_shot_all_reduce``), which launches its own kernel on them.
prepare, prepare_staged, prepare_call = staging.prepares(check)


def one_shot_all_reduce_with(launch, op: str):
    """The installed one-shot all-reduce, driving ``launch``: the recipe's (``kraken.one_shot_all_reduce``) or its
    Helion twin's (``helion_ports.one_shot_all_reduce``, ``op`` "helion one_shot_all_reduce")."""

    def one_shot_all_reduce(
        tensor: torch.Tensor, group: dist.ProcessGroup | str | None = None, **config
    ) -> torch.Tensor:
        """Sum ``tensor`` over the group; returns a new tensor, the input is left unchanged.

        ``tensor``: any shape, contiguous, bf16/fp16/fp32, on the GPU; in symmetric memory
        (``kraken.symm_empty``) it is read in place, otherwise staged inside the kernel. ``config``
        overrides ``kraken.comm.one_shot_all_reduce.DEFAULT_CONFIG``.
        """
        ctx, launch_cfg, staged = prepare_call(tensor, group, op, config)
        return staging.launched(launch, ctx, launch_cfg, staged, tensor, torch.empty_like(tensor))

    return one_shot_all_reduce


one_shot_all_reduce = one_shot_all_reduce_with(one_shot_launch, "one_shot_all_reduce")
