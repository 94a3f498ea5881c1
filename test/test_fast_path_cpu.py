"""The host fast path (``prepared.per_signature``, ``Launcher``, ``kraken._blocks.helion.run``), on CPU.

After one warm call, the next calls of the same signature make no collective, find no symmetric buffer,
build no plan, and launch through the compiled kernel with exactly the arguments Triton's JIT bound on
the first launch. A new signature (here, a bad config) still goes through the checks and raises. No call's
tensors outlive their caller's references (nothing holds them, in a reference cycle or otherwise).
"""

from __future__ import annotations

import contextlib
import functools
import gc
import importlib
import inspect
import sys
import weakref

import pytest
import torch
import triton
from triton.runtime.jit import JITFunction

from benchmark import sm90
from fake_world import FakeWorld
from kraken.runtime import crossover, graphs, groups, prepared, symm
from kraken.runtime.launcher import Launcher, jit_launch, tma_operand
from kraken.runtime.replay import NOT_REPLAYED, NOT_YET, Replay, record_replay, replayed

WARM_CALLS = 5


class FakeCompiled:
    """What ``kernel[grid](...)`` returns on a GPU: a compiled kernel whose ``run`` launches (recorded here)."""

    function, packed_metadata = "cufunction", "packed metadata"

    def __init__(self, log: list):
        self.run = lambda *args: log.append(("fast", args))


@pytest.fixture
def launches(monkeypatch):
    """Every launch, as ("jit", kernel, args, meta, grid) or ("fast", launcher args); no GPU is touched."""
    log: list = []

    def jit_run(kernel, *args, grid, warmup, **meta):
        log.append(("jit", kernel, args, meta, grid))
        return FakeCompiled(log)

    with sm90.capture_launches():  # Helion's compile-time view of an H200; then our fake JIT run on top
        monkeypatch.setattr(JITFunction, "run", jit_run)
        monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda device: 1234, raising=False)
        monkeypatch.setattr(torch._C, "_cuda_getDevice", lambda: 0, raising=False)
        yield log


def test_launcher_replays_the_jit_bound_arguments(launches):
    kernel = importlib.import_module("kraken.comm.one_shot_all_reduce").one_shot_all_reduce_kernel
    peers = (torch.zeros(8), torch.zeros(8))
    out = torch.zeros(8)
    launcher = Launcher("op")
    for _ in range(3):
        launcher(kernel, (3,), peers, out, peers[0], peers[0], 77, 8, 1024, 1, 2, BLOCK_SIZE=1024, STAGED=False,
                 num_warps=4)
    (_, _, args, meta, grid), *fast = launches
    assert grid == (3,) and meta == {"BLOCK_SIZE": 1024, "STAGED": False, "num_warps": 4}
    assert [kind for kind, _ in fast] == ["fast", "fast"]
    for _, run_args in fast:
        # grid x, y, z, the current stream, the function, its metadata, no hooks, then every parameter in
        # order: the ones passed positionally, then the constexprs passed by keyword, then WIDE at its default.
        assert run_args[:9] == (3, 1, 1, 1234, "cufunction", "packed metadata", None, None, None)
        assert run_args[9:] == (*args, 1024, False, False)
        assert run_args[9] is peers and run_args[10] is out


def c_launcher(monkeypatch, launch, launch_pdl: bool = False) -> Launcher:
    """A ``Launcher`` whose kernels 'compile' (a fake JIT) to triton 3.6's ``CudaLauncher`` shape with no
    scratch: ``launch`` is its C launch function, and its Python ``__call__`` must not be called."""

    class CudaLauncher:
        global_scratch_size = profile_scratch_size = 0
        launch_cooperative_grid = False

        def __call__(self, *args):
            raise AssertionError("the Python wrapper was called")

    runner = CudaLauncher()
    runner.launch, runner.launch_pdl = launch, launch_pdl

    class Compiled:
        function, packed_metadata, run = "cufunction", "packed metadata", runner

    monkeypatch.setattr(JITFunction, "run", lambda self, *args, grid, warmup, **meta: Compiled())
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda device: 1234, raising=False)
    monkeypatch.setattr(torch._C, "_cuda_getDevice", lambda: 0, raising=False)
    return Launcher("op")


def test_launcher_calls_the_c_launch_function_when_no_scratch_is_needed(monkeypatch):
    """With triton 3.6's CudaLauncher (``run.launch`` and no scratch), the launch skips its Python ``__call__``
    and passes what that would pass: no scratch buffers, the cooperative/PDL flags, metadata, no hooks."""
    log: list = []
    kernel = importlib.import_module("kraken.comm.one_shot_all_reduce").one_shot_all_reduce_kernel
    launcher = c_launcher(monkeypatch, lambda *args: log.append(args), launch_pdl=True)
    args = ((torch.zeros(8), torch.zeros(8)), torch.zeros(8), torch.zeros(8), torch.zeros(8), 77, 8, 1024, 1, 2)
    for _ in range(2):
        launcher(kernel, (5,), *args, BLOCK_SIZE=1024, STAGED=False, num_warps=4)
    assert log == [(5, 1, 1, 1234, "cufunction", False, True, None, None, "packed metadata", None, None, None,
                    *args, 1024, False, False)]  # BLOCK_SIZE, STAGED, WIDE (its default)


def test_launcher_takes_the_jit_path_while_a_launch_hook_is_set(launches, monkeypatch):
    from triton import knobs

    kernel = importlib.import_module("kraken.comm.one_shot_all_reduce").one_shot_all_reduce_kernel
    launcher = Launcher("op")
    args = ((torch.zeros(8), torch.zeros(8)), torch.zeros(8), torch.zeros(8), torch.zeros(8), 77, 8, 1024, 1, 2)
    launcher(kernel, (1,), *args, BLOCK_SIZE=1024, STAGED=False, num_warps=4)
    hook = lambda metadata: None  # noqa: E731
    knobs.runtime.launch_enter_hook.add(hook)
    try:
        launcher(kernel, (1,), *args, BLOCK_SIZE=1024, STAGED=False, num_warps=4)
    finally:
        knobs.runtime.launch_enter_hook.remove(hook)
    launcher(kernel, (1,), *args, BLOCK_SIZE=1024, STAGED=False, num_warps=4)
    assert [entry[0] for entry in launches] == ["jit", "jit", "fast"]


def symmetric_world(monkeypatch, plan_module: str) -> dict:
    """A fake 2-rank world (this process rank 1's view of its peers) that counts the per-signature work."""
    counts = {"symm_context": 0, "plan": 0}
    prepared.forget_prepared_calls()
    world = FakeWorld(monkeypatch)
    counts["world"] = world

    def symm_context(tensor, group, op, name="tensor"):
        counts["symm_context"] += 1
        return symm.SymmContext(1, 2, "fake", (torch.zeros_like(tensor), tensor), sm90.FAKE_SIGNAL_PADS)

    def symm_workspace(numel, dtype, device, group, op):
        return torch.zeros(numel, dtype=dtype)

    module = importlib.import_module(plan_module)
    real_plan = module.plan

    def plan(*args, **kwargs):
        counts["plan"] += 1
        return real_plan(*args, **kwargs)

    monkeypatch.setattr(symm, "symm_context", symm_context)
    monkeypatch.setattr(symm, "symm_workspace", symm_workspace)
    monkeypatch.setattr(groups, "check_tensor", lambda *args, **kwargs: None)  # CPU tensors stand in for CUDA ones
    monkeypatch.setattr(module, "plan", plan)
    return counts


