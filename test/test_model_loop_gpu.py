"""The host fast path in a model: a 32-layer eager loop calling the fused recipes on fresh activations.

Each layer (this rank's ``ROWS`` tokens): ``all_gather_matmul`` -> SiLU -> ``gemm_reduce_scatter`` ->
``all_reduce_bias_rms_norm`` -> ``context_parallel_attention`` (causal, its heads from the normed rows) ->
``gemm_one_shot_all_reduce`` -> ``moe_dispatch`` -> one expert matmul -> ``moe_combine``. Every layer has its own
weights and every call new inputs (a model's activations: new addresses), three timed steps after two warm-up steps,
under ``torch.cuda.set_sync_debug_mode("error")`` (a call that synchronises with the device raises) and with
``torch.cuda.synchronize`` counted (none may happen).

Each call's host cost (the time until it returns, nothing synchronised) is set beside two costs of the op's call kept
from the warm-up step, both timed before the first step and after the last (this host's speed drifts over a minute):
``warm``, the call looped on the same inputs as the benchmark measures it, and ``interleaved``, the same calls made in
rounds of every op's, in the model's order. A call amid other work runs with cold caches, and costs more than in a tight
loop for any path, the library's too (docs/history.md, the host path); ``interleaved`` is that cost on the warm path. So
the checks ask whether the model's calls take the warm path: the typical call (median) within ``TYPICAL`` times
``interleaved``; no call past ``SPIKE`` times ``interleaved`` but those of each step's first layer (its fresh input,
after the step's synchronisation: cold, and in pieces where a recipe has them) and those that ran Python's garbage
collector (counted apart); no timed step capturing a CUDA graph. A capture costs a few hundred microseconds: where
consecutive layers reuse the addresses of the last one's tensors, two address sets in turn, a step captures them, and
the later steps find the same addresses. The warm loops' own allocations move the allocator's free blocks, so a second,
untimed warm-up step follows them (a model's first steps, with nothing of a test's between them, need no such step); and
no garbage collection may free a CUDA tensor (one freed late, out of a reference cycle, would shift the address sets:
captured again). Each op's line also prints its median against ``warm`` and how many calls cost more than twice
``warm``. Where ranks share a GPU (``KRAKEN_WORLD_SIZE`` above the GPU count) their kernels time-slice it and a host
call can wait for the other rank's work, so there the costs are printed, not checked.

For scale, at one rank the same loop runs the library path in place of the five GEMM, norm and attention recipes
(``Library``: NCCL + cuBLAS + SDPA; NCCL's MoE dispatch synchronises on its split sizes, so the MoE pair is left out
of the comparison), its steps taking turns with the recipes'. Its calls cost more amid the model than in its warm loop
too; each recipe's typical call must cost less than the library's.
"""

from __future__ import annotations

import gc
import statistics
import time

import torch
import torch.distributed as dist

from gpu_utils import heartbeat, needs_gpus, run_on_gpus

pytestmark = needs_gpus
BF16 = torch.bfloat16
LAYERS, STEPS = 32, 3
ROWS, HIDDEN, FFN, HEADS, KV_HEADS, HEAD_DIM, EXPERTS_PER_RANK, TOP_K = 128, 512, 1024, 4, 2, 128, 2, 2
WARM_CALLS = 30
TYPICAL, SPIKE = 2.5, 10.0  # a model's calls against the op's interleaved call: the median, every call


