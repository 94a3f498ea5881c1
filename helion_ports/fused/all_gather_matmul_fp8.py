"""Helion twin of ``kraken.fused.all_gather_matmul_fp8``: same function, same arguments.

The staging kernel (a copy of the recipe's Triton ``stage_kernel``: this rank's values and scales into its chunk of
the gather buffer, on the gather's side stream, for the peers) and the gather are the recipe's, line for line, with
the barrier a one-block Helion kernel; ``plan``, ``row_bytes`` and ``buffer_views`` are copies (a test keeps them
equal). The GEMM is the bf16 twin's body (a copy here) with ``scaled`` on, mirroring the recipe's kernel:

* ``hl.grid(num_blocks)`` is the persistent grid, tiles ``b, b + num_blocks, ...`` chunk by chunk (own
  rows first, from ``a`` and ``scale_a``; then the peers', from the buffer), ``group_m``-row bands;
* a block waits for a peer's chunk at its first tile of it (the recipe's ``GMEM_WAIT_ASYNC`` PTX through
  ``hl.inline_triton``); the own rows need no wait;
* the fp8 values of ``a``, of the gathered rows and ``b`` load through host-built tensor descriptors (TMA);
  ``b`` arrives as [N, K] and its tiles go to ``hl.dot`` transposed (``b_trans``), fp32 accumulation;
* the epilogue loads the rows' scales (``scale_a`` as an [M] view, or each gathered row's from the buffer,
  ``row_scales``, a strided fp32 view) and the column scales (``scale_b`` as an [N] view: stride 0 for a
  per-tensor scale), masked to the chunk's rows and to N, and stores bf16.

``helion_ports.all_gather_matmul_fp8`` is the installed twin (``kraken.runtime.gather_matmul`` driving this
``launch``).

    torchrun --nproc-per-node 2 helion_ports/fused/all_gather_matmul_fp8.py
"""

from __future__ import annotations

import functools
import os
import time

import helion
import helion.language as hl
import torch
import torch.distributed as dist
import torch.distributed._symmetric_memory as symm_mem
import triton
import triton.language as tl
from torch._C._distributed_c10d import _SymmetricMemory

from kraken._blocks.helion import flat_kernel, run
from kraken._gemm_core import (
    FP8, SKINNY_M, balanced_grid, cdiv, flattens, round_up, skinny_or_large_tiles, tma_fp8,
)
from kraken._gemm_core import FP8_B_LAYOUTS as B_LAYOUTS
from kraken._gemm_core import FP8_MAX_BLOCK_K as MAX_BLOCK_K
from kraken._gemm_core import fp8_b_operand as b_operand
from kraken._ptx_utils.inline_source import GMEM_WAIT_ASYNC, SYMM_MEM_SYNC

OP = "all_gather_matmul_fp8"
OUT_DTYPE = torch.bfloat16
SCALE_BYTES = 16  # per gathered row: the fp32 scale, in its own 16 bytes after the values
ROW_ALIGN = 128  # bytes: each gathered row starts on a 128-byte line (TMA reads a box row from one line)
# The recipe's constants (kraken/fused/all_gather_matmul_fp8.py), kept equal by a test.
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
# The flag (a pointer expression in the snippet): progress + index.
WAIT_FLAG = GMEM_WAIT_ASYNC.replace("{flag}", "{progress} + {index}")
# Per load/store of one tile loop, in program order: the rows (a's or the buffer's) and b through TMA; the row and
# column scales and the store to out through pointers.
INDEXING = ("tensor_descriptor", "tensor_descriptor", "pointer", "pointer", "pointer")