CASES = [
    # (module of the public function, its name, recipe module whose plan/prepare it uses, the call's arguments)
    ("kraken.runtime.collectives", "one_shot_all_reduce", "kraken.comm.one_shot_all_reduce",
     lambda: (torch.randn(1000, dtype=torch.bfloat16),)),
    ("helion_ports", "one_shot_all_reduce", "kraken.comm.one_shot_all_reduce",
     lambda: (torch.randn(1000, dtype=torch.bfloat16),)),
    ("kraken.runtime.collectives", "reduce_scatter", "kraken.comm.reduce_scatter",
     lambda: (torch.randn(1000, dtype=torch.bfloat16),)),
    ("helion_ports", "reduce_scatter", "kraken.comm.reduce_scatter", lambda: (torch.randn(1000, dtype=torch.bfloat16),)),
    ("kraken.runtime.collectives", "all_gather", "kraken.comm.all_gather",
     lambda: (torch.randn(1000, dtype=torch.bfloat16),)),
    ("helion_ports", "all_gather", "kraken.comm.all_gather", lambda: (torch.randn(1000, dtype=torch.bfloat16),)),
    ("kraken.runtime.bias_norm", "one_shot_all_reduce_bias", "kraken.fused.one_shot_all_reduce_bias",
     lambda: (torch.randn(4, 256, dtype=torch.bfloat16), torch.randn(256, dtype=torch.bfloat16))),
    ("helion_ports", "one_shot_all_reduce_bias", "kraken.fused.one_shot_all_reduce_bias",
     lambda: (torch.randn(4, 256, dtype=torch.bfloat16), torch.randn(256, dtype=torch.bfloat16))),
    ("kraken.runtime.bias_norm", "one_shot_all_reduce_bias_rms_norm", "kraken.fused.one_shot_all_reduce_bias_rms_norm",
     lambda: (torch.randn(4, 320, dtype=torch.bfloat16), torch.randn(320, dtype=torch.bfloat16),
              torch.randn(320, dtype=torch.bfloat16))),
]


def same_kind(launched, bound, addresses: bool) -> bool:
    """Whether a fast launch's argument is of the kind the JIT bound: the same type, or (``addresses``) an int
    address where it bound a tensor."""
    if isinstance(bound, tuple):
        return isinstance(launched, tuple) and all(same_kind(a, b, addresses) for a, b in zip(launched, bound))
    if addresses and isinstance(bound, torch.Tensor):
        return type(launched) is int and launched != 0
    return type(launched) is type(bound)


@pytest.mark.parametrize("module,name,plan_module,make_args", CASES, ids=[f"{c[0]}:{c[1]}" for c in CASES])
def test_warm_calls_do_no_per_call_work(monkeypatch, launches, module, name, plan_module, make_args):
    counts = symmetric_world(monkeypatch, plan_module)
    fn = getattr(importlib.import_module(module), name)
    args = make_args()
    jit_calls = 2 if module.startswith("helion_ports") else 1
    outputs = [fn(*args) for _ in range(jit_calls)]
    # Nothing of Triton's host API per warm call: triton.next_power_of_2 is a constexpr_function in triton 3.6
    # (about 2 us a call); the launch paths use groups.next_power_of_2.
    real_next_power_of_2, pow2_calls = triton.next_power_of_2, []
    monkeypatch.setattr(triton, "next_power_of_2", lambda n: pow2_calls.append(n) or real_next_power_of_2(n))
    # A collective's warm call finds its prepared call with the keys ``staging.prepares`` spells out: were they not
    # the keys ``prepare`` and ``prepare_staged`` keep it under, the call would go on to those (and ``tensor_key``).
    real_tensor_key, keyed = prepared.tensor_key, []
    monkeypatch.setattr(prepared, "tensor_key", lambda *a, **k: keyed.append(a) or real_tensor_key(*a, **k))
    outputs += [fn(*args) for _ in range(WARM_CALLS - jit_calls)]
    assert not pow2_calls, "a warm call went through triton.next_power_of_2"
    assert not keyed or ".fused." in plan_module, "a collective's warm call missed its prepared call's key"
    world = counts["world"]
    assert world.exchanges == 1, "the ranks agreed on the signature more than once"
    assert counts["plan"] == 1 and counts["symm_context"] == 1, counts
    kinds = [entry[0] for entry in launches]
    # A collective's twin stages its ordinary input by a copy launch of its own (``kraken._blocks.helion.stage``): two
    # launches a call. A Triton recipe binds once through the JIT; a Helion twin compiles with its plain call, then
    # binds once more through the prepared call's launcher.
    per_call = 2 if module.startswith("helion_ports") and ".comm." in plan_module else 1
    assert kinds == ["jit"] * jit_calls * per_call + ["fast"] * (WARM_CALLS - jit_calls) * per_call, kinds
    bound = [entry[2] for entry in launches[(jit_calls - 1) * per_call:jit_calls * per_call]]
    # The inputs here are ordinary tensors: staged. Warm calls replay their launches (``Replay``: the whole
    # call, ``replayed``, or a twin's kernel): their tensors go in as their addresses.
    recorded = jit_calls + 1 if module.startswith("helion_ports") else jit_calls  # (twins replay one call earlier)
    for i, (_, run_args) in enumerate(launches[recorded * per_call:]):
        jit_args = bound[i % per_call]
        assert len(run_args) - 9 >= len(jit_args)
        assert all(same_kind(a, b, True) for a, b in zip(run_args[9:], jit_args))
    if per_call == 2:  # the staging copy is a launch like the others: the twin's whole call replays
        product = inspect.getmodule(fn.__wrapped__)  # the product module that prepares the twin's calls
        twin_launch = importlib.import_module(twin_module(plan_module)).launch
        _, launch_cfg, staged = product.prepare_call(args[0], None, f"helion {name}", {})
        assert staged and launch_cfg["launcher"].replays.get(twin_launch) is not None, "not replayed whole"
    assert all(out is not outputs[0] for out in outputs[1:]), "every call returns a new tensor"

    with pytest.raises(TypeError, match="unknown config keys"):
        fn(*args, not_a_key=1)  # a new signature: checked (and agreed) again, so it raises
    assert world.exchanges == 2


def twin_module(recipe_module: str) -> str:
    """The twin's file of a recipe's: ``kraken.comm.x`` -> ``helion_ports.comm.x``."""
    return recipe_module.replace("kraken.", "helion_ports.", 1)


