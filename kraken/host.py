"""Host-side helpers shared by every kraken kernel and every Helion port.

* symmetric buffers: ``symm_empty`` allocates and rendezvouses one;
  ``symm_context`` turns a symmetric tensor into what a kernel needs (rank,
  world size, the peer-buffer tuple, the signal-pad pointer array), cached so the
  per-call cost is a dictionary lookup;
* the signal-pad budget: ``max_barrier_blocks`` and ``check_barrier_blocks``;
* input validation that raises ``ValueError``/``TypeError`` on the host, before
  any launch, naming the problem.

Validate locally, agree globally (``agreed``): every recipe runs its argument
checks on each rank, and on the first call of each call signature (every
argument's shape, dtype and value) the ranks exchange (signature, verdict)
once, so a mistake on one rank raises on every rank, naming the rank and its
message, and ranks that pass different shapes all raise too. The first time a
buffer is seen, the ranks also exchange its shape and dtype once
(``dist.all_gather_object``). A mistake made on one rank only *after* its
signature was agreed (say, a non-symmetric tensor on rank 1 alone) cannot be
detected without a collective per call; that rank raises alone and the others
wait for it.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import functools
from dataclasses import dataclass, field, replace
import math
import os
import sys
import threading
import time
from typing import Callable, Iterator, NamedTuple

import torch
import torch.distributed as dist
import torch.distributed._symmetric_memory as symm_mem
from torch.utils._python_dispatch import TorchDispatchMode
from triton import knobs
from triton.runtime import _allocation
from triton.tools.tensor_descriptor import TensorDescriptor

from kraken._ptx_utils import timeout

SUPPORTED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
MIN_WORLD_SIZE = 1  # a group of one runs the same kernels with a peer set of one (itself)
MAX_WORLD_SIZE = 8
SIGNAL_SLOT_BYTES = 4  # one uint32 per (block id, peer)


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
    pad_bytes = signal_pad_bytes() if pad_bytes is None else pad_bytes
    return pad_bytes // SIGNAL_SLOT_BYTES // world_size


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


# ---------------------------------------------------------------------------
# Symmetric buffers
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class SymmContext:
    """What a kernel needs to reach a symmetric tensor on every rank."""

    rank: int
    world_size: int
    group_name: str
    peers: tuple[torch.Tensor, ...]  # peers[r]: rank r's copy, same shape and dtype (peers[rank] is local)
    signal_pad_ptrs: int  # device address of uint64[world_size]: every rank's signal pad


_contexts: dict[tuple, SymmContext] = {}


def _agree(signature: tuple, group: dist.ProcessGroup, op: str, verdict: tuple[str, str] | None = None) -> None:
    """Every rank sends (``signature``, its ``verdict``: None, or the (type, message) of its local
    error) and all raise the same error if any rank failed or the signatures differ (a collective)."""
    if torch.cuda.is_current_stream_capturing():
        return  # no collectives inside a capture; first calls happen in eager warm-up
    seen = [None] * dist.get_world_size(group)
    dist.all_gather_object(seen, (signature, verdict), group=group)
    failed = {r: v for r, (_, v) in enumerate(seen) if v is not None}
    disagree = "" if all(s == signature for s, _ in seen) else (
        f"ranks disagree on the input's shape/dtype ({_differences([s for s, _ in seen])})")
    if failed:
        types = {kind for kind, _ in failed.values()}
        by_message: dict[str, list[int]] = {}
        for r, (_, message) in failed.items():
            by_message.setdefault(message, []).append(r)
        text = "; ".join(f"rank{'s' if len(rs) > 1 else ''} {', '.join(map(str, rs))}: {m}" for m, rs in by_message.items())
        error = TypeError if types == {"TypeError"} and not disagree else ValueError
        raise error(f"{op}: bad input on {text}" + (f"; and {disagree}" if disagree else ""))
    if disagree:
        raise ValueError(f"{op}: {disagree}")


def _differences(signatures: list) -> str:
    """What differs between the ranks' signatures: per differing argument, every rank's value."""
    if not all(isinstance(s, tuple) and all(isinstance(p, tuple) and len(p) == 2 for p in s) for s in signatures):
        return "; ".join(f"rank {r}: {s}" for r, s in enumerate(signatures))
    per_rank = [dict(s) for s in signatures]
    names = list(dict.fromkeys(name for d in per_rank for name in d))
    differing = [n for n in names if len({repr(d.get(n)) for d in per_rank}) > 1]
    return "; ".join(f"{n}: " + ", ".join(f"rank {r} {d.get(n)}" for r, d in enumerate(per_rank)) for n in differing)


def signature_of(value: object) -> object:
    """What the ranks compare of one argument: a tensor's shape, dtype, device type and contiguity, a
    scalar's value, a container's items; anything else, its type's name."""
    if isinstance(value, torch.Tensor):
        return ("tensor", tuple(value.shape), str(value.dtype).removeprefix("torch."), value.device.type,
                value.is_contiguous())
    if isinstance(value, (bool, int, float, str, type(None))):
        return value
    if isinstance(value, torch.dtype):
        return str(value)
    if isinstance(value, (tuple, list)):
        return tuple(signature_of(v) for v in value)
    if isinstance(value, dict):
        return tuple(sorted((str(k), signature_of(v)) for k, v in value.items()))
    return type(value).__name__


last_op = "none yet"  # the op whose arguments were last checked on this rank: named by a barrier timeout


@contextlib.contextmanager
def agreed(op: str, group: dist.ProcessGroup | str | None, **arguments) -> Iterator[None]:
    """Validate locally, agree globally: run the local checks in the ``with`` body (no collectives
    there), and on the first call of this call signature (``arguments`` through ``signature_of``) every
    rank exchanges (signature, its verdict) once. If any rank's checks raised, every rank raises one
    error naming each failing rank and its message (a TypeError if all of them were TypeErrors, else
    a ValueError); if the signatures differ, every rank raises naming what differs. After an agreed
    success the same signature costs a set lookup.

    What this cannot see: a rank whose signature was agreed before and that fails alone later skips
    the exchange, as the others do; it raises its own error locally, and the others go on alone.
    """
    if not dist.is_available() or not dist.is_initialized():
        yield  # no group to agree in: the checks' own error, if any, then the missing group's
        resolve_group(group, op)
        return
    global last_op
    last_op = op
    arm_barrier_timeout()
    pg = resolve_group(group, op)  # a bad group raises here, alike on every rank: nothing to agree over
    signature = tuple((name, signature_of(value)) for name, value in arguments.items())
    key = (op, signature, pg.group_name)
    try:
        yield
    except (TypeError, ValueError) as exc:
        if key in _agreed:
            raise
        _agree(signature, pg, op, (type(exc).__name__, str(exc).removeprefix(f"{op}: ")))
        raise  # inside a CUDA graph capture nothing is exchanged: the local error stands
    if key not in _agreed:
        _agree(signature, pg, op)
        _agreed.add(key)


_agreed: set[tuple] = set()


def agree_once(signature: tuple, group: dist.ProcessGroup | str | None, op: str) -> None:
    """``_agree`` the first time this process sees ``signature`` from ``op`` in ``group`` (a collective
    then; a set lookup after). A failed agreement is not remembered: the next call checks again."""
    pg = resolve_group(group, op)
    key = (op, signature, pg.group_name)
    if key not in _agreed:
        _agree(signature, pg, op)
        _agreed.add(key)


