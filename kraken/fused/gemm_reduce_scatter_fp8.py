"""FP8 GEMM + reduce-scatter: this rank's rows of ``sum over ranks of _scaled_mm(a, b, scale_a, scale_b)``.

``kraken/fused/gemm_reduce_scatter.py`` for ``torch.float8_e4m3fn`` operands with scales, in the layouts
``torch._scaled_mm`` takes: ``scale_a`` per tensor (one element) or per row ([M, 1]), ``scale_b`` per
tensor or per column ([1, N]), all float32. Each rank's partial is scaled in the epilogue, before it
leaves the SM (``acc * scale_a[rows, None] * scale_b[None, cols]``, fp32), so the ranks' scales may all
differ; the partials cross NVLink in ``out_dtype`` (bf16 by default, as the bf16 recipe's) and are
summed in fp32. fp8 doubles the tensor cores' rate: the exchange has half the GEMM time to hide under.

The kernel is the bf16 recipe's (a copy, so that this file stands alone) with ``SCALED`` and the scale
pointers set, and ``B_TRANS`` for a column-major ``b``. The protocol: a persistent grid, block ``b``
takes band-local tiles ``b, b + blocks, ...`` of every band (grouped by ``GROUP_M`` tile rows); the
peers' bands first (owner ``rank + 1`` first), each tile pushed into this rank's slot of chunk ``b`` of
the owner's workspace; then the own band, one epoch barrier with block ``b`` of every peer after its first
GEMM (a group of one splits it around its band), the peers' partials added from local memory in slot
order (slot ``q`` holds sender ``rank + 1 + q``: deterministic), in fp32, the band's rows stored.
The workspace is double-buffered per block (``parity``) and its barrier rounds are counted per block on
the device (``epochs``): no barrier at the end (the bf16 recipe's docstring says why that is safe).

* Accumulation: the tensor cores' accumulator over the whole k loop (like ``_scaled_mm``'s
  ``use_fast_accum=True``).
* k steps are twice as long as the bf16 recipe's (up to 128: 128 fp8 bytes, one TMA swizzle row):
  the same bytes per pipeline stage, the same tile shapes (``plan``).
* ``b``: Hopper's fp8 wgmma takes both operands K-major from shared memory, so a column-major ``b``
  (``w.t()`` of an [N, K] weight, what ``_scaled_mm`` wants) is read in place as [N, K] and each tile
  is transposed as a shared-memory view (``B_TRANS``); a row-major ``b`` is read as stored, at a cost
  (``b_layout``: ``kraken._gemm_core.fp8_b_operand``).

Layout: ``a`` [M, K] contiguous fp8, M divisible by the world size; ``b`` [K, N] fp8 in any layout;
``out`` [M / ws, N], bf16 or fp32.

This file is the recipe: the kernel, ``plan`` (pure), ``launch`` (the seam the installed package's fast
path calls with its own ``launcher``) and a plain host function. ``kraken.gemm_reduce_scatter_fp8`` is the
same kernel behind the product layer (``kraken.runtime.gemm_reduce_scatter_fp8``: checks agreed across ranks,
the choice between this fused form and ``torch._scaled_mm`` then the SM reduce-scatter, prepared calls).

    torchrun --nproc-per-node 2 kraken/fused/gemm_reduce_scatter_fp8.py
"""

from __future__ import annotations

import math
import os
import time

import torch
import torch.distributed as dist
import torch.distributed._symmetric_memory as symm_mem
import torch.distributed.distributed_c10d as c10d
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from kraken._gemm_core import FP8_B_LAYOUTS as B_LAYOUTS
from kraken._gemm_core import FP8_MAX_BLOCK_K as MAX_BLOCK_K
from kraken._gemm_core import (
    SKINNY_M, SKINNY_STAGE_BYTES, balanced_grid, cdiv, check_tiles, mainloop, scaled,
    skinny_or_large_tiles, tile_coords,
)
from kraken._gemm_core import fp8_b_operand as b_operand
from kraken._gemm_core import tma_fp8 as tma_a
from kraken._ptx_utils import barrier_blocks, epoch_send, epoch_sync, epoch_wait

