"""Helion twin of ``kraken.fused.all_gather_matmul``: same function, same arguments.

The gather is the recipe's, line for line (copy-engine copies and stream memory operations on a side stream,
host code), with the barrier a one-block Helion kernel (the kraken PTX through ``hl.inline_triton``); ``plan`` and
``tma_inputs`` are copies of the recipe's (a test keeps them equal). The GEMM mirrors the recipe's kernel:

* ``hl.grid(num_blocks)`` is the persistent grid; block ``b`` takes tiles ``b, b +
  num_blocks, ...``, chunk by chunk: this rank's rows first, read from ``a`` itself, then
  rank + 1's, rank + 2's, ... from the gather buffer, as the recipe: two ``hl.grid`` loops,
  one per source of rows, each with its own k loop (Helion 1.5 cannot pick a load's tensor
  per tile, docs/helion-notes.md; the recipe, too, keeps one loop per source). The loops
  follow each other, so their pipeline buffers share shared memory; a group of one compiles
  the first alone;
* a block waits for the rows' flag at its first tile of each peer's chunk, with the recipe's
  PTX (``GMEM_WAIT_ASYNC``: acquire spin by one thread, thread barrier, every thread's
  async-proxy fence) pasted in with ``hl.inline_triton``;
* within a chunk, ``group_m``-row bands of tiles, as the recipe;
* each tile is a 2-D ``hl.tile`` over one whole tile with an ``hl.tile`` over k and
  ``hl.dot`` into fp32; ``a``, ``gathered`` and ``b`` load through host-built tensor
  descriptors (TMA, ``host_tensor_descriptors``; Helion loads a tensor smaller than its box
  through pointers, whole boxes, so ``a``'s rows come padded to whole tiles up to
  ``SKINNY_M``, ``tma_inputs``); the store to ``out`` is masked to the chunk's rows. A
  transposed ``b`` arrives as its [N, K] transpose and each tile is transposed in
  registers (``b_trans``), as the recipe.

The body also has the fp8 twin's switch (``scaled`` and the scales; off and None here, and absent from the
generated kernel; ``helion_ports/fused/all_gather_matmul_fp8.py`` holds its own copy). The config is explicit:
``block_sizes`` follow the loops (the tile's m and n, its k step, per tile loop), from the ``plan``. Set
``HELION_PRINT_OUTPUT_CODE=1`` to see the generated Triton. ``helion_ports.all_gather_matmul`` is the installed twin
(``kraken.runtime.gather_matmul`` driving this ``launch``).

    torchrun --nproc-per-node 2 helion_ports/fused/all_gather_matmul.py
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
from torch._C._distributed_c10d import _SymmetricMemory

from kraken._blocks.helion import flat_kernel, run
from kraken._gemm_core import (
    SKINNY_M, TILE_CONFIGS as CORE_TILES, balanced_grid, cdiv, flattens, round_up, skinny_or_large_tiles, tma_operands,
)
from kraken._ptx_utils.inline_source import GMEM_WAIT_ASYNC, SYMM_MEM_SYNC

OP = "all_gather_matmul"
# The recipe's tiles and planning constants (kraken/fused/all_gather_matmul.py), kept equal by a test.
TILE_CONFIGS = [CORE_TILES[0], {**CORE_TILES[1], "num_stages": 6}]
MIN_TILES_PER_SM = 0.9
GROUP_M = 8
RESERVED_SMS = 1
B_LAYOUTS = ("auto", "kn", "nk")
DEFAULT_CONFIG = {**TILE_CONFIGS[0], "group_m": GROUP_M, "max_blocks": None, "b_layout": "auto"}
# The flag (a pointer expression in the snippet): progress + index.
WAIT_FLAG = GMEM_WAIT_ASYNC.replace("{flag}", "{progress} + {index}")
# Per load/store, in program order: the gathered rows and b through TMA, the store to out through pointers.
INDEXING = ("tensor_descriptor", "tensor_descriptor", "pointer")


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
    launcher=None,
) -> torch.Tensor:
    """The GEMM alone, on TMA-ready operands (``tma_inputs``; my rows ``a``, the peers' in ``gathered``); mirrors
    the recipe's ``launch_matmul``."""
    args = (
        a, gathered, b, None, None, None, out, progress, num_blocks, rank, world_size, b_trans,
        False, block_m, block_n, group_m,
    )
    run(compiled(block_m, block_n, block_k, num_warps, num_stages, world_size), args, launcher)
    return out


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
    """Resolve the launch configuration (a copy of the recipe's): ``m`` is one rank's rows.

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
           rank: int, a_out: torch.Tensor | None, group_name: str, launcher) -> None:
    """The recipe's exchange on the current stream (the side stream), after my rows are in my chunk: the first
    barrier, each peer's chunk copied (rank + 1 first) and flagged, the ``a_out`` snapshot, the closing barrier."""
    rows, world_size = peers[rank].shape[0], len(peers)
    barrier(progress, signal_pad_ptrs, rank, world_size, group_name, launcher)  # every rank's rows are staged
    flags = progress.view(torch.uint32)
    for step in range(1, world_size):
        peer = (rank + step) % world_size
        gathered[peer * rows:(peer + 1) * rows].copy_(peers[peer])
        _SymmetricMemory.stream_write_value32(flags, peer, 1)
    if a_out is not None:
        a_out.copy_(gathered)
    barrier(progress, signal_pad_ptrs, rank, world_size, group_name, launcher)  # done reading


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
    launcher=None,
) -> torch.Tensor:
    """Launch on planned arguments (no checks); the recipe's ``launch`` signature and gather, this GEMM.

    ``gathered`` [world_size * M, K'] (K' = K padded for TMA) is this rank's symmetric gather buffer, ``peers[r]``
    rank r's chunk of rank r's (where r's own rows go); ``progress`` int32[world_size]; ``out`` [world_size * M, N];
    ``a_out``: where to copy the gathered ``a`` (``return_a``), or None; ``group_name``: Helion's process-group
    name. ``launcher``: None for a plain call, or the installed package's (``run``).
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
        gather(peers, gathered, progress, signal_pad_ptrs, rank, a_out, group_name, launcher)
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

    The twin spelled out: a symmetric gather buffer on every rank, the plan, one launch. It allocates and
    rendezvouses on every call and checks nothing; ``helion_ports.all_gather_matmul`` is the installed one."""
    group = dist.group.WORLD if group is None else group
    buffers, cfg = call_buffers(a, b, group, return_a, config)
    out = launch(a, b, **buffers, **cfg, group_name=group.group_name)
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

    group = dist.group.WORLD
    buffers, cfg = call_buffers(a, b, group, False, {})  # the buffers, once
    out = buffers["out"]
    for _ in range(3):  # warm up (the first compiles)
        launch(a, b, **buffers, **cfg, group_name=group.group_name)
    out.fill_(float("nan"))  # a timed launch that writes nothing fails the check below
    dist.barrier()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(iters):
        launch(a, b, **buffers, **cfg, group_name=group.group_name)
    torch.cuda.synchronize()
    us = (time.perf_counter() - start) / iters * 1e6
    torch.testing.assert_close(out, expected, rtol=2e-2, atol=2e-2)
    if rank == 0:
        print(f"helion all_gather_matmul: {world_size}x{m} x {n} x {k} bf16: matches NCCL + torch.matmul, {us:.1f} us per "
              f"call (eager launches; {cfg})")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
