"""Shared by the GPU tests: the skip marker, the per-GPU runner and the checks.

GPU tests run one process per visible GPU (world size = GPU count: one GPU runs world size 1, a peer set of
one; ``KRAKEN_WORLD_SIZE=2`` runs two ranks on one GPU, functional checks only: see ``benchmark.launch``)
through ``benchmark.launch.spawn``; a rank that makes no progress for 60 s fails
the test with the op's name. Worker functions live at module level (they are
pickled into the spawned processes) and call ``heartbeat`` between steps.
"""

from __future__ import annotations

import pytest
import torch

from benchmark.launch import default_world_size, heartbeat, spawn

GPU_COUNT = torch.cuda.device_count() if torch.cuda.is_available() else 0
WORLD_SIZE = default_world_size()
needs_gpus = pytest.mark.skipif(
    GPU_COUNT < 1 or WORLD_SIZE < 1,
    reason=f"GPU test: needs a CUDA GPU (one process per GPU: world size 1 on one GPU, 2-8 on NVLink-connected "
    f"GPUs), found {GPU_COUNT} (with one GPU, KRAKEN_WORLD_SIZE=2 runs two ranks on it: functional checks only)",
)
DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# ||out - ref|| / ||ref|| against a float64 reference, by the output dtype.
TOLERANCE = {torch.bfloat16: 1e-2, torch.float16: 2e-3, torch.float32: 1e-5}
POISON = float("nan")


def run_on_gpus(fn, *args, name: str) -> list:
    """Run ``fn(*args)`` on every GPU (one process each); returns each rank's result."""
    return spawn(fn, args, name=name, stall_s=60.0)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out64, ref64 = out.double(), ref.double()
    return ((out64 - ref64).norm() / ref64.norm().clamp_min(1e-30)).item()


def assert_close(out: torch.Tensor, ref: torch.Tensor, what: str) -> None:
    """Every element written (no NaN left from the poison) and the relative error within the dtype's bound."""
    assert out.shape == ref.shape, f"{what}: shape {tuple(out.shape)} != {tuple(ref.shape)}"
    assert not torch.isnan(out).any(), f"{what}: NaN in the output (an element was never written?)"
    err = rel_err(out, ref)
    assert err <= TOLERANCE[out.dtype], f"{what}: relative error {err:.2e} > {TOLERANCE[out.dtype]:.0e}"


def check_graph_replays(backend: str, fn, inputs: list, slots, **kwargs) -> None:
    """CUDA-graph capture of ``fn(*static, **kwargs)`` on clones of ``inputs[slots[0]]`` (a column-major clone
    keeps its strides), then 20 replays, each on the next slot's inputs copied in (fp8 through its bytes),
    bitwise against eager calls on the same inputs."""
    eager = {k: fn(*inputs[k], **kwargs) for k in slots}
    static = [t.clone() for t in inputs[slots[0]]]
    fn(*static, **kwargs)  # warm-up before capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = fn(*static, **kwargs)
    for i in range(20):
        k = slots[i % len(slots)]
        for tensor, value in zip(static, inputs[k]):
            if tensor.dtype == torch.float8_e4m3fn:
                tensor.view(torch.uint8).copy_(value.view(torch.uint8))
            else:
                tensor.copy_(value)
        static_out.fill_(POISON)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(static_out, eager[k]), f"{backend} graph replay {i} differs from eager"
    heartbeat(f"{backend} graph replays done")


__all__ = ["DTYPES", "GPU_COUNT", "POISON", "assert_close", "check_graph_replays", "heartbeat", "needs_gpus",
           "rel_err", "run_on_gpus"]
