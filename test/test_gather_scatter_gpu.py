"""GPU tests of reduce-scatter and all-gather, the recipes and their Helion twins (one process per GPU).

One spawn per backend runs every check, to keep the file to a couple of minutes: each dtype and odd
shapes (M = ws * 1, ws * 37 x 3, ws * 1000 x 129, ws * 3000 x 1111) on fresh random inputs into
NaN-poisoned outputs, against a float64 reference and bitwise (the reduce-scatter against an fp32
rank-order sum rounded once, the all-gather against the exact inputs), the public call equal to
prepare/launch; 1000 back-to-back launches of each on rotating inputs; CUDA-graph replays equal to
eager; bad input raising on every rank with the group still working afterwards.
"""

from __future__ import annotations

import importlib

import pytest
import torch
import torch.distributed as dist

from kraken.runtime import collectives
from gpu_utils import DTYPES, POISON, assert_close, heartbeat, needs_gpus, run_on_gpus

pytestmark = needs_gpus

MODULES = {
    "triton": ("kraken.comm.reduce_scatter", "kraken.comm.all_gather"),
    "helion": ("helion_ports.comm.reduce_scatter", "helion_ports.comm.all_gather"),
}
# Rows per rank and inner dims: the reduce-scatter's input is [ws * rows, *inner], the all-gather's shard
# [rows, *inner]. One element (size-1 specialisation), unaligned shards, an aligned one, and one large
# enough that every block loops over several steps and ends mid-step.
CASES = ((1,), (37, 3), (1000, 129), (3000, 1111))
STRESS_CASE = (8191, 8)


def load(path: str):
    """The module and its installed function (``kraken.<name>`` or ``helion_ports.<name>``)."""
    top, name = path.split(".", 1)[0], path.rsplit(".", 1)[1]
    return importlib.import_module(path), getattr(importlib.import_module(top), name)


def rank_values(seed: int, rank: int, shape, dtype: torch.dtype) -> torch.Tensor:
    """Rank ``rank``'s input; any rank can regenerate any other's for the reference."""
    gen = torch.Generator(device="cuda").manual_seed(seed * 97 + rank)
    return torch.randn(shape, generator=gen, device="cuda", dtype=torch.float32).to(dtype)


