"""MoE dispatch and combine without a GPU: the plans fit the signal pad and cover every pair and token once,
the twins plan as their recipes and take their arguments, the plain-torch reference has the documented layout and capacity rule, the four dispatch kernels and the
combine kernel, the recipes' and the Helion twins' alike, run end to end under the Triton interpreter (fake
peers, barriers as no-ops) and agree with the reference exactly, the NCCL baseline gives the same layout,
bad input raises on every rank before any launch (a fake two-rank world), warm calls take the host fast path
(no agreement, plan or buffer lookup; launches through the compiled kernels), every default benchmark shape
round-trips through the harness and the command line, and the combine's machine code issues every peer load
of a step before its first multiply-add."""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import os
import re
import subprocess
import sys

import pytest
import torch
import triton
import triton.language as tl

from benchmark import harness, registry, sm90
from benchmark.cli import parse_args
from benchmark.ops import moe as moe_op
from fake_world import FakeWorld
from kraken.runtime import graphs, groups, moe, prepared, symm
from test_fast_path_cpu import WARM_CALLS, same_kind, symmetric_world
from test_fast_path_cpu import launches as fast_path_launches  # noqa: F401 (a fixture, used by its name)

DISPATCH = ("kraken.comm.moe_dispatch", "helion_ports.comm.moe_dispatch")  # the recipe and its twin
COMBINE = ("kraken.comm.moe_combine", "helion_ports.comm.moe_combine")
PACKAGES = ("kraken", "helion_ports")  # the installed functions: kraken.moe_dispatch, helion_ports.moe_dispatch
PAD = 9216  # torch 2.11's default signal pad
HERE = os.path.dirname(os.path.abspath(__file__))


def module(path: str):
    return importlib.import_module(path)


D, C = module(DISPATCH[0]), module(COMBINE[0])


# ---------------------------------------------------------------------------
# Plans
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("ws", [2, 3, 8])
@pytest.mark.parametrize("tokens,top_k", [(1, 1), (37, 2), (128, 8), (4096, 8), (4097, 3)])
def test_plans_fit_the_pad_and_cover_everything_once(ws, tokens, top_k):
    for max_blocks in (132, 100_000):
        cfg = D.plan(tokens, top_k, 4096, 8 * ws, ws, {"max_blocks": max_blocks}, pad_bytes=PAD)
        assert 1 <= cfg["num_blocks"] <= groups.max_barrier_blocks(ws, PAD)
        covered = torch.zeros(tokens * top_k, dtype=torch.int32)
        for b in range(cfg["num_blocks"]):
            start = b * cfg["pairs_per_block"]
            covered[start:min(start + cfg["pairs_per_block"], tokens * top_k)] += 1
        assert torch.all(covered == 1), (ws, tokens, top_k, cfg)
        assert cfg["pairs_per_block"] % cfg["rows"] == 0
        assert cfg["num_chunks"] * D.CHUNK >= tokens * top_k
        assert cfg["e_pad"] >= 8 * ws and cfg["ws_pad"] >= ws
        ccfg = C.plan(tokens, 4096, ws, {"max_blocks": max_blocks}, pad_bytes=PAD)
        assert 1 <= ccfg["num_blocks"] <= groups.max_barrier_blocks(ws, PAD)
        covered = torch.zeros(tokens, dtype=torch.int32)
        for b in range(ccfg["num_blocks"]):
            start = b * ccfg["tokens_per_block"]
            covered[start:min(start + ccfg["tokens_per_block"], tokens)] += 1
        assert torch.all(covered == 1), (ws, tokens, ccfg)
    with pytest.raises(TypeError, match="unknown config keys"):
        D.plan(4, 2, 8, 4, 2, {"bogus": 1})
    with pytest.raises(TypeError, match="unknown config keys"):
        C.plan(4, 8, 2, {"bogus": 1})