def all_gather_matmul_body(
    a: torch.Tensor,
    gathered: torch.Tensor,
    b: torch.Tensor,
    scale_a: torch.Tensor | None,  # scaled: fp32 [M] (stride 0 for a per-tensor scale), my rows' scales; None here
    row_scales: torch.Tensor | None,  # scaled: fp32 [world_size * M], each gathered row's scale; None here
    scale_b: torch.Tensor | None,  # scaled: fp32 [N] (stride 0 for a per-tensor scale); None here
    out: torch.Tensor,
    progress: torch.Tensor,
    num_blocks: int,
    rank: int,
    world_size: hl.constexpr,
    b_trans: hl.constexpr,
    scaled: hl.constexpr,  # the fp8 twin's: the epilogue multiplies by the rows' and columns' scales
    block_m: hl.constexpr,
    block_n: hl.constexpr,
    group_m: hl.constexpr,
) -> torch.Tensor:
    k = gathered.size(1)
    m = out.size(0) // world_size
    n = out.size(1)
    tiles_m = (m + block_m - 1) // block_m
    tiles_n = (n + block_n - 1) // block_n
    chunk_tiles = tiles_m * tiles_n
    band_tiles = group_m * tiles_n
    num_tiles = world_size * chunk_tiles
    own_rounds = (chunk_tiles + num_blocks - 1) // num_blocks
    rounds = (num_tiles + num_blocks - 1) // num_blocks
    for block in hl.grid(num_blocks):
        # My rows, from a: block b's tiles b, b + num_blocks, ... of my chunk.
        for rnd in hl.grid(own_rounds):
            tile = block + rnd * num_blocks
            if tile < chunk_tiles:
                band = tile // band_tiles
                band_rows = min(tiles_m - band * group_m, group_m)
                m0 = (band * group_m + tile % band_tiles % band_rows) * block_m
                n0 = tile % band_tiles // band_rows * block_n
                for tile_m, tile_n in hl.tile([m0, n0], [m0 + block_m, n0 + block_n]):
                    acc = hl.zeros([tile_m, tile_n], dtype=torch.float32)
                    for tile_k in hl.tile(0, k):
                        if b_trans:
                            acc = hl.dot(a[tile_m, tile_k], b[tile_n, tile_k].T, acc=acc)
                        else:
                            acc = hl.dot(a[tile_m, tile_k], b[tile_k, tile_n], acc=acc)
                    row_in = tile_m.index < m
                    col_in = tile_n.index < n
                    if scaled:
                        scale_rows = hl.load(scale_a, [tile_m], extra_mask=row_in)
                        scale_cols = hl.load(scale_b, [tile_n], extra_mask=col_in)
                        acc = acc * scale_rows[:, None] * scale_cols[None, :]
                    hl.store(out, [tile_m.index + rank * m, tile_n], acc.to(out.dtype),
                             extra_mask=row_in[:, None] & col_in[None, :])
        # The peers' rows, from the gather buffer: the same block's later tiles (its first may be in the round
        # where its own rows ended), chunk by chunk, rank + 1's first.
        if world_size > 1:
            for rnd in hl.grid(own_rounds - 1, rounds):
                tile = block + rnd * num_blocks
                if tile >= chunk_tiles and tile < num_tiles:
                    step = tile // chunk_tiles
                    # The step of this block's previous tile (0 when it was one of my rows), as the recipe.
                    prev_step = (tile + num_tiles - num_blocks) // chunk_tiles - world_size
                    src = (rank + step) % world_size
                    within = tile % chunk_tiles
                    band = within // band_tiles
                    band_rows = min(tiles_m - band * group_m, group_m)
                    m0 = (band * group_m + within % band_tiles % band_rows) * block_m
                    n0 = within % band_tiles // band_rows * block_n
                    # At a block's first tile of each peer's chunk: the copy engine has landed these rows (acquire),
                    # and TMA will see them (async-proxy fence).
                    if step != prev_step:
                        hl.inline_triton(WAIT_FLAG, args={"progress": progress, "index": src, "value": 1},
                                         output_like=None)
                    row0 = src * m + m0
                    for tile_g, tile_n in hl.tile([row0, n0], [row0 + block_m, n0 + block_n]):
                        acc = hl.zeros([tile_g, tile_n], dtype=torch.float32)
                        for tile_k in hl.tile(0, k):
                            if b_trans:
                                acc = hl.dot(gathered[tile_g, tile_k], b[tile_n, tile_k].T, acc=acc)
                            else:
                                acc = hl.dot(gathered[tile_g, tile_k], b[tile_k, tile_n], acc=acc)
                        # Only the chunk's rows: a tile at its end also read some of the next chunk's, discarded.
                        row_in = tile_g.index < src * m + m
                        col_in = tile_n.index < n
                        if scaled:
                            scale_rows = hl.load(row_scales, [tile_g], extra_mask=row_in)
                            scale_cols = hl.load(scale_b, [tile_n], extra_mask=col_in)
                            acc = acc * scale_rows[:, None] * scale_cols[None, :]
                        hl.store(out, [tile_g, tile_n], acc.to(out.dtype), extra_mask=row_in[:, None] & col_in[None, :])
    return out


