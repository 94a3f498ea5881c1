"""One-shot all-reduce: every rank reads every peer's whole buffer and sums.

Each rank moves ``(world_size - 1) * N`` elements over NVLink, the most of any
all-reduce, but needs only two barrier rounds and no intermediate writes, so it
is the latency winner for small messages.

A persistent grid of ``num_blocks`` blocks splits the tensor into contiguous
chunks. Block ``b`` of every rank handles chunk ``b`` and uses barrier slot
``b``:

1. barrier (acquire): block ``b`` of every peer has started, so every peer's
   input is complete (it was written by kernels earlier in that rank's stream,
   which finished and reached the peer's L2 before this kernel began);
2. sum chunk ``b`` of every peer's buffer, in rank order (bitwise identical on
   every rank), accumulate in fp32, write the local output;
3. barrier (release): "I am done reading your buffer", so when the kernel
   returns every rank may overwrite its input.

An ordinary tensor (not in symmetric memory) is staged (``kraken.runtime.staging``):
block ``b`` copies chunk ``b`` of it into kraken's symmetric workspace before
its first barrier, which then also releases those writes; the peers are the
workspace. A symmetric tensor is read in place.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import triton
import triton.language as tl

from kraken._blocks import copy_slice
from kraken._ptx_utils import symm_mem_sync
from kraken.runtime import agreement, groups, staging
from kraken.runtime.launcher import jit_launch

# Tuned on 2x H200 with benchmark/tune.py (within 3% of the best config at every size, 4K..4M bf16).
DEFAULT_CONFIG = {"block_size": 8192, "num_warps": 16, "max_blocks": 64}
MAX_INDEX = 2**31 - 1  # the largest offset 32-bit arithmetic reaches; past it the kernel runs WIDE


@triton.jit
def one_shot_all_reduce_kernel(
    peers,  # tuple of world_size pointers, peers[r] = rank r's buffer
    out_ptr,
    x_ptr,  # STAGED: the ordinary input, copied into workspace_ptr first
    workspace_ptr,  # STAGED: this rank's workspace (= peers[rank])
    signal_pad_ptrs,
    numel,
    chunk,  # elements per block, a multiple of BLOCK_SIZE
    rank,
    world_size: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    STAGED: tl.constexpr,
    WIDE: tl.constexpr = False,  # past 2**31 elements: 64-bit offsets (32-bit ones are cheaper where they reach)
):
    block_id = tl.program_id(0)
    start = (block_id.to(tl.int64) if WIDE else block_id) * chunk
    end = tl.minimum(start + chunk, numel)
    if STAGED:  # the peers' block b reads exactly chunk b
        copy_slice(x_ptr, workspace_ptr, start, end, BLOCK_SIZE)
    # Acquire: every peer's input is complete (staged: release mine too).
    symm_mem_sync(signal_pad_ptrs, block_id, rank, world_size, hasPreviousMemAccess=STAGED, hasSubsequentMemAccess=True)
    for offset in tl.range(start, end, BLOCK_SIZE):
        offsets = offset + tl.arange(0, BLOCK_SIZE)
        mask = offsets < end
        acc = tl.zeros([BLOCK_SIZE], dtype=tl.float32)
        for r in tl.static_range(world_size):
            acc += tl.load(peers[r] + offsets, mask=mask).to(tl.float32)
        tl.store(out_ptr + offsets, acc.to(out_ptr.dtype.element_ty), mask=mask)
    symm_mem_sync(signal_pad_ptrs, block_id, rank, world_size, hasPreviousMemAccess=True, hasSubsequentMemAccess=False)


def launch(
    peers: tuple[torch.Tensor, ...],
    out: torch.Tensor,
    signal_pad_ptrs: int,
    rank: int,
    block_size: int,
    num_warps: int,
    num_blocks: int,
    chunk: int,
    wide: bool = False,
    group_name: str = "",
    launcher=jit_launch,
    x: torch.Tensor | None = None,
) -> torch.Tensor:
    """Launch on prepared arguments (no checks); the same signature as the Helion port's ``launch``.

    ``wide``: the tensor has more than 2**31 - 1 elements (64-bit offsets). ``group_name`` is unused here;
    Helion takes it as its ``hl.ProcessGroupName``. ``launcher``: the prepared call's ``Launcher`` (the
    host fast path), or Triton's own launch. ``x``: an ordinary input to stage into ``peers[rank]`` (the
    workspace) first; None when the peers are the input.
    """
    local = peers[rank]
    launcher(
        one_shot_all_reduce_kernel, (num_blocks,), peers, out, local if x is None else x, local, signal_pad_ptrs,
        out.numel(), chunk, rank, len(peers), BLOCK_SIZE=block_size, STAGED=x is not None, WIDE=wide,
        num_warps=num_warps,
    )
    return out


def plan(numel: int, world_size: int, config: dict) -> dict:
    """Resolve the launch configuration (shared with the Helion port)."""
    cfg = groups.resolve_config(config, DEFAULT_CONFIG, "one_shot_all_reduce")
    block_size = cfg["block_size"]
    num_blocks = groups.persistent_grid(groups.cdiv(numel, block_size), cfg["max_blocks"], world_size)
    chunk = groups.round_up(groups.cdiv(numel, num_blocks), block_size)
    return {"block_size": block_size, "num_warps": cfg["num_warps"], "num_blocks": num_blocks, "chunk": chunk,
            "wide": numel > MAX_INDEX}


def check(tensor: torch.Tensor, group, op: str, config: dict, staged: bool) -> dict:
    """Validate and agree (first call of a signature), plan."""
    with agreement.agreed(op, group, tensor=tensor, staged=staged, config=config):  # any rank's bad input: all raise
        groups.check_tensor(tensor, "tensor", op)
        world_size = groups.world_size_of(group, op)
        launch_cfg = plan(tensor.numel(), world_size, config)
        groups.check_barrier_blocks(launch_cfg["num_blocks"], world_size, op)
    return launch_cfg


# Kept per signature: (the peers' symmetric context, the launch configuration); see kraken.runtime.staging.
prepare, prepare_staged, prepare_call = staging.prepares(check)


def one_shot_all_reduce(
    tensor: torch.Tensor, group: dist.ProcessGroup | str | None = None, **config
) -> torch.Tensor:
    """Sum ``tensor`` over the group; returns a new tensor, the input is left unchanged.

    ``tensor``: any shape, contiguous, bf16/fp16/fp32, on the GPU; in symmetric memory
    (``kraken.symm_empty``) it is read in place, otherwise staged inside the kernel. ``config``
    overrides ``DEFAULT_CONFIG``.
    """
    ctx, launch_cfg, staged = prepare_call(tensor, group, "one_shot_all_reduce", config)
    return staging.launched(launch, ctx, launch_cfg, staged, tensor, torch.empty_like(tensor))
