"""Where one-shot stops paying and two-shot takes over: the one table the front doors read.

A one-shot reads every peer's whole message (``(world_size - 1) * N`` elements in per rank) in two
barrier rounds; a two-shot moves ``2 (world_size - 1) / world_size * N`` for the same two rounds. Small
messages are latency-bound (the two tie or one-shot wins by a little), large ones bandwidth-bound
(two-shot wins), and the crossover moves down as the world grows. Each entry is the largest message
at which one-shot is chosen, by world size; the front doors (``kraken.all_reduce``,
``kraken.fused.all_reduce_bias``, ``kraken.fused.all_reduce_bias_rms_norm`` and their Helion twins)
pick two-shot above it. ``shot="one"`` or ``shot="two"`` in a front door's config forces either.

A front door keeps its own preparation per call signature: its first call of each checks the inputs as the
recipes do and agrees on them across ranks (``agreement.agreed``, through ``checked_plan``), ``shot`` included,
and later calls launch the chosen recipe from it after one lookup. The recipes' own prepared calls are
shared with direct calls of them: a signature a recipe has seen before skips the agreement there, so a
door that went through them would let one rank's bad input raise on that rank alone.

Measured on H200s, bf16, eager GPU time (``docs/history.md``, ``docs/results.md``):

* all_reduce, in elements: at 2 ranks the two tie up to 1M elements (two-shot 0.7 us ahead from
  2M); at 4 ranks one-shot leads up to 32K (8.8 against 8.9 us) and two-shot from 64K (9.1 against
  9.3 us; 10.5 against 12.6 at 256K); at 8 ranks one-shot up to 32K, two-shot from 64K.
* the bias family (``all_reduce_bias``, ``all_reduce_bias_rms_norm``), in tokens (rows), measured at
  hidden 5120: at 2 ranks one-shot up to 64 tokens (two-shot from 128 with RMSNorm); at 4 ranks
  one-shot up to 16 (two-shot from 32 with RMSNorm, from 64 without); at 8 ranks the family crosses
  between 16 and 32 tokens.

* GEMM + all-reduce (``kraken.fused.gemm_one_shot_all_reduce`` and its twin, whose ``config`` takes
  ``shot="one"``, ``"push"`` or ``"two"``), in output elements (M x N): the recipe's plan holds a copy of this
  row (its ``ONE_SHOT_UP_TO``, kept equal by a test: a recipe imports nothing of the runtime) and picks push or
  pull for one itself. At 8 ranks the one-shot form lost to matmul + NCCL from
  M = 128 at N = 4096 (0.46x at M = 2048: each rank reads 7 whole partials, where two-shot reads 2 x 7/8
  of one). Two-shot pays one more barrier, so it starts where the one-shot's reads outgrow a barrier:
  estimates from those bytes at about 360 GB/s per peer read, not yet measured on 4- or 8-GPU hosts
  (256K elements at 4 ranks, 64K at 8). At 2 ranks two-shot reads as much as one-shot: never.

World sizes without a measurement take the next larger measured one's entry (more readers per
buffer only favours two-shot sooner). A group of one runs one-shot (a peer set of itself: one read,
one write, no second copy of the workspace).

The fused GEMM recipes have a second choice, their **form** (``form``): ``"fused"``, the recipe's own kernel
that overlaps the exchange with the GEMM, or ``"sequential"``: cuBLAS's GEMM before or after this project's
SM-driven collective (``all_gather`` then the GEMM; the GEMM then ``reduce_scatter`` or ``all_reduce``), each
a kernel that beats NCCL at these sizes. Where the GEMM is short the fused kernel cannot hide much of the
exchange and pays for its own machinery (the copy-engine gather's fixed cost, flags, a persistent grid sized
for the exchange), so the sequential form wins; where the GEMM is long the overlap wins. ``FUSED_FROM`` holds,
per recipe and measured world size, the fewest total rows M (``all_gather_matmul``: ``world_size`` times a
rank's rows) at which the fused form runs; below it the sequential one. A group of one always runs fused (no
exchange). A recipe may also prefer sequential where its fused kernel is known to be slow at the shape (a
``prefers_sequential(a, b, world_size)`` it passes to ``form``). ``form="fused"`` or ``"sequential"`` forces either;
any other config key (tiles, ``shot``) configures the fused kernel, so it runs the fused form (and
``"sequential"`` with such keys is an error). The choice is agreed across ranks on the first call of each call
signature (``form``) and is the same for the recipe and its twin.
"""

from __future__ import annotations

import math
import sys

import torch
import torch.distributed as dist

from kraken.runtime import agreement, groups

ONE, TWO = "one", "two"
SHOTS = (ONE, TWO)