@pytest.mark.parametrize("ws", [1, 2, 3, 8])
def test_the_twins_plan_as_their_recipes(ws):
    """A twin's ``plan``, ``DEFAULT_CONFIG`` and capacity rule are copies of its recipe's; the installed functions
    plan with the recipe's for both."""
    twin_dispatch, twin_combine = module(DISPATCH[1]), module(COMBINE[1])
    assert twin_dispatch.DEFAULT_CONFIG == D.DEFAULT_CONFIG and twin_combine.DEFAULT_CONFIG == C.DEFAULT_CONFIG
    assert twin_dispatch.CHUNK == D.CHUNK and twin_dispatch.default_capacity(37, 3) == D.default_capacity(37, 3)
    for tokens, top_k, hidden in ((1, 1, 1), (37, 2, 129), (4097, 3, 7168), (65536, 8, 4096)):
        for config in ({}, {"max_blocks": 100_000}, {"rows": 8, "block_h": 256}):
            for pad in (PAD, 1 << 16):
                assert twin_dispatch.plan(tokens, top_k, hidden, 8 * ws, ws, config, pad_bytes=pad) == D.plan(
                    tokens, top_k, hidden, 8 * ws, ws, config, pad_bytes=pad)
        for config in ({}, {"max_blocks": 7}, {"tokens": 8, "block_h": 512}):
            assert twin_combine.plan(tokens, hidden, ws, config, pad_bytes=PAD) == C.plan(tokens, hidden, ws, config,
                                                                                          pad_bytes=PAD)
    assert D.plan(37, 2, 129, 8 * ws, ws, {}) == D.plan(37, 2, 129, 8 * ws, ws, {}, pad_bytes=PAD)  # torch's pad
    with pytest.raises(TypeError, match="unknown config keys"):
        twin_dispatch.plan(4, 2, 8, 4, 2, {"bogus": 1})
    with pytest.raises(TypeError, match="unknown config keys"):
        twin_combine.plan(4, 8, 2, {"bogus": 1})


@pytest.mark.parametrize("recipe_path,twin_path", list(zip(DISPATCH[:1] + COMBINE[:1], DISPATCH[1:] + COMBINE[1:])))
def test_the_twins_have_their_recipes_signatures(recipe_path, twin_path):
    """The plain host function and ``launch`` of a twin take its recipe's arguments (``launch``'s default launcher
    aside: Triton's own launch in a recipe, None in a twin), and the installed twin its installed recipe's."""
    recipe, twin = module(recipe_path), module(twin_path)
    name = recipe_path.rsplit(".", 1)[1]

    def seam(fn):
        signature = inspect.signature(fn)
        return signature.replace(parameters=[p.replace(default="a launcher") if p.name == "launcher" else p
                                             for p in signature.parameters.values()])

    for attr in (name, "launch"):
        assert seam(getattr(twin, attr)) == seam(getattr(recipe, attr)), f"{name}.{attr}"
    installed = (getattr(module(package), name) for package in PACKAGES)
    assert inspect.signature(next(installed)) == inspect.signature(next(installed))


def test_default_capacity_is_twice_an_even_share():
    assert D.default_capacity(4096, 8) == 2 * 4096 * 8
    assert D.default_capacity(1, 1) == 2


# ---------------------------------------------------------------------------
# The reference: layout, capacity, bad ids
# ---------------------------------------------------------------------------


def test_reference_layout_is_expert_major_then_rank_then_token():
    # 2 ranks, 4 experts (rank 0 owns 0, 1; rank 1 owns 2, 3), top-2.
    ids0 = torch.tensor([[1, 2], [0, 1], [3, -1]])
    ids1 = torch.tensor([[1, 0], [2, 3]])
    ref = D.reference_slots([ids0, ids1], 4, capacity=100)
    # Rank 0 receives: expert 0 from rank 0 (t1) then rank 1 (t0); expert 1: rank 0 (t0, t1), rank 1 (t0).
    assert ref["recv_counts"][0].tolist() == [2, 3] and ref["recv_offsets"][0].tolist() == [0, 2]
    assert ref["recv_counts"][1].tolist() == [2, 2] and ref["recv_offsets"][1].tolist() == [0, 2]
    assert ref["slots"][0].tolist() == [[2, 100 + 0], [0, 3], [100 + 2, -1]]
    assert ref["slots"][1].tolist() == [[4, 1], [100 + 1, 100 + 3]]
    assert ref["dropped"] == [0, 0] and ref["bad"] == [0, 0]
    tokens = [torch.arange(3.0)[:, None].expand(3, 2) + 10, torch.arange(2.0)[:, None].expand(2, 2) + 20]
    rows, counts, offsets = D.reference_dispatch(tokens, [ids0, ids1], 4, 100, 0)
    assert rows[:, 0].tolist() == [11, 20, 10, 11, 20]


def test_capacity_drops_the_last_rows_and_counts_them():
    ids0 = torch.tensor([[0], [0], [1]])
    ids1 = torch.tensor([[0], [1], [1]])
    # Rank 0 owns experts 0 and 1 (of 4): expert 0 gets rows 0-2, expert 1 rows 3-5; capacity 4 keeps 4.
    ref = D.reference_slots([ids0, ids1], 4, capacity=4)
    assert ref["slots"][0].flatten().tolist() == [0, 1, 3]
    assert ref["slots"][1].flatten().tolist() == [2, -1, -1]
    assert ref["dropped"] == [0, 2]
    assert ref["recv_counts"][0].tolist() == [3, 1] and ref["recv_offsets"][0].tolist() == [0, 3]
    # Capacity 2: expert 1 starts past the end, nothing of it is kept.
    ref = D.reference_slots([ids0, ids1], 4, capacity=2)
    assert ref["recv_counts"][0].tolist() == [2, 0] and ref["recv_offsets"][0].tolist() == [0, 2]
    assert ref["dropped"] == [1, 3]


