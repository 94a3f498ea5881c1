"""GPU tests of context-parallel attention and its Helion twin.

One spawn per backend runs every check: a float32 reference (attention of this rank's queries over the whole
sequence, every rank's K/V rebuilt from their seeds, the causal mask from the layout's positions) on odd
per-rank lengths (tails in every chunk, one row per rank), causal and not, GQA and MQA, head_dim 64 and 128,
bf16 and fp16, a custom scale, several flag pieces, into NaN-poisoned outputs with a NaN-poisoned gather
buffer; ``attention_on_gathered`` (the no-communication kernel) alike; 200 back-to-back launches
alternating shapes; both public calls replayed from their own graphs (new values at the same addresses) equal to
plain launches; CUDA-graph replays equal to eager; bad input raising on every rank. A third spawn checks
the benchmark's baselines (NCCL + SDPA and SDPA on gathered K/V, each on cuDNN and on flash) against the same
reference, so the harness's comparisons stand on a checked baseline.
"""

from __future__ import annotations

import functools
import importlib
import math
import types

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from benchmark.ops import context_parallel_attention as op
from benchmark.registry import REGISTRY
from benchmark.launch import spawn
from gpu_utils import POISON, assert_close, heartbeat, needs_gpus, rel_err, run_on_gpus

pytestmark = needs_gpus

MODULES = {
    "triton": "kraken.fused.context_parallel_attention",
    "helion": "helion_ports.fused.context_parallel_attention",
}
BF16, FP16 = torch.bfloat16, torch.float16


def backend_module(backend: str) -> types.SimpleNamespace:
    """A backend's installed functions (``kraken.<name>`` / ``helion_ports.<name>``, and ``attention_on_gathered``)
    and the product's ``prepare`` and ``launch`` driving that backend's kernels (``kraken.runtime.attention``)."""
    product = importlib.import_module("kraken.runtime.attention")
    public = importlib.import_module("kraken.runtime.api" if backend == "triton" else "kraken.runtime.twins")
    return types.SimpleNamespace(
        context_parallel_attention=public.context_parallel_attention,
        attention_on_gathered=(product if backend == "triton" else public).attention_on_gathered,
        prepare=product.prepare,
        launch=functools.partial(product.launch, attention=importlib.import_module(MODULES[backend]).launch_attention))
NONE, CAUSAL = op.NONE, op.CAUSAL


def shape_of(batch, s_local, heads, kv_heads, head_dim, mask, world_size):
    """The op's shape (total sequence) for ``s_local`` rows per rank."""
    return (batch, s_local * world_size, heads, kv_heads, head_dim, mask)


