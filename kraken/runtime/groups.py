"""Process groups, argument checks and the signal pad's budget: what every recipe checks on the host,
before any launch, raising ``ValueError``/``TypeError`` that name the problem.

* groups: ``resolve_group`` (a group, its name, or the default group) and ``world_size_of`` (checked
  to be one NVLink domain, 1 to 8 ranks);
* inputs: ``check_tensor`` (type, dtype, layout, device) and ``resolve_config`` (a recipe's defaults
  overridden by the caller's config);
* the signal-pad budget: ``max_barrier_blocks`` and ``check_barrier_blocks`` (a barrier uses
  ``world_size`` slots of the pad per block id), ``persistent_grid`` sized from it;
* integer helpers for plans: ``cdiv``, ``round_up``, ``next_power_of_2``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed._symmetric_memory as symm_mem

from kraken._ptx_utils.symm_mem_barrier import SIGNAL_SLOT_BYTES, barrier_blocks

SUPPORTED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
MIN_WORLD_SIZE = 1  # a group of one runs the same kernels with a peer set of one (itself)
MAX_WORLD_SIZE = 8


# ---------------------------------------------------------------------------
# Process groups
# ---------------------------------------------------------------------------


def resolve_group(group: dist.ProcessGroup | str | None, op: str) -> dist.ProcessGroup:
    """The process group to use: ``group``, a group name, or the default group."""
    if not dist.is_available() or not dist.is_initialized():
        raise ValueError(f"{op}: torch.distributed is not initialized; call dist.init_process_group first")
    if group is None:
        return dist.group.WORLD
    if isinstance(group, str):
        for pg, name in dist.distributed_c10d._world.pg_names.items():
            if name == group:
                return pg
        raise ValueError(f"{op}: no process group is named {group!r}")
    if not isinstance(group, dist.ProcessGroup):
        raise TypeError(f"{op}: group must be a ProcessGroup, a group name or None, got {type(group).__name__}")
    return group


def world_size_of(group: dist.ProcessGroup | str | None, op: str) -> int:
    """The group's size, checked to be one this project supports (1..8)."""
    world_size = dist.get_world_size(resolve_group(group, op))
    check_world_size(world_size, op)
    return world_size


def check_world_size(world_size: int, op: str) -> None:
    if not MIN_WORLD_SIZE <= world_size <= MAX_WORLD_SIZE:
        raise ValueError(
            f"{op}: needs a group of {MIN_WORLD_SIZE} to {MAX_WORLD_SIZE} ranks (one NVLink domain), "
            f"got world size {world_size}"
        )


# ---------------------------------------------------------------------------
# Input validation
# ---------------------------------------------------------------------------


def check_tensor(
    tensor: object,
    name: str,
    op: str,
    dtypes: tuple[torch.dtype, ...] = SUPPORTED_DTYPES,
    ndim: int | None = None,
) -> None:
    """Type, dtype, layout and device checks for one tensor argument."""
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{op}: {name} must be a torch.Tensor, got {type(tensor).__name__}")
    if tensor.dtype not in dtypes:
        allowed = ", ".join(str(d).removeprefix("torch.") for d in dtypes)
        raise ValueError(f"{op}: {name} has dtype {str(tensor.dtype).removeprefix('torch.')}; supported: {allowed}")
    if ndim is not None and tensor.dim() != ndim:
        raise ValueError(f"{op}: {name} must be {ndim}-D, got shape {tuple(tensor.shape)}")
    if not tensor.is_contiguous():
        raise ValueError(f"{op}: {name} must be contiguous (got strides {tensor.stride()}); call .contiguous() first")
    if tensor.device.type != "cuda":
        raise ValueError(f"{op}: {name} must be on a CUDA device, got {tensor.device}")


# ---------------------------------------------------------------------------
# Signal-pad budget
# ---------------------------------------------------------------------------


def signal_pad_bytes() -> int:
    return symm_mem.get_signal_pad_size()


def max_barrier_blocks(world_size: int, pad_bytes: int | None = None) -> int:
    """How many block ids a barrier can use: each needs ``world_size`` slots of the pad."""
    return barrier_blocks(world_size, signal_pad_bytes() if pad_bytes is None else pad_bytes)


def check_barrier_blocks(num_blocks: int, world_size: int, op: str, pad_bytes: int | None = None) -> None:
    """Refuse a launch whose barrier would use more slots than the signal pad has."""
    limit = max_barrier_blocks(world_size, pad_bytes)
    if num_blocks > limit:
        pad_bytes = signal_pad_bytes() if pad_bytes is None else pad_bytes
        raise ValueError(
            f"{op}: the launch needs {num_blocks} barrier block ids x {world_size} ranks = "
            f"{num_blocks * world_size} signal slots, but the {pad_bytes}-byte signal pad holds "
            f"{pad_bytes // SIGNAL_SLOT_BYTES} ({limit} block ids at world size {world_size}); lower the "
            "block count or call torch.distributed._symmetric_memory.set_signal_pad_size() before the "
            "first symmetric allocation"
        )


def persistent_grid(num_tiles: int, max_blocks: int, world_size: int) -> int:
    """Blocks for a persistent kernel: at most one per tile, ``max_blocks``, and the pad's budget."""
    return max(1, min(num_tiles, max_blocks, max_barrier_blocks(world_size)))


def resolve_config(config: dict, defaults: dict, op: str) -> dict:
    """``defaults`` overridden by ``config``; unknown keys are a TypeError."""
    unknown = set(config) - set(defaults)
    if unknown:
        raise TypeError(f"{op}: unknown config keys {sorted(unknown)}; known: {sorted(defaults)}")
    return {**defaults, **config}


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def round_up(a: int, multiple: int) -> int:
    return cdiv(a, multiple) * multiple


def next_power_of_2(n: int) -> int:
    """``triton.next_power_of_2`` for the per-call launch path: triton 3.6 makes that a ``constexpr_function``,
    whose host call unwraps its arguments through a list and a dict (about 2 us a call on the GPU hosts)."""
    return 1 << (n - 1).bit_length() if n > 0 else 1