def symm_context(
    tensor: torch.Tensor, group: dist.ProcessGroup | str | None, op: str, name: str = "tensor"
) -> SymmContext:
    """Validate the group and rendezvous ``tensor`` (a view into a symmetric allocation)."""
    arm_barrier_timeout()
    pg = resolve_group(group, op)
    world_size = dist.get_world_size(pg)
    check_world_size(world_size, op)
    key = (
        tensor.data_ptr(),
        tensor.untyped_storage()._cdata,
        tuple(tensor.shape),
        tensor.dtype,
        pg.group_name,
    )
    ctx = _contexts.get(key)
    if ctx is not None:
        return ctx
    _agree((name, tuple(tensor.shape), str(tensor.dtype)), pg, op)
    try:
        handle = symm_mem.rendezvous(tensor, pg.group_name)
    except RuntimeError:
        handle = None  # older torch raises; torch 2.11 warns and returns None
    if handle is None:
        raise ValueError(
            f"{op}: {name} is not in symmetric memory; allocate it with kraken.symm_empty(...) "
            "(or torch.distributed._symmetric_memory.empty)"
        )
    rank = handle.rank
    offset_bytes = tensor.data_ptr() - handle.buffer_ptrs[rank]
    offset = offset_bytes // tensor.element_size()
    if offset_bytes < 0 or tensor.data_ptr() + tensor.numel() * tensor.element_size() > (
        handle.buffer_ptrs[rank] + handle.buffer_size
    ):
        raise ValueError(f"{op}: {name} does not lie inside its symmetric allocation")
    peers = tuple(
        tensor if r == rank else handle.get_buffer(r, tuple(tensor.shape), tensor.dtype, offset)
        for r in range(world_size)
    )
    ctx = SymmContext(rank, world_size, pg.group_name, peers, handle.signal_pad_ptrs_dev)
    _contexts[key] = ctx
    return ctx


def symm_empty(
    shape: int | tuple[int, ...],
    dtype: torch.dtype = torch.bfloat16,
    device: torch.device | int | None = None,
    group: dist.ProcessGroup | str | None = None,
) -> torch.Tensor:
    """A tensor in symmetric memory, already rendezvoused with ``group`` (collective)."""
    shape = (shape,) if isinstance(shape, int) else tuple(shape)
    device = torch.device("cuda", torch.cuda.current_device()) if device is None else torch.device(device)
    tensor = symm_mem.empty(shape, dtype=dtype, device=device)
    symm_context(tensor, group, "symm_empty")
    return tensor


_workspaces: dict[tuple, torch.Tensor] = {}


def symm_workspace(
    numel: int, dtype: torch.dtype, device: torch.device, group: dist.ProcessGroup | str | None, op: str
) -> torch.Tensor:
    """A cached symmetric scratch buffer of at least ``numel`` elements (collective on first use).

    Kernels that take ordinary tensors stage them here. One workspace per
    (device, dtype, group); it grows by powers of two and is shared by all ops.
    The first request of each size is checked across ranks *before* the buffer
    may grow: growing is a collective, and a rank that grows alone would hang.
    """
    pg = resolve_group(group, op)
    agree_once(("workspace elements", numel, str(dtype)), pg, op)
    key = (device, dtype, pg.group_name)
    buf = _workspaces.get(key)
    if buf is None or buf.numel() < numel:
        size = 1 << max(12, math.ceil(math.log2(max(numel, 1))))
        buf = symm_empty(size, dtype, device, pg)
        _workspaces[key] = buf
    return buf[:numel]


_symmetric_storages: tuple[int, frozenset] = (0, frozenset())  # (len(_contexts) when built, their storages)


def is_symmetric(tensor: object) -> bool:
    """Whether ``tensor`` lies in a symmetric allocation that ``symm_context`` has rendezvoused (every
    ``symm_empty`` tensor, and any view of one a recipe took before): a storage lookup, about 0.3 us, no
    collective. A symmetric tensor that torch allocated and no recipe has seen yet reads False; a recipe
    then stages it as it stages an ordinary tensor (correct, one copy more). The storages stay alive
    (``_contexts`` holds them), so their ids are never reused by an ordinary tensor's."""
    global _symmetric_storages
    built, storages = _symmetric_storages
    if built != len(_contexts):
        storages = frozenset(key[1] for key in _contexts)
        _symmetric_storages = (len(_contexts), storages)
    return isinstance(tensor, torch.Tensor) and tensor.untyped_storage()._cdata in storages


# ---------------------------------------------------------------------------
# Block-owned, double-buffered symmetric workspace (kernels with no trailing barrier)
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class BlockWorkspace:
    """A symmetric buffer cut into two halves of ``num_chunks`` chunks of ``chunk_bytes`` each.

    Block ``b`` of a kernel only ever writes chunk ``b`` of half ``parity[b]`` (its
    own, or every rank's when it pushes) and flips ``parity[b]`` when it finishes;
    a chunk is read only by block ``b`` of a rank. A launch therefore writes the half
    that the previous launch of block ``b`` did not, and the launch before that is
    finished on every rank: each launch passes at least one barrier with every peer,
    and a peer's kernel starts only after its previous one ended. No "done reading"
    barrier at the end of a kernel, whatever the shapes and grids of the launches in
    between.

    The buffer's signal pad belongs to ``epoch_sync`` alone: block ``b``'s barrier
    rounds are numbered ``epochs[b] + 1, + 2, ...`` and the block adds its rounds to
    ``epochs[b]`` when it finishes (every rank runs block ``b`` the same rounds).
    """

    flat: SymmContext  # peers: every rank's whole buffer, uint8
    parity: torch.Tensor  # int32[>= num_chunks: a block id of the pad each], local; which half block b writes next
    epochs: torch.Tensor  # int32[>= num_chunks], local; barrier rounds block b has completed
    num_chunks: int
    chunk_bytes: int

    _contexts: dict = field(default_factory=dict, compare=False, repr=False)

    def context(self, dtype: torch.dtype, tile: tuple[int, ...]) -> SymmContext:
        """The workspace as a kernel takes it: ``peers[r]`` is rank r's buffer viewed as
        [2, num_chunks, tiles per chunk, *tile] of ``dtype`` (strided: chunks keep their byte size)."""
        key = (dtype, tile)
        if key not in self._contexts:
            tile_elems = math.prod(tile)
            chunk_elems = self.chunk_bytes // dtype.itemsize
            shape = (2, self.num_chunks, chunk_elems // tile_elems, *tile)
            tile_strides = tuple(math.prod(tile[i + 1:]) for i in range(len(tile)))
            strides = (self.num_chunks * chunk_elems, chunk_elems, tile_elems, *tile_strides)
            peers = tuple(p.view(dtype).as_strided(shape, strides) for p in self.flat.peers)
            self._contexts[key] = replace(self.flat, peers=peers)
        return self._contexts[key]


_block_workspaces: dict[tuple, BlockWorkspace] = {}
_retired: list[BlockWorkspace] = []  # outgrown buffers: a peer may still be reading one, so never freed


def block_workspace(
    chunk_bytes: int, device: torch.device, group: dist.ProcessGroup | str | None, op: str
) -> BlockWorkspace:
    """The cached ``BlockWorkspace`` of (device, group), with chunks of at least ``chunk_bytes`` (collective
    when it grows; each new request size is first checked across ranks, as in ``symm_workspace``)."""
    pg = resolve_group(group, op)
    key = (device, pg.group_name)
    ws = _block_workspaces.get(key)
    if ws is not None and ws.chunk_bytes >= chunk_bytes:
        return ws
    agree_once(("block workspace bytes", chunk_bytes), pg, op)
    num_chunks = torch.cuda.get_device_properties(device).multi_processor_count
    # Parity and epoch for every block id the pad has (more than chunks in a group of one, where a kernel may run
    # more blocks than SMs, each touching no chunk: gemm_one_shot_all_reduce's one tile per block).
    num_ids = max(num_chunks, max_barrier_blocks(pg.size()))
    size = 1 << max(16, math.ceil(math.log2(chunk_bytes)))
    if ws is not None:
        _retired.append(ws)
        size = max(size, 2 * ws.chunk_bytes)
    buf = symm_mem.empty(2 * num_chunks * size, dtype=torch.uint8, device=device)
    parity = torch.zeros(num_ids, dtype=torch.int32, device=device)
    epochs = torch.zeros(num_ids, dtype=torch.int32, device=device)  # the new pad's slots are all 0
    ws = BlockWorkspace(symm_context(buf, pg, op, name="block workspace"), parity, epochs, num_chunks, size)
    _block_workspaces[key] = ws
    return ws


_local_pads: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}


