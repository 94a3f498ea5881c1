"""The all-reduce + bias + RMSNorm family without a GPU.

* every kernel and every Helion twin compiles for sm_90 (benchmark.sm90) at world
  sizes 2 and 8, hidden 5120 and 1000, and each twin carries exactly the
  cross-GPU barrier atomics of its Triton sibling;
* bad arguments raise ValueError/TypeError naming the problem before anything
  needs CUDA or torch.distributed;
* the launch plans cover every row/element exactly once and fit the signal pad;
* the kernels compute the right numbers: both Triton and Helion code run under
  Triton's CPU interpreter with the barriers as no-ops, the ranks ordered so
  every read happens after the write a real barrier would wait for.
"""

from __future__ import annotations

import importlib
import os
import re
import subprocess
import sys
import textwrap

import pytest
import torch

from benchmark import registry, sm90
from benchmark.ops.all_reduce_bias import auto_example, example_launch
from kraken.runtime import groups

FAMILY = [
    "one_shot_all_reduce_bias",
    "one_shot_all_reduce_bias_rms_norm",
    "two_shot_all_reduce_bias",
    "two_shot_all_reduce_bias_rms_norm",
]
PAIRS = [pair for op in ("all_reduce_bias", "all_reduce_bias_rms_norm") for pair in registry.get(op).pairs]
PAD_BYTES = 9216  # torch 2.11's default signal pad


def compiled(module_path: str, world_size: int, hidden: int, example=example_launch) -> dict:
    with sm90.capture_launches() as launches:
        example(importlib.import_module(module_path), world_size, (7, hidden))
    assert len(launches) == 1, f"{module_path}: expected one launch, got {len(launches)}"
    return sm90.kernel_stats(launches[0])


# ---------------------------------------------------------------------------
# Compile for sm_90, same barriers
# ---------------------------------------------------------------------------


def test_registry_lists_the_family():
    names = {p.triton_module.rsplit(".", 1)[1] for p in PAIRS}
    # The recipes and rms_norm. The front doors (triton_auto, helion_auto) are product code with no module of
    # their own: their pair names the one-shot recipe and twin, and its example launches the one the door chooses.
    assert names == set(FAMILY) | {"rms_norm"}
    assert all(p.helion_module == p.triton_module.replace("kraken.", "helion_ports.", 1) for p in PAIRS)
    auto = {p.triton_module: p.example for p in PAIRS if p.triton == "triton_auto"}
    doors = ("all_reduce_bias", "all_reduce_bias_rms_norm")
    assert auto == {f"kraken.fused.one_shot_{op}": auto_example for op in doors}
    for op in ("all_reduce_bias", "all_reduce_bias_rms_norm"):
        assert list(registry.get(op).backends) == [
            "nccl", "chain", "triton_1shot", "helion_1shot", "triton_2shot", "helion_2shot", "triton_auto",
            "helion_auto", "copy",
        ]


@pytest.mark.parametrize("pkg", ["kraken", "helion_ports"])
@pytest.mark.parametrize("norm", ["", "_rms_norm"])
def test_a_doors_example_launches_the_recipe_its_plan_chooses(pkg, norm):
    """``auto_example`` (the doors' compile example) launches the one-shot kernel up to the table's row count and
    the two-shot one above it (16 tokens at 4 ranks)."""
    module = importlib.import_module(f"{pkg}.fused.one_shot_all_reduce_bias{norm}")
    for tokens, expected in ((16, "one_shot"), (17, "two_shot")):
        with sm90.capture_launches() as launches:
            auto_example(module, 4, (tokens, 1000))
        (launch,) = launches
        name = getattr(launch.kernel, "fn", launch.kernel).__name__
        assert f"{expected}_all_reduce_bias{norm}" in name and (norm or "rms_norm" not in name), (tokens, name)