class Layer:
    def __init__(self, seed: int):
        ws, rank = dist.get_world_size(), dist.get_rank()
        gen = torch.Generator(device="cuda").manual_seed(1000 * seed + rank)

        def weight(*shape):
            return torch.randn(*shape, generator=gen, device="cuda").div(shape[0] ** 0.5).to(BF16)

        self.w1, self.w2, self.w3 = weight(HIDDEN, FFN), weight(FFN, HIDDEN), weight(HIDDEN, HIDDEN)
        self.bias, self.norm = weight(1, HIDDEN)[0], 1 + weight(1, HIDDEN)[0]
        self.expert = weight(HIDDEN, HIDDEN)  # every local expert's (the routing, not the math, is under test)
        shared = torch.Generator(device="cuda").manual_seed(seed)  # the router: the same on every rank
        self.router = torch.randn(HIDDEN, EXPERTS_PER_RANK * ws, generator=shared, device="cuda")
        self.capacity = ws * ROWS * TOP_K

    def forward(self, ops, x: torch.Tensor, call) -> torch.Tensor:
        """The layer on ``ops`` (``kraken``, or ``Library``); ``call(op, fn, *args, **kwargs)`` runs each of its calls
        (the caller times it), its arguments made before (fresh tensors from the previous output)."""
        h = call("all_gather_matmul", ops.all_gather_matmul, x, self.w1)
        y = call("gemm_reduce_scatter", ops.gemm_reduce_scatter, torch.nn.functional.silu(h), self.w2)
        z = call("all_reduce_bias_rms_norm", ops.all_reduce_bias_rms_norm, y, self.bias, self.norm)
        heads = z.view(ROWS, HEADS, HEAD_DIM).transpose(0, 1).unsqueeze(0)
        q, k = heads.contiguous(), heads[:, :KV_HEADS].contiguous()
        o = call("context_parallel_attention", ops.context_parallel_attention, q, k, k * 0.5, causal=True)
        r = call("gemm_one_shot_all_reduce", ops.gemm_one_shot_all_reduce,
                 o[0].transpose(0, 1).reshape(ROWS, HIDDEN), self.w3, out_dtype=BF16)
        weights, ids = torch.topk(torch.softmax(r.float() @ self.router, dim=-1), TOP_K)
        recv, _, handle = call("moe_dispatch", ops.moe_dispatch, r, ids, self.router.shape[1],
                               capacity=self.capacity)
        return call("moe_combine", ops.moe_combine, recv @ self.expert, handle, weights)