# op family -> {measured world size: largest message (all_reduce: elements; bias family: tokens) for one-shot}
ONE_SHOT_UP_TO = {
    "all_reduce": {1: math.inf, 2: 1 << 20, 4: 1 << 15, 8: 1 << 15},
    "all_reduce_bias": {1: math.inf, 2: 64, 4: 16, 8: 16},
    "gemm_all_reduce": {1: math.inf, 2: math.inf, 4: 1 << 18, 8: 1 << 16},  # output elements (estimates, above)
}
# Which table row each front door reads.
FAMILY = {
    "all_reduce": "all_reduce",
    "all_reduce_bias": "all_reduce_bias",
    "all_reduce_bias_rms_norm": "all_reduce_bias",
    "gemm_one_shot_all_reduce": "gemm_all_reduce",
}

FUSED, SEQUENTIAL = "fused", "sequential"
FORMS = (FUSED, SEQUENTIAL)
# recipe -> {measured world size: the fewest total rows M at which the fused form runs}. Measured on 2 and 4
# H200s (eager, bf16, the benchmark's default shapes; docs/results.md): all_gather_matmul's fused form loses from
# 512 rows down (its copy-engine gather's fixed cost), gemm_reduce_scatter's at 256 rows at 2 ranks and up to 512
# at 4. gemm_one_shot_all_reduce's fused forms win by rows at every measured M; it runs sequential where its tiles
# fill the SMs' waves poorly instead (``fills_poorly``). all_gather_matmul_fp8 shares the bf16 recipe's gather and
# its entries; gemm_reduce_scatter_fp8 takes the bf16 recipe's (not measured in fp8). 8 ranks: 4's entries (not
# measured there).
FUSED_FROM = {
    "all_gather_matmul": {1: 0, 2: 1024, 4: 1024, 8: 1024},
    "gemm_reduce_scatter": {1: 0, 2: 512, 4: 1024, 8: 1024},
    "gemm_one_shot_all_reduce": {1: 0, 2: 0, 4: 0, 8: 0},
    "all_gather_matmul_fp8": {1: 0, 2: 1024, 4: 1024, 8: 1024},
    "gemm_reduce_scatter_fp8": {1: 0, 2: 512, 4: 1024, 8: 1024},
}


def one_shot_up_to(op: str, world_size: int) -> float:
    """The largest message at which ``op`` runs one-shot in a group of ``world_size``: the entry of the
    smallest measured world size at or above it."""
    table = ONE_SHOT_UP_TO[FAMILY[op]]
    sizes = sorted(table)
    if not 1 <= world_size <= sizes[-1]:
        raise ValueError(f"{op}: no crossover for world size {world_size} (measured: {sizes})")
    return table[min(ws for ws in sizes if ws >= world_size)]


def choose(op: str, size: int, world_size: int, shot: str | None = None) -> str:
    """``"one"`` or ``"two"``: ``shot`` when given (forced), else by the table. ``size`` is what the
    table counts for ``op`` (elements for all_reduce, tokens for the bias family)."""
    if shot is not None:
        if shot not in SHOTS:
            raise ValueError(f"{op}: shot must be 'one' or 'two' (or absent: chosen by size), got {shot!r}")
        return shot
    return ONE if size <= one_shot_up_to(op, world_size) else TWO


def plan(op: str, one_shot, two_shot, size: int, world_size: int, config: dict, *plan_args) -> dict:
    """A front door's ``plan`` (shared with its twin): the choice for ``size`` under ``"shot"``, and the chosen
    recipe module's ``plan(*plan_args, world_size, config)`` with ``"shot"`` taken out of the config."""
    config = dict(config)
    shot = choose(op, size, world_size, config.pop("shot", None))
    return {"shot": shot, **(one_shot if shot == ONE else two_shot).plan(*plan_args, world_size, config)}


def checked_plan(name: str, plan, sizes: tuple[int, ...], group, config: dict) -> dict:
    """A front door's first-call checks after its inputs' own, inside its ``agreement.agreed`` (``name``: the op its
    errors name): the group's size, ``plan(*sizes, world_size, config)`` and the signal pad's budget. Returns
    that plan: the choice under ``"shot"``, the chosen recipe's launch configuration."""
    world_size = groups.world_size_of(group, name)
    launch_cfg = plan(*sizes, world_size, config)
    groups.check_barrier_blocks(launch_cfg["num_blocks"], world_size, name)
    return launch_cfg


def size_of(op: str, x: object) -> int:
    """What the table counts for ``op`` in its input ``x``: elements (all_reduce) or rows (the bias family,
    ``x`` [..., hidden]). 0 for what is no tensor or no rows: the chosen recipe's checks then name the problem."""
    if not isinstance(x, torch.Tensor) or x.dim() == 0:
        return 0
    if FAMILY[op] == "all_reduce":
        return x.numel()
    return x.numel() // x.shape[-1] if x.shape[-1] else 0


def traced_shot(op: str, x: object, group, config: dict) -> str:
    """A front door's choice while Dynamo traces: unchecked, from ``x``'s size (the chosen recipe's operator checks
    when it runs); takes ``"shot"`` out of ``config`` (the rest is the chosen recipe's)."""
    return choose(op, size_of(op, x), groups.world_size_of(group, op), config.pop("shot", None))


