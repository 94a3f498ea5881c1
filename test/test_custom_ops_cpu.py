"""The recipes as custom operators (``kraken/runtime/library.py``), without a GPU: every operator's fake gives the
shapes and dtypes the recipe gives, for odd sizes, under ``FakeTensorMode`` (fake CUDA tensors) in a fake
4-rank world; a model calling the front doors traces as one graph (``torch.export``, strict: Dynamo, no
graph break); the eager front door calls the recipe directly and costs well under a microsecond."""

from __future__ import annotations

import inspect
import os
import subprocess
import sys
import time
import timeit

import pytest
import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.testing._internal.distributed.fake_pg import FakeStore

import helion_ports
import kraken
from kraken.runtime import library

WORLD = 4
NAMESPACES = ("kraken", "kraken_helion")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def fake_world():
    """A 4-rank process group in this one process (torch's ``fake`` backend: no peers, no collectives run)."""
    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    dist.init_process_group("fake", rank=1, world_size=WORLD, store=FakeStore())
    yield dist.group.WORLD
    dist.destroy_process_group()


def op(namespace: str, name: str):
    return getattr(getattr(torch.ops, namespace), name).default


def fake(shape, dtype=torch.bfloat16):
    return torch.empty(shape, dtype=dtype, device="cuda")


# (name, arguments in schema order but the config string (the group, then its size), the expected outputs'
# (shape, dtype))
CASES = [
    ("one_shot_all_reduce", lambda: (fake((3, 5)), None, WORLD), [((3, 5), torch.bfloat16)]),
    ("one_shot_all_reduce", lambda: (fake((7,), torch.float32), "0", WORLD), [((7,), torch.float32)]),
    ("reduce_scatter", lambda: (fake((12, 3, 5), torch.float16), None, WORLD), [((3, 3, 5), torch.float16)]),
    ("all_gather", lambda: (fake((3, 5)), None, WORLD), [((12, 5), torch.bfloat16)]),
    ("all_gather", lambda: (fake((7,), torch.float32), None, WORLD), [((28,), torch.float32)]),
    ("one_shot_all_reduce_bias", lambda: (fake((2, 3, 5)), fake((5,)), None, WORLD), [((2, 3, 5), torch.bfloat16)]),
    ("two_shot_all_reduce_bias", lambda: (fake((3, 5)), fake((5,)), None, WORLD), [((3, 5), torch.bfloat16)]),
    ("one_shot_all_reduce_bias_rms_norm", lambda: (fake((3, 5)), fake((5,)), fake((5,)), 1e-5, None, WORLD),
     [((3, 5), torch.bfloat16)]),
    ("two_shot_all_reduce_bias_rms_norm", lambda: (fake((1, 3, 5), torch.float32), fake((5,), torch.float32),
                                                   fake((5,), torch.float32), 1e-6, None, WORLD),
     [((1, 3, 5), torch.float32)]),
    ("rms_norm", lambda: (fake((3, 5)), fake((5,)), 1e-5), [((3, 5), torch.bfloat16)]),
    ("gemm_one_shot_all_reduce", lambda: (fake((3, 5)), fake((5, 7)), None, WORLD, torch.float32),
     [((3, 7), torch.float32)]),
    ("gemm_reduce_scatter", lambda: (fake((12, 5)), fake((5, 7)), None, WORLD, torch.bfloat16),
     [((3, 7), torch.bfloat16)]),
    ("gemm_reduce_scatter_fp8", lambda: (fake((12, 32), torch.float8_e4m3fn), fake((32, 7), torch.float8_e4m3fn),
                                         fake((1,), torch.float32), fake((1,), torch.float32), None, WORLD,
                                         torch.float32),
     [((3, 7), torch.float32)]),
    ("all_gather_matmul", lambda: (fake((3, 5)), fake((5, 7)), None, WORLD, False), [((12, 7), torch.bfloat16)]),
    ("all_gather_matmul", lambda: (fake((3, 5), torch.float16), fake((5, 7), torch.float16), None, WORLD, True),
     [((12, 5), torch.float16), ((12, 7), torch.float16)]),
    ("all_gather_matmul_fp8", lambda: (fake((3, 32), torch.float8_e4m3fn), fake((32, 7), torch.float8_e4m3fn),
                                       fake((3, 1), torch.float32), fake((1, 7), torch.float32), None, WORLD),
     [((12, 7), torch.bfloat16)]),
    ("context_parallel_attention", lambda: (fake((1, 4, 3, 64)), fake((1, 2, 3, 64)), fake((1, 2, 3, 64)), None,
                                            WORLD, True, None), [((1, 4, 3, 64), torch.bfloat16)]),
]