def local_barrier_pads(device: torch.device) -> int:
    """Signal pads for a barrier between blocks of one GPU, as ``symm_mem_sync`` takes them.

    ``symm_mem_sync(pads, group, party, parties)`` then synchronises ``parties``
    (<= 8) blocks of the same launch on this GPU, ``group`` < the SM count: the
    same CAS slots and self-resetting protocol as the cross-GPU barrier, with
    "party" in the role of rank. Returns the device address of the pointer array.
    """
    if device not in _local_pads:
        num_sms = torch.cuda.get_device_properties(device).multi_processor_count
        pads = torch.zeros(MAX_WORLD_SIZE, num_sms * MAX_WORLD_SIZE, dtype=torch.int32, device=device)
        ptrs = torch.tensor([row.data_ptr() for row in pads], dtype=torch.int64, device=device)
        _local_pads[device] = (pads, ptrs)
    return _local_pads[device][1].data_ptr()


_scratch: dict[tuple, torch.Tensor] = {}


def local_scratch(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A cached uninitialised local tensor of ``shape`` (one per device and dtype; grows, never shrinks)."""
    numel = math.prod(shape)
    buf = _scratch.get((device, dtype))
    if buf is None or buf.numel() < numel:
        buf = torch.empty(numel, dtype=dtype, device=device)
        _scratch[(device, dtype)] = buf
    return buf[:numel].view(shape)


# ---------------------------------------------------------------------------
# Barrier timeout, on by default (KRAKEN_BARRIER_TIMEOUT_S: unset 300 s, 0 or "off" off): the host half of
# kraken._ptx_utils.timeout. The first recipe call of a process (``agreed``, ``symm_context``) arms it on a GPU.
# ---------------------------------------------------------------------------

TIMEOUT_EXIT_CODE = 75
_armed = False


def _map_report_page() -> None:
    """Host memory at ``timeout.REPORT_ADDRESS`` that the GPU writes to at the same address."""
    from cuda.bindings import runtime as cudart  # torch's own dependency

    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    prot, flags = 0x1 | 0x2, 0x02 | 0x20 | 0x100000  # read|write; private|anonymous|fixed, no replace
    address = libc.mmap(timeout.REPORT_ADDRESS, timeout.REPORT_BYTES, prot, flags, -1, 0)
    if address != timeout.REPORT_ADDRESS:
        raise RuntimeError(f"{timeout.ENV}: could not map the barrier timeout's report page at "
                           f"{timeout.REPORT_ADDRESS:#x} (got {address}, errno {ctypes.get_errno()}); set "
                           f"{timeout.ENV}=0 to run without the barrier timeout")
    ctypes.memset(address, 0, timeout.REPORT_BYTES)
    (err,) = cudart.cudaHostRegister(address, timeout.REPORT_BYTES, cudart.cudaHostRegisterMapped)
    err2, device_address = cudart.cudaHostGetDevicePointer(address, 0)
    if err != cudart.cudaError_t.cudaSuccess or err2 != cudart.cudaError_t.cudaSuccess or device_address != address:
        raise RuntimeError(f"{timeout.ENV}: the GPU cannot write the barrier timeout's report page at its host "
                           f"address ({err}, {err2}, device address {device_address}); set {timeout.ENV}=0 to run "
                           "without the barrier timeout")


def barrier_timeout_report(words: list[int]) -> str | None:
    """The message for a report page's first five words, or None if no barrier gave up: the op last checked on
    this rank (``last_op``), the barrier, the block, and for a signal the rank and the peer that did not arrive
    (ranks in the op's group); this process's global rank; and how to turn the timeout off."""
    magic, barrier, block, rank, peer = words[:5]
    if magic != timeout.REPORT_MAGIC:
        return None
    who = "" if rank == timeout.NONE else f" on rank {rank}, waiting for rank {peer}"
    process = f" (global rank {dist.get_rank()})" if dist.is_available() and dist.is_initialized() else ""
    return (f"kraken: a barrier gave up after {timeout.TIMEOUT_S:g} s ({timeout.ENV}) in block {block}{who}: "
            f"{timeout.BARRIERS.get(barrier, f'barrier {barrier}')}. The last op checked on this rank was "
            f"{last_op!r}; a peer that never made the matching call (or crashed) is the usual cause. The kernel "
            f"trapped, so this process's CUDA context is unusable: exiting{process}. The timeout is on by default: "
            f"set {timeout.ENV}=0 to turn it off, or to more seconds to wait longer.")


_reported = threading.Lock()


def _report_once() -> bool:
    """Print the report page's message, if a barrier gave up, once per process; True if there is one."""
    message = barrier_timeout_report(list((ctypes.c_uint32 * 5).from_address(timeout.REPORT_ADDRESS)))
    if message and _reported.acquire(blocking=False):
        print(message, file=sys.stderr, flush=True)
    return message is not None


def _watch_report_page() -> None:
    while not _report_once():
        time.sleep(0.05)
    os._exit(TIMEOUT_EXIT_CODE)


def arm_barrier_timeout() -> None:
    """With the timeout on (the default), map the report page and start the watchdog thread that prints a
    barrier's report and exits the process (once per process, before the first launch). Off, or without a GPU,
    nothing."""
    global _armed
    if _armed or not timeout.TIMEOUT_S or not torch.cuda.is_available():
        return
    _map_report_page()
    threading.Thread(target=_watch_report_page, name="kraken-barrier-timeout", daemon=True).start()
    atexit.register(_report_once)  # the main thread may die of the trap's CUDA error before the watchdog looks
    _armed = True


# ---------------------------------------------------------------------------
# The host fast path: a prepared call per signature, launched through the compiled kernel
# ---------------------------------------------------------------------------

MAX_PREPARED = 256  # prepared calls kept per recipe; past that the cache starts over (a bound, not a tuning)


def tensor_key(tensor: object, address: bool = False) -> object:
    """What a prepared call may depend on of one argument: a tensor's shape, strides, dtype, device and whether
    its address is 16-byte aligned (Triton specialises kernels on it, TMA needs it), and with ``address`` the
    address itself (symmetric tensors: their peers are found from it); anything else as it is."""
    if not isinstance(tensor, torch.Tensor):
        return tensor
    ptr = tensor.data_ptr()  # one call, and flat tuples: this runs on every call (half the time of the nested form)
    if address:  # the address says its alignment
        return (tensor.shape, tensor.stride(), tensor.dtype, tensor.device, ptr)
    return (tensor.shape, tensor.stride(), tensor.dtype, tensor.device, ptr % 16 == 0)


def scalar_key(value: object) -> tuple:
    """A scalar argument in a key, with its type: ``1``, ``1.0`` and ``True`` are equal and hash alike in
    Python, but a check may accept one and refuse another (``eps=True`` is refused)."""
    return (type(value), value)


def config_key(config: dict) -> tuple:
    """A ``**config`` in a key: each item with its value's type (see ``scalar_key``)."""
    if not config:  # the common call: no generator to run
        return ()
    return tuple((name, type(value), value) for name, value in config.items())


def symmetric_key(tensor: torch.Tensor, group, op: str, config: dict) -> tuple:
    """``per_signature``'s key for a ``prepare(tensor, group, op, config)`` of one symmetric tensor."""
    return (op, group, tensor_key(tensor, address=True), config_key(config))


def per_signature(key: Callable[..., tuple]) -> Callable:
    """Decorate a recipe's ``prepare``: its result is kept per ``key(*args)`` and returned by later calls
    with the same key, with no check, collective or plan (the first call of each key ran them all, and a
    call that raised is not kept). ``key`` must hold everything ``prepare`` reads (``tensor_key`` of each
    tensor, ``scalar_key`` of each scalar, ``config_key`` of the config, the group, the op); a key that cannot
    be hashed (say, a list in the config) just skips the cache. The result is shared by every later call:
    treat it as read-only (change a launch argument in a copy: ``launch(**{**cfg, "out": mine})``).
    ``prepare.cache`` is the dictionary, ``prepare.uncached`` the original."""

    def decorate(prepare: Callable) -> Callable:
        cache: dict = {}

        @functools.wraps(prepare)
        def cached(*args):
            try:
                signature = key(*args)
                prepared = cache.get(signature)
            except TypeError:  # unhashable: a bad argument (prepare says so) or a list in the config
                return prepare(*args)
            if prepared is None:
                prepared = prepare(*args)
                if len(cache) >= MAX_PREPARED:
                    cache.clear()
                cache[signature] = prepared
            return prepared

        cached.cache, cached.uncached = cache, prepare
        _prepared_caches.append(cache)
        return cached

    return decorate


_prepared_caches: list[dict] = []


def forget_prepared_calls() -> None:
    """Empty every recipe's cache of prepared calls (the next call of each signature checks and agrees again);
    for tests, and for a process that destroys and recreates its process groups."""
    for cache in _prepared_caches:
        cache.clear()


def _triton_scratch(size: int, alignment: int, stream) -> torch.Tensor:
    """Triton's allocator protocol: global scratch for a launch (device-built TMA descriptors live there)."""
    return torch.empty(size, dtype=torch.int8, device="cuda")


@contextlib.contextmanager
def scratch_allocator() -> Iterator[None]:
    """Triton's allocator for the launches within (``triton.set_allocator``, undone after, so that a recipe sets no
    process-wide state): kernels that build TMA descriptors on the device get their global scratch from torch."""
    token = _allocation._allocator.set(_triton_scratch)
    try:
        yield
    finally:
        _allocation._allocator.reset(token)


class Address:
    """A device address where a launch wants an object with ``data_ptr()`` (a replayed descriptor's base)."""

    __slots__ = ("ptr",)

    def __init__(self, ptr: int):
        self.ptr = ptr

    def data_ptr(self) -> int:
        return self.ptr


class TmaOperand(NamedTuple):
    """A host tensor descriptor's fields, as a recipe passes them to its launcher (``tma_operand``): what the
    launch reads of one (``tensor_maps``, Triton's ``make_tensordesc_arg``) without ``TensorDescriptor``'s
    checks on every call (3.4 us a descriptor on the CI CPU, two or three per GEMM launch); ``jit_launch`` makes
    it a ``TensorDescriptor`` (checked, and what the JIT specialises on) for the launches that bind. A replayed
    twin's descriptor (``Replay``) has an ``Address`` for its base: it only goes to compiled launches."""

    base: torch.Tensor | Address
    shape: tuple
    strides: tuple
    block_shape: list
    padding: str = "zero"


def tma_operand(tensor: torch.Tensor, block_shape: list[int]) -> TmaOperand:
    """``TensorDescriptor.from_tensor(tensor, block_shape)``'s fields (see ``TmaOperand``)."""
    return TmaOperand(tensor, tensor.shape, tensor.stride(), block_shape)


def jit_launch(kernel, grid: tuple[int, ...], *args, **meta):
    """``kernel[grid](*args, **meta)``: Triton's own launch path (binds, specialises, finds the compiled kernel).
    The default ``launcher`` of every recipe's ``launch``; ``Launcher`` is the cached one."""
    args = tuple(TensorDescriptor(*arg) if type(arg) is TmaOperand else arg for arg in args)
    with scratch_allocator():
        return kernel[grid](*args, **meta)


def launch_hooked() -> bool:
    """Whether a Triton launch enter/exit hook is installed (triton 3.6 keeps them in always-present chains)."""
    enter, exit_ = knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook
    return bool(getattr(enter, "calls", enter) or getattr(exit_, "calls", exit_))


class Launcher:
    """Launches one prepared call's kernels, with the ``launcher(kernel, grid, *args, **meta)`` protocol of
    ``jit_launch`` and of Helion's generated host code (its ``_launcher`` argument).

    The first launch of each kernel goes through Triton's JIT (compile or cache lookup, argument binding);
    it returns the ``CompiledKernel``, and later launches call its launcher directly with the arguments laid
    out as the JIT lays them out (the kernel's parameters in order, constexprs included). That skips about
    15 us of binding per call. It is exact because every launch of a prepared call has the same
    specialisation: its ints come from the plan (fixed by the signature), its tensors' dtypes and 16-byte
    alignment are in the signature's key (``tensor_key``). While a Triton launch hook is set (a profiler
    such as proton), every launch takes the JIT path, so the hook sees it. Helion kernels keep their bound
    kernel here too (``helion_ports.run``).

    Where the kernel needs no scratch memory, the launch goes one step further down, to the C function of
    triton 3.6's ``CudaLauncher`` (``launch``), with the arguments its ``__call__`` would add (no scratch
    buffers); any other launcher object is called as the JIT calls it.
    """

    def __init__(self, op: str):
        self.op = op
        # Keyed by id(kernel): kernels live as long as their modules, and JITFunction's __hash__ is Python code.
        # id(JIT kernel) -> (launch function, arguments before the kernel's, tensor descriptors, constexprs)
        self.compiled: dict = {}
        self.bound: dict = {}  # id(Helion kernel) -> its BoundKernel for this call's specialisation
        # id(Helion kernel), or a whole call's ``launch`` function (``replayed``) -> its Replay, or None where it
        # cannot replay
        self.replays: dict = {}
        self.recording: Recording | None = None  # what ``record_replay`` watches, while it runs (on one thread)

    def __call__(self, kernel, grid: tuple[int, ...], *args, **meta):
        global last_op
        last_op = self.op
        recording = self.recording
        if recording is not None and recording.here():  # record_replay: noted, then launched as below
            return recording.launch(self, kernel, grid, args, meta)
        hit = self.compiled.get(id(kernel))
        grid_y, grid_z = (grid[1] if len(grid) > 1 else 1), (grid[2] if len(grid) > 2 else 1)
        programs = grid[0] * grid_y * grid_z
        if hit is None or launch_hooked() or programs > hit[3]:
            compiled = jit_launch(kernel, grid, *args, **meta)
            if compiled is not None and hasattr(compiled, "packed_metadata"):  # None: a CPU capture recorded it
                names, params = kernel.arg_names, kernel.params
                tail = tuple(meta.get(name, params[i].default) for i, name in enumerate(names) if i >= len(args))
                self.compiled[id(kernel)] = (*launch_function(compiled, len(args), programs), tail)
            return compiled
        self.launch_compiled(hit, grid, grid_y, grid_z, args)

    @staticmethod
    def launch_compiled(hit: tuple, grid: tuple[int, ...], grid_y: int, grid_z: int, args) -> None:
        """Launch a kernel compiled before (its entry in ``compiled``) on ``args`` as the JIT lays them out: tensors
        or their addresses (ints), host tensor descriptors or anything with their fields (``tensor_maps``)."""
        run, head, descriptors, _, tail = hit
        if descriptors:
            args = tensor_maps(args, descriptors)
        stream = torch._C._cuda_getCurrentRawStream(torch._C._cuda_getDevice())  # what Triton's driver asks too
        run(grid[0], grid_y, grid_z, stream, *head, *args, *tail)


def launch_function(compiled, num_args: int, programs: int) -> tuple[Callable, tuple, tuple, int]:
    """How ``Launcher`` launches ``compiled`` (called with ``num_args`` positional arguments, on a grid of
    ``programs``): a function, the arguments that go between (grid, stream) and the kernel's own, the tensor
    descriptors it turns into TMA maps itself (``tensor_maps``), and the most programs it serves. No launch metadata
    and no hooks (``launch_hooked`` is checked before). A kernel that needs global scratch (device-built TMA
    descriptors) gets one buffer for ``programs`` programs, kept with the launch: its launches run in stream order
    and each rewrites what it reads there first."""
    run = compiled.run
    hooks = (None, None, None)  # launch metadata, enter hook, exit hook
    scratch_size, profile_size = getattr(run, "global_scratch_size", None), getattr(run, "profile_scratch_size", None)
    if scratch_size is not None and profile_size == 0:
        scratch = None if scratch_size == 0 else _triton_scratch(programs * run.num_ctas * scratch_size, 0, None)
        head = (compiled.function, run.launch_cooperative_grid, run.launch_pdl, scratch, None, compiled.packed_metadata)
        launch, descriptors = unwrap_descriptors(run.launch, num_args)
        return launch, (*head, *hooks), descriptors, programs if scratch_size else sys.maxsize
    return run, (compiled.function, compiled.packed_metadata, *hooks), (), sys.maxsize


def unwrap_descriptors(launch: Callable, num_args: int) -> tuple[Callable, tuple]:
    """Triton 3.6 wraps the C launch function of a kernel with host tensor descriptors in a closure
    (``wrap_handle_tensordesc``) that encodes every descriptor's TMA map again on every launch (a driver call
    and a Python list per descriptor). Returns that C function and, per descriptor, (position among the
    arguments, Triton's metadata for it, a cache of its maps, the encoder), so that ``tensor_maps`` encodes a
    map once per (pointer, shape, strides). Any other launch function (no descriptors, or a wrapper of another
    shape) is returned as it is, with no descriptors."""
    code, closure = getattr(launch, "__code__", None), getattr(launch, "__closure__", None)
    if code is None or not closure or launch.__name__ != "inner":
        return launch, ()
    cells = dict(zip(code.co_freevars, (cell.cell_contents for cell in closure)))
    positions, metadata = sorted(cells.get("tensordesc_indices", ())), cells.get("tensordesc_meta")
    if not positions or not metadata or "launcher" not in cells or positions[-1] >= num_args or None in metadata:
        return launch, ()  # (no TMA metadata: the frontend decomposed the descriptors, nothing to encode)
    from triton.backends.nvidia.driver import make_tensordesc_arg as encode

    return cells["launcher"], tuple((position, meta, {}, encode) for position, meta in zip(positions, metadata))


def tensor_maps(args: tuple, descriptors: tuple) -> list:
    """``args`` with each host tensor descriptor replaced by what Triton's launch wrapper would put there (its
    TMA map, shape and strides), each map encoded once per (pointer, shape, strides, box) and then reused: a
    TMA map is those values and nothing else, passed to the kernel by value."""
    expanded = list(args)
    for position, meta, cache, encode in reversed(descriptors):  # right to left: the positions to the left stay put
        desc = expanded[position]
        key = (desc.base.data_ptr(), tuple(desc.shape), tuple(desc.strides), tuple(desc.block_shape), desc.padding)
        value = cache.get(key)
        if value is None:
            if len(cache) >= MAX_PREPARED:
                cache.clear()
            value = cache[key] = tuple(encode(desc, meta))
        expanded[position:position + 1] = value
    return expanded


# ---------------------------------------------------------------------------
# Calls of several launches, replayed from a CUDA graph per pointer set
# ---------------------------------------------------------------------------

_graphs: dict = {}  # key -> the CUDA graph of its work, or the count of its plain runs so far (NEVER: never captured)
PLAIN_RUNS = 1  # a key's plain runs before its capture: the first binds its kernels through the JIT
NEVER = -1
_capture_streams: dict[int, torch.cuda.Stream] = {}


def graphed(key: tuple, run: Callable[[], object], device: torch.device) -> None:
    """``run()``'s work on the current stream, from a CUDA graph of it kept under ``key``: captured (thread-local
    mode: other threads' CUDA calls go on) on the key's run after ``PLAIN_RUNS`` plain runs, and replayed from then
    on, one graph launch where ``run`` made a host call per launch, stream operation and copy. ``key`` must hold
    everything ``run`` reads whose value can change from call to call: a prepared call (its ``Launcher``: its
    shapes, plan and buffers) and the address of every tensor passed in. Tensors ``run`` makes itself come from the
    graph's memory pool. ``run`` goes plainly where the device is no GPU, while the current stream is being
    captured (the caller's graph takes the launches), while a Triton launch hook is set (a profiler sees every
    launch), and for a key whose capture failed. Keys past ``MAX_PREPARED`` start the cache over (after a device
    synchronisation: a graph's pool must not go back to the allocator while a replay still uses it)."""
    graph = _kept_graph(key, run, device, lambda: _captured(run))
    if graph is not None:
        graph.replay()


def _captured(run: Callable[[], object]) -> torch.cuda.CUDAGraph:
    """A CUDA graph of ``run()``'s work on the current (capture) stream, which does not run it."""
    graph = torch.cuda.CUDAGraph()
    graph.capture_begin(capture_error_mode="thread_local")
    try:
        run()
    finally:
        graph.capture_end()
    return graph


def _kept_graph(key: tuple, run: Callable[[], object], device: torch.device, capture: Callable[[], object]):
    """What ``capture()`` made of ``run``'s work under ``key`` on a capture stream of the device (``graphed``'s
    rules), or None after running ``run()`` plainly instead."""
    if device.type != "cuda" or torch._C._cuda_isCurrentStreamCapturing() or launch_hooked():
        run()
        return None
    entry = _graphs.get(key, 0)
    if not isinstance(entry, int):
        return entry
    if entry < PLAIN_RUNS:  # NEVER included
        run()
        if entry != NEVER:
            _graphs[key] = entry + 1
        return None
    if len(_graphs) >= MAX_PREPARED:  # start over
        drop_graphs()
    stream = _capture_streams.get(device.index)
    if stream is None:  # a capture needs a stream of its own: never the legacy default one
        stream = _capture_streams[device.index] = torch.cuda.Stream(device=device)
    try:
        with torch.cuda.stream(stream):
            entry = capture()
    except Exception:  # not capturable (or a real error, which the plain run raises again)
        _graphs[key] = NEVER
        run()
        return None
    _graphs[key] = entry
    return entry


def drop_graphs() -> None:
    """Forget every kept graph (``graphed``, ``forked``) once the devices that captured them are idle: when their
    cache starts over (a graph's pool must not go back to the allocator while a replay still uses it), and before a
    cache of tensors that a kept graph may read drops them (a launch's tile order or scratch buffer: a graph holds
    their addresses, not the tensors, and would read or write their memory after the allocator gave it away)."""
    if _graphs:
        for index in _capture_streams:
            torch.cuda.synchronize(index)
        _graphs.clear()


class ForkedGraph:
    """``head`` on the current stream, then ``tail`` on a side stream that follows it, captured as two CUDA graphs
    and launched with one driver call each (``launch``); the side stream's graph ends by recording an event that
    ``join`` makes the current stream wait for. The same work done plainly is a fork (an event recorded, and waited
    for), a switch to the side stream and back, and a join (another event), each a host call: here the fork and
    the join's record are event nodes of the graphs (``torch.cuda.Event(external=True)``)."""

    def __init__(self, head: Callable[[], object], tail: Callable[[], object]):
        from cuda.bindings import runtime as cudart  # torch's own dependency

        stream = torch.cuda.current_stream()  # the capture stream
        self.forked, self.joined = torch.cuda.Event(external=True), torch.cuda.Event(external=True)
        self.head = _captured(lambda: (head(), self.forked.record(stream)))
        self.tail = _captured(lambda: (self.forked.wait(stream), tail(), self.joined.record(stream)))
        self.head_exec, self.tail_exec = self.head.raw_cuda_graph_exec(), self.tail.raw_cuda_graph_exec()
        self.joined_event = self.joined.cuda_event
        self.graph_launch, self.stream_wait_event = cudart.cudaGraphLaunch, cudart.cudaStreamWaitEvent

    def launch(self, current: int, side: int) -> None:
        """Launch the head on the raw stream ``current`` and the tail on ``side``."""
        (error,) = self.graph_launch(self.head_exec, current)
        if not error:
            (error,) = self.graph_launch(self.tail_exec, side)
        if error:
            raise RuntimeError(f"kraken: cudaGraphLaunch failed: {error!r}")

    def join(self, device_index: int) -> None:
        """The device's current stream waits for the tail's last launch."""
        (error,) = self.stream_wait_event(torch._C._cuda_getCurrentRawStream(device_index), self.joined_event, 0)
        if error:
            raise RuntimeError(f"kraken: cudaStreamWaitEvent failed: {error!r}")


def forked(key: tuple, head: Callable[[], object], tail: Callable[[], object], plain: Callable[[], object],
           side: torch.cuda.Stream) -> ForkedGraph | None:
    """``head()``'s work on the current stream and ``tail()``'s on ``side`` after it, from a ``ForkedGraph`` kept
    under ``key`` (``graphed``'s rules) and launched; returns it (its ``join`` is the caller's), or None after
    running ``plain()`` instead (the same work, forked to ``side`` plainly; the caller joins it plainly too)."""
    graph = _kept_graph(key, plain, side.device, lambda: ForkedGraph(head, tail))
    if graph is not None:
        graph.launch(torch._C._cuda_getCurrentRawStream(side.device_index), side.cuda_stream)
    return graph


# ---------------------------------------------------------------------------
# Replaying a Helion kernel's generated host code (the twins' host fast path)
# ---------------------------------------------------------------------------


class _ViewsOnly(TorchDispatchMode):
    """Watches the ATen ops run inside (outside launches): ``other`` is set by any that is not a view."""

    def __init__(self):
        super().__init__()
        self.launching, self.other = False, None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not self.launching and not func.is_view and self.other is None:
            self.other = func
        return func(*args, **(kwargs or {}))


class NotReplayable(Exception):
    """A launch argument that a replay cannot derive from the call's arguments or the prepared call's tensors."""


NOT_REPLAYED = object()  # what a checked replay (``Replay.function``) returns for arguments it was not made for
NOT_YET = object()  # what ``record_replay`` returns where a launch went past the launcher (a kernel's first call)


@dataclass(frozen=True)
class Replay:
    """The launches of one call of host code (a Helion kernel's generated host code, or a recipe's or twin's whole
    ``launch`` on a prepared call: ``replayed``), as functions of the call's arguments.

    Host code turns its arguments into launches: a Triton kernel, a grid, and arguments that are the tensors given
    or views of them, host tensor descriptors on them, the prepared call's own tensors (``keep``: its peers and
    workspaces), and sizes, strides and scalars. Under one prepared call everything but the arguments' addresses is
    fixed (its key holds every tensor's shape, strides and dtype, and every scalar), so ``record_replay`` runs the
    host code once, watching what it launches, and keeps each launch argument as a constant (a kept tensor as its
    address) or as (argument, byte offset into it). Its ``function()`` launches the same compiled kernels
    (as ``Launcher.launch_compiled`` does) with each tensor as its address (the C launch function takes an int where it
    takes a tensor, and then skips the tensor's ``data_ptr()`` and the driver's pointer check) and each descriptor
    as a ``TmaOperand`` on an ``Address``: no host code, no views, no descriptor objects. With ``checked``, a call
    whose scalars or top-level shapes differ from the recorded ones returns ``NOT_REPLAYED``, and the caller runs
    the host code (a whole call's arguments are fixed by its prepared call's key: not checked).
    """

    launcher: Launcher
    # per launch: (id of the Triton kernel, grid, grid y, grid z, constants, pointers, others), where ``pointers``
    # are (position, argument, tuple index or None, byte offset) and ``others`` (position, getter) (descriptors, tuples)
    launches: tuple
    checked: bool
    scalar_positions: list  # every top-level argument that is neither a tensor nor a tuple ...
    scalar_values: list  # ... and its value
    tensor_positions: list  # every top-level tensor argument ...
    shapes: list  # ... and its shape
    result: int | tuple | None  # the argument(s) the host code returned, by position
    keep: tuple  # the prepared call's tensors whose addresses are constants here: alive as long as the replay

    def function(self) -> Callable[[tuple], object]:
        """The replay as one Python function of a call's arguments (``replayed`` and ``helion_ports.run`` keep and call
        it): its source is generated here, straight-line, one C launch call per kernel with every constant bound by
        name and each address an ``args[i].data_ptr() + offset``, because a loop over the plan read each launch's
        description again on every call (half the replay's Python; see ``replay_source``). It launches what the
        launcher had compiled for each kernel when the replay was made."""
        source, names = replay_source(self)
        namespace: dict = {}
        exec(compile(source, f"<replay of {self.launcher.op}>", "exec"), globals(), namespace)
        replay = namespace["bind"](**names)
        replay.source, replay.plan = source, self
        return replay


def replay_source(replay: Replay) -> tuple[str, dict]:
    """``Replay.function``'s source (a function ``bind(**names)`` that returns ``replay(args)``) and its names: the
    checks of a ``checked`` replay (``NOT_REPLAYED`` where a scalar or a top-level shape differs), then per launch
    ``run(grid x, y, z, the current stream, *head, *the kernel's arguments, *tail)`` as ``Launcher.launch_compiled``
    calls it, the arguments' addresses read from ``args``, and the arguments the host code returned."""
    names: dict = {}

    def name(value, prefix: str) -> str:
        if value is None or type(value) in (bool, int):  # literals that read back exactly
            return repr(value)
        names[f"{prefix}{len(names)}"] = value
        return f"{prefix}{len(names) - 1}"

    def address(i: int, j: int | None, offset: int) -> str:
        return f"args[{i}]{'' if j is None else f'[{j}]'}.data_ptr(){f' + {offset}' if offset else ''}"

    lines = []
    if replay.checked:
        checks = [f"args[{i}] != {name(v, 'scalar')}" for i, v in zip(replay.scalar_positions, replay.scalar_values)]
        checks += [f"args[{i}].shape != {name(tuple(s), 'shape')}" for i, s in zip(replay.tensor_positions,
                                                                                   replay.shapes)]
        if checks:
            lines.append(f"if {' or '.join(checks)}: return NOT_REPLAYED")
    lines += ["global last_op", f"last_op = {name(replay.launcher.op, 'op')}",
              "stream = torch._C._cuda_getCurrentRawStream(torch._C._cuda_getDevice())"]
    for key, grid, grid_y, grid_z, constants, pointers, others in replay.launches:
        run, head, descriptors, _, tail = replay.launcher.compiled[key]
        values = [name(value, "const") for value in constants]
        for position, i, j, offset in pointers:
            values[position] = address(i, j, offset)
        for position, get in others:
            values[position] = f"{name(get, 'get')}(args)"
        arguments = ", ".join(values)
        if descriptors:  # each descriptor's fields in place of it
            arguments = f"*tensor_maps([{arguments}], {name(descriptors, 'descriptors')})"
        arguments = ", ".join([*(name(value, "head") for value in head), *([arguments] if arguments else []),
                               *(name(value, "tail") for value in tail)])
        lines.append(f"{name(run, 'run')}({grid[0]}, {grid_y}, {grid_z}, stream, {arguments})")
    result = replay.result
    if result is None or isinstance(result, int):
        lines.append(f"return {'None' if result is None else f'args[{result}]'}")
    else:
        lines.append(f"return ({''.join(f'args[{i}], ' for i in result)})")
    body = "\n".join(f"        {line}" for line in lines)
    return f"def bind({', '.join(names)}):\n    def replay(args):\n{body}\n    return replay\n", names


class Recording:
    """What ``record_replay`` sees while host code runs: each launch through the launcher (kernel, grid, arguments),
    None for a launch that went past it (``past``), and (``watch``) any ATen op outside the launches."""

    def __init__(self):
        self.launches: list = []
        self.watch = _ViewsOnly()  # (a dispatch mode sees its own thread only)
        self.thread = threading.get_ident()

    def here(self) -> bool:
        """Whether a launch belongs to this recording: made on its thread, and not the recorded launch itself."""
        return self.thread == threading.get_ident() and not self.watch.launching

    def launch(self, launcher: Launcher, kernel, grid: tuple[int, ...], args: tuple, meta: dict):
        self.launches.append((kernel, tuple(grid), args))
        self.watch.launching = True
        try:
            return launcher(kernel, grid, *args, **meta)
        finally:
            self.watch.launching = False

    def past(self) -> None:
        self.launches.append(None)


_recording_lock = threading.Lock()


def record_replay(launcher: Launcher, host_code: Callable[[], object], args: tuple, viewed: bool = False,
                  keep: tuple = (), checked: bool = True) -> tuple[Callable | None | object, object]:
    """Run ``host_code()``, which launches through ``launcher`` on ``args`` (or, ``viewed``, on views of them), and
    return (its ``Replay``'s function of ``args``, what it returned). The replay is None where it cannot be made:
    the host code ran an ATen op other than a view (it would not be repeated), launched nothing, launched a kernel
    that did not compile to a kept launch (a CPU capture), passed a tensor derived neither from ``args`` nor from
    ``keep`` (the prepared call's own tensors: tensors, tuples, dicts and dataclasses of them), or returned something
    other than arguments; a replay of views returns None. It is ``NOT_YET`` where a launch went past the launcher (a
    Helion kernel's first, plain call): try again on a later call."""
    recording = Recording()
    with _recording_lock:
        busy = launcher.recording is not None  # another thread records this launcher now: leave it to that one
        if not busy:
            launcher.recording = recording
    if busy:
        return NOT_YET, host_code()
    try:
        with recording.watch:
            result = host_code()
    finally:
        launcher.recording = None
    launches = recording.launches
    if None in launches:
        return NOT_YET, result
    try:
        if recording.watch.other is not None or not launches or not all(
                id(kernel) in launcher.compiled for kernel, _, _ in launches):
            raise NotReplayable
        return _replay_of(launcher, args, launches, None if viewed else result, keep, checked), result
    except NotReplayable:
        return None, result


def replayed(launcher: Launcher, launch: Callable, args: tuple, host_code: Callable[[], object], keep: tuple
             ) -> object:
    """``host_code()``: a prepared call's whole launch path (``launch``, a recipe's or twin's, on the prepared call's
    arguments, ``keep``, and the call's own tensors, ``args``), replayed from its second call on (``Replay``, kept
    in the launcher under ``launch``, so a prepared call that two launch functions share keeps one replay each): one
    launch per kernel from the call's addresses, with no host code, no keyword arguments, no layers of calls. Only
    for host code that does nothing but launch through ``launcher`` (views aside): a stream operation, an event or a
    driver call would not be repeated. Runs the host code itself while a Triton launch hook is set, and where no
    replay can be made (``record_replay``)."""
    replay = launcher.replays.get(launch)
    if replay is not None and not launch_hooked():
        return replay(args)
    if replay is not None or launch in launcher.replays or launch_hooked():
        return host_code()
    made, result = record_replay(launcher, host_code, args, keep=keep, checked=False)
    if made is not NOT_YET:
        launcher.replays[launch] = made
    return result


def prepared_launch(launch: Callable, inputs: tuple, ctx: SymmContext, launch_cfg: dict, out: torch.Tensor
                    ) -> torch.Tensor:
    """``launch(*inputs, ctx.peers, out, ctx.signal_pad_ptrs, ctx.rank, **launch_cfg, group_name=ctx.group_name)``: a
    fused recipe's (or twin's) ``launch`` on its prepared call (``ctx``, ``launch_cfg``) with this call's ``inputs``
    and new ``out``, replayed from the prepared call's second call on (``replayed``). Returns ``out``."""
    replay = launch_cfg["launcher"].replays.get(launch)
    if replay is not None and not launch_hooked():  # (``replayed``'s first step, without its frame and closure)
        return replay((out, *inputs))

    def host_code() -> torch.Tensor:
        launch(*inputs, ctx.peers, out, ctx.signal_pad_ptrs, ctx.rank, **launch_cfg, group_name=ctx.group_name)
        return out

    return replayed(launch_cfg["launcher"], launch, (out, *inputs), host_code, (ctx, launch_cfg))


def held_tensors(value: object, depth: int = 3) -> list[torch.Tensor]:
    """Every tensor in ``value``: a tensor, or tensors in its tuples, lists, dict values and dataclass fields, to
    ``depth`` levels (a prepared call's context and launch configuration: ``replayed``'s ``keep``)."""
    if isinstance(value, torch.Tensor):
        return [value]
    if depth == 0:
        return []
    if isinstance(value, dict):
        value = list(value.values())
    elif hasattr(value, "__dataclass_fields__"):
        value = [getattr(value, name) for name in value.__dataclass_fields__]
    if isinstance(value, (tuple, list)):
        return [t for item in value for t in held_tensors(item, depth - 1)]
    return []


def _replay_of(launcher: Launcher, args: tuple, launches: list, result: object, keep: tuple, checked: bool
               ) -> Callable[[tuple], object]:
    sources = []  # (top-level position, position in a tuple or None, tensor)
    for i, arg in enumerate(args):
        if isinstance(arg, torch.Tensor):
            sources.append((i, None, arg))
        elif isinstance(arg, tuple):
            sources += [(i, j, t) for j, t in enumerate(arg) if isinstance(t, torch.Tensor)]
    kept = held_tensors(keep)

    def inside(ptr: int, tensors) -> list:
        return [t for t in tensors if t.data_ptr() <= ptr < t.data_ptr() + _extent_bytes(t)]

    def address_of(tensor: torch.Tensor) -> tuple[int | None, int | None, int]:
        """(None, None, its address) when ``tensor`` is, or lies in, a tensor of ``keep``: a constant (the prepared
        call holds it; where it is also an argument, as a symmetric input is one of its peers, the prepared call's
        key holds that argument's address). Else where its address is in a call's arguments: (argument, tuple
        index or None, byte offset), when it is one of them or a view into one."""
        ptr = tensor.data_ptr()
        if any(t is tensor for t in kept) or inside(ptr, kept):
            return None, None, ptr
        found = next(((i, j, 0) for i, j, t in sources if t is tensor), None)
        if found is not None:
            return found
        hits = [(i, j, t) for i, j, t in sources if inside(ptr, (t,))]
        if not hits or len({t.data_ptr() for _, _, t in hits}) > 1:  # none, or overlapping arguments
            raise NotReplayable
        i, j, t = hits[0]
        return i, j, ptr - t.data_ptr()

    def constant(value) -> object:
        """``value`` as a constant launch argument (a kept tensor as its address), or NotReplayable."""
        if isinstance(value, torch.Tensor):
            i, _, ptr = address_of(value)
            if i is None:
                return ptr
        elif isinstance(value, (TensorDescriptor, TmaOperand)):  # (a TmaOperand is a tuple: before tuples)
            if isinstance(value.base, Address):
                return value
            i, _, ptr = address_of(value.base)
            if i is None:
                return TmaOperand(Address(ptr), tuple(value.shape), tuple(value.strides), tuple(value.block_shape),
                                  value.padding)
        elif isinstance(value, tuple):
            return tuple(constant(item) for item in value)
        elif value is None or isinstance(value, (bool, int, float, str, torch.dtype)):
            return value
        raise NotReplayable

    def resolved(value) -> tuple[Callable | None, object]:
        """(None, the value as a constant), or (a getter of the value for a call's arguments, None): descriptors,
        tuples and the tensors in them (a launch's own tensor arguments are its ``pointers``)."""
        try:
            return None, constant(value)
        except NotReplayable:
            pass
        if isinstance(value, torch.Tensor):
            i, j, offset = address_of(value)
            return (lambda call: (call[i] if j is None else call[i][j]).data_ptr() + offset), None
        if isinstance(value, (TensorDescriptor, TmaOperand)):
            i, j, offset = address_of(value.base)
            rest = (tuple(value.shape), tuple(value.strides), tuple(value.block_shape), value.padding)
            return (lambda call: TmaOperand(Address((call[i] if j is None else call[i][j]).data_ptr() + offset),
                                            *rest)), None
        if isinstance(value, tuple):
            parts = tuple(resolved(item) for item in value)
            return (lambda call: tuple(item if get is None else get(call) for get, item in parts)), None
        raise NotReplayable

    planned = []
    for kernel, grid, launch_args in launches:
        pointers, others, constants = [], [], []
        for position, value in enumerate(launch_args):
            if isinstance(value, torch.Tensor):  # its address: a constant (kept), or from an argument
                i, j, offset = address_of(value)
                constants.append(offset if i is None else None)
                if i is not None:
                    pointers.append((position, i, j, offset))
                continue
            get, fixed = resolved(value)
            constants.append(fixed)
            if get is not None:
                others.append((position, get))
        grid_y, grid_z = (grid[1] if len(grid) > 1 else 1), (grid[2] if len(grid) > 2 else 1)
        planned.append((id(kernel), grid, grid_y, grid_z, tuple(constants), tuple(pointers), tuple(others)))

    def position_of(value) -> int:
        found = next((i for i, arg in enumerate(args) if arg is value), None)
        if found is None:
            raise NotReplayable
        return found

    if result is None:
        returned = None
    elif isinstance(result, tuple):
        returned = tuple(position_of(r) for r in result)
    else:
        returned = position_of(result)
    scalars = [i for i, a in enumerate(args) if not isinstance(a, (torch.Tensor, tuple))]
    tensors = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor)]
    return Replay(launcher, tuple(planned), checked, scalars, [args[i] for i in scalars], tensors,
                  [args[i].shape for i in tensors], returned, tuple(kept)).function()


def _extent_bytes(tensor: torch.Tensor) -> int:
    """Bytes from a tensor's first element to just past its last one (its strides' span)."""
    if tensor.numel() == 0:
        return 0
    return (1 + sum((size - 1) * stride for size, stride in zip(tensor.shape, tensor.stride()))) * tensor.element_size()