def test_bad_ids_are_skipped_and_counted():
    ref = D.reference_slots([torch.tensor([[0, 7], [-1, -2]]), torch.tensor([[1, 1]])], 4, capacity=10)
    assert ref["bad"] == [2, 0] and ref["slots"][0].tolist() == [[0, -1], [-1, -1]]


# ---------------------------------------------------------------------------
# The kernels under the Triton interpreter (a subprocess: TRITON_INTERPRET is read at import)
# ---------------------------------------------------------------------------

INTERPRET_CASES = [
    # ws, T, H, E, K, capacity, skewed, bad ids
    (2, 1, 1, 2, 1, None, False, False),  # one token, one column, one expert per rank
    (2, 37, 33, 4, 2, None, False, False),
    (3, 50, 16, 6, 3, None, True, False),
    (4, 150, 8, 16, 2, 200, True, False),  # drops past capacity, chunks of 128 pairs cross
    (2, 20, 8, 8, 2, None, False, True),  # ids -1 and out of range
    (8, 16, 4, 64, 8, 40, True, False),  # many empty experts, drops
]


@triton.jit
def no_barrier(signal_pad_ptrs, block_id, rank, world_size: tl.constexpr, hasPreviousMemAccess: tl.constexpr = False,
               hasSubsequentMemAccess: tl.constexpr = False):
    """Stands in for ``symm_mem_sync`` under the interpreter (which runs no inline PTX)."""
    pass


def interpret_case(ws, tokens, hidden, num_experts, top_k, capacity, skewed, bad, backend="triton", seed=0):
    """Run inside a TRITON_INTERPRET=1 process: every rank's four dispatch kernels on CPU tensors standing in for
    the symmetric buffers (the barrier a no-op: the exchange runs twice over all ranks, so the second pass sees
    every rank's counts), then the combine, each checked against the reference. With ``backend="helion"`` the
    twins' launches run instead: Helion generates its Triton (with the barrier snippets swapped for a thread
    barrier, since the interpreter runs no inline PTX) and the interpreter runs that."""
    sm90.fix_interpreter_scalars()
    D.symm_mem_sync = C.symm_mem_sync = module("kraken._blocks.moe").symm_mem_sync = no_barrier
    launches = (D.launch, C.launch)
    if backend == "helion":
        twin_dispatch, twin_combine = module(DISPATCH[1]), module(COMBINE[1])
        twin_dispatch.SYNC_END = twin_combine.SYNC_START = twin_combine.SYNC_END = "tl.debug_barrier()"
        D.launch, C.launch = twin_dispatch.launch, twin_combine.launch
    try:
        return run_case(ws, tokens, hidden, num_experts, top_k, capacity, skewed, bad, seed)
    finally:
        D.launch, C.launch = launches


def run_case(ws, tokens, hidden, num_experts, top_k, capacity, skewed, bad, seed):
    gen = torch.Generator().manual_seed(seed)
    weights = 1.0 / torch.arange(1, num_experts + 1) ** 2 if skewed else torch.ones(num_experts)
    all_ids = [torch.multinomial(weights.expand(tokens, num_experts), top_k, generator=gen) for _ in range(ws)]
    if bad:
        all_ids[0][0, 0], all_ids[0][1, 1], all_ids[1][2, 0] = -1, num_experts, -5
    all_tokens = [torch.randn(tokens, hidden, generator=gen).to(torch.bfloat16) for _ in range(ws)]
    capacity = capacity or D.default_capacity(tokens, top_k)
    cfg = D.plan(tokens, top_k, hidden, num_experts, ws, {"max_blocks": 7, "rows": 4, "block_h": 16})
    recv = tuple(torch.full((capacity, hidden), float("nan"), dtype=torch.bfloat16) for _ in range(ws))
    counts = tuple(torch.zeros(ws, cfg["e_pad"], dtype=torch.int32) for _ in range(ws))
    # The routing outputs as the installed dispatch lays them out: views of its handle's one allocation.
    handles = [moe.new_handle(all_tokens[r], all_ids[r], num_experts, recv[r], symm.SymmContext(r, ws, "", recv, 0),
                              capacity) for r in range(ws)]
    outputs = [(h.slots, h.recv_counts, h.recv_offsets, h.status) for h in handles]
    for _ in range(2):
        for r in range(ws):
            D.route(all_ids[r], *outputs[r], counts, 0, r, num_experts, capacity, cfg["num_chunks"], cfg["e_pad"],
                    cfg["ws_pad"])
    for r in range(ws):
        D.launch(all_tokens[r], all_ids[r], *outputs[r], recv, 0, counts, 0, r, num_experts, capacity, **cfg)
    ref = D.reference_slots(all_ids, num_experts, capacity)
    for r in range(ws):
        h = handles[r]
        assert torch.equal(h.slots, ref["slots"][r]), (r, h.slots, ref["slots"][r])
        assert h.recv_counts.tolist() == ref["recv_counts"][r].tolist(), r
        assert h.recv_offsets.tolist() == ref["recv_offsets"][r].tolist(), r
        assert h.status.tolist() == [ref["dropped"][r], ref["bad"][r]], (r, h.status)
        rows, _, _ = D.reference_dispatch(all_tokens, all_ids, num_experts, capacity, r)
        used = rows.shape[0]
        if used:
            assert torch.equal(recv[r][:min(used, capacity)], rows[:capacity]), f"rank {r}: recv rows differ"
        assert torch.isnan(recv[r][used:].float()).all(), f"rank {r}: rows past the used ones were written"
    # Combine: expert outputs = recv * 2 (rows never written stay NaN and must never be read).
    expert_out = tuple(x * 2 for x in recv)
    for r in range(ws):
        recv[r].copy_(expert_out[r])
    ccfg = C.plan(tokens, hidden, ws, {"max_blocks": 5, "tokens": 2, "block_h": 16})
    for r in range(ws):
        w = torch.rand(tokens, top_k, generator=gen)
        out = torch.full((tokens, hidden), float("nan"), dtype=torch.bfloat16)
        C.launch(out, w, handles[r].slots, recv, 0, r, capacity, **ccfg)
        expected = C.reference_combine(list(expert_out), ref["slots"], w, r, capacity)
        assert not torch.isnan(out.float()).any(), f"rank {r}: combine read an unwritten row or left one"
        torch.testing.assert_close(out.float(), expected.float(), rtol=1e-2, atol=1e-2)
    return "ok"


