"""GPU tests of all-gather + matmul, its Helion twin, and the copy-engine all-gather under them.

One spawn per backend runs every check: float64 reference on odd and default-class shapes (M the
rows per rank here), bf16 and fp16, b row-major, transposed and strided, into NaN-poisoned outputs;
the returned gathered ``a`` equal to every rank's rows exactly; 200 back-to-back launches alternating
shapes; CUDA-graph replays equal to eager; bad input raising on every rank. A third spawn checks
``all_gather_with_progress`` alone: every row exact and every flag set once it has returned.
"""

from __future__ import annotations

import functools
import importlib

import pytest
import torch
import torch.distributed as dist

from benchmark.ops.all_gather_matmul import rank_operands
from gpu_utils import POISON, TOLERANCE, check_graph_replays, heartbeat, needs_gpus, rel_err, run_on_gpus
from kraken.runtime import crossover, gather_matmul, graphs

OP = "all_gather_matmul"

pytestmark = needs_gpus

MODULES = {  # the recipe and its twin (``launch``, the plain function)
    "triton": "kraken.fused.all_gather_matmul",
    "helion": "helion_ports.fused.all_gather_matmul",
}
PACKAGES = {"triton": "kraken", "helion": "helion_ports"}  # the installed functions
BF16, FP16 = torch.bfloat16, torch.float16
# (rows per rank, N, K). Odd: one row per rank; tails everywhere, N or K not multiples of 8 (the padded
# operands); a chunk end inside a tile. Classes: the 128x128 and 128x256 tiles.
ODD_SHAPES = ((1, 8, 16), (37, 100, 72), (129, 257, 130), (300, 1000, 520))
CLASS_SHAPES = ((128, 4096, 1024), (1024, 4096, 1024))
STRESS_SHAPES = ((64, 1024, 512), (300, 2048, 256))


def reference(shape, dtype, seed: int, world_size: int, b: torch.Tensor | None = None) -> torch.Tensor:
    """all_gather(a) @ b in float64, every rank's rows rebuilt from their seeds."""
    rows = torch.cat([rank_operands(shape, dtype, seed, r, 1)[0] for r in range(world_size)])
    b = rank_operands(shape, dtype, seed, 0, 1)[1] if b is None else b
    return rows.double() @ b.double()


def operands(shape, dtype, seed: int):
    """This rank's [M, K] rows and the shared b (``rank_operands`` takes total rows: M x world size)."""
    m, n, k = shape
    a, _ = rank_operands(shape, dtype, seed, dist.get_rank(), 1)
    return a, rank_operands(shape, dtype, seed, 0, 1)[1]


def check(out: torch.Tensor, ref: torch.Tensor, what: str) -> None:
    assert out.shape == ref.shape, f"{what}: shape {tuple(out.shape)} != {tuple(ref.shape)}"
    assert not torch.isnan(out).any(), f"{what}: NaN in the output (an element was never written?)"
    err = rel_err(out, ref)
    assert err <= TOLERANCE[out.dtype], f"{what}: relative error {err:.2e} > {TOLERANCE[out.dtype]:.0e}"


def launch_into(module, a, b, out: torch.Tensor, **config) -> torch.Tensor:
    """The public call's own prepare and the recipe's (or twin's) launch, but into a caller-owned (poisoned) output."""
    ctx, cfg = gather_matmul.prepare(a, b, None, "test", config, False)
    return module.launch(a, b, signal_pad_ptrs=ctx.signal_pad_ptrs, rank=ctx.rank, **cfg, out=out, a_out=None,
                         group_name=ctx.group_name)


def all_rows(a: torch.Tensor) -> list[torch.Tensor]:
    """Every rank's ``a``, by NCCL."""
    rows = [torch.empty_like(a) for _ in range(dist.get_world_size())]
    dist.all_gather(rows, a)
    return rows


def layouts(b: torch.Tensor, which: str) -> torch.Tensor:
    """The same values of b stored row-major, transposed (``w.t()``) or strided (every other column of a wider one)."""
    if which == "transposed":
        return b.t().contiguous().t()
    if which == "strided":
        wide = torch.full((b.shape[0], 2 * b.shape[1]), POISON, dtype=b.dtype, device=b.device)
        wide[:, ::2] = b
        return wide[:, ::2]
    return b