def test_every_entry_is_an_operator_in_both_namespaces():
    for namespace in NAMESPACES:
        for name, entry in library.ENTRIES.items():
            schema = op(namespace, name)._schema
            assert schema.name == f"{namespace}::{name}"
            written = [a.name for a in schema.arguments if a.alias_info is not None and a.alias_info.is_write]
            assert written == list(entry.mutates), f"{namespace}::{name} declares it writes {written}"
    assert list(library.ENTRIES["two_shot_all_reduce"].mutates) == ["tensor"]
    assert {name for name, *_ in CASES} | {"two_shot_all_reduce"} == set(library.ENTRIES), "a case per operator"


@pytest.mark.parametrize("namespace", NAMESPACES)
@pytest.mark.parametrize("case", range(len(CASES)), ids=[f"{name}-{i}" for i, (name, *_) in enumerate(CASES)])
def test_fake_gives_the_recipes_shapes_and_dtypes(fake_world, namespace, case):
    name, arguments, expected = CASES[case]
    with FakeTensorMode():
        result = op(namespace, name)(*arguments(), "")
        outputs = result if isinstance(result, list) else [result]
        assert [(tuple(t.shape), t.dtype) for t in outputs] == expected
        assert all(t.device.type == "cuda" and t.is_contiguous() for t in outputs)


@pytest.mark.parametrize("namespace", NAMESPACES)
def test_fake_of_the_in_place_all_reduce_and_a_refused_shape(fake_world, namespace):
    with FakeTensorMode():
        assert op(namespace, "two_shot_all_reduce")(fake((3, 5)), None, WORLD, "") is None
        with pytest.raises(ValueError, match="not divisible by the world size 4"):
            op(namespace, "reduce_scatter")(fake((6, 5)), None, WORLD, "")


def test_config_round_trips_through_its_encoding():
    config = {"max_blocks": 7, "b_layout": "auto", "push": True, "scale": 0.5, "num_warps": None}
    assert library.decode_config(library.encode_config(config)) == config
    assert library.encode_config({}) == "" and library.decode_config("") == {}


class SequenceParallelMLP(torch.nn.Module):
    """all_gather_matmul -> SiLU -> gemm_one_shot_all_reduce, then the collectives the table holds."""

    def __init__(self, fused, comm, group):
        super().__init__()
        self.fused, self.comm, self.group = fused, comm, group
        self.w1 = torch.nn.Parameter(torch.empty(16, 24))
        self.w2 = torch.nn.Parameter(torch.empty(24, 16))

    def forward(self, x):
        h = torch.nn.functional.silu(self.fused.all_gather_matmul(x, self.w1, group=self.group))
        y = self.fused.gemm_one_shot_all_reduce(h, self.w2, self.group, out_dtype=torch.float32, max_blocks=4)
        y = self.comm.two_shot_all_reduce(y + 1)  # in place on an intermediate
        return self.comm.reduce_scatter(y) * 2, self.comm.all_gather(x)


@pytest.mark.parametrize("packages", [(kraken, kraken), (helion_ports, helion_ports)],
                         ids=["kraken", "helion"])
def test_a_model_traces_as_one_graph_of_operators(fake_world, packages):
    """torch.export (strict: Dynamo) refuses any graph break; the front doors become the operators, the group
    object its name, the config its encoding."""
    namespace = "kraken" if packages[0] is kraken else "kraken_helion"
    program = torch.export.export(SequenceParallelMLP(*packages, fake_world), (torch.empty(3, 16),), strict=True)
    calls = [n for n in program.graph.nodes if n.op == "call_function"]
    targets = [str(n.target) for n in calls]
    for name in ("all_gather_matmul", "gemm_one_shot_all_reduce", "two_shot_all_reduce", "reduce_scatter",
                 "all_gather"):
        assert any(t.startswith(f"{namespace}.{name}.") for t in targets), (name, targets)
    gemm = next(n for n in calls if str(n.target).startswith(f"{namespace}.gemm_one_shot_all_reduce"))
    assert gemm.args[2:] == (fake_world.group_name, WORLD, torch.float32, "(('max_blocks', 4),)")
    out, gathered = (n.meta["val"] for n in program.graph.output_node().args[0])
    assert tuple(out.shape) == (3, 16) and tuple(gathered.shape) == (12, 16)


