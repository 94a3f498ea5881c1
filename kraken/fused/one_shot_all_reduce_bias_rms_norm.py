"""One-shot all-reduce + bias + RMSNorm: the fusion after every tensor-parallel linear layer.

    h = sum_r x_r + bias
    y = h * rsqrt(mean(h^2) + eps) * weight          (per row, all in fp32)

Same shape as ``one_shot_all_reduce_bias`` (staging, two barrier rounds, rank-
order sums), but the unit of work is a whole row: RMSNorm needs the row's sum of
squares, so each row is reduced as one ``next_power_of_2(hidden)`` register tile
and normalised on the spot, with no second pass over memory and no extra launch.

Block ``b`` of every rank owns ``rows_per_block`` consecutive rows and barrier
slot ``b``:

1. copy its rows of ``x`` into the symmetric workspace, and load ``bias`` and
   ``weight`` (once: they are the same for every row);
2. barrier (release + acquire): staged rows are visible both ways;
3. for each row: sum the peers' rows (rank order, fp32), add ``bias``,
   normalise (``kraken._blocks.rms_normalize``), store the local output;
4. barrier (release): "done reading your workspace".

The row is spread so that no thread holds more than one 16-byte vector of it
(``row_warps``): at world size 2 a row costs one NVLink round trip, both peers'
loads in flight together.

Every rank computes every row itself, so the results are bitwise identical on
all ranks. ``x`` is always copied into the workspace (see ``one_shot_all_reduce_bias``).

Layout: ``x`` [..., hidden] (any leading shape flattened into tokens), contiguous, bf16/fp16/fp32, hidden at
most 16384 (a row is one register tile); ``bias``, ``weight`` [hidden] of ``x``'s dtype; the workspace holds
``tokens * hidden`` elements (``WORKSPACE_COPIES`` = 1).

This file is the recipe: the kernel, ``plan`` (pure), ``launch`` (the seam the installed package's fast path
calls with its own ``launcher``) and a plain host function. ``kraken.one_shot_all_reduce_bias_rms_norm`` is the
same kernel behind the product layer (``kraken.runtime.bias_norm``).

    torchrun --nproc-per-node 2 kraken/fused/one_shot_all_reduce_bias_rms_norm.py
"""

from __future__ import annotations

import os
import time

import torch
import torch.distributed as dist
import torch.distributed._symmetric_memory as symm_mem
import triton
import triton.language as tl

from kraken._blocks import copy_slice, rms_normalize, sum_peers
from kraken._ptx_utils import barrier_blocks, symm_mem_sync

# Not tuned on its own: the tuned one-shot all-reduce's grid cap; num_warps None: from the row width
# (``row_warps``: at most one 16-byte vector per thread, so a row's loads go out together).
DEFAULT_CONFIG = {"num_warps": None, "max_blocks": 64}
WORKSPACE_COPIES = 1  # the staged input