# (batch, S_local, heads, kv_heads, head_dim, mask, dtype, config, twin too). Odd: one row per rank, odd lengths
# (a query and a key tile end inside every chunk), GQA 2:1 and MQA, head_dim 64 and 128; then several tiles per
# chunk and several flag pieces; a custom scale is added to one case below. Helion compiles each (head_dim, dtype,
# causal, config) for most of a minute: the twin runs the cases of four of them (and the stress shapes and bad
# input reuse those), the recipe all.
CASES = [
    (1, 1, 2, 2, 64, NONE, BF16, {}, True),
    (1, 2, 2, 1, 128, CAUSAL, FP16, {}, False),
    (1, 37, 4, 4, 64, NONE, BF16, {}, True),
    (2, 129, 4, 2, 128, NONE, FP16, {}, True),
    (1, 74, 4, 1, 128, CAUSAL, BF16, {}, True),
    (2, 150, 8, 2, 64, CAUSAL, FP16, {"pieces": 3}, True),
    (1, 300, 4, 2, 128, CAUSAL, BF16, {"block_m": 64, "block_n": 32, "num_warps": 4, "num_stages": 2}, False),
    (1, 1024, 8, 8, 128, NONE, BF16, {"pieces": 4}, True),  # whole tiles: 2-D K/V boxes, the TMA store
    (1, 2048, 8, 2, 128, CAUSAL, BF16, {}, True),
    (1, 1000, 4, 4, 64, CAUSAL, FP16, {"pieces": 1}, True),
    # Two blocks per SM, more blocks than SMs (512 and 384 tiles of 64 rows).
    (1, 2048, 16, 4, 64, CAUSAL, BF16, {"block_m": 64, "block_n": 64, "num_warps": 4, "blocks_per_sm": 2}, True),
    (2, 1500, 8, 2, 128, CAUSAL, FP16, {"block_m": 64, "block_n": 64, "num_warps": 4, "blocks_per_sm": 2}, False),
    # The warp-specialized kernel (without causal) on its other key tile, and a tail in every chunk.
    (2, 1000, 8, 2, 128, NONE, FP16, {"block_n": 64}, False),
    # The defaults at head_dim 64 (three blocks per SM under the plan's register cap) with more tiles than blocks.
    (2, 2048, 16, 8, 64, CAUSAL, BF16, {}, False),
]
# Two causal shapes (head_dim 128) and one not (head_dim 64), all bf16; the graphs replay slots 0/3 and 1/4.
STRESS = [(1, 256, 8, 2, 128, CAUSAL), (2, 100, 4, 4, 64, NONE), (1, 512, 8, 8, 128, CAUSAL)]
# Helion compiles a kernel for most of a minute with no heartbeat: the twin's spawn allows longer stalls.
STALL_S = {"triton": 60.0, "helion": 240.0}


def operands(shape, dtype, seed: int, rank: int | None = None):
    world_size = dist.get_world_size()
    return op.rank_operands(shape, dtype, seed, dist.get_rank() if rank is None else rank, world_size)


