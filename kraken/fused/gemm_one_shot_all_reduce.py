"""GEMM + one-shot all-reduce: ``sum over ranks of a @ b`` in one kernel.

The row-parallel linear layer of tensor parallelism: every rank holds a slice of
the reduction dimension, computes a partial product and the partials are summed.
Here the GEMM and the all-reduce share one persistent launch. The output is
cut into one rectangular region per block, a whole number of ``BLOCK_M x
BLOCK_N`` tiles each (``plan`` picks the regions so that the busiest block has
as few tiles as the grid allows). Block ``b`` of every rank owns region ``b``:

1. GEMM: block ``b`` computes every tile of its region of the local ``a @ b``
   (``tl.dot``, fp32 accumulation) and stores it into the rank's symmetric
   workspace;
2. barrier (release + acquire) for block id ``b``: "my region is visible to
   you" and "yours to me". Block ``b`` of each peer wrote exactly the region
   that block ``b`` reduces, so one barrier round per block suffices, however
   many tiles the region holds;
3. reduce: sum the region over every rank's workspace, in rank order (bitwise
   identical on every rank), accumulating in fp32, and write ``out``;
4. barrier (release): "I am done reading your workspace". The next launch
   overwrites the workspace only after every block of this one has passed it,
   so back-to-back launches (and CUDA-graph replays) need no other barrier.

Two barrier rounds per call, whatever the shape: the grid is persistent, at
most one block per SM and within the signal pad's budget.

The workspace holds partials in ``out_dtype``: fp32 partials for an fp32 output
(no rounding before the sum), bf16 partials for a bf16 output, which halves the
bytes crossing NVLink and rounds each partial once, as ``torch.matmul`` followed
by a bf16 all-reduce does.
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist
import triton
import triton.language as tl

from kraken import host
from kraken._ptx_utils import symm_mem_sync

INPUT_DTYPES = (torch.bfloat16, torch.float16)
OUT_DTYPES = (torch.bfloat16, torch.float32)
MAX_INDEX = 2**31 - 1  # offsets are int32, as in the Helion twin

# Tile configs, largest tile first, swept on 2x H200 (``python -m benchmark.tune gemm_all_reduce``).
# ``default_config`` takes the largest tile that still gives at least ``MIN_TILES_PER_SM`` of the
# SMs a tile: large M is bound by the tensor cores and wants 128 x 256 tiles; small M is bound by
# streaming ``b`` (and by re-reading ``a`` once per column of tiles) and wants enough blocks in
# flight, so narrower tiles with a deeper k step. Any key may be overridden per call.
# ``max_blocks`` None: one block per SM. ``reduce_m`` None: from ``reduce_rows``.
TILE_CONFIGS = [
    {"block_m": 128, "block_n": 256, "block_k": 64, "num_warps": 8, "num_stages": 4},
    {"block_m": 128, "block_n": 128, "block_k": 64, "num_warps": 8, "num_stages": 5},
    {"block_m": 128, "block_n": 64, "block_k": 128, "num_warps": 8, "num_stages": 4},
    {"block_m": 64, "block_n": 64, "block_k": 128, "num_warps": 4, "num_stages": 5},
    {"block_m": 64, "block_n": 32, "block_k": 256, "num_warps": 4, "num_stages": 3},
]
MIN_TILES_PER_SM = 0.55
# When a row of a or b is not a multiple of 16 elements, Triton cannot prove 16-byte alignment,
# loads go element by element without cp.async, and small tiles keep the registers in check.
UNALIGNED_CONFIG = {
    "block_m": 64, "block_n": 64, "block_k": 32, "num_warps": 8, "num_stages": 1,
}
DEFAULT_CONFIG = {**TILE_CONFIGS[0], "reduce_m": None, "max_blocks": None}  # every key a caller may pass
# The reduce tile holds about this many values per thread (fp32 sums, and loads from up to 4 ranks in flight).
REDUCE_VALUES_PER_THREAD = 64


@triton.jit
def gemm_one_shot_all_reduce_kernel(
    a_ptr,  # [M, K], row-major
    b_ptr,  # [K, N], row-major
    workspace_ptr,  # [M, N] in symmetric memory: this rank's partial a @ b
    peers,  # tuple of world_size pointers, peers[r] = rank r's workspace
    out_ptr,  # [M, N]
    signal_pad_ptrs,
    M,
    N,
    K,
    region_m,  # every block owns a region_m x region_n region of the output (multiples of the tiles)
    region_n,
    rank,
    world_size: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    REDUCE_M: tl.constexpr,  # rows per reduce tile: fewer than BLOCK_M keeps world_size loads in registers
):
    block_id = tl.program_id(0)
    regions_n = tl.cdiv(N, region_n)
    m_begin = block_id // regions_n * region_m
    n_begin = block_id % regions_n * region_n
    m_end = tl.minimum(m_begin + region_m, M)
    n_end = tl.minimum(n_begin + region_n, N)

    # Offsets are summed in int32 before they meet the pointer: the part hoisted out of the
    # loops stays 32-bit, which saves ~40 registers over pointer + rows + columns.
    for m0 in tl.range(m_begin, m_end, BLOCK_M):
        offs_m = m0 + tl.arange(0, BLOCK_M)
        for n0 in tl.range(n_begin, n_end, BLOCK_N):
            offs_n = n0 + tl.arange(0, BLOCK_N)
            acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            for k0 in tl.range(0, K, BLOCK_K):
                offs_k = k0 + tl.arange(0, BLOCK_K)
                a = tl.load(a_ptr + (offs_m[:, None] * K + offs_k[None, :]),
                            mask=(offs_m[:, None] < m_end) & (offs_k[None, :] < K), other=0.0)
                b = tl.load(b_ptr + (offs_k[:, None] * N + offs_n[None, :]),
                            mask=(offs_k[:, None] < K) & (offs_n[None, :] < n_end), other=0.0)
                acc = tl.dot(a, b, acc)
            tl.store(workspace_ptr + (offs_m[:, None] * N + offs_n[None, :]), acc.to(workspace_ptr.dtype.element_ty),
                     mask=(offs_m[:, None] < m_end) & (offs_n[None, :] < n_end))

    # All my partial tiles are visible to peers; theirs (the same region: same block id) to me.
    symm_mem_sync(signal_pad_ptrs, block_id, rank, world_size, hasPreviousMemAccess=True, hasSubsequentMemAccess=True)

    for m0 in tl.range(m_begin, m_end, REDUCE_M):
        offs_m = m0 + tl.arange(0, REDUCE_M)
        for n0 in tl.range(n_begin, n_end, BLOCK_N):
            offs_n = n0 + tl.arange(0, BLOCK_N)
            offsets = offs_m[:, None] * N + offs_n[None, :]
            in_range = (offs_m[:, None] < m_end) & (offs_n[None, :] < n_end)
            acc = tl.zeros([REDUCE_M, BLOCK_N], dtype=tl.float32)
            for r in tl.static_range(world_size):
                acc += tl.load(peers[r] + offsets, mask=in_range).to(tl.float32)
            tl.store(out_ptr + offsets, acc.to(out_ptr.dtype.element_ty), mask=in_range)

    # Done reading peers' workspaces: the next launch may overwrite them.
    symm_mem_sync(signal_pad_ptrs, block_id, rank, world_size, hasPreviousMemAccess=True, hasSubsequentMemAccess=False)


def launch(
    a: torch.Tensor,
    b: torch.Tensor,
    peers: tuple[torch.Tensor, ...],
    out: torch.Tensor,
    signal_pad_ptrs: int,
    rank: int,
    block_m: int,
    block_n: int,
    block_k: int,
    reduce_m: int,
    num_warps: int,
    num_stages: int,
    num_blocks: int,
    region_m: int,
    region_n: int,
    group_name: str = "",
) -> torch.Tensor:
    """Launch on prepared arguments (no checks); the same signature as the Helion port's ``launch``.

    ``peers[rank]`` is this rank's workspace; ``group_name`` is unused here (Helion's ``hl.ProcessGroupName``).
    """
    (m, k), n = a.shape, b.shape[1]
    gemm_one_shot_all_reduce_kernel[(num_blocks,)](
        a, b, peers[rank], peers, out, signal_pad_ptrs, m, n, k, region_m, region_n, rank, len(peers),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, REDUCE_M=reduce_m,
        num_warps=num_warps, num_stages=num_stages,
    )
    return out


def default_config(m: int, n: int, k: int, num_sms: int) -> dict:
    """This shape's tile config: the largest of ``TILE_CONFIGS`` that keeps enough SMs busy, else the smallest."""
    if n % 16 or k % 16:
        return UNALIGNED_CONFIG

    def fits(cfg: dict) -> bool:
        tiles = host.cdiv(m, cfg["block_m"]) * host.cdiv(n, cfg["block_n"])
        return cfg["block_m"] <= max(64, m) and tiles >= MIN_TILES_PER_SM * num_sms

    return next((cfg for cfg in TILE_CONFIGS if fits(cfg)), TILE_CONFIGS[-1])


