"""Bad input gets a ValueError/TypeError naming the problem, on the host, before any launch."""

from __future__ import annotations

import importlib

import pytest
import torch
import torch.distributed as dist

from fake_world import FakeWorld
from kraken.runtime import agreement, groups, symm

ENTRY_POINTS = [
    ("kraken.runtime.collectives", "one_shot_all_reduce"),
    ("kraken.runtime.collectives", "two_shot_all_reduce"),
    ("helion_ports", "one_shot_all_reduce"),
    ("helion_ports", "two_shot_all_reduce"),
]


def entry(module: str, name: str):
    return getattr(importlib.import_module(module), name)


@pytest.mark.parametrize("module,name", ENTRY_POINTS)
def test_tensor_checks(module, name):
    fn = entry(module, name)
    with pytest.raises(ValueError, match="dtype int32; supported: bfloat16, float16, float32"):
        fn(torch.zeros(8, dtype=torch.int32))
    with pytest.raises(ValueError, match="must be contiguous"):
        fn(torch.zeros(8, 8).t())
    with pytest.raises(ValueError, match="must be on a CUDA device"):
        fn(torch.zeros(8))
    with pytest.raises(TypeError, match="must be a torch.Tensor"):
        fn([1.0, 2.0])


def test_group_checks():
    with pytest.raises(ValueError, match="not initialized"):
        groups.resolve_group(None, "op")
    with pytest.raises(ValueError, match="needs a group of 1 to 8 ranks"):
        groups.check_world_size(0, "op")
    with pytest.raises(ValueError, match="got world size 9"):
        groups.check_world_size(9, "op")
    for ws in range(1, 9):
        groups.check_world_size(ws, "op")


