"""GPU tests of MoE dispatch and combine, the recipes and their Helion twins (one process per GPU).

One spawn per backend (the installed pair, ``kraken.moe_dispatch`` / ``moe_combine``, or the twins',
``helion_ports.``) runs every check: on fresh random tokens and routing (all-gathered, so every rank
builds the exact reference with plain torch, ``reference_slots`` / ``reference_dispatch`` /
``reference_combine``), for each dtype and for odd, skewed (most experts empty) and large-hidden cases:
the handle's slots, counts and offsets equal the reference, the received rows equal it bitwise and no other
row of the NaN-poisoned receive buffer is written; combine of the identity expert gives the tokens scaled by
their summed weights, combine of another expert output (an ordinary tensor) the reference. Then: capacity
overflow (reported on the device, ``check`` raising on every rank, the rows that fit still right), bad input
on one rank (expert ids out of range: ``check`` raises on every rank; a wrong dtype: every rank raises before
any launch) with the group working afterwards, a CUDA graph of dispatch + combine replayed on new routing,
and 600 back-to-back dispatch + combine rounds on rotating inputs. Each recipe and twin file runs its own
``main`` under ``torchrun``.
"""

from __future__ import annotations

import importlib

import pytest
import torch
import torch.distributed as dist

from gpu_utils import POISON, assert_close, heartbeat, needs_gpus, run_on_gpus

pytestmark = needs_gpus

MODULES = {"triton": "kraken", "helion": "helion_ports"}  # the packages whose installed pair each backend runs


def load(backend: str):
    package = importlib.import_module(MODULES[backend])
    return package.moe_dispatch, package.moe_combine


def check(handle) -> None:
    """The installed pair's status check (a collective: raises on every rank)."""
    importlib.import_module("kraken.runtime.moe").check(handle)


def gather(x: torch.Tensor) -> list[torch.Tensor]:
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, x.contiguous())
    return parts


def routing(seed: int, tokens: int, experts: int, top_k: int, kind: str) -> torch.Tensor:
    """This rank's ``[T, k]`` ids: "uniform", "zipf", or "few" (only experts 0..top_k+1 used: most are empty)."""
    gen = torch.Generator().manual_seed(seed * 97 + dist.get_rank())
    if kind == "few":
        weights = torch.zeros(experts)
        weights[:min(experts, top_k + 2)] = 1.0
    elif kind == "zipf":
        weights = 1.0 / torch.arange(1, experts + 1, dtype=torch.float32)
    else:
        weights = torch.ones(experts)
    return torch.multinomial(weights.expand(tokens, experts), top_k, generator=gen).cuda()


def inputs(seed: int, tokens: int, hidden: int, experts: int, top_k: int, kind: str, dtype: torch.dtype):
    gen = torch.Generator(device="cuda").manual_seed(seed * 97 + dist.get_rank())
    x = torch.randn(tokens, hidden, generator=gen, device="cuda").to(dtype)
    w = torch.rand(tokens, top_k, generator=gen, device="cuda")
    return x, routing(seed, tokens, experts, top_k, kind), w


def expected(x, ids, w, recv_like, experts: int, capacity: int):
    """Every rank's routing and tokens all-gathered; this rank's reference bookkeeping and received rows."""
    from kraken.comm.moe_dispatch import reference_dispatch, reference_slots

    all_ids, all_x = gather(ids), gather(x)
    ref = reference_slots([i.cpu() for i in all_ids], experts, capacity)
    rows, _, _ = reference_dispatch(all_x, all_ids, experts, capacity, dist.get_rank())
    return ref, rows


def check_dispatch(what, recv, counts, handle, ref, rows, capacity):
    rank = dist.get_rank()
    assert torch.equal(handle.slots.cpu(), ref["slots"][rank]), f"{what}: slots differ from the reference"
    assert counts.tolist() == ref["recv_counts"][rank].tolist(), f"{what}: recv_counts {counts.tolist()}"
    assert handle.recv_offsets.tolist() == ref["recv_offsets"][rank].tolist(), f"{what}: recv_offsets"
    assert handle.status.tolist() == [ref["dropped"][rank], ref["bad"][rank]], f"{what}: status {handle.status}"
    used = min(rows.shape[0], capacity)
    assert torch.equal(recv[:used], rows[:used]), f"{what}: received rows differ from the reference"
    assert torch.isnan(recv[used:].float()).all(), f"{what}: rows past the received ones were written"


