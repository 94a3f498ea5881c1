"""The GEMM core every fused GEMM recipe runs: main loop, tile order, tiles, operands, checks.

CUTLASS's split between mainloop and epilogue: this module is the mainloop (TMA loads through host-built
descriptors, ``tl.dot`` into fp32 on wgmma, the k loop's software pipeline) and the persistent schedule's
tile order; a recipe adds its prologue (flag waits, barriers) and its epilogue (push, reduce, scale,
store). The recipes import from here, never from each other (an fp8 recipe runs its bf16 sibling's
kernel with constexpr switches). An improvement to the main loop reaches every recipe at once.

* ``mainloop``: one output tile's k loop over ``[k_begin, k_end)``; TMA fills rows and columns past the
  tensors' ends with zeros, so there are no masks. ``B_TRANS``: ``b`` stored as [N, K] (fp8 wgmma takes
  both operands K-major; the tile is transposed as a shared-memory view).
* ``tile_coords``: tile ``j`` of a ``tiles_m x tiles_n`` grid in ``GROUP_M``-row bands, column-major within
  a band, so that the blocks running at once share rows of ``a`` and columns of ``b`` in L2 (``GROUP_M``
  1: row-major).
* ``scaled``: the fp8 epilogue's ``acc * scale_a[rows] * scale_b[cols]``.
* Host: ``tma_operands`` / ``tma_fp8`` / ``fp8_b_operand`` (operands TMA can address), the tile choices
  (``TILE_CONFIGS``, ``skinny_or_large_tiles``), whether a recipe's tile loop is flattened (``flattens``: its
  ``FLATTEN`` constexpr), and ``check_tiles`` (a tile configuration's sizes). The argument checks of the
  recipes' inputs are the product layer's (``kraken.runtime.gemm_checks``).

It imports nothing of the project: a recipe copied with it (and ``kraken._ptx_utils``, ``kraken._blocks``) runs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

INPUT_DTYPES = (torch.bfloat16, torch.float16)
OUT_DTYPES = (torch.bfloat16, torch.float32)
FP8 = torch.float8_e4m3fn
MAX_INDEX = 2**31 - 1  # the largest offset 32-bit arithmetic reaches (TMA coordinates are per dimension)
TMA_ALIGN = 16  # bytes: TMA needs 16-byte aligned bases and row strides; others are padded (``tma_operands``)

# bf16/fp16 tiles, largest first: 128x256 on two consumer warpgroups where the shape has the tiles to fill the
# SMs, else 128x128. fp8 takes the same tiles with k steps twice as long (the same bytes per stage).
TILE_CONFIGS = [
    {"block_m": 128, "block_n": 256, "block_k": 64, "num_warps": 8, "num_stages": 3},
    {"block_m": 128, "block_n": 128, "block_k": 64, "num_warps": 8, "num_stages": 4},
]
FP8_MAX_BLOCK_K = 128  # fp8 bytes per TMA box row: one 128-byte swizzle row

# Tile choice for the reduce recipes (see ``skinny_or_large_tiles``; ``python -m benchmark.tune`` sweeps it). Up to
# ``SKINNY_M`` rows the GEMM is bound by streaming ``b`` from HBM: one warpgroup per tile, 128-deep k steps (fewer,
# larger TMA loads), and the narrowest tile (32 wide, 64 when pushing 64-row tiles) that still fits all tiles in one
# wave of the SMs, so that every SM streams its own columns of ``b``. Larger M is bound by the tensor cores and takes
# the largest of ``TILE_CONFIGS`` that still gives ``MIN_TILES_PER_SM`` of the SMs a tile.
SKINNY_M = 256
SKINNY_BLOCK_K = 128
SKINNY_STAGE_BYTES = 192 * 1024  # shared memory for the pipeline stages (of the 227 KiB an SM offers)
SKINNY_MAX_STAGES = 5
# Skinny tiles at least this wide (block_m + block_n: 128x64, 128x128, 64x128) take 64-deep k steps, as many stages as
# ``SKINNY_STAGE_BYTES`` hold up to ``SKINNY_MAX_STAGES_64``: a stage of a wide tile 128 deep is so large that the
# budget holds only 3-4 of them, too few loads in flight to hide HBM's latency; halving the step doubles the stages.
# Narrower tiles (64x32, 128x32) already hold enough 128-deep stages and keep the fewer, larger loads. cuBLAS makes the
# same choice at these shapes: 128x64 tiles 64 deep with 8 stages, 128x128 64 deep with 6 (docs/history.md, the GEMM
# core).
SKINNY_WIDE = 192
SKINNY_MAX_STAGES_64 = 8
MIN_TILES_PER_SM = 0.55
# A persistent tile loop over tiles of at least ``FLATTEN_MIN_TILE`` elements runs as ``tl.range(..., flatten=True)``
# (``flattens``): Triton fuses it with the k loop into one pipelined loop, so the next tile's first loads are in flight
# during this tile's epilogue. That pays where a tile's epilogue is long (128x256 tiles, 3 stages: a few percent of the
# GEMM); on smaller tiles with deep pipelines (128x128 six stages deep, the skinny tiles) the fused loop is slower
# (docs/history.md, the GEMM core). Only a loop with no barrier or flag wait in it is flattened: Triton copies the loop
# body's wait into the flattened loop's peeled iterations (two acquire spins in the PTX of all_gather_matmul's peer
# loop), so that loop and gemm_one_shot_all_reduce's stay as they are, and gemm_reduce_scatter runs its band's first
# tile, the one with the barrier, before its flattened loop (its fp8 sibling stays unflattened: flattened, it spills at
# 2 ranks).
FLATTEN_MIN_TILE = 128 * 256


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def round_up(a: int, multiple: int) -> int:
    return cdiv(a, multiple) * multiple


def balanced_grid(num_tiles: int, max_blocks: int) -> int:
    """A persistent GEMM's blocks: as few as still take its tiles in the fewest rounds (``max_blocks`` at once), so
    that every round runs as many tiles, not full rounds and a short last one. A short last round costs as much as a
    full one, and the tiles' operands come through L2, which fewer concurrent tiles share: 208 tiles of 128x256 on 132
    SMs run faster as two rounds of 104 than as a round of 132 and one of 76 (docs/history.md, the GEMM core)."""
    rounds = cdiv(num_tiles, max(1, max_blocks))
    return max(1, cdiv(num_tiles, rounds))


def flattens(block_m: int, block_n: int, out_bytes: int = 2) -> bool:
    """Whether a persistent tile loop over ``block_m x block_n`` tiles is flattened (``FLATTEN_MIN_TILE``), for
    outputs of ``out_bytes`` per element: not for 4-byte outputs, whose epilogue stages a whole fp32 tile in shared
    memory (128 KiB at 128x256), which a flattened loop needs beside its pipeline's buffers (272 KiB in all, of
    227)."""
    return block_m * block_n >= FLATTEN_MIN_TILE and out_bytes <= 2


@triton.jit
def tile_coords(j, tiles_m, tiles_n, GROUP_M: tl.constexpr):
    """Tile ``j`` -> (tile row, tile column), ``GROUP_M`` tile rows at a time, column-major within a group:
    consecutive ``j`` (the blocks running at once) share rows of ``a`` and columns of ``b``. ``GROUP_M`` 1:
    row-major, and a ``j`` past the last tile gets a tile row past the last (a persistent loop's empty round)."""
    if GROUP_M == 1:
        return j // tiles_n, j % tiles_n
    width = GROUP_M * tiles_n
    first_m = j // width * GROUP_M
    rows = tl.minimum(tiles_m - first_m, GROUP_M)
    return first_m + (j % width) % rows, (j % width) // rows


@triton.jit
def mainloop(a_desc, b_desc, m0, n0, k_begin, k_end, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
             BLOCK_K: tl.constexpr, B_TRANS: tl.constexpr):
    """The fp32 product of rows ``m0...`` of ``a`` and columns ``n0...`` of ``b`` over ``[k_begin, k_end)``:
    TMA loads (zeros past the tensors' ends: no masks), ``tl.dot`` on wgmma, pipelined by the caller's
    ``num_stages``. ``b_desc`` holds [K, N] boxes, or (``B_TRANS``) [N, K] boxes read as their transpose."""
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in tl.range(k_begin, k_end, BLOCK_K):
        if B_TRANS:
            acc = tl.dot(a_desc.load([m0, k0]), b_desc.load([n0, k0]).T, acc)
        else:
            acc = tl.dot(a_desc.load([m0, k0]), b_desc.load([k0, n0]), acc)
    return acc


@triton.jit
def scaled(acc, scale_a_ptr, scale_b_ptr, m0, n0, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
           A_ROWWISE: tl.constexpr, B_COLWISE: tl.constexpr):
    """``acc * scale_a[rows, None] * scale_b[None, cols]`` for the tile at (m0, n0) (rows past M and columns
    past N, zeros from TMA, get scale 0): the fp8 epilogue."""
    rows = m0 + tl.arange(0, BLOCK_M)
    cols = n0 + tl.arange(0, BLOCK_N)
    scale_a = tl.load(scale_a_ptr + rows * A_ROWWISE, mask=rows < M, other=0.0)
    scale_b = tl.load(scale_b_ptr + cols * B_COLWISE, mask=cols < N, other=0.0)
    return acc * scale_a[:, None] * scale_b[None, :]


# ---------------------------------------------------------------------------
# Host: operands
# ---------------------------------------------------------------------------


def tma_rows(m: int, block_m: int) -> int:
    """The rows ``a`` is padded to for TMA (``tma_operands``, ``tma_fp8``): whole ``block_m`` tiles up to ``SKINNY_M``
    rows, ``m`` itself above."""
    return round_up(m, block_m) if m <= SKINNY_M else m


def tma_operands(a: torch.Tensor, b: torch.Tensor, block_m: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """``a`` and ``b`` as TMA can load them: if a base or a row is not 16-byte aligned, zero-padded copies
    (k and n rounded up; the zeros add nothing to the product, and the output keeps the true N). With
    ``block_m``, up to ``SKINNY_M`` rows, ``a``'s rows too are zero-padded to a multiple of it, for kernels whose
    output keeps the true M (``out``'s) and that never read ``a``'s row count: a TMA box that reaches past the
    tensor's last row is slow (on a small GEMM a row of half-empty boxes costs about as much as all its useful
    loads), so for few rows the zero-padded copy pays for itself. Above ``SKINNY_M``, one partial row of tiles among
    several costs less than the copy of ``a`` (docs/history.md, the GEMM core)."""
    (m, k), n = a.shape, b.shape[1]
    step = TMA_ALIGN // a.element_size()
    rows = tma_rows(m, block_m)
    aligned = k % step == 0 and a.data_ptr() % TMA_ALIGN == 0
    if not (aligned and n % step == 0 and b.data_ptr() % TMA_ALIGN == 0):
        k_pad, n_pad = round_up(k, step), round_up(n, step)
        b_pad = b.new_zeros(k_pad, n_pad)
        b_pad[:k, :n] = b
        b, aligned = b_pad, False
    if not aligned or rows != m:
        a_pad = a.new_zeros(rows, round_up(k, step))
        a_pad[:m, :k] = a
        a = a_pad
    return a, b


def tma_fp8(a: torch.Tensor, block_m: int = 1) -> torch.Tensor:
    """An fp8 ``a`` as TMA can load it: itself, or (a row stride or base not 16-byte aligned, or, with ``block_m``,
    up to ``SKINNY_M`` rows that are not whole tiles: ``tma_operands`` says why) a zero-padded copy; the k loop's
    bound is the true K either way (the descriptor's shape), TMA fills past it with zeros."""
    m, k = a.shape
    rows = tma_rows(m, block_m)
    if k % TMA_ALIGN == 0 and a.data_ptr() % TMA_ALIGN == 0 and rows == m:
        return a
    padded = torch.zeros(rows, round_up(k, TMA_ALIGN), dtype=torch.uint8, device=a.device)
    padded[:m, :k].copy_(a.view(torch.uint8))
    return padded.view(FP8)[:, :k]


# "auto": an fp8 b as stored: column-major (``w.t()``) as [N, K] (K-major, what fp8 wgmma wants), row-major as
# [K, N]; anything else copied to [N, K]. "nk" / "kn": that layout, copying b if it is stored otherwise.
FP8_B_LAYOUTS = ("auto", "nk", "kn")


def fp8_b_operand(b: torch.Tensor, layout: str) -> tuple[torch.Tensor, bool]:
    """An fp8 ``b`` as the kernel reads it: (tensor, transposed). [N, K] (``b.t()``, K-major) for a column-major
    ``b`` or layout "nk", [K, N] for a row-major one or "kn" (``FP8_B_LAYOUTS``). Rows that TMA cannot address
    (a row stride not a multiple of 16 bytes, an unaligned base) or the other layout are copied into a
    zero-padded [rows, cols rounded up to 16] buffer, read through its [rows, cols] view."""
    (k, n), (k_stride, n_stride) = b.shape, b.stride()  # once: each ``stride()`` is a host call on every launch
    column_major = k_stride == 1 and n_stride >= max(k, 1)
    row_major = n_stride == 1 and k_stride >= max(n, 1)
    trans = layout == "nk" or (layout == "auto" and (column_major or not row_major))
    w = b.t() if trans else b
    (rows, cols), (row_stride, col_stride) = ((n, k), (n_stride, k_stride)) if trans else ((k, n), (k_stride, n_stride))
    if col_stride == 1 and row_stride % 16 == 0 and row_stride >= cols and b.data_ptr() % 16 == 0:
        return w, trans
    padded = torch.zeros(rows, round_up(cols, 16), dtype=torch.uint8, device=b.device)
    padded[:, :cols].copy_(w.view(torch.uint8))  # (bytes: copies of fp8 tensors go through their bytes)
    return padded.view(FP8)[:, :cols], trans


# ---------------------------------------------------------------------------
# Host: tiles
# ---------------------------------------------------------------------------


def skinny_or_large_tiles(m: int, n: int, k: int, num_sms: int, push: bool, operand_bytes: int = 2) -> dict:
    """Tiles for an M x N output (M rows of one rank's partial): for M <= ``SKINNY_M``, one warpgroup on 64- or
    128-row tiles (128 from M = 128), as narrow (>= 32, or 64 when ``push``-ing 64-row tiles) as fits one
    wave of ``num_sms``, 128-deep k steps (64-deep from ``SKINNY_WIDE`` with 2-byte operands) and as many stages as
    ``SKINNY_STAGE_BYTES`` hold; above, the largest of ``TILE_CONFIGS`` that gives ``MIN_TILES_PER_SM`` of the SMs a
    tile, else the smallest."""
    if m <= SKINNY_M:
        # Boxes no larger than the operands where they can be (Helion loads a box larger than its tensor
        # through pointers, not TMA).
        block_m = 128 if m >= 128 else 64
        block_n = 64 if block_m == 64 and push else 32
        while block_n < 256 and cdiv(m, block_m) * cdiv(n, block_n) > num_sms:
            block_n *= 2
        wide = block_m + block_n >= SKINNY_WIDE and operand_bytes == 2  # (fp8: 128-deep steps, one 128-byte TMA row)
        block_k = 64 if wide or k < SKINNY_BLOCK_K else SKINNY_BLOCK_K
        stages = SKINNY_STAGE_BYTES // ((block_m + block_n) * block_k * 2)  # bf16/fp16 operands
        return {"block_m": block_m, "block_n": block_n, "block_k": block_k, "num_warps": 4,
                "num_stages": min(stages, SKINNY_MAX_STAGES_64 if wide else SKINNY_MAX_STAGES)}

    def fills(cfg: dict) -> bool:
        return cdiv(m, cfg["block_m"]) * cdiv(n, cfg["block_n"]) >= MIN_TILES_PER_SM * num_sms

    return dict(next((cfg for cfg in TILE_CONFIGS if fills(cfg)), TILE_CONFIGS[-1]))


def check_tiles(cfg: dict, op: str, least_block_k: int = 16) -> None:
    """Tile sizes powers of two, at least 16 (``block_k`` at least ``least_block_k``), ``group_m`` >= 1."""
    for key in ("block_m", "block_n", "block_k"):
        least = least_block_k if key == "block_k" else 16
        if cfg[key] < least or cfg[key] & (cfg[key] - 1):
            raise ValueError(f"{op}: {key} must be a power of two >= {least}, got {cfg[key]}")
    if cfg["group_m"] < 1:
        raise ValueError(f"{op}: group_m must be >= 1, got {cfg['group_m']}")
