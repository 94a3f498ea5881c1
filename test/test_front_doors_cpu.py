"""The front doors (``kraken.all_reduce``, ``kraken.all_reduce_bias[_rms_norm]`` and their twins) choose
one-shot or two-shot as ``kraken.runtime.crossover``'s table says, per (size, world size); ``shot`` forces either; and
the missing twin, ``helion_ports.comm.all_gather_with_progress``, mirrors its recipe. No GPU needed."""

from __future__ import annotations

import importlib
import inspect
import re

import pytest
import torch

import helion_ports
import kraken
from benchmark import sm90
from fake_world import FakeWorld
from kraken.runtime import bias_doors, collectives, crossover, groups, prepared, symm

K = 1024
# (op, world size, the largest size that runs one-shot): the table in words (docs/history.md's measurements).
EXPECTED = [
    ("all_reduce", 2, 1 << 20), ("all_reduce", 4, 32 * K), ("all_reduce", 8, 32 * K),
    ("all_reduce", 3, 32 * K), ("all_reduce", 5, 32 * K), ("all_reduce", 7, 32 * K),
    ("all_reduce_bias", 2, 64), ("all_reduce_bias", 4, 16), ("all_reduce_bias", 8, 16),
    ("all_reduce_bias_rms_norm", 2, 64), ("all_reduce_bias_rms_norm", 4, 16), ("all_reduce_bias_rms_norm", 8, 16),
    ("all_reduce_bias", 3, 16), ("all_reduce_bias_rms_norm", 6, 16),
]
FRONT_DOORS = {  # op -> (front door module, one-shot module, two-shot module), under kraken.
    # The doors are product code (kraken.runtime.collectives, .bias_doors), no recipe file: ``door_plan``.
    "all_reduce": (None, "comm.one_shot_all_reduce", "comm.two_shot_all_reduce"),
    "all_reduce_bias": (None, "fused.one_shot_all_reduce_bias", "fused.two_shot_all_reduce_bias"),
    "all_reduce_bias_rms_norm": (None, "fused.one_shot_all_reduce_bias_rms_norm",
                                 "fused.two_shot_all_reduce_bias_rms_norm"),
}


def door_of(package: str, op: str):
    """The front door: the public function ``kraken.<op>`` or ``helion_ports.<op>``."""
    return getattr(importlib.import_module(package), op)


def recipes_of(package: str, op: str) -> tuple:
    """The door's (one-shot, two-shot) recipe modules under ``package``."""
    return tuple(importlib.import_module(f"{package}.{m}") for m in FRONT_DOORS[op][1:])


def door_plan(package: str, op: str):
    """The door's ``plan`` (its choice under ``"shot"`` and the chosen recipe's plan)."""
    if op == "all_reduce":
        return collectives.all_reduce_plan
    return getattr(bias_doors, f"plan_{op}")  # one plan for the door and its twin's


@pytest.mark.parametrize("op,world_size,last_one_shot", EXPECTED, ids=[f"{o}-ws{w}" for o, w, _ in EXPECTED])
def test_choice_follows_the_table(op, world_size, last_one_shot):
    assert crossover.choose(op, 1, world_size) == "one"
    assert crossover.choose(op, last_one_shot, world_size) == "one"
    assert crossover.choose(op, last_one_shot + 1, world_size) == "two"
    assert crossover.choose(op, 64 * last_one_shot, world_size) == "two"
    for shot in ("one", "two"):  # forced either way, at both ends
        assert crossover.choose(op, 1, world_size, shot) == shot
        assert crossover.choose(op, 64 * last_one_shot, world_size, shot) == shot


@pytest.mark.parametrize("op", sorted(FRONT_DOORS))
def test_a_group_of_one_runs_one_shot_and_bad_choices_raise(op):
    assert crossover.choose(op, 1 << 30, 1) == "one"
    for world_size in (0, 9):
        with pytest.raises(ValueError, match="world size"):
            crossover.choose(op, 1, world_size)
    with pytest.raises(ValueError, match="shot must be"):
        crossover.choose(op, 1, 2, "three")