BF16 = lambda *shape: torch.randn(*shape, dtype=torch.bfloat16)  # noqa: E731
REPLAYED = [  # (module, public function, module whose plan it uses, the call's arguments, config, in place)
    ("kraken.runtime.collectives", "one_shot_all_reduce", "kraken.comm.one_shot_all_reduce",
     lambda: (BF16(1000),), {}, False),
    ("kraken.runtime.collectives", "two_shot_all_reduce", "kraken.comm.two_shot_all_reduce",
     lambda: (BF16(1000),), {}, True),
    ("kraken.runtime.collectives", "reduce_scatter", "kraken.comm.reduce_scatter", lambda: (BF16(1000),), {}, False),
    ("kraken.runtime.collectives", "all_gather", "kraken.comm.all_gather", lambda: (BF16(1000),), {}, False),
    ("kraken.runtime.collectives", "all_reduce", "kraken.comm.one_shot_all_reduce", lambda: (BF16(1000),),
     {"shot": "one"}, False),
    ("kraken.runtime.collectives", "all_reduce", "kraken.comm.two_shot_all_reduce", lambda: (BF16(1000),),
     {"shot": "two"}, True),
    ("helion_ports", "two_shot_all_reduce", "kraken.comm.two_shot_all_reduce", lambda: (BF16(1000),), {}, True),
    ("helion_ports", "reduce_scatter", "kraken.comm.reduce_scatter", lambda: (BF16(1000),), {}, False),
    ("helion_ports", "all_gather", "kraken.comm.all_gather", lambda: (BF16(1000),), {}, False),
    ("helion_ports", "all_reduce", "kraken.comm.two_shot_all_reduce", lambda: (BF16(1000),), {"shot": "two"}, True),
    ("helion_ports", "one_shot_all_reduce", "kraken.comm.one_shot_all_reduce", lambda: (BF16(1000),), {}, False),
    ("kraken.runtime.bias_norm", "one_shot_all_reduce_bias", "kraken.fused.one_shot_all_reduce_bias",
     lambda: (BF16(4, 256), BF16(256)), {}, False),
    ("kraken.runtime.bias_norm", "two_shot_all_reduce_bias_rms_norm",
     "kraken.fused.two_shot_all_reduce_bias_rms_norm", lambda: (BF16(4, 320), BF16(320), BF16(320), 1e-5), {}, False),
    ("helion_ports", "one_shot_all_reduce_bias", "kraken.fused.one_shot_all_reduce_bias",
     lambda: (BF16(4, 256), BF16(256)), {}, False),
]


@pytest.mark.parametrize("module,name,plan_module,make_args,config,in_place", REPLAYED,
                         ids=[f"{c[0]}:{c[1]}-{c[4].get('shot', '')}" for c in REPLAYED])
def test_a_whole_call_replay_launches_what_its_host_code_launches(monkeypatch, launches, module, name, plan_module,
                                                                  make_args, config, in_place):
    """``replayed`` (the collectives' ``staging.launched``, the bias family's ``staged_call``): a call's first run
    runs its host code, the next ones replay its launches with no host code. Each call here has new inputs (and gets a
    new output), so each replay must launch exactly what the host code launched on the first call, with the inputs'
    and the output's addresses moved to this call's. The prepared call's own tensors (the staging workspace: the
    peers) stay where they are."""
    symmetric_world(monkeypatch, plan_module)
    try:
        fn = getattr(importlib.import_module(module), name)
        twin = module.startswith("helion_ports")
        calls = [make_args() for _ in range(WARM_CALLS)]
        if twin and ".comm." in plan_module:  # it stages by a copy launch: its whole call replays on symmetric inputs
            monkeypatch.setattr(symm, "is_symmetric", lambda tensor: True)
            calls = calls[:1] * WARM_CALLS  # (one prepared call per symmetric address)
        with collector_off():
            outputs = [fn(*args, **config) for args in calls]
            # the call's launch function: a front door's own (``launch``), the twin's, or the recipe's (a standalone
            # recipe's public function is elsewhere)
            launch = getattr(fn, "launch", None) or importlib.import_module(
                twin_module(plan_module) if twin else plan_module).launch
            assert_replays_match(launches, calls, outputs, twin, launch)
            assert all((out is args[0]) == in_place for args, out in zip(calls, outputs))
            if not (twin and ".comm." in plan_module):  # (a symmetric input is its prepared call's own)
                assert_freed_with_their_callers_references(launches, calls, outputs)
    finally:
        prepared.forget_prepared_calls()


GEMMS = [  # (package of the public function, its name, product module, recipe or twin module, the call's arguments)
    ("kraken", "gemm_reduce_scatter", "kraken.runtime.gemm_reduce_scatter", "kraken.fused.gemm_reduce_scatter",
     lambda: (BF16(256, 128), BF16(128, 512))),
    ("kraken", "gemm_one_shot_all_reduce", "kraken.runtime.gemm_all_reduce", "kraken.fused.gemm_one_shot_all_reduce",
     lambda: (BF16(128, 256), BF16(256, 512))),
    ("kraken", "gemm_reduce_scatter_fp8", "kraken.runtime.gemm_reduce_scatter_fp8",
     "kraken.fused.gemm_reduce_scatter_fp8", lambda: (
        BF16(256, 128).to(torch.float8_e4m3fn), BF16(512, 128).to(torch.float8_e4m3fn).t(),
        torch.ones(1, dtype=torch.float32), torch.ones(1, dtype=torch.float32))),
    ("helion_ports", "gemm_reduce_scatter", "kraken.runtime.gemm_reduce_scatter",
     "helion_ports.fused.gemm_reduce_scatter", lambda: (BF16(256, 128), BF16(128, 512))),
]


@pytest.mark.parametrize("package,name,product,module,make_args", GEMMS, ids=[c[3] for c in GEMMS])
def test_a_gemm_call_replays_what_its_host_code_launches(monkeypatch, launches, package, name, product, module,
                                                         make_args):
    """``prepared_launch`` for the GEMM recipes and twins (TMA operands on the call's ``a`` and ``b``, the block
    workspace's peers, parity and epochs kept): as ``test_a_whole_call_replay_launches_what_its_host_code_launches``,
    on a fake H200 (132 SMs) and a fake workspace."""
    FakeWorld(monkeypatch)
    prepared.forget_prepared_calls()

    class Properties:
        multi_processor_count = 132

    def block_workspace(chunk_bytes, device, group, op):
        peers = tuple(torch.zeros(2 * 132 * chunk_bytes, dtype=torch.uint8) for _ in range(2))
        flat = symm.SymmContext(0, 2, "fake", peers, sm90.FAKE_SIGNAL_PADS)
        ids = torch.zeros(groups.max_barrier_blocks(2), dtype=torch.int32)
        return symm.BlockWorkspace(flat, ids, ids.clone(), 132, chunk_bytes)

    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: Properties())
    monkeypatch.setattr(symm, "block_workspace", block_workspace)
    monkeypatch.setattr(symm, "local_barrier_pads", lambda device: 4096)
    # The product layer's checks (the recipe and its twin share them): CPU tensors stand in for CUDA ones.
    monkeypatch.setattr(importlib.import_module(product), "check_inputs", lambda *args, **kwargs: None)
    try:
        fn = getattr(importlib.import_module(package), name)
        if name in crossover.FUSED_FROM:  # a recipe with a sequential form: its fused kernel, whatever the size
            fn = functools.partial(fn, form="fused")
        calls = [make_args() for _ in range(WARM_CALLS)]
        with collector_off():
            outputs = [fn(*args) for args in calls]
            assert_replays_match(launches, calls, outputs, package == "helion_ports",
                                 importlib.import_module(module).launch)
            assert_freed_with_their_callers_references(launches, calls, outputs)
    finally:
        prepared.forget_prepared_calls()


@contextlib.contextmanager
def collector_off():
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def assert_freed_with_their_callers_references(launches: list, calls: list, outputs: list) -> None:
    """Every input and output of ``calls`` is freed once the caller drops them (``calls`` and ``outputs`` emptied
    here), Python's collector off: neither a prepared call, a replay nor a reference cycle holds them. (A model's
    activations held in a cycle go back to the allocator when the collector next runs, not when the model drops
    them: its next layers find other addresses, and their calls capture new graphs.)"""
    refs = [weakref.ref(t) for args, out in zip(calls, outputs) for t in (*args, out) if isinstance(t, torch.Tensor)]
    calls.clear()
    outputs.clear()
    launches.clear()  # (the fake launches' log holds their arguments)
    assert sum(ref() is not None for ref in refs) == 0, "a call's tensors outlive their caller's references"


