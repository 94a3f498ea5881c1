"""Helion twin of ``kraken/comm/one_shot_all_reduce.py``: the same algorithm, plan and arguments.

The structure mirrors the Triton recipe one to one:

* ``hl.grid(num_blocks)`` is the persistent grid; the grid index is the barrier's block id, identical on every
  rank (``pid_type="flat"``: exactly ``num_blocks`` programs);
* the barriers are the kraken PTX, pasted in with ``hl.inline_triton`` (``kraken._ptx_utils.inline_source``),
  not ``hl.signal``/``hl.wait``;
* the peer buffers arrive as one tuple and are walked with ``hl.static_range(world_size)``, which Helion unrolls
  into plain loads.

An ordinary input is staged by a copy kernel before the sum (``kraken._blocks.helion.stage``): that copy finished
before the sum's first barrier, like any input written earlier on the stream. ``helion_ports.one_shot_all_reduce``
is the installed twin (checks agreed across ranks, prepared calls, replayed launches). Set
``HELION_PRINT_OUTPUT_CODE=1`` to see the generated Triton.

    torchrun --nproc-per-node 2 helion_ports/comm/one_shot_all_reduce.py
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

from kraken._blocks.helion import flat_kernel, flat_view, run, stage, views
from kraken._ptx_utils import barrier_blocks
from kraken._ptx_utils.inline_source import SYMM_MEM_SYNC

# The recipe's tuned defaults (kraken/comm/one_shot_all_reduce.py), kept equal by a test.
DEFAULT_CONFIG = {"block_size": 8192, "num_warps": 16, "max_blocks": 64}

# The barriers: "peers' inputs are ready" (acquire) and "done reading peers" (release).
SYNC_START = SYMM_MEM_SYNC[(False, True)]
SYNC_END = SYMM_MEM_SYNC[(True, False)]


def one_shot_all_reduce_body(
    peers: tuple[torch.Tensor, ...],
    out: torch.Tensor,
    signal_pad_ptrs: int,
    num_blocks: int,
    chunk: int,
    rank: int,
    world_size: hl.constexpr,
    group_name: hl.ProcessGroupName,
) -> torch.Tensor:
    numel = out.size(0)
    for block in hl.grid(num_blocks):
        barrier = {"signal_pad_ptrs": signal_pad_ptrs, "block_id": block, "rank": rank, "world_size": world_size}
        hl.inline_triton(SYNC_START, args=barrier, output_like=None)
        start = block * chunk
        # The range itself is clipped, as in the recipe: one bound serves the loop and the mask. With a
        # separate ``tile.index < numel`` mask, ptxas issued a thread's last peer load only after adds
        # that waited on the first ones: a second NVLink round trip per call.
        for tile in hl.tile(start, min(start + chunk, numel)):
            acc = hl.zeros([tile], dtype=torch.float32)
            for r in hl.static_range(world_size):
                acc = acc + hl.load(peers[r], [tile]).to(torch.float32)
            hl.store(out, [tile], acc.to(out.dtype))
        hl.inline_triton(SYNC_END, args=barrier, output_like=None)
    return out


@functools.cache
def compiled(block_size: int, num_warps: int) -> helion.Kernel:
    """One Helion kernel per launch configuration, each with one explicit config (``flat_kernel``)."""
    return flat_kernel(one_shot_all_reduce_body, (block_size,), num_warps)


def plan(numel: int, world_size: int, config: dict, pad_bytes: int | None = None) -> dict:
    """The recipe's plan: a persistent grid of at most one block per ``block_size`` elements, ``max_blocks``, and
    the block ids the signal pad holds, each block a chunk of whole ``block_size`` tiles."""
    unknown = set(config) - set(DEFAULT_CONFIG)
    if unknown:
        raise TypeError(f"one_shot_all_reduce: unknown config keys {sorted(unknown)}; known: {sorted(DEFAULT_CONFIG)}")
    cfg = {**DEFAULT_CONFIG, **config}
    block_size = cfg["block_size"]
    pad_bytes = symm_mem.get_signal_pad_size() if pad_bytes is None else pad_bytes
    num_blocks = max(1, min(-(-numel // block_size), cfg["max_blocks"], barrier_blocks(world_size, pad_bytes)))
    chunk = -(-(-(-numel // num_blocks)) // block_size) * block_size
    return {"block_size": block_size, "num_warps": cfg["num_warps"], "num_blocks": num_blocks, "chunk": chunk,
            "wide": numel > 2**31 - 1}


def launch(
    peers: tuple[torch.Tensor, ...],
    out: torch.Tensor,
    signal_pad_ptrs: int,
    rank: int,
    block_size: int,
    num_warps: int,
    num_blocks: int,
    chunk: int,
    wide: bool = False,  # unused: Helion picks 64-bit indices itself from the tensors' sizes
    group_name: str = "",
    launcher=None,
    x: torch.Tensor | None = None,
) -> torch.Tensor:
    """Launch on planned arguments (no checks); the recipe's ``launch`` signature. An ordinary ``x`` is staged
    into ``peers[rank]`` first. ``launcher``: None for a plain call, or the installed package's (``run``)."""
    if x is not None:
        stage(peers, rank, x, group_name, launcher)
    args = (views(peers, -1), flat_view(out), signal_pad_ptrs, num_blocks, chunk, rank, len(peers), group_name)
    run(compiled(block_size, num_warps), args, launcher)
    return out


