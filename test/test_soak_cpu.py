"""benchmark.soak without a GPU: --help; the schedule is a function of the seed alone (the same in another process,
another for another seed) and keeps to each op's rules; every drawn shape passes the op's own make_inputs checks
(stopped at its first CUDA generator); the table, exit code and JSON from made-up counts; and a one-rank gloo world
running fake ops end to end, counting launches, mismatches, errors, unsupported calls and skipped shapes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.distributed as dist

from benchmark import registry, soak

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = {**os.environ, "PYTHONPATH": ROOT}


def first_steps(seed: int, world_size: int = 4, count: int = 300, **kwargs) -> list:
    return [step for step, _ in zip(soak.schedule(registry.load_all(), world_size, seed, **kwargs), range(count))]


def test_help():
    result = subprocess.run([sys.executable, "-m", "benchmark.soak", "--help"], capture_output=True, text=True,
                            cwd=ROOT, env=ENV)
    assert result.returncode == 0, result.stderr[-2000:]
    for flag in ("--ops", "--seconds", "--launches", "--graph-every", "--seed", "--nproc", "--subgroup", "--json"):
        assert flag in result.stdout
    assert "tp_mlp" in result.stdout  # the ops --subgroup can run on a group, named


def test_the_schedule_is_the_seeds_alone():
    kwargs = {"graph_every": 0.3, "subgroup": True}
    steps = first_steps(7, **kwargs)
    assert steps == first_steps(7, **kwargs)
    assert steps != first_steps(8, **kwargs)
    assert len({s.op for s in steps}) > 5 and any(s.graph for s in steps) and any(not s.graph for s in steps)
    # another process (other hash seed, fresh imports) draws the very same steps: what every rank does
    code = ("from benchmark import registry, soak\n"
            "s = soak.schedule(registry.load_all(), 4, 7, graph_every=0.3, subgroup=True)\n"
            "print(repr([tuple(vars(next(s)).values()) for _ in range(300)]))\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                            env={**ENV, "PYTHONHASHSEED": "12345"})
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == repr([tuple(vars(s).values()) for s in steps])


def test_steps_keep_to_the_rules():
    ops = registry.load_all()
    for step in first_steps(3, count=1000, graph_every=0.5, subgroup=True):
        op = ops[step.op]
        assert step.backend in op.backends and step.backend != op.baseline and step.backend.startswith(soak.OURS)
        assert not step.backend.endswith("_compiled")
        assert not (step.graph and step.backend in op.eager_only)
        assert step.dtype in soak.OP_DTYPES.get(step.op, ("bf16",))
        assert step.group == "world" or soak.takes_group(op)
        assert soak.fits(step.op, step.shape, 2 if step.group == "half" else 4), step
    everything = first_steps(3, count=500, backends=["all"])
    assert {s.backend for s in everything if s.op == "all_gather_matmul"} >= {"torch_fused", "matmul", "triton"}
    assert {s.backend for s in first_steps(3, count=200, backends=["helion"])} == {"helion"}
    assert {s.backend for s in first_steps(3, count=50, backends=["triton_compiled"])} == {"triton_compiled"}
    assert {s.dtype for s in first_steps(3, count=200, dtypes=("fp32",))} == {"fp32"}


def test_fields_match_the_registry():
    ops = registry.load_all()
    for name, rules in soak.FIELDS.items():
        assert name in ops, f"FIELDS names {name}, which is not registered"
        assert len(rules.split()) == len(ops[name].shape_format.split("x")), name
    assert set(soak.OP_DTYPES) <= set(ops)


@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 8])
def test_drawn_shapes_fit(world_size):
    import random

    ops = registry.load_all()
    rng = random.Random(world_size)
    for name, rules in soak.FIELDS.items():
        for _ in range(300):
            default = rng.choice(ops[name].default_shapes)
            shape = soak.draw_shape(name, default, world_size, rng)
            assert soak.fits(name, shape, world_size), (name, shape)
            for rule, value, was in zip(rules.split(), shape, default):
                assert 1 <= value <= was + 1 and (rule != "keep" or value == was), (name, shape, default)
            if name == "context_parallel_attention":
                assert shape[1] % (world_size * (2 if shape[-1] == 2 else 1)) == 0
            if name in ("all_gather_matmul", "gemm_reduce_scatter", "tp_mlp"):
                assert shape[0] % world_size == 0
        pool = soak.shape_pool(ops[name], world_size, seed=5)
        assert len(pool) == len(set(pool)) <= soak.POOL and all(soak.fits(name, s, world_size) for s in pool)


class Reached(Exception):
    """make_inputs got past its checks to its first CUDA random generator."""


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_make_inputs_accepts_every_pool_shape(world_size, monkeypatch):
    ops, real = registry.load_all(), torch.Generator  # every module imported before the patch

    def generator(device=None):
        if device is not None and torch.device(device).type == "cuda":
            raise Reached()
        return real()

    monkeypatch.setattr(torch, "Generator", generator)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: world_size)
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 0)
    for name in soak.FIELDS:
        for shape in soak.shape_pool(ops[name], world_size, seed=11):
            for dtype in soak.OP_DTYPES.get(name, ("bf16",)):
                with pytest.raises(Reached):
                    ops[name].make_inputs(shape, soak.DTYPES[dtype], 1)


def test_summary_exit_code_and_json():
    counts = {"all_reduce/triton_1shot": {"launches": 10, "replays": 8, "mismatches": 0, "errors": 0, "unsupported": 0},
              "moe_combine/helion": {"launches": 4, "replays": 0, "mismatches": 1, "errors": 0, "unsupported": 0},
              "tp_mlp/triton@half": {"launches": 0, "replays": 0, "mismatches": 0, "errors": 0, "unsupported": 3}}
    header, body, totals = soak.summarize(counts)
    assert header == ["op/backend", "launches", "replays", "mismatches", "errors", "unsupported"]
    assert body[0] == ["all_reduce/triton_1shot", 10, 8, 0, 0, 0] and body[-1] == ["total", 14, 8, 1, 0, 3]
    out = soak.report(counts, {"moe_dispatch": 2}, [], 4, {"seed": 0}, 12.34)
    no_mismatch = {k: v for k, v in counts.items() if "moe" not in k}  # unsupported alone does not fail the run
    assert soak.report(no_mismatch, {}, [], 4, {}, 1.0)["exit_code"] == 0
    assert json.loads(json.dumps(out)) == out
    assert out["totals"] == totals and out["exit_code"] == 1 and out["elapsed_s"] == 12.3
    assert [row["label"] for row in out["per_backend"]] == sorted(counts)


FAKE = textwrap.dedent("""
    import argparse, json, os, sys
    import torch, torch.distributed as dist
    from benchmark import registry, soak

    dist.init_process_group("gloo", init_method="file://" + sys.argv[1] + ".store", rank=0, world_size=1)

    def make_inputs(shape, dtype, seed):
        if shape[0] == 13:
            raise ValueError("13 rows: refused")
        return {"x": torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(dtype)}

    def boom(i):
        raise RuntimeError("boom")

    def unsupported(i):
        raise NotImplementedError("torch refuses")

    op = registry.Op("fake", "fake", make_inputs,
                     {"nccl": lambda i: i["x"] * 2, "triton": lambda i: i["x"] * 2, "triton_bad": lambda i: i["x"] * 3,
                      "triton_raise": boom, "helion_ni": unsupported, "triton_free": lambda i: i["x"] / 0,
                      "copy": lambda i: i["x"]},
                     [(8, 4), (13, 4)], "ROWSxCOLS", lambda *a: 0.0, lambda *a: 0.0,
                     reference_free=frozenset({"triton_free"}))
    args = argparse.Namespace(seed=1, pool=6, scale=1.0, graph_every=0.0, replays=2, subgroup=False, backends=None,
                              dtypes=("bf16",), launches=60, seconds=None, progress_every=1e9, json=sys.argv[1])
    code = soak.Soak(args, {"fake": op}).run()
    dist.destroy_process_group()
    sys.exit(code)
