"""Two-shot all-reduce + bias + RMSNorm: each rank reduces and normalises a shard of rows.

    h = sum_r x_r + bias
    y = h * rsqrt(mean(h^2) + eps) * weight          (per row, all in fp32)

``two_shot_all_reduce_bias`` with RMSNorm folded in, so the shards must hold
whole rows: rank ``r`` owns rows ``[r * shard, (r + 1) * shard)`` with
``shard = cdiv(tokens, world_size)``, reduces them from every peer, normalises
them and pushes the finished rows to every rank. Only the owner computes a row,
so every rank holds the same bits.

With fewer tokens than ranks (a single decode token, say) the last ranks own no
rows: they still stage, take part in both barriers and gather, but reduce
nothing, and the call costs about what one-shot does plus one push. Splitting a
row across ranks would need a third barrier round to combine partial sums of
squares, which is a worse trade at these sizes.

Same five steps, workspace layout ([staged x | result]) and barrier reasoning
as ``two_shot_all_reduce_bias``, in units of rows. The row is spread so that no
thread holds more than one 16-byte vector of it (``row_warps``).

Layout: ``x`` [..., hidden] (any leading shape flattened into tokens), contiguous, bf16/fp16/fp32, hidden at
most 16384 (a row is one register tile); ``bias``, ``weight`` [hidden] of ``x``'s dtype; the workspace holds
``2 * tokens * hidden`` elements (``WORKSPACE_COPIES``).

This file is the recipe: the kernel, ``plan`` (pure), ``launch`` (the seam the installed package's fast path
calls with its own ``launcher``) and a plain host function. ``kraken.two_shot_all_reduce_bias_rms_norm`` is the
same kernel behind the product layer (``kraken.runtime.bias_norm``).

    torchrun --nproc-per-node 2 kraken/fused/two_shot_all_reduce_bias_rms_norm.py
"""

from __future__ import annotations

import os
import time

import torch
import torch.distributed as dist
import torch.distributed._symmetric_memory as symm_mem
import triton
import triton.language as tl

from kraken._blocks import block_range, copy_slice, rms_normalize, sum_peers
from kraken._ptx_utils import barrier_blocks, symm_mem_sync

# Not tuned on its own: the tuned two-shot all-reduce's grid cap; num_warps None: from the row width
# (``row_warps``: at most one 16-byte vector per thread, so a row's loads go out together).
DEFAULT_CONFIG = {"num_warps": None, "max_blocks": 132}
WORKSPACE_COPIES = 2  # staged input, then the pushed result


