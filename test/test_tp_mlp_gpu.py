"""GPU tests of the tp_mlp block (``benchmark/ops/tp_mlp.py``): every backend against float64 on odd and
Llama-like shapes scaled down, twice (the same bits), the recipes and twins also in CUDA-graph replays; the
async-TP backend must really run torch's fused ops (inductor's generated code names them)."""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist

from benchmark.launch import spawn
from check_all import check_all
from gpu_utils import assert_close, check_graph_replays, heartbeat, needs_gpus

pytestmark = needs_gpus
BF16 = torch.bfloat16


def shapes(world_size: int) -> list[tuple[int, int, int]]:
    """(TOKENS, HIDDEN, FFN) of the layer: odd rows per rank and an FFN slice off the tiles; then 8B's proportions
    (FFN = 3.5 HIDDEN) at a tenth of the size."""
    return [(world_size * 37, 256, world_size * 136), (world_size * 128, 512, 1792)]


def worker(backend: str) -> None:
    from benchmark.ops import tp_mlp

    fn = tp_mlp.BACKENDS[backend]
    for seed, shape in enumerate(shapes(dist.get_world_size())):
        what = f"tp_mlp {backend} {shape}"
        heartbeat(what)
        inputs = tp_mlp.make_inputs(shape, BF16, seed)
        # Checked with 2 ranks sharing a GPU; a group of one may leave inductor nothing to rewrite.
        if backend == "torch_async_tp" and seed == 0 and dist.get_world_size() > 1:
            from torch._inductor.utils import run_and_get_code

            out, code = run_and_get_code(tp_mlp.async_tp(dist.group.WORLD), inputs["x"], inputs["w_gate_up"],
                                         inputs["w_down"])
            code = "\n".join(code)
            for op in ("fused_all_gather_matmul", "fused_matmul_reduce_scatter"):
                assert op in code, f"{what}: inductor did not rewrite the block into {op}"
        out = fn(inputs).clone()
        again = fn(inputs)
        torch.cuda.synchronize()
        assert_close(out, tp_mlp.reference(shape, BF16, seed, dist.get_rank(), dist.get_world_size()).to(BF16),
                     what)
        assert torch.equal(out, again), f"{what}: a second call on the same inputs differs"
    if backend in ("triton", "helion"):
        shape = shapes(dist.get_world_size())[0]
        slots = [tp_mlp.make_inputs(shape, BF16, 10 + s) for s in range(3)]
        inputs = [(i["x"], i["w_gate_up"], i["w_down"]) for i in slots]
        block = lambda x, w_gate_up, w_down: fn({"x": x, "w_gate_up": w_gate_up, "w_down": w_down, "group": None})
        check_graph_replays(f"tp_mlp {backend}", block, inputs, range(3))


BACKENDS = ("nccl", "triton", "helion", "torch_fused", "triton_compiled", "helion_compiled", "torch_async_tp")


def all_backends_worker() -> None:
    check_all([(backend, functools.partial(worker, backend)) for backend in BACKENDS])


def test_tp_mlp_every_backend():
    # torch.compile of the async-TP block can take minutes with ranks sharing a GPU's host: a longer stall limit.
    spawn(all_backends_worker, name="tp_mlp", stall_s=300.0)