@pytest.mark.parametrize("hidden", [5120, 1000])
@pytest.mark.parametrize("world_size", [2, 8])
@pytest.mark.parametrize("pair", PAIRS, ids=[f"{p.triton_module.rsplit('.', 1)[1]}:{p.triton}" for p in PAIRS])
def test_pair_compiles_for_sm90_with_the_same_barriers(pair, world_size, hidden):
    if pair.triton_module.endswith(".rms_norm") and world_size != 2:
        pytest.skip("rms_norm is single-GPU: one world size is enough")
    triton_stats = compiled(pair.triton_module, world_size, hidden, pair.example)
    helion_stats = compiled(pair.helion_module, world_size, hidden, pair.example)
    for stats in (triton_stats, helion_stats):
        assert re.search(r"\.target\s+sm_90", stats["ptx"]), f"{stats['kernel']}: not compiled for sm_90"
        assert stats["registers"] > 0 and stats["ptx_instructions"] > 0
    t_ops, h_ops = sm90.barrier_opcodes(triton_stats["ptx"]), sm90.barrier_opcodes(helion_stats["ptx"])
    assert h_ops == t_ops, f"{helion_stats['kernel']} barrier atomics {dict(h_ops)} != {dict(t_ops)}"
    if pair.triton_module.endswith(".rms_norm"):
        assert not t_ops, "the single-GPU rms_norm has no barrier"
    else:
        # Two barrier rounds per call, each a send (CAS 0->1 on the peer) and a wait (CAS 1->0 locally).
        assert sm90.signal_rounds(triton_stats["ptx"]) == 2 and sum(t_ops.values()) == 4, dict(t_ops)


# ---------------------------------------------------------------------------
# Input validation (no GPU, no process group)
# ---------------------------------------------------------------------------

ENTRY_POINTS = [(pkg, name) for pkg in ("kraken", "helion_ports") for name in FAMILY + ["rms_norm"]]


def call(pkg: str, name: str, x, bias=None, weight=None, eps=1e-5, **config):
    """Call an installed function (``kraken.<name>``, ``helion_ports.<name>``) with the arguments it takes."""
    fn = getattr(importlib.import_module(pkg), name)
    if name == "rms_norm":
        return fn(x, weight, eps, **config)
    if name.endswith("_rms_norm"):
        return fn(x, bias, weight, eps, **config)
    return fn(x, bias, **config)


def vectors(hidden: int, dtype=torch.bfloat16):
    return torch.randn(hidden).to(dtype), torch.randn(hidden).to(dtype)