# Row counts are not specialized: one binary per (dtype, hidden) serves every token count, and
# alignment comes from `hidden` alone.
@triton.jit(do_not_specialize=["tokens", "shard", "chunk"])
def two_shot_all_reduce_bias_rms_norm_kernel(
    x_ptr,
    bias_ptr,
    weight_ptr,
    workspace_ptr,  # this rank's workspace (= peers[rank]): [staged x | result]
    peers,  # tuple of world_size pointers, peers[r] = rank r's workspace
    out_ptr,
    signal_pad_ptrs,
    tokens,
    hidden,
    shard,  # rows per rank
    chunk,  # rows per block within a shard
    eps,
    rank,
    world_size: tl.constexpr,
    BLOCK_H: tl.constexpr,  # next_power_of_2(hidden): one row per tile
):
    block_id = tl.program_id(0)
    result_offset = tokens * hidden  # where the result region starts in every workspace
    for owner in tl.static_range(world_size):
        row_start, row_end = block_range(owner, block_id, shard, chunk, tokens)
        copy_slice(x_ptr, workspace_ptr, row_start * hidden, row_end * hidden, BLOCK_H)
    # The same for every row, and not written by peers: loaded once, while the barrier waits.
    cols = tl.arange(0, BLOCK_H)
    mask = cols < hidden
    bias = tl.load(bias_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    # Release: my staged rows are visible to their owners. Acquire: peers' rows of my shard are visible to me.
    symm_mem_sync(signal_pad_ptrs, block_id, rank, world_size, hasPreviousMemAccess=True, hasSubsequentMemAccess=True)
    row_start, row_end = block_range(rank, block_id, shard, chunk, tokens)
    for row in tl.range(row_start, row_end):
        offsets = row * hidden + cols
        h = sum_peers(peers, offsets, mask, world_size) + bias
        y = rms_normalize(h, weight, eps, hidden).to(out_ptr.dtype.element_ty)
        for r in tl.static_range(world_size):
            tl.store(peers[r] + result_offset + offsets, y, mask=mask)
    # Release: my pushed rows are visible to every rank. Acquire: every owner's rows are visible to me.
    symm_mem_sync(signal_pad_ptrs, block_id, rank, world_size, hasPreviousMemAccess=True, hasSubsequentMemAccess=True)
    for owner in tl.static_range(world_size):
        row_start, row_end = block_range(owner, block_id, shard, chunk, tokens)
        copy_slice(workspace_ptr + result_offset, out_ptr, row_start * hidden, row_end * hidden, BLOCK_H)


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """``triton.next_power_of_2`` without its host cost: triton 3.6 makes that a ``constexpr_function`` (about
    2 us a call), and ``launch`` runs on every call."""
    return 1 << (n - 1).bit_length() if n > 0 else 1


def row_warps(hidden: int) -> int:
    """Warps for the one-row tile: at most one 16-byte vector (8 bf16) per thread, 16 to 32.

    Then a thread's share of a row is one load per peer, so (at world size 2)
    the first add of the peers' rows needs every load the thread issued, and
    they are all in flight at once. With two vectors per thread (16 warps for a
    5120-wide row), ptxas may hold back a thread's last load until the first
    ones have arrived: a second NVLink round trip on every row.
    """
    return max(16, min(32, next_power_of_2(hidden) // (8 * 32)))


def plan(tokens: int, hidden: int, world_size: int, config: dict, pad_bytes: int | None = None) -> dict:
    """The launch configuration: ``DEFAULT_CONFIG`` overridden by ``config``; ``world_size`` shards of whole rows,
    a persistent grid of at most one block per row of a shard, ``max_blocks``, and the block ids the signal pad
    holds (``pad_bytes``; by default torch's pad size), every block with rows. Shared with the Helion twin."""
    unknown = set(config) - set(DEFAULT_CONFIG)
    if unknown:
        raise TypeError(f"two_shot_all_reduce_bias_rms_norm: unknown config keys {sorted(unknown)}; "
                        f"known: {sorted(DEFAULT_CONFIG)}")
    cfg = {**DEFAULT_CONFIG, **config}
    shard = max(1, cdiv(tokens, world_size))
    pad_bytes = symm_mem.get_signal_pad_size() if pad_bytes is None else pad_bytes
    num_blocks = max(1, min(shard, cfg["max_blocks"], barrier_blocks(world_size, pad_bytes)))
    chunk = cdiv(shard, num_blocks)
    num_blocks = cdiv(shard, chunk)  # no block left without rows
    num_warps = cfg["num_warps"] or row_warps(hidden)
    return {"num_warps": num_warps, "num_blocks": num_blocks, "shard": shard, "chunk": chunk}


def triton_launch(kernel, grid: tuple[int, ...], *args, **meta):
    """``launch``'s default launcher: Triton's own ``kernel[grid](...)``."""
    return kernel[grid](*args, **meta)


def launch(
    x: torch.Tensor,
    bias: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    peers: tuple[torch.Tensor, ...],
    out: torch.Tensor,
    signal_pad_ptrs: int,
    rank: int,
    num_warps: int,
    num_blocks: int,
    shard: int,
    chunk: int,
    group_name: str = "",
    launcher=triton_launch,
) -> torch.Tensor:
    """Launch on planned arguments (no checks); the same signature as the Helion twin's ``launch``.

    ``x``, ``out``: [tokens, hidden]; ``peers``: every rank's workspace (``2 * tokens * hidden`` elements).
    ``group_name`` is unused here. ``launcher``: Triton's own launch, or the installed package's.
    """
    tokens, hidden = x.shape
    launcher(
        two_shot_all_reduce_bias_rms_norm_kernel, (num_blocks,),
        x, bias, weight, peers[rank], peers, out, signal_pad_ptrs, tokens, hidden, shard, chunk, float(eps),
        rank, len(peers), BLOCK_H=next_power_of_2(hidden), num_warps=num_warps,
    )
    return out


def symmetric_peers(numel: int, dtype: torch.dtype, device: torch.device, group) -> tuple:
    """A symmetric buffer of ``numel`` elements on every rank of ``group`` (a collective: every rank calls it):
    (every rank's buffer as this rank sees it, the signal pads' pointer array, this rank)."""
    buf = symm_mem.empty(numel, dtype=dtype, device=device)
    handle = symm_mem.rendezvous(buf, group if isinstance(group, str) else group.group_name)
    peers = tuple(buf if r == handle.rank else handle.get_buffer(r, (numel,), dtype)
                  for r in range(handle.world_size))
    return peers, handle.signal_pad_ptrs_dev, handle.rank


def two_shot_all_reduce_bias_rms_norm(
    x: torch.Tensor,
    bias: torch.Tensor,
    weight: torch.Tensor,
    eps: float = 1e-5,
    group: dist.ProcessGroup | str | None = None,
    **config,
) -> torch.Tensor:
    """RMSNorm(``sum over ranks of x`` + ``bias``) * ``weight``, rows sharded over ranks; a new tensor.

    The recipe spelled out: a symmetric workspace of two regions on every rank, the plan, one launch. It
    allocates and rendezvouses on every call and checks nothing; ``kraken.two_shot_all_reduce_bias_rms_norm`` is
    the installed one (checks agreed across ranks, a shared workspace, prepared calls)."""
    group = dist.group.WORLD if group is None else group
    hidden = x.shape[-1]
    x2d = x.view(-1, hidden)
    peers, signal_pad_ptrs, rank = symmetric_peers(max(WORKSPACE_COPIES * x.numel(), 1), x.dtype, x.device, group)
    out = torch.empty_like(x2d)
    cfg = plan(x2d.shape[0], hidden, len(peers), config)
    launch(x2d, bias, weight, eps, peers, out, signal_pad_ptrs, rank, **cfg)
    return out.view(x.shape)


def reference(x: torch.Tensor, bias: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """NCCL's all-reduce, then the bias and RMSNorm in float64."""
    h = x.double()
    dist.all_reduce(h)
    h += bias.double()
    return h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps) * weight.double()


def main(tokens: int = 256, hidden: int = 5120, iters: int = 100) -> None:
    """Check against NCCL's all-reduce, the bias and RMSNorm in float64, and time the kernel (``torchrun``, or
    alone)."""
    if "RANK" not in os.environ:  # run alone: a group of one
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT="29501")
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", device_id=device)
    rank, world_size = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(1234)  # the parameters: the same on every rank
    bias = torch.randn(hidden, dtype=torch.bfloat16, device=device)
    weight = (1 + 0.5 * torch.randn(hidden, device=device)).to(torch.bfloat16)
    torch.manual_seed(rank)
    x = torch.randn(tokens, hidden, dtype=torch.bfloat16, device=device)
    expected = reference(x, bias, weight, 1e-5)
    got = two_shot_all_reduce_bias_rms_norm(x, bias, weight)
    torch.testing.assert_close(got.double(), expected, rtol=2e-2, atol=2e-2)

    peers, signal_pad_ptrs, rank = symmetric_peers(WORKSPACE_COPIES * x.numel(), x.dtype, device, dist.group.WORLD)
    out, cfg = torch.empty_like(x), plan(tokens, hidden, len(peers), {})
    for _ in range(10):  # warm up (compile)
        launch(x, bias, weight, 1e-5, peers, out, signal_pad_ptrs, rank, **cfg)
    dist.barrier()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(iters):
        launch(x, bias, weight, 1e-5, peers, out, signal_pad_ptrs, rank, **cfg)
    torch.cuda.synchronize()
    us = (time.perf_counter() - start) / iters * 1e6
    torch.testing.assert_close(out.double(), expected, rtol=2e-2, atol=2e-2)
    if rank == 0:
        print(f"two_shot_all_reduce_bias_rms_norm: {tokens}x{hidden} bf16 x {world_size} ranks: matches NCCL + "
              f"bias + RMSNorm, {us:.1f} us per call (eager launches; {cfg})")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