@functools.cache
def compiled(block_m: int, block_n: int, block_k: int, num_warps: int, num_stages: int, world_size: int,
             indexing: tuple[str, ...] = INDEXING) -> helion.Kernel:
    """One Helion kernel per tile config, each with an explicit config (``block_sizes``: the tile's m, n and
    k step, per tile loop: one at world size 1, two above; ``indexing`` per load and store of one tile loop: TMA
    through descriptors built on the host, as the recipe's; ``pid_type="flat"``: the recipe's grid, see
    ``helion_ports``)."""
    loops = 1 if world_size == 1 else 2
    # My rows' tile loop (the loop over rounds, Helion's loop 1) flattened as the recipe's (``flattens``).
    flatten = {"range_flattens": (None, True)} if flattens(block_m, block_n) else {}
    return flat_kernel(all_gather_matmul_body, (block_m, block_n, block_k) * loops, num_warps, num_stages,
                       indexing=indexing * loops, host_tensor_descriptors=True, **flatten)


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


def triton_launch(kernel, grid: tuple[int, ...], *args, **meta):
    """The staging kernel's plain launch: Triton's own ``kernel[grid](...)``."""
    return kernel[grid](*args, **meta)


# 16 x 512 bytes a block, 64 a thread (four 16-byte accesses in flight), and enough blocks for every SM.
STAGE_BLOCK_M, STAGE_BLOCK_K, STAGE_WARPS = 16, 512, 4


