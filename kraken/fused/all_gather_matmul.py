"""All-gather + matmul: ``all_gather(a) @ b`` with the gather hidden under the GEMM.

The column-parallel linear layer of sequence/tensor parallelism: every rank holds
``a`` [M, K], its M rows of the activations, and the same ``b`` [K, N]; every rank
needs the product of all ``world_size * M`` rows. The gather moves (ws-1)/ws of
``a``; the GEMM is far longer, so the craft is starting the GEMM at once and never
making it wait for rows that are not there yet.

* The gather runs on the copy engine (``kraken.comm.all_gather_with_progress``) into a
  symmetric gather buffer [world_size * M, K]. On the side stream, the copy engine stages
  ``a`` into this rank's chunk of it (for the peers to read), the ranks meet at one
  barrier (a one-block kernel), each peer's chunk is copied from the peer's buffer
  (rank + 1 first) and flagged, and a last barrier says "done reading". The flags are
  set by stream memory operations: no SM is involved, so GEMM blocks spinning on a flag
  cannot starve the copies. A group of one has no peer to stage for: nothing is staged
  (but for ``return_a``, whose copy of the buffer needs my rows in it).
* The GEMM is persistent (one block per SM but ``RESERVED_SMS``, left to the barrier
  kernel) and walks its tiles chunk by chunk: first this rank's rows, read from ``a``
  itself (so the GEMM starts at once, while the copy engine stages them), then rank + 1's,
  rank + 2's, ... from the gather buffer, in a second loop (a block's tiles are ``pid, pid +
  blocks, ...`` across both). At its first tile of each peer's chunk a block
  waits for the rows' flag: one thread spins on an acquire load, then every thread fences
  the async proxy (``wait_async``): the rows are read through TMA. Within a chunk, tiles
  go in ``GROUP_M``-row bands (a band's rows and a column of ``b`` tiles stay in L2).
* The GEMM is ``kraken._gemm_core.mainloop``: ``a``, the gathered rows and ``b`` load through host-built TMA descriptors
  (zero-padded in k and n where a base or a row is not 16-byte aligned; ``a``'s rows up to ``SKINNY_M`` padded to whole
  tiles: ``tma_operands``). Each of the two tile loops has its own k loop; the loops follow each other, so their
  pipeline buffers share shared memory (a branch between two k loops inside one tile loop keeps both sets alive: twice
  the shared memory). On the 128x256 tiles the first loop, which waits on no flag, is flattened with its k loop
  (``kraken._gemm_core.flattens``). A ``b`` stored transposed (``w.t()`` of an [N, K] weight: strides (1, K)) is read as
  is, its tiles transposed in registers (``b_layout``); any other layout is copied contiguous. ``tl.dot`` accumulates in
  fp32; the output, in ``a``'s dtype, is stored through pointers, masked to the chunk's rows (a tile at a chunk's end
  also reads some of the next chunk's rows, and discards them).

The flags are zeroed on the current stream before the side stream forks, and the side
stream rejoins after the GEMM: every call (and every CUDA-graph replay) runs the whole
protocol, with no host round trip. My own rows carry no flag (the GEMM reads them from
``a``), so a group of one writes no flag and skips the zeroing (``start``'s ``flag_own``).
Rank r's rows of the output are ``r * M ...``, where ``all_gather(a) @ b`` has them. With
``return_a=True`` the gathered ``a`` is returned too (a fresh copy, made on the side stream
while the GEMM runs).

The kernel and ``tile_plan`` also serve ``kraken.fused.all_gather_matmul_fp8`` (its ``a_desc`` is its fp8 ``a``,
its own rows' scales ``scale_a``): the kernel's constexpr switches (``SCALED``, ``A_ROWWISE``, ``B_COLWISE``) and
scale arguments stay at their defaults here, and compile away.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import triton
import triton.language as tl

from kraken._ptx_utils import wait_async
from kraken._gemm_core import (
    INPUT_DTYPES, MAX_INDEX, SKINNY_M, TILE_CONFIGS as CORE_TILES, balanced_grid, flattens, mainloop,
    skinny_or_large_tiles, tile_coords, tma_operands,
)
from kraken.runtime.collectives import all_gather as sm_all_gather
from kraken.comm.all_gather_with_progress import start as start_gather
from kraken.runtime import agreement, crossover, graphs, groups, prepared, symm
from kraken.runtime.launcher import Launcher, jit_launch, tma_operand

OP = "all_gather_matmul"
# The GEMM core's tiles, the 128x128 ones 6 stages deep (as cuBLAS runs them at M = 256; one H200, world size 1,
# 256x8192x8192: 55.2 us against 62.6 on 4).
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
    launcher=jit_launch,
) -> torch.Tensor:
    """The GEMM alone, on TMA-ready operands (``tma_inputs``; my rows ``a``, the peers' in ``gathered``): the
    consumer of the flags in ``progress``."""
    k = gathered.shape[1]
    m, n = out.shape[0] // world_size, out.shape[1]
    b_box = [block_n, block_k] if b_trans else [block_k, block_n]
    launcher(
        all_gather_matmul_kernel, (num_blocks,),
        tma_operand(a, [block_m, block_k]), tma_operand(gathered, [block_m, block_k]),
        tma_operand(b, b_box), out, progress, None, None, None, m, n, k, None, rank, world_size,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, GROUP_M=group_m, B_TRANS=b_trans,
        FLATTEN=flattens(block_m, block_n), WIDE=out.numel() > MAX_INDEX, num_warps=num_warps, num_stages=num_stages,
    )
    return out


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
    launcher=jit_launch,
) -> torch.Tensor:
    """Launch on prepared arguments (no checks); the same signature as the Helion port's ``launch``.

    ``gathered`` [world_size * M, K'] (K' = K padded for TMA) is this rank's symmetric gather buffer,
    ``peers[r]`` rank r's chunk of rank r's (where r's own rows go); ``out`` [world_size * M, N];
    ``a_out``: where to copy the gathered ``a`` (``return_a``), or None; ``group_name`` is unused here.
    """
    m = a.shape[0]
    a, b, b_trans = tma_inputs(a, b, b_layout, block_m)
    started = start_gather(peers, signal_pad_ptrs, rank, gathered, progress, stage_from=a if len(a) == m else a[:m],
                           snapshot=a_out, launcher=launcher, flag_own=False)  # my rows: read from a
    launch_matmul(a, gathered, b, out, progress, rank, len(peers), b_trans, block_m, block_n, block_k, group_m,
                  num_warps, num_stages, num_blocks, launcher)
    started.wait()
    return out


def tile_plan(m: int, n: int, k: int, world_size: int, config: dict, num_sms: int, tile_configs: list,
              defaults: dict, op: str, least_block_k: int = 16, operand_bytes: int = 2) -> tuple[dict, int]:
    """What both GEMMs' plans share: the largest of ``tile_configs`` that gives ``MIN_TILES_PER_SM`` of the SMs a
    tile; where none does, up to ``SKINNY_M`` rows, the reduce recipes' skinny tiles (one warpgroup, narrow tiles
    that fill a wave: ``skinny_or_large_tiles``, ``operand_bytes`` 1 for fp8), else the smallest; under the ``config``;
    tile sizes powers of two (at least 16, ``block_k`` at least ``least_block_k``); and the grid: at most one block per
    SM but ``RESERVED_SMS`` (the GEMM waits on flags in local memory and uses no signal pad), never more blocks than
    tiles, balanced (``balanced_grid``). (cfg, num_blocks)."""
    def fills(cfg: dict) -> bool:
        return (world_size * groups.cdiv(m, cfg["block_m"]) * groups.cdiv(n, cfg["block_n"])
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
    num_tiles = world_size * groups.cdiv(max(m, 1), cfg["block_m"]) * groups.cdiv(max(n, 1), cfg["block_n"])
    sms = max(1, num_sms - RESERVED_SMS)
    max_blocks = sms if cfg["max_blocks"] is None else max(1, min(cfg["max_blocks"], sms))
    return cfg, balanced_grid(num_tiles, max_blocks)


def plan(m: int, n: int, k: int, world_size: int, config: dict, num_sms: int) -> dict:
    """Resolve the launch configuration (shared with the Helion port): ``m`` is one rank's rows.

    The tiles and the persistent grid of ``tile_plan``.
    """
    groups.resolve_config(config, DEFAULT_CONFIG, OP)  # rejects unknown keys
    cfg, num_blocks = tile_plan(m, n, k, world_size, config, num_sms, TILE_CONFIGS, DEFAULT_CONFIG, OP)
    if cfg["b_layout"] not in B_LAYOUTS:
        raise ValueError(f"{OP}: b_layout must be one of {B_LAYOUTS}, got {cfg['b_layout']!r}")
    keys = ("b_layout", "block_m", "block_n", "block_k", "group_m", "num_warps", "num_stages")
    return {**{key: cfg[key] for key in keys}, "num_blocks": num_blocks}


def check_inputs(a: torch.Tensor, b: torch.Tensor, op: str) -> None:
    """Argument checks that need neither a GPU nor torch.distributed (any layout of ``b``)."""
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        if a.dtype != b.dtype:
            raise ValueError(f"{op}: a and b must have the same dtype, got {a.dtype} and {b.dtype}")
        if a.dim() == 2 and b.dim() == 2 and a.shape[1] != b.shape[0]:
            raise ValueError(
                f"{op}: inner dimensions differ: a is {tuple(a.shape)}, b is {tuple(b.shape)} (need a [M, K], b [K, N])"
            )
        if a.dim() == 2 and b.dim() == 2 and (a.numel() == 0 or b.numel() == 0):
            raise ValueError(f"{op}: empty operand (a is {tuple(a.shape)}, b is {tuple(b.shape)})")
    if not isinstance(b, torch.Tensor):
        raise TypeError(f"{op}: b must be a torch.Tensor, got {type(b).__name__}")
    groups.check_tensor(a, "a", op, INPUT_DTYPES, ndim=2)
    if b.dtype not in INPUT_DTYPES or b.dim() != 2:
        raise ValueError(f"{op}: b must be a 2-D bfloat16 or float16 tensor, got {b.dtype} of shape {tuple(b.shape)}")
    if a.device.type != "cuda" or b.device != a.device:
        raise ValueError(f"{op}: a and b must be on the same CUDA device, got {a.device} and {b.device}")


@prepared.per_signature(lambda a, b, group, op, config, return_a: (
    op, group, prepared.tensor_key(a), prepared.tensor_key(b), prepared.scalar_key(return_a),
    prepared.config_key(config)))
def chosen(a: torch.Tensor, b: torch.Tensor, group, op: str, config: dict, return_a: bool):
    """``crossover.SEQUENTIAL`` or the fused form's ``prepare``, kept per signature (``crossover.fused_prepared``)."""
    return crossover.fused_prepared(op, a, b, group, True, True, config, check_sequential,
                                    lambda fused_config: prepare(a, b, group, op, fused_config, return_a))


def check_sequential(a: torch.Tensor, b: torch.Tensor, world_size: int, op: str) -> None:
    """The sequential form's checks (``kraken.runtime.crossover.form`` runs them inside its agreement)."""
    check_inputs(a, b, op)


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
        check_inputs(a, b, op)
        (m, k), n = a.shape, b.shape[1]
        world_size = groups.world_size_of(group, op)
        num_sms = torch.cuda.get_device_properties(a.device).multi_processor_count
        cfg = plan(m, n, k, world_size, config, num_sms)
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
    ``block_k``, ``num_warps``, ``num_stages``, ``group_m``), ``max_blocks`` and ``b_layout`` (see ``plan``);
    ``form="fused"`` or ``"sequential"`` forces the form ``kraken.runtime.crossover`` would choose by size.
    """
    return call(launch, OP, a, b, group, return_a, config, sm_all_gather)


def call(launch, op: str, a: torch.Tensor, b: torch.Tensor, group, return_a: bool, config: dict, all_gather
         ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """``all_gather_matmul`` with a given ``launch`` and ``all_gather`` (the recipe's or its twin's) under the name
    ``op``, in the form ``crossover`` chooses. Sequential: ``all_gather`` (the SM-driven collective) of ``a``,
    then cuBLAS on the gathered rows. Fused: the prepared call, the new outputs, and the launch; its fork, the
    gather's exchange, the GEMM and a join are replayed from one CUDA graph per pointer set (``graphs.graphed``)."""
    prepared = chosen(a, b, group, op, config, return_a)
    if prepared == crossover.SEQUENTIAL:
        gathered = all_gather(a, group)
        out = torch.matmul(gathered, b)
        return (gathered, out) if return_a else out
    ctx, cfg = prepared
    new = outputs(a, b, cfg["gathered"], return_a)
    out, a_out = new["out"], new["a_out"]
    graphs.graphed((cfg["launcher"], a.data_ptr(), b.data_ptr(), out.data_ptr(),
                    a_out is not None and a_out.data_ptr()),
                   lambda: launch(a, b, signal_pad_ptrs=ctx.signal_pad_ptrs, rank=ctx.rank, **cfg, **new,
                                  group_name=ctx.group_name), a.device)
    return out if not return_a else (a_out[:, :a.shape[1]], out)
