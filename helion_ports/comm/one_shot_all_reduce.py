"""Helion twin of ``kraken.comm.one_shot_all_reduce``: same function, same arguments.

The structure mirrors the Triton recipe one to one:

* ``hl.grid(num_blocks)`` is the persistent grid; the grid index is the
  barrier's block id, identical on every rank;
* the barriers are the kraken PTX, pasted in with ``hl.inline_triton``
  (``kraken._ptx_utils.inline_source``), not ``hl.signal``/``hl.wait``;
* the peer buffers arrive as one tuple and are walked with
  ``hl.static_range(world_size)``, which Helion unrolls into plain loads.

Set ``HELION_PRINT_OUTPUT_CODE=1`` to see the generated Triton.
"""

from __future__ import annotations

import functools

import helion
import helion.language as hl
import torch
import torch.distributed as dist

from helion_ports import flat_kernel, flat_view, run, stage, views
from kraken._ptx_utils.inline_source import SYMM_MEM_SYNC
from kraken.comm.one_shot_all_reduce import plan  # noqa: F401 (shared with the Triton recipe)
from kraken.runtime.collectives import prepare, prepare_call  # noqa: F401 (the recipe's prepared calls, shared)
from kraken.runtime import staging
from kraken.runtime.launcher import jit_launch

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
        # that waited on the first ones: a second NVLink round trip per call (about 0.7 us).
        for tile in hl.tile(start, min(start + chunk, numel)):
            acc = hl.zeros([tile], dtype=torch.float32)
            for r in hl.static_range(world_size):
                acc = acc + hl.load(peers[r], [tile]).to(torch.float32)
            hl.store(out, [tile], acc.to(out.dtype))
        hl.inline_triton(SYNC_END, args=barrier, output_like=None)
    return out


@functools.cache
def compiled(block_size: int, num_warps: int) -> helion.Kernel:
    """One Helion kernel per launch configuration, each with an explicit config.

    ``pid_type="flat"``: the recipe's grid, one program per block (see ``helion_ports``).
    """
    return flat_kernel(one_shot_all_reduce_body, (block_size,), num_warps)


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
    launcher=jit_launch,
    x: torch.Tensor | None = None,
) -> torch.Tensor:
    """Launch on prepared arguments (no checks); mirrors ``kraken.comm.one_shot_all_reduce.launch`` (an ordinary
    ``x`` is staged by a copy launch: ``helion_ports.stage``)."""
    if x is not None:
        stage(peers, rank, x, group_name, launcher)
    flat_peers = views(peers, -1)
    args = (flat_peers, flat_view(out), signal_pad_ptrs, num_blocks, chunk, rank, len(peers), group_name)
    run(compiled(block_size, num_warps), args, launcher)
    return out


def one_shot_all_reduce(
    tensor: torch.Tensor, group: dist.ProcessGroup | str | None = None, **config
) -> torch.Tensor:
    """Sum ``tensor`` over the group; returns a new tensor (see the kraken recipe)."""
    ctx, launch_cfg, staged = prepare_call(tensor, group, "helion one_shot_all_reduce", config)
    return staging.launched(launch, ctx, launch_cfg, staged, tensor, torch.empty_like(tensor))
