"""tp_mlp: the sequence-parallel MLP block of a Llama layer, built from the GEMM recipes.

Shapes are ``TOKENSxHIDDENxFFN`` for the whole layer: ``TOKENS`` rows of the sequence (divisible by the
world size), the model's hidden size and its FFN size (divisible by the world size). Each rank holds

* ``x``: its [TOKENS / ws, HIDDEN] rows of the sequence (sequence parallelism between the layers);
* ``w_gate_up``: [HIDDEN, 2 * FFN / ws], its column slice of the gate projection then of the up projection
  (the fused [gate | up] weight, column parallel);
* ``w_down``: [FFN / ws, HIDDEN], the matching row slice of the down projection (row parallel);

and gets back its [TOKENS / ws, HIDDEN] rows of ``down(silu(gate(X)) * up(X))`` for the whole sequence X:
``all_gather(x) @ w_gate_up``, SwiGLU, then ``@ w_down`` summed over the ranks and scattered by rows.
``tp_mlp`` below is that block for a model to lift; the per-rank shapes of Llama-3 8B (4096, 14336) and 70B
(8192, 28672) are the defaults. Backends, all checked against the NCCL baseline (and against float64 by
``test/test_tp_mlp_gpu.py``):

* ``nccl``: ``all_gather_into_tensor``, cuBLAS, SwiGLU, cuBLAS, ``reduce_scatter_tensor``;
* ``torch_fused``: torch's ``symm_mem.fused_all_gather_matmul`` and ``fused_matmul_reduce_scatter``, eager;
* ``torch_async_tp``: the same block on functional collectives under ``torch.compile`` with
  ``_micro_pipeline_tp`` (inductor rewrites it into those two fused ops: torch's async tensor parallelism);
* ``triton`` / ``helion``: ``tp_mlp`` with the kraken recipes (``kraken.fused.all_gather_matmul``,
  ``kraken.gemm_reduce_scatter``) or with their Helion twins;
* ``triton_compiled`` / ``helion_compiled``: the same under ``torch.compile``: the recipes are operators that
  inductor leaves alone (``kraken/runtime/library.py``), and it fuses the SwiGLU between them into one kernel;
* ``matmul``: the two GEMMs and SwiGLU on an already gathered ``x`` (no exchange, its own partial product
  only): the floor the fused blocks aim for, timed, not checked.
"""

from __future__ import annotations

import functools
import warnings

import torch
import torch.distributed as dist
import torch.nn.functional as F

import helion_ports
import kraken
from benchmark.registry import Op, gemm_us, nvlink_us, register

OUT_DTYPE = torch.bfloat16  # gemm_reduce_scatter's bf16 output: the block's output dtype
LLAMA3 = {"8B": (4096, 14336), "70B": (8192, 28672)}  # (hidden, ffn)
DEFAULT_SHAPES = [(tokens, hidden, ffn) for hidden, ffn in LLAMA3.values() for tokens in (2048, 8192)]


# ---------------------------------------------------------------------------
# The block
# ---------------------------------------------------------------------------


