"""The tp_mlp block's conventions on CPU: ``tp_mlp`` composed with stand-in recipes that simulate a world of
ranks one rank at a time gives ``reference`` (float64), the Llama MLP written with separate gate, up and down
matrices; and the registry entry."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from benchmark import registry
from benchmark.ops import tp_mlp


class SimulatedWorld:
    """``all_gather_matmul`` / ``gemm_reduce_scatter`` of one rank of a world whose rows of ``x`` are ``xs``: the
    gather is exact; the reduce-scatter returns the rank's whole partial product (the test sums and splits)."""

    def __init__(self, xs):
        self.xs = xs

    def all_gather_matmul(self, x, w, group):
        assert any(x is other for other in self.xs)
        return torch.cat(self.xs) @ w

    def gemm_reduce_scatter(self, h, w, group, out_dtype):
        return h.double() @ w.double()


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_block_is_the_llama_mlp(world_size):
    shape = (world_size * 5, 24, world_size * 12)
    tokens, hidden, ffn = shape
    operands = [tp_mlp.rank_operands(shape, torch.float32, 3, r, world_size, "cpu") for r in range(world_size)]
    world = SimulatedWorld([x for x, _, _ in operands])
    partials = [tp_mlp.tp_mlp(x, w_gate_up, w_down, recipes=world) for x, w_gate_up, w_down in operands]
    out = sum(partials).chunk(world_size)
    # The same layer with whole, separate matrices: rank r's slice of FFN is columns [r f, (r + 1) f).
    f = ffn // world_size
    gate = torch.cat([w[:, :f] for _, w, _ in operands], dim=1).double()
    up = torch.cat([w[:, f:] for _, w, _ in operands], dim=1).double()
    down = torch.cat([w for _, _, w in operands]).double()
    x = torch.cat(world.xs).double()
    layer = (F.silu(x @ gate) * (x @ up)) @ down
    for rank in range(world_size):
        expected = tp_mlp.reference(shape, torch.float32, 3, rank, world_size, "cpu")
        assert torch.allclose(expected, layer.chunk(world_size)[rank], rtol=1e-9, atol=1e-9)
        assert torch.allclose(out[rank], expected, rtol=1e-5, atol=1e-5)
        assert out[rank].shape == (tokens // world_size, hidden)


def test_registry_entry():
    op = registry.get("tp_mlp")
    assert list(op.backends) == ["nccl", "torch_fused", "torch_async_tp", "triton", "helion", "triton_compiled",
                                 "helion_compiled", "matmul"]
    assert op.reference_free == {"matmul"} and op.library == "matmul"
    for tokens, hidden, ffn in op.default_shapes:  # Llama-3 8B and 70B, splittable over 2, 4 and 8 ranks
        assert (hidden, ffn) in tp_mlp.LLAMA3.values() and tokens % 8 == 0 and ffn % 8 == 0
    with pytest.raises(ValueError, match="divisible"):
        tp_mlp.check_shape((100, 64, 96), torch.bfloat16, 8)
    with pytest.raises(ValueError, match="bf16"):
        tp_mlp.check_shape((16, 64, 96), torch.float16, 2)


@pytest.fixture
def fake_world():
    """A 4-rank process group in this one process (torch's ``fake`` backend: no peers, no collectives run)."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    dist.init_process_group("fake", rank=1, world_size=4, store=FakeStore())
    yield dist.group.WORLD
    dist.destroy_process_group()


@pytest.mark.parametrize("package", ["kraken", "helion_ports"])
def test_block_traces_as_one_graph_of_two_operators_and_the_swiglu(fake_world, package):
    """What ``triton_compiled`` / ``helion_compiled`` hand to inductor: the two recipes as operators, the SwiGLU
    between them as aten ops it can fuse (``torch.export``, strict: no graph break)."""
    import importlib

    from torch._subclasses.fake_tensor import FakeTensorMode

    recipes = importlib.import_module(package)

    class Block(torch.nn.Module):
        def forward(self, x, w_gate_up, w_down):
            return tp_mlp.tp_mlp(x, w_gate_up, w_down, fake_world, recipes=recipes)

    with FakeTensorMode():
        shapes = ((64, 256), (256, 272), (136, 256))  # x [T, H], w_gate_up [H, 2 f], w_down [f, H]
        args = tuple(torch.empty(shape, dtype=torch.bfloat16, device="cuda") for shape in shapes)
        program = torch.export.export(Block(), args, strict=True)
    namespace = "kraken" if package == "kraken" else "kraken_helion"
    targets = [str(n.target) for n in program.graph.nodes if n.op == "call_function"]
    ours = [t for t in targets if t.startswith(f"{namespace}.")]
    assert ours == [f"{namespace}.all_gather_matmul.default", f"{namespace}.gemm_reduce_scatter.default"], targets
    assert "aten.silu.default" in targets and "aten.mul.Tensor" in targets
    (out,) = (n.meta["val"] for n in program.graph.output_node().args[0])
    assert tuple(out.shape) == (64, 256) and out.dtype == torch.bfloat16
