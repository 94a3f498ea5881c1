"""Helion twin of ``kraken/fused/two_shot_all_reduce_bias_rms_norm.py``: the same algorithm, plan and arguments.

The Triton recipe's five steps in rows: this rank's workspace arrives as a
``[2, tokens, hidden]`` view (0: staged input, 1: pushed result), a row is one
``[1, hidden]`` tile of ``hl.tile(..., block_size=1)``, and the shard owners
are unrolled with ``hl.static_range``. The peers' workspaces arrive as flat
views of their two regions (``staged``, ``results``: see
``kraken._blocks.helion.views``), read and written at the recipe's offsets
``row * hidden + cols``.

``helion_ports.two_shot_all_reduce_bias_rms_norm`` is the installed twin (checks agreed across ranks, prepared
calls, replayed launches). Set ``HELION_PRINT_OUTPUT_CODE=1`` to see the generated Triton.

    torchrun --nproc-per-node 2 helion_ports/fused/two_shot_all_reduce_bias_rms_norm.py
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
from kraken._ptx_utils import barrier_blocks
from kraken._ptx_utils.inline_source import SYMM_MEM_SYNC

# The recipe's defaults (kraken/fused/two_shot_all_reduce_bias_rms_norm.py), kept equal by a test.
DEFAULT_CONFIG = {"num_warps": None, "max_blocks": 132}
WORKSPACE_COPIES = 2  # staged input, then the pushed result

# Both barriers: "my writes are visible to you" (release) and "yours to me" (acquire).
SYNC = SYMM_MEM_SYNC[(True, True)]


def two_shot_all_reduce_bias_rms_norm_body(
    x: torch.Tensor,
    bias: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    workspace: torch.Tensor,
    staged: tuple[torch.Tensor, ...],
    results: tuple[torch.Tensor, ...],
    out: torch.Tensor,
    signal_pad_ptrs: int,
    num_blocks: int,
    shard: int,
    chunk: int,
    rank: int,
    shard_end: int,
    world_size: hl.constexpr,
    block_h: hl.constexpr,
    group_name: hl.ProcessGroupName,
) -> torch.Tensor:
    tokens, hidden = x.size(0), x.size(1)
    for block in hl.grid(num_blocks):
        barrier = {"signal_pad_ptrs": signal_pad_ptrs, "block_id": block, "rank": rank, "world_size": world_size}
        for owner in hl.static_range(world_size):
            start = owner * shard + block * chunk
            for rows in hl.tile(start, start + chunk, block_size=1):
                valid = ((rows.index < tokens) & (rows.index < owner * shard + shard))[:, None]
                row = hl.load(x, [rows, slice(None)], extra_mask=valid)
                hl.store(workspace, [0, rows, slice(None)], row, extra_mask=valid)
        # The same for every row, and not written by peers: loaded once, while the barrier waits.
        cols = hl.arange(block_h)
        in_row = cols < hidden
        bias_row = hl.load(bias, [cols], extra_mask=in_row).to(torch.float32)[None, :]
        weight_row = hl.load(weight, [cols], extra_mask=in_row).to(torch.float32)[None, :]
        hl.inline_triton(SYNC, args=barrier, output_like=None)
        start = rank * shard + block * chunk
        # As the recipe: a clipped range of rows, and every peer's row at the one offset row * hidden + cols
        # from its flat view's base. With [2, tokens, hidden] views (peers[r][0, rows, :]: a stride parameter
        # per peer, so an offset per peer) or with masked rows, ptxas issued 3 of the 4 peers' loads before
        # the first add at 4 ranks (the recipe 4); see docs/helion-notes.md. `shard_end` (my shard's end,
        # clipped to `tokens`) comes from the host: with `min(start + chunk, min(rank * shard + shard, tokens))`
        # here the same happened at 8 ranks (3 of 8, the recipe 4) when the barriers have their timeout.
        for rows in hl.tile(start, min(start + chunk, shard_end), block_size=1):
            offsets = rows.index[:, None] * hidden + cols[None, :]
            # Start from rank 0's row (as sum_peers does): hl.zeros([rows, hidden]) would need hidden specialized.
            h = hl.load(staged[0], [offsets], extra_mask=in_row[None, :]).to(torch.float32)
            for r in hl.static_range(world_size):  # not (1, world_size): docs/helion-notes.md
                if r > 0:  # rank order, from rank 0's value, as in the recipe (folded at compile time)
                    h = h + hl.load(staged[r], [offsets], extra_mask=in_row[None, :]).to(torch.float32)
            h = h + bias_row
            # rms_normalize with the row's width: torch.mean over the block_h columns would divide by block_h.
            y = (h * torch.rsqrt(torch.sum(h * h, dim=-1, keepdim=True) / hidden + eps) * weight_row).to(out.dtype)
            for r in hl.static_range(world_size):
                hl.store(results[r], [offsets], y, extra_mask=in_row[None, :])
        hl.inline_triton(SYNC, args=barrier, output_like=None)
        for owner in hl.static_range(world_size):
            start = owner * shard + block * chunk
            for rows in hl.tile(start, start + chunk, block_size=1):
                valid = ((rows.index < tokens) & (rows.index < owner * shard + shard))[:, None]
                row = hl.load(workspace, [1, rows, slice(None)], extra_mask=valid)
                hl.store(out, [rows, slice(None)], row, extra_mask=valid)
    return out


@functools.cache
def compiled(num_warps: int) -> helion.Kernel:
    """One Helion kernel per launch configuration, each with an explicit config.

    ``pid_type="flat"``: the recipe's grid, one program per block (see ``helion_ports``).
    """
    return flat_kernel(two_shot_all_reduce_bias_rms_norm_body, (), num_warps)


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """``triton.next_power_of_2`` without its host cost (``launch`` runs on every call)."""
    return 1 << (n - 1).bit_length() if n > 0 else 1


def row_warps(hidden: int) -> int:
    """The recipe's warps for the one-row tile: at most one 16-byte vector (8 bf16) per thread, 16 to 32."""
    return max(16, min(32, next_power_of_2(hidden) // (8 * 32)))


def plan(tokens: int, hidden: int, world_size: int, config: dict, pad_bytes: int | None = None) -> dict:
    """The recipe's plan: ``world_size`` shards of whole rows, a persistent grid of at most one block per row of a
    shard, ``max_blocks``, and the block ids the signal pad holds, every block with rows."""
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
    launcher=None,
) -> torch.Tensor:
    """Launch on planned arguments (no checks); the recipe's ``launch`` signature. ``launcher``: None for a plain
    call, or the installed package's (``run``)."""
    tokens, hidden = x.shape
    # `workspace` through its own storage object: see kraken._blocks.helion.own_storage.
    args = (
        x, bias, weight, float(eps), own_storage(peers[rank]), peers, out, signal_pad_ptrs, num_blocks, shard, chunk,
        rank, min((rank + 1) * shard, tokens), len(peers), next_power_of_2(hidden), group_name,
    )
    run(compiled(num_warps), args, launcher, region_args)
    return out


def region_args(args: tuple) -> tuple:
    """``launch``'s arguments as the kernel takes them (``kraken._blocks.helion.run``): the workspaces as two regions of
    ``x``'s rows (staged input, reduced shard), and the peers' regions flat."""
    x, bias, weight, eps, workspace, peers, *rest = args
    tokens, hidden = x.shape
    flat = (2, tokens * hidden)
    return (x, bias, weight, eps, workspace.view(2, tokens, hidden), views(peers, flat, 0), views(peers, flat, 1),
            *rest)


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

    The twin spelled out: a symmetric workspace of two regions on every rank (``symm_mem.empty``, ``rendezvous``),
    the plan, one launch. It allocates and rendezvouses on every call and checks nothing."""
    group = dist.group.WORLD if group is None else group
    name = group if isinstance(group, str) else group.group_name
    hidden = x.shape[-1]
    x2d = x.view(-1, hidden)
    peers, signal_pad_ptrs, rank = symmetric_peers(max(WORKSPACE_COPIES * x.numel(), 1), x.dtype, x.device, name)
    out = torch.empty_like(x2d)
    cfg = plan(x2d.shape[0], hidden, len(peers), config)
    launch(x2d, bias, weight, eps, peers, out, signal_pad_ptrs, rank, **cfg, group_name=name)
    return out.view(x.shape)


def main(tokens: int = 256, hidden: int = 5120, iters: int = 100) -> None:
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
        got = two_shot_all_reduce_bias_rms_norm(x, bias, weight)
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
        print(f"helion two_shot_all_reduce_bias_rms_norm: {tokens}x{hidden} bf16 x {dist.get_world_size()} ranks: "
              f"matches NCCL + bias + RMSNorm, {us:.1f} us per call (eager launches; {cfg})")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
