"""GEMM + reduce-scatter: this rank's rows of ``sum over ranks of a @ b`` in one kernel.

The row-parallel linear layer of sequence parallelism: every rank holds a slice of
the reduction dimension (``a`` [M, K], ``b`` [K, N]) and keeps only its band of the
summed product, rows ``[rank * M / ws, (rank + 1) * M / ws)``. Each band is cut into
``BLOCK_M x BLOCK_N`` tiles with band-local indices ``j`` (grouped by ``GROUP_M`` tile
rows, so the blocks running at once share ``a`` rows and ``b`` columns in L2). The
grid is persistent: block ``b`` takes tiles ``j = b, b + blocks, ...`` of *every* band,
the same ``j`` on every rank, so block ``b`` of a rank exchanges only with block ``b``
of the others (block ``b`` writes only chunk ``b`` of the workspace).

1. Peers' bands, owners ``rank + 1, rank + 2, ...`` (so the ranks do not all push to
   one peer at once): GEMM each tile (``kraken._gemm_core.mainloop``) and push the
   partial, in ``out_dtype``, into this rank's slot of chunk ``b`` of the owner's
   workspace: posted NVLink stores that drain while the next tiles compute.
2. Own band: GEMM each tile; after the first one, one epoch barrier with block ``b``
   of every peer ("my pushes are visible to you, yours to me"; ``epoch_sync``, the
   workspace's own pad, no compare-and-swap round trip), placed after a GEMM so that
   the last pushes drain under it (a group of one splits it around its band: below).
   Then add the peers' partials of the tile from local memory (slot ``q`` holds sender ``rank + 1 + q``:
   a fixed order, so results are deterministic), in fp32, to the tile still in
   registers and store the rows that lie in the band and in N.

Rows past a band's end (``M / ws`` not a multiple of ``BLOCK_M``) are the next band's
rows, or TMA's zeros past M: computed and pushed, never stored to ``out``.

The workspace: a symmetric buffer viewed as [2, chunks, rounds, world_size - 1, BLOCK_M,
BLOCK_N] of ``out_dtype`` (two halves of a chunk per block, a slot per sending peer in each
round: ``rounds_of``, ``chunk_tile``), with ``parity`` and ``epochs`` (int32 per block) and
the buffer's own signal pad. No barrier at the end: block ``b`` writes half ``parity[b]``
and flips it, so a launch writes the half the previous launch did not, and the launch
before that has finished on every rank (each launch passes a barrier with every peer,
and a peer's kernel starts only after its previous one ended); its barrier rounds are
numbered ``epochs[b] + 1, ...`` and advance on the device, so CUDA graphs replay it as is.

Layout: ``a`` [M, K] and ``b`` [K, N] contiguous, bf16 or fp16, the same shapes on every
rank, M divisible by the world size; ``out`` [M / ws, N], bf16 or fp32. TMA needs 16-byte
aligned rows: other operands are zero-padded copies (``kraken._gemm_core.tma_operands``).

The kernel's constexpr switches for fp8 (``B_TRANS``, ``SCALED``) and its scale pointers
stay at their defaults here, and compile away.

This file is the recipe: the kernel, ``plan`` (pure), ``launch`` (the seam the installed
package's fast path calls with its own ``launcher``) and a plain host function.
``kraken.gemm_reduce_scatter`` is the same kernel behind the product layer
(``kraken.runtime.gemm_reduce_scatter``: checks agreed across ranks, the choice between this
fused form and cuBLAS then the SM reduce-scatter, a prepared call per signature, a shared
workspace, replayed launches).

    torchrun --nproc-per-node 2 kraken/fused/gemm_reduce_scatter.py
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

from kraken._gemm_core import (
    MAX_INDEX, SKINNY_M, balanced_grid, cdiv, check_tiles, flattens, mainloop, scaled, skinny_or_large_tiles,
    tile_coords, tma_operands,
)
from kraken._ptx_utils import barrier_blocks, epoch_send, epoch_sync, epoch_wait

OP = "gemm_reduce_scatter"
GROUP_M = 8  # tile rows per group of the tile order (L2 reuse across the blocks running at once)
DEFAULT_CONFIG = {"block_m": None, "block_n": None, "block_k": None, "group_m": GROUP_M, "num_warps": None,
                  "num_stages": None, "max_blocks": None}
# Above 256 rows per band the tensor cores bind, and each phase ends in a partial wave of tiles. 128x128 tiles
# (8 warps, 4 stages) replace the core's 128x256 where they fill the waves ``WAVE_GAIN`` better (a short last
# wave costs as much as a full one).
MID_TILE = {"block_m": 128, "block_n": 128, "block_k": 64, "num_warps": 8, "num_stages": 4}
WAVE_GAIN = 0.05


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
    scale_a_ptr,  # SCALED: fp32 [M] (A_ROWWISE) or [1]; None here
    scale_b_ptr,  # SCALED: fp32 [N] (B_COLWISE) or [1]; None here
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
    # The fp8 recipe's (``kraken.fused.gemm_reduce_scatter_fp8``): b read as [N, K], each partial times its
    # scales (``scaled``) before it leaves the SM. This recipe leaves them at their defaults.
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
    """The tiles for one band (``M / world_size`` rows): ``kraken._gemm_core.skinny_or_large_tiles`` (up to 256
    rows one warpgroup on narrow tiles that fit one wave, bound by streaming ``b``, 64 wide on 64-row tiles up
    to 2 ranks; above, the largest tile that gives more than half the SMs a tile), or ``MID_TILE`` where that
    fills the waves of ``num_sms`` blocks by ``WAVE_GAIN`` better."""
    band_m = max(m // world_size, 1)
    cfg = skinny_or_large_tiles(band_m, n, k, num_sms, push=band_m <= SKINNY_M and world_size <= 2)

    def fill(tile: dict) -> float:  # the share of the rounds' block slots (rounds x blocks) that get a tile
        tiles = cdiv(band_m, tile["block_m"]) * cdiv(n, tile["block_n"])
        return tiles / (cdiv(tiles, num_sms) * num_sms)

    if band_m > SKINNY_M and fill(MID_TILE) > fill(cfg) + WAVE_GAIN:
        return dict(MID_TILE)
    return cfg


LAUNCH_KEYS = ("block_m", "block_n", "block_k", "group_m", "num_warps", "num_stages")


def plan(m: int, n: int, k: int, world_size: int, config: dict, num_sms: int, pad_bytes: int | None = None) -> dict:
    """The launch configuration: ``DEFAULT_CONFIG`` overridden by ``config``, the tiles of ``default_config`` for
    what it leaves None, and a persistent grid of at most one block per band tile, per SM (``max_blocks``) and
    per block id the signal pad holds (``pad_bytes``; by default torch's pad size), balanced (``balanced_grid``:
    every round of a band as many tiles). Shared with the Helion twin."""
    unknown = set(config) - set(DEFAULT_CONFIG)
    if unknown:
        raise TypeError(f"{OP}: unknown config keys {sorted(unknown)}; known: {sorted(DEFAULT_CONFIG)}")
    chosen = {key: value for key, value in config.items() if value is not None}
    cfg = {**DEFAULT_CONFIG, **default_config(m, n, k, num_sms, world_size), **chosen}
    check_tiles(cfg, OP)
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
    BLOCK_M, BLOCK_N]; a group of one has no sender but keeps one (unused) slot, so that its workspace, views
    and barrier pads are those of any other group."""
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
    peers: tuple[torch.Tensor, ...],
    out: torch.Tensor,
    signal_pad_ptrs: int,
    rank: int,
    parity: torch.Tensor,
    epochs: torch.Tensor,
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
    ``hl.ProcessGroupName``). ``launcher(kernel, grid, *args, **meta)``: Triton's own launch, or the one the
    installed package's prepared call passes (its host fast path).
    """
    band_m, n = out.shape
    a, b = tma_operands(a, b, block_m)  # a's rows zero-padded to whole tiles (``tma_operands`` says why)
    workspace = peers[rank]
    launcher(
        gemm_reduce_scatter_kernel, (num_blocks,),
        descriptor(a, [block_m, block_k]), descriptor(b, [block_k, block_n]),
        None, None, workspace, peers, parity, epochs, out, signal_pad_ptrs, band_m, n, a.shape[1],
        *workspace.stride()[:2], num_blocks, rank, len(peers),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, GROUP_M=group_m,
        FLATTEN=flattens(block_m, block_n, out.element_size()), WIDE=out.numel() > MAX_INDEX, num_warps=num_warps,
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


def gemm_reduce_scatter(
    a: torch.Tensor,
    b: torch.Tensor,
    group: dist.ProcessGroup | str | None = None,
    out_dtype: torch.dtype = torch.bfloat16,
    **config,
) -> torch.Tensor:
    """This rank's rows ``[rank * M / ws, (rank + 1) * M / ws)`` of ``sum over ranks of a @ b``, a new
    [M / ws, N] tensor of ``out_dtype`` (bf16 or fp32), by the fused kernel.

    The recipe spelled out: the plan, a symmetric workspace on every rank, one launch. It allocates and
    rendezvouses on every call and checks nothing; ``kraken.gemm_reduce_scatter`` is the installed one (checks
    agreed across ranks, cuBLAS then the SM reduce-scatter where that is faster, prepared calls)."""
    group = dist.group.WORLD if group is None else group
    group = c10d._resolve_process_group(group) if isinstance(group, str) else group
    (m, k), n = a.shape, b.shape[1]
    world_size = group.size()
    num_sms = torch.cuda.get_device_properties(a.device).multi_processor_count
    cfg = plan(m, n, k, world_size, config, num_sms)
    peers, signal_pad_ptrs, rank, parity, epochs = block_workspace(m, n, cfg, out_dtype, a.device, group)
    out = torch.empty(m // world_size, n, dtype=out_dtype, device=a.device)
    return launch(a, b, peers, out, signal_pad_ptrs, rank, parity, epochs, **cfg)


def main(m: int = 2048, n: int = 4096, k: int = 4096, iters: int = 20) -> None:
    """Check against ``torch.matmul`` and NCCL's reduce-scatter and time the kernel (``torchrun``, or alone)."""
    if "RANK" not in os.environ:  # run alone: a group of one
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT="29501")
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", device_id=device)
    rank, world_size = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(rank)
    a = (torch.randn(m, k, device=device) / k**0.5).to(torch.bfloat16)
    b = torch.randn(k, n, device=device).to(torch.bfloat16)
    expected = torch.empty(m // world_size, n, device=device)
    dist.reduce_scatter_tensor(expected, a.float() @ b.float())
    got = gemm_reduce_scatter(a, b)
    torch.testing.assert_close(got.float(), expected, rtol=2e-2, atol=2e-2 * world_size)

    cfg = plan(m, n, k, world_size, {}, torch.cuda.get_device_properties(device).multi_processor_count)
    peers, signal_pad_ptrs, rank, parity, epochs = block_workspace(m, n, cfg, torch.bfloat16, device,
                                                                   dist.group.WORLD)
    out = torch.empty(m // world_size, n, dtype=torch.bfloat16, device=device)
    for _ in range(3):  # warm up (compile)
        launch(a, b, peers, out, signal_pad_ptrs, rank, parity, epochs, **cfg)
    dist.barrier()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(iters):
        launch(a, b, peers, out, signal_pad_ptrs, rank, parity, epochs, **cfg)
    torch.cuda.synchronize()
    us = (time.perf_counter() - start) / iters * 1e6
    torch.testing.assert_close(out.float(), expected, rtol=2e-2, atol=2e-2 * world_size)
    if rank == 0:
        print(f"gemm_reduce_scatter: {m}x{n}x{k} bf16 x {world_size} ranks: matches matmul + NCCL, {us:.1f} us per "
              f"call (eager launches; {cfg})")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