OP = "gemm_reduce_scatter_fp8"
GROUP_M = 8  # tile rows per group of the tile order (L2 reuse across the blocks running at once)
DEFAULT_CONFIG = {"block_m": None, "block_n": None, "block_k": None, "group_m": GROUP_M, "num_warps": None,
                  "num_stages": None, "max_blocks": None, "b_layout": "auto"}
# The bf16 recipe's band tiles (``default_config``): 128x128 where they fill the waves ``WAVE_GAIN`` better than
# the core's 128x256 above 256 rows per band.
MID_TILE = {"block_m": 128, "block_n": 128, "block_k": 64, "num_warps": 8, "num_stages": 4}
WAVE_GAIN = 0.05
# The skinny tiles (up to 256 rows per band) in fp8: two warpgroups and 4 stages (fp8 stages hold half the bytes
# of bf16's, so more of them fit).
SKINNY_WARPS = 8
SKINNY_STAGES = 4


@triton.jit
def band_tile(a_desc, b_desc, scale_a_ptr, scale_b_ptr, owner, block, rnd, num_blocks, tiles_m, tiles_n, band_m, N, K,
              world_size: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
              GROUP_M: tl.constexpr, B_TRANS: tl.constexpr, SCALED: tl.constexpr, A_ROWWISE: tl.constexpr,
              B_COLWISE: tl.constexpr):
    """Block ``block``'s round ``rnd`` tile of ``owner``'s band (both phases): its fp32 product (times its scales if
    ``SCALED``), its tile row in the band and its first column."""
    tile_m, tile_n = tile_coords(block + rnd * num_blocks, tiles_m, tiles_n, GROUP_M)
    m0 = owner * band_m + tile_m * BLOCK_M
    n0 = tile_n * BLOCK_N
    acc = mainloop(a_desc, b_desc, m0, n0, 0, K, BLOCK_M, BLOCK_N, BLOCK_K, B_TRANS)
    if SCALED:
        acc = scaled(acc, scale_a_ptr, scale_b_ptr, m0, n0, band_m * world_size, N, BLOCK_M, BLOCK_N, A_ROWWISE,
                     B_COLWISE)
    return acc, tile_m, n0