def correctness(backend: str, module, fn) -> None:
    world_size, seed = dist.get_world_size(), 0
    cases = [(s, d, "row-major", {}) for s in ODD_SHAPES for d in (BF16, FP16)]
    cases += [(s, BF16, "row-major", {}) for s in CLASS_SHAPES]
    cases += [(ODD_SHAPES[2], BF16, "transposed", {}), (CLASS_SHAPES[0], BF16, "transposed", {}),
              (ODD_SHAPES[1], FP16, "strided", {})]
    for shape, dtype, layout, config in cases:
        seed += 1
        what = f"{backend} {'x'.join(map(str, shape))} {dtype} b {layout} {config}"
        heartbeat(what)
        a, b = operands(shape, dtype, seed)
        b = layouts(b, layout)
        out = torch.full((world_size * shape[0], shape[1]), POISON, dtype=dtype, device="cuda")
        launch_into(module, a, b, out, **config)
        gathered, public = fn(a, b, return_a=True, **config)
        torch.cuda.synchronize()
        ref = reference(shape, dtype, seed, world_size)
        check(out, ref, what)
        assert torch.equal(public, out), f"{what}: the public call and launch() disagree"
        assert torch.equal(gathered, torch.cat(all_rows(a))), f"{what}: the returned gathered a is not every rank's rows"


def stress_and_cuda_graph(backend: str, module, fn) -> None:
    """200 back-to-back launches on rotating inputs, alternating shapes and the returned gathered ``a`` (a shard
    overwritten while a peer still copies it, or a flag left over from the previous launch, shows up here), then
    CUDA-graph capture and 20 replays against eager, bitwise (with and without ``return_a``: in a group of one, my
    rows are staged only for that copy)."""
    world_size = dist.get_world_size()
    shapes = [STRESS_SHAPES[s % 2] for s in range(6)]
    inputs = [operands(shape, BF16, 100 + s) for s, shape in enumerate(shapes)]
    refs = [reference(shape, BF16, 100 + s, world_size) for s, shape in enumerate(shapes)]
    outs = [torch.full((world_size * shape[0], shape[1]), POISON, dtype=BF16, device="cuda") for shape in shapes]
    for i in range(200):
        a, b = inputs[i % 6]
        if i % 6 == 3:
            gathered, public = fn(a, b, return_a=True)
            outs[i % 6].copy_(public)
            assert torch.equal(gathered, torch.cat(all_rows(a))), f"{backend} launch {i}: the returned gathered a"
        else:
            launch_into(module, a, b, outs[i % 6])
        if i % 50 == 49:
            heartbeat(f"{backend} launch {i + 1}")
            torch.cuda.synchronize()
            for k in range(6):
                check(outs[k], refs[k], f"{backend} after {i + 1} launches (slot {k}, {shapes[k]})")
                outs[k].fill_(POISON)
    # The public calls among them ran from a CUDA graph after the first call of each shape.
    assert any(isinstance(e, torch.cuda.CUDAGraph) for e in graphs._graphs.values()), (
        f"{backend}: nothing replayed from a graph")

    slots = range(0, 6, 2)  # the graph replays one shape
    eager = {k: fn(*inputs[k]) for k in slots}
    static_a, static_b = (t.clone() for t in inputs[0])
    fn(static_a, static_b)  # warm-up before capture
    fn(static_a, static_b, return_a=True)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = fn(static_a, static_b)
        static_gathered, static_out_ra = fn(static_a, static_b, return_a=True)
    for i in range(20):
        k = slots[i % len(slots)]
        static_a.copy_(inputs[k][0])
        static_b.copy_(inputs[k][1])
        static_out.fill_(POISON)
        static_out_ra.fill_(POISON)
        static_gathered.fill_(POISON)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(static_out, eager[k]), f"{backend} graph replay {i} differs from eager"
        assert torch.equal(static_out_ra, eager[k]), f"{backend} graph replay {i} (return_a) differs from eager"
        assert torch.equal(static_gathered, torch.cat(all_rows(static_a))), f"{backend} graph replay {i}: gathered a"
    heartbeat(f"{backend} graph replays done")