def swiglu(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` of a [rows, 2 f] product whose first f columns are the gate's."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def tp_mlp(
    x: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    group: dist.ProcessGroup | str | None = None,
    recipes=kraken,
) -> torch.Tensor:
    """The sequence-parallel Llama MLP on this rank's rows: ``reduce_scatter(swiglu(all_gather(x) @ w_gate_up)
    @ w_down)``, each exchange fused into its GEMM.

    ``x`` [T, H]: this rank's rows of the sequence, bf16; ``w_gate_up`` [H, 2 f]: this rank's gate columns then
    its up columns (f = FFN / world size); ``w_down`` [f, H]. Returns this rank's [T, H] rows of the layer's
    output, bf16. ``group``: the tensor-parallel group (a device mesh dimension's, ``mesh.get_group("tp")``).
    ``recipes``: where ``all_gather_matmul`` and ``gemm_reduce_scatter`` come from (``kraken``, or
    ``helion_ports`` for the Helion twins).
    """
    gate_up = recipes.all_gather_matmul(x, w_gate_up, group)
    return recipes.gemm_reduce_scatter(swiglu(gate_up), w_down, group, out_dtype=OUT_DTYPE)


# ---------------------------------------------------------------------------
# Inputs
# ---------------------------------------------------------------------------


def rank_operands(shape, dtype, seed: int, rank: int, world_size: int, device="cuda"):
    """Rank ``rank``'s ``x`` rows and its weight slices; any rank can rebuild any other's (float64 references).
    The weights are scaled by 1/sqrt(fan-in) so that every activation stays of order one."""
    tokens, hidden, ffn = shape
    gen = torch.Generator(device=device).manual_seed(seed * 1000 + rank)
    x = torch.randn(tokens // world_size, hidden, device=device, generator=gen)
    gen.manual_seed(seed * 1000 + 500 + rank)
    w_gate_up = torch.randn(hidden, 2 * ffn // world_size, device=device, generator=gen) / hidden ** 0.5
    w_down = torch.randn(ffn // world_size, hidden, device=device, generator=gen) / ffn ** 0.5
    return x.to(dtype), w_gate_up.to(dtype), w_down.to(dtype)


def reference(shape, dtype, seed: int, rank: int, world_size: int, device="cuda") -> torch.Tensor:
    """Rank ``rank``'s rows of the whole layer's output in float64, from every rank's operands rebuilt."""
    operands = [rank_operands(shape, dtype, seed, r, world_size, device) for r in range(world_size)]
    gathered = torch.cat([x for x, _, _ in operands]).double()
    total = sum(swiglu(gathered @ w_gate_up.double()) @ w_down.double() for _, w_gate_up, w_down in operands)
    return total.chunk(world_size)[rank]


def check_shape(shape, dtype, world_size: int) -> None:
    tokens, _, ffn = shape
    if dtype != torch.bfloat16:
        raise ValueError(f"tp_mlp: bf16 only (the block's output is bf16), got {dtype}")
    if tokens % world_size or ffn % world_size:
        raise ValueError(f"tp_mlp: TOKENS = {tokens} and FFN = {ffn} must be divisible by the world size {world_size}")


def make_inputs(shape, dtype, seed, group: dist.ProcessGroup | None = None):
    world_size, rank = dist.get_world_size(group), dist.get_rank(group)
    check_shape(shape, dtype, world_size)
    x, w_gate_up, w_down = rank_operands(shape, dtype, seed, rank, world_size)
    gathered = x.new_empty(world_size * x.shape[0], x.shape[1])
    dist.all_gather_into_tensor(gathered, x, group=group)  # for the matmul-alone backend only
    return {"x": x, "w_gate_up": w_gate_up, "w_down": w_down, "gathered": gathered, "group": group}


# ---------------------------------------------------------------------------
# Backends
# ---------------------------------------------------------------------------


def group_of(i) -> dist.ProcessGroup:
    return i["group"] or dist.group.WORLD


def nccl(i):
    group, x = group_of(i), i["x"]
    world_size = dist.get_world_size(group)
    gathered = x.new_empty(world_size * x.shape[0], x.shape[1])
    dist.all_gather_into_tensor(gathered, x, group=group)
    partial = swiglu(gathered @ i["w_gate_up"]) @ i["w_down"]
    band = partial.new_empty(x.shape[0], partial.shape[1])
    dist.reduce_scatter_tensor(band, partial, group=group)
    return band


def torch_fused(i):
    name = group_of(i).group_name
    _, (gate_up,) = torch.ops.symm_mem.fused_all_gather_matmul(i["x"], [i["w_gate_up"]], 0, name, return_A=False)
    return torch.ops.symm_mem.fused_matmul_reduce_scatter(swiglu(gate_up), i["w_down"], "sum", 0, name)


def functional_block(x, w_gate_up, w_down, group):
    """The block on functional collectives: what ``_micro_pipeline_tp`` pattern-matches under torch.compile."""
    from torch.distributed import _functional_collectives as funcol

    gathered = funcol.all_gather_tensor(x, 0, group)
    return funcol.reduce_scatter_tensor(swiglu(gathered @ w_gate_up) @ w_down, "sum", 0, group)


@functools.cache
def async_tp(group: dist.ProcessGroup):
    """``functional_block`` compiled with torch's async tensor parallelism, one compile per shape (static)."""
    from torch.distributed import _symmetric_memory as symm_mem

    with warnings.catch_warnings():
        # Deprecated in torch 2.11, but inductor's pass still checks that the group has symmetric memory on.
        warnings.simplefilter("ignore", FutureWarning)
        symm_mem.enable_symm_mem_for_group(group.group_name)
    block = functools.partial(functional_block, group=group)
    # Shape padding off: inductor's pad_mm pads a matmul whose rows are not a multiple of 8 (an odd token count) when
    # a timing says so, and a padded matmul is no longer the reduce-scatter's producer, so the async-TP rewrite
    # skips it ("no producer matmul found"): at such shapes the row would be unfused on some compiles and not others.
    return torch.compile(block, fullgraph=True, dynamic=False,
                         options={"_micro_pipeline_tp": True, "shape_padding": False})


def torch_async_tp(i):
    return async_tp(group_of(i))(i["x"], i["w_gate_up"], i["w_down"])


def recipes(package):
    return lambda i: tp_mlp(i["x"], i["w_gate_up"], i["w_down"], i["group"], recipes=package)


@functools.cache
def compiled_block(recipes, group: dist.ProcessGroup):
    """``tp_mlp`` with ``recipes`` under ``torch.compile``, one compile per shape (static).

    Every (recipes, group, shape) is a compile of the one ``tp_mlp`` function: Dynamo keeps them per code
    object, and its default limit of 8 (hit at the default shapes with both packages, a hard error under
    ``fullgraph=True``) is raised for this benchmark."""
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
    return torch.compile(functools.partial(tp_mlp, group=group, recipes=recipes), fullgraph=True, dynamic=False)


def compiled(package):
    return lambda i: compiled_block(package, group_of(i))(i["x"], i["w_gate_up"], i["w_down"])


def matmul(i):
    return swiglu(i["gathered"] @ i["w_gate_up"]) @ i["w_down"]


BACKENDS = {"nccl": nccl, "torch_fused": torch_fused, "torch_async_tp": torch_async_tp,
            "triton": recipes(kraken), "helion": recipes(helion_ports),
            "triton_compiled": compiled(kraken), "helion_compiled": compiled(helion_ports),
            "matmul": matmul}


# ---------------------------------------------------------------------------
# Registration
# ---------------------------------------------------------------------------


def flops(shape) -> float:
    """The whole layer's: [T, H] @ [H, 2 FFN] and [T, FFN] @ [FFN, H]."""
    tokens, hidden, ffn = shape
    return 6.0 * tokens * hidden * ffn


def nvlink_bytes(shape, dtype, world_size):
    # Every rank receives the other ranks' rows of x, and (ws-1)/ws of its band's partials in bf16.
    tokens, hidden, _ = shape
    return 2 * (world_size - 1) / world_size * tokens * hidden * dtype.itemsize


def floor_us(shape, dtype, world_size):
    # This rank's GEMMs at the measured peak; both exchanges can hide under them.
    return max(gemm_us(flops(shape) / world_size), nvlink_us(nvlink_bytes(shape, dtype, world_size)))


register(
    Op(
        name="tp_mlp",
        description="sequence-parallel Llama MLP: all_gather(x) @ [gate|up], SwiGLU, @ down, reduce-scatter",
        make_inputs=make_inputs,
        backends=BACKENDS,
        default_shapes=DEFAULT_SHAPES,
        shape_format="TOKENSxHIDDENxFFN",
        nvlink_bytes=nvlink_bytes,
        floor_us=floor_us,
        library="matmul",  # the one-GPU core table's library column (world size 1)
        work=lambda shape, dtype: (flops(shape), "flop"),
        reference_free=frozenset({"matmul"}),
    )
)