def assert_replays_match(launches: list, calls: list, outputs: list, twin: bool, launch) -> None:
    """The calls' launches (``launches``) are: the first call's through the JIT (a twin's first two: its plain
    compile, then its binding one through the launcher), then one replayed launch per later call, which must be
    what the binding call launched with each input's and the output's address moved to that call's, addresses
    only (no tensor). The replay is kept under the call's ``launch`` function."""
    addresses = [launch[1][9:] for launch in launches if launch[0] == "fast"]
    first = [launch for launch in launches if launch[0] == "jit"][-1][2]
    replayed = len(addresses)
    assert replayed == len(calls) - (2 if twin else 1) and len(launches) == len(calls), [l[0] for l in launches]
    launcher = next(value["launcher"] for cache in prepared._prepared_caches for call in cache.values()
                    for value in call if isinstance(value, dict) and "launcher" in value)
    assert isinstance(getattr(launcher.replays.get(launch), "plan", None), Replay)

    def names(args, out) -> dict:
        found = {out.data_ptr(): "out"}
        found.update({arg.data_ptr(): f"arg{i}" for i, arg in enumerate(args) if isinstance(arg, torch.Tensor)})
        return found

    bound = 1 if twin else 0  # the call of ``first``
    expected = tuple(named(value, names(calls[bound], outputs[bound])) for value in normalized(first))
    for args, out, launched in zip(calls[-replayed:], outputs[-replayed:], addresses[-replayed:]):
        got = tuple(named(value, names(args, out)) for value in normalized(tuple(launched)))
        assert got[:len(expected)] == expected
        assert all(type(value) is not torch.Tensor for value in launched), "a replay passes addresses"


def test_a_whole_call_replay_is_kept_per_launch_function(launches):
    """Two launch functions through one prepared call's launcher (say, a recipe's and another's sharing its
    preparation) each get their own whole-call replay (``replayed`` keys it by the function): the second never
    replays the first's launches."""
    module = importlib.import_module("kraken.comm.one_shot_all_reduce")
    kernels = {"one": module.one_shot_all_reduce_kernel,
               "two": importlib.import_module("kraken.comm.two_shot_all_reduce").two_shot_all_reduce_kernel}
    launcher, peers = Launcher("op"), (torch.zeros(8),)

    def launch_with(name):
        def launch(out):
            launcher(kernels[name], (1,), peers, out, peers[0], peers[0], 77, 8, 1024, 0, 1, BLOCK_SIZE=1024,
                     STAGED=False, num_warps=4)
            return out
        return launch

    one, two = launch_with("one"), launch_with("two")
    for launch in (one, two, one, two, one, two):
        out = torch.zeros(8)
        assert replayed(launcher, launch, (out,), lambda: launch(out), (peers,)) is out
    assert {launcher.replays[one].plan.launches[0][0], launcher.replays[two].plan.launches[0][0]} == {
        id(kernels["one"]), id(kernels["two"])}
    assert [kind for kind, *_ in launches] == ["jit", "jit", "fast", "fast", "fast", "fast"]


def test_a_recording_takes_only_its_own_threads_launches(launches):
    """``record_replay`` watches one thread: a launch that another thread makes through the same launcher meanwhile
    (another call of the same prepared call) is launched, but not recorded, so the replay does not repeat it; and
    that thread's own attempt to record the launcher runs its host code unrecorded (``NOT_YET``)."""
    import threading

    kernel = importlib.import_module("kraken.comm.one_shot_all_reduce").one_shot_all_reduce_kernel
    launcher = Launcher("op")
    peers = (torch.zeros(8),)

    def call(out):
        launcher(kernel, (1,), peers, out, peers[0], peers[0], 77, 8, 1024, 0, 1, BLOCK_SIZE=1024, STAGED=False,
                 num_warps=4)
        return out

    mine, theirs, inner, nested = torch.zeros(8), torch.zeros(8), torch.zeros(8), []

    def other_thread():
        call(theirs)
        nested.append(record_replay(launcher, lambda: call(inner), (inner,))[0])

    def host_code():  # (no ATen op of its own: a replay would not repeat it)
        other = threading.Thread(target=other_thread)
        other.start()
        other.join()
        return call(mine)

    replay, result = record_replay(launcher, host_code, (mine,), keep=(peers,), checked=False)
    assert result is mine and nested == [NOT_YET]
    assert len(launches) == 3, "every launch was made"
    assert isinstance(replay.plan, Replay) and len(replay.plan.launches) == 1, (
        "only this thread's own launch is replayed")
    launches.clear()
    again = torch.zeros(8)
    assert replay((again,)) is again
    (kind, args), = launches
    assert kind == "fast" and args[10] == again.data_ptr() and args[9] == (peers[0].data_ptr(),)


def test_a_checked_replay_refuses_other_scalars_and_shapes_and_launches_its_own_constants(launches):
    """A twin's kernel replay (``checked``) is one generated function: a call with another scalar or another
    top-level shape gets ``NOT_REPLAYED`` and launches nothing; a call that matches launches the recorded kernel with
    its own tensors' addresses, the kept peers' addresses and the recorded ints, floats and grid."""
    kernel = importlib.import_module("kraken.comm.one_shot_all_reduce").one_shot_all_reduce_kernel
    launcher, peers = Launcher("op"), (torch.zeros(8), torch.zeros(8))

    def host_code(out, numel, scale):
        launcher(kernel, (3, 2), peers, out, peers[0], out[2:], numel, scale, 1024, 0, 2, BLOCK_SIZE=1024,
                 STAGED=False, num_warps=4)
        return out

    out = torch.zeros(8)
    for _ in range(2):  # the first binds through the JIT, the second is recorded
        replay, result = record_replay(launcher, lambda: host_code(out, 8, 0.5), (out, 8, 0.5), keep=(peers,))
    assert result is out and "def replay(args)" in replay.source
    launches.clear()
    other = torch.zeros(8)
    assert replay((other, 9, 0.5)) is NOT_REPLAYED and replay((other, 8, 0.25)) is NOT_REPLAYED
    assert replay((torch.zeros(6), 8, 0.5)) is NOT_REPLAYED and not launches
    assert replay((other, 8, 0.5)) is other
    (kind, args), = launches
    assert kind == "fast" and args[:4] == (3, 2, 1, 1234)
    assert args[9:] == ((peers[0].data_ptr(), peers[1].data_ptr()), other.data_ptr(), peers[0].data_ptr(),
                        other.data_ptr() + 2 * other.element_size(), 8, 0.5, 1024, 0, 2, 1024, False, False)


def test_a_replay_holds_none_of_the_recorded_calls_tensors(launches):
    """Once a call whose launches were recorded returns and its caller drops its tensors, they are freed there and
    then, with Python's collector off: nothing of the recording keeps them in a reference cycle. A model's
    activations freed only when the collector next runs come back to the allocator at a time that depends on it, and
    the next layers' tensors land on other addresses than in the step before (new address sets, new graph captures)."""
    kernel = importlib.import_module("kraken.comm.one_shot_all_reduce").one_shot_all_reduce_kernel
    launcher, peers = Launcher("op"), (torch.zeros(8),)

    def host_code(out, inp):
        launcher(kernel, (1,), peers, out, inp, inp[2:], 77, 8, 1024, 0, 1, BLOCK_SIZE=1024, STAGED=False,
                 num_warps=4)
        return out

    def call() -> tuple:  # (the replay, and weak references to the call's tensors)
        out, inp = torch.zeros(8), torch.randn(8)
        replay, _ = record_replay(launcher, lambda: host_code(out, inp), (out, inp), keep=(peers,))
        return replay, [weakref.ref(out), weakref.ref(inp)]

    with collector_off():
        _, first = call()  # binds through the JIT
        replay, recorded = call()
        assert "def replay(args)" in replay.source
        launches.clear()  # (the fake launches' log holds their arguments)
        assert [ref() for ref in first + recorded] == [None] * 4