def test_sizes_the_table_counts():
    x = torch.empty(3, 5, 7)
    assert crossover.size_of("all_reduce", x) == 105
    assert crossover.size_of("all_reduce_bias", x) == 15 and crossover.size_of("all_reduce_bias_rms_norm", x) == 15
    # Not a tensor, or no rows: 0 (one-shot), and the recipe's own checks then name the problem.
    assert crossover.size_of("all_reduce_bias", [1, 2]) == 0 and crossover.size_of("all_reduce", torch.tensor(1.0)) == 0
    assert crossover.size_of("all_reduce_bias", torch.empty(4, 0)) == 0


@pytest.mark.parametrize("op", sorted(FRONT_DOORS))
@pytest.mark.parametrize("world_size,size", [(2, 8), (2, 1 << 22), (4, 8), (4, 1 << 22), (8, 100), (8, 1 << 20)])
def test_plan_is_the_chosen_recipes_plan(op, world_size, size):
    plan, (one, two) = door_plan("kraken", op), recipes_of("kraken", op)
    assert door_plan("helion_ports", op) is plan  # one plan, one choice
    shot = crossover.choose(op, size, world_size)
    args = (size, world_size) if op == "all_reduce" else (size, 4096, world_size)
    assert plan(*args, {}) == {"shot": shot, **(one if shot == "one" else two).plan(*args, {})}
    forced = "two" if shot == "one" else "one"
    assert plan(*args, {"shot": forced}) == {"shot": forced, **(one if forced == "one" else two).plan(*args, {})}


CALLS = {  # op -> how to call its front door ``fn`` on x
    "all_reduce": lambda fn, x, **config: fn(x, **config),
    "all_reduce_bias": lambda fn, x, **config: fn(x, torch.empty(x.shape[-1]), **config),
    "all_reduce_bias_rms_norm": lambda fn, x, **config: fn(x, torch.empty(x.shape[-1]), torch.empty(x.shape[-1]),
                                                          1e-6, **config),
}


def recorded_recipes(monkeypatch, package: str, op: str) -> list:
    """The front door's two recipes' ``launch`` replaced by recorders of (shot, the door's input as the launch got
    it, the launch configuration); returns the record. The doors launch the chosen recipe on the preparation they
    keep (``door_call``): ``all_reduce``'s passes an ordinary input as ``x`` (staged), the bias family's first."""
    calls = []
    for shot, recipe in zip(("one", "two"), recipes_of(package, op)):
        assert recipe.__name__ == f"{package}.{FRONT_DOORS[op][1 if shot == 'one' else 2]}"

        def record(*args, _shot=shot, launcher, group_name, **launch_cfg):
            x = launch_cfg.pop("x") if op == "all_reduce" else args[0]
            calls.append((_shot, x, launch_cfg))

        monkeypatch.setattr(recipe, "launch", record)
    return calls


def reached(op: str, shot: str, x: torch.Tensor, world_size: int, config: dict) -> dict:
    """The launch configuration ``shot``'s recipe should get: its ``plan`` with ``config``."""
    recipe = importlib.import_module(f"kraken.{FRONT_DOORS[op][1 if shot == 'one' else 2]}")
    if op == "all_reduce":
        return recipe.plan(x.numel(), world_size, config)
    return recipe.plan(x.shape[0], x.shape[1], world_size, config)