def combine_reference(expert_out, handle, ref, w, capacity):
    from kraken.comm.moe_combine import reference_combine

    return reference_combine(gather(expert_out), [s.cuda() for s in ref["slots"]], w, dist.get_rank(), capacity)


# (tokens, hidden, experts per rank, top-k, routing, capacity: None = default, or a factor of T * k)
CASES = [
    (1, 1, 1, 1, "uniform", None),
    (37, 129, 2, 2, "uniform", None),
    (300, 1000, 8, 4, "few", "all"),  # most experts receive nothing (capacity: every pair fits)
    (257, 7168, 8, 8, "zipf", None),
    (1000, 2048, 4, 2, "zipf", 0.5),  # past capacity: the owner of the first experts drops rows
]


def correctness(backend: str) -> None:
    dispatch, combine = load(backend)
    ws, seed = dist.get_world_size(), 0
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        for tokens, hidden, per_rank, top_k, kind, factor in CASES:
            seed += 1
            experts = per_rank * ws
            top_k = min(top_k, experts)
            capacity = {None: None, "all": ws * tokens * top_k}.get(factor) if not isinstance(factor, float) else (
                max(1, int(factor * tokens * top_k)))
            what = f"{backend} {dtype} T={tokens} H={hidden} E={experts} k={top_k} {kind} capacity={capacity}"
            heartbeat(what)
            x, ids, w = inputs(seed, tokens, hidden, experts, top_k, kind, dtype)
            recv, _, handle = dispatch(x, ids, experts, capacity=capacity)  # finds (or allocates) the buffer
            torch.cuda.synchronize()
            dist.barrier()
            recv.fill_(POISON)  # no peer touches it between calls
            torch.cuda.synchronize()
            dist.barrier()
            recv, counts, handle = dispatch(x, ids, experts, capacity=capacity)
            torch.cuda.synchronize()
            ref, rows = expected(x, ids, w, recv, experts, handle.capacity)
            check_dispatch(what, recv, counts, handle, ref, rows, handle.capacity)

            # Identity expert: recv itself (zero copy). Every pair kept: the tokens times their summed weights.
            out = combine(recv, handle, w)
            torch.cuda.synchronize()
            assert_close(out, combine_reference(recv, handle, ref, w, handle.capacity), f"{what}: identity combine")
            if sum(ref["dropped"]) == 0:
                assert_close(out, (x.float() * w.sum(1, keepdim=True)).to(dtype), f"{what}: tokens x summed weights")
            else:
                with pytest.raises(ValueError, match="dropped past capacity"):
                    check(handle)
            # Another expert: an ordinary tensor, copied into the receive buffer by the combine.
            expert_out = torch.nan_to_num(recv.float() * 2 + 1, nan=0.0).to(dtype)
            out = combine(expert_out, handle, w)
            torch.cuda.synchronize()
            assert_close(out, combine_reference(expert_out, handle, ref, w, handle.capacity), f"{what}: combine")


def overflow_and_bad_input(backend: str) -> None:
    """Capacity overflow and out-of-range ids are reported on the device and raise on every rank through
    ``check``; a wrong dtype on one rank raises on every rank before any launch; the group works afterwards."""
    dispatch, combine = load(backend)
    ws, rank = dist.get_world_size(), dist.get_rank()
    experts = 2 * ws
    heartbeat(f"{backend} overflow")
    x, ids, w = inputs(500, 64, 256, experts, 2, "uniform", torch.bfloat16)
    ids = torch.zeros_like(ids)  # every pair to expert 0 (rank 0): 64 * 2 * ws rows for capacity 100
    recv, counts, handle = dispatch(x, ids, experts, capacity=100)
    with pytest.raises(ValueError, match=r"rank 0: 28 \(token, expert\) pairs dropped past capacity 100"):
        check(handle)
    if rank == 0:
        assert counts.tolist()[0] == 100, counts
    with pytest.raises(ValueError, match="dropped past capacity"):
        dispatch(x, ids, experts, capacity=100, check_status=True)

    heartbeat(f"{backend} bad ids")
    x, ids, w = inputs(501, 65, 256, experts, 2, "uniform", torch.bfloat16)
    last = dist.get_world_size() - 1  # the rank that alone passes bad input
    if rank == last:
        ids[3, 1] = experts + 3  # out of range on the last rank alone; -1 (no expert) is allowed anywhere
    ids[0, 0] = -1
    recv, counts, handle = dispatch(x, ids, experts)
    with pytest.raises(ValueError, match=rf"rank {last}: 1 expert ids outside \[-1, {experts}\)"):
        check(handle)
    ref, rows = expected(x, ids, w, recv, experts, handle.capacity)
    used = min(rows.shape[0], handle.capacity)
    assert torch.equal(recv[:used], rows[:used]), "rows of the valid ids"
    assert torch.equal(handle.slots.cpu(), ref["slots"][rank])

    heartbeat(f"{backend} wrong dtype")
    x, ids, w = inputs(502, 66, 256, experts, 2, "uniform", torch.bfloat16)  # a signature no call used yet
    with pytest.raises(ValueError, match=f"bad input on rank {last}: expert_ids has dtype float32"):
        dispatch(x, ids.float() if rank == last else ids, experts)
    with pytest.raises(ValueError, match=f"bad input on rank {last}: tokens has dtype int32"):
        dispatch(x.int() if rank == last else x, ids, experts, capacity=7)
    with pytest.raises(ValueError, match=f"bad input on rank {last}: weights has dtype int64"):
        recv, _, handle = dispatch(x, ids, experts, capacity=300)
        combine(recv, handle, w.long() if rank == last else w)
    recv, counts, handle = dispatch(x, ids, experts, capacity=300)
    out = combine(recv, handle, w)
    torch.cuda.synchronize()
    assert_close(out, (x.float() * w.sum(1, keepdim=True)).to(x.dtype), f"{backend}: after the errors")
    check(handle)