@pytest.mark.parametrize("pkg,name", ENTRY_POINTS)
def test_bad_inputs_raise_before_cuda_or_distributed(pkg, name):
    x = torch.randn(4, 64).to(torch.bfloat16)
    bias, weight = vectors(64)
    takes_bias, takes_norm = name != "rms_norm", name.endswith("rms_norm")

    with pytest.raises(TypeError, match="x must be a torch.Tensor"):
        call(pkg, name, [1.0, 2.0], bias, weight)
    with pytest.raises(ValueError, match=r"x must be \[tokens, hidden\]"):
        call(pkg, name, torch.tensor(1.0, dtype=torch.bfloat16), bias, weight)
    with pytest.raises(ValueError, match="x has dtype int32; supported: bfloat16, float16, float32"):
        call(pkg, name, x.to(torch.int32), bias.to(torch.int32), weight.to(torch.int32))
    with pytest.raises(ValueError, match="x has dtype float64"):
        call(pkg, name, x.double(), bias.double(), weight.double())
    with pytest.raises(ValueError, match="x must be contiguous"):
        call(pkg, name, torch.randn(4, 128).to(torch.bfloat16)[:, ::2], bias, weight)
    with pytest.raises(ValueError, match="hidden size 20000 is above"):
        call(pkg, name, torch.zeros(1, 20000, dtype=torch.bfloat16), *vectors(20000))

    named = [("bias", 0)] * takes_bias + [("weight", 1)] * takes_norm
    for vector, index in named:
        good = [bias, weight]
        bad = list(good)
        bad[index] = torch.randn(65).to(torch.bfloat16)
        with pytest.raises(ValueError, match=rf"{vector} must have shape \(64,\).*got \(65,\)"):
            call(pkg, name, x, *bad)
        bad[index] = good[index].to(torch.float16)
        with pytest.raises(ValueError, match=f"{vector} has dtype float16 but x has bfloat16"):
            call(pkg, name, x, *bad)
        bad[index] = good[index].view(8, 8)
        with pytest.raises(ValueError, match=rf"{vector} must have shape \(64,\)"):
            call(pkg, name, x, *bad)
        bad[index] = None
        with pytest.raises(TypeError, match=f"{vector} must be a torch.Tensor"):
            call(pkg, name, x, *bad)

    if takes_norm:
        for eps in (-1e-5, float("nan"), float("inf")):
            with pytest.raises(ValueError, match="eps must be a finite number >= 0"):
                call(pkg, name, x, bias, weight, eps=eps)
        for eps in ("1e-5", None, True):
            with pytest.raises(TypeError, match="eps must be a float"):
                call(pkg, name, x, bias, weight, eps=eps)

    # Everything above was refused on its own merits; a valid call fails only at the device check.
    with pytest.raises(ValueError, match="x must be on a CUDA device"):
        call(pkg, name, x.view(2, 2, 64), bias, weight)


@pytest.mark.parametrize("pkg", ["kraken", "helion_ports"])
@pytest.mark.parametrize("name", FAMILY + ["rms_norm"])
def test_unknown_config_keys_are_refused(pkg, name):
    plan = importlib.import_module(f"{pkg}.fused.{name}").plan
    args = (4, 64, {"bogus": 1}) if name == "rms_norm" else (4, 64, 2, {"bogus": 1})
    with pytest.raises(TypeError, match=rf"^{name}: unknown config keys \['bogus'\]"):
        plan(*args)


@pytest.mark.parametrize("name", FAMILY + ["rms_norm"])
def test_twin_plans_as_its_recipe(name):
    """A twin carries its own copy of its recipe's defaults and ``plan`` (it imports no recipe): they agree."""
    recipe, twin = (importlib.import_module(f"{pkg}.fused.{name}") for pkg in ("kraken", "helion_ports"))
    assert twin.DEFAULT_CONFIG == recipe.DEFAULT_CONFIG
    assert getattr(twin, "WORKSPACE_COPIES", None) == getattr(recipe, "WORKSPACE_COPIES", None)
    configs = [{}, {"num_warps": 8}, {"max_blocks": 3}, {"block_size": 512, "max_blocks": 5}]
    for tokens, hidden in [(0, 64), (1, 1), (1, 5120), (3, 1000), (7, 5120), (4097, 64), (256, 16384)]:
        for config in configs:
            config = {k: v for k, v in config.items() if k in recipe.DEFAULT_CONFIG}
            if name == "rms_norm":
                assert twin.plan(tokens, hidden, config) == recipe.plan(tokens, hidden, config)
                continue
            for world_size in (1, 2, 3, 8):
                for pad_bytes in (None, 9216, 64):
                    got = twin.plan(tokens, hidden, world_size, config, pad_bytes=pad_bytes)
                    assert got == recipe.plan(tokens, hidden, world_size, config, pad_bytes=pad_bytes), (
                        name, tokens, hidden, world_size, config, pad_bytes)


