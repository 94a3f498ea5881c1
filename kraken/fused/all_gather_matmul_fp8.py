"""FP8 all-gather + matmul: ``_scaled_mm(all_gather(a), b, all_gather(scale_a), scale_b)`` in bf16.

The all-gather + matmul recipe (``kraken/fused/all_gather_matmul.py``) for ``torch.float8_e4m3fn`` operands with
scales, in the layouts ``torch._scaled_mm`` takes: ``scale_a`` per tensor (one element) or per row ([M, 1]),
``scale_b`` per tensor or per column ([1, N]), all float32. fp8 halves the bytes the gather moves and doubles the
tensor cores' rate, so the same protocol has twice as much GEMM per byte to hide the exchange under.

* The gathered operand travels as fp8 *with its row scales*: each row of the symmetric gather buffer (bytes,
  [world_size * M, ``row_bytes(K)``]) holds the row's K fp8 values and, at byte K' (K rounded up to 16), its fp32
  scale (a per-tensor ``scale_a`` is written into every row: ranks may have different ones). Rows start on 128-byte
  boundaries: a TMA box row (128 fp8 values) then sits in one 128-byte line. One contiguous copy per peer chunk
  moves both, on the copy engine, with the chunk's flag; no second gather, no second flag.
* The gather (as the bf16 recipe's: a side stream forked after the flags' reset, a one-block barrier, each peer's
  chunk copied and flagged by a stream memory operation, a closing barrier, the join after the GEMM) stages my rows
  first, on the side stream, before its first barrier (``stage``: one kernel, a block per 16 rows x 512 bytes,
  writes this rank's values and scales into its chunk), and only for the peers: the GEMM reads my rows from ``a``
  itself and their scales from ``scale_a``, so it starts at once and a group of one stages nothing. A block waits
  (acquire + async-proxy fence, ``wait_async``) only at its first tile of each peer's chunk.
* The GEMM is the bf16 recipe's kernel (a copy here, ``all_gather_matmul_kernel`` with ``SCALED``: own rows
  first, from ``a``, then rank + 1's, ..., from the buffer, ``GROUP_M``-row bands), on 128-wide k steps (the same
  bytes per stage as bf16's 64). The descriptor over the gathered values has shape [world_size * M, K] with the
  buffer's row stride: TMA zero-fills past K, and the scale bytes are never read as values.
* ``b``: Hopper's fp8 wgmma takes both operands K-major from shared memory. A column-major ``b`` (``w.t()`` of an
  [N, K] weight, what ``_scaled_mm`` wants) is read in place as [N, K] in ``BLOCK_N x BLOCK_K`` boxes and each tile
  is transposed as a shared-memory view (``B_TRANS``): wgmma reads the TMA-written tile as is. A row-major ``b``
  [K, N] also compiles to wgmma, but each k step then moves b's tile through registers into a transposed copy in
  shared memory. ``b_layout="auto"`` reads either as stored (pass ``w.t()`` for the fast one), "nk" copies a
  row-major ``b`` to [N, K] first.
* Accumulation: ``tl.dot`` into an fp32 accumulator. On sm_90 Triton lets the tensor cores accumulate fp8 products
  over the whole k loop with no promotion to exact fp32 adds (``max_num_imprecise_acc`` defaults to 2**30 there):
  what ``_scaled_mm(..., use_fast_accum=True)`` does.
* Epilogue: fp32 accumulator times ``scale_a[rows, None] * scale_b[None, cols]`` (a peer's row scales from its
  gathered rows), then bf16, stored masked to the chunk's rows.

This file is the recipe: the kernels, ``plan`` (pure), ``launch`` (the seam the installed package replays from a
CUDA graph, with its own ``launcher``; on new addresses it drives the parts, ``stage``, ``gather``,
``launch_matmul``) and a plain host function. ``kraken.all_gather_matmul_fp8`` is the same launch behind the product
layer (``kraken.runtime.gather_matmul``).

    torchrun --nproc-per-node 2 kraken/fused/all_gather_matmul_fp8.py
"""

from __future__ import annotations

