"""The all-gather + matmul recipes' product layer (``kraken.all_gather_matmul``, ``kraken.all_gather_matmul_fp8`` and
their twins), wrapped around the recipes ``kraken.fused.all_gather_matmul`` and ``kraken.fused.all_gather_matmul_fp8``
from outside.

A recipe holds the kernels, its pure ``plan`` and its ``launch`` seam (the gather on the copy engine under the GEMM),
made of parts this layer also drives one by one (``tma_inputs`` or ``stage``, ``gather``, ``launch_matmul``).
What the installed package adds lives here:

* the checks, agreed across ranks on the first call of each signature (``agreement.agreed``: one rank's bad input
  raises on every rank; ``kraken.runtime.gemm_checks``);
* the form, fused or sequential (the SM-driven all-gather, then cuBLAS or ``torch._scaled_mm``), chosen by size
  (``kraken.runtime.crossover``) and kept with the prepared call (``chosen``);
* the prepared call per signature: the symmetric gather buffer (a slice of ``symm.symm_workspace``), every rank's
  own chunk of it, the flags, the plan and a ``Launcher`` (``prepare``);
* the public call, driving the recipe's kernels or its twin's (``all_gather_matmul_with``): its fork, the gather's
  exchange, the GEMM and the join replayed from one CUDA graph per pointer set (``graphs.graphed``) when the same
  addresses come back; on new ones (a model's layers), the launch in pieces that new addresses do not change: the
  exchange but the staging of ``a`` as one CUDA graph per prepared call, the GEMM as one replayed launch
  (``in_pieces``).
"""

from __future__ import annotations

import functools
import importlib
import inspect

import torch
import torch.distributed as dist

from kraken._gemm_core import MAX_INDEX
from kraken.runtime import agreement, crossover, graphs, groups, prepared, replay, symm
from kraken.runtime.gemm_checks import check_fp8_inputs, check_inputs
from kraken.runtime.launcher import Launcher, launch_hooked
from kraken.runtime.progress import copy_stream, fork, join, on_stream, reset_flags

# The recipes' modules: their plans and buffer layouts (tests replace them there), their ``launch`` by name.
BF16 = importlib.import_module("kraken.fused.all_gather_matmul")
FP8 = importlib.import_module("kraken.fused.all_gather_matmul_fp8")
OP, OP_FP8 = BF16.OP, FP8.OP


def sm_all_gather(package: str):
    """``<package>.all_gather`` (``kraken`` or ``helion_ports``: the installed SM-driven collective), looked up at
    its first use."""
    found = []

    def all_gather(tensor: torch.Tensor, group) -> torch.Tensor:
        if not found:
            found.append(getattr(importlib.import_module(package), "all_gather"))
        return found[0](tensor, group)

    return all_gather


# ---------------------------------------------------------------------------
# What both share: every rank's own chunk of its gather buffer, the flags
# ---------------------------------------------------------------------------

_chunks: dict[tuple, tuple[torch.Tensor, ...]] = {}


def chunk_views(ctx: symm.SymmContext, m: int) -> tuple[torch.Tensor, ...]:
    """Rank r's own chunk (rows r * m ...) of rank r's gather buffer, for every r (cached)."""
    key = tuple(p.data_ptr() for p in ctx.peers) + (m, ctx.peers[0].shape[1])
    if key not in _chunks:
        _chunks[key] = tuple(p[r * m:(r + 1) * m] for r, p in enumerate(ctx.peers))
    return _chunks[key]


_flags: dict[tuple, torch.Tensor] = {}


def progress_flags(world_size: int, device: torch.device) -> torch.Tensor:
    """The flags of one launch, a rank's chunk each (cached; zeroed by every launch before its gather starts)."""
    key = (device, world_size)
    if key not in _flags:
        _flags[key] = torch.zeros(world_size, dtype=torch.int32, device=device)
    return _flags[key]


# ---------------------------------------------------------------------------
# all_gather_matmul
# ---------------------------------------------------------------------------


