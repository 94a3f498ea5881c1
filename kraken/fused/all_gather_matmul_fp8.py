"""FP8 all-gather + matmul: ``_scaled_mm(all_gather(a), b, all_gather(scale_a), scale_b)`` in bf16.

``kraken.fused.all_gather_matmul`` for ``torch.float8_e4m3fn`` operands with scales, in the layouts
``torch._scaled_mm`` takes: ``scale_a`` per tensor (one element) or per row ([M, 1]), ``scale_b`` per
tensor or per column ([1, N]), all float32. fp8 halves the bytes the gather moves and doubles the
tensor cores' rate, so the same protocol has twice as much GEMM per byte to hide the exchange under.

* The gathered operand travels as fp8 *with its row scales*: each row of the symmetric gather buffer
  (bytes, [world_size * M, ``row_bytes(K)``]) holds the row's K fp8 values and, at byte K' (K rounded
  up to 16), its fp32 scale (a per-tensor ``scale_a`` is written into every row: ranks may have
  different ones). Rows start on 128-byte boundaries: a TMA box row (128 fp8 values) then sits in one
  128-byte line (one H200, 256x8192x8192 on 128x128 tiles: 35.8 us with 16-byte aligned rows, 27.8
  with 128-byte aligned ones). One contiguous copy per peer chunk moves both, on the copy engine, with
  the chunk's flag (``kraken.comm.all_gather_with_progress``); no second gather, no second flag.
* Staging runs on the gather's side stream, before its first barrier (``stage``: one kernel, a block per
  16 rows x 512 bytes, writes this rank's values and scales into its chunk), and only for the peers: the
  GEMM reads my rows from ``a`` itself and their scales from ``scale_a``, so it starts at once and a
  group of one stages nothing (one H200, 256x8192x8192: on the current stream, the staging kernel and its
  gap to the GEMM cost 2.7 us of 33). A block waits (acquire + async-proxy fence, ``wait_async``) only at
  its first tile of each peer's chunk.
* The GEMM is the bf16 recipe's kernel (``all_gather_matmul_kernel`` with ``SCALED``: own rows first, from
  ``a``, then rank + 1's, ..., from the buffer, ``GROUP_M``-row bands), on 128-wide k steps (the same bytes
  per stage as bf16's 64), planned by its ``tile_plan`` over this recipe's ``TILE_CONFIGS``. The
  descriptor over the gathered values has shape [world_size * M, K] with the buffer's row stride:
  TMA zero-fills past K, and the scale bytes are never read as values.
* ``b``: Hopper's fp8 wgmma takes both operands K-major from shared memory. A column-major ``b``
  (``w.t()`` of an [N, K] weight, what ``_scaled_mm`` wants) is read in place as [N, K] in
  ``BLOCK_N x BLOCK_K`` boxes and each tile is transposed as a shared-memory view (``B_TRANS``): wgmma
  reads the TMA-written tile as is. A row-major ``b`` [K, N] also compiles to wgmma with Triton 3.6,
  but each k step then moves b's tile through registers into a transposed copy in shared memory
  (sm_90 PTX at 128x256x128: 24 ``ld.shared.v4`` + 96 ``prmt`` + 128 byte-wide ``st.shared`` per k step,
  one wgmma group in flight instead of two, 254 registers instead of 211). ``b_layout="auto"`` reads
  either as stored (pass ``w.t()`` for the fast one), "nk" copies a row-major ``b`` to [N, K] first.
* Accumulation: ``tl.dot`` into an fp32 accumulator. On sm_90 Triton 3.6 lets the tensor cores
  accumulate fp8 products over the whole k loop with no promotion to exact fp32 adds
  (``max_num_imprecise_acc`` defaults to 2**30 there): what ``_scaled_mm(..., use_fast_accum=True)``
  does. The baselines run ``_scaled_mm``'s default (promoting); the GPU tests bound the difference.
* Epilogue: fp32 accumulator times ``scale_a[rows, None] * scale_b[None, cols]`` (a peer's row scales
  from its gathered rows), then bf16, stored masked to the chunk's rows.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import triton
import triton.language as tl

from kraken._gemm_core import FP8, MAX_INDEX, flattens, tma_fp8
from kraken._gemm_core import FP8_B_LAYOUTS as B_LAYOUTS
from kraken._gemm_core import FP8_MAX_BLOCK_K as MAX_BLOCK_K
from kraken._gemm_core import fp8_b_operand as b_operand
from kraken.runtime.collectives import all_gather as sm_all_gather
from kraken.comm.all_gather_with_progress import start as start_gather
from kraken.fused.all_gather_matmul import (  # noqa: F401 (RESERVED_SMS: the plan's, used by tests)
    GROUP_M, RESERVED_SMS, all_gather_matmul_kernel, chunk_views, progress_flags, tile_plan,
)
from kraken.runtime import agreement, crossover, graphs, groups, prepared, symm
from kraken.runtime.gemm_checks import check_fp8_inputs as check_inputs
from kraken.runtime.launcher import Launcher, jit_launch, tma_operand

OP = "all_gather_matmul_fp8"
OUT_DTYPE = torch.bfloat16
SCALE_BYTES = 16  # per gathered row: the fp32 scale, in its own 16 bytes after the values
ROW_ALIGN = 128  # bytes: each gathered row starts on a 128-byte line (TMA reads a box row from one line)
# The bf16 recipe's tiles with k steps twice as long: the same bytes per pipeline stage (fp8 wgmma's k is 32);
# 4 stages on the large tiles (one H200: 512x8192x8192 62.1 us against 65.0 on 3, 1024x6656x5120 71.2 against 72.3),
# 6 on the small ones (256x8192x8192 49.0 us against 51.5 on 4).
TILE_CONFIGS = [
    {"block_m": 128, "block_n": 256, "block_k": 128, "num_warps": 8, "num_stages": 4},
    {"block_m": 128, "block_n": 128, "block_k": 128, "num_warps": 8, "num_stages": 6},
]
DEFAULT_CONFIG = {**TILE_CONFIGS[0], "group_m": GROUP_M, "max_blocks": None, "b_layout": "auto"}


# ---------------------------------------------------------------------------
# Host: operands, the gather buffer's layout, staging
# ---------------------------------------------------------------------------


def row_bytes(k: int) -> int:
    """Bytes per gathered row: K fp8 values rounded up to 16, the fp32 scale in its own 16 bytes, the row
    rounded up to ``ROW_ALIGN``."""
    return groups.round_up(groups.round_up(k, 16) + SCALE_BYTES, ROW_ALIGN)


_views: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}


def buffer_views(gathered: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(values, row scales) of a gather buffer (bytes, [rows, ``row_bytes(k)``]): the fp8 [rows, K] view the
    TMA descriptor covers (the buffer's row stride) and the fp32 [rows] view of each row's scale. Kept per buffer
    and K (every call of a prepared call asks for the same two): four view operations cost more than a launch
    (one H200's host: 6 to 14 us a call). The kept views hold the buffer, so no other tensor takes its address."""
    key = (gathered.data_ptr(), gathered.shape, gathered.dtype, k)
    views = _views.get(key)
    if views is None:
        if len(_views) >= prepared.MAX_PREPARED:
            _views.clear()
        values = gathered.view(FP8)[:, :k]
        scales = gathered.view(torch.float32)[:, groups.round_up(k, 16) // 4]
        views = _views[key] = (values, scales)
    return views


@triton.jit
def stage_kernel(
    a_ptr,  # this rank's rows [M, K], as bytes
    scale_ptr,  # fp32 [M] (SCALE_ROWWISE) or [1]
    values_ptr,  # this rank's chunk of the gather buffer, as bytes: row i at values_ptr + i * row_stride
    scales_ptr,  # fp32: row i's scale at scales_ptr + i * scale_stride
    M,
    K,
    row_stride,
    scale_stride,
    SCALE_ROWWISE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """Block (i, j) copies rows ``i * BLOCK_M ...`` and bytes ``j * BLOCK_K ...`` of ``a``; blocks (i, 0) also
    write their rows' scales."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    row_in = rows < M
    inside = row_in[:, None] & (cols < K)[None, :]
    values = tl.load(a_ptr + rows[:, None] * K + cols[None, :], mask=inside)
    tl.store(values_ptr + rows[:, None] * row_stride + cols[None, :], values, mask=inside)
    if tl.program_id(1) == 0:
        scale = tl.load(scale_ptr + rows * SCALE_ROWWISE, mask=row_in)
        tl.store(scales_ptr + rows * scale_stride, scale, mask=row_in)


# 16 x 512 bytes a block, 64 a thread (four 16-byte accesses in flight), and enough blocks for every SM: a loop
# over k in a block per 8 rows (32 blocks at M = 256) took 4.8 us for 256 x 8192 bytes on one H200.
STAGE_BLOCK_M, STAGE_BLOCK_K, STAGE_WARPS = 16, 512, 4


def stage(a: torch.Tensor, scale_a: torch.Tensor, own_values: torch.Tensor, own_scales: torch.Tensor,
          launcher=jit_launch) -> None:
    """This rank's rows and their scales (a per-tensor scale into every row) into its chunk of the gather
    buffer (``buffer_views``), on the current stream (``launch`` calls it on the gather's side stream): one
    kernel."""
    m, k = a.shape
    grid = (groups.cdiv(m, STAGE_BLOCK_M), groups.cdiv(k, STAGE_BLOCK_K))
    launcher(stage_kernel, grid, a.view(torch.uint8), scale_a,
             own_values.view(torch.uint8), own_scales, m, k, own_values.stride(0), own_scales.stride(0),
             SCALE_ROWWISE=int(scale_a.numel() > 1), BLOCK_M=STAGE_BLOCK_M, BLOCK_K=STAGE_BLOCK_K,
             num_warps=STAGE_WARPS)


def launch_matmul(
    a: torch.Tensor,
    scale_a: torch.Tensor,
    gathered: torch.Tensor,
    b: torch.Tensor,
    scale_b: torch.Tensor,
    out: torch.Tensor,
    progress: torch.Tensor,
    rank: int,
    world_size: int,
    k: int,
    b_trans: bool,
    block_m: int,
    block_n: int,
    block_k: int,
    group_m: int,
    num_warps: int,
    num_stages: int,
    num_blocks: int,
    launcher=jit_launch,
) -> torch.Tensor:
    """The GEMM alone: my rows from ``a`` (a TMA-ready fp8 [M, K], ``tma_fp8``) and ``scale_a``, the peers' from
    the gather buffer (bytes, [world_size * M, ``row_bytes(k)``]), a TMA-ready ``b`` (``b_operand``): the
    consumer of the flags in ``progress``."""
    m, n = out.shape[0] // world_size, out.shape[1]
    values, scales = buffer_views(gathered, k)
    b_box = [block_n, block_k] if b_trans else [block_k, block_n]
    launcher(
        all_gather_matmul_kernel, (num_blocks,),
        tma_operand(a, [block_m, block_k]), tma_operand(values, [block_m, block_k]),
        tma_operand(b, b_box), out, progress, scales, scale_a, scale_b, m, n, k, scales.stride(0),
        rank, world_size, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, GROUP_M=group_m, B_TRANS=b_trans,
        SCALED=True, A_ROWWISE=int(scale_a.numel() > 1), B_COLWISE=int(scale_b.numel() > 1),
        FLATTEN=flattens(block_m, block_n), num_warps=num_warps, num_stages=num_stages,
    )
    return out


def launch(
    a: torch.Tensor,
    b: torch.Tensor,
    scale_a: torch.Tensor,
    scale_b: torch.Tensor,
    peers: tuple[torch.Tensor, ...],
    gathered: torch.Tensor,
    own_values: torch.Tensor,
    own_scales: torch.Tensor,
    out: torch.Tensor,
    progress: torch.Tensor,
    signal_pad_ptrs: int,
    rank: int,
    b_layout: str,
    block_m: int,
    block_n: int,
    block_k: int,
    group_m: int,
    num_warps: int,
    num_stages: int,
    num_blocks: int,
    group_name: str = "",
    launcher=jit_launch,
) -> torch.Tensor:
    """Launch on prepared arguments (no checks); the same signature as the Helion port's ``launch``.

    ``gathered`` is this rank's symmetric gather buffer (bytes, [world_size * M, ``row_bytes(K)``]),
    ``peers[r]`` rank r's own chunk of rank r's, ``own_values`` / ``own_scales`` this rank's chunk as fp8
    values and fp32 scales (``buffer_views``); ``out`` [world_size * M, N] bf16; ``group_name`` is unused here.
    """
    b, b_trans = b_operand(b, b_layout)
    started = start_gather(peers, signal_pad_ptrs, rank, gathered, progress, launcher=launcher, flag_own=False,
                           stage_launch=lambda: stage(a, scale_a, own_values, own_scales, launcher))
    launch_matmul(tma_fp8(a, block_m), scale_a, gathered, b, scale_b, out, progress, rank, len(peers), a.shape[1],
                  b_trans, block_m, block_n, block_k, group_m, num_warps, num_stages, num_blocks, launcher)
    started.wait()
    return out


# ---------------------------------------------------------------------------
# Host: plan, checks, prepare, the public call
# ---------------------------------------------------------------------------


def plan(m: int, n: int, k: int, world_size: int, config: dict, num_sms: int) -> dict:
    """Resolve the launch configuration (shared with the Helion port): ``m`` is one rank's rows. The bf16
    recipe's ``tile_plan`` over this recipe's ``TILE_CONFIGS``: the largest that gives ``MIN_TILES_PER_SM`` of
    the SMs a tile, a persistent grid of at most one block per SM but ``RESERVED_SMS``."""
    groups.resolve_config(config, DEFAULT_CONFIG, OP)  # rejects unknown keys
    cfg, num_blocks = tile_plan(m, n, k, world_size, config, num_sms, TILE_CONFIGS, DEFAULT_CONFIG, OP,
                                least_block_k=32, operand_bytes=1)
    if cfg["block_k"] > MAX_BLOCK_K:
        raise ValueError(f"{OP}: block_k must be <= 128 (128 fp8 bytes: one TMA swizzle row), got {cfg['block_k']}")
    if cfg["b_layout"] not in B_LAYOUTS:
        raise ValueError(f"{OP}: b_layout must be one of {B_LAYOUTS}, got {cfg['b_layout']!r}")
    keys = ("b_layout", "block_m", "block_n", "block_k", "group_m", "num_warps", "num_stages")
    return {**{key: cfg[key] for key in keys}, "num_blocks": num_blocks}


@prepared.per_signature(lambda a, b, scale_a, scale_b, group, op, config: (
    op, group, prepared.tensor_key(a), prepared.tensor_key(b), prepared.tensor_key(scale_a),
    prepared.tensor_key(scale_b), prepared.config_key(config)))
def chosen(a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor, group, op: str,
           config: dict):
    """``crossover.SEQUENTIAL`` or the fused form's ``prepare``, kept per signature (``crossover.fused_prepared``);
    sequential only where ``torch._scaled_mm`` takes K and N (multiples of 16)."""
    sequential_ok = all(isinstance(t, torch.Tensor) and t.dim() == 2 and t.shape[1] % 16 == 0 for t in (a, b))
    return crossover.fused_prepared(op, a, b, group, True, sequential_ok, config, check_sequential,
                                    lambda fused_config: prepare(a, b, scale_a, scale_b, group, op, fused_config),
                                    None, (scale_a, scale_b))


def check_sequential(a: torch.Tensor, b: torch.Tensor, world_size: int, op: str, scale_a: torch.Tensor,
                     scale_b: torch.Tensor) -> None:
    """The sequential form's checks (``kraken.runtime.crossover.form`` runs them inside its agreement)."""
    check_inputs(a, b, scale_a, scale_b, op)


def gather_then_scaled_mm(all_gather, a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor,
                          scale_b: torch.Tensor, group) -> torch.Tensor:
    """The sequential form (K and N multiples of 16): ``all_gather`` (the SM-driven collective) of the fp8 values, as
    bf16 pairs of bytes, and of the row scales (a per-tensor scale becomes every row's: ranks may hold different
    ones), then ``torch._scaled_mm`` with row-wise scales on a column-major ``b``."""
    m = a.shape[0]
    values = all_gather(a.view(torch.bfloat16), group).view(FP8)
    rows = all_gather(scale_a.reshape(-1, 1), group)
    if scale_a.numel() == 1:
        rows = rows.repeat_interleave(m, dim=0)
    col_scales = scale_b.reshape(1, -1).expand(1, b.shape[1]).contiguous()
    b_cols = b if b.stride(0) == 1 else b.t().contiguous().t()
    return torch._scaled_mm(values, b_cols, rows, col_scales, out_dtype=OUT_DTYPE)


@prepared.per_signature(lambda a, b, scale_a, scale_b, group, op, config: (
    op, group, prepared.tensor_key(a), prepared.tensor_key(b), prepared.tensor_key(scale_a),
    prepared.tensor_key(scale_b), prepared.config_key(config)))
def prepare(
    a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor, group, op: str, config: dict
) -> tuple[symm.SymmContext, dict]:
    """Validate, plan, and find the buffers: the context of the symmetric gather buffer (bytes,
    [world_size * M, ``row_bytes(K)``], a slice of ``symm.symm_workspace``), and the launch arguments but
    the output (every rank's own chunk of it as ``peers``, this rank's as fp8 values and fp32 scales,
    ``progress``, the config); kept per signature."""
    # Local checks; the first call of each signature also agrees on them (and on the shapes) across ranks.
    with agreement.agreed(op, group, a=a, b=b, scale_a=scale_a, scale_b=scale_b, config=config):
        check_inputs(a, b, scale_a, scale_b, op)
        (m, k), n = a.shape, b.shape[1]
        world_size = groups.world_size_of(group, op)
        if max(world_size * m * max(row_bytes(k), n), k * n) > MAX_INDEX:
            raise ValueError(f"{op}: the gathered a, b or the output has more than 2**31 - 1 elements (32-bit offsets)")
        num_sms = torch.cuda.get_device_properties(a.device).multi_processor_count
        cfg = plan(m, n, k, world_size, config, num_sms)
    pg = groups.resolve_group(group, op)
    width = row_bytes(k)
    gathered = symm.symm_workspace(world_size * m * width, torch.uint8, a.device, pg, op).view(world_size * m, width)
    ctx = symm.symm_context(gathered, pg, op, name="gather buffer")
    chunks = chunk_views(ctx, m)
    own_values, own_scales = buffer_views(chunks[ctx.rank], k)
    return ctx, {"peers": chunks, "gathered": gathered, "own_values": own_values, "own_scales": own_scales,
                 "progress": progress_flags(world_size, a.device), **cfg, "launcher": Launcher(op)}


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
    ``max_blocks`` and ``b_layout`` (see ``plan`` and ``B_LAYOUTS``); ``form="fused"`` or ``"sequential"`` forces
    the form ``kraken.runtime.crossover`` would choose by size.
    """
    return call(launch, OP, a, b, scale_a, scale_b, group, config, sm_all_gather)


def call(launch, op: str, a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor, group,
         config: dict, all_gather) -> torch.Tensor:
    """``all_gather_matmul_fp8`` with a given ``launch`` and ``all_gather`` (the recipe's or its twin's) under the
    name ``op``, in the form ``crossover`` chooses. Sequential: ``gather_then_scaled_mm``. Fused: the prepared
    call, the new output, and the launch; its fork, the gather's exchange, the GEMM and a join are replayed from one
    CUDA graph per pointer set (``graphs.graphed``)."""
    prepared = chosen(a, b, scale_a, scale_b, group, op, config)
    if prepared == crossover.SEQUENTIAL:
        return gather_then_scaled_mm(all_gather, a, b, scale_a, scale_b, group)
    ctx, cfg = prepared
    out = torch.empty(cfg["gathered"].shape[0], b.shape[1], dtype=OUT_DTYPE, device=a.device)
    graphs.graphed((cfg["launcher"], a.data_ptr(), b.data_ptr(), scale_a.data_ptr(), scale_b.data_ptr(),
                    out.data_ptr()),
                   lambda: launch(a, b, scale_a, scale_b, signal_pad_ptrs=ctx.signal_pad_ptrs, rank=ctx.rank, out=out,
                                  **cfg, group_name=ctx.group_name), a.device)
    return out