def cuda_graph_and_stress(backend: str) -> None:
    dispatch, combine = load(backend)
    ws = dist.get_world_size()
    tokens, hidden, experts, top_k, dtype = 200, 512, 4 * ws, 4, torch.bfloat16
    sets = [inputs(700 + s, tokens, hidden, experts, top_k, "zipf" if s % 2 else "uniform", dtype) for s in range(10)]
    # Per set: the reference combine of the identity expert with a fixed capacity large enough for any routing.
    capacity = ws * tokens * top_k
    refs = [(x.float() * w.sum(1, keepdim=True)).to(dtype) for x, _, w in sets]

    heartbeat(f"{backend} graph")
    x0, ids0, w0 = (t.clone() for t in sets[0])
    recv, _, handle = dispatch(x0, ids0, experts, capacity=capacity)  # warm-up (and agreement) before capture
    eager = combine(recv, handle, w0).clone()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        recv, counts, handle = dispatch(x0, ids0, experts, capacity=capacity)
        static_out = combine(recv, handle, w0)
    for i in range(20):
        x, ids, w = sets[i % 10]
        x0.copy_(x), ids0.copy_(ids), w0.copy_(w)
        static_out.fill_(POISON)
        graph.replay()
        torch.cuda.synchronize()
        expected_out = eager if i % 10 == 0 else refs[i % 10]
        assert_close(static_out, expected_out, f"{backend} graph replay {i}")
        if i % 10 == 0:
            assert torch.equal(static_out, eager), f"{backend} graph replay {i} differs from eager"
        if i < 3:
            ref, rows = expected(x, ids, w, recv, experts, capacity)
            assert torch.equal(handle.slots.cpu(), ref["slots"][dist.get_rank()]), f"graph replay {i}: slots"
            assert counts.tolist() == ref["recv_counts"][dist.get_rank()].tolist()
    heartbeat(f"{backend} graph done")

    outs = []
    for i in range(600):
        x, ids, w = sets[i % 10]
        recv, _, handle = dispatch(x, ids, experts, capacity=capacity)
        outs.append(combine(recv, handle, w))
        if i % 100 == 99:
            heartbeat(f"{backend} round {i + 1}")
            torch.cuda.synchronize()
            for k, out in enumerate(outs):
                assert_close(out, refs[(i + 1 - len(outs) + k) % 10], f"{backend} round {i + 1 - len(outs) + k}")
            outs = []
    # Those dispatches, on the same inputs every tenth call, ran from CUDA graphs (graphs.graphed) once warm.
    graphs = importlib.import_module("kraken.runtime.graphs")._graphs
    assert any(isinstance(e, torch.cuda.CUDAGraph) and key[1] in {x.data_ptr() for x, _, _ in sets}
               for key, e in graphs.items()), f"{backend}: no dispatch was replayed from a graph"


def worker(backend: str) -> None:
    correctness(backend)
    overflow_and_bad_input(backend)
    cuda_graph_and_stress(backend)


@pytest.mark.parametrize("backend", list(MODULES))
def test_moe_dispatch_and_combine(backend):
    run_on_gpus(worker, backend, name=f"moe {backend}")