def new_addresses(backend: str, fn) -> None:
    """A model's calls: every call a new ``a`` (earlier ones kept alive, so no address comes back), one of three
    weights in turn, b transposed for one of them, ``return_a`` on every third call; each output (and gathered
    ``a``) checked. They run in pieces (``gather_matmul.in_pieces``): no graph is captured for their addresses, and
    above one rank the exchange is one graph of the prepared call, replayed on every call."""
    world_size, shape = dist.get_world_size(), STRESS_SHAPES[0]
    weights = [operands(shape, BF16, 500 + w)[1] for w in range(3)]
    weights[2] = weights[2].t().contiguous().t()  # strides (1, K): read in place, transposed
    before, kept = set(graphs._graphs), []
    for i in range(12):
        seed, b = 510 + i, weights[i % 3]
        a = operands(shape, BF16, seed)[0]
        heartbeat(f"{backend} new addresses call {i}")
        result = fn(a, b, return_a=i % 3 == 1)
        gathered, out = result if i % 3 == 1 else (None, result)
        torch.cuda.synchronize()
        check(out, reference(shape, BF16, seed, world_size, b), f"{backend} new addresses call {i}")
        if gathered is not None:
            assert torch.equal(gathered, torch.cat(all_rows(a))), f"{backend} new addresses call {i}: gathered a"
        kept.append((a, out))
    new_keys = set(graphs._graphs) - before
    assert all(isinstance(key[0], tuple) and key[0][0] == "gather" for key in new_keys), (
        f"{backend}: graphs kept for new address sets: {len(new_keys)}")
    exchanges = [e for key, e in graphs._graphs.items() if isinstance(key[0], tuple) and key[0][0] == "gather"]
    assert any(isinstance(e, torch.cuda.CUDAGraph) for e in exchanges), f"{backend}: no exchange graph kept"


def bad_input(backend: str, module, fn) -> None:
    rank = dist.get_rank()
    if dist.get_world_size() > 1:  # a group of one cannot disagree
        # Ranks disagreeing on M (fresh shapes, so this is the first use): every rank raises, nothing hangs.
        a, b = operands((40 + rank, 48, 32), BF16, 7)
        with pytest.raises(ValueError, match="ranks disagree"):
            fn(a, b)
    a, b = operands((44, 48, 32), BF16, 7)
    with pytest.raises(TypeError, match="unknown config"):
        fn(a, b, bogus=1)
    with pytest.raises(ValueError, match="inner dimensions differ"):
        fn(a, b.t().contiguous())
    # One rank alone passes a bad dtype: both raise (the first call of this signature is agreed).
    with pytest.raises((ValueError, TypeError)):
        fn(a if rank else a.float(), b if rank else b.float())
    # The group still works after all that.
    out = fn(a, b)
    torch.cuda.synchronize()
    check(out, reference((44, 48, 32), BF16, 7, dist.get_world_size()), f"{backend} after bad input")
    heartbeat(f"{backend} bad input done")


def replayed_front_door(backend: str, fn) -> None:
    """The public call, repeated on the same tensors (its output freed between calls, so torch's allocator gives the
    next call the same address), runs from one CUDA graph (``graphs.graphed``) from its second call on (in a group of
    one, which has nothing to exchange, from the GEMM's replayed launch): every call still reads the values its inputs
    hold then."""
    world_size, shape = dist.get_world_size(), STRESS_SHAPES[1]
    a, b = operands(shape, BF16, 400)
    for i in range(6):
        seed = 400 + i // 2  # new values every other call, at the same addresses
        heartbeat(f"{backend} front door call {i}")
        a.copy_(operands(shape, BF16, seed)[0])
        out = fn(a, b)
        torch.cuda.synchronize()
        check(out, reference(shape, BF16, seed, world_size, b), f"{backend} front door call {i}")
        out.fill_(POISON)  # a replay must write every element again
        del out
    graphed = any(isinstance(e, torch.cuda.CUDAGraph) and key[1:2] == (a.data_ptr(),)
                  for key, e in graphs._graphs.items())
    assert graphed == (world_size > 1), f"{backend}: the front door's calls graphed: {graphed} at {world_size} ranks"


def sequential_form(backend: str, fn) -> None:
    """The sequential form (``crossover``: the SM all-gather, then cuBLAS), what the recipe runs below its
    crossover at more than one rank: against float64 on odd shapes, with ``return_a``, and replayed from a CUDA
    graph bitwise against eager."""
    world_size = dist.get_world_size()
    for seed, shape in enumerate(ODD_SHAPES[1:], start=900):
        what = f"{backend} sequential {'x'.join(map(str, shape))}"
        heartbeat(what)
        a, b = operands(shape, BF16, seed)
        gathered, out = fn(a, b, return_a=True, form="sequential")
        torch.cuda.synchronize()
        check(out, reference(shape, BF16, seed, world_size), what)
        assert torch.equal(gathered, torch.cat(all_rows(a))), f"{what}: the returned gathered a"
        if world_size > 1 and shape[0] * world_size < crossover.fused_from(OP, world_size):
            assert torch.equal(fn(a, b), out), f"{what}: the form chosen by size is not the sequential one"
    inputs = [operands(STRESS_SHAPES[1], BF16, seed) for seed in (950, 951)]
    check_graph_replays(f"{backend} sequential", fn, inputs, [0, 1], form="sequential")


