"""GPU tests of the all-reduce recipes and their Helion twins (one process per GPU)."""

from __future__ import annotations

import importlib

import pytest
import torch
import torch.distributed as dist

from kraken.runtime import collectives
from gpu_utils import DTYPES, POISON, assert_close, heartbeat, needs_gpus, run_on_gpus

pytestmark = needs_gpus

ODD_SIZES = (1, 7, 4095, (1 << 20) + 3)
DEFAULT_SIZES = tuple(1 << k for k in range(12, 23))
MODULES = {
    "triton_1shot": "kraken.comm.one_shot_all_reduce",
    "helion_1shot": "helion_ports.comm.one_shot_all_reduce",
    "triton_2shot": "kraken.comm.two_shot_all_reduce",
    "helion_2shot": "helion_ports.comm.two_shot_all_reduce",
}


def public(path: str):
    """The installed function of a recipe or twin module: ``kraken.<name>`` or ``helion_ports.<name>``."""
    return getattr(importlib.import_module(path.split(".", 1)[0]), path.rsplit(".", 1)[1])


def rank_input(seed: int, rank: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
    """Rank ``rank``'s input; any rank can regenerate any other's for the reference."""
    gen = torch.Generator(device="cuda").manual_seed(seed * 97 + rank)
    return torch.randn(numel, generator=gen, device="cuda", dtype=torch.float32).to(dtype)


def reference(seed: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
    return sum(rank_input(seed, r, numel, dtype).double() for r in range(dist.get_world_size()))


class Runner:
    """Calls one backend: ``step(src)`` copies ``src`` into the symmetric buffer and reduces it."""

    def __init__(self, backend: str, numel: int, dtype: torch.dtype):
        import kraken

        self.module = importlib.import_module(MODULES[backend])
        self.name = MODULES[backend].rsplit(".", 1)[1]
        self.fn = public(MODULES[backend])
        self.buf = kraken.symm_empty(numel, dtype)
        self.in_place = "2shot" in backend

    def step(self, src: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        self.buf.copy_(src)
        if out is None:
            return self.fn(self.buf)
        # One-shot into a caller-owned (poisoned) output, through the product's prepared call (one of its own,
        # named "test ...") and the module's launch.
        ctx, cfg = collectives.prepare(self.buf, None, f"test {self.name}", {})
        return self.module.launch(ctx.peers, out, ctx.signal_pad_ptrs, ctx.rank, **cfg)


def check_same_on_every_rank(out: torch.Tensor, what: str) -> None:
    gathered = [torch.empty_like(out) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, out)
    for r, other in enumerate(gathered):
        assert torch.equal(other, out), (
            f"{what}: rank {r}'s result differs bitwise from rank {dist.get_rank()}'s"
        )


def correctness_worker(backend: str) -> None:
    seed = 0
    for dtype in DTYPES:
        for numel in ODD_SIZES + DEFAULT_SIZES:
            heartbeat(f"{backend} {dtype} {numel}")
            seed += 1
            runner = Runner(backend, numel, dtype)
            what = f"{backend} {dtype} numel={numel}"
            if runner.in_place:
                out = runner.step(rank_input(seed, dist.get_rank(), numel, dtype))
            else:
                out = torch.full((numel,), POISON, dtype=dtype, device="cuda")
                runner.step(rank_input(seed, dist.get_rank(), numel, dtype), out)
                public = runner.step(rank_input(seed, dist.get_rank(), numel, dtype))
                assert torch.equal(public, out), f"{what}: public call and launch() disagree"
            torch.cuda.synchronize()
            assert_close(out, reference(seed, numel, dtype).to(dtype), what)
            check_same_on_every_rank(out, what)


def stress_worker(backend: str) -> None:
    """1000 back-to-back launches (a barrier that fails to reset shows up here), then 100 graph replays."""
    numel, dtype = 65536 + 5, torch.bfloat16
    runner = Runner(backend, numel, dtype)
    srcs = [rank_input(s, dist.get_rank(), numel, dtype) for s in range(10)]
    refs = [reference(s, numel, dtype).to(dtype) for s in range(10)]
    outs = [torch.full((numel,), POISON, dtype=dtype, device="cuda") for _ in range(10)]
    for i in range(1000):
        result = runner.step(srcs[i % 10], None if runner.in_place else outs[i % 10])
        if runner.in_place:
            outs[i % 10].copy_(result)
        if i % 100 == 99:
            heartbeat(f"{backend} launch {i + 1}")
            torch.cuda.synchronize()
            for k in range(10):
                assert_close(outs[k], refs[k], f"{backend} after {i + 1} launches (slot {k})")
                outs[k].fill_(POISON)

    static_src = torch.empty_like(srcs[0])
    static_out = torch.full((numel,), POISON, dtype=dtype, device="cuda")
    static_src.copy_(srcs[0])
    eager = runner.step(static_src).clone()  # warm-up on this stream before capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out.copy_(runner.step(static_src))
    for i in range(100):
        static_src.copy_(srcs[i % 10])
        static_out.fill_(POISON)
        graph.replay()
        torch.cuda.synchronize()
        expected = eager if i % 10 == 0 else refs[i % 10]
        assert_close(static_out, expected, f"{backend} graph replay {i}")
        if i % 10 == 0:
            assert torch.equal(static_out, eager), f"{backend} graph replay {i} differs from eager bitwise"
    heartbeat(f"{backend} graph replays done")


def errors_worker(backend: str) -> None:
    import kraken

    fn = public(MODULES[backend])
    # An ordinary (non-symmetric) tensor is staged into the recipe's workspace: the same sum.
    plain = torch.full((1024,), dist.get_rank() + 1.0, device="cuda", dtype=torch.bfloat16)
    summed = fn(plain)
    torch.cuda.synchronize()
    ws = dist.get_world_size()
    assert torch.all(summed == ws * (ws + 1) // 2).item(), f"{backend}: an ordinary input's sum"
    # Ranks passing different shapes: every rank raises (first-use agreement), nothing hangs.
    buf = kraken.symm_empty(4096, torch.bfloat16)
    if dist.get_world_size() > 1:  # a group of one always agrees with itself
        with pytest.raises(ValueError, match="ranks disagree"):
            fn(buf[: 1000 + dist.get_rank()])
    with pytest.raises(ValueError, match="dtype int32"):
        fn(torch.zeros(16, dtype=torch.int32, device="cuda"))
    with pytest.raises(ValueError, match="contiguous"):
        fn(kraken.symm_empty((64, 64), torch.bfloat16).t())
    with pytest.raises(TypeError, match="unknown config"):
        fn(buf, bogus=1)
    # The group still works after all that.
    buf.fill_(1.0)
    out = fn(buf)
    torch.cuda.synchronize()
    assert torch.all(out == dist.get_world_size()).item()


@pytest.mark.parametrize("backend", list(MODULES))
def test_all_reduce_matches_float64(backend):
    run_on_gpus(correctness_worker, backend, name=f"all_reduce {backend} correctness")


@pytest.mark.parametrize("backend", list(MODULES))
def test_all_reduce_stress_and_cuda_graph(backend):
    run_on_gpus(stress_worker, backend, name=f"all_reduce {backend} stress")


@pytest.mark.parametrize("backend", list(MODULES))
def test_all_reduce_bad_input_raises_on_every_rank(backend):
    run_on_gpus(errors_worker, backend, name=f"all_reduce {backend} errors")