def named(value, names: dict):
    """A normalized launch argument with the addresses in ``names`` replaced by their names."""
    if isinstance(value, tuple):
        return tuple(named(item, names) for item in value)
    return names.get(value, value) if type(value) is int else value


def test_cached_prepare_is_per_signature(monkeypatch, launches):
    counts = symmetric_world(monkeypatch, "kraken.comm.one_shot_all_reduce")
    fn = importlib.import_module("kraken.runtime.collectives").one_shot_all_reduce
    small, large = torch.randn(1000, dtype=torch.bfloat16), torch.randn(100_000, dtype=torch.bfloat16)
    for _ in range(3):
        fn(small)
        fn(large)
        fn(large, max_blocks=8)
    assert counts["plan"] == 3 and counts["world"].exchanges == 3


def test_a_scalar_of_another_type_is_another_signature(monkeypatch, launches):
    """``eps=1.0`` then ``eps=True``: equal in Python, but the second is refused, so it must not hit the first's
    prepared call; nor may a config value ``True`` stand in for ``1``."""
    symmetric_world(monkeypatch, "kraken.fused.one_shot_all_reduce_bias_rms_norm")
    fn = importlib.import_module("kraken.runtime.bias_norm").one_shot_all_reduce_bias_rms_norm
    x, vector = torch.randn(4, 256, dtype=torch.bfloat16), torch.randn(256, dtype=torch.bfloat16)
    fn(x, vector, vector, eps=1.0)
    with pytest.raises(TypeError, match="eps must be a float"):
        fn(x, vector, vector, eps=True)
    assert prepared.config_key({"max_blocks": 1}) != prepared.config_key({"max_blocks": True})


def test_gather_with_progress_keeps_its_barrier_launcher_per_group_and_rank():
    """``all_gather_with_progress`` launches its two barriers per call through a launcher kept per (signal pad,
    rank, world size), the barrier kernels' every argument: the same one for the same group and rank, another
    for another rank or group (a kernel specialised for one rank must never launch for another)."""
    from kraken.runtime.progress import barrier_launcher

    def ctx(rank, world_size, pads):
        return symm.SymmContext(rank, world_size, "fake", (), pads)

    first = barrier_launcher(ctx(0, 2, 1000))
    assert isinstance(first, Launcher) and barrier_launcher(ctx(0, 2, 1000)) is first
    others = {id(barrier_launcher(c)) for c in (ctx(1, 2, 1000), ctx(0, 4, 1000), ctx(0, 2, 2000))}
    assert id(first) not in others and len(others) == 3


@pytest.mark.parametrize("package", ["kraken", "helion_ports"])
def test_a_standalone_gather_prepares_once_and_keeps_its_launcher(monkeypatch, package):
    """``all_gather_with_progress`` (and its twin) checks the shard and finds its peers on the first call of a
    signature only, and hands ``start`` its exchange (the recipe's ``launch``, or the twin's) and the same launcher
    object on every call: ``start`` replays the exchange from graphs kept per launcher (``graphs.forked``), which a new
    launcher per call would never find. ``out`` and ``progress`` are new on every call."""
    progress = importlib.import_module("kraken.runtime.progress")
    exchange = importlib.import_module(f"{package}.comm.all_gather_with_progress").launch
    fn = importlib.import_module(package).all_gather_with_progress
    prepared.forget_prepared_calls()
    contexts, started = [], []
    monkeypatch.setattr(groups, "check_tensor", lambda *args, **kwargs: None)
    monkeypatch.setattr(symm, "symm_context", lambda tensor, group, op, name="tensor": contexts.append(name) or
                        symm.SymmContext(0, 2, "fake", (tensor, torch.zeros_like(tensor)), sm90.FAKE_SIGNAL_PADS))
    monkeypatch.setattr(progress, "start", lambda *args: started.append(args))
    shard = torch.randn(4, 8)
    try:  # no prepared call built on fakes outlives the test
        for _ in range(3):
            fn(shard)
        assert contexts == ["shard"] and len(started) == 3
        assert all(args[0] is exchange for args in started)
        assert len({id(args[6]) for args in started}) == 1
        outs = [args[4] for args in started]
        assert all(out.shape == (8, 8) for out in outs) and len({id(out) for out in outs}) == 3
        assert all(args[5].shape == (2,) and args[5].dtype == torch.int32 for args in started)
        other = torch.randn(4, 16)  # another signature: checked and rendezvoused again
        fn(other)
        assert contexts == ["shard", "shard"]
    finally:
        prepared.forget_prepared_calls()


def test_launcher_encodes_a_tensor_map_once_per_pointer_and_shape(monkeypatch):
    """Triton 3.6 wraps the C launch function of a kernel with tensor descriptors (``wrap_handle_tensordesc``) so
    that every launch encodes each descriptor's TMA map again. The launcher calls the C function under that
    wrapper with the same expanded arguments, encoding a map only for a new (pointer, shape, strides, box)."""
    from triton.backends.nvidia import driver
    from triton.tools.tensor_descriptor import TensorDescriptor

    encoded, launched = [], []

    def encode(desc, meta):
        encoded.append((desc.base.data_ptr(), tuple(desc.shape), meta["swizzle"]))
        return [f"map{len(encoded)}", *desc.shape, *desc.strides]

    monkeypatch.setattr(driver, "make_tensordesc_arg", encode)
    signature = {"peers": "*bf16", "out": "tensordesc<bf16[64, 64]>", "x": "*bf16", "w": "*bf16", "pads": "i64",
                 "numel": "i32", "chunk": "i32", "rank": "i32", "world_size": "constexpr"}
    wrapped = driver.wrap_handle_tensordesc(lambda *args: launched.append(args), signature, [{"swizzle": 3}])
    kernel = importlib.import_module("kraken.comm.one_shot_all_reduce").one_shot_all_reduce_kernel
    launcher = c_launcher(monkeypatch, wrapped)
    first, second = torch.zeros(64, 128), torch.zeros(64, 128)
    rest = (torch.zeros(8), torch.zeros(8), 77, 8, 1024, 1, 2)
    for base in (first, first, first, second, first):
        launcher(kernel, (5,), (torch.zeros(8),), TensorDescriptor.from_tensor(base, [64, 64]), *rest,
                 BLOCK_SIZE=1024, STAGED=False, num_warps=4)
    # The first launch went through the JIT (the fake one here); the next four through the C function itself.
    assert encoded == [(first.data_ptr(), (64, 128), 3), (second.data_ptr(), (64, 128), 3)]
    maps = [args[14] for args in launched]
    assert maps == ["map1", "map1", "map2", "map1"]
    for args in launched:
        assert args[:13] == (5, 1, 1, 1234, "cufunction", False, False, None, None, "packed metadata", None, None,
                             None)
        assert args[15:19] == (64, 128, 128, 1) and args[19:] == (*rest, 1024, False, False)