@pytest.fixture
def two_ranks(monkeypatch):
    """A fake two-rank world (``fake_world.FakeWorld``: this process is rank 0, ``world.other`` says what rank 1
    sends), CPU tensors standing in for CUDA ones and the symmetric buffers faked: the doors' and the recipes'
    own host code runs, checks, agreement and prepared calls included; launches can be captured
    (``sm90.capture_launches``)."""
    prepared.forget_prepared_calls()
    world = FakeWorld(monkeypatch)
    monkeypatch.setattr(groups, "check_tensor", lambda *args, **kwargs: None)
    monkeypatch.setattr(symm, "symm_workspace", lambda numel, dtype, device, group, op: torch.zeros(numel, dtype=dtype))
    monkeypatch.setattr(symm, "symm_context", lambda tensor, group, op, name="tensor": symm.SymmContext(
        0, 2, "fake", (tensor, torch.zeros_like(tensor)), sm90.FAKE_SIGNAL_PADS))
    yield world
    prepared.forget_prepared_calls()  # no prepared call built on fakes outlives the test


@pytest.mark.parametrize("package", ["kraken", "helion_ports"])
@pytest.mark.parametrize("op", sorted(FRONT_DOORS))
def test_front_door_calls_the_chosen_recipe(two_ranks, monkeypatch, package, op):
    """The call reaches the recipe the table names, with the caller's group and config less ``shot``."""
    fn = door_of(package, op)
    calls = recorded_recipes(monkeypatch, package, op)
    world = {"size": 4}
    monkeypatch.setattr(groups, "world_size_of", lambda group, op_name: world["size"])
    sizes = (8 * K, 64 * K) if op == "all_reduce" else (16, 32)  # one-shot and two-shot at 4 ranks
    for world_size, size, expected in ((4, sizes[0], "one"), (4, sizes[1], "two"), (2, sizes[1], "one"),
                                       (1, 64 * sizes[1], "one")):
        world["size"] = world_size
        prepared.forget_prepared_calls()  # the choice is kept per signature, and the default group's size changed
        x = torch.empty(size) if op == "all_reduce" else torch.empty(size, 96)
        calls.clear()
        CALLS[op](fn, x, max_blocks=8)  # a key every recipe of the door knows: the door checks the config too
        ((shot, seen, config),) = calls
        assert shot == expected, (world_size, tuple(x.shape))
        assert seen is x and config == reached(op, shot, x, world_size, {"max_blocks": 8})
        calls.clear()
        forced = "two" if expected == "one" else "one"
        CALLS[op](fn, x, shot=forced)
        assert calls[0][0] == forced and calls[0][2] == reached(op, forced, x, world_size, {})


@pytest.mark.parametrize("package", ["kraken", "helion_ports"])
@pytest.mark.parametrize("op", sorted(FRONT_DOORS))
def test_while_dynamo_traces_a_door_calls_the_chosen_recipes_operator(monkeypatch, package, op):
    """While Dynamo traces, the doors neither check nor prepare (``door_call``): they call the chosen recipe's public
    function (its operator there) with the caller's arguments and group, the config less ``shot``."""
    calls = []
    for shot, recipe in zip(("one", "two"), recipes_of(package, op)):
        public = crossover.PUBLIC[recipe.__name__.split(".")[0]]  # where its public function (operator) is
        monkeypatch.setattr(importlib.import_module(public), recipe.__name__.rpartition(".")[2],
                            lambda *args, _shot=shot, **config: calls.append((_shot, args, config)))
        monkeypatch.setattr(recipe, "launch", lambda *args, **kwargs: pytest.fail("a traced door launched"))
    monkeypatch.setattr(torch.compiler, "is_dynamo_compiling", lambda: True)
    monkeypatch.setattr(groups, "world_size_of", lambda group, op_name: 4)
    sizes = (8 * K, 64 * K) if op == "all_reduce" else (16, 32)  # one-shot and two-shot at 4 ranks
    for size, expected in zip(sizes, ("one", "two")):
        x = torch.empty(size) if op == "all_reduce" else torch.empty(size, 96)
        forced = "two" if expected == "one" else "one"
        CALLS[op](door_of(package, op), x, max_blocks=8)
        CALLS[op](door_of(package, op), x, shot=forced)
        (shot, args, config), (forced_shot, _, forced_config) = calls
        assert (shot, forced_shot) == (expected, forced) and args[0] is x and args[-1] is None  # the default group
        assert len(args) == {"all_reduce": 2, "all_reduce_bias": 3, "all_reduce_bias_rms_norm": 5}[op]
        assert config == {"max_blocks": 8} and forced_config == {}
        calls.clear()