def test_recipe_defaults_are_the_tuned_all_reduces():
    """The family is not tuned on its own: its defaults are copies of the tuned all-reduces' (grid cap included)."""
    one_shot = importlib.import_module("kraken.comm.one_shot_all_reduce").DEFAULT_CONFIG
    two_shot = importlib.import_module("kraken.comm.two_shot_all_reduce").DEFAULT_CONFIG
    fused = {name: importlib.import_module(f"kraken.fused.{name}").DEFAULT_CONFIG for name in FAMILY}
    assert fused["one_shot_all_reduce_bias"] == one_shot and fused["two_shot_all_reduce_bias"] == two_shot
    assert fused["one_shot_all_reduce_bias_rms_norm"] == {"num_warps": None, "max_blocks": one_shot["max_blocks"]}
    assert fused["two_shot_all_reduce_bias_rms_norm"] == {"num_warps": None, "max_blocks": two_shot["max_blocks"]}
    assert importlib.import_module("kraken.fused.two_shot_all_reduce_bias").SHARD_ALIGN == \
        importlib.import_module("kraken.comm.two_shot_all_reduce").SHARD_ALIGN


# ---------------------------------------------------------------------------
# Plans: exact coverage, pad budget
# ---------------------------------------------------------------------------


def block_range(owner: int, block: int, shard: int, chunk: int, total: int) -> range:
    """Python twin of two_shot_all_reduce_bias.block_range."""
    start = owner * shard + block * chunk
    return range(start, min(start + chunk, owner * shard + shard, total))


def covered_units(name: str, tokens: int, hidden: int, world_size: int) -> tuple[list[range], dict]:
    """Each block's units (elements for the bias kernels, rows for RMSNorm), every owner's for two-shot."""
    cfg = importlib.import_module(f"kraken.fused.{name}").plan(tokens, hidden, world_size, {})
    rows = name.endswith("rms_norm")
    total = tokens if rows else tokens * hidden
    ranges = []
    for block in range(cfg["num_blocks"]):
        if "shard" in cfg:
            ranges += [block_range(s, block, cfg["shard"], cfg["chunk"], total) for s in range(world_size)]
        else:
            step = cfg["rows_per_block"] if rows else cfg["chunk"]
            ranges.append(range(block * step, min(block * step + step, total)))
    return ranges, cfg


@pytest.mark.parametrize("name", FAMILY)
def test_plans_cover_every_unit_once_and_fit_the_pad(name):
    shapes = registry.get("all_reduce_bias").default_shapes + [(0, 64), (1, 1), (3, 1000), (7, 5120), (4097, 64)]
    for world_size in range(2, 9):
        for tokens, hidden in shapes:
            ranges, cfg = covered_units(name, tokens, hidden, world_size)
            units = [u for r in ranges for u in r]
            total = tokens if name.endswith("rms_norm") else tokens * hidden
            where = f"{name} ws={world_size} {tokens}x{hidden} {cfg}"
            assert sorted(units) == list(range(total)), f"{where}: not an exact cover"
            assert 1 <= cfg["num_blocks"] <= groups.max_barrier_blocks(world_size, PAD_BYTES), where
            if "shard" in cfg and not name.endswith("rms_norm"):
                assert cfg["shard"] % 64 == 0 and cfg["chunk"] % 64 == 0, f"{where}: 16-byte alignment"
            if name == "one_shot_all_reduce_bias_rms_norm" and tokens:
                assert all(len(r) for r in ranges), f"{where}: a block without rows"


# ---------------------------------------------------------------------------
# Numbers: Triton's CPU interpreter with no-op barriers
# ---------------------------------------------------------------------------