def addresses(value):
    """A C launch's arguments with each tensor as its address (a replay passes the address where the launcher's own
    path passes the tensor)."""
    if isinstance(value, tuple):
        return tuple(addresses(item) for item in value)
    return value.data_ptr() if isinstance(value, torch.Tensor) else value


def test_a_replay_expands_each_tma_map_in_line_and_encodes_it_once_per_address(monkeypatch):
    """A replayed launch with host tensor descriptors passes, call after call, what the launcher's own path
    (``tensor_maps``) passes for the same call: one descriptor on a view of the call's output (new addresses, old
    ones again), one on the prepared call's own weight. The replay's source expands each map in line, encoding the
    weight's once when the replay is made and the output's once per address."""
    from triton.backends.nvidia import driver

    encoded, launched, source = [], [], ["replay"]

    def encode(desc, meta):
        encoded.append((source[0], desc.base.data_ptr()))
        return [("map", desc.base.data_ptr(), tuple(desc.shape), tuple(desc.strides), meta["swizzle"]), *desc.shape,
                *desc.strides]

    monkeypatch.setattr(driver, "make_tensordesc_arg", encode)
    signature = {"peers": "*fp32", "out": "tensordesc<fp32[64, 64]>", "x": "*fp32", "w": "tensordesc<fp32[64, 64]>",
                 "pads": "i64", "numel": "i32", "chunk": "i32", "rank": "i32", "world_size": "constexpr"}
    wrapped = driver.wrap_handle_tensordesc(lambda *args: launched.append(args), signature,
                                            [{"swizzle": 3}, {"swizzle": 1}])
    kernel = importlib.import_module("kraken.comm.one_shot_all_reduce").one_shot_all_reduce_kernel
    launcher = c_launcher(monkeypatch, wrapped)
    peers, weight = (torch.zeros(8),), torch.zeros(64, 128)  # the prepared call's own tensors

    def arguments(out, x):
        return (peers, tma_operand(out[1:], [64, 64]), x, tma_operand(weight, [64, 64]), 77, 8, 1024, 1, 2)

    def launch(out, x):  # a recipe's launch on a call's (out, x)
        launcher(kernel, (5,), *arguments(out, x), BLOCK_SIZE=1024, STAGED=False, num_warps=4)
        return out

    outs, xs = [torch.randn(65, 128) for _ in range(3)], [torch.randn(8) for _ in range(3)]
    calls = [(outs[0], xs[0]), (outs[0], xs[0]), (outs[1], xs[1]), (outs[0], xs[2]), (outs[2], xs[0]),
             (outs[1], xs[1])]
    for out, x in calls:
        source[0] = "replay"
        assert replayed(launcher, launch, (out, x), lambda: launch(out, x), (peers, weight)) is out
        if len(launched) == 0:  # the first call bound through the (fake) JIT and recorded the replay
            continue
        source[0] = "launcher"
        Launcher.launch_compiled(launcher.compiled[id(kernel)], (5,), 1, 1, arguments(out, x))
        assert addresses(launched[-2]) == addresses(launched[-1]), (launched[-2], launched[-1])
        assert launched[-1][14][:2] == ("map", out.data_ptr() + 128 * 4)  # the output's map, at its view's address
    assert len(launched) == 2 * (len(calls) - 1)
    assert "tensor_maps" not in launcher.replays[launch].source
    replay_maps = [ptr for where, ptr in encoded if where == "replay"]
    assert replay_maps == [weight.data_ptr(), *(out.data_ptr() + 128 * 4 for out in outs)], replay_maps


def test_local_scratch_is_kept_per_device_and_dtype():
    """One buffer per (device, dtype), grown when a bigger one is asked for (a later name in its module once shadowed
    its cache, and every GEMM + all-reduce at world size 1 failed on the GPU)."""
    cpu = torch.device("cpu")
    a = symm.local_scratch((4, 8), torch.float32, cpu)
    b = symm.local_scratch((2, 3), torch.float32, cpu)
    assert a.shape == (4, 8) and b.shape == (2, 3) and a.data_ptr() == b.data_ptr()
    c = symm.local_scratch((100,), torch.float32, cpu)
    assert c.numel() == 100 and symm.local_scratch((2,), torch.int32, cpu).dtype == torch.int32



def twin_examples() -> list:
    from benchmark import registry

    found = {}
    for op in registry.load_all().values():
        for pair in op.pairs:
            found.setdefault(pair.helion_module, pair.example)
    return sorted(found.items())