def plain_function(backend: str, module) -> None:
    """The recipe's (or twin's) plain host function, with its gathered ``a``, against float64 on odd shapes."""
    world_size = dist.get_world_size()
    for seed, shape in enumerate(ODD_SHAPES, start=700):
        what = f"{backend} plain {'x'.join(map(str, shape))}"
        heartbeat(what)
        a, b = operands(shape, BF16, seed)
        gathered, out = module.all_gather_matmul(a, b, return_a=True)
        torch.cuda.synchronize()
        check(out, reference(shape, BF16, seed, world_size), what)
        assert torch.equal(gathered, torch.cat(all_rows(a))), f"{what}: the returned gathered a"


def worker(backend: str) -> None:
    module = importlib.import_module(MODULES[backend])
    public = importlib.import_module(PACKAGES[backend]).all_gather_matmul
    plain_function(backend, module)
    sequential_form(backend, public)
    fn = functools.partial(public, form="fused")  # the fused kernel, at every size
    correctness(backend, module, fn)
    stress_and_cuda_graph(backend, module, fn)
    replayed_front_door(backend, fn)
    new_addresses(backend, fn)
    bad_input(backend, module, fn)


@pytest.mark.parametrize("backend", list(MODULES))
def test_all_gather_matmul(backend):
    run_on_gpus(worker, backend, name=f"all_gather_matmul {backend}")


def gather_worker() -> None:
    import kraken
    from kraken import all_gather_with_progress

    rank, world_size = dist.get_rank(), dist.get_world_size()
    for rows, cols, dtype in ((1, 8, BF16), (333, 1000, FP16), (4096, 1024, BF16)):
        heartbeat(f"gather {rows}x{cols}")
        shard = kraken.symm_empty((rows, cols), dtype)
        for launch in range(3):
            shard.copy_(torch.randn(rows, cols, device="cuda").to(dtype) + 100 * rank + launch)
            out = torch.full((world_size * rows, cols), POISON, dtype=dtype, device="cuda")
            started = all_gather_with_progress(shard, out=out)
            started.wait()
            torch.cuda.synchronize()
            expected = [torch.empty_like(shard) for _ in range(world_size)]
            dist.all_gather(expected, shard)
            assert torch.equal(out, torch.cat(expected)), f"gather {rows}x{cols} launch {launch}: rows differ"
            assert started.progress.tolist() == [1] * world_size, f"flags after the gather: {started.progress.tolist()}"
            assert started.order[0] == rank and sorted(started.order) == list(range(world_size))
    # Calls on the same buffers run from two graphs (``graphs.ForkedGraph``) from the second on: each gathers what the
    # shards hold after the current stream's slow write, and writes every flag again.
    from kraken.runtime.progress import OP

    shard = kraken.symm_empty((64, 256), BF16)
    out = torch.empty((world_size * 64, 256), dtype=BF16, device="cuda")
    progress = torch.empty(world_size, dtype=torch.int32, device="cuda")
    for launch in range(8):
        out.fill_(POISON)
        progress.fill_(-5)
        torch.cuda._sleep(1_000_000)  # (about half a millisecond) before the shard's new values
        shard.copy_(torch.randn(64, 256, device="cuda").to(BF16) + 100 * rank + launch)
        started = all_gather_with_progress(shard, out=out, progress=progress)
        started.wait()
        torch.cuda.synchronize()
        expected = [torch.empty_like(shard) for _ in range(world_size)]
        dist.all_gather(expected, shard)
        assert torch.equal(out, torch.cat(expected)), f"repeated gather {launch}: rows differ"
        assert progress.tolist() == [1] * world_size, f"repeated gather {launch}: flags {progress.tolist()}"
    assert any(key[0] == OP and isinstance(e, graphs.ForkedGraph) for key, e in graphs._graphs.items()), (
        "the repeated gathers did not run from their graphs")
    heartbeat("gather done")


def test_all_gather_with_progress():
    run_on_gpus(gather_worker, name="all_gather_with_progress")