def reduce_rows(block_m: int, block_n: int, num_warps: int, world_size: int) -> int:
    """Rows per reduce tile: as many as fit the register budget, so a block's region crosses NVLink
    in as few round trips as possible (a whole 64 x 32 tile at a time for decode shapes)."""
    budget = REDUCE_VALUES_PER_THREAD * 32 * num_warps
    rows = block_m
    while rows > 16 and rows * block_n * min(world_size, 4) > budget:
        rows //= 2
    return rows


@functools.lru_cache(maxsize=256)
def regions(tiles_m: int, tiles_n: int, max_blocks: int) -> tuple[int, int]:
    """Tiles per block region (rows, cols): the fewest per block, then the most blocks, then the fewest rows."""
    best = None
    for blocks_m in range(1, min(tiles_m, max_blocks) + 1):
        rows = host.cdiv(tiles_m, blocks_m)
        cols = host.cdiv(tiles_n, max_blocks // host.cdiv(tiles_m, rows))
        blocks = host.cdiv(tiles_m, rows) * host.cdiv(tiles_n, cols)
        key = (rows * cols, -blocks, rows)
        if best is None or key < best[0]:
            best = (key, rows, cols)
    return best[1], best[2]


def plan(m: int, n: int, k: int, world_size: int, config: dict, num_sms: int) -> dict:
    """Resolve the launch configuration (shared with the Helion port).

    The output is cut into one region per block, a whole number of tiles each,
    so that the busiest block has as few tiles as the grid allows; the grid is at
    most one block per SM and within the signal pad's budget.
    """
    host.resolve_config(config, DEFAULT_CONFIG, "gemm_one_shot_all_reduce")  # rejects unknown keys
    cfg = {**DEFAULT_CONFIG, **default_config(m, n, k, num_sms), **config}
    if cfg["reduce_m"] is None:
        cfg["reduce_m"] = reduce_rows(cfg["block_m"], cfg["block_n"], cfg["num_warps"], world_size)
    for key in ("block_m", "block_n", "block_k", "reduce_m"):
        if cfg[key] < 16 or cfg[key] & (cfg[key] - 1):
            raise ValueError(f"gemm_one_shot_all_reduce: {key} must be a power of two >= 16, got {cfg[key]}")
    if cfg["reduce_m"] > cfg["block_m"]:
        raise ValueError(f"gemm_one_shot_all_reduce: reduce_m {cfg['reduce_m']} > block_m {cfg['block_m']}")
    tiles_m, tiles_n = host.cdiv(max(m, 1), cfg["block_m"]), host.cdiv(max(n, 1), cfg["block_n"])
    max_blocks = num_sms if cfg["max_blocks"] is None else min(cfg["max_blocks"], num_sms)
    max_blocks = host.persistent_grid(tiles_m * tiles_n, max_blocks, world_size)
    rows, cols = regions(tiles_m, tiles_n, max_blocks)
    num_blocks = host.cdiv(tiles_m, rows) * host.cdiv(tiles_n, cols)
    keys = ("block_m", "block_n", "block_k", "reduce_m", "num_warps", "num_stages")
    return {
        **{key: cfg[key] for key in keys},
        "num_blocks": num_blocks, "region_m": rows * cfg["block_m"], "region_n": cols * cfg["block_n"],
    }


def check_inputs(a: torch.Tensor, b: torch.Tensor, out_dtype: torch.dtype, op: str) -> None:
    """Argument checks that need neither a GPU nor torch.distributed."""
    if out_dtype not in OUT_DTYPES:
        allowed = ", ".join(str(d).removeprefix("torch.") for d in OUT_DTYPES)
        raise ValueError(f"{op}: out_dtype {out_dtype} is not supported; supported: {allowed}")
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        if a.dtype != b.dtype:
            raise ValueError(f"{op}: a and b must have the same dtype, got {a.dtype} and {b.dtype}")
        if a.dim() == 2 and b.dim() == 2 and a.shape[1] != b.shape[0]:
            raise ValueError(
                f"{op}: inner dimensions differ: a is {tuple(a.shape)}, b is {tuple(b.shape)} (need a [M, K], b [K, N])"
            )
        if a.dim() == 2 and b.dim() == 2 and (a.shape[0] == 0 or b.shape[1] == 0):
            raise ValueError(f"{op}: the output would be empty (a is {tuple(a.shape)}, b is {tuple(b.shape)})")
    host.check_tensor(a, "a", op, INPUT_DTYPES, ndim=2)
    host.check_tensor(b, "b", op, INPUT_DTYPES, ndim=2)
    if a.device != b.device:
        raise ValueError(f"{op}: a and b are on different devices ({a.device}, {b.device})")
    if max(a.numel(), b.numel(), a.shape[0] * b.shape[1]) > MAX_INDEX:
        raise ValueError(f"{op}: a, b or the output has more than 2**31 - 1 elements (32-bit offsets)")


def prepare(
    a: torch.Tensor, b: torch.Tensor, group, out_dtype: torch.dtype, op: str, config: dict
) -> tuple[host.SymmContext, dict]:
    """Validate, then rendezvous this shape's workspace (a [M, N] view of the shared symmetric scratch)."""
    check_inputs(a, b, out_dtype, op)
    (m, k), n = a.shape, b.shape[1]
    workspace = host.symm_workspace(m * n, out_dtype, a.device, group, op).view(m, n)
    # The first use of each shape checks that every rank passes the same one (K included, via the name).
    ctx = host.symm_context(workspace, group, op, name=f"workspace of ({m}x{k}) @ ({k}x{n})")
    num_sms = torch.cuda.get_device_properties(a.device).multi_processor_count
    launch_cfg = plan(m, n, k, ctx.world_size, config, num_sms)
    host.check_barrier_blocks(launch_cfg["num_blocks"], ctx.world_size, op)
    return ctx, launch_cfg


def gemm_one_shot_all_reduce(
    a: torch.Tensor,
    b: torch.Tensor,
    group: dist.ProcessGroup | str | None = None,
    out_dtype: torch.dtype = torch.float32,
    **config,
) -> torch.Tensor:
    """``sum over ranks of a @ b`` as a new [M, N] tensor of ``out_dtype`` (bf16 or fp32).

    ``a`` [M, K] and ``b`` [K, N] are ordinary contiguous CUDA tensors, bf16 or
    fp16, the same shapes on every rank. ``config`` overrides ``default_config(M, N, K, num_sms)``.
    """
    ctx, launch_cfg = prepare(a, b, group, out_dtype, "gemm_one_shot_all_reduce", config)
    out = torch.empty(a.shape[0], b.shape[1], dtype=out_dtype, device=a.device)
    return launch(a, b, ctx.peers, out, ctx.signal_pad_ptrs, ctx.rank, **launch_cfg, group_name=ctx.group_name)