def stage(a: torch.Tensor, scale_a: torch.Tensor, own_values: torch.Tensor, own_scales: torch.Tensor,
          launcher=None) -> None:
    """This rank's rows and their scales (a per-tensor scale into every row) into its chunk of the gather
    buffer (``buffer_views``), on the current stream (``launch`` calls it on the gather's side stream): one
    kernel."""
    m, k = a.shape
    grid = (cdiv(m, STAGE_BLOCK_M), cdiv(k, STAGE_BLOCK_K))
    (launcher or triton_launch)(stage_kernel, grid, a.view(torch.uint8), scale_a,
                                own_values.view(torch.uint8), own_scales, m, k, own_values.stride(0),
                                own_scales.stride(0), SCALE_ROWWISE=int(scale_a.numel() > 1),
                                BLOCK_M=STAGE_BLOCK_M, BLOCK_K=STAGE_BLOCK_K, num_warps=STAGE_WARPS)


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
    launcher=None,
) -> torch.Tensor:
    """The GEMM alone; mirrors the recipe's ``launch_matmul``: my rows from ``a`` (TMA-ready, ``tma_fp8``) and
    ``scale_a``, the peers' rows and scales from the gather buffer."""
    values, row_scales = buffer_views(gathered, k)
    m, n = out.shape[0] // world_size, out.shape[1]
    args = (
        a, values, b, scale_a.reshape(-1).expand(m), row_scales, scale_b.reshape(-1).expand(n), out, progress,
        num_blocks, rank, world_size, b_trans, True, block_m, block_n, group_m,
    )
    run(compiled(block_m, block_n, block_k, num_warps, num_stages, world_size), args, launcher)
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
    """Resolve the launch configuration (a copy of the recipe's): ``m`` is one rank's rows. ``tile_plan``
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
# The gather: the recipe's, with the barrier a Helion kernel
# ---------------------------------------------------------------------------

# "Every write before this is visible to the peers, and theirs to everything after it on this stream."
SYNC = SYMM_MEM_SYNC[(True, True)]


def barrier_body(anchor: torch.Tensor, signal_pad_ptrs: int, rank: int, world_size: hl.constexpr,
                 group_name: hl.ProcessGroupName) -> None:
    # ``anchor`` is never read: a Helion kernel takes its device from a tensor argument. Block id 0 (grid index 0).
    for block in hl.grid(1):
        hl.inline_triton(SYNC, args={"signal_pad_ptrs": signal_pad_ptrs, "block_id": block, "rank": rank,
                                     "world_size": world_size}, output_like=None)


@functools.cache
def compiled_barrier() -> helion.Kernel:
    """The barrier kernel with an explicit config: one program (``pid_type="flat"``), one warp."""
    return flat_kernel(barrier_body, (), 1)


def barrier(anchor: torch.Tensor, signal_pad_ptrs: int, rank: int, world_size: int, group_name: str,
            launcher=None) -> None:
    """One cross-rank barrier on the current stream (one block, one warp: it fits on the SM the GEMM leaves free)."""
    run(compiled_barrier(), (anchor, signal_pad_ptrs, rank, world_size, group_name), launcher)


_side_streams: dict[torch.device, torch.cuda.Stream] = {}


def side_stream(device: torch.device) -> torch.cuda.Stream:
    """The stream the copies run on (one per device, high priority)."""
    if device not in _side_streams:
        _side_streams[device] = torch.cuda.Stream(device=device, priority=-1)
    return _side_streams[device]


def gather(peers: tuple[torch.Tensor, ...], gathered: torch.Tensor, progress: torch.Tensor, signal_pad_ptrs: int,
           rank: int, group_name: str, launcher) -> None:
    """The recipe's exchange on the current stream (the side stream), after my rows are in my chunk: the first
    barrier, each peer's chunk copied (rank + 1 first) and flagged, the closing barrier."""
    rows, world_size = peers[rank].shape[0], len(peers)
    barrier(progress, signal_pad_ptrs, rank, world_size, group_name, launcher)  # every rank's rows are staged
    flags = progress.view(torch.uint32)
    for step in range(1, world_size):
        peer = (rank + step) % world_size
        gathered[peer * rows:(peer + 1) * rows].copy_(peers[peer])
        _SymmetricMemory.stream_write_value32(flags, peer, 1)
    barrier(progress, signal_pad_ptrs, rank, world_size, group_name, launcher)  # done reading


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
    launcher=None,
) -> torch.Tensor:
    """Launch on planned arguments (no checks); the recipe's ``launch`` signature, staging and gather, this GEMM.

    ``gathered`` is this rank's symmetric gather buffer (bytes, [world_size * M, ``row_bytes(K)``]), ``peers[r]``
    rank r's own chunk of rank r's, ``own_values`` / ``own_scales`` this rank's chunk as fp8 values and fp32 scales
    (``buffer_views``); ``progress`` int32[world_size]; ``out`` [world_size * M, N] bf16; ``group_name``: Helion's
    process-group name. ``launcher``: None for a plain call, or the installed package's (``run``).
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
        gather(peers, gathered, progress, signal_pad_ptrs, rank, group_name, launcher)
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

    The twin spelled out: a symmetric gather buffer on every rank, the plan, one launch. It allocates and
    rendezvouses on every call and checks nothing; ``helion_ports.all_gather_matmul_fp8`` is the installed one."""
    group = dist.group.WORLD if group is None else group
    buffers, cfg = call_buffers(a, b, group, config)
    return launch(a, b, scale_a, scale_b, **buffers, **cfg, group_name=group.group_name)


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

    group = dist.group.WORLD
    buffers, cfg = call_buffers(a, b, group, {})  # the buffers, once
    out = buffers["out"]
    for _ in range(3):  # warm up (the first compiles)
        launch(a, b, scale_a, scale_b, **buffers, **cfg, group_name=group.group_name)
    out.fill_(float("nan"))  # a timed launch that writes nothing fails the check below
    dist.barrier()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(iters):
        launch(a, b, scale_a, scale_b, **buffers, **cfg, group_name=group.group_name)
    torch.cuda.synchronize()
    us = (time.perf_counter() - start) / iters * 1e6
    torch.testing.assert_close(out.float(), expected.float(), rtol=3e-2, atol=3e-2 * expected.abs().max().item())
    if rank == 0:
        print(f"helion all_gather_matmul_fp8: {world_size}x{m} x {n} x {k} fp8: matches NCCL + torch._scaled_mm, {us:.1f} us "
              f"per call (eager launches; {cfg})")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