@pytest.mark.parametrize("backend", ["triton", "helion"])
@pytest.mark.parametrize("case", INTERPRET_CASES, ids=[f"ws{c[0]}-T{c[1]}-E{c[3]}-k{c[4]}" for c in INTERPRET_CASES])
def test_kernels_under_the_interpreter_match_the_reference(case, backend):
    """The one-token case also guards the Helion combine's size-1 workaround: without it the interpreter shows
    the same wrong row 0 as the GPU would (docs/helion-notes.md)."""
    code = (f"import sys; sys.path.insert(0, {HERE!r}); import test_moe_cpu as t; "
            f"print(t.interpret_case(*{case!r}, backend={backend!r}))")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    env["KRAKEN_BARRIER_TIMEOUT_S"] = "0"  # plain barrier loops (on by default): the interpreter runs no PTX anyway
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                            cwd=os.path.dirname(HERE), timeout=600)
    assert result.returncode == 0 and result.stdout.strip().endswith("ok"), result.stderr[-4000:]


# ---------------------------------------------------------------------------
# Input validation (host only, before any launch)
# ---------------------------------------------------------------------------


def every_check_but_the_device(real_check):
    def check(tensor, name, op, **kwargs):
        try:
            real_check(tensor, name, op, **kwargs)
        except ValueError as exc:
            if "must be on a CUDA device" not in str(exc):
                raise
    return check


@pytest.mark.parametrize("package", PACKAGES)
def test_dispatch_bad_input_raises_on_every_rank_before_any_launch(package, monkeypatch):
    mod = module(package)
    world = FakeWorld(monkeypatch)  # rank 1 passes the same arguments
    monkeypatch.setattr(groups, "check_tensor", every_check_but_the_device(groups.check_tensor))
    launches = []
    monkeypatch.setattr(graphs, "graphed", lambda *args, **kwargs: launches.append(args))  # the launches' way
    tokens, ids = torch.zeros(6, 8), torch.zeros(6, 2, dtype=torch.int64)
    cases = [
        ((tokens.int(), ids, 4), ValueError, "tokens has dtype int32"),
        ((tokens, ids.float(), 4), ValueError, "expert_ids has dtype float32"),
        ((tokens, ids[:5], 4), ValueError, "expert_ids has 5 rows but tokens has 6"),
        ((tokens, ids, 3), ValueError, "divisible by the world size 2"),
        ((tokens, ids, 4.0), TypeError, "num_experts must be an int"),
        ((tokens, torch.zeros(6, 17, dtype=torch.int64), 4), ValueError, "top-k = 17"),
        ((tokens[0], ids, 4), ValueError, "tokens must be 2-D"),
    ]
    for args, error, message in cases:
        with pytest.raises(error, match=message):
            getattr(mod, "moe_dispatch")(*args)
    with pytest.raises(ValueError, match="capacity must be a positive int"):
        mod.moe_dispatch(tokens, ids, 4, capacity=0)
    with pytest.raises(TypeError, match="unknown config keys"):
        mod.moe_dispatch(tokens, ids, 4, bogus=1)
    assert not launches and world.exchanges == len(cases) + 2


