"""The collectives' product layer, wrapped around their recipes from outside.

A recipe file (``kraken/comm/<name>.py``) holds the kernel, its pure ``plan``, its ``launch`` seam and a plain host
function. What the installed package adds lives here: the checks of a call's arguments, agreed across ranks on the
first call of each signature (``check``, one for the four collectives: ``agreement.agreed``, so one rank's bad input
raises on every rank); the prepared calls per signature, symmetric (a symmetric tensor read in place) or staged (an
ordinary tensor copied by the kernel into the shared workspace), each with its cached ``Launcher``
(``staging.prepares``); and the public functions, whose warm call is one lookup and the recipe's ``launch`` replayed
(``staging.launched``). ``kraken.runtime.api`` exports them as ``kraken.<name>``, and ``kraken.runtime.library`` makes
each a ``torch.library`` operator.

* ``one_shot_all_reduce``, ``two_shot_all_reduce``, ``reduce_scatter``, ``all_gather``: each made by a factory,
  ``<name>_with(launch, op)``, that drives the recipe's ``launch`` or its Helion twin's (same signature, same plan).
* ``all_reduce``: the front door, one-shot or two-shot (``all_reduce_with``).
* ``helion_<name>``: the twins' installed functions (``helion_ports.<name>``), made on first use (a twin imports
  Helion, which the recipes' installed functions do not need).
"""

from __future__ import annotations

import importlib

import torch
import torch.distributed as dist

from kraken.runtime import agreement, crossover, groups, staging

# The recipes' modules: each ``plan`` called through its module (tests replace it there), ``launch`` by name.
ONE_SHOT = importlib.import_module("kraken.comm.one_shot_all_reduce")
TWO_SHOT = importlib.import_module("kraken.comm.two_shot_all_reduce")
REDUCE_SCATTER = importlib.import_module("kraken.comm.reduce_scatter")
ALL_GATHER = importlib.import_module("kraken.comm.all_gather")
one_shot_launch = ONE_SHOT.launch
# op's last word (a twin's op is "helion <name>") -> its recipe, whose plan the twin shares
RECIPES = {"one_shot_all_reduce": ONE_SHOT, "two_shot_all_reduce": TWO_SHOT, "reduce_scatter": REDUCE_SCATTER,
           "all_gather": ALL_GATHER}


# ---------------------------------------------------------------------------
# Checks and prepared calls, shared by the four collectives and their twins
# ---------------------------------------------------------------------------


def check_shape(shape: tuple[int, ...], world_size: int, op: str, scatter: bool = True) -> None:
    """Rows: at least one dimension; to scatter (``reduce_scatter``), a first dimension that splits evenly over the
    ranks (a ValueError naming M and the world size)."""
    if len(shape) == 0:
        rows = "rows to scatter" if scatter else "rows to gather"
        raise ValueError(f"{op}: tensor must have at least one dimension ({rows}), got a 0-d tensor")
    if scatter and shape[0] % world_size != 0:
        raise ValueError(
            f"{op}: the first dimension M = {shape[0]} is not divisible by the world size {world_size}; "
            f"every rank gets M / {world_size} rows"
        )


def check(tensor: torch.Tensor, group, op: str, config: dict, staged: bool) -> dict:
    """Validate and agree (first call of a signature), plan with the recipe ``op``'s last word names (``RECIPES``)."""
    recipe = RECIPES[op.rpartition(" ")[2]]
    with agreement.agreed(op, group, tensor=tensor, staged=staged, config=config):  # any rank's bad input: all raise
        groups.check_tensor(tensor, "tensor", op)
        world_size = groups.world_size_of(group, op)
        if recipe is REDUCE_SCATTER or recipe is ALL_GATHER:  # rows, planned by the element's size
            check_shape(tuple(tensor.shape), world_size, op, scatter=recipe is REDUCE_SCATTER)
            launch_cfg = recipe.plan(tensor.numel(), world_size, config, tensor.element_size())
        else:
            launch_cfg = recipe.plan(tensor.numel(), world_size, config)
        groups.check_barrier_blocks(launch_cfg["num_blocks"], world_size, op)
    return launch_cfg


# Kept per signature and op: (the peers' symmetric context, the launch configuration); see kraken.runtime.staging.
# Shared with the Helion twins, which launch their own kernels on them.
prepare, prepare_staged, prepare_call = staging.prepares(check)


