"""All-gather + matmul: ``all_gather(a) @ b`` with the gather hidden under the GEMM.

The column-parallel linear layer of sequence/tensor parallelism: every rank holds ``a`` [M, K], its M rows of the
activations, and the same ``b`` [K, N]; every rank needs the product of all ``world_size * M`` rows. The gather moves
(ws-1)/ws of ``a``; the GEMM is far longer, so the craft is starting the GEMM at once and never making it wait for
rows that are not there yet.

* The gather runs on the copy engine into a symmetric gather buffer [world_size * M, K]. On a side stream, the copy
  engine stages ``a`` into this rank's chunk of it (for the peers to read), the ranks meet at one barrier (a
  one-block kernel), each peer's chunk is copied from the peer's buffer (rank + 1 first, so no two ranks read the
  same peer at once) and flagged, and a last barrier says "done reading". The flags are set by stream memory
  operations (``cuStreamWriteValue32``, system-scope fence first): no SM is involved, so GEMM blocks spinning on a
  flag cannot starve the copies. A group of one has no peer to stage for: nothing is staged (but for ``return_a``,
  whose copy of the buffer needs my rows in it).
* Memory ordering: the flags are zeroed on the current stream before the side stream forks from it, and only go
  0 -> 1 within a call; the first barrier follows every write the current stream made before the fork (my rows are
  complete on every rank before anyone copies them); the closing barrier comes after my last copy of a peer's rows,
  and the current stream joins the side stream after the GEMM, so the caller's next write to the buffer waits for
  every peer to be done reading it. Every call (and every CUDA-graph replay) runs the whole protocol, with no host
  round trip. My own rows carry no flag (the GEMM reads them from ``a``), so a group of one zeroes nothing.
* The GEMM is persistent (one block per SM but ``RESERVED_SMS``, left to the barrier kernel) and walks its tiles
  chunk by chunk: first this rank's rows, read from ``a`` itself (so the GEMM starts at once, while the copy engine
  stages them), then rank + 1's, rank + 2's, ... from the gather buffer, in a second loop (a block's tiles are ``pid,
  pid + blocks, ...`` across both). At its first tile of each peer's chunk a block waits for the rows' flag: one
  thread spins on an acquire load, then every thread fences the async proxy (``wait_async``): the rows are read
  through TMA. Within a chunk, tiles go in ``GROUP_M``-row bands (a band's rows and a column of ``b`` tiles stay in
  L2).
* The GEMM is ``kraken._gemm_core.mainloop``: ``a``, the gathered rows and ``b`` load through host-built TMA
  descriptors (zero-padded in k and n where a base or a row is not 16-byte aligned; ``a``'s rows up to ``SKINNY_M``
  padded to whole tiles: ``tma_operands``). Each of the two tile loops has its own k loop; the loops follow each
  other, so their pipeline buffers share shared memory (a branch between two k loops inside one tile loop keeps both
  sets alive: twice the shared memory). On the 128x256 tiles the first loop, which waits on no flag, is flattened
  with its k loop (``kraken._gemm_core.flattens``). A ``b`` stored transposed (``w.t()`` of an [N, K] weight:
  strides (1, K)) is read as is, its tiles transposed in registers (``b_layout``); any other layout is copied
  contiguous. ``tl.dot`` accumulates in fp32; the output, in ``a``'s dtype, is stored through pointers, masked to
  the chunk's rows (a tile at a chunk's end also reads some of the next chunk's rows, and discards them).

Rank r's rows of the output are ``r * M ...``, where ``all_gather(a) @ b`` has them. With ``return_a=True`` the
gathered ``a`` is returned too (a fresh copy, made on the side stream while the GEMM runs). The kernel's constexpr
switches ``SCALED``, ``A_ROWWISE``, ``B_COLWISE`` and its scale arguments are the fp8 recipe's
(``kraken/fused/all_gather_matmul_fp8.py`` holds its own copy of this kernel): at their defaults here they compile
away.

This file is the recipe: the kernels, ``plan`` (pure), ``launch`` (the seam the installed package replays from a
CUDA graph, with its own ``launcher``; on new addresses it drives the parts, ``tma_inputs``, ``gather``,
``launch_matmul``) and a plain host function. ``kraken.all_gather_matmul`` is the same launch behind the product
layer (``kraken.runtime.gather_matmul``: checks agreed across ranks, the choice between this fused form and a
sequential one by size, prepared calls, a shared workspace).

    torchrun --nproc-per-node 2 kraken/fused/all_gather_matmul.py
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
    MAX_INDEX, SKINNY_M, TILE_CONFIGS as CORE_TILES, balanced_grid, cdiv, flattens, mainloop,
    round_up, skinny_or_large_tiles, tile_coords, tma_operands,
)

OP = "all_gather_matmul"
# The GEMM core's tiles, the 128x128 ones 6 stages deep (as cuBLAS runs them at M = 256).
TILE_CONFIGS = [CORE_TILES[0], {**CORE_TILES[1], "num_stages": 6}]
# Tiles: the largest of the GEMM core's ``TILE_CONFIGS`` that still gives ``MIN_TILES_PER_SM`` of the SMs
# a tile (a small M leaves the 128x256 tiles too few to fill them), ``GROUP_M`` row tiles per band.
MIN_TILES_PER_SM = 0.9
GROUP_M = 8
# The GEMM leaves this many SMs free. Its blocks spin on flags that follow the gather's one-block barrier
# kernel, which must find an SM while every GEMM block is resident (the twin's 8-warp block can take all of
# an SM's registers). At the default shapes the last round of tiles is partial anyway: no round is added.
RESERVED_SMS = 1
# ``b_layout``: "auto" reads b as it is stored (row-major, or transposed: strides (1, K)); "kn" / "nk" force
# a row-major / transposed copy when b is stored otherwise.
B_LAYOUTS = ("auto", "kn", "nk")
DEFAULT_CONFIG = {**TILE_CONFIGS[0], "group_m": GROUP_M, "max_blocks": None, "b_layout": "auto"}


@triton.jit
def all_gather_matmul_kernel(
    a_desc,  # my rows [M, K] (``a``), BLOCK_M x BLOCK_K boxes
    gathered_desc,  # the gathered a [world_size * M, K], the same boxes: rank r's rows at r * M
    b_desc,  # b [K, N] in BLOCK_K x BLOCK_N boxes, or (B_TRANS) its transpose [N, K] in BLOCK_N x BLOCK_K
    out_ptr,  # [world_size * M, N]
    progress_ptr,  # int32 flags, 0 -> 1: [r] rank r's rows have landed
    row_scales_ptr,  # SCALED: fp32 scale of gathered row i at row_scales_ptr + i * scale_stride; None here
    scale_a_ptr,  # SCALED: my rows' fp32 scales, [M] (A_ROWWISE) or [1]; None here
    scale_b_ptr,  # SCALED: fp32 [N] (B_COLWISE) or [1]; None here
    M,
    N,
    K,
    scale_stride,  # SCALED; None here
    rank,
    world_size: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    B_TRANS: tl.constexpr,
    # The fp8 recipe's (``kraken.fused.all_gather_matmul_fp8``); this one leaves them at their defaults.
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


def triton_launch(kernel, grid: tuple[int, ...], *args, **meta):
    """``launch``'s default launcher: Triton's own ``kernel[grid](...)``."""
    return kernel[grid](*args, **meta)


def descriptor(tensor: torch.Tensor, block_shape: list[int]) -> TensorDescriptor:
    """A host TMA descriptor over ``tensor`` in ``block_shape`` boxes."""
    return TensorDescriptor(tensor, tensor.shape, tensor.stride(), block_shape)


def b_operand(b: torch.Tensor, layout: str) -> tuple[torch.Tensor, bool]:
    """``b`` as the kernel reads it: (tensor, transposed). Row-major ``b`` as is; a transposed one (strides
    (1, K), e.g. ``w.t()``) as ``b.t()`` [N, K]; anything else, or a layout the config forces, copied."""
    row_major = b.stride(1) == 1 and b.stride(0) >= max(b.shape[1], 1)
    transposed = b.stride(0) == 1 and b.stride(1) >= max(b.shape[0], 1)
    if layout == "nk" or (layout == "auto" and transposed and not row_major):
        bt = b.t()
        return (bt if bt.is_contiguous() else bt.contiguous()), True
    return (b if b.is_contiguous() else b.contiguous()), False


def tma_inputs(a: torch.Tensor, b: torch.Tensor, b_layout: str, block_m: int = 1
               ) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """(a, b, b transposed) as TMA loads them: ``b`` in its layout (``b_operand``), and both zero-padded in
    k and n where a base or a row is not 16-byte aligned, ``a``'s rows to whole ``block_m`` tiles up to
    ``SKINNY_M`` rows (``tma_operands``, by way of b's row-major view)."""
    b, trans = b_operand(b, b_layout)
    a, b_kn = tma_operands(a, b.t() if trans else b, block_m)
    if trans:
        return a, (b if b_kn.data_ptr() == b.data_ptr() else b_kn.t().contiguous()), True
    return a, b_kn, False


def launch_matmul(
    a: torch.Tensor,
    gathered: torch.Tensor,
    b: torch.Tensor,
    out: torch.Tensor,
    progress: torch.Tensor,
    rank: int,
    world_size: int,
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
    """The GEMM alone, on TMA-ready operands (``tma_inputs``; my rows ``a``, the peers' in ``gathered``): the
    consumer of the flags in ``progress``."""
    k = gathered.shape[1]
    m, n = out.shape[0] // world_size, out.shape[1]
    b_box = [block_n, block_k] if b_trans else [block_k, block_n]
    launcher(
        all_gather_matmul_kernel, (num_blocks,),
        descriptor(a, [block_m, block_k]), descriptor(gathered, [block_m, block_k]),
        descriptor(b, b_box), out, progress, None, None, None, m, n, k, None, rank, world_size,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, GROUP_M=group_m, B_TRANS=b_trans,
        FLATTEN=flattens(block_m, block_n), WIDE=out.numel() > MAX_INDEX, num_warps=num_warps, num_stages=num_stages,
    )
    return out


def tile_plan(m: int, n: int, k: int, world_size: int, config: dict, num_sms: int, tile_configs: list,
              defaults: dict, op: str, least_block_k: int = 16, operand_bytes: int = 2) -> tuple[dict, int]:
    """The GEMM's tiles and grid (the fp8 recipe holds a copy): the largest of ``tile_configs`` that gives ``MIN_TILES_PER_SM`` of the SMs a
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
    """Resolve the launch configuration (the Helion twin holds a copy): ``m`` is one rank's rows.

    The tiles and the persistent grid of ``tile_plan``.
    """
    unknown = set(config) - set(DEFAULT_CONFIG)
    if unknown:
        raise TypeError(f"{OP}: unknown config keys {sorted(unknown)}; known: {sorted(DEFAULT_CONFIG)}")
    cfg, num_blocks = tile_plan(m, n, k, world_size, config, num_sms, TILE_CONFIGS, DEFAULT_CONFIG, OP)
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
           rank: int, a_out: torch.Tensor | None, launcher) -> None:
    """The exchange on the current stream (the side stream), after my rows are in my chunk: the first barrier, each
    peer's chunk copied by the copy engine (rank + 1 first) and flagged, the ``a_out`` snapshot, the closing
    barrier. My chunk is ``peers[rank]``, already in place."""
    rows, world_size = peers[rank].shape[0], len(peers)
    barrier(signal_pad_ptrs, rank, world_size, launcher)  # every rank's rows are staged
    flags = progress.view(torch.uint32)  # (the stream operations' dtype; the kernel reads int32)
    for step in range(1, world_size):
        peer = (rank + step) % world_size
        gathered[peer * rows:(peer + 1) * rows].copy_(peers[peer])
        _SymmetricMemory.stream_write_value32(flags, peer, 1)  # after the copy, fenced system-wide
    if a_out is not None:
        a_out.copy_(gathered)
    barrier(signal_pad_ptrs, rank, world_size, launcher)  # done reading: peers may stage into their buffers again


def launch(
    a: torch.Tensor,
    b: torch.Tensor,
    peers: tuple[torch.Tensor, ...],
    gathered: torch.Tensor,
    out: torch.Tensor,
    progress: torch.Tensor,
    signal_pad_ptrs: int,
    rank: int,
    a_out: torch.Tensor | None,
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

    ``gathered`` [world_size * M, K'] (K' = K padded for TMA) is this rank's symmetric gather buffer, ``peers[r]``
    rank r's chunk of rank r's (where r's own rows go); ``progress`` int32[world_size]; ``out`` [world_size * M, N];
    ``a_out``: where to copy the gathered ``a`` (``return_a``), or None; ``group_name`` is unused here (Helion's
    process-group name). ``launcher(kernel, grid, *args, **meta)``: Triton's own launch, or the installed package's.
    """
    m, world_size = a.shape[0], len(peers)
    a, b, b_trans = tma_inputs(a, b, b_layout, block_m)
    side = side_stream(a.device)
    if world_size > 1:
        progress.zero_()  # before the fork: no flag of the previous call survives into this one
    current = torch.cuda.current_stream(a.device)  # (the device named: else torch looks it up, a device query)
    side.wait_stream(current)  # the fork
    torch.cuda.set_stream(side)
    try:
        if world_size > 1 or a_out is not None:  # my rows into my chunk, for the peers (and the snapshot)
            peers[rank].copy_(a[:m])
        gather(peers, gathered, progress, signal_pad_ptrs, rank, a_out, launcher)
    finally:
        torch.cuda.set_stream(current)
    launch_matmul(a, gathered, b, out, progress, rank, world_size, b_trans, block_m, block_n, block_k, group_m,
                  num_warps, num_stages, num_blocks, launcher)
    current.wait_stream(side)  # the join: the caller may write the buffer again
    return out


def symmetric_chunks(m: int, k: int, dtype: torch.dtype, device: torch.device, group) -> tuple:
    """A symmetric gather buffer [world_size * m, k] on every rank of ``group`` (a collective): (this rank's buffer,
    every rank's own chunk of its buffer as this rank sees it, the signal pads' pointer array, this rank)."""
    world_size = dist.get_world_size(group)
    gathered = symm_mem.empty(world_size * m, k, dtype=dtype, device=device)
    handle = symm_mem.rendezvous(gathered, group.group_name)
    peers = tuple((gathered if r == handle.rank else handle.get_buffer(r, (world_size * m, k), dtype))[r * m:(r + 1) * m]
                  for r in range(world_size))
    return gathered, peers, handle.signal_pad_ptrs_dev, handle.rank


def call_buffers(a: torch.Tensor, b: torch.Tensor, group: dist.ProcessGroup, return_a: bool, config: dict
                 ) -> tuple[dict, dict]:
    """What a call on ``a`` and ``b`` launches on (a collective: every rank of ``group`` calls it): ``launch``'s
    buffer arguments by name (peers, gather buffer, out, zeroed progress flags, signal pads, rank, ``a_out`` when
    ``return_a``) and the plan. Shared by the plain host function and the timing in ``main``."""
    (m, k), n = a.shape, b.shape[1]
    world_size = dist.get_world_size(group)
    gathered, peers, signal_pad_ptrs, rank = symmetric_chunks(m, round_up(k, 16 // a.element_size()), a.dtype,
                                                               a.device, group)
    cfg = plan(m, n, k, world_size, config, torch.cuda.get_device_properties(a.device).multi_processor_count)
    out = a.new_empty(world_size * m, n)
    a_out = torch.empty_like(gathered) if return_a else None
    progress = torch.zeros(world_size, dtype=torch.int32, device=a.device)
    return {"peers": peers, "gathered": gathered, "out": out, "progress": progress, "signal_pad_ptrs": signal_pad_ptrs,
            "rank": rank, "a_out": a_out}, cfg


def all_gather_matmul(
    a: torch.Tensor,
    b: torch.Tensor,
    group: dist.ProcessGroup | None = None,
    return_a: bool = False,
    **config,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """``all_gather(a) @ b`` as a new [world_size * M, N] tensor in ``a``'s dtype (and the gathered [world_size * M,
    K] ``a`` first when ``return_a``); ``a`` [M, K] bf16 or fp16, contiguous, the same shape on every rank.

    The recipe spelled out: a symmetric gather buffer on every rank, the plan, one launch (the gather on the copy
    engine under the GEMM). It allocates and rendezvouses on every call and checks nothing; ``kraken.all_gather_matmul``
    is the installed one (checks agreed across ranks, a sequential form for small sizes, prepared calls)."""
    group = dist.group.WORLD if group is None else group
    buffers, cfg = call_buffers(a, b, group, return_a, config)
    out = launch(a, b, **buffers, **cfg)
    return (buffers["a_out"][:, :a.shape[1]], out) if return_a else out


def main(m: int = 1024, n: int = 8192, k: int = 8192, iters: int = 20) -> None:
    """Check against NCCL's all-gather and torch's matmul, and time ``launch`` on buffers prepared once (``torchrun``,
    or alone)."""
    if "RANK" not in os.environ:  # run alone: a group of one
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT="29501")
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", device_id=device)
    rank, world_size = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(rank)
    a = torch.randn(m, k, dtype=torch.bfloat16, device=device)
    torch.manual_seed(1234)  # the same b on every rank
    b = torch.randn(k, n, dtype=torch.bfloat16, device=device) / k ** 0.5
    gathered = torch.empty(world_size * m, k, dtype=a.dtype, device=device)
    dist.all_gather_into_tensor(gathered, a)
    expected = gathered @ b
    got_a, got = all_gather_matmul(a, b, return_a=True)
    assert torch.equal(got_a, gathered)
    torch.testing.assert_close(got, expected, rtol=2e-2, atol=2e-2)

    buffers, cfg = call_buffers(a, b, dist.group.WORLD, False, {})  # the buffers, once
    out = buffers["out"]
    for _ in range(3):  # warm up (compile)
        launch(a, b, **buffers, **cfg)
    out.fill_(float("nan"))  # a timed launch that writes nothing fails the check below
    dist.barrier()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(iters):
        launch(a, b, **buffers, **cfg)
    torch.cuda.synchronize()
    us = (time.perf_counter() - start) / iters * 1e6
    torch.testing.assert_close(out, expected, rtol=2e-2, atol=2e-2)
    if rank == 0:
        print(f"all_gather_matmul: {world_size}x{m} x {n} x {k} bf16: matches NCCL + torch.matmul, {us:.1f} us per "
              f"call (eager launches; {cfg})")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
