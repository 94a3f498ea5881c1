"""Device-side building blocks that several recipes share: plain Triton functions, no host code.

A recipe copied out of this project needs this file (with ``kraken._ptx_utils`` for the barriers and, for the
GEMM recipes, ``kraken._gemm_core``), not another recipe: the copy loop of every staged collective, the
slice of a shard a block owns in the two-shot recipes, the rank-ordered sum of the one-shot reads, and the
RMSNorm row math of the bias family.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def copy_slice(src_ptr, dst_ptr, start, end, BLOCK_SIZE: tl.constexpr):
    """``dst[start:end] = src[start:end]``, one tile at a time (an empty range copies nothing)."""
    for offset in tl.range(start, end, BLOCK_SIZE):
        offsets = offset + tl.arange(0, BLOCK_SIZE)
        mask = offsets < end
        tl.store(dst_ptr + offsets, tl.load(src_ptr + offsets, mask=mask), mask=mask)


@triton.jit
def block_range(owner, block_id, shard, chunk, numel):
    """``[start, end)`` of slice ``block_id`` (``chunk`` long) of shard ``owner`` (``shard`` long), up to ``numel``."""
    start = owner * shard + block_id * chunk
    end = tl.minimum(tl.minimum(start + chunk, owner * shard + shard), numel)
    return start, end


@triton.jit
def sum_peers(peers, offsets, mask, world_size: tl.constexpr):
    """``sum_r peers[r][offsets]`` in fp32, in rank order: every rank gets the same bits (0 where masked)."""
    acc = tl.load(peers[0] + offsets, mask=mask, other=0.0).to(tl.float32)
    for r in tl.static_range(1, world_size):
        acc += tl.load(peers[r] + offsets, mask=mask, other=0.0).to(tl.float32)
    return acc


@triton.jit
def rms_normalize(h, weight, eps, hidden):
    """``h * rsqrt(mean(h^2) + eps) * weight`` for one fp32 row and the fp32 ``weight`` row.

    ``weight`` comes in as values, loaded by the caller before the row's
    reduction (once per block in the fused kernels): loaded here, after the
    reduction's thread barriers, its latency would be paid again on every row.
    """
    mean_square = tl.sum(h * h, axis=0) / hidden
    return h * tl.rsqrt(mean_square + eps) * weight