def test_dispatch_bad_input_on_one_rank_raises_on_both(monkeypatch):
    """Rank 1 (the fake) reports a failure: rank 0, whose input is fine, raises naming rank 1."""
    def other(mine):
        signature, _ = mine
        return signature, ("ValueError", "expert_ids has dtype float32; supported: int32, int64")

    FakeWorld(monkeypatch, other=other)
    monkeypatch.setattr(groups, "check_tensor", every_check_but_the_device(groups.check_tensor))
    monkeypatch.setattr(moe, "buffers", lambda *a: pytest.fail("allocated after a failed agreement"))
    with pytest.raises(ValueError, match="bad input on rank 1: expert_ids has dtype float32"):
        moe.moe_dispatch(torch.zeros(6, 8), torch.zeros(6, 2, dtype=torch.int64), 4)


def test_combine_checks(monkeypatch):
    FakeWorld(monkeypatch)
    monkeypatch.setattr(groups, "check_tensor", every_check_but_the_device(groups.check_tensor))
    recv = torch.zeros(24, 8, dtype=torch.bfloat16)
    ctx = symm.SymmContext(0, 2, "fake", (recv, recv), 0)
    handle = moe.new_handle(torch.zeros(6, 8, dtype=torch.bfloat16), torch.zeros(6, 2, dtype=torch.int64), 4, recv,
                            ctx, 24)
    for package in PACKAGES:
        fn = module(package).moe_combine
        with pytest.raises(TypeError, match="handle must be the MoEHandle"):
            fn(recv, object(), torch.zeros(6, 2))
        with pytest.raises(ValueError, match="expert_out has dtype float32"):
            fn(recv.float(), handle, torch.zeros(6, 2))
        with pytest.raises(ValueError, match=r"expert_out has shape \(23, 8\)"):
            fn(recv[:23], handle, torch.zeros(6, 2))
        with pytest.raises(ValueError, match=r"weights has shape \(6, 3\)"):
            fn(recv, handle, torch.zeros(6, 3))
        with pytest.raises(ValueError, match="weights has dtype int64"):
            fn(recv, handle, torch.zeros(6, 2, dtype=torch.int64))


# ---------------------------------------------------------------------------
# The host fast path: warm calls look up their prepared call and launch through the compiled kernels
# ---------------------------------------------------------------------------


def launch_args(entry) -> tuple:
    """The kernel's own arguments of a logged launch (test_fast_path_cpu's ``launches``): as the JIT was called,
    or as the compiled kernel's launch function got them (after grid, stream, function, metadata and hooks)."""
    return entry[2] if entry[0] == "jit" else entry[1][9:]