import os
import time

import torch
import torch.distributed as dist
import torch.distributed._symmetric_memory as symm_mem
import triton
import triton.language as tl
from torch._C._distributed_c10d import _SymmetricMemory
from triton.tools.tensor_descriptor import TensorDescriptor

from kraken._ptx_utils import symm_mem_sync, wait_async
from kraken._gemm_core import (
    FP8, SKINNY_M, balanced_grid, cdiv, flattens, mainloop, round_up, skinny_or_large_tiles, tile_coords,
    tma_fp8,
)
from kraken._gemm_core import FP8_B_LAYOUTS as B_LAYOUTS
from kraken._gemm_core import FP8_MAX_BLOCK_K as MAX_BLOCK_K
from kraken._gemm_core import fp8_b_operand as b_operand

OP = "all_gather_matmul_fp8"
OUT_DTYPE = torch.bfloat16
SCALE_BYTES = 16  # per gathered row: the fp32 scale, in its own 16 bytes after the values
ROW_ALIGN = 128  # bytes: each gathered row starts on a 128-byte line (TMA reads a box row from one line)
# Tiles: the largest of ``TILE_CONFIGS`` that still gives ``MIN_TILES_PER_SM`` of the SMs a tile, ``GROUP_M`` row
# tiles per band (the bf16 recipe's rules).
MIN_TILES_PER_SM = 0.9
GROUP_M = 8
# The GEMM leaves this many SMs free: its blocks spin on flags that follow the gather's one-block barrier kernel,
# which must find an SM while every GEMM block is resident.
RESERVED_SMS = 1
# The bf16 recipe's tiles with k steps twice as long: the same bytes per pipeline stage (fp8 wgmma's k is 32);
# 4 stages on the large tiles, 6 on the small ones.
TILE_CONFIGS = [
    {"block_m": 128, "block_n": 256, "block_k": 128, "num_warps": 8, "num_stages": 4},
    {"block_m": 128, "block_n": 128, "block_k": 128, "num_warps": 8, "num_stages": 6},
]
DEFAULT_CONFIG = {**TILE_CONFIGS[0], "group_m": GROUP_M, "max_blocks": None, "b_layout": "auto"}
MAX_VIEWS = 256  # buffers whose views ``buffer_views`` keeps; past that it starts over