@triton.jit
def own_tile(a_desc, b_desc, scale_a_ptr, scale_b_ptr, workspace_ptr, out_ptr, signal_pad_ptrs, chunk, block, rnd,
             num_blocks, tiles_m, tiles_n, band_m, N, K, rank, epoch, world_size: tl.constexpr, BLOCK_M: tl.constexpr,
             BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, B_TRANS: tl.constexpr,
             SCALED: tl.constexpr, A_ROWWISE: tl.constexpr, B_COLWISE: tl.constexpr, MEET: tl.constexpr,
             WIDE: tl.constexpr):
    """Round ``rnd`` of my band (phase 2): GEMM the tile, meet the peers after it if ``MEET`` and this is the first
    round, add their partials from my workspace, store the rows in the band."""
    TILE: tl.constexpr = BLOCK_M * BLOCK_N
    SLOTS: tl.constexpr = world_size - 1
    acc, tile_m, n0 = band_tile(a_desc, b_desc, scale_a_ptr, scale_b_ptr, rank, block, rnd, num_blocks, tiles_m,
                                tiles_n, band_m, N, K, world_size, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, B_TRANS, SCALED,
                                A_ROWWISE, B_COLWISE)
    if MEET:
        if rnd == 0:  # my pushes are visible to block b of every peer, theirs (to my band) to me
            epoch_sync(signal_pad_ptrs, block, rank, world_size, epoch + 1)
    in_tile = tl.arange(0, BLOCK_M)[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
    # One slot at a time (a loop, not unrolled): a whole tile per slot in flight spills at 8 ranks.
    for q in tl.range(0, SLOTS, num_stages=1):
        acc += tl.load(workspace_ptr + chunk + (rnd * SLOTS + q) * TILE + in_tile).to(tl.float32)
    rows = tile_m * BLOCK_M + tl.arange(0, BLOCK_M)
    if WIDE:  # the band has more than 2**31 - 1 elements
        rows = rows.to(tl.int64)
    cols = n0 + tl.arange(0, BLOCK_N)
    tl.store(out_ptr + (rows[:, None] * N + cols[None, :]), acc.to(out_ptr.dtype.element_ty),
             mask=(rows[:, None] < band_m) & (cols[None, :] < N))


@triton.jit
def gemm_reduce_scatter_kernel(
    a_desc,  # TMA descriptor of a [M, K], BLOCK_M x BLOCK_K boxes
    b_desc,  # b [K, N] in BLOCK_K x BLOCK_N boxes, or (B_TRANS) its transpose [N, K] in BLOCK_N x BLOCK_K
    scale_a_ptr,  # SCALED: fp32 [M] (A_ROWWISE) or [1]
    scale_b_ptr,  # SCALED: fp32 [N] (B_COLWISE) or [1]
    workspace_ptr,  # this rank's BlockWorkspace as [2, chunks, rounds, world_size - 1, BLOCK_M, BLOCK_N], out_dtype
    peers,  # tuple of world_size pointers, peers[r] = rank r's workspace
    parity_ptr,  # int32[chunks]: the half of the workspace block b writes in this launch
    epochs_ptr,  # int32[chunks]: the barrier rounds block b has completed
    out_ptr,  # [M / world_size, N]: this rank's band
    signal_pad_ptrs,  # the workspace's own pads (epoch_sync)
    band_m,  # M / world_size
    N,
    K,
    half_stride,  # workspace strides, in elements
    chunk_stride,
    num_blocks,
    rank,
    world_size: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    # This recipe's: b read as [N, K] (column-major b), each partial times its scales (``scaled``) before it leaves
    # the SM. (The kernel is the bf16 recipe's, ``kraken.fused.gemm_reduce_scatter``, which leaves them off.)
    B_TRANS: tl.constexpr = False,
    SCALED: tl.constexpr = False,
    A_ROWWISE: tl.constexpr = 0,
    B_COLWISE: tl.constexpr = 0,
    FLATTEN: tl.constexpr = False,  # my band's tile loop, but the first tile, flattened with its k loop (``flattens``)
    WIDE: tl.constexpr = False,  # the band (out) has more than 2**31 - 1 elements: 64-bit offsets in the epilogue
):
    TILE: tl.constexpr = BLOCK_M * BLOCK_N
    SLOTS: tl.constexpr = world_size - 1  # a slot per sending peer in each round of a chunk
    block = tl.program_id(0)
    parity = tl.load(parity_ptr + block)
    epoch = tl.load(epochs_ptr + block)
    chunk = parity.to(tl.int64) * half_stride + block.to(tl.int64) * chunk_stride  # a workspace can pass 2**31
    tiles_m = tl.cdiv(band_m, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    rounds = tl.cdiv(tiles_m * tiles_n - block, num_blocks)  # this block's tiles per band, >= 1
    in_tile = tl.arange(0, BLOCK_M)[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]

    # 1. Every peer's band, starting with the next rank's: GEMM, push to the owner.
    for i in tl.range(0, (world_size - 1) * rounds):
        owner = (rank + 1 + i // rounds) % world_size
        rnd = i % rounds
        acc, _, _ = band_tile(a_desc, b_desc, scale_a_ptr, scale_b_ptr, owner, block, rnd, num_blocks, tiles_m, tiles_n,
                              band_m, N, K, world_size, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, B_TRANS, SCALED, A_ROWWISE,
                              B_COLWISE)
        destination = peers[0]
        for r in tl.static_range(1, world_size):
            destination = tl.where(owner == r, peers[r], destination)
        slot = (rank - owner - 1 + world_size) % world_size  # the owner's slot q holds sender owner + 1 + q
        tl.store(destination + chunk + (rnd * SLOTS + slot) * TILE + in_tile, acc.to(workspace_ptr.dtype.element_ty))

    # 2. My band: GEMM, meet the peers once (after the first tile), add their partials, store. Flattened, the first
    # tile (with the barrier) runs before the loop, so that the loop waits on nothing: Triton copies a wait inside a
    # flattened loop into its peeled iterations. A group of one pushed nothing and reads no partial: its barrier (with
    # itself) is split around the whole band, whose loop is flattened. The send goes first, relaxed (nothing in this
    # launch is written before it), the wait last, so neither stands between the block and its first loads.
    ALONE: tl.constexpr = world_size == 1
    PEEL: tl.constexpr = FLATTEN and not ALONE
    if ALONE:
        epoch_send(signal_pad_ptrs, block, rank, world_size, epoch + 1)
    if PEEL:
        own_tile(a_desc, b_desc, scale_a_ptr, scale_b_ptr, workspace_ptr, out_ptr, signal_pad_ptrs, chunk, block, 0,
                 num_blocks, tiles_m, tiles_n, band_m, N, K, rank, epoch, world_size, BLOCK_M, BLOCK_N, BLOCK_K,
                 GROUP_M, B_TRANS, SCALED, A_ROWWISE, B_COLWISE, True, WIDE)
    for rnd in tl.range(1 if PEEL else 0, rounds, flatten=FLATTEN):
        own_tile(a_desc, b_desc, scale_a_ptr, scale_b_ptr, workspace_ptr, out_ptr, signal_pad_ptrs, chunk, block,
                 rnd, num_blocks, tiles_m, tiles_n, band_m, N, K, rank, epoch, world_size, BLOCK_M, BLOCK_N, BLOCK_K,
                 GROUP_M, B_TRANS, SCALED, A_ROWWISE, B_COLWISE, not FLATTEN and not ALONE, WIDE)
    if ALONE:
        epoch_wait(signal_pad_ptrs, block, rank, world_size, epoch + 1)
    # The next launch writes the other half: no "done reading" barrier (the module docstring).
    tl.store(parity_ptr + block, 1 - parity)
    tl.store(epochs_ptr + block, epoch + 1)


def default_config(m: int, n: int, k: int, num_sms: int, world_size: int) -> dict:
    """The bf16 recipe's tiles for one band (``M / world_size`` rows): ``kraken._gemm_core.skinny_or_large_tiles``,
    or ``MID_TILE`` where that fills the waves of ``num_sms`` blocks by ``WAVE_GAIN`` better."""
    band_m = max(m // world_size, 1)
    cfg = skinny_or_large_tiles(band_m, n, k, num_sms, push=band_m <= SKINNY_M and world_size <= 2)

    def fill(tile: dict) -> float:  # the share of the rounds' block slots (rounds x blocks) that get a tile
        tiles = cdiv(band_m, tile["block_m"]) * cdiv(n, tile["block_n"])
        return tiles / (cdiv(tiles, num_sms) * num_sms)

    if band_m > SKINNY_M and fill(MID_TILE) > fill(cfg) + WAVE_GAIN:
        return dict(MID_TILE)
    return cfg


LAUNCH_KEYS = ("b_layout", "block_m", "block_n", "block_k", "group_m", "num_warps", "num_stages")


def plan(m: int, n: int, k: int, world_size: int, config: dict, num_sms: int, pad_bytes: int | None = None) -> dict:
    """The launch configuration (shared with the Helion twin): the bf16 recipe's tiles for the band
    (``default_config``) with k steps twice as long, up to ``MAX_BLOCK_K`` (the same bytes per stage), and its
    persistent grid: at most one block per band tile, per SM (``max_blocks``) and per block id the signal pad
    holds (``pad_bytes``; by default torch's pad size), balanced (``balanced_grid``)."""
    unknown = set(config) - set(DEFAULT_CONFIG)
    if unknown:
        raise TypeError(f"{OP}: unknown config keys {sorted(unknown)}; known: {sorted(DEFAULT_CONFIG)}")
    chosen = {key: value for key, value in config.items() if value is not None}
    tiles = default_config(m, n, k, num_sms, world_size)
    tiles["block_k"] = min(2 * tiles["block_k"], MAX_BLOCK_K)
    if tiles["num_warps"] == 4:  # the skinny tiles: fp8 stages hold half the bytes of bf16's, so more of them
        stage = (tiles["block_m"] + tiles["block_n"]) * tiles["block_k"]
        tiles.update(num_warps=SKINNY_WARPS, num_stages=min(SKINNY_STAGE_BYTES // stage, SKINNY_STAGES))
    cfg = {**DEFAULT_CONFIG, **tiles, **chosen}
    check_tiles(cfg, OP, least_block_k=32)
    if cfg["block_k"] > MAX_BLOCK_K:
        raise ValueError(f"{OP}: block_k must be <= {MAX_BLOCK_K} (one TMA swizzle row of fp8), got {cfg['block_k']}")
    if cfg["b_layout"] not in B_LAYOUTS:
        raise ValueError(f"{OP}: b_layout must be one of {B_LAYOUTS}, got {cfg['b_layout']!r}")
    pad_bytes = symm_mem.get_signal_pad_size() if pad_bytes is None else pad_bytes
    band_tiles = cdiv(max(m // world_size, 1), cfg["block_m"]) * cdiv(max(n, 1), cfg["block_n"])
    max_blocks = num_sms if cfg["max_blocks"] is None else min(cfg["max_blocks"], num_sms)
    grid = max(1, min(band_tiles, max_blocks, barrier_blocks(world_size, pad_bytes)))
    return {**{key: cfg[key] for key in LAUNCH_KEYS}, "num_blocks": balanced_grid(band_tiles, grid)}


def rounds_of(m: int, n: int, world_size: int, cfg: dict) -> int:
    """Tiles per band of block 0, the busiest (``plan``'s ``cfg``): the rounds a chunk holds."""
    band_tiles = cdiv(max(m // world_size, 1), cfg["block_m"]) * cdiv(n, cfg["block_n"])
    return cdiv(band_tiles, cfg["num_blocks"])


def chunk_tile(cfg: dict, world_size: int) -> tuple[int, int, int]:
    """What block ``b``'s chunk of the workspace holds per round: a slot per sending peer, [world_size - 1,
    BLOCK_M, BLOCK_N] (a group of one keeps one unused slot)."""
    return (max(world_size - 1, 1), cfg["block_m"], cfg["block_n"])


def triton_launch(kernel, grid: tuple[int, ...], *args, **meta):
    """``launch``'s default launcher: Triton's own ``kernel[grid](...)``."""
    return kernel[grid](*args, **meta)


def descriptor(tensor: torch.Tensor, block_shape: list[int]) -> TensorDescriptor:
    """A host TMA descriptor of ``tensor`` in ``block_shape`` boxes (zeros past its ends)."""
    return TensorDescriptor(tensor, tensor.shape, tensor.stride(), block_shape)


def launch(
    a: torch.Tensor,
    b: torch.Tensor,
    scale_a: torch.Tensor,
    scale_b: torch.Tensor,
    peers: tuple[torch.Tensor, ...],
    out: torch.Tensor,
    signal_pad_ptrs: int,
    rank: int,
    parity: torch.Tensor,
    epochs: torch.Tensor,
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

    ``peers`` are every rank's workspace viewed as [2, chunks, rounds, *chunk_tile], ``peers[rank]`` this rank's;
    ``out`` is this rank's band [M / world_size, N]; ``group_name`` is unused here (Helion's
    ``hl.ProcessGroupName``). ``launcher``: Triton's own launch, or the installed package's.
    """
    band_m, n = out.shape
    a = tma_a(a)
    b, b_trans = b_operand(b, b_layout)
    workspace = peers[rank]
    b_box = [block_n, block_k] if b_trans else [block_k, block_n]
    launcher(
        gemm_reduce_scatter_kernel, (num_blocks,),
        descriptor(a, [block_m, block_k]), descriptor(b, b_box),
        scale_a, scale_b, workspace, peers, parity, epochs, out, signal_pad_ptrs, band_m, n, a.shape[1],
        *workspace.stride()[:2], num_blocks, rank, len(peers),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, GROUP_M=group_m, B_TRANS=b_trans, SCALED=True,
        A_ROWWISE=int(scale_a.numel() > 1), B_COLWISE=int(scale_b.numel() > 1), num_warps=num_warps,
        num_stages=num_stages,
    )
    return out


def block_workspace(m: int, n: int, cfg: dict, dtype: torch.dtype, device: torch.device,
                    group: dist.ProcessGroup) -> tuple:
    """A fresh symmetric workspace for ``plan``'s ``cfg`` on every rank of ``group`` (a collective): (every rank's
    workspace viewed as [2, num_blocks, rounds, *chunk_tile] as this rank sees it, the signal pads' pointer array,
    this rank, parity, epochs). Its pad is new, all zeros: the barrier rounds count from 1."""
    world_size = group.size()
    shape = (2, cfg["num_blocks"], rounds_of(m, n, world_size, cfg), *chunk_tile(cfg, world_size))
    buf = symm_mem.empty(math.prod(shape), dtype=dtype, device=device)
    handle = symm_mem.rendezvous(buf, group.group_name)
    peers = tuple(buf.view(shape) if r == handle.rank else handle.get_buffer(r, shape, dtype)
                  for r in range(handle.world_size))
    parity = torch.zeros(cfg["num_blocks"], dtype=torch.int32, device=device)
    return peers, handle.signal_pad_ptrs_dev, handle.rank, parity, torch.zeros_like(parity)


def gemm_reduce_scatter_fp8(
    a: torch.Tensor,
    b: torch.Tensor,
    scale_a: torch.Tensor,
    scale_b: torch.Tensor,
    group: dist.ProcessGroup | str | None = None,
    out_dtype: torch.dtype = torch.bfloat16,
    **config,
) -> torch.Tensor:
    """This rank's rows ``[rank * M / ws, (rank + 1) * M / ws)`` of ``sum over ranks of (a * scale_a) @
    (b * scale_b)``, accumulated in fp32, a new [M / ws, N] tensor of ``out_dtype`` (bf16 or fp32), by the fused
    kernel.

    The recipe spelled out: the plan, a symmetric workspace on every rank, one launch. It allocates and
    rendezvouses on every call and checks nothing; ``kraken.gemm_reduce_scatter_fp8`` is the installed one."""
    group = dist.group.WORLD if group is None else group
    group = c10d._resolve_process_group(group) if isinstance(group, str) else group
    (m, k), n = a.shape, b.shape[1]
    world_size = group.size()
    num_sms = torch.cuda.get_device_properties(a.device).multi_processor_count
    cfg = plan(m, n, k, world_size, config, num_sms)
    peers, signal_pad_ptrs, rank, parity, epochs = block_workspace(m, n, cfg, out_dtype, a.device, group)
    out = torch.empty(m // world_size, n, dtype=out_dtype, device=a.device)
    return launch(a, b, scale_a, scale_b, peers, out, signal_pad_ptrs, rank, parity, epochs, **cfg)


def main(m: int = 2048, n: int = 4096, k: int = 4096, iters: int = 20) -> None:
    """Check against ``torch.matmul`` of the scaled operands and NCCL's reduce-scatter and time the kernel
    (``torchrun``, or alone)."""
    if "RANK" not in os.environ:  # run alone: a group of one
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT="29501")
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", device_id=device)
    rank, world_size = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(rank)
    a = torch.randn(m, k, device=device).to(torch.float8_e4m3fn)
    b = torch.randn(n, k, device=device).to(torch.float8_e4m3fn).t()  # column-major, as _scaled_mm takes it
    scale_a = torch.rand(m, 1, device=device) / k**0.5  # per row
    scale_b = torch.rand(1, n, device=device) + 0.5  # per column
    expected = torch.empty(m // world_size, n, device=device)
    dist.reduce_scatter_tensor(expected, (a.float() * scale_a) @ (b.float() * scale_b))
    got = gemm_reduce_scatter_fp8(a, b, scale_a, scale_b)
    torch.testing.assert_close(got.float(), expected, rtol=2e-2, atol=2e-2 * world_size)

    cfg = plan(m, n, k, world_size, {}, torch.cuda.get_device_properties(device).multi_processor_count)
    peers, signal_pad_ptrs, rank, parity, epochs = block_workspace(m, n, cfg, torch.bfloat16, device,
                                                                   dist.group.WORLD)
    out = torch.empty(m // world_size, n, dtype=torch.bfloat16, device=device)
    args = (a, b, scale_a, scale_b, peers, out, signal_pad_ptrs, rank, parity, epochs)
    for _ in range(3):  # warm up (compile)
        launch(*args, **cfg)
    dist.barrier()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(iters):
        launch(*args, **cfg)
    torch.cuda.synchronize()
    us = (time.perf_counter() - start) / iters * 1e6
    torch.testing.assert_close(out.float(), expected, rtol=2e-2, atol=2e-2 * world_size)
    if rank == 0:
        print(f"gemm_reduce_scatter_fp8: {m}x{n}x{k} fp8 x {world_size} ranks: matches matmul + NCCL, {us:.1f} us "
              f"per call (eager launches; {cfg})")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