@pytest.mark.parametrize("package", ["kraken", "helion_ports"])
def test_warm_calls_do_no_per_call_work(package, monkeypatch, fast_path_launches):
    """After the first dispatch + combine of a signature: no agreement, no plan, no symmetric buffer lookup, the
    routing scratch reused, a new handle and output per call, and every kernel (three routing kernels and the
    copy, then the combine) launched through its compiled kernel with the argument types the JIT bound. A new
    signature is checked and agreed again."""
    launches = fast_path_launches
    counts = symmetric_world(monkeypatch, DISPATCH[0])  # a fake 2-rank world; this process's peers are zeros
    monkeypatch.setattr(symm, "symm_empty", lambda shape, dtype, device, group: torch.zeros(shape, dtype=dtype))
    monkeypatch.setattr(moe, "_buffers", {})
    combine_plans = []
    real_plan = C.plan
    monkeypatch.setattr(C, "plan", lambda *args: combine_plans.append(args) or real_plan(*args))
    dispatch, combine = module(package).moe_dispatch, module(package).moe_combine
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randn(37, 64, generator=gen).to(torch.bfloat16)
    ids, weights = torch.randint(0, 4, (37, 2), generator=gen), torch.rand(37, 2, generator=gen)
    handles, outs = [], []
    try:
        for _ in range(WARM_CALLS):
            recv, recv_counts, handle = dispatch(tokens, ids, 4)
            assert recv_counts is handle.recv_counts and recv is handle.recv
            outs.append(combine(recv, handle, weights))
            handles.append(handle)
        world = counts["world"]
        assert world.exchanges == 2, "the ranks agreed on a signature more than once"
        assert counts["plan"] == 1 and len(combine_plans) == 1, (counts, combine_plans)
        assert counts["symm_context"] == 2, "recv and counts are found once"
        per_round = 5  # histogram, exchange, slots, copy; combine
        assert len(launches) == per_round * WARM_CALLS, [entry[0] for entry in launches]
        rounds = [launches[r * per_round:(r + 1) * per_round] for r in range(WARM_CALLS)]
        for i in range(per_round):
            kinds = [rnd[i][0] for rnd in rounds]
            # A Triton kernel binds once through the JIT; a Helion twin's kernel compiles with its plain call, then
            # binds once more through the prepared call's launcher.
            jit_calls = 2 if package == "helion_ports" and i >= 3 else 1
            assert kinds == ["jit"] * jit_calls + ["fast"] * (WARM_CALLS - jit_calls), (i, kinds)
            bound = launch_args(rounds[jit_calls - 1][i])
            for r, rnd in enumerate(rounds[jit_calls:], jit_calls):
                fast = launch_args(rnd[i])
                # Warm calls replay the whole dispatch's and the combine's launches (``replayed``): their tensors go
                # in as their addresses. A twin's dispatch records its replay on its second call (its Helion
                # kernels' first calls went past the launcher), launching as the JIT bound them.
                replayed = not (package == "helion_ports" and i < 4 and r == 1)
                assert len(fast) >= len(bound) and all(same_kind(a, b, replayed) for a, b in zip(fast, bound)), i
        address = lambda value: value if isinstance(value, int) else value.data_ptr()  # noqa: E731
        for r, rnd in enumerate(rounds):
            histogram, exchange, slots_launch = (launch_args(entry) for entry in rnd[:3])
            assert address(histogram[1]) == launch_args(rounds[0][0])[1].data_ptr(), (
                "the routing scratch is made once per signature")
            assert address(slots_launch[3]) == handles[r].slots.data_ptr()  # this call's handle
            assert address(exchange[5]) == handles[r].recv_counts.data_ptr()
            if rnd[4][0] == "fast":  # the combine's replay: this call's output and slots, the prepared call's recv
                combined = [v for value in launch_args(rnd[4]) for v in (value if type(value) is tuple else (value,))]
                assert outs[r].data_ptr() in combined and handles[r].slots.data_ptr() in combined
                assert handles[r].recv.data_ptr() in combined and weights.data_ptr() in combined  # recv: a peer
                assert all(type(value) is not torch.Tensor for value in combined), "a replay passes addresses"
        assert len({id(h.slots) for h in handles}) == WARM_CALLS and len({id(o) for o in outs}) == WARM_CALLS
        assert handles[0].slots.shape == (37, 2) and handles[0].status.shape == (2,)
        assert handles[0].recv_counts.shape == handles[0].recv_offsets.shape == (2,)

        with pytest.raises(TypeError, match="unknown config keys"):
            dispatch(tokens, ids, 4, not_a_key=1)  # a new signature: checked (and agreed) again
        with pytest.raises(TypeError, match="unknown config keys"):
            combine(recv, handle, weights, not_a_key=1)
        assert world.exchanges == 4
        combine(recv, handle, weights, max_blocks=3)
        assert len(combine_plans) == 3 and world.exchanges == 5  # the bad config raised in its plan
        # Another receive buffer of the same shape is another prepared call: the replay above, whose peers are
        # constants, never launches on this one's.
        other = torch.zeros_like(recv)
        ctx = handle.recv_context
        peers = tuple(other if r == ctx.rank else peer for r, peer in enumerate(ctx.peers))
        moved = dataclasses.replace(handle, recv=other, recv_context=dataclasses.replace(ctx, peers=peers))
        for _ in range(2):
            combine(other, moved, weights)
        assert len(combine_plans) == 4  # (the ranks agreed on these arguments before: no exchange)
        for entry in launches[-2:]:
            values = [v.data_ptr() if isinstance(v, torch.Tensor) else v for value in launch_args(entry)
                      for v in (value if type(value) is tuple else (value,))]
            assert other.data_ptr() in values and recv.data_ptr() not in values, "launched on the old buffer's peers"
    finally:
        prepared.forget_prepared_calls()  # nothing prepared in this fake world serves another test


# ---------------------------------------------------------------------------
# Machine code and registry
# ---------------------------------------------------------------------------


def loads_before_first_fma(sass: list[str]) -> int:
    """Data loads a thread issues after the first cross-GPU barrier, before its first fp32 multiply(-add)."""
    barrier = next(i for i, line in enumerate(sass) if re.search(r"ATOMG.*\.SYS", line))
    start = next(i for i in range(barrier, len(sass)) if "BAR.SYNC" in sass[i])
    loads = 0
    for line in sass[start:]:
        op = re.sub(r"^@!?\w+\s+", "", line)
        if op.startswith("LDG") and "STRONG" not in op and ".128" in op:
            loads += 1
        elif op.startswith(("FFMA", "FMUL")) and loads:
            return loads
    raise AssertionError("no multiply after the barrier")