# ---------------------------------------------------------------------------
# The collectives
# ---------------------------------------------------------------------------


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


def two_shot_all_reduce_with(launch, op: str):
    """The installed two-shot all-reduce, driving ``launch``: the recipe's (``kraken.two_shot_all_reduce``) or its
    Helion twin's (``op`` "helion two_shot_all_reduce")."""

    def two_shot_all_reduce(
        tensor: torch.Tensor, group: dist.ProcessGroup | str | None = None, **config
    ) -> torch.Tensor:
        """Sum ``tensor`` over the group *in place* and return it.

        ``tensor``: any shape, contiguous, bf16/fp16/fp32, on the GPU; in symmetric memory
        (``kraken.symm_empty``) it is reduced where it lies, otherwise staged through the workspace inside the
        kernel (and the sum written back). ``config`` overrides ``kraken.comm.two_shot_all_reduce.DEFAULT_CONFIG``.
        """
        ctx, launch_cfg, staged = prepare_call(tensor, group, op, config)
        return staging.launched(launch, ctx, launch_cfg, staged, tensor)

    return two_shot_all_reduce


def reduce_scatter_with(launch, op: str):
    """The installed reduce-scatter, driving ``launch``: the recipe's (``kraken.reduce_scatter``) or its Helion
    twin's (``op`` "helion reduce_scatter")."""

    def reduce_scatter(tensor: torch.Tensor, group: dist.ProcessGroup | str | None = None, **config) -> torch.Tensor:
        """This rank's ``[M / world_size, ...]`` rows of the sum of ``tensor`` over the group, as a new tensor.

        ``tensor``: ``[M, ...]`` with ``M`` divisible by the world size, contiguous, bf16/fp16/fp32, on the GPU;
        in symmetric memory (``kraken.symm_empty``) it is read in place, otherwise staged inside the kernel; it
        is left unchanged. The sum runs in rank order in fp32 and is rounded once. ``config`` overrides
        ``kraken.comm.reduce_scatter.DEFAULT_CONFIG``.
        """
        ctx, launch_cfg, staged = prepare_call(tensor, group, op, config)
        out = staging.new_rows(tensor, tensor.shape[0] // ctx.world_size)
        return staging.launched(launch, ctx, launch_cfg, staged, tensor, out)

    return reduce_scatter


def all_gather_with(launch, op: str):
    """The installed all-gather, driving ``launch``: the recipe's (``kraken.all_gather``) or its Helion twin's
    (``op`` "helion all_gather")."""

    def all_gather(tensor: torch.Tensor, group: dist.ProcessGroup | str | None = None, **config) -> torch.Tensor:
        """Every rank's ``tensor`` stacked along the first dimension in rank order, as a new
        ``[world_size * M, ...]`` tensor.

        ``tensor`` (this rank's shard, ``[M, ...]``): contiguous, bf16/fp16/fp32, on the GPU; in symmetric
        memory (``kraken.symm_empty``) it is read in place, otherwise staged inside the kernel; it is left
        unchanged. ``config`` overrides ``kraken.comm.all_gather.DEFAULT_CONFIG``.
        """
        ctx, launch_cfg, staged = prepare_call(tensor, group, op, config)
        out = staging.new_rows(tensor, ctx.world_size * tensor.shape[0])
        return staging.launched(launch, ctx, launch_cfg, staged, tensor, out)

    return all_gather


one_shot_all_reduce = one_shot_all_reduce_with(one_shot_launch, "one_shot_all_reduce")
two_shot_all_reduce = two_shot_all_reduce_with(TWO_SHOT.launch, "two_shot_all_reduce")
reduce_scatter = reduce_scatter_with(REDUCE_SCATTER.launch, "reduce_scatter")
all_gather = all_gather_with(ALL_GATHER.launch, "all_gather")


# ---------------------------------------------------------------------------
# The all-reduce front door: one-shot or two-shot, chosen for the caller
# ---------------------------------------------------------------------------
#
# ``all_reduce(tensor, group)`` sums over the group with the recipe that wins at the tensor's size and the world
# size (``kraken.runtime.crossover``: one-shot while the message is latency-bound, two-shot from the crossover on).
# ``shot="one"`` / ``shot="two"`` forces either; every other config key goes to the chosen recipe. The door keeps its
# own prepared call per call signature (symmetric or staged, as the collectives do), whose first call checks the
# input as the recipes' do and agrees across ranks, so one rank's bad input raises on every rank before any launch,
# even on a signature the chosen recipe, called directly, has run before (its prepared call would skip the
# agreement). Later calls: one lookup, then the chosen recipe's launch, as its own call makes it.
#
# One-shot writes a new tensor and leaves the input as it was, two-shot sums in place. The door returns the sum
# either way, and its input is spent: read the result, not the input.

ALL_REDUCE = "all_reduce"


def all_reduce_plan(numel: int, world_size: int, config: dict) -> dict:
    """The chosen recipe's launch configuration, the choice under ``"shot"`` (the door's and its twin's)."""
    return crossover.plan(ALL_REDUCE, ONE_SHOT, TWO_SHOT, numel, world_size, config, numel)


def door_check(tensor: torch.Tensor, group, op: str, config: dict, staged: bool) -> dict:
    """A door's first call of a signature under ``op`` (its own name, or its twin's: each door agrees on its own
    first calls): the input checked as the recipes check it and agreed across ranks (``staged`` included), then
    the choice and the chosen recipe's plan (``crossover.checked_plan``: the launch configuration with ``shot``)."""
    # one rank's bad input: every rank raises
    with agreement.agreed(op, group, tensor=tensor, staged=staged, config=config):
        groups.check_tensor(tensor, "tensor", op)
        return crossover.checked_plan(op, all_reduce_plan, (tensor.numel(),), group, config)


# The doors' own prepared calls, per signature and door name: (the peers' symmetric context, the chosen recipe's
# launch configuration with ``shot`` and a ``Launcher``, staged or not).
_, _, door_prepare_call = staging.prepares(door_check)


def all_reduce_with(one_shot, two_shot, op: str):
    """The installed front door over the modules ``one_shot`` and ``two_shot`` (their ``launch``, looked up on every
    host-code run: tests replace it there): the recipes' (``kraken.all_reduce``) or the Helion twins'
    (``helion_ports.all_reduce``, ``op`` "helion all_reduce"). While Dynamo traces, the chosen recipe's operator
    (``crossover.traced_call``)."""
    recipes = (one_shot, two_shot)

    def launch(peers, out, signal_pad_ptrs, rank, shot, group_name, launcher, **launch_cfg):
        """Launch the recipe ``all_reduce_plan`` chose; returns the sum: ``out`` (one-shot), or ``peers[rank]``
        (or a staged ``x``) summed in place (two-shot, which leaves ``out`` alone)."""
        if shot == crossover.ONE:
            return one_shot.launch(peers, out, signal_pad_ptrs, rank, **launch_cfg, group_name=group_name,
                                   launcher=launcher)
        return two_shot.launch(peers, signal_pad_ptrs, rank, **launch_cfg, group_name=group_name, launcher=launcher)

    def all_reduce(tensor: torch.Tensor, group: dist.ProcessGroup | str | None = None, **config) -> torch.Tensor:
        """The sum of ``tensor`` over the group, one-shot or two-shot as ``kraken.runtime.crossover`` says.

        ``tensor``: any shape, contiguous, bf16/fp16/fp32, on the GPU; in symmetric memory (``kraken.symm_empty``,
        with ``group``) it is read in place, otherwise staged inside the kernel, as the recipes do. Returns the
        sum: a new tensor (one-shot) or ``tensor`` itself (two-shot, in place); afterwards treat ``tensor``'s
        values as spent. ``config``: ``shot="one"|"two"`` forces a recipe; the rest overrides its config.
        """
        if torch.compiler.is_dynamo_compiling():
            return crossover.traced_call(ALL_REDUCE, recipes, tensor, (), group, config)
        ctx, launch_cfg, staged = door_prepare_call(tensor, group, op, config)
        out = torch.empty_like(tensor) if launch_cfg["shot"] == crossover.ONE else None
        return staging.launched(launch, ctx, launch_cfg, staged, tensor, out)

    all_reduce.launch = launch  # (the door's launch seam, under which its prepared calls keep their replays)
    return all_reduce


all_reduce = all_reduce_with(ONE_SHOT, TWO_SHOT, ALL_REDUCE)