BF16 = torch.bfloat16
RECIPE_FIRST = {  # op -> (a good call's arguments after x, rank 1's bad argument, what rank 1's check says of it)
    "all_reduce": ((), "tensor", "tensor must be contiguous"),
    "all_reduce_bias": ((torch.ones(1000, dtype=BF16),), "bias", "bias must have shape (1000,)"),
    "all_reduce_bias_rms_norm": ((torch.ones(1000, dtype=BF16), torch.ones(1000, dtype=BF16), 1e-5), "bias",
                                 "bias must have shape (1000,)"),
}


def rank_one_bad(argument: str, message: str):
    """``FakeWorld.other``: rank 1 passes its own bad ``argument`` (a shape or layout rank 0 does not have) and its
    check refused it with ``message``, as ``agreement.agreed`` reports a local error."""

    def other(mine):
        signature, _ = mine
        bad = ("tensor", (999,), "bfloat16", "cuda", False)
        return tuple((n, bad if n == argument else s) for n, s in signature), ("ValueError", message)

    return other


@pytest.mark.parametrize("op", sorted(FRONT_DOORS))
def test_one_rank_alone_bad_raises_through_the_door_on_a_signature_the_recipe_ran(two_ranks, op):
    """The GPU family test's case at two ranks: the one-shot recipe, called directly, has run this call signature
    (agreed, prepared); then rank 1 alone passes bad input to the front door on it. Rank 0 must raise too, naming
    rank 1, before any launch: the door agrees on its own first call of a signature, since the recipe's prepared
    call (shared with direct calls) would skip the exchange and launch, leaving rank 1 to raise alone."""
    one_path = FRONT_DOORS[op][1]
    door = door_of("kraken", op)
    rest, argument, message = RECIPE_FIRST[op]
    x = torch.randn(7000, dtype=BF16) if op == "all_reduce" else torch.randn(7, 1000, dtype=BF16)
    assert crossover.choose(op, crossover.size_of(op, x), 2) == "one"  # the door calls the recipe that ran
    with sm90.capture_launches() as launches:
        getattr(kraken, one_path.rsplit(".", 1)[1])(x, *rest)
        assert len(launches) == 1 and two_ranks.exchanges == 1
        two_ranks.other = rank_one_bad(argument, message)
        with pytest.raises(ValueError, match=rf"^{op}: bad input on rank 1: {re.escape(message)}"):
            door(x, *rest)
        assert len(launches) == 1, "rank 0 launched while rank 1 raised"
        assert two_ranks.exchanges == 2
        two_ranks.other = None  # rank 1 passes good input again: the door agrees once, then its prepared call
        for _ in range(3):
            door(x, *rest)
        assert len(launches) == 4 and two_ranks.exchanges == 3
        assert all("one_shot" in launch.kernel.fn.__name__ for launch in launches)


@pytest.mark.parametrize("op", sorted(FRONT_DOORS))
def test_each_door_agrees_on_its_own_first_calls(two_ranks, monkeypatch, op):
    """The twin's door is another door: a signature kraken's door agreed on is new to the twin's, which agrees on
    it again (so rank 1's bad input there raises on rank 0 too), naming itself."""
    rest, argument, message = RECIPE_FIRST[op]
    x = torch.randn(7000, dtype=BF16) if op == "all_reduce" else torch.randn(7, 1000, dtype=BF16)
    doors = []
    for package in ("kraken", "helion_ports"):
        recorded_recipes(monkeypatch, package, op)
        doors.append(door_of(package, op))
    kraken_door, twin_door = doors
    kraken_door(x, *rest)
    two_ranks.other = rank_one_bad(argument, message)
    with pytest.raises(ValueError, match=rf"^helion {op}: bad input on rank 1: {re.escape(message)}"):
        twin_door(x, *rest)