def moved(value):
    """``value`` (a kernel's argument) with every tensor in new memory: views of one buffer stay views of one new
    buffer, at the same offsets, shapes and strides."""
    buffers: dict = {}

    def move(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        new = buffers.get(storage.data_ptr())
        if new is None:
            new = buffers[storage.data_ptr()] = torch.empty(storage.nbytes() + 64, dtype=torch.uint8)
        moved_tensor = torch.empty(0, dtype=tensor.dtype)
        return moved_tensor.set_(new.untyped_storage(), tensor.storage_offset(), tensor.shape, tensor.stride())

    def walk(item):
        if isinstance(item, torch.Tensor):
            return move(item)
        return tuple(walk(x) for x in item) if isinstance(item, tuple) else item

    return walk(value)


def normalized(value):
    """A launch argument as the kernel sees it: a tensor as its address, a descriptor as its fields."""
    if isinstance(value, torch.Tensor):
        return value.data_ptr()
    if hasattr(value, "block_shape"):  # a TensorDescriptor, or a TmaOperand (the replay's)
        return ("descriptor", value.base.data_ptr(), tuple(value.shape), tuple(value.strides),
                tuple(value.block_shape), value.padding)
    if isinstance(value, tuple):
        return tuple(normalized(x) for x in value)
    return value


@pytest.mark.parametrize("module_name,example", twin_examples(), ids=[m for m, _ in twin_examples()])
def test_a_replay_launches_what_the_twins_host_code_launches(monkeypatch, launches, module_name, example):
    """For every twin: after its first two calls through a prepared call's launcher, the calls replay the
    launches of Helion's generated host code (``Replay``), with no host code run. Each call here moves
    every argument to new memory, and the replayed launches must be exactly what the host code launches for
    those arguments (run again with replays off): the same kernels, grids, addresses, descriptors and scalars.
    Twins whose kernels take views (``kraken._blocks.helion.run``'s ``kernel_args``) are replayed from their own
    arguments, with no view made."""
    import kraken._blocks.helion as helion_blocks
    import kraken.runtime.replay as replays

    module = importlib.import_module(module_name)
    calls, real_run = [], helion_blocks.run

    def recording_run(kernel, args, launcher=jit_launch, kernel_args=None):
        calls.append((kernel, args, kernel_args))
        return real_run(kernel, args, launcher, kernel_args)

    for name, twin in list(sys.modules.items()):  # every twin module calls kraken._blocks.helion.run by its own name
        if name.startswith("helion_ports.") and getattr(twin, "run", None) is real_run:
            monkeypatch.setattr(twin, "run", recording_run)
    example(module, 2)
    assert calls, "the example launched no Helion kernel"
    real_record = record_replay
    for kernel, args, kernel_args in calls:
        variants = [moved(args) for _ in range(5)]
        runs = {}
        for replaying in (True, False):
            if not replaying:
                monkeypatch.setattr(replays, "record_replay",
                                    lambda launcher, code, args, **kwargs: (None, code()))
            launcher, start = Launcher("test"), len(launches)
            results = [real_run(kernel, variant, launcher, kernel_args) for variant in variants]
            runs[replaying] = [(entry[0], normalized(entry[1:])) for entry in launches[start:]]
            # What each call returned, as the position of that argument among its own (None: it returned None).
            runs[replaying].append([next((i for i, arg in enumerate(variant) if arg is result), "other")
                                    if result is not None else None for result, variant in zip(results, variants)])
            if replaying:
                assert isinstance(launcher.replays[id(kernel)].plan, Replay), f"{module_name}: not replayed"
        monkeypatch.setattr(replays, "record_replay", real_record)
        assert [kind for kind, _ in runs[True][:-1]] == ["jit", "jit", "fast", "fast", "fast"], runs[True]
        assert "other" not in runs[True][-1], "a call returned something other than one of its arguments"
        assert runs[True] == runs[False], module_name
        addresses = [args for kind, args in runs[True][2:-1]]
        assert addresses[0] != addresses[1], "the moved arguments launched at the same addresses"


def fake_capture(monkeypatch, events: list, capturing: list) -> None:
    """``graphs``' graph capture on a CPU: ``torch.cuda.CUDAGraph`` a fake that notes its capture's begin and end and
    its replays in ``events`` (each graph with an exec handle of its own, 101, 102, ...), a capture stream by name,
    the current stream being captured while ``capturing[0]``, and no graph kept yet."""

    class Graph:
        count = 0

        def __init__(self):
            Graph.count += 1
            self.exec = 100 + Graph.count

        def capture_begin(self, capture_error_mode):
            assert capture_error_mode == "thread_local"
            events.append("begin")

        def capture_end(self):
            events.append("end")

        def replay(self):
            events.append("replay")

        def raw_cuda_graph_exec(self):
            return self.exec

    monkeypatch.setattr(torch.cuda, "CUDAGraph", Graph)
    monkeypatch.setattr(torch.cuda, "Stream", lambda device: "capture stream")
    monkeypatch.setattr(torch._C, "_cuda_isCurrentStreamCapturing", lambda: capturing[0])
    monkeypatch.setattr(graphs, "_graphs", {})
    monkeypatch.setattr(graphs, "_calls", {})
    monkeypatch.setattr(graphs, "_last_call", {})
    monkeypatch.setattr(graphs, "_capture_streams", {})


def test_graphed_runs_plainly_then_captures_once_then_replays(monkeypatch):
    """``graphs.graphed``: a key's first run is plain, its second is captured (on a stream of its own) and replayed,
    later ones only replay; a capture that fails runs plainly and is never tried again; while the current stream is
    being captured, or on a CPU, every run is plain."""
    events, capturing = [], [False]
    fake_capture(monkeypatch, events, capturing)
    monkeypatch.setattr(torch.cuda, "stream", lambda stream: events.append(("on", stream)) or contextlib.nullcontext())
    gpu = torch.device("cuda", 0)
    run = lambda: events.append("run")  # noqa: E731
    for _ in range(4):
        graphs.graphed(("key",), run, gpu)
    assert events == ["run", ("on", "capture stream"), "begin", "run", "end", "replay", "replay", "replay"]

    events.clear()
    capturing[0] = True
    graphs.graphed(("key",), run, gpu)
    graphs.graphed(("other",), run, torch.device("cpu"))
    assert events == ["run", "run"] and ("other",) not in graphs._graphs
    capturing[0] = False

    events.clear()

    def failing():
        events.append("run")
        if "begin" in events and "end" not in events:
            raise RuntimeError("operation not permitted when stream is capturing")

    for _ in range(4):
        graphs.graphed(("failing",), failing, gpu)
    assert events == ["run", ("on", "capture stream"), "begin", "run", "end", "run", "run", "run"]
    assert graphs._graphs[("failing",)] == graphs.NEVER


def test_graphed_never_captures_a_prepared_call_whose_addresses_keep_changing(monkeypatch):
    """A model's layers call one prepared call (same shapes) on fresh activations: every call a new address set.
    Those calls run plainly, step after step: no capture (a millisecond each), no kept graph (no cache to start
    over, no device synchronisation). A key that comes back within ``RECENT_CALLS`` calls (two outputs in turn: a loop
    that keeps the last output while the next is made; ten input sets in turn) is captured then, and a kept graph
    replays whatever came between. A key that comes back only after more calls than that, the replays counted (a
    model step's first layer, on its fresh input), is not captured."""
    events, capturing = [], [False]
    fake_capture(monkeypatch, events, capturing)
    monkeypatch.setattr(torch.cuda, "stream", lambda stream: contextlib.nullcontext())
    gpu = torch.device("cuda", 0)
    run = lambda: events.append("run")  # noqa: E731
    for step in range(3):
        for layer in range(32):
            graphs.graphed(("prepared call", 1000 + layer), run, gpu)
    assert events == ["run"] * 96 and not graphs._graphs
    events.clear()
    for address in (1, 2, 1, 2, 1, 3, 2):
        graphs.graphed(("prepared call", address), run, gpu)
    assert events == ["run", "run", "begin", "run", "end", "replay", "begin", "run", "end", "replay", "replay", "run",
                      "replay"]
    assert list(graphs._graphs) == [("prepared call", 1), ("prepared call", 2)]
    events.clear()
    for call in range(30):  # ten input sets in turn: each captured on its second round
        graphs.graphed(("rotating", 100 + call % 10), run, gpu)
    assert events == ["run"] * 10 + ["begin", "run", "end", "replay"] * 10 + ["replay"] * 10
    events.clear()
    for step in range(3):  # a model: its first layer on a step's fresh input, the others on two addresses in turn
        graphs.graphed(("model", "first layer"), run, gpu)
        for layer in range(1, 32):
            graphs.graphed(("model", layer % 2), run, gpu)
    # The first layer's key comes back once a step, 32 calls on (the replays count): never captured.
    assert events == ["run"] * 3 + ["begin", "run", "end", "replay"] * 2 + ["replay"] * 27 + (
        ["run"] + ["replay"] * 31) * 2
    assert ("model", "first layer") not in graphs._graphs


def test_graphed_forgets_its_oldest_graph_past_the_bound_without_synchronising(monkeypatch):
    """Past ``MAX_PREPARED`` kept graphs (a model whose allocations shift between steps: each shift brings its layers a
    new pair of address sets, captured again), ``graphed`` forgets the graph captured first and keeps the rest: no
    device synchronisation, no cache started over."""
    events, capturing = [], [False]
    fake_capture(monkeypatch, events, capturing)
    monkeypatch.setattr(torch.cuda, "stream", lambda stream: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "synchronize", lambda index=None: events.append("synchronize"))
    monkeypatch.setattr(prepared, "MAX_PREPARED", 3)
    gpu = torch.device("cuda", 0)
    for shift in range(4):  # each shift: two address sets in turn, captured on their second call
        for address in (2 * shift, 2 * shift + 1) * 3:
            graphs.graphed(("prepared call", address), lambda: events.append("run"), gpu)
    assert "synchronize" not in events and events.count("begin") == 8
    assert list(graphs._graphs) == [("prepared call", 5), ("prepared call", 6), ("prepared call", 7)]
    events.clear()
    graphs.graphed(("prepared call", 7), lambda: events.append("run"), gpu)
    assert events == ["replay"], "a kept graph still replays"


def test_caches_of_tensors_that_graphs_read_drop_every_kept_graph_first(monkeypatch):
    """A cache of tensors that a kept graph may read or write (context-parallel attention's lse buffers and tile
    orders, its twin's span tables: a graph holds their addresses, not the tensors) keeps them up to ``MAX_PREPARED``
    keys; past that it starts over only after ``graphs.drop_graphs`` has waited for every device that captured a graph
    and forgotten every kept graph."""
    cp = importlib.import_module("kraken.runtime.attention")  # the installed context-parallel attention's caches
    synced: list = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda index=None: synced.append(index))
    monkeypatch.setattr(graphs, "_capture_streams", {0: "capture stream"})
    monkeypatch.setattr(prepared, "MAX_PREPARED", 3)
    cpu = torch.device("cpu")
    makers = {
        "_lse": (cp, lambda n: cp.lse_buffer(n + 1, cpu)),
        "_orders": (cp, lambda n: cp.tile_order(4, 2, 32 * (n + 1), True, 16, 1, cpu)),
        "_spans": (cp, lambda n: cp.spans(n + 1, 16, 64, 0, 2, 1, cpu)),
    }
    for name, (module, make) in makers.items():
        monkeypatch.setattr(module, name, {})
        monkeypatch.setattr(graphs, "_graphs", {("key",): "a kept graph"})
        synced.clear()
        first = [make(n) for n in range(3)]
        assert make(0) is first[0] and graphs._graphs and not synced, f"{name}: under the bound, everything is kept"
        make(3)
        assert not graphs._graphs and synced == [0], f"{name}: started over with a graph still kept"
        assert len(getattr(module, name)) == 1