def check_sequential(a: torch.Tensor, b: torch.Tensor, world_size: int, op: str) -> None:
    """The sequential form's checks (``kraken.runtime.crossover.form`` runs them inside its agreement)."""
    check_inputs(a, b, None, op, wide=True, any_b=True)


@prepared.per_signature(lambda a, b, group, op, config, return_a: (
    op, group, prepared.tensor_key(a), prepared.tensor_key(b), prepared.scalar_key(return_a),
    prepared.config_key(config)))
def chosen(a: torch.Tensor, b: torch.Tensor, group, op: str, config: dict, return_a: bool):
    """``crossover.SEQUENTIAL`` or the fused form's ``prepare``, kept per signature (``crossover.fused_prepared``)."""
    return crossover.fused_prepared(op, a, b, group, True, True, config, check_sequential,
                                    lambda fused_config: prepare(a, b, group, op, fused_config, return_a))


@prepared.per_signature(lambda a, b, group, op, config, return_a: (
    op, group, prepared.tensor_key(a), prepared.tensor_key(b), prepared.scalar_key(return_a),
    prepared.config_key(config)))
def prepare(
    a: torch.Tensor, b: torch.Tensor, group, op: str, config: dict, return_a: bool
) -> tuple[symm.SymmContext, dict]:
    """Validate, plan, and find the buffers: the context of the symmetric gather buffer [world_size * M, K']
    (K' = K padded for TMA; a slice of ``symm.symm_workspace``), and the launch arguments but the outputs
    (every rank's own chunk of it as ``peers``, ``gathered``, ``progress``, the config); kept per signature."""
    # Local checks; the first call of each signature also agrees on them (and on the shapes) across ranks.
    with agreement.agreed(op, group, a=a, b=b, return_a=return_a, config=config):
        check_inputs(a, b, None, op, wide=True, any_b=True)
        (m, k), n = a.shape, b.shape[1]
        world_size = groups.world_size_of(group, op)
        num_sms = torch.cuda.get_device_properties(a.device).multi_processor_count
        cfg = BF16.plan(m, n, k, world_size, config, num_sms)
    pg = groups.resolve_group(group, op)
    k_tma = groups.round_up(k, 16 // a.element_size())
    gathered = symm.symm_workspace(world_size * m * k_tma, a.dtype, a.device, pg, op).view(world_size * m, k_tma)
    ctx = symm.symm_context(gathered, pg, op, name="gather buffer")
    chunks = chunk_views(ctx, m)
    progress = progress_flags(world_size, a.device)
    return ctx, {"peers": chunks, "gathered": gathered, "progress": progress, **cfg, "launcher": Launcher(op)}


def outputs(a: torch.Tensor, b: torch.Tensor, gathered: torch.Tensor, return_a: bool) -> dict:
    """A call's new tensors: ``out`` [world_size * M, N], and ``a_out`` (the gathered ``a``) when ``return_a``."""
    a_out = torch.empty(gathered.shape, dtype=a.dtype, device=a.device) if return_a else None
    return {"out": torch.empty(gathered.shape[0], b.shape[1], dtype=a.dtype, device=a.device), "a_out": a_out}


def call(recipe, op: str, a: torch.Tensor, b: torch.Tensor, group, return_a: bool, config: dict, all_gather
         ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """``all_gather_matmul`` with a given ``recipe`` (the recipe's module or its twin's) and ``all_gather`` under
    the name ``op``, in the form ``crossover`` chooses. Sequential: ``all_gather`` (the SM-driven collective) of
    ``a``, then cuBLAS on the gathered rows. Fused: the prepared call, the new outputs, and the launch: replayed from
    one CUDA graph per pointer set (``graphs.graphed``) when the same addresses come back, else in its pieces
    (``in_pieces``); in a group of one without ``return_a``, the GEMM's replayed launch alone (``gemm_replayed``):
    a model's new addresses would never replay a graph, and without one a warm loop costs what a model's call costs."""
    prepared = chosen(a, b, group, op, config, return_a)
    if prepared == crossover.SEQUENTIAL:
        gathered = all_gather(a, group)
        out = torch.matmul(gathered, b)
        return (gathered, out) if return_a else out
    ctx, cfg = prepared
    new = outputs(a, b, cfg["gathered"], return_a)
    out, a_out = new["out"], new["a_out"]
    if cfg["gathered"].shape[1] != a.shape[1]:  # K padded for TMA: the whole launch stages the zero-padded rows
        run = lambda: recipe.launch(a, b, signal_pad_ptrs=ctx.signal_pad_ptrs, rank=ctx.rank,  # noqa: E731
                                    **cfg, **new, group_name=ctx.group_name)
    elif len(cfg["peers"]) == 1 and a_out is None:  # nothing to exchange: one replayed launch, no graph needed
        if not gemm_replayed(recipe, cfg, (out, a, b)):
            in_pieces(recipe, ctx, cfg, a, b, out, None)
        return out
    else:
        run = lambda: in_pieces(recipe, ctx, cfg, a, b, out, a_out)  # noqa: E731
    graphs.graphed((cfg["launcher"], a.data_ptr(), b.data_ptr(), out.data_ptr(),
                    a_out is not None and a_out.data_ptr()), run, a.device)
    return out if not return_a else (a_out[:, :a.shape[1]], out)


def gemm_replayed(recipe, cfg: dict, args: tuple) -> bool:
    """Whether the GEMM's replay (``pieces``'s, on ``args``) ran: a group of one with nothing to exchange calls that
    launch alone, and once it is recorded skips ``in_pieces``'s frames and closures (as ``replay.prepared_launch``)."""
    replay_of = cfg["launcher"].replays.get(recipe.launch_matmul)
    if replay_of is None or launch_hooked():
        return False
    replay_of(args)
    return True


def in_pieces(recipe, ctx: symm.SymmContext, cfg: dict, a: torch.Tensor, b: torch.Tensor, out: torch.Tensor,
              a_out: torch.Tensor | None) -> None:
    """The recipe's ``launch`` (K needing no padding) in pieces that new addresses do not change (``pieces``): my
    rows staged with a copy, the GEMM on ``tma_inputs``."""
    peers, gathered, flags, launcher = cfg["peers"], cfg["gathered"], cfg["progress"], cfg["launcher"]

    def gemm(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        a_tma, b_tma, b_trans = recipe.tma_inputs(a, b, cfg["b_layout"], cfg["block_m"])
        return recipe.launch_matmul(a_tma, gathered, b_tma, out, flags, ctx.rank, len(peers), b_trans,
                                    cfg["block_m"], cfg["block_n"], cfg["block_k"], cfg["group_m"], cfg["num_warps"],
                                    cfg["num_stages"], cfg["num_blocks"], launcher)

    pieces(recipe, ctx, cfg, a.device, lambda: peers[ctx.rank].copy_(a), gemm, (out, a, b),
           None if a_out is None else lambda: a_out.copy_(gathered))


def pieces(recipe, ctx: symm.SymmContext, cfg: dict, device: torch.device, stage, gemm, args: tuple,
           snapshot=None) -> None:
    """A fused call in pieces that new addresses do not change: a model's layers call with new activations and
    their own weights, so a graph per address set would be captured for one replay.

    Of the exchange's work only ``stage()`` (my rows into my chunk) and ``snapshot()`` (``a_out``) read this call's
    addresses; the rest (the barriers, the peers' chunks and their flags: ``recipe.gather``) reads the prepared
    call's buffers alone, so it is one CUDA graph per prepared call (``graphs.graphed``), replayed on the side
    stream. ``gemm(*args)`` (``args``: this call's tensors) is one replayed launch (``replay.replayed``). The order
    is the recipe's: the flags reset before the fork, the GEMM queued after the exchange (its blocks wait on the
    exchange's flags), the join after the GEMM. A group of one without a snapshot has nothing to exchange: the GEMM
    alone."""
    flags, launcher = cfg["progress"], cfg["launcher"]
    world_size = len(cfg["peers"])
    side = copy_stream(device) if world_size > 1 or snapshot is not None else None
    if side is not None:
        if world_size > 1:
            reset_flags(flags)
        fork(side)
        with on_stream(side):
            stage()
            exchange = exchange_of(recipe)
            graphs.graphed((("gather", launcher),), lambda: exchange(ctx, cfg), device)
            if snapshot is not None:  # (after the closing barrier: only this rank writes its buffer)
                snapshot()
    replay.replayed(launcher, recipe.launch_matmul, args, lambda: gemm(*args), (ctx, cfg))
    if side is not None:
        join(side)


@functools.cache
def exchange_of(recipe):
    """``exchange(ctx, cfg)``: ``recipe.gather`` on a prepared call's buffers, with no ``a_out`` snapshot, spelled
    once per recipe for its signature (the bf16 ones take ``a_out``, the twins Helion's ``group_name``)."""
    parameters = inspect.signature(recipe.gather).parameters
    snapshot = (None,) if "a_out" in parameters else ()
    takes_name = "group_name" in parameters

    def exchange(ctx: symm.SymmContext, cfg: dict) -> None:
        named = {"group_name": ctx.group_name} if takes_name else {}
        recipe.gather(cfg["peers"], cfg["gathered"], cfg["progress"], ctx.signal_pad_ptrs, ctx.rank, *snapshot,
                      launcher=cfg["launcher"], **named)

    return exchange


def all_gather_matmul_with(recipe, op: str, package: str):
    """The installed all-gather + matmul, driving ``recipe``'s kernels: the recipe's module
    (``kraken.all_gather_matmul``) or its Helion twin's (``helion_ports.all_gather_matmul``, ``op`` "helion
    all_gather_matmul"); the sequential form gathers with ``<package>.all_gather``."""
    all_gather = sm_all_gather(package)

    def all_gather_matmul(
        a: torch.Tensor,
        b: torch.Tensor,
        group: dist.ProcessGroup | str | None = None,
        return_a: bool = False,
        **config,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """``all_gather(a) @ b`` as a new [world_size * M, N] tensor in ``a``'s dtype (and the gathered
        [world_size * M, K] ``a`` first when ``return_a``).

        ``a`` [M, K]: this rank's rows, an ordinary contiguous CUDA tensor, bf16 or fp16, the same shape on
        every rank; ``b`` [K, N] in any layout. ``config`` overrides the tiles (``block_m``, ``block_n``,
        ``block_k``, ``num_warps``, ``num_stages``, ``group_m``), ``max_blocks`` and ``b_layout`` (see the recipe's
        ``plan``); ``form="fused"`` or ``"sequential"`` forces the form ``kraken.runtime.crossover`` would choose by
        size.
        """
        return call(recipe, op, a, b, group, return_a, config, all_gather)

    return all_gather_matmul


all_gather_matmul = all_gather_matmul_with(BF16, OP, "kraken")


# ---------------------------------------------------------------------------
# all_gather_matmul_fp8
# ---------------------------------------------------------------------------


def check_sequential_fp8(a: torch.Tensor, b: torch.Tensor, world_size: int, op: str, scale_a: torch.Tensor,
                         scale_b: torch.Tensor) -> None:
    """The sequential form's checks (``kraken.runtime.crossover.form`` runs them inside its agreement)."""
    check_fp8_inputs(a, b, scale_a, scale_b, op)


@prepared.per_signature(lambda a, b, scale_a, scale_b, group, op, config: (
    op, group, prepared.tensor_key(a), prepared.tensor_key(b), prepared.tensor_key(scale_a),
    prepared.tensor_key(scale_b), prepared.config_key(config)))
def chosen_fp8(a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor, group, op: str,
               config: dict):
    """``crossover.SEQUENTIAL`` or the fused form's ``prepare_fp8``, kept per signature; sequential only where
    ``torch._scaled_mm`` takes K and N (multiples of 16)."""
    sequential_ok = all(isinstance(t, torch.Tensor) and t.dim() == 2 and t.shape[1] % 16 == 0 for t in (a, b))
    return crossover.fused_prepared(op, a, b, group, True, sequential_ok, config, check_sequential_fp8,
                                    lambda fused_config: prepare_fp8(a, b, scale_a, scale_b, group, op, fused_config),
                                    None, (scale_a, scale_b))


def gather_then_scaled_mm(all_gather, a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor,
                          scale_b: torch.Tensor, group) -> torch.Tensor:
    """The sequential form (K and N multiples of 16): ``all_gather`` (the SM-driven collective) of the fp8 values, as
    bf16 pairs of bytes, and of the row scales (a per-tensor scale becomes every row's: ranks may hold different
    ones), then ``torch._scaled_mm`` with row-wise scales on a column-major ``b``."""
    m = a.shape[0]
    values = all_gather(a.view(torch.bfloat16), group).view(FP8.FP8)
    rows = all_gather(scale_a.reshape(-1, 1), group)
    if scale_a.numel() == 1:
        rows = rows.repeat_interleave(m, dim=0)
    col_scales = scale_b.reshape(1, -1).expand(1, b.shape[1]).contiguous()
    b_cols = b if b.stride(0) == 1 else b.t().contiguous().t()
    return torch._scaled_mm(values, b_cols, rows, col_scales, out_dtype=FP8.OUT_DTYPE)


@prepared.per_signature(lambda a, b, scale_a, scale_b, group, op, config: (
    op, group, prepared.tensor_key(a), prepared.tensor_key(b), prepared.tensor_key(scale_a),
    prepared.tensor_key(scale_b), prepared.config_key(config)))
def prepare_fp8(
    a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor, group, op: str, config: dict
) -> tuple[symm.SymmContext, dict]:
    """Validate, plan, and find the buffers: the context of the symmetric gather buffer (bytes,
    [world_size * M, ``row_bytes(K)``], a slice of ``symm.symm_workspace``), and the launch arguments but
    the output (every rank's own chunk of it as ``peers``, this rank's as fp8 values and fp32 scales,
    ``progress``, the config); kept per signature."""
    with agreement.agreed(op, group, a=a, b=b, scale_a=scale_a, scale_b=scale_b, config=config):
        check_fp8_inputs(a, b, scale_a, scale_b, op)
        (m, k), n = a.shape, b.shape[1]
        world_size = groups.world_size_of(group, op)
        if max(world_size * m * max(FP8.row_bytes(k), n), k * n) > MAX_INDEX:
            raise ValueError(f"{op}: the gathered a, b or the output has more than 2**31 - 1 elements (32-bit offsets)")
        num_sms = torch.cuda.get_device_properties(a.device).multi_processor_count
        cfg = FP8.plan(m, n, k, world_size, config, num_sms)
    pg = groups.resolve_group(group, op)
    width = FP8.row_bytes(k)
    gathered = symm.symm_workspace(world_size * m * width, torch.uint8, a.device, pg, op).view(world_size * m, width)
    ctx = symm.symm_context(gathered, pg, op, name="gather buffer")
    chunks = chunk_views(ctx, m)
    own_values, own_scales = FP8.buffer_views(chunks[ctx.rank], k)
    return ctx, {"peers": chunks, "gathered": gathered, "own_values": own_values, "own_scales": own_scales,
                 "progress": progress_flags(world_size, a.device), **cfg, "launcher": Launcher(op)}


def call_fp8(recipe, op: str, a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor, group,
             config: dict, all_gather) -> torch.Tensor:
    """``all_gather_matmul_fp8`` with a given ``recipe`` (the recipe's module or its twin's) and ``all_gather`` under
    the name ``op``, in the form ``crossover`` chooses. Sequential: ``gather_then_scaled_mm``. Fused: the prepared
    call, the new output, and the launch: replayed from one CUDA graph per pointer set (``graphs.graphed``) when the
    same addresses come back, else in its pieces (``in_pieces_fp8``); in a group of one, the GEMM's replayed launch
    alone."""
    prepared = chosen_fp8(a, b, scale_a, scale_b, group, op, config)
    if prepared == crossover.SEQUENTIAL:
        return gather_then_scaled_mm(all_gather, a, b, scale_a, scale_b, group)
    ctx, cfg = prepared
    out = torch.empty(cfg["gathered"].shape[0], b.shape[1], dtype=FP8.OUT_DTYPE, device=a.device)
    if len(cfg["peers"]) == 1:  # nothing to exchange: one replayed launch, no graph needed
        if not gemm_replayed(recipe, cfg, (out, a, b, scale_a, scale_b)):
            in_pieces_fp8(recipe, ctx, cfg, a, b, scale_a, scale_b, out)
        return out
    graphs.graphed((cfg["launcher"], a.data_ptr(), b.data_ptr(), scale_a.data_ptr(), scale_b.data_ptr(),
                    out.data_ptr()),
                   lambda: in_pieces_fp8(recipe, ctx, cfg, a, b, scale_a, scale_b, out), a.device)
    return out


def in_pieces_fp8(recipe, ctx: symm.SymmContext, cfg: dict, a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor,
                  scale_b: torch.Tensor, out: torch.Tensor) -> None:
    """The fp8 recipe's ``launch`` in pieces that new addresses do not change (``pieces``): my rows and their
    scales staged by the recipe's ``stage`` kernel, the GEMM on ``tma_fp8`` and ``b_operand``."""
    launcher, world_size = cfg["launcher"], len(cfg["peers"])

    def gemm(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor
             ) -> torch.Tensor:
        b_tma, b_trans = recipe.b_operand(b, cfg["b_layout"])
        return recipe.launch_matmul(recipe.tma_fp8(a, cfg["block_m"]), scale_a, cfg["gathered"], b_tma, scale_b, out,
                                    cfg["progress"], ctx.rank, world_size, a.shape[1], b_trans, cfg["block_m"],
                                    cfg["block_n"], cfg["block_k"], cfg["group_m"], cfg["num_warps"],
                                    cfg["num_stages"], cfg["num_blocks"], launcher)

    pieces(recipe, ctx, cfg, a.device,
           lambda: recipe.stage(a, scale_a, cfg["own_values"], cfg["own_scales"], launcher), gemm,
           (out, a, b, scale_a, scale_b))


def all_gather_matmul_fp8_with(recipe, op: str, package: str):
    """The installed fp8 all-gather + matmul, driving ``recipe``'s kernels: the recipe's module or its Helion
    twin's."""
    all_gather = sm_all_gather(package)

    def all_gather_matmul_fp8(
        a: torch.Tensor,
        b: torch.Tensor,
        scale_a: torch.Tensor,
        scale_b: torch.Tensor,
        group: dist.ProcessGroup | str | None = None,
        **config,
    ) -> torch.Tensor:
        """``(all_gather(a) * all_gather(scale_a)) @ (b * scale_b)`` as a new [world_size * M, N] bf16 tensor,
        accumulated in fp32: what ``torch._scaled_mm`` gives on the gathered operands.

        ``a`` [M, K]: this rank's rows, a contiguous ``float8_e4m3fn`` CUDA tensor, the same shape on every rank;
        ``b`` [K, N] fp8 in any layout (column-major, ``w.t()``, is read in place); ``scale_a`` float32, one
        element or [M, 1] (each rank its own); ``scale_b`` float32, one element or [1, N]. ``config`` overrides
        the tiles (``block_m``, ``block_n``, ``block_k``, ``num_warps``, ``num_stages``, ``group_m``),
        ``max_blocks`` and ``b_layout`` (see the recipe's ``plan`` and ``B_LAYOUTS``); ``form="fused"`` or
        ``"sequential"`` forces the form ``kraken.runtime.crossover`` would choose by size.
        """
        return call_fp8(recipe, op, a, b, scale_a, scale_b, group, config, all_gather)

    return all_gather_matmul_fp8


all_gather_matmul_fp8 = all_gather_matmul_fp8_with(FP8, OP_FP8, "kraken")