def reduce_scatter_refs(seed: int, shape, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's shard of (float64 sum, fp32 rank-order sum rounded once)."""
    ws, rank = dist.get_world_size(), dist.get_rank()
    inputs = [rank_values(seed, r, shape, dtype) for r in range(ws)]
    acc = inputs[0].float()
    for x in inputs[1:]:
        acc = acc + x.float()
    rows = shape[0] // ws
    shard = slice(rank * rows, (rank + 1) * rows)
    return sum(x.double() for x in inputs)[shard], acc.to(dtype)[shard]


def all_gather_ref(seed: int, shape, dtype: torch.dtype) -> torch.Tensor:
    return torch.cat([rank_values(seed, r, shape, dtype) for r in range(dist.get_world_size())])


def launch_into(module, tensor: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """The product's prepared call (one of its own, named "test ...") and the module's launch, into a caller-owned
    (poisoned) output."""
    ctx, cfg = collectives.prepare(tensor, None, f"test {module.__name__.rsplit('.', 1)[1]}", {})
    return module.launch(ctx.peers, out, ctx.signal_pad_ptrs, ctx.rank, **cfg, group_name=ctx.group_name)


def correctness(backend: str) -> None:
    import kraken

    (rs, rs_fn), (ag, ag_fn) = (load(p) for p in MODULES[backend])
    ws, rank, seed = dist.get_world_size(), dist.get_rank(), 0
    largest = ws * max(rows for rows, *_ in CASES) * 1111
    for dtype in DTYPES:
        buf = kraken.symm_empty(largest, dtype)
        for rows, *inner in CASES:
            seed += 1
            what = f"{backend} reduce_scatter {dtype} [{ws}*{rows}, {inner}]"
            heartbeat(what)
            shape = (ws * rows, *inner)
            x = buf[:ws * rows * (inner[0] if inner else 1)].view(shape)
            x.copy_(rank_values(seed, rank, shape, dtype))
            out = torch.full((rows, *inner), POISON, dtype=dtype, device="cuda")
            launch_into(rs, x, out)
            public = rs_fn(x)
            torch.cuda.synchronize()
            ref64, ref_fp32 = reduce_scatter_refs(seed, shape, dtype)
            assert_close(out, ref64.to(dtype), what)
            assert torch.equal(out, ref_fp32), f"{what}: not bitwise the fp32 rank-order sum rounded once"
            assert torch.equal(public, out), f"{what}: the public call and launch() disagree"

            what = f"{backend} all_gather {dtype} [{rows}, {inner}]"
            heartbeat(what)
            shape = (rows, *inner)
            x = buf[:rows * (inner[0] if inner else 1)].view(shape)
            x.copy_(rank_values(seed, rank, shape, dtype))
            out = torch.full((ws * rows, *inner), POISON, dtype=dtype, device="cuda")
            launch_into(ag, x, out)
            public = ag_fn(x)
            torch.cuda.synchronize()
            ref = all_gather_ref(seed, shape, dtype)
            assert_close(out, ref, what)
            assert torch.equal(out, ref), f"{what}: not bitwise every rank's input"
            assert torch.equal(public, out), f"{what}: the public call and launch() disagree"


def stress_and_cuda_graph(backend: str) -> None:
    """1000 back-to-back launches of each op, interleaved, into 10 rotating poisoned outputs each (a barrier
    that fails to reset, or a buffer overwritten while a peer still reads it, shows up here); then each op
    captured in a CUDA graph and replayed on new inputs, equal to eager bitwise."""
    import kraken

    (rs, rs_fn), (ag, ag_fn) = (load(p) for p in MODULES[backend])
    ws, rank, dtype = dist.get_world_size(), dist.get_rank(), torch.bfloat16
    rows, inner = STRESS_CASE
    rs_shape, ag_shape = (ws * rows, inner), (rows, inner)
    rs_in, ag_in = kraken.symm_empty(rs_shape, dtype), kraken.symm_empty(ag_shape, dtype)
    rs_srcs = [rank_values(100 + s, rank, rs_shape, dtype) for s in range(10)]
    ag_srcs = [rank_values(200 + s, rank, ag_shape, dtype) for s in range(10)]
    rs_refs = [reduce_scatter_refs(100 + s, rs_shape, dtype)[1] for s in range(10)]
    ag_refs = [all_gather_ref(200 + s, ag_shape, dtype) for s in range(10)]
    rs_outs = [torch.full((rows, inner), POISON, dtype=dtype, device="cuda") for _ in range(10)]
    ag_outs = [torch.full((ws * rows, inner), POISON, dtype=dtype, device="cuda") for _ in range(10)]
    for i in range(1000):
        rs_in.copy_(rs_srcs[i % 10])
        launch_into(rs, rs_in, rs_outs[i % 10])
        ag_in.copy_(ag_srcs[i % 10])
        launch_into(ag, ag_in, ag_outs[i % 10])
        if i % 250 == 249:
            heartbeat(f"{backend} launch {i + 1}")
            torch.cuda.synchronize()
            for k in range(10):
                assert torch.equal(rs_outs[k], rs_refs[k]), f"{backend} reduce_scatter after {i + 1} launches ({k})"
                assert torch.equal(ag_outs[k], ag_refs[k]), f"{backend} all_gather after {i + 1} launches ({k})"
                rs_outs[k].fill_(POISON)
                ag_outs[k].fill_(POISON)

    for name, fn, buf, srcs, refs in (("reduce_scatter", rs_fn, rs_in, rs_srcs, rs_refs),
                                      ("all_gather", ag_fn, ag_in, ag_srcs, ag_refs)):
        static_src = srcs[0].clone()
        buf.copy_(static_src)
        eager = fn(buf).clone()  # warm-up on this stream before capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            buf.copy_(static_src)
            static_out = fn(buf)
        for i in range(20):
            static_src.copy_(srcs[i % 10])
            static_out.fill_(POISON)
            graph.replay()
            torch.cuda.synchronize()
            expected = eager if i % 10 == 0 else refs[i % 10]
            assert torch.equal(static_out, expected), f"{backend} {name} graph replay {i} differs from eager"
        heartbeat(f"{backend} {name} graph replays done")


def bad_input(backend: str) -> None:
    """Every rank raises the same error before any launch, and the group works afterwards."""
    import kraken

    (_, rs_fn), (_, ag_fn) = (load(p) for p in MODULES[backend])
    ws, rank = dist.get_world_size(), dist.get_rank()
    buf = kraken.symm_empty(4096, torch.bfloat16)
    for fn in (rs_fn, ag_fn):
        heartbeat(f"{backend} {fn.__module__} errors")
        fn(torch.randn(ws * 64, device="cuda", dtype=torch.bfloat16))  # an ordinary tensor is staged, not refused
        if ws > 1:  # ranks passing different shapes: every rank raises (first-use agreement), nothing hangs
            with pytest.raises(ValueError, match="ranks disagree"):
                fn(buf[:ws * (100 + rank)])
        with pytest.raises(ValueError, match="dtype int32"):
            fn(torch.zeros(16, dtype=torch.int32, device="cuda"))
        with pytest.raises(ValueError, match="contiguous"):
            fn(buf[:ws * 64].view(ws * 8, 8).t())
        with pytest.raises(TypeError, match="unknown config"):
            fn(buf[:ws * 64], bogus=1)
    if ws > 1:  # every M divides among one rank
        with pytest.raises(ValueError, match=rf"M = {ws * 3 + 1} is not divisible by the world size {ws}"):
            rs_fn(buf[:ws * 3 + 1])
        with pytest.raises(ValueError, match=rf"M = {ws * 3 + 1} is not divisible by the world size {ws}"):
            rs_fn(buf[:(ws * 3 + 1) * 4].view(ws * 3 + 1, 4))
    # The group still works after all that.
    x = buf[:ws * 64]
    x.fill_(rank + 1)
    reduced = rs_fn(x)
    gathered = ag_fn(x)
    torch.cuda.synchronize()
    assert torch.all(reduced == ws * (ws + 1) // 2).item()
    expected = torch.arange(1, ws + 1, device="cuda").repeat_interleave(ws * 64).to(torch.bfloat16)
    assert torch.equal(gathered, expected)


def worker(backend: str) -> None:
    correctness(backend)
    stress_and_cuda_graph(backend)
    bad_input(backend)


@pytest.mark.parametrize("backend", list(MODULES))
def test_reduce_scatter_and_all_gather(backend):
    run_on_gpus(worker, backend, name=f"reduce_scatter/all_gather {backend}")