def test_group_lookup_errors(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        with pytest.raises(ValueError, match="no process group is named"):
            groups.resolve_group("nope", "op")
        with pytest.raises(TypeError, match="group must be"):
            groups.resolve_group(3, "op")
    finally:
        dist.destroy_process_group()


def test_signal_pad_budget():
    pad = 9216  # torch 2.11's default: 2304 slots
    assert groups.max_barrier_blocks(2, pad) == 1152
    assert groups.max_barrier_blocks(8, pad) == 288
    groups.check_barrier_blocks(288, 8, "op", pad)
    with pytest.raises(ValueError, match=r"needs 289 barrier block ids x 8 ranks = 2312 signal slots.*holds 2304"):
        groups.check_barrier_blocks(289, 8, "op", pad)


@pytest.mark.parametrize("module", ["kraken.comm.one_shot_all_reduce", "kraken.comm.two_shot_all_reduce"])
def test_plans_stay_inside_the_pad_at_every_world_size(module):
    plan = importlib.import_module(module).plan
    for ws in range(2, 9):
        for numel in (1, 7, 4095, 1 << 20, 1 << 28):
            cfg = plan(numel, ws, {"max_blocks": 100_000})
            assert 1 <= cfg["num_blocks"] <= groups.max_barrier_blocks(ws)
            covered = cfg["num_blocks"] * cfg["chunk"] * (ws if "shard" in cfg else 1)
            assert covered >= numel, f"{module} ws={ws} numel={numel}: grid covers only {covered}"
    with pytest.raises(TypeError, match="unknown config keys"):
        plan(10, 2, {"blocksize": 1})


def test_workspace_sizes_are_agreed_before_growing(monkeypatch):
    """Growing the workspace is a collective: every rank must agree on the size first, or one rank
    would enter the allocation alone and hang. So the agreement comes first, once per size."""
    calls = []

    class FakeGroup:
        group_name = "fake"

    monkeypatch.setattr(groups, "resolve_group", lambda group, op: FakeGroup())
    monkeypatch.setattr(agreement, "_agree", lambda signature, pg, op: calls.append(("agree", signature)))
    monkeypatch.setattr(symm, "symm_empty", lambda size, dtype, device, pg: calls.append(("grow", size))
                        or torch.empty(size, dtype=dtype))
    monkeypatch.setattr(symm, "_workspaces", {})
    monkeypatch.setattr(agreement, "_agreed", set())
    device = torch.device("cpu")
    assert symm.symm_workspace(5000, torch.float32, device, None, "op").numel() == 5000
    assert symm.symm_workspace(5000, torch.float32, device, None, "op").numel() == 5000  # no new collective
    assert symm.symm_workspace(100, torch.float32, device, None, "op").numel() == 100  # fits: agree only
    assert calls == [("agree", ("workspace elements", 5000, "torch.float32")), ("grow", 8192),
                     ("agree", ("workspace elements", 100, "torch.float32"))]
    # A rank whose agreement fails (ranks disagree) never reaches the allocation.
    def disagree(signature, pg, op):
        calls.append(("agree", signature))
        raise ValueError("ranks disagree")

    monkeypatch.setattr(agreement, "_agree", disagree)
    with pytest.raises(ValueError, match="ranks disagree"):
        symm.symm_workspace(1 << 20, torch.float32, device, None, "op")
    assert calls[-1] == ("agree", ("workspace elements", 1 << 20, "torch.float32"))  # and no "grow" after it


def _fail(exc):
    raise exc


def test_agreed_raises_on_every_rank_when_one_rank_is_wrong(monkeypatch):
    bias = torch.zeros(5120)
    # Rank 1 alone has a bad bias (same shapes as ours: its check failed on something else).
    world = FakeWorld(monkeypatch, other=lambda mine: (mine[0], ("ValueError", "bias has dtype float16 but x has float32")))
    with pytest.raises(ValueError, match=r"^op: bad input on rank 1: bias has dtype float16 but x has float32$"):
        with agreement.agreed("op", None, bias=bias, eps=1e-6):
            pass  # our own checks pass
    assert world.exchanges == 1
    # The failed agreement is not remembered: the same call exchanges again (and the peer is fixed now).
    world.other = None
    with agreement.agreed("op", None, bias=bias, eps=1e-6):
        pass
    with agreement.agreed("op", None, bias=bias, eps=1e-6):
        pass
    assert world.exchanges == 2  # one more exchange, then a set lookup


def test_agreed_names_every_failing_rank_and_keeps_the_error_type(monkeypatch):
    FakeWorld(monkeypatch, other=lambda mine: mine)  # the peer fails the same way
    with pytest.raises(TypeError, match=r"^op: bad input on ranks 0, 1: x must be a torch.Tensor$"):
        with agreement.agreed("op", None, x=[1.0]):
            _fail(TypeError("op: x must be a torch.Tensor"))
    FakeWorld(monkeypatch, other=lambda mine: (mine[0], ("ValueError", "eps must be >= 0")))
    with pytest.raises(ValueError, match=r"rank 0: x is wrong; rank 1: eps must be >= 0"):
        with agreement.agreed("op", None, x=torch.zeros(2)):
            _fail(TypeError("op: x is wrong"))


def test_agreed_names_what_differs_between_ranks(monkeypatch):
    other = lambda mine: ((("x", ("tensor", (4, 5121), "bfloat16", "cuda", True)), mine[0][1]), None)  # noqa: E731
    FakeWorld(monkeypatch, other=other)
    x = torch.zeros(4, 5120, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"ranks disagree on the input's shape/dtype \(x: rank 0 \('tensor', \(4, 5120\)"):
        with agreement.agreed("op", None, x=x, eps=1e-6):
            pass


def test_agreed_after_success_raises_locally_without_a_collective(monkeypatch):
    world = FakeWorld(monkeypatch)
    with agreement.agreed("op", None, n=3):
        pass
    with pytest.raises(ValueError, match="only here"):
        with agreement.agreed("op", None, n=3):
            _fail(ValueError("only here"))
    assert world.exchanges == 1


def test_signature_of_describes_arguments():
    t = torch.zeros(3, 4, dtype=torch.float16)
    assert agreement.signature_of(t) == ("tensor", (3, 4), "float16", "cpu", True)
    assert agreement.signature_of(t.t())[-1] is False
    assert agreement.signature_of({"b": 1, "a": torch.bfloat16}) == (("a", "torch.bfloat16"), ("b", 1))
    assert agreement.signature_of([1, None, "x"]) == (1, None, "x") and agreement.signature_of(object()) == "object"


def test_agreed_reports_bad_input_and_disagreement_together(monkeypatch):
    """Rank 1 passes another shape *and* fails its own check: both are named, in one ValueError."""
    other = lambda mine: ((("m", 9),), ("ValueError", "M = 9 rows do not split evenly over 2 ranks"))  # noqa: E731
    FakeWorld(monkeypatch, other=other)
    with pytest.raises(ValueError, match=r"bad input on rank 1: M = 9 rows do not split evenly over 2 ranks; "
                                         r"and ranks disagree on the input's shape/dtype \(m: rank 0 8, rank 1 9\)"):
        with agreement.agreed("op", None, m=8):
            pass