def one_shot_all_reduce(
    tensor: torch.Tensor, group: dist.ProcessGroup | str | None = None, **config
) -> torch.Tensor:
    """Sum ``tensor`` over ``group`` (the default group when None); returns a new tensor.

    The twin spelled out: a symmetric buffer on every rank (``symm_mem.empty``, ``rendezvous``), the plan, a
    staging copy and the sum. It allocates and rendezvouses on every call and checks nothing."""
    group = dist.group.WORLD if group is None else group
    name = group if isinstance(group, str) else group.group_name
    buf = symm_mem.empty(tensor.numel(), dtype=tensor.dtype, device=tensor.device)
    handle = symm_mem.rendezvous(buf, name)
    peers = tuple(buf if r == handle.rank else handle.get_buffer(r, (tensor.numel(),), tensor.dtype)
                  for r in range(handle.world_size))
    out = torch.empty_like(tensor)
    cfg = plan(tensor.numel(), handle.world_size, config)
    return launch(peers, out, handle.signal_pad_ptrs_dev, handle.rank, **cfg, group_name=name, x=tensor)


def main(numel: int = 1 << 20, iters: int = 100) -> None:
    """Check against NCCL's all-reduce and time the twin (``torchrun``, or alone as a group of one)."""
    if "RANK" not in os.environ:
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT="29501")
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", device_id=device)
    torch.manual_seed(dist.get_rank())
    x = torch.randn(numel, dtype=torch.bfloat16, device="cuda")
    expected = x.float()
    dist.all_reduce(expected)
    got = one_shot_all_reduce(x)
    torch.testing.assert_close(got.float(), expected, rtol=2e-2, atol=2e-2 * dist.get_world_size())

    # The kernel alone on a symmetric input (no staging), as the recipe's main times it.
    group = dist.group.WORLD
    buf = symm_mem.empty(numel, dtype=x.dtype, device=x.device)
    handle = symm_mem.rendezvous(buf, group.group_name)
    peers = tuple(buf if r == handle.rank else handle.get_buffer(r, (numel,), x.dtype) for r in range(handle.world_size))
    buf.copy_(x)
    out, cfg = torch.empty_like(x), plan(numel, len(peers), {})
    run_once = lambda: launch(peers, out, handle.signal_pad_ptrs_dev, handle.rank, **cfg,  # noqa: E731
                              group_name=group.group_name)
    for _ in range(10):  # warm up (compile)
        run_once()
    dist.barrier()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(iters):
        run_once()
    torch.cuda.synchronize()
    us = (time.perf_counter() - start) / iters * 1e6
    torch.testing.assert_close(out.float(), expected, rtol=2e-2, atol=2e-2 * dist.get_world_size())
    if dist.get_rank() == 0:
        print(f"helion one_shot_all_reduce: {numel} bf16 x {len(peers)} ranks: matches NCCL, {us:.1f} us per call "
              f"(eager launches; {cfg})")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