@pytest.mark.parametrize("package", ["kraken", "helion_ports"])
@pytest.mark.parametrize("op", sorted(FRONT_DOORS))
def test_forced_shots_that_differ_between_ranks_raise_on_every_rank(two_ranks, monkeypatch, package, op):
    """``shot`` is part of the agreed signature: rank 0 forcing one-shot while rank 1 forces two-shot would launch
    two different kernels against each other; both raise instead, and no recipe is called."""
    calls = recorded_recipes(monkeypatch, package, op)
    rest, _, _ = RECIPE_FIRST[op]
    x = torch.randn(7000, dtype=BF16) if op == "all_reduce" else torch.randn(7, 1000, dtype=BF16)
    two_ranks.other = lambda mine: (tuple((n, (("shot", "two"),) if n == "config" else s) for n, s in mine[0]), None)
    differs = "config: rank 0 (('shot', 'one'),), rank 1 (('shot', 'two'),)"
    with pytest.raises(ValueError, match=re.escape(f"ranks disagree on the input's shape/dtype ({differs})")):
        door_of(package, op)(x, *rest, shot="one")
    assert calls == []


def test_front_door_launch_reaches_the_chosen_kernel():
    """The benchmark's example of the door (its pair names the two-shot modules) launches the kernel of the recipe
    the door's ``plan`` chooses, of the pair's package (CPU stand-ins, captured, not run)."""
    from benchmark.ops.all_reduce import auto_example

    for package in ("kraken", "helion_ports"):
        pair_module = importlib.import_module(f"{package}.comm.two_shot_all_reduce")
        for numel, expected in ((10007, "one_shot"), (1 << 20 | 7, "two_shot")):
            with sm90.capture_launches() as launches:
                auto_example(pair_module, 4, shape=(numel,))
            (launch,) = launches
            assert expected in launch.kernel.fn.__name__ or expected in launch.kernel.__name__, (package, numel)


# ---------------------------------------------------------------------------
# The missing twin: helion_ports.comm.all_gather_with_progress
# ---------------------------------------------------------------------------

GATHER = "comm.all_gather_with_progress"


def parameters(fn) -> list:
    """A signature's parameters but the launcher's default (Triton's launch in a recipe, None in a twin)."""
    return [(p.name, p.kind, p.default if p.name != "launcher" else None)
            for p in inspect.signature(fn).parameters.values()]


def test_gather_twin_mirrors_its_recipe():
    recipe, twin = (importlib.import_module(f"{p}.{GATHER}") for p in ("kraken", "helion_ports"))
    twins, progress = (importlib.import_module(f"kraken.runtime.{m}") for m in ("twins", "progress"))
    assert helion_ports.all_gather_with_progress is twins.all_gather_with_progress
    assert kraken.all_gather_with_progress is progress.all_gather_with_progress
    for name in ("all_gather_with_progress", "launch", "plan", "set_flag"):
        assert parameters(getattr(twin, name)) == parameters(getattr(recipe, name)), name
    # The twin's barrier also takes Helion's process-group name, after the recipe's arguments.
    recipe_params = [p.name for p in inspect.signature(recipe.barrier).parameters.values()]
    assert [p.name for p in inspect.signature(twin.barrier).parameters.values()][:len(recipe_params)] == recipe_params
    # Its own copy of the plan and constants (no import of the recipe).
    for rank, world_size in ((0, 1), (1, 2), (3, 4), (7, 8), (2, 8)):
        assert twin.plan(rank, world_size) == recipe.plan(rank, world_size)
        assert progress.copy_order(rank, world_size) == recipe.plan(rank, world_size)["order"]
    for name in ("BARRIER_BLOCK", "BARRIER_WARPS", "LANDED"):
        assert getattr(twin, name) == getattr(recipe, name), name