# Row counts are not specialized: one binary per (dtype, hidden) serves every token count, and
# alignment comes from `hidden` alone.
@triton.jit(do_not_specialize=["tokens", "rows_per_block"])
def one_shot_all_reduce_bias_rms_norm_kernel(
    x_ptr,
    bias_ptr,
    weight_ptr,
    workspace_ptr,  # this rank's workspace (= peers[rank])
    peers,  # tuple of world_size pointers, peers[r] = rank r's workspace
    out_ptr,
    signal_pad_ptrs,
    tokens,
    hidden,
    rows_per_block,
    eps,
    rank,
    world_size: tl.constexpr,
    BLOCK_H: tl.constexpr,  # next_power_of_2(hidden): one row per tile
):
    block_id = tl.program_id(0)
    row_start = block_id * rows_per_block
    row_end = tl.minimum(row_start + rows_per_block, tokens)
    copy_slice(x_ptr, workspace_ptr, row_start * hidden, row_end * hidden, BLOCK_H)
    # The same for every row, and not written by peers: loaded once, while the barrier waits.
    cols = tl.arange(0, BLOCK_H)
    mask = cols < hidden
    bias = tl.load(bias_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    # Release: my staged rows are visible to peers. Acquire: theirs are visible to me.
    symm_mem_sync(signal_pad_ptrs, block_id, rank, world_size, hasPreviousMemAccess=True, hasSubsequentMemAccess=True)
    for row in tl.range(row_start, row_end):
        offsets = row * hidden + cols
        h = sum_peers(peers, offsets, mask, world_size) + bias
        y = rms_normalize(h, weight, eps, hidden)
        tl.store(out_ptr + offsets, y.to(out_ptr.dtype.element_ty), mask=mask)
    # Done reading peers' workspaces: after this they may restage into them.
    symm_mem_sync(signal_pad_ptrs, block_id, rank, world_size, hasPreviousMemAccess=True, hasSubsequentMemAccess=False)


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
    """The launch configuration: ``DEFAULT_CONFIG`` overridden by ``config``, a persistent grid of at most one block
    per row, ``max_blocks``, and the block ids the signal pad holds (``pad_bytes``; by default torch's pad size),
    every block with rows. Shared with the Helion twin."""
    unknown = set(config) - set(DEFAULT_CONFIG)
    if unknown:
        raise TypeError(f"one_shot_all_reduce_bias_rms_norm: unknown config keys {sorted(unknown)}; "
                        f"known: {sorted(DEFAULT_CONFIG)}")
    cfg = {**DEFAULT_CONFIG, **config}
    pad_bytes = symm_mem.get_signal_pad_size() if pad_bytes is None else pad_bytes
    num_blocks = max(1, min(tokens, cfg["max_blocks"], barrier_blocks(world_size, pad_bytes)))
    rows_per_block = max(1, -(-tokens // num_blocks))
    num_blocks = max(1, -(-tokens // rows_per_block))  # no block left without rows
    num_warps = cfg["num_warps"] or row_warps(hidden)
    return {"num_warps": num_warps, "num_blocks": num_blocks, "rows_per_block": rows_per_block}


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
    rows_per_block: int,
    group_name: str = "",
    launcher=triton_launch,
) -> torch.Tensor:
    """Launch on planned arguments (no checks); the same signature as the Helion twin's ``launch``.

    ``x``, ``out``: [tokens, hidden]; ``peers``: every rank's workspace (``tokens * hidden`` elements).
    ``group_name`` is unused here. ``launcher``: Triton's own launch, or the installed package's.
    """
    tokens, hidden = x.shape
    launcher(
        one_shot_all_reduce_bias_rms_norm_kernel, (num_blocks,),
        x, bias, weight, peers[rank], peers, out, signal_pad_ptrs, tokens, hidden, rows_per_block, float(eps),
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


def one_shot_all_reduce_bias_rms_norm(
    x: torch.Tensor,
    bias: torch.Tensor,
    weight: torch.Tensor,
    eps: float = 1e-5,
    group: dist.ProcessGroup | str | None = None,
    **config,
) -> torch.Tensor:
    """RMSNorm(``sum over ranks of x`` + ``bias``) * ``weight``; a new tensor of ``x``'s shape and dtype.

    The recipe spelled out: a symmetric workspace on every rank, the plan, one launch. It allocates and
    rendezvouses on every call and checks nothing; ``kraken.one_shot_all_reduce_bias_rms_norm`` is the installed
    one (checks agreed across ranks, a shared workspace, prepared calls)."""
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


def main(tokens: int = 16, hidden: int = 5120, iters: int = 100) -> None:
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
    got = one_shot_all_reduce_bias_rms_norm(x, bias, weight)
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
        print(f"one_shot_all_reduce_bias_rms_norm: {tokens}x{hidden} bf16 x {world_size} ranks: matches NCCL + "
              f"bias + RMSNorm, {us:.1f} us per call (eager launches; {cfg})")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
