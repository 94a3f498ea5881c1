"""Helion twin of ``kraken.fused.gemm_one_shot_all_reduce``: same function, same arguments.

The structure mirrors the Triton recipe one to one:

* ``hl.grid(num_blocks)`` is the persistent grid; the grid index is the
  barrier's block id, identical on every rank, and picks the block's region of
  the output (``plan`` is shared with the recipe);
* the GEMM is a 2-D ``hl.tile`` over that region, its end clipped to
  ``[m, n]`` so Helion's masks cover the tails, with an ``hl.tile`` over k and
  ``hl.dot`` into an fp32 accumulator; the reduce is a second 2-D ``hl.tile``
  over the same region, with its own tile size;
* the config is explicit: ``block_sizes`` are the GEMM tile (m, n), its k step
  and the reduce tile (m, n), in loop order, from the recipe's ``plan``;
* the barriers are the kraken PTX, pasted in with ``hl.inline_triton``; the
  peers' workspaces arrive as one tuple, walked with ``hl.static_range``, and
  the local workspace is written through its own argument.

Set ``HELION_PRINT_OUTPUT_CODE=1`` to see the generated Triton.
"""

from __future__ import annotations

import functools

import helion
import helion.language as hl
import torch
import torch.distributed as dist

from helion_ports import flat_kernel
from kraken._ptx_utils.inline_source import SYMM_MEM_SYNC
from kraken.fused.gemm_one_shot_all_reduce import plan, prepare  # shared with the Triton recipe

# "My partial tiles are visible to you, yours to me" (release + acquire), then "done reading yours" (release).
SYNC_PARTIALS = SYMM_MEM_SYNC[(True, True)]
SYNC_END = SYMM_MEM_SYNC[(True, False)]


def gemm_one_shot_all_reduce_body(
    a: torch.Tensor,
    b: torch.Tensor,
    workspace: torch.Tensor,
    peers: tuple[torch.Tensor, ...],
    out: torch.Tensor,
    signal_pad_ptrs: int,
    num_blocks: int,
    region_m: int,
    region_n: int,
    rank: int,
    world_size: hl.constexpr,
    group_name: hl.ProcessGroupName,
) -> torch.Tensor:
    m, k = a.size()
    n = b.size(1)
    for block in hl.grid(num_blocks):
        barrier = {"signal_pad_ptrs": signal_pad_ptrs, "block_id": block, "rank": rank, "world_size": world_size}
        regions_n = (n + region_n - 1) // region_n
        m_begin = block // regions_n * region_m
        n_begin = block % regions_n * region_n
        region_end = [min(m_begin + region_m, m), min(n_begin + region_n, n)]
        for tile_m, tile_n in hl.tile([m_begin, n_begin], region_end):
            acc = hl.zeros([tile_m, tile_n], dtype=torch.float32)
            for tile_k in hl.tile(k):
                acc = hl.dot(a[tile_m, tile_k], b[tile_k, tile_n], acc=acc)
            workspace[tile_m, tile_n] = acc.to(workspace.dtype)
        # All my partial tiles are visible to peers; theirs (the same region: same block id) to me.
        hl.inline_triton(SYNC_PARTIALS, args=barrier, output_like=None)
        for tile_m, tile_n in hl.tile([m_begin, n_begin], region_end):
            acc = hl.zeros([tile_m, tile_n], dtype=torch.float32)
            for r in hl.static_range(world_size):
                acc = acc + hl.load(peers[r], [tile_m, tile_n]).to(torch.float32)
            out[tile_m, tile_n] = acc.to(out.dtype)
        # Done reading peers' workspaces: the next launch may overwrite them.
        hl.inline_triton(SYNC_END, args=barrier, output_like=None)
    return out


@functools.cache
def compiled(block_m: int, block_n: int, block_k: int, reduce_m: int, num_warps: int, num_stages: int) -> helion.Kernel:
    """One Helion kernel per launch configuration, each with an explicit config.

    ``block_sizes`` follow the loops: the GEMM tile (m, n), its k step, then the reduce tile (m, n).
    ``pid_type="flat"``: the recipe's grid, one program per block (see ``helion_ports``).
    """
    block_sizes = (block_m, block_n, block_k, reduce_m, block_n)
    return flat_kernel(gemm_one_shot_all_reduce_body, block_sizes, num_warps, num_stages)


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
    """Launch on prepared arguments (no checks); mirrors ``kraken.fused.gemm_one_shot_all_reduce.launch``.

    ``peers[rank]`` goes in twice: as ``workspace``, the top-level argument the GEMM stores through
    (Helion cannot store through a tuple element; it sees the same tensor and passes one pointer),
    and inside ``peers``. Every size the body uses comes from top-level tensors, which is what makes
    Helion 1.5.0 re-specialize when a shape changes bucket (it ignores sizes inside tuples).
    """
    compiled(block_m, block_n, block_k, reduce_m, num_warps, num_stages)(
        a, b, peers[rank], peers, out, signal_pad_ptrs, num_blocks, region_m, region_n, rank, len(peers), group_name
    )
    return out


def gemm_one_shot_all_reduce(
    a: torch.Tensor,
    b: torch.Tensor,
    group: dist.ProcessGroup | str | None = None,
    out_dtype: torch.dtype = torch.float32,
    **config,
) -> torch.Tensor:
    """``sum over ranks of a @ b`` as a new [M, N] tensor of ``out_dtype`` (see the kraken recipe)."""
    ctx, launch_cfg = prepare(a, b, group, out_dtype, "helion gemm_one_shot_all_reduce", config)
    out = torch.empty(a.shape[0], b.shape[1], dtype=out_dtype, device=a.device)
    return launch(a, b, ctx.peers, out, ctx.signal_pad_ptrs, ctx.rank, **launch_cfg, group_name=ctx.group_name)