@pytest.mark.parametrize("ws", [2, 4, 8])
def test_combine_issues_every_row_load_before_its_first_multiply(ws):
    """One NVLink round trip per step: the k rows' 16-byte loads (one per rank and expert slot, masked: one of
    each rank's lands) are all issued before the first multiply, in the recipe and in the twin alike."""
    shape = (64, 4096, 2 * ws, 2, moe_op.UNIFORM)
    counts = []
    for path in COMBINE:
        with sm90.capture_launches() as launches:
            moe_op.combine_example(module(path), ws, shape=shape)
        counts.append(loads_before_first_fma(sm90.sass_instructions(launches[-1])))
    recipe, twin = counts
    assert recipe >= 2 * ws and twin >= recipe, f"ws={ws}: the recipe issues {recipe} loads first, the twin {twin}"


@pytest.mark.parametrize("path", DISPATCH + COMBINE)
def test_every_rank_compiles(path):
    """Every kernel compiles for sm_90 at every rank of a 3-rank world. The registry examples launch as rank 1,
    an int Triton specialises to a constant: indexing the peers' tuple with the rank compiled there and failed
    at ranks 0 and 2 (a tuple takes constexpr indices only)."""
    shape = (37, 129, 6, 2, moe_op.UNIFORM)
    for rank in range(3):
        example = moe_op.dispatch_example if "dispatch" in path else moe_op.combine_example
        with sm90.capture_launches() as launches:
            example(module(path), 3, shape=shape, rank=rank)
        for launch in launches:
            assert sm90.compile_sm90(launch).asm["ptx"], (path, rank, launch.kernel.fn.__name__)


def test_registry_entries():
    for name in ("moe_dispatch", "moe_combine"):
        entry = registry.get(name)
        assert list(entry.backends) == ["nccl", "triton", "helion", "copy"]  # copy: the one-GPU library column
        assert len(entry.default_shapes) == 48 and entry.shape_format == "TxHxExKxSKEW"
        assert (4096, 4096, 8, 2, 1) in entry.default_shapes and (128, 7168, 64, 8, 2) in entry.default_shapes
        # 4096 tokens x top-2 x 4096 x bf16 at 2 ranks: half of the 64 MiB of rows cross NVLink.
        assert entry.nvlink_bytes((4096, 4096, 8, 2, 1), torch.bfloat16, 2) == 32 << 20
        assert entry.floor_us((4096, 4096, 8, 2, 1), torch.bfloat16, 2) == pytest.approx((32 << 20) / 361e3 + 2.0)
    assert registry.parse_shape("4096x7168x64x8x2", "TxHxExKxSKEW") == (4096, 7168, 64, 8, 2)
    with pytest.raises(ValueError, match="divisible by the world size 3"):
        moe_op.dispatch_example(None, 3, shape=(8, 8, 4, 2, 1))
    for skew in (0, 3):
        with pytest.raises(ValueError, match="SKEW must be 1 .uniform. or 2 .Zipf., got"):
            moe_op.dispatch_example(None, 2, shape=(8, 8, 4, 2, skew))


@pytest.mark.parametrize("name", ["moe_dispatch", "moe_combine"])
def test_every_default_shape_round_trips_through_the_harness_and_the_command_line(name, monkeypatch):
    """The harness prints each shape as its row's text; ``--shapes`` with that text (registry.parse_shape, via the
    command line's own parsing) gives the shape back, and the op accepts it at every world size it divides."""
    entry = registry.get(name)
    # The harness's own formatting: run_op over every default shape, backends that refuse (no GPU here), one rank.
    monkeypatch.setattr(harness.dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(harness, "_slowest", lambda value: value)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)

    def refuse(inputs):
        raise ValueError("no GPU")

    fake = registry.Op(entry.name, entry.description, lambda *args: {}, {"nccl": lambda i: torch.ones(1),
                       "triton": refuse}, entry.default_shapes, entry.shape_format, entry.nvlink_bytes,
                       entry.floor_us)
    rows = harness.run_op(fake, entry.default_shapes, ["triton"], torch.bfloat16, harness.Settings())
    texts = [row.shape for row in rows]
    assert len(texts) == len(entry.default_shapes) and all(row.status == "error (no GPU)" for row in rows)
    assert [registry.parse_shape(t, entry.shape_format) for t in texts] == entry.default_shapes
    assert parse_args([name, "--shapes", *texts]).shapes == entry.default_shapes
    assert "4096x4096x8x2x1" in texts and "128x7168x64x8x2" in texts
    for shape in entry.default_shapes:
        for ws in (2, 4, 8):
            moe_op.check_shape(shape, ws)


