"""Helion twin of ``kraken/fused/one_shot_all_reduce_bias_rms_norm.py``: the same algorithm, plan and arguments.

Same structure as the Triton recipe: ``hl.grid(num_blocks)`` with
``pid_type="flat"`` launches exactly the recipe's persistent grid (one program
per block, the barrier's block id); each block walks its rows with
``hl.tile(start, start + rows_per_block, block_size=1)``, a row being one
``[1, hidden]`` tile (the ``:`` index is Helion's persistent reduction
dimension, ``BLOCK_H`` in Triton). The staging copy goes to this rank's
workspace, passed as its own argument; the barriers are the kraken PTX through
``hl.inline_triton``; the row math is ``kraken._blocks.norm.rms_normalize``.

``helion_ports.one_shot_all_reduce_bias_rms_norm`` is the installed twin (checks agreed across ranks, prepared
calls, replayed launches). Set ``HELION_PRINT_OUTPUT_CODE=1`` to see the generated Triton.

    torchrun --nproc-per-node 2 helion_ports/fused/one_shot_all_reduce_bias_rms_norm.py
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

from kraken._blocks.helion import flat_kernel, own_storage, run, views
from kraken._blocks.norm import rms_normalize
from kraken._ptx_utils import barrier_blocks
from kraken._ptx_utils.inline_source import SYMM_MEM_SYNC

# The recipe's defaults (kraken/fused/one_shot_all_reduce_bias_rms_norm.py), kept equal by a test.
DEFAULT_CONFIG = {"num_warps": None, "max_blocks": 64}
WORKSPACE_COPIES = 1  # the staged input

# "My staged rows are visible / yours are" (release + acquire), then "done reading yours" (release).
SYNC_STAGED = SYMM_MEM_SYNC[(True, True)]
SYNC_DONE = SYMM_MEM_SYNC[(True, False)]


def one_shot_all_reduce_bias_rms_norm_body(
    x: torch.Tensor,
    bias: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    workspace: torch.Tensor,
    peers: tuple[torch.Tensor, ...],
    out: torch.Tensor,
    signal_pad_ptrs: int,
    num_blocks: int,
    rows_per_block: int,
    rank: int,
    world_size: hl.constexpr,
    group_name: hl.ProcessGroupName,
) -> torch.Tensor:
    tokens = x.size(0)
    for block in hl.grid(num_blocks):
        barrier = {"signal_pad_ptrs": signal_pad_ptrs, "block_id": block, "rank": rank, "world_size": world_size}
        start = block * rows_per_block
        # Ranges are clipped, as in the recipe, rather than masked per row: with one bound ptxas
        # batches the peers' loads as it does for the recipe (the CPU tests compare the schedules).
        for rows in hl.tile(start, min(start + rows_per_block, tokens), block_size=1):
            hl.store(workspace, [rows, slice(None)], hl.load(x, [rows, slice(None)]))
        # The same for every row, and not written by peers: loaded once, while the barrier waits.
        bias_row = hl.load(bias, [slice(None)]).to(torch.float32)[None, :]
        weight_row = hl.load(weight, [slice(None)]).to(torch.float32)[None, :]
        hl.inline_triton(SYNC_STAGED, args=barrier, output_like=None)
        for rows in hl.tile(start, min(start + rows_per_block, tokens), block_size=1):
            # Start from rank 0's row (as sum_peers does): hl.zeros([rows, hidden]) would need hidden specialized.
            h = hl.load(peers[0], [rows, slice(None)]).to(torch.float32)
            for r in hl.static_range(world_size):  # not (1, world_size): docs/helion-notes.md
                if r > 0:  # rank order, from rank 0's value, as in the recipe (folded at compile time)
                    h = h + hl.load(peers[r], [rows, slice(None)]).to(torch.float32)
            h = h + bias_row
            y = rms_normalize(h, weight_row, eps)
            hl.store(out, [rows, slice(None)], y.to(out.dtype))
        hl.inline_triton(SYNC_DONE, args=barrier, output_like=None)
    return out


@functools.cache
def compiled(num_warps: int) -> helion.Kernel:
    """One Helion kernel per launch configuration, each with an explicit config.

    ``pid_type="flat"``: the recipe's grid, one program per block (see ``helion_ports``).
    """
    return flat_kernel(one_shot_all_reduce_bias_rms_norm_body, (), num_warps)


def row_warps(hidden: int) -> int:
    """The recipe's warps for the one-row tile: at most one 16-byte vector (8 bf16) per thread, 16 to 32."""
    block_h = 1 << (hidden - 1).bit_length() if hidden > 0 else 1
    return max(16, min(32, block_h // (8 * 32)))


def plan(tokens: int, hidden: int, world_size: int, config: dict, pad_bytes: int | None = None) -> dict:
    """The recipe's plan: a persistent grid of at most one block per row, ``max_blocks``, and the block ids the
    signal pad holds, every block with rows."""
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
    launcher=None,
) -> torch.Tensor:
    """Launch on planned arguments (no checks); the recipe's ``launch`` signature. ``launcher``: None for a plain
    call, or the installed package's (``run``)."""
    # `workspace` through its own storage object: see kraken._blocks.helion.own_storage.
    args = (x, bias, weight, float(eps), own_storage(peers[rank]), peers, out, signal_pad_ptrs, num_blocks,
            rows_per_block, rank, len(peers), group_name)
    run(compiled(num_warps), args, launcher, row_args)
    return out


def row_args(args: tuple) -> tuple:
    """``launch``'s arguments as the kernel takes them (``kraken._blocks.helion.run``): the workspaces as ``x``'s rows."""
    x, bias, weight, eps, workspace, peers, *rest = args
    return (x, bias, weight, eps, workspace.view(x.shape), views(peers, x.shape), *rest)


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

    The twin spelled out: a symmetric workspace on every rank (``symm_mem.empty``, ``rendezvous``), the plan, one
    launch. It allocates and rendezvouses on every call and checks nothing."""
    group = dist.group.WORLD if group is None else group
    name = group if isinstance(group, str) else group.group_name
    hidden = x.shape[-1]
    x2d = x.view(-1, hidden)
    peers, signal_pad_ptrs, rank = symmetric_peers(max(WORKSPACE_COPIES * x.numel(), 1), x.dtype, x.device, name)
    out = torch.empty_like(x2d)
    cfg = plan(x2d.shape[0], hidden, len(peers), config)
    launch(x2d, bias, weight, eps, peers, out, signal_pad_ptrs, rank, **cfg, group_name=name)
    return out.view(x.shape)


def main(tokens: int = 16, hidden: int = 5120, iters: int = 100) -> None:
    """Check against NCCL's all-reduce, the bias and RMSNorm in float64, and time the twin (``torchrun``, or alone
    as a group of one)."""
    if "RANK" not in os.environ:
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT="29501")
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", device_id=device)
    torch.manual_seed(1234)  # the parameters: the same on every rank
    bias = torch.randn(hidden, dtype=torch.bfloat16, device=device)
    weight = (1 + 0.5 * torch.randn(hidden, device=device)).to(torch.bfloat16)
    torch.manual_seed(dist.get_rank())
    x = torch.randn(tokens, hidden, dtype=torch.bfloat16, device=device)
    h = x.double()
    dist.all_reduce(h)
    h += bias.double()
    expected = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-5) * weight.double()
    for _ in range(3):  # compile, then warm
        got = one_shot_all_reduce_bias_rms_norm(x, bias, weight)
    torch.testing.assert_close(got.double(), expected, rtol=2e-2, atol=2e-2)

    # The plain call's buffers, plan and arguments, prepared once: the loop times the launches alone.
    name = dist.group.WORLD.group_name
    peers, signal_pad_ptrs, rank = symmetric_peers(max(WORKSPACE_COPIES * x.numel(), 1), x.dtype, device, name)
    out, cfg = torch.empty_like(x), plan(tokens, hidden, len(peers), {})
    for _ in range(3):  # warm up
        launch(x, bias, weight, 1e-5, peers, out, signal_pad_ptrs, rank, **cfg, group_name=name)
    dist.barrier()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(iters):
        launch(x, bias, weight, 1e-5, peers, out, signal_pad_ptrs, rank, **cfg, group_name=name)
    torch.cuda.synchronize()
    us = (time.perf_counter() - start) / iters * 1e6
    torch.testing.assert_close(out.double(), expected, rtol=2e-2, atol=2e-2)
    if rank == 0:
        print(f"helion one_shot_all_reduce_bias_rms_norm: {tokens}x{hidden} bf16 x {dist.get_world_size()} ranks: "
              f"matches NCCL + bias + RMSNorm, {us:.1f} us per call (eager launches; {cfg})")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