def test_forked_runs_plainly_then_captures_a_head_and_a_tail_then_launches_both_on_their_streams(monkeypatch):
    """``graphs.forked``: the first call runs the plain fork; the second captures the head (then the fork's event
    record) and the tail (the fork's event wait first, the join's event record last) as two graphs on the capture
    stream; every call from then on launches the head on the current stream and the tail on the side stream, one
    ``cudaGraphLaunch`` each, and ``join`` makes the current stream wait for the join's event. While the current
    stream is being captured the work is plain. A failed launch raises; a capture that fails runs plainly from then
    on."""
    from cuda.bindings import runtime as cudart

    events, capturing = [], [False]
    fake_capture(monkeypatch, events, capturing)

    class Event:
        def __init__(self, external):
            assert external
            self.cuda_event = 200 + len(events)

        def record(self, stream):
            events.append(("record", self.cuda_event, stream))

        def wait(self, stream):
            events.append(("wait", self.cuda_event, stream))

    class Side:
        device, device_index, cuda_stream = torch.device("cuda", 0), 0, 77

    errors = [0]
    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "stream", lambda stream: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "current_stream", lambda: "capture stream")
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda index: 55)
    monkeypatch.setattr(cudart, "cudaGraphLaunch", lambda graph, stream: events.append(("launch", graph, stream))
                        or (errors[0],))
    monkeypatch.setattr(cudart, "cudaStreamWaitEvent", lambda stream, event, flags: events.append(
        ("stream waits", stream, event, flags)) or (0,))
    head, tail = (lambda: events.append("head")), (lambda: events.append("tail"))
    plain = lambda: events.append("plain")  # noqa: E731
    assert graphs.forked(("key",), head, tail, plain, Side()) is None
    assert events == ["plain"]
    events.clear()
    kept = graphs.forked(("key",), head, tail, plain, Side())
    forked, joined = kept.forked.cuda_event, kept.joined.cuda_event
    head_exec, tail_exec = kept.head.exec, kept.tail.exec
    assert head_exec != tail_exec
    assert events == ["begin", "head", ("record", forked, "capture stream"), "end",
                      "begin", ("wait", forked, "capture stream"), "tail", ("record", joined, "capture stream"), "end",
                      ("launch", head_exec, 55), ("launch", tail_exec, 77)]
    events.clear()
    assert graphs.forked(("key",), head, tail, plain, Side()) is kept
    kept.join(0)
    assert events == [("launch", head_exec, 55), ("launch", tail_exec, 77), ("stream waits", 55, joined, 0)]
    events.clear()
    capturing[0] = True  # the caller's capture takes the plain work, even where a graph is kept
    assert graphs.forked(("key",), head, tail, plain, Side()) is None
    assert events == ["plain"]
    capturing[0] = False

    events.clear()
    errors[0] = cudart.cudaError_t.cudaErrorInvalidValue
    with pytest.raises(RuntimeError, match="cudaGraphLaunch failed"):
        graphs.forked(("key",), head, tail, plain, Side())
    assert events == [("launch", head_exec, 55)]  # the tail is never launched after a failed head
    errors[0] = 0

    events.clear()

    def failing():
        events.append("tail")
        raise RuntimeError("operation not permitted when stream is capturing")

    for _ in range(3):
        assert graphs.forked(("failing",), head, failing, plain, Side()) is None
    assert events[0] == "plain" and events[-2:] == ["plain", "plain"] and "tail" in events
    assert graphs._graphs[("failing",)] == graphs.NEVER


def test_all_gather_matmul_in_pieces_replays_its_gemm_on_new_addresses(launches):
    """``gather_matmul.in_pieces`` in a group of one (nothing to exchange), each call on a new ``a``, ``b`` and
    ``out`` (a model's layers): the first call binds the GEMM through the JIT, every later one is one replayed
    launch, the JIT's bound arguments with the call's three addresses moved; b stored transposed is read in place.
    Once the replay is made, ``gemm_replayed`` (the public call's way) launches the same, and nothing before."""
    product = importlib.import_module("kraken.runtime.gather_matmul")
    recipe = product.BF16
    m, n, k = 128, 512, 256
    for transposed in (False, True):
        launches.clear()
        launcher = Launcher("all_gather_matmul")
        gathered = torch.zeros(m, k, dtype=torch.bfloat16)
        cfg = {**recipe.plan(m, n, k, 1, {}, sm90.H200_NUM_SMS), "peers": (gathered,), "gathered": gathered,
               "progress": torch.zeros(1, dtype=torch.int32), "launcher": launcher}
        ctx = symm.SymmContext(0, 1, "fake", (gathered,), sm90.FAKE_SIGNAL_PADS)
        calls = []
        for i in range(2 * WARM_CALLS):
            b = torch.randn(n, k).to(torch.bfloat16).t() if transposed else torch.randn(k, n).to(torch.bfloat16)
            calls.append((torch.randn(m, k).to(torch.bfloat16), b, torch.empty(m, n, dtype=torch.bfloat16)))
            a, b, out = calls[-1]
            if i < WARM_CALLS:
                product.in_pieces(recipe, ctx, cfg, a, b, out, None)
            else:  # the public call's way once the replay is made: the replay alone, none of in_pieces's frames
                assert product.gemm_replayed(recipe, cfg, (out, a, b)), i
        assert [kind for kind, *_ in launches] == ["jit"] + ["fast"] * (2 * WARM_CALLS - 1), transposed
        assert not product.gemm_replayed(recipe, {**cfg, "launcher": Launcher("new")}, (out, a, b))  # none made
        assert len(launches) == 2 * WARM_CALLS
        assert isinstance(getattr(launcher.replays.get(recipe.launch_matmul), "plan", None), Replay)
        first = tuple(normalized(value) for value in launches[0][2])

        def names(a, b, out) -> dict:
            return {a.data_ptr(): "a", b.data_ptr(): "b", out.data_ptr(): "out"}

        expected = tuple(named(value, names(*calls[0])) for value in first)
        for (a, b, out), (_, launched) in zip(calls[1:], launches[1:]):
            got = tuple(named(normalized(value), names(a, b, out)) for value in launched[9:])
            assert got[:len(expected)] == expected, transposed