def test_routing_draws_distinct_experts_and_skews():
    ids = moe_op.routing(4096, 64, 8, moe_op.ZIPF, seed=3)
    assert ids.shape == (4096, 8) and all(len(set(row)) == 8 for row in ids.tolist()[:100])
    load = torch.bincount(ids.flatten(), minlength=64)
    assert load[0] > 3 * load.float().mean() and load[-1] < load.float().mean()
    uniform = torch.bincount(moe_op.routing(4096, 8, 2, moe_op.UNIFORM, seed=3).flatten(), minlength=8).float()
    assert uniform.max() < 1.2 * uniform.mean()
    assert torch.equal(moe_op.routing(16, 8, 2, 1, seed=5), moe_op.routing(16, 8, 2, 1, seed=5))


def test_eager_path_regrouping_round_trips():
    chunks = [[2, 0, 1], [1, 3, 0]]  # (rank s, expert e) chunk sizes
    rows = torch.arange(7.0)[:, None]
    expert_major = moe_op.rank_major_to_expert_major(rows, chunks)
    # rank-major: s0e0 = [0, 1], s0e2 = [2], s1e0 = [3], s1e1 = [4, 5, 6]; expert-major: e0 (s0, s1), e1, e2.
    assert expert_major.flatten().tolist() == [0, 1, 3, 4, 5, 6, 2]
    assert torch.equal(moe_op.expert_major_to_rank_major(expert_major, chunks), rows)


class ThreadWorld:
    """``world_size`` ranks as threads of this process: ``all_to_all_single`` exchanges through a shared box."""

    def __init__(self, world_size: int):
        import threading

        self.world_size, self.box, self.local = world_size, {}, threading.local()
        self.barrier = threading.Barrier(world_size)

    def get_world_size(self, group=None):
        return self.world_size

    def get_rank(self, group=None):
        return self.local.rank

    def all_to_all_single(self, output, input, output_split_sizes=None, input_split_sizes=None, group=None):
        splits = input_split_sizes or [input.shape[0] // self.world_size] * self.world_size
        self.box[self.local.rank] = input.split(list(splits))
        self.barrier.wait()
        output.copy_(torch.cat([self.box[s][self.local.rank] for s in range(self.world_size)]))
        self.barrier.wait()

    def run(self, fn):
        import concurrent.futures

        def as_rank(rank):
            self.local.rank = rank
            return fn(rank)

        with concurrent.futures.ThreadPoolExecutor(self.world_size) as pool:
            return list(pool.map(as_rank, range(self.world_size)))


@pytest.mark.parametrize("ws,shape", [(2, (37, 16, 4, 2, 1)), (3, (100, 8, 6, 3, 2)), (8, (64, 4, 64, 8, 2)),
                                      (8, (50, 4, 8, 8, 1))])
def test_eager_baseline_matches_the_reference(ws, shape, monkeypatch):
    """The NCCL baseline (Megatron's permute + all_to_all_single + regroup, and back) gives the recipes' layout
    row for row and the reference combine: the benchmark compares them directly."""
    world = ThreadWorld(ws)
    for name in ("get_world_size", "get_rank", "all_to_all_single"):
        monkeypatch.setattr(moe_op.dist, name, getattr(world, name))
    num_tokens, hidden, num_experts, top_k, skew = shape
    all_ids = [moe_op.routing(num_tokens, num_experts, top_k, skew, 10 + r) for r in range(ws)]
    all_tokens = [torch.randn(num_tokens, hidden) for _ in range(ws)]
    books = [moe_op.bookkeeping(all_ids, r, num_experts) for r in range(ws)]
    capacity = books[0]["capacity"]
    assert all(b["capacity"] == capacity for b in books)
    ref = D.reference_slots(all_ids, num_experts, capacity)
    assert sum(ref["dropped"]) == 0 and capacity >= max(b["recv_rows"] for b in books)

    def dispatch(rank):
        return moe_op.nccl_dispatch({**books[rank], "tokens": all_tokens[rank], "expert_ids": all_ids[rank]})

    received = world.run(dispatch)
    for rank in range(ws):
        rows, _, _ = D.reference_dispatch(all_tokens, all_ids, num_experts, capacity, rank)
        assert torch.equal(received[rank], rows) and rows.shape[0] == books[rank]["recv_rows"], rank
    expert_out = [x * 2 for x in received]
    weights = [torch.rand(num_tokens, top_k) for _ in range(ws)]

    def combine(rank):
        return moe_op.nccl_combine({**books[rank], "tokens": all_tokens[rank], "expert_ids": all_ids[rank],
                                    "expert_out": expert_out[rank], "weights": weights[rank]})

    combined = world.run(combine)
    padded = [torch.cat([x, x.new_zeros(capacity - x.shape[0], hidden)]) for x in expert_out]
    for rank in range(ws):
        expected = C.reference_combine(padded, ref["slots"], weights[rank], rank, capacity)
        torch.testing.assert_close(combined[rank], expected, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(combined[rank], all_tokens[rank] * 2 * weights[rank].sum(1, keepdim=True),
                                   rtol=1e-5, atol=1e-5)