@triton.jit
def all_gather_matmul_kernel(
    a_desc,  # my rows [M, K] (``a``), BLOCK_M x BLOCK_K boxes
    gathered_desc,  # the gathered a [world_size * M, K], the same boxes: rank r's rows at r * M
    b_desc,  # b [K, N] in BLOCK_K x BLOCK_N boxes, or (B_TRANS) its transpose [N, K] in BLOCK_N x BLOCK_K
    out_ptr,  # [world_size * M, N]
    progress_ptr,  # int32 flags, 0 -> 1: [r] rank r's rows have landed
    row_scales_ptr,  # SCALED: fp32 scale of gathered row i at row_scales_ptr + i * scale_stride
    scale_a_ptr,  # SCALED: my rows' fp32 scales, [M] (A_ROWWISE) or [1]
    scale_b_ptr,  # SCALED: fp32 [N] (B_COLWISE) or [1]
    M,
    N,
    K,
    scale_stride,  # SCALED
    rank,
    world_size: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    B_TRANS: tl.constexpr,
    # The scaled GEMM's switches (this recipe's; the bf16 recipe's copy leaves them at their defaults).
    SCALED: tl.constexpr = False,  # the epilogue multiplies by the rows' scales and b's column scales
    A_ROWWISE: tl.constexpr = 0,
    B_COLWISE: tl.constexpr = 0,
    FLATTEN: tl.constexpr = False,  # my rows' tile loop flattened with its k loop (``kraken._gemm_core.flattens``)
    WIDE: tl.constexpr = False,  # out has more than 2**31 - 1 elements: 64-bit offsets in the epilogue
):
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    chunk_tiles = tiles_m * tiles_n
    num_tiles = world_size * chunk_tiles
    pid = tl.program_id(0)
    blocks = tl.num_programs(0)
    # My rows, from a (no flag: earlier work on this stream wrote them): this block's tiles pid, pid + blocks, ...
    # of my chunk.
    for tile in tl.range(pid, chunk_tiles, blocks, flatten=FLATTEN):
        tile_m, tile_n = tile_coords(tile, tiles_m, tiles_n, GROUP_M)
        acc = mainloop(a_desc, b_desc, tile_m * BLOCK_M, tile_n * BLOCK_N, 0, K, BLOCK_M, BLOCK_N, BLOCK_K, B_TRANS)
        store_tile(acc, out_ptr, rank * M, scale_a_ptr, 0, A_ROWWISE, scale_b_ptr, tile_m * BLOCK_M, tile_n * BLOCK_N,
                   M, N, BLOCK_M, BLOCK_N, SCALED, B_COLWISE, WIDE)
    # The peers' rows, from the gather buffer: the block's later tiles, rank + 1's chunk first. A second loop, not a
    # descriptor picked per tile: the two k loops follow each other, so their pipelines share shared memory.
    if world_size > 1:
        first = pid + (chunk_tiles - pid + blocks - 1) // blocks * blocks  # this block's first tile past my chunk
        for tile in tl.range(first, num_tiles, blocks):
            step = tile // chunk_tiles  # 1: rank + 1's rows, 2: rank + 2's, ...
            # The step of this block's previous tile (0: my rows; negative before its first: operands stay >= 0).
            prev_step = (tile + num_tiles - blocks) // chunk_tiles - world_size
            src = (rank + step) % world_size
            tile_m, tile_n = tile_coords(tile % chunk_tiles, tiles_m, tiles_n, GROUP_M)
            # At a block's first tile of each peer's chunk: these rows have landed (acquire), and TMA will see them
            # (async-proxy fence).
            if step != prev_step:
                wait_async(progress_ptr + src, 1)
            acc = mainloop(gathered_desc, b_desc, src * M + tile_m * BLOCK_M, tile_n * BLOCK_N, 0, K, BLOCK_M,
                           BLOCK_N, BLOCK_K, B_TRANS)
            store_tile(acc, out_ptr, src * M, row_scales_ptr, src * M, scale_stride, scale_b_ptr, tile_m * BLOCK_M,
                       tile_n * BLOCK_N, M, N, BLOCK_M, BLOCK_N, SCALED, B_COLWISE, WIDE)


@triton.jit
def store_tile(acc, out_ptr, out_row0, scale_rows_ptr, scale_row0, scale_stride, scale_b_ptr, m0, n0, M, N,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SCALED: tl.constexpr, B_COLWISE: tl.constexpr,
               WIDE: tl.constexpr):
    """The epilogue of the tile at (m0, n0) of a chunk of M rows: stored at rows ``out_row0 + m0 ...`` of ``out``,
    only the chunk's rows (a tile at its end also read some of the next chunk's, discarded). ``SCALED``: times
    the rows' scales, row i's at ``scale_rows_ptr + (scale_row0 + i) * scale_stride`` (my rows' ``scale_a``:
    stride 1, or 0 for one per tensor; the gathered rows': the buffer's), and b's column scales."""
    rows = m0 + tl.arange(0, BLOCK_M)
    cols = n0 + tl.arange(0, BLOCK_N)
    row_in = rows < M
    col_in = cols < N
    if SCALED:
        scale_a = tl.load(scale_rows_ptr + (scale_row0 + rows) * scale_stride, mask=row_in, other=0.0)
        scale_b = tl.load(scale_b_ptr + cols * B_COLWISE, mask=col_in, other=0.0)
        acc = acc * scale_a[:, None] * scale_b[None, :]
    out_rows = out_row0 + rows
    if WIDE:
        out_rows = out_rows.to(tl.int64)
    offsets = out_rows[:, None] * N + cols[None, :]
    tl.store(out_ptr + offsets, acc.to(out_ptr.dtype.element_ty), mask=row_in[:, None] & col_in[None, :])