def traced_call(op: str, recipes: tuple, x: object, operands: tuple, group, config: dict):
    """A front door's call while Dynamo traces: the operator of the recipe ``traced_shot`` chooses among ``recipes``
    (its (one-shot, two-shot) modules; a module's operator is the public function of its name, ``kraken.<name>`` or
    ``helion_ports.<name>``: a recipe's own function of that name is its plain host function), on ``(x, *operands, group,
    **config)``. The operator checks when it runs."""
    recipe = recipes[0] if traced_shot(op, x, group, config) == ONE else recipes[1]
    top, name = recipe.__name__.split(".", 1)[0], recipe.__name__.rpartition(".")[2]
    return getattr(sys.modules[PUBLIC[top]], name)(x, *operands, group, **config)


PUBLIC = {"kraken": "kraken.runtime.api", "helion_ports": "kraken.runtime.twins"}  # where the operators' doors are


def fused_from(op: str, world_size: int) -> int:
    """The fewest total rows at which ``op`` (or its twin) runs its fused form in a group of ``world_size``: the entry
    of the smallest measured world size at or above it."""
    table = FUSED_FROM[op.removeprefix("helion ")]  # a twin (named "helion <op>") chooses as its recipe
    sizes = sorted(table)
    if not 1 <= world_size <= sizes[-1]:
        raise ValueError(f"{op}: no form crossover for world size {world_size} (measured: {sizes})")
    return table[min(ws for ws in sizes if ws >= world_size)]


def choose_form(op: str, rows: int, world_size: int, config: dict, sequential_ok: bool = True) -> str:
    """``"fused"`` or ``"sequential"`` for ``rows`` total rows: ``config["form"]`` when given (forced), else the
    table's. ``sequential_ok`` False (an output dtype or layout only the fused kernel produces) or any other
    config key (it configures the fused kernel) choose fused."""
    form = config.get("form")
    if form is not None and form not in FORMS:
        raise ValueError(f"{op}: form must be 'fused' or 'sequential' (or absent: chosen by size), got {form!r}")
    others = sorted(key for key in config if key != "form")
    if form == SEQUENTIAL and (others or not sequential_ok):
        why = f"config {others} configures the fused kernel" if others else "its dtypes need the fused kernel"
        raise ValueError(f"{op}: form='sequential' cannot run this call: {why}")
    if form is not None:
        return form
    if others or not sequential_ok or world_size == 1:
        return FUSED
    return FUSED if rows >= fused_from(op, world_size) else SEQUENTIAL


def fused_prepared(op: str, a: torch.Tensor, b: torch.Tensor, group, rows_per_a: bool, sequential_ok: bool,
                   config: dict, check, prepare, prefers_sequential=None, scales: tuple = ()):
    """``SEQUENTIAL``, or the fused form's prepared call: ``prepare(config)`` with ``"form"`` taken out. A recipe keeps
    this per call signature (its ``chosen``, keyed as its ``prepare``), so that a warm call is one lookup whichever
    the form; the arguments are ``form``'s."""
    if form(op, a, b, group, rows_per_a, sequential_ok, config, check, prefers_sequential, scales) == SEQUENTIAL:
        return SEQUENTIAL
    return prepare({key: value for key, value in config.items() if key != "form"})


def form(op: str, a: torch.Tensor, b: torch.Tensor, group, rows_per_a: bool, sequential_ok: bool,
         config: dict, check, prefers_sequential=None, scales: tuple = ()) -> str:
    """A fused GEMM recipe's form for this call (``choose_form``), agreed across ranks on the first call of each
    signature, so that every rank runs the same kernels (the recipes keep the result with their prepared calls:
    ``fused_prepared``). ``rows_per_a``: ``a`` holds one rank's rows (the total is ``world_size`` times them). The
    ranks agree on what decides the form (the total rows, ``sequential_ok``, the config), not on the operands: the
    fused form's prepared call and the sequential form's collectives agree on those, each with its own messages.
    ``check(a, b, world_size, op, *scales)``, the recipe's argument checks, runs inside this agreement when the
    choice is sequential, so that one rank's bad input raises on every rank; inputs that are not two matrices, or
    no process group, choose fused, whose checks name the problem first (as ``agreement.agreed`` does).
    ``prefers_sequential(a, b, world_size)`` turns an unforced fused choice sequential."""
    if not dist.is_initialized():
        return FUSED
    world_size = groups.world_size_of(group, op)
    matrices = isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dim() == 2 and b.dim() == 2
    rows = a.shape[0] * (world_size if rows_per_a else 1) if matrices else None
    with agreement.agreed(f"{op} (form)", group, rows=rows, sequential_ok=sequential_ok, config=config):
        if rows is None:
            return FUSED
        choice = choose_form(op, rows, world_size, config, sequential_ok)
        if (choice == FUSED and not config and world_size > 1 and sequential_ok and prefers_sequential is not None
                and prefers_sequential(a, b, world_size)):
            choice = SEQUENTIAL
        if choice == SEQUENTIAL:
            check(a, b, world_size, op, *scales)
        return choice