""")


def test_fake_ops_end_to_end(tmp_path):
    script, path = tmp_path / "fake.py", tmp_path / "soak.json"
    script.write_text(FAKE)
    result = subprocess.run([sys.executable, str(script), str(path)], capture_output=True, text=True, cwd=ROOT,
                            env=ENV, timeout=300)
    assert result.returncode == 1, result.stdout[-3000:] + result.stderr[-3000:]
    out = json.loads(path.read_text())
    rows = {row["label"]: row for row in out["per_backend"]}
    assert set(rows) <= {"fake/triton", "fake/triton_bad", "fake/triton_raise", "fake/helion_ni", "fake/triton_free"}
    assert rows["fake/triton"]["launches"] > 0 and rows["fake/triton"]["mismatches"] == 0
    assert rows["fake/triton_bad"]["mismatches"] == rows["fake/triton_bad"]["launches"] > 0
    assert rows["fake/triton_free"]["mismatches"] == rows["fake/triton_free"]["launches"] > 0  # not finite
    assert rows["fake/triton_raise"]["errors"] > 0 and rows["fake/triton_raise"]["launches"] == 0
    assert rows["fake/helion_ni"]["unsupported"] > 0 and rows["fake/helion_ni"]["errors"] == 0
    assert out["skipped_shapes"]["fake"] > 0 and out["exit_code"] == 1
    assert sum(r["launches"] + r["errors"] + r["unsupported"] for r in rows.values()) == 60
    assert "boom" in result.stderr and result.stderr.count("soak: ERROR") == 1  # told once per op
    assert {f["kind"] for f in out["failures"]} == {"mismatch", "error", "unsupported"}
    trace = (tmp_path / "soak-rank0.log").read_text().splitlines()
    assert trace and all(" rank 0 step " in line for line in trace)


def test_pool_and_scale_bound_the_shapes():
    """``--pool`` shapes per op and group size; ``--scale`` shrinks every varying field of the defaults, keeps the rest
    and the op's rules (every shape still fits)."""
    ops = registry.load_all()
    for name in ("tp_mlp", "context_parallel_attention", "gemm_reduce_scatter", "moe_dispatch"):
        op = ops[name]
        full, small = soak.shape_pool(op, 4, 3, 2), soak.shape_pool(op, 4, 3, 2, 0.25)
        assert len(full) == len(small) == 2
        largest = max(max(s[i] for s in op.default_shapes) for i in range(len(op.default_shapes[0])))
        assert max(max(s) for s in small) <= max(1, largest // 2), (name, small)
        for shape in small:
            assert soak.fits(name, shape, 4), (name, shape)
            for i, (rule, value) in enumerate(zip(soak.FIELDS[name].split(), shape)):
                if rule == "keep":
                    assert value in {default[i] for default in op.default_shapes}, (name, shape)
    args = soak.parse_args(["--pool", "3", "--scale", "0.5"])
    assert (args.pool, args.scale) == (3, 0.5)
    steps = first_steps(5, pool=1, scale=0.25)
    assert len({step.shape for step in steps if step.op == "tp_mlp"}) == 1