@triton.jit
def shard_barrier_kernel(signal_pad_ptrs, rank, world_size: tl.constexpr, BLOCK_ID: tl.constexpr):
    # Every write before this on the side stream (and the current stream's before the fork) is visible to the
    # peers, and theirs to everything after it on this stream.
    symm_mem_sync(signal_pad_ptrs, BLOCK_ID, rank, world_size, hasPreviousMemAccess=True, hasSubsequentMemAccess=True)


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


def triton_launch(kernel, grid: tuple[int, ...], *args, **meta):
    """``launch``'s default launcher: Triton's own ``kernel[grid](...)``."""
    return kernel[grid](*args, **meta)


def descriptor(tensor: torch.Tensor, block_shape: list[int]) -> TensorDescriptor:
    """A host TMA descriptor over ``tensor`` in ``block_shape`` boxes."""
    return TensorDescriptor(tensor, tensor.shape, tensor.stride(), block_shape)


def row_bytes(k: int) -> int:
    """Bytes per gathered row: K fp8 values rounded up to 16, the fp32 scale in its own 16 bytes, the row
    rounded up to ``ROW_ALIGN``."""
    return round_up(round_up(k, 16) + SCALE_BYTES, ROW_ALIGN)


_views: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}


def buffer_views(gathered: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(values, row scales) of a gather buffer (bytes, [rows, ``row_bytes(k)``]): the fp8 [rows, K] view the
    TMA descriptor covers (the buffer's row stride) and the fp32 [rows] view of each row's scale. Kept per buffer
    and K (every call of a prepared call asks for the same two): four view operations cost more than a launch. The
    kept views hold the buffer, so no other tensor takes its address."""
    key = (gathered.data_ptr(), gathered.shape, gathered.dtype, k)
    views = _views.get(key)
    if views is None:
        if len(_views) >= MAX_VIEWS:
            _views.clear()
        values = gathered.view(FP8)[:, :k]
        scales = gathered.view(torch.float32)[:, round_up(k, 16) // 4]
        views = _views[key] = (values, scales)
    return views


# 16 x 512 bytes a block, 64 a thread (four 16-byte accesses in flight), and enough blocks for every SM.
STAGE_BLOCK_M, STAGE_BLOCK_K, STAGE_WARPS = 16, 512, 4


def stage(a: torch.Tensor, scale_a: torch.Tensor, own_values: torch.Tensor, own_scales: torch.Tensor,
          launcher=triton_launch) -> None:
    """This rank's rows and their scales (a per-tensor scale into every row) into its chunk of the gather
    buffer (``buffer_views``), on the current stream (``launch`` calls it on the gather's side stream): one
    kernel."""
    m, k = a.shape
    grid = (cdiv(m, STAGE_BLOCK_M), cdiv(k, STAGE_BLOCK_K))
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
    launcher=triton_launch,
) -> torch.Tensor:
    """The GEMM alone: my rows from ``a`` (a TMA-ready fp8 [M, K], ``tma_fp8``) and ``scale_a``, the peers' from
    the gather buffer (bytes, [world_size * M, ``row_bytes(k)``]), a TMA-ready ``b`` (``b_operand``): the
    consumer of the flags in ``progress``."""
    m, n = out.shape[0] // world_size, out.shape[1]
    values, scales = buffer_views(gathered, k)
    b_box = [block_n, block_k] if b_trans else [block_k, block_n]
    launcher(
        all_gather_matmul_kernel, (num_blocks,),
        descriptor(a, [block_m, block_k]), descriptor(values, [block_m, block_k]),
        descriptor(b, b_box), out, progress, scales, scale_a, scale_b, m, n, k, scales.stride(0),
        rank, world_size, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, GROUP_M=group_m, B_TRANS=b_trans,
        SCALED=True, A_ROWWISE=int(scale_a.numel() > 1), B_COLWISE=int(scale_b.numel() > 1),
        FLATTEN=flattens(block_m, block_n), num_warps=num_warps, num_stages=num_stages,
    )
    return out


def tile_plan(m: int, n: int, k: int, world_size: int, config: dict, num_sms: int, tile_configs: list,
              defaults: dict, op: str, least_block_k: int = 16, operand_bytes: int = 2) -> tuple[dict, int]:
    """The GEMM's tiles and grid (the bf16 recipe's rules): the largest of ``tile_configs`` that gives ``MIN_TILES_PER_SM`` of the SMs a
    tile; where none does, up to ``SKINNY_M`` rows, the reduce recipes' skinny tiles (one warpgroup, narrow tiles
    that fill a wave: ``skinny_or_large_tiles``, ``operand_bytes`` 1 for fp8), else the smallest; under the ``config``;
    tile sizes powers of two (at least 16, ``block_k`` at least ``least_block_k``); and the grid: at most one block per
    SM but ``RESERVED_SMS`` (the GEMM waits on flags in local memory and uses no signal pad), never more blocks than
    tiles, balanced (``balanced_grid``). (cfg, num_blocks)."""
    def fills(cfg: dict) -> bool:
        return (world_size * cdiv(m, cfg["block_m"]) * cdiv(n, cfg["block_n"])
                >= MIN_TILES_PER_SM * num_sms)

    tiles = next((cfg for cfg in tile_configs if fills(cfg)), None)
    if tiles is None:
        tiles = skinny_or_large_tiles(m, n, k, num_sms, False, operand_bytes) if m <= SKINNY_M else tile_configs[-1]
    cfg = {**defaults, **tiles, **config}
    for key in ("block_m", "block_n", "block_k", "group_m"):
        value = cfg[key]
        least = 1 if key == "group_m" else (least_block_k if key == "block_k" else 16)
        if value < least or value & (value - 1):
            raise ValueError(f"{op}: {key} must be a power of two{f' >= {least}' if key != 'group_m' else ''}, "
                             f"got {value}")
    num_tiles = world_size * cdiv(max(m, 1), cfg["block_m"]) * cdiv(max(n, 1), cfg["block_n"])
    sms = max(1, num_sms - RESERVED_SMS)
    max_blocks = sms if cfg["max_blocks"] is None else max(1, min(cfg["max_blocks"], sms))
    return cfg, balanced_grid(num_tiles, max_blocks)


def plan(m: int, n: int, k: int, world_size: int, config: dict, num_sms: int) -> dict:
    """Resolve the launch configuration (the Helion twin holds a copy): ``m`` is one rank's rows. ``tile_plan``
    over this recipe's ``TILE_CONFIGS``: the largest that gives ``MIN_TILES_PER_SM`` of the SMs a tile, a persistent
    grid of at most one block per SM but ``RESERVED_SMS``."""
    unknown = set(config) - set(DEFAULT_CONFIG)
    if unknown:
        raise TypeError(f"{OP}: unknown config keys {sorted(unknown)}; known: {sorted(DEFAULT_CONFIG)}")
    cfg, num_blocks = tile_plan(m, n, k, world_size, config, num_sms, TILE_CONFIGS, DEFAULT_CONFIG, OP,
                                least_block_k=32, operand_bytes=1)
    if cfg["block_k"] > MAX_BLOCK_K:
        raise ValueError(f"{OP}: block_k must be <= 128 (128 fp8 bytes: one TMA swizzle row), got {cfg['block_k']}")
    if cfg["b_layout"] not in B_LAYOUTS:
        raise ValueError(f"{OP}: b_layout must be one of {B_LAYOUTS}, got {cfg['b_layout']!r}")
    keys = ("b_layout", "block_m", "block_n", "block_k", "group_m", "num_warps", "num_stages")
    return {**{key: cfg[key] for key in keys}, "num_blocks": num_blocks}


# ---------------------------------------------------------------------------
# The gather: copy engine, stream memory operations, two one-block barriers
# ---------------------------------------------------------------------------


def barrier(signal_pad_ptrs: int, rank: int, world_size: int, launcher=triton_launch) -> None:
    """One cross-rank barrier on the current stream (one block, one warp: it fits on the SM the GEMM leaves free)."""
    launcher(shard_barrier_kernel, (1,), signal_pad_ptrs, rank, world_size, BLOCK_ID=0, num_warps=1)


_side_streams: dict[torch.device, torch.cuda.Stream] = {}


def side_stream(device: torch.device) -> torch.cuda.Stream:
    """The stream the copies run on (one per device, high priority, as torch's async-TP backend stream)."""
    if device not in _side_streams:
        _side_streams[device] = torch.cuda.Stream(device=device, priority=-1)
    return _side_streams[device]


def gather(peers: tuple[torch.Tensor, ...], gathered: torch.Tensor, progress: torch.Tensor, signal_pad_ptrs: int,
           rank: int, launcher) -> None:
    """The exchange on the current stream (the side stream), after my rows are in my chunk: the first barrier, each
    peer's chunk (values and scales) copied by the copy engine (rank + 1 first) and flagged, the closing barrier."""
    rows, world_size = peers[rank].shape[0], len(peers)
    barrier(signal_pad_ptrs, rank, world_size, launcher)  # every rank's rows are staged
    flags = progress.view(torch.uint32)  # (the stream operations' dtype; the kernel reads int32)
    for step in range(1, world_size):
        peer = (rank + step) % world_size
        gathered[peer * rows:(peer + 1) * rows].copy_(peers[peer])
        _SymmetricMemory.stream_write_value32(flags, peer, 1)  # after the copy, fenced system-wide
    barrier(signal_pad_ptrs, rank, world_size, launcher)  # done reading: peers may stage into their buffers again


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
    launcher=triton_launch,
) -> torch.Tensor:
    """Launch on planned arguments (no checks); the same signature as the Helion twin's ``launch``.

    ``gathered`` is this rank's symmetric gather buffer (bytes, [world_size * M, ``row_bytes(K)``]), ``peers[r]``
    rank r's own chunk of rank r's, ``own_values`` / ``own_scales`` this rank's chunk as fp8 values and fp32 scales
    (``buffer_views``); ``progress`` int32[world_size]; ``out`` [world_size * M, N] bf16; ``group_name`` is unused
    here (Helion's process-group name).
    """
    world_size = len(peers)
    b, b_trans = b_operand(b, b_layout)
    side = side_stream(a.device)
    if world_size > 1:
        progress.zero_()  # before the fork: no flag of the previous call survives into this one
    current = torch.cuda.current_stream(a.device)  # (the device named: else torch looks it up, a device query)
    side.wait_stream(current)  # the fork
    torch.cuda.set_stream(side)
    try:
        if world_size > 1:  # my rows and their scales into my chunk, for the peers
            stage(a, scale_a, own_values, own_scales, launcher)
        gather(peers, gathered, progress, signal_pad_ptrs, rank, launcher)
    finally:
        torch.cuda.set_stream(current)
    launch_matmul(tma_fp8(a, block_m), scale_a, gathered, b, scale_b, out, progress, rank, world_size, a.shape[1],
                  b_trans, block_m, block_n, block_k, group_m, num_warps, num_stages, num_blocks, launcher)
    current.wait_stream(side)  # the join: the caller may write the buffer again
    return out


def call_buffers(a: torch.Tensor, b: torch.Tensor, group: dist.ProcessGroup, config: dict) -> tuple[dict, dict]:
    """What a call on ``a`` and ``b`` launches on (a collective: every rank of ``group`` calls it): ``launch``'s
    buffer arguments by name (peers, gather buffer, my chunk's values and scales, out, zeroed
    progress flags, signal pads, rank) and the plan. Shared by the plain host function and the timing in ``main``."""
    (m, k), n = a.shape, b.shape[1]
    world_size = dist.get_world_size(group)
    width = row_bytes(k)
    gathered = symm_mem.empty(world_size * m, width, dtype=torch.uint8, device=a.device)
    handle = symm_mem.rendezvous(gathered, group.group_name)
    rank = handle.rank
    peers = tuple((gathered if r == rank else handle.get_buffer(r, (world_size * m, width), torch.uint8))
                  [r * m:(r + 1) * m] for r in range(world_size))
    own_values, own_scales = buffer_views(peers[rank], k)
    cfg = plan(m, n, k, world_size, config, torch.cuda.get_device_properties(a.device).multi_processor_count)
    out = torch.empty(world_size * m, n, dtype=OUT_DTYPE, device=a.device)
    progress = torch.zeros(world_size, dtype=torch.int32, device=a.device)
    return {"peers": peers, "gathered": gathered, "own_values": own_values, "own_scales": own_scales, "out": out,
            "progress": progress, "signal_pad_ptrs": handle.signal_pad_ptrs_dev, "rank": rank}, cfg


def all_gather_matmul_fp8(
    a: torch.Tensor,
    b: torch.Tensor,
    scale_a: torch.Tensor,
    scale_b: torch.Tensor,
    group: dist.ProcessGroup | None = None,
    **config,
) -> torch.Tensor:
    """``(all_gather(a) * all_gather(scale_a)) @ (b * scale_b)`` as a new [world_size * M, N] bf16 tensor; ``a``
    [M, K] contiguous fp8 e4m3, the same shape on every rank, ``b`` [K, N] fp8 (column-major is read in place),
    ``scale_a`` one element or [M, 1], ``scale_b`` one element or [1, N], float32.

    The recipe spelled out: a symmetric gather buffer on every rank, the plan, one launch. It allocates and
    rendezvouses on every call and checks nothing; ``kraken.all_gather_matmul_fp8`` is the installed one."""
    group = dist.group.WORLD if group is None else group
    buffers, cfg = call_buffers(a, b, group, config)
    return launch(a, b, scale_a, scale_b, **buffers, **cfg)


def main(m: int = 1024, n: int = 8192, k: int = 8192, iters: int = 20) -> None:
    """Check against NCCL's all-gather and ``torch._scaled_mm``, and time ``launch`` on buffers prepared once
    (``torchrun``, or alone)."""
    if "RANK" not in os.environ:  # run alone: a group of one
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT="29501")
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", device_id=device)
    rank, world_size = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(rank)
    x = torch.randn(m, k, device=device)
    scale_a = x.abs().amax(dim=1, keepdim=True) / 448.0  # row-wise, each rank its own
    a = (x / scale_a).to(FP8)
    torch.manual_seed(1234)  # the same b on every rank
    w = torch.randn(n, k, device=device)
    scale_b = (w.abs().amax(dim=1, keepdim=True) / 448.0).t().contiguous()  # [1, N]
    b = (w / scale_b.t()).to(FP8).t()  # column-major [K, N]
    values = torch.empty(world_size * m, k, dtype=torch.uint8, device=device)
    dist.all_gather_into_tensor(values, a.view(torch.uint8))
    rows = torch.empty(world_size * m, 1, device=device)
    dist.all_gather_into_tensor(rows, scale_a)
    expected = torch._scaled_mm(values.view(FP8), b, rows, scale_b, out_dtype=OUT_DTYPE)
    got = all_gather_matmul_fp8(a, b, scale_a, scale_b)
    torch.testing.assert_close(got.float(), expected.float(), rtol=3e-2, atol=3e-2 * expected.abs().max().item())

    buffers, cfg = call_buffers(a, b, dist.group.WORLD, {})  # the buffers, once
    out = buffers["out"]
    for _ in range(3):  # warm up (compile)
        launch(a, b, scale_a, scale_b, **buffers, **cfg)
    out.fill_(float("nan"))  # a timed launch that writes nothing fails the check below
    dist.barrier()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(iters):
        launch(a, b, scale_a, scale_b, **buffers, **cfg)
    torch.cuda.synchronize()
    us = (time.perf_counter() - start) / iters * 1e6
    torch.testing.assert_close(out.float(), expected.float(), rtol=3e-2, atol=3e-2 * expected.abs().max().item())
    if rank == 0:
        print(f"all_gather_matmul_fp8: {world_size}x{m} x {n} x {k} fp8: matches NCCL + torch._scaled_mm, {us:.1f} us "
              f"per call (eager launches; {cfg})")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