EMULATION = textwrap.dedent(
    '''
    import importlib, os, sys
    import numpy as np
    import torch
    import triton.language as tl
    from triton.runtime import interpreter

    # 1. Scalars that come out of tl.minimum are 1-element arrays in the interpreter: let them index.
    from benchmark.sm90 import fix_interpreter_scalars
    fix_interpreter_scalars()

    # 2. The barriers (inline PTX) do nothing: the loop below orders the ranks instead.
    def no_asm(self, asm, constraints, values, types, is_pure, pack):
        shape = np.broadcast_shapes(*[np.shape(v.data) for v in values]) if values else ()
        class Call:
            def get_result(self, i):
                return interpreter.TensorHandle(np.zeros(shape, dtype=np.int32), tl.int32)
        return Call()
    interpreter.InterpreterBuilder.create_inline_asm = no_asm

    # 3. Helion's generated code calls libdevice.rsqrt, which the interpreter lacks; no GPU to count SMs.
    from torch._inductor.runtime import triton_compat
    triton_compat.libdevice.rsqrt = lambda x: tl.math.rsqrt(x)
    import helion.runtime
    helion.runtime.get_num_sm = lambda device, reserved_sms=0: 132

    TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}
    pkg = sys.argv[1]
    failures = []
    # tokens < world size, tails in both dimensions, several blocks per rank (small configs).
    for dtype, ws, tokens, hidden, config in [
        (torch.float32, 2, 1, 40, {}),
        (torch.float32, 3, 7, 100, {"block_size": 256, "max_blocks": 2}),
        (torch.bfloat16, 2, 5, 1000, {"block_size": 512, "max_blocks": 3}),
    ]:
        g = torch.Generator().manual_seed(tokens * 31 + hidden + ws)
        xs = [torch.randn(tokens, hidden, generator=g).to(dtype) for _ in range(ws)]
        bias = torch.randn(hidden, generator=g).to(dtype)
        weight = (1 + 0.5 * torch.randn(hidden, generator=g)).to(dtype)
        h = sum(x.double() for x in xs) + bias.double()
        refs = {False: h, True: h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-5) * weight.double()}
        for name in ["one_shot_all_reduce_bias", "one_shot_all_reduce_bias_rms_norm",
                     "two_shot_all_reduce_bias", "two_shot_all_reduce_bias_rms_norm", "rms_norm"]:
            module = importlib.import_module(f"{pkg}.fused.{name}")
            norm = name.endswith("rms_norm")
            if name == "rms_norm":
                out = torch.full_like(xs[0], float("nan"))
                module.launch(xs[0], weight, out, 1e-5, **module.plan(tokens, hidden, {}))
                x64 = xs[0].double()
                outs, ref = [out], x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + 1e-5) * weight.double()
            else:
                cfg = module.plan(tokens, hidden, ws, {k: v for k, v in config.items()
                                                       if not (norm and k == "block_size")})
                copies = 2 if "shard" in cfg else 1
                # Workspaces poisoned, then every rank's staged input in place (what barrier 1 waits for).
                peers = tuple(torch.full((copies * tokens * hidden,), float("nan"), dtype=dtype) for _ in range(ws))
                for r in range(ws):
                    peers[r][: tokens * hidden] = xs[r].view(-1)
                outs = [torch.full_like(xs[0], float("nan")) for _ in range(ws)]
                # Two-shot runs every rank twice: the second pass gathers rows every owner has pushed.
                for _ in range(copies):
                    for r in range(ws):
                        norm_args = (weight, 1e-5) if norm else ()
                        module.launch(xs[r], bias, *norm_args, peers, outs[r], 0x7F0000001000, r, **cfg)
                ref = refs[norm]
            for r, out in enumerate(outs):
                err = ((out.double() - ref).norm() / ref.norm()).item()
                where = f"{pkg}.{name} {dtype} ws={ws} {tokens}x{hidden} rank {r}"
                if not err <= TOL[dtype]:  # NaN (an unwritten element) fails too
                    failures.append(f"{where}: relative error {err:.2e}")
                if not torch.equal(out, outs[0]):
                    failures.append(f"{where}: differs from rank 0")
    print("\\n".join(failures) or "ok")
    '''
)


@pytest.mark.parametrize("pkg", ["kraken", "helion_ports"])
def test_kernels_compute_the_reference_in_the_interpreter(pkg):
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    result = subprocess.run(
        [sys.executable, "-c", EMULATION, pkg], env=env, capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip().splitlines()[-1] == "ok", result.stdout[-3000:]