class Library:
    """The library path under the recipes' names (one rank): NCCL collectives, cuBLAS matmuls, torch's RMSNorm, SDPA.
    The MoE pair stands in with no communication (its calls are not compared)."""

    @staticmethod
    def all_gather_matmul(x, w):
        gathered = x.new_empty((dist.get_world_size() * x.shape[0], x.shape[1]))
        dist.all_gather_into_tensor(gathered, x)
        return gathered @ w

    @staticmethod
    def gemm_reduce_scatter(a, w):
        full = a @ w
        out = full.new_empty((full.shape[0] // dist.get_world_size(), full.shape[1]))
        dist.reduce_scatter_tensor(out, full)
        return out

    @staticmethod
    def all_reduce_bias_rms_norm(y, bias, weight):
        dist.all_reduce(y)
        return torch.nn.functional.rms_norm(y + bias, (y.shape[-1],), weight)

    @staticmethod
    def context_parallel_attention(q, k, v, causal):
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)

    @staticmethod
    def gemm_one_shot_all_reduce(a, w, out_dtype):
        out = a @ w
        dist.all_reduce(out)
        return out

    @staticmethod
    def moe_dispatch(tokens, ids, num_experts, capacity):
        return tokens, None, None

    @staticmethod
    def moe_combine(expert_out, handle, weights):
        return expert_out


COMPARED = ("all_gather_matmul", "gemm_reduce_scatter", "all_reduce_bias_rms_norm", "context_parallel_attention",
            "gemm_one_shot_all_reduce")


class Path:
    """One way to run the model's ops (``kraken``, or ``Library``) and what its loop measured: op -> [(step, host us,
    whether the garbage collector ran, whether a graph was captured)] per call (``record``), op -> its warm and its
    interleaved samples, and the op's call of layer 0 in the warm-up step (``kept``), which those loops repeat.
    ``sync_checked``: its steps run under ``set_sync_debug_mode("error")`` and count ``torch.cuda.synchronize``."""

    def __init__(self, ops, sync_checked: bool):
        self.ops, self.sync_checked = ops, sync_checked
        self.record, self.warm, self.interleaved, self.kept = {}, {}, {}, {}


def cost(fn, args, kwargs) -> tuple[object, float]:
    """The call's output and its host us."""
    start = time.perf_counter_ns()
    out = fn(*args, **kwargs)
    return out, (time.perf_counter_ns() - start) / 1e3


def warm_loops(path: Path) -> None:
    """The benchmark's loop of each kept call (the same inputs, the last output kept; its first third dropped), then
    rounds of every op's kept call in the model's order."""
    for op, (fn, args, kwargs) in path.kept.items():
        samples = [cost(fn, args, kwargs)[1] for _ in range(WARM_CALLS)]
        path.warm.setdefault(op, []).extend(samples[WARM_CALLS // 3:])
        torch.cuda.synchronize()
    for i in range(WARM_CALLS):
        for op, (fn, args, kwargs) in path.kept.items():
            us = cost(fn, args, kwargs)[1]
            if i >= WARM_CALLS // 3:
                path.interleaved.setdefault(op, []).append(us)
    torch.cuda.synchronize()


def host_costs(paths: list, layers: list) -> dict:
    """Each path's warm-up step (layer 0's calls kept), its warm and interleaved loops and a second warm-up step,
    then ``STEPS`` steps, each running every path's model step in turn (this host's speed drifts over a minute: the
    paths are compared within the same seconds), every call timed; the warm and interleaved loops again after the last.
    Returns step -> CUDA graphs kept after it (0: after the warm-up)."""
    from kraken.runtime import graphs

    rank = dist.get_rank()
    collections, current = [0], [0]  # garbage collections so far, the step running
    allocated, freed = [0], []  # CUDA bytes allocated when the running collection started; what collections freed

    def collecting(phase: str, info: dict) -> None:  # (the allocator's counters: no synchronisation)
        now = torch.cuda.memory_allocated()
        if phase == "start":
            collections[0] += 1
            allocated[0] = now
        elif now < allocated[0]:
            freed.append((current[0], allocated[0] - now))

    def timed(path: Path):
        def call(op, fn, *args, **kwargs):
            before, graphs_before = collections[0], len(graphs._graphs)
            out, us = cost(fn, args, kwargs)
            path.record.setdefault(op, []).append((current[0], us, collections[0] > before,
                                                   len(graphs._graphs) > graphs_before))  # (far below the bound)
            return out
        return call

    def step(path: Path, seed: int, first, call) -> torch.Tensor:
        gen = torch.Generator(device="cuda").manual_seed(seed * 97 + rank)
        x = torch.randn(ROWS, HIDDEN, generator=gen, device="cuda").to(BF16)
        for i, layer in enumerate(layers):
            x = layer.forward(path.ops, x, first if i == 0 else call)
        return x

    def keep(path: Path):
        def call(op, fn, *args, **kwargs):
            path.kept[op] = (fn, args, kwargs)
            return fn(*args, **kwargs)
        return call

    def plain(op, fn, *args, **kwargs):
        return fn(*args, **kwargs)

    def kept_graphs() -> int:
        return sum(not isinstance(entry, int) for entry in graphs._graphs.values())

    gc.callbacks.append(collecting)
    real_synchronize, synchronized, captured = torch.cuda.synchronize, [], {}
    try:
        with torch.no_grad():
            for path in paths:
                out = step(path, 0, keep(path), plain)  # compiles every kernel, agrees on every signature
                torch.cuda.synchronize()
                assert out.shape == (ROWS, HIDDEN) and torch.isfinite(out).all(), "the model's output"
                del out
                warm_loops(path)
            for path in paths:  # the warm loops' own allocations moved the allocator's free blocks: one more untimed
                step(path, 0, plain, plain)  # step, and the model's layers are back in the cycle of address sets that
                torch.cuda.synchronize()  # every later step repeats (its new ones captured here, once)
            captured[0] = kept_graphs()
            heartbeat("model warm-up steps done")
            for seed in range(1, STEPS + 1):
                current[0] = seed
                for path in paths:
                    if path.sync_checked:
                        torch.cuda.synchronize = lambda *args, **kwargs: synchronized.append(args)
                        torch.cuda.set_sync_debug_mode("error")
                    try:
                        call = timed(path)
                        step(path, seed, call, call)
                    finally:
                        torch.cuda.set_sync_debug_mode("default")
                        torch.cuda.synchronize = real_synchronize
                    real_synchronize()
                captured[seed] = kept_graphs()
                heartbeat(f"model step {seed} done")
            for path in paths:  # once more after the last step (between steps their allocations would shift the
                warm_loops(path)  # addresses that the next step's layers see)
        gc.collect()  # (whatever reference cycles are left)
    finally:
        gc.callbacks.remove(collecting)
    assert not synchronized, f"rank {rank}: the fast path synchronised the device {len(synchronized)} times"
    # A tensor in a reference cycle goes back to the allocator when the collector runs, not when its last holder drops
    # it: the model's next layers would find other addresses than the step before.
    assert not freed, f"rank {rank}: Python's collector freed CUDA tensors (step, bytes): {freed}"
    for path in paths:
        for op, calls in path.record.items():
            assert len(calls) == LAYERS * STEPS, (op, len(calls))
    return captured


def summary(op: str, calls: list, warm: float, interleaved: float) -> tuple[str, float, float]:
    """(a line of the op's costs, its model median, its largest cost past each step's first layer, with no garbage
    collection; a capture fails the test on its own)."""
    samples = [us for _, us, _, _ in calls]
    ordered, median = sorted(samples), statistics.median(samples)
    late, where = max((us, i) for i, (_, us, collected, _) in enumerate(calls)
                      if i % LAYERS and not collected)
    over = [i for i, us in enumerate(samples) if us > 2 * warm]
    first, grabbed = sum(i % LAYERS == 0 for i in over), sum(calls[i][3] for i in over if i % LAYERS)
    collected = sum(collected for _, _, collected, _ in calls)
    captures = [f"{us:.0f} us (step {i // LAYERS + 1}, layer {i % LAYERS})" for i, (_, us, _, captured)
                in enumerate(calls) if captured]
    return (f"  {op:28s} warm {warm:6.1f} us  interleaved {interleaved:6.1f}  model median {median:6.1f} "
            f"({median / interleaved:.2f}x interleaved, {median / warm:.2f}x warm)  p95 "
            f"{ordered[int(0.95 * len(ordered)) - 1]:6.1f}  max {ordered[-1]:7.1f}; past layer 0 "
            f"{late:7.1f} (step {where // LAYERS + 1}, layer {where % LAYERS});  {len(over)} of {len(samples)} calls "
            f"over 2x warm (a step's first layer {first}, captures {grabbed}, the rest {len(over) - first - grabbed}), "
            f"{collected} with a garbage collection; captures: {', '.join(captures) or 'none'}", median, late)


def model_loop() -> None:
    import kraken

    rank, world_size = dist.get_rank(), dist.get_world_size()
    layers = [Layer(seed) for seed in range(LAYERS)]
    recipes = Path(kraken, sync_checked=True)
    library = Path(Library, sync_checked=False) if world_size == 1 else None  # (its attention is one rank's)
    captured = host_costs([recipes] + ([library] if library else []), layers)

    def lines(path: Path, ops) -> dict:  # op -> (its line, its model median, its largest later call)
        return {op: summary(op, path.record[op], statistics.median(path.warm[op]),
                            statistics.median(path.interleaved[op])) for op in ops}

    ours = lines(recipes, recipes.record)
    print(f"rank {rank} of {world_size}: {LAYERS} layers x {STEPS} steps, host cost per call (CUDA graphs kept after "
          f"the warm-up, 0, and each step: {captured}):\n" + "\n".join(line for line, _, _ in ours.values()),
          flush=True)
    assert all(captured[step] == captured[0] for step in captured), (
        f"rank {rank}: graphs kept after the warm-up and after each step: {captured} (a step captured new address "
        f"sets)")
    if world_size > torch.cuda.device_count():  # ranks sharing a GPU: no timing means anything
        return
    misses = [op for op, (_, median, late) in ours.items()
              if median > TYPICAL * statistics.median(recipes.interleaved[op])
              or late > SPIKE * statistics.median(recipes.interleaved[op])]
    dearer = []
    if library is not None:
        theirs = lines(library, COMPARED)
        print("the library path in the same loop (NCCL, cuBLAS, torch's RMSNorm, SDPA), its steps taking turns with "
              "the recipes':\n" + "\n".join(line for line, _, _ in theirs.values()), flush=True)
        dearer = [op for op in COMPARED if ours[op][1] >= theirs[op][1]]
    assert not misses, (f"rank {rank}: host cost past {TYPICAL:g}x the interleaved call's (median) or {SPIKE:g}x (a "
                        f"call past a step's first layer) for {misses}")
    assert not dearer, f"a model's typical call costs the library path less than the recipe: {dearer}"


def test_model_loop_calls_stay_warm_without_synchronising():
    run_on_gpus(model_loop, name="model loop")