# Rank 0 first compiles in a world of one rank, then both ranks in a world of two (gloo), with one inductor
# cache directory: what a GPU host running the suite at world size 1 and then 2 does. The recipe needs a GPU,
# so the operator gets a CPU kernel here, its output sized by the live group as the recipe's is.
TWO_WORLDS = """
import datetime, sys
import torch, torch.distributed as dist
from torch._dynamo.utils import counters
import kraken

def gather_matmul_on_cpu(a, b, *rest):  # (the group's name and size,) return_a (False here), config
    parts = [torch.empty_like(a) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, a)
    return [torch.cat(parts) @ b]

torch.library.register_kernel("kraken::all_gather_matmul", "cpu", gather_matmul_on_cpu)
rank, store = int(sys.argv[1]), sys.argv[2]
x, w = torch.full((3, 16), rank + 1.0), torch.ones(16, 8)

def compiled_equals_eager():
    torch._dynamo.reset()
    counters.clear()
    out = torch.compile(lambda x, w: kraken.all_gather_matmul(x, w), fullgraph=True)(x, w)
    assert torch.equal(out, gather_matmul_on_cpu(x, w)[0])
    cache = counters["aot_autograd"]
    print(f"rank {rank} world size {dist.get_world_size()}: {cache['autograd_cache_hit']} cache hits, "
          f"{cache['autograd_cache_saved']} saved", flush=True)

if rank == 0:
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    compiled_equals_eager()
    dist.destroy_process_group()
dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2,
                        timeout=datetime.timedelta(seconds=30))
compiled_equals_eager()
dist.destroy_process_group()
"""


def test_a_graph_compiled_at_one_world_size_is_not_reused_at_another(tmp_path):
    """Inductor and AOTAutograd cache compiled graphs on disk, keyed by the graph and its
    inputs' shapes. The per-rank shapes and the default group's name are the same at every world size, so the
    operator takes the group's size, and a graph compiled at world size 1 (its all_gather_matmul output sized
    for one rank) is not handed to a world of two, where inductor's size assert refused the real output."""
    env = {**os.environ, "PYTHONPATH": ROOT, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor"),
           "TORCHINDUCTOR_FX_GRAPH_CACHE": "1", "TORCHINDUCTOR_AUTOGRAD_CACHE": "1"}
    logs = [tmp_path / f"rank{rank}.log" for rank in range(2)]
    ranks = [subprocess.Popen([sys.executable, "-c", TWO_WORLDS, str(rank), str(tmp_path / "store")], env=env,
                              cwd=ROOT, stdout=log.open("w"), stderr=subprocess.STDOUT)
             for rank, log in enumerate(logs)]
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:  # until both are done, or one has failed
        codes = [rank.poll() for rank in ranks]
        if codes == [0, 0] or any(codes):
            break
        time.sleep(0.1)
    for rank in ranks:
        if rank.poll() is None:
            rank.kill()
        rank.wait()
    logs = [log.read_text() for log in logs]
    assert [rank.returncode for rank in ranks] == [0, 0], "\n".join(log[-3000:] for log in logs)
    assert "rank 0 world size 1: 0 cache hits, 1 saved" in logs[0], logs[0]  # the cache is on
    assert "rank 0 world size 2: 0 cache hits" in logs[0], logs[0]  # not world size 1's graph


def test_front_doors_keep_the_recipes_signatures_and_are_the_modules_functions():
    for package in (kraken, helion_ports):
        for name in library.ENTRIES:
            door = getattr(package, name, None)
            if door is None:
                continue
            recipe = door.__wrapped__
            assert inspect.signature(door) == inspect.signature(recipe)
            assert door.__doc__ == recipe.__doc__ and door.op is not None
            if "<locals>" not in recipe.__qualname__:  # (a twin made by a product factory is not its module's own)
                assert getattr(inspect.getmodule(recipe), name) is door
    for name in ("one_shot_all_reduce", "two_shot_all_reduce", "reduce_scatter", "all_gather", "all_reduce"):
        assert getattr(kraken, name) is getattr(kraken.runtime.collectives, name), name


def test_eager_front_door_calls_the_recipe_and_costs_little(monkeypatch):
    """In eager the door is the recipe plus one is_compiling() check: time it around a no-op recipe."""
    seen = []
    door = library.front_door(lambda tensor, group=None, **config: seen.append((tensor, group, config)),
                              library.ENTRIES["one_shot_all_reduce"], op=None)
    door(1, "g", max_blocks=3)
    assert seen == [(1, "g", {"max_blocks": 3})]

    def no_op(tensor, group=None, **config):
        return tensor

    door = library.front_door(no_op, library.ENTRIES["one_shot_all_reduce"], op=None)
    x = torch.empty(4)
    best = lambda fn: min(timeit.repeat(lambda: fn(x), number=20000, repeat=5)) / 20000 * 1e6  # noqa: E731
    direct, through = best(no_op), best(door)
    print(f"front door host cost: {through - direct:.3f} us per call (no-op recipe {direct:.3f} us, door {through:.3f})")
    assert through - direct < 1.0