@pytest.mark.parametrize("world_size", [1, 2, 8])
def test_gather_twin_barrier_compiles_to_the_recipes_barrier(world_size):
    """One block, one warp, block id 0, and the same system-scope CAS release/acquire pair as the recipe's."""
    stats = []
    for package in ("kraken", "helion_ports"):
        module = importlib.import_module(f"{package}.{GATHER}")
        with sm90.capture_launches() as launches:
            module.barrier(sm90.FAKE_SIGNAL_PADS, world_size - 1, world_size)
        (launch,) = launches
        assert launch.kwargs.get("num_warps") == 1 and tuple(launch.grid) == (1,), package
        stats.append(sm90.kernel_stats(launch))
    recipe, twin = stats
    assert sm90.barrier_opcodes(twin["ptx"]) == sm90.barrier_opcodes(recipe["ptx"])
    assert dict(sm90.barrier_opcodes(recipe["ptx"])) == {
        "atom.global.release.sys.cas.b32": 1, "atom.global.acquire.sys.cas.b32": 1}
    assert twin["spill_bytes"] == 0


def test_gather_twin_launches_only_the_helion_barrier(monkeypatch):
    """The twin's exchange launches its Helion barrier (twice: around the copies) through the installed package's
    launcher, never the recipe's Triton kernel; on one rank it copies my rows and flags them."""
    twin = importlib.import_module(f"helion_ports.{GATHER}")
    ran: list = []

    class Through:  # a prepared call's launcher: the Helion kernels go through its ``helion``
        def helion(self, kernel, args, kernel_args=None):
            ran.append((kernel, args[1:4]))

    shard, out = torch.randn(3, 4), torch.zeros(3, 4)
    flags: list = []
    monkeypatch.setattr(twin, "set_flag", lambda progress, index, value=1: flags.append(index))
    twin.launch((shard,), out, torch.zeros(1, dtype=torch.int32), sm90.FAKE_SIGNAL_PADS, 0, (0,), launcher=Through())
    assert [kernel for kernel, _ in ran] == [twin.compiled()] * 2
    assert [args for _, args in ran] == [(sm90.FAKE_SIGNAL_PADS, 0, 1)] * 2
    assert flags == [0] and torch.equal(out, shard)


@pytest.fixture
def fake_world():
    """A 4-rank process group in this one process (torch's ``fake`` backend: no peers, no collectives run)."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    dist.init_process_group("fake", rank=1, world_size=4, store=FakeStore())
    yield dist.group.WORLD
    dist.destroy_process_group()


@pytest.mark.parametrize("package", ["kraken", "helion_ports"])
def test_front_doors_trace_to_the_chosen_operators(fake_world, package):
    """Under Dynamo (``torch.export``, strict: no graph break) a front door makes its choice at trace time and
    leaves the chosen recipe's operator in the graph (``kraken/runtime/library.py``), forced choices included."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    comm = fused = importlib.import_module(package)

    class Block(torch.nn.Module):
        def forward(self, x, bias, weight):
            y = fused.all_reduce_bias(x, bias, fake_world)  # 40 tokens at 4 ranks: two-shot
            z = fused.all_reduce_bias_rms_norm(y[:3], bias, weight, 1e-5, fake_world, shot="two")
            return comm.all_reduce(z.reshape(-1), fake_world), comm.all_reduce(y.reshape(-1), fake_world)

    with FakeTensorMode():
        args = (torch.empty(40, 16, device="cuda"), torch.empty(16, device="cuda"), torch.empty(16, device="cuda"))
        program = torch.export.export(Block(), args, strict=True)
    namespace = "kraken" if package == "kraken" else "kraken_helion"
    ops = [str(n.target).removesuffix(".default") for n in program.graph.nodes
           if str(n.target).startswith(f"{namespace}.")]
    # 48 elements: one-shot; 640 elements at 4 ranks: one-shot too (up to 32K).
    assert ops == [f"{namespace}.{name}" for name in ("two_shot_all_reduce_bias", "two_shot_all_reduce_bias_rms_norm",
                                                       "one_shot_all_reduce", "one_shot_all_reduce")], ops