def reference(shape, dtype, seed: int, scale: float | None = None) -> torch.Tensor:
    """This rank's output in float32: its queries over the whole sequence's keys, every rank's K/V rebuilt from
    their seeds and put in sequence order, the causal mask from each row's position in the layout."""
    world_size, rank = dist.get_world_size(), dist.get_rank()
    batch, s_local, heads, kv_heads, head_dim, causal = op.unpack(shape, world_size)
    recipe = importlib.import_module(MODULES["triton"])
    q = operands(shape, dtype, seed)[0].float()
    shards = [operands(shape, dtype, seed, r) for r in range(world_size)]
    k = recipe.unshard_sequence([s[1] for s in shards], causal).float()
    v = recipe.unshard_sequence([s[2] for s in shards], causal).float()
    group = heads // kv_heads
    scale = 1 / math.sqrt(head_dim) if scale is None else scale
    q_pos = recipe.sequence_positions(s_local, rank, world_size, causal).cuda()
    k_pos = torch.arange(s_local * world_size, device="cuda")
    out = torch.empty(batch, heads, s_local, head_dim, dtype=torch.float32, device="cuda")
    for h in range(heads):  # one head at a time: [S_local, S] scores stay small
        scores = q[:, h] @ k[:, h // group].transpose(-1, -2) * scale
        if causal:
            scores = scores.masked_fill(k_pos[None, :] > q_pos[:, None], float("-inf"))
        out[:, h] = torch.softmax(scores, dim=-1) @ v[:, h // group]
    return out


def launch_into(module, q, k, v, out: torch.Tensor, causal: bool, scale=None, poison_buffer: bool = False,
                **config) -> torch.Tensor:
    """The public call's own prepare/launch, but into a caller-owned (poisoned) output; optionally with this
    rank's whole gather buffer poisoned first (no peer reads it between calls: each call ends with a barrier
    after every copy, and the current stream joins it)."""
    ctx, cfg = module.prepare(q, k, v, None, "test", causal, scale, config)  # (kept per signature)
    if poison_buffer:
        cfg["gathered"].fill_(POISON)
    return module.launch(q, k, v, out=out, signal_pad_ptrs=ctx.signal_pad_ptrs, rank=ctx.rank, causal=causal,
                         scale=scale, **cfg, group_name=ctx.group_name)


def correctness(backend: str, module) -> None:
    world_size, rank = dist.get_world_size(), dist.get_rank()
    fn = module.context_parallel_attention
    for seed, (batch, s_local, heads, kv_heads, head_dim, mask, dtype, config, twin_too) in enumerate(CASES, start=1):
        if backend == "helion" and not twin_too:
            continue
        shape = shape_of(batch, s_local, heads, kv_heads, head_dim, mask, world_size)
        causal = mask == CAUSAL
        scale = 0.05 if seed == 4 else None
        what = f"{backend} {'x'.join(map(str, shape))} {dtype} {config} scale={scale}"
        heartbeat(what)
        q, k, v = operands(shape, dtype, seed)
        ref = reference(shape, dtype, seed, scale)
        out = torch.full_like(q, POISON)
        launch_into(module, q, k, v, out, causal, scale, poison_buffer=True, **config)
        public = fn(q, k, v, causal=causal, scale=scale, **config)
        warm = fn(q, k, v, causal=causal, scale=scale, **config)  # prepared: launched through the compiled kernels
        # New addresses (a model's next layer): the kernels replayed from a record of an earlier call, which must
        # read this call's tensors: the earlier ones are poisoned.
        fresh = [t.clone() for t in (q, k, v)]
        for t in (q, k, v):
            t.fill_(POISON)
        q, k, v = fresh
        moved = fn(q, k, v, causal=causal, scale=scale, **config)
        torch.cuda.synchronize()
        assert_close(out, ref, what)
        assert torch.equal(public, out), f"{what}: the public call and launch() disagree"
        assert torch.equal(warm, public), f"{what}: the warm call differs from the first"
        assert torch.equal(moved, public), f"{what}: the call on new addresses differs from the first"
        if backend == "triton":  # (the benchmark's triton_local column; the twin's is the same kernel, not timed)
            # The kernel with every rank's K/V here already (gathered by NCCL): no communication.
            gathered = op.gather_kv(k, v)
            gathered[rank].fill_(POISON)  # my own K/V come from k and v
            local = module.attention_on_gathered(q, k, v, gathered, rank, causal=causal, scale=scale, **config)
            torch.cuda.synchronize()
            assert_close(local, ref, f"{what} (attention_on_gathered)")


def stress_and_cuda_graph(backend: str, module) -> None:
    """200 back-to-back launches on rotating inputs, alternating shapes and masks (a buffer overwritten while a peer
    still copies it, or a flag left over from the previous launch, shows up here), then CUDA-graph capture and 20
    replays against eager, bitwise."""
    world_size = dist.get_world_size()
    fn = module.context_parallel_attention
    shapes = [shape_of(*STRESS[s % len(STRESS)], world_size) for s in range(6)]
    inputs = [operands(shape, BF16, 100 + s) for s, shape in enumerate(shapes)]
    refs = [reference(shape, BF16, 100 + s) for s, shape in enumerate(shapes)]
    outs = [torch.full_like(inputs[s][0], POISON) for s in range(6)]
    for i in range(200):
        q, k, v = inputs[i % 6]
        launch_into(module, q, k, v, outs[i % 6], shapes[i % 6][5] == CAUSAL)
        if i % 50 == 49:
            heartbeat(f"{backend} launch {i + 1}")
            torch.cuda.synchronize()
            for s in range(6):
                assert_close(outs[s], refs[s], f"{backend} after {i + 1} launches (slot {s}, {shapes[s]})")
                outs[s].fill_(POISON)

    replayed_calls(backend, module, shapes, inputs)
    for causal, slots in ((True, [0, 3]), (False, [1, 4])):  # slots of one shape each (STRESS[0], STRESS[1])
        eager = {s: fn(*inputs[s], causal=causal) for s in slots}
        static = [t.clone() for t in inputs[slots[0]]]
        fn(*static, causal=causal)  # warm-up before capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static_out = fn(*static, causal=causal)
        for i in range(20):
            s = slots[i % len(slots)]
            for dst, src in zip(static, inputs[s]):
                dst.copy_(src)
            static_out.fill_(POISON)
            graph.replay()
            torch.cuda.synchronize()
            assert torch.equal(static_out, eager[s]), f"{backend} causal={causal}: graph replay {i} differs from eager"
    heartbeat(f"{backend} graph replays done")


def replayed_calls(backend: str, module, shapes, inputs) -> None:
    """The public calls (``context_parallel_attention``, ``attention_on_gathered``) on the same addresses with new
    values, eight each per shape (two seeds in turn): from the second call on, replays of a CUDA graph kept for those
    pointers (``graphs.graphed``), bitwise equal to a plain ``launch`` of the same inputs; and each call's prepared
    launcher kept a graph for those q, k, v."""
    graphs = importlib.import_module("kraken.runtime.graphs")
    cp = importlib.import_module("kraken.runtime.attention")  # both prepared calls (the twin's under its op name)
    rank = dist.get_rank()
    for slots in ([0, 3], [1, 4], [2, 5]):  # slots of one shape each
        causal = shapes[slots[0]][5] == CAUSAL
        plain = {s: launch_into(module, *inputs[s], torch.full_like(inputs[s][0], POISON), causal) for s in slots}
        kv = {s: op.gather_kv(*inputs[s][1:]) for s in slots}
        for s in slots:
            kv[s][rank].fill_(POISON)  # (my own K/V come from k and v)
        static = [t.clone() for t in inputs[slots[0]]]
        gathered = torch.empty_like(kv[slots[0]])
        for i in range(8):
            s = slots[i % 2]
            for dst, src in zip((*static, gathered), (*inputs[s], kv[s])):
                dst.copy_(src)
            public = module.context_parallel_attention(*static, causal=causal)
            local = module.attention_on_gathered(*static, gathered, rank, causal=causal)
            torch.cuda.synchronize()
            what = f"{backend} {shapes[s]} call {i}"
            assert torch.equal(public, plain[s]), f"{what}: the public call differs from a plain launch"
            assert torch.equal(local, plain[s]), f"{what}: attention_on_gathered differs from a plain launch"
            del public, local  # (their memory comes back at the same addresses: the next call's pointers are these)
        # Each call's launcher (its prepared call's) kept a graph for these q, k, v (for one output address or more:
        # the allocator may place the first calls' outputs elsewhere).
        name = f"helion {cp.OP}" if backend == "helion" else cp.OP
        launchers = {id(cp.prepare(*static, None, name, causal, None, {})[1]["launcher"]),
                     id(cp.prepare_on_gathered(*static, gathered, rank, name, causal, None, {})[2])}
        kept = {id(key[0]) for key, entry in graphs._graphs.items()
                if isinstance(entry, torch.cuda.CUDAGraph) and key[1:4] == tuple(t.data_ptr() for t in static)}
        assert launchers <= kept, f"{backend} {shapes[slots[0]]}: a call kept no graph for these pointers"
    heartbeat(f"{backend} replayed calls done")


def bad_input(backend: str, module) -> None:
    rank, world_size = dist.get_rank(), dist.get_world_size()
    fn = module.context_parallel_attention
    # Ranks disagreeing on S_local (fresh shapes, so this is the first use): every rank raises, nothing hangs (a
    # group of one cannot disagree).
    if world_size > 1:
        q, k, v = operands(shape_of(1, 40 + 2 * rank, 2, 2, 64, NONE, world_size), BF16, 7)
        with pytest.raises(ValueError, match="ranks disagree"):
            fn(q, k, v)
    shape = shape_of(1, 44, 4, 2, 128, CAUSAL, world_size)
    q, k, v = operands(shape, BF16, 7)
    with pytest.raises(TypeError, match="unknown config"):
        fn(q, k, v, causal=True, bogus=1)
    with pytest.raises(ValueError, match="head_dim must be one of"):
        fn(q[..., :96].contiguous(), k[..., :96].contiguous(), v[..., :96].contiguous())
    with pytest.raises(ValueError, match="must divide the query heads"):
        fn(q[:, :3].contiguous(), k, v)
    with pytest.raises(ValueError, match="causal=True needs an even S_local"):
        fn(q[:, :, :43].contiguous(), k[:, :, :43].contiguous(), v[:, :, :43].contiguous(), causal=True)
    # One rank alone passes a bad dtype or a bad head count: every rank raises (first call of this signature).
    with pytest.raises((ValueError, TypeError)):
        fn(q if rank else q.float(), k if rank else k.float(), v if rank else v.float(), causal=True)
    with pytest.raises(ValueError, match="bad input on rank 0"):
        fn(q if rank else q[:, :3].contiguous(), k, v, causal=True)
    # The group still works after all that.
    out = fn(q, k, v, causal=True)
    torch.cuda.synchronize()
    assert_close(out, reference(shape, BF16, 7), f"{backend} after bad input")
    heartbeat(f"{backend} bad input done")


def worker(backend: str) -> None:
    module = backend_module(backend)
    correctness(backend, module)
    stress_and_cuda_graph(backend, module)
    bad_input(backend, module)


@pytest.mark.parametrize("backend", list(MODULES))
def test_context_parallel_attention(backend):
    spawn(worker, (backend,), name=f"context_parallel_attention {backend}", stall_s=STALL_S[backend])


def baseline_worker() -> None:
    world_size = dist.get_world_size()
    for seed, (s_local, mask, kv_heads) in enumerate(((256, NONE, 8), (256, CAUSAL, 2), (130, CAUSAL, 8)), start=1):
        shape = shape_of(1, s_local, 8, kv_heads, 128, mask, world_size)
        ref = reference(shape, BF16, seed)
        for name in ("nccl_cudnn", "nccl_flash", "sdpa_cudnn", "sdpa_flash", "triton_local", "torch_cp"):
            heartbeat(f"baseline {name} {shape}")
            backend = REGISTRY["context_parallel_attention"].backends[name]
            if name != "torch_cp":
                inputs = op.make_inputs(shape, BF16, seed)
                out = backend(inputs)
                torch.cuda.synchronize()
                assert_close(out, ref, f"baseline {name} {shape}")
                if name.startswith(("nccl_", "sdpa_")):  # the named SDPA backend and nothing else (no fallback)
                    sdpa_backend = name.split("_")[1]
                    ran = op.attention_ops(lambda: (backend(inputs), torch.cuda.synchronize()))
                    assert ran and all(sdpa_backend in op_name for op_name in ran), f"{name} {shape}: SDPA ran {ran}"
                continue
            if dist.get_backend() == "gloo":  # ranks sharing a GPU (KRAKEN_WORLD_SIZE, see benchmark.launch)
                print(f"rank {dist.get_rank()}: torch_cp skipped: its ring attention segfaults on gloo", flush=True)
                continue
            # torch's prototype: informational (the benchmark reports an error or a FAIL in its column the same way),
            # but a failure must leave SDPA unpatched for the next case's baselines.
            sdpa_fn = F.scaled_dot_product_attention
            try:
                out = backend(op.make_inputs(shape, BF16, seed))
                torch.cuda.synchronize()
                print(f"rank {dist.get_rank()}: torch_cp {shape}: relative error {rel_err(out, ref):.2e}", flush=True)
            except NotImplementedError as exc:
                print(f"rank {dist.get_rank()}: torch_cp refused {shape}: {exc}", flush=True)
            assert F.scaled_dot_product_attention is sdpa_fn, "torch_cp left SDPA patched"


def test_benchmark_baselines():
    run_on_gpus(baseline_worker, name="context_parallel_attention baselines")
