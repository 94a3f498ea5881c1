"""All-gather on the copy engine, with a progress flag per rank's chunk.

For a consumer kernel that starts on the chunks that have landed while the rest
are still in flight (``kraken.fused.all_gather_matmul``). Every rank holds a
symmetric ``shard`` [M, ...]; ``out`` [world_size * M, ...] gets rank r's shard
at rows ``r * M ...``, and ``progress[r]`` turns from 0 to 1 once they are there.

No SM moves data: on a side stream, ``tensor.copy_`` of each peer's shard (a
``cudaMemcpyAsync`` from its NVLink-mapped buffer, run by the copy engine), one
chunk at a time starting with rank + 1 (so no two ranks read the same peer at
once), each followed by a stream memory operation that writes the chunk's flag
(``cuStreamWriteValue32``, with a system-scope fence before the write; a memory-
operation node of the graph under CUDA-graph capture). A
consumer on the current stream that spins on a flag therefore cannot starve the
producer, whatever SMs it holds.

The protocol (CUDA-graph safe, no host round trip):

* flags: ``progress`` is zeroed on the current stream *before* the side stream
  forks from it, and only ever goes 0 -> 1 within a call. A consumer launched on
  the current stream after this call sees 0 until the chunk has landed; it waits
  with an acquire load (``kraken._ptx_utils.wait`` / ``wait_async`` for TMA
  readers) and reads the chunk after. In a CUDA graph the zeroing, the copies and
  the writes are nodes of the graph, so every replay repeats the whole protocol;
* peers' shards are complete before I copy them: a one-block barrier kernel
  (``symm_mem_sync``, release + acquire, block id ``BARRIER_BLOCK`` of the shard's
  signal pad) on the side stream, which follows every write to ``shard`` that the
  current stream ordered before this call (and the staging copy, when there is one);
* I must not overwrite my shard while a peer still copies it: a second barrier
  after the last copy ("done reading"). A peer's side stream reaches it only after
  its copies of my shard; the caller's next write to the shard comes after
  ``GatherInProgress.wait()``, which joins the side stream behind that barrier.
  (The GEMM consumer is far longer than the copies, so the join costs nothing.)
* replays: from its second call with the same pointers (a gather in place, my shard my own chunk of a
  symmetric ``out``, as the GEMM consumers' prepared buffers; a standalone gather whose fresh ``out`` and
  ``progress`` come back at the same addresses), a call with nothing to stage is two CUDA graphs
  (``graphs.ForkedGraph``): the reset and the fork's event on the current stream, and on the side stream the
  fork's wait, the exchange (the barriers, copies and flag writes above) and the join's event, two host calls
  where there were a dozen; ``wait()`` is one. A call that stages replays its exchange after the staging
  (``graphs.graphed``). The same operations either way;
* my own rows: copied locally to ``out`` after the peers' chunks (those are what a
  consumer waits for; it can read its own rows from ``shard`` without waiting) and
  flagged like the others, unless the consumer reads them from its own copy (``start``'s
  ``flag_own=False``: the GEMM consumers, whose kernels read my rows from ``a``); then my
  flag is never written, and a group of one, with no flag at all to write, skips the reset too.

The barrier kernels are single one-warp blocks with no shared memory: a persistent
consumer must leave them room on some SM (``all_gather_matmul`` leaves one SM free).
Both use the shard's signal pad at block id ``BARRIER_BLOCK``: no other kernel may use
that block's slots of that pad at the same time. Flags are int32 tensors; torch's
stream operations see the same bytes as uint32.
"""

from __future__ import annotations

import functools
import threading
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import _SymmetricMemory
import triton
import triton.language as tl

from kraken._ptx_utils import symm_mem_sync
from kraken.runtime import graphs, groups, prepared, symm
from kraken.runtime.launcher import Launcher, jit_launch

OP = "all_gather_with_progress"
BARRIER_BLOCK = 0
BARRIER_WARPS = 1
LANDED = 1  # the value of a chunk's flag once its rows are in ``out``


@triton.jit
def shard_barrier_kernel(signal_pad_ptrs, rank, world_size: tl.constexpr, BLOCK_ID: tl.constexpr):
    # Every write before this (the copies of this side stream, and the current stream's before the fork)
    # is visible to the peers, and theirs to everything after it on this stream.
    symm_mem_sync(signal_pad_ptrs, BLOCK_ID, rank, world_size, hasPreviousMemAccess=True, hasSubsequentMemAccess=True)


def barrier(signal_pad_ptrs: int, rank: int, world_size: int, launcher=jit_launch) -> None:
    """One cross-rank barrier on the current stream (one block, one warp)."""
    launcher(shard_barrier_kernel, (1,), signal_pad_ptrs, rank, world_size, BLOCK_ID=BARRIER_BLOCK,
             num_warps=BARRIER_WARPS)


def set_flag(progress: torch.Tensor, index: int, value: int = LANDED) -> None:
    """``progress[index] = value`` on the current stream without a kernel: a stream memory operation
    (``cuStreamWriteValue32``, which fences the stream's earlier writes system-wide first). It is captured
    into CUDA graphs as a memory-operation node (checked on the 2x H200 host with torch 2.11: replays
    write the values; torch's own async-TP code uses a memset there instead)."""
    _SymmetricMemory.stream_write_value32(_uint32(progress), index, value)


def reset_flags(progress: torch.Tensor) -> None:
    """Every flag to 0 on the current stream: eagerly a driver memset (``cuMemsetD32Async``), the one torch's async-TP
    resets its signals with, where ``zero_`` goes through torch's dispatcher to a fill kernel (one H200's host: 2.1
    us against 5.3 per call). While the stream is captured, ``zero_``: in a replayed graph the memset node cost the
    GPU about 2.5 us more per call than the fill kernel's node (all_gather_matmul 256x8192x8192 at world size 1:
    fp8 33.0-33.3 against 30.7 us, bf16 53.8-54.0 against 51.9-52.3)."""
    if torch._C._cuda_isCurrentStreamCapturing():
        progress.zero_()
    else:
        _SymmetricMemory.memset32(_uint32(progress), 0, 0, progress.numel())


def _uint32(progress: torch.Tensor) -> torch.Tensor:
    """The flags as uint32, as torch's stream operations take them (the same bytes the kernels read as int32); the
    view is kept on the tensor: making it costs more than the write's own Python call."""
    as_uint32 = getattr(progress, "_as_uint32", None)
    if as_uint32 is None:
        as_uint32 = progress._as_uint32 = progress.view(torch.uint32)
    return as_uint32


_copy_streams: dict[torch.device, torch.cuda.Stream] = {}


def copy_stream(device: torch.device) -> torch.cuda.Stream:
    """The side stream the copies run on (one per device, high priority, as torch's async-TP backend stream)."""
    if device not in _copy_streams:
        _copy_streams[device] = torch.cuda.Stream(device=device, priority=-1)
    return _copy_streams[device]


def current_stream(device_index: int) -> torch._C._CudaStreamBase:
    """The device's current stream as torch's C stream object (what events record on and wait from): a quarter
    of ``torch.cuda.current_stream``'s host cost, which builds its Python ``Stream`` through device checks."""
    stream_id, index, device_type = torch._C._cuda_getCurrentStream(device_index)
    return torch._C._CudaStreamBase(stream_id=stream_id, device_index=index, device_type=device_type)


_local = threading.local()  # each thread's fork and join events, per device
# torch.cuda.Event's record and wait without their Python wrappers (which only default the stream): a quarter of
# fork + join's host cost (one H200: 6.7 us against 9.0 for the pair).
_record, _wait = torch._C._CudaEventBase.record, torch._C._CudaEventBase.wait


def _events(device_index: int) -> tuple[torch.cuda.Event, torch.cuda.Event]:
    events = getattr(_local, "events", None)
    if events is None:
        events = _local.events = {}
    pair = events.get(device_index)
    if pair is None:
        pair = events[device_index] = (torch.cuda.Event(), torch.cuda.Event())
    return pair


def fork(side: torch.cuda.Stream) -> None:
    """``side.wait_stream(current stream)``: the side stream follows everything queued on the current stream so
    far. Through an event kept per thread and device, recorded just before the wait (a wait follows the event's
    latest record), where ``wait_stream`` creates an event per call: half the host cost. In a CUDA-graph capture
    the record and the wait become the graph's edge, as ``wait_stream``'s do."""
    event = _events(side.device_index)[0]
    _record(event, current_stream(side.device_index))
    _wait(event, side)


def join(side: torch.cuda.Stream) -> None:
    """``current stream.wait_stream(side)``, through the other kept event (``fork``)."""
    event = _events(side.device_index)[1]
    _record(event, side)
    _wait(event, current_stream(side.device_index))


class on_stream:
    """``with on_stream(stream):`` is ``torch.cuda.stream(stream)`` for a stream of the current device, without its
    Python bookkeeping: the current stream is set, and set back, through torch's C calls. A class, not a
    ``contextlib`` generator, whose own machinery cost as much as the two calls (one H200: 4.6 us a use against
    2.1 for the calls alone)."""

    __slots__ = ("stream", "previous", "other_device")

    def __init__(self, stream: torch.cuda.Stream):
        self.stream = stream
        self.other_device = None  # another device's stream: torch.cuda.stream, which switches the device too

    def __enter__(self) -> None:
        stream = self.stream
        if stream.device_index != torch._C._cuda_getDevice():
            self.other_device = torch.cuda.stream(stream)
            self.other_device.__enter__()
            return
        self.previous = torch._C._cuda_getCurrentStream(stream.device_index)
        torch._C._cuda_setStream(stream_id=stream.stream_id, device_index=stream.device_index,
                                 device_type=stream.device_type)

    def __exit__(self, *exc) -> None:
        if self.other_device is not None:
            self.other_device.__exit__(*exc)
            return
        previous = self.previous
        torch._C._cuda_setStream(stream_id=previous[0], device_index=previous[1], device_type=previous[2])


@dataclass
class GatherInProgress:
    """What ``all_gather_with_progress`` started: the output, its flags, and the join."""

    out: torch.Tensor  # [world_size * M, ...]: rank r's rows are final once progress[r] == LANDED
    progress: torch.Tensor  # int32[world_size] (then one per staged piece, for all_gather_matmul)
    stream: torch.cuda.Stream  # the side stream the copies run on
    order: tuple[int, ...]  # the ranks in the order their chunks are copied (own first)
    graphs: graphs.ForkedGraph | None = None  # what launched the call, if its graphs did: the join is theirs

    def wait(self) -> torch.Tensor:
        """Make the current stream wait for every copy and the closing barrier; returns ``out``.

        Call it after launching the consumer and before anything else uses ``out`` or writes the shard
        (and before a CUDA-graph capture ends: the side stream must rejoin)."""
        if self.graphs is None:
            join(self.stream)
        else:
            self.graphs.join(self.stream.device_index)
        return self.out


def check_progress(progress: torch.Tensor, world_size: int, device: torch.device, op: str) -> None:
    groups.check_tensor(progress, "progress", op, (torch.int32,), ndim=1)
    if progress.numel() != world_size or progress.device != device:
        raise ValueError(f"{op}: progress must be int32[{world_size}] on {device}, got {progress.numel()} on {progress.device}")


def all_gather_with_progress(
    shard: torch.Tensor,
    group: dist.ProcessGroup | str | None = None,
    *,
    out: torch.Tensor | None = None,
    progress: torch.Tensor | None = None,
) -> GatherInProgress:
    """Start gathering every rank's ``shard`` into ``out`` on the copy engine; see the module docstring.

    ``shard``: this rank's rows, a contiguous tensor in symmetric memory (``kraken.symm_empty``), the same
    shape on every rank. ``out``: [world_size * shard.shape[0], *shard.shape[1:]] (allocated if None).
    ``progress``: int32[world_size] (allocated if None), zeroed here on the current stream. Launch the
    consumer on the current stream, then call ``.wait()`` on the result.
    """
    ctx, out, progress = prepare(shard, group, out, progress)
    return start(ctx.peers, ctx.signal_pad_ptrs, ctx.rank, out, progress, launcher=barrier_launcher(ctx))


_barrier_launchers: dict[tuple[int, int, int], Launcher] = {}


def barrier_launcher(ctx: symm.SymmContext) -> Launcher:
    """The launcher of a shard's barriers, kept per (signal pad, rank, world size): the barrier kernels' every
    argument (``Launcher``'s condition), so later calls skip Triton's (or Helion's) binding, two per call."""
    key = (ctx.signal_pad_ptrs, ctx.rank, ctx.world_size)
    launcher = _barrier_launchers.get(key)
    if launcher is None:
        launcher = _barrier_launchers[key] = Launcher(OP)
    return launcher


@prepared.per_signature(lambda shard, group: (OP, group, prepared.tensor_key(shard, address=True)))
def shard_context(shard: torch.Tensor, group) -> symm.SymmContext:
    """The shard's checks and its symmetric context (the peers), kept per signature: the shard's address finds its
    peers, and a symmetric tensor stays alive once rendezvoused (its context holds it), so the address is never
    another tensor's."""
    groups.check_tensor(shard, "shard", OP, groups.SUPPORTED_DTYPES + (torch.int32, torch.uint8))
    if shard.dim() < 1 or shard.shape[0] == 0:
        raise ValueError(f"{OP}: shard must have at least one row, got shape {tuple(shard.shape)}")
    return symm.symm_context(shard, group, OP, name="shard")


def prepare(shard: torch.Tensor, group, out: torch.Tensor | None, progress: torch.Tensor | None
            ) -> tuple[symm.SymmContext, torch.Tensor, torch.Tensor]:
    """Check the arguments and find the peers (shared with the Helion twin): the shard's symmetric context
    (``shard_context``), and ``out`` and ``progress``, allocated where not given (checked where given)."""
    ctx = shard_context(shard, group)
    shape = (ctx.world_size * shard.shape[0], *shard.shape[1:])
    if out is None:  # (``new_empty``: half the host time of ``torch.empty`` with a dtype and a device)
        out = shard.new_empty(shape)
    else:
        groups.check_tensor(out, "out", OP, (shard.dtype,))
        if tuple(out.shape) != shape or out.device != shard.device:
            raise ValueError(f"{OP}: out must be {shape} on {shard.device}, got {tuple(out.shape)} on {out.device}")
    if progress is None:
        progress = shard.new_empty(ctx.world_size, dtype=torch.int32)
    else:
        check_progress(progress, ctx.world_size, shard.device, OP)
    return ctx, out, progress


@functools.cache
def copy_order(rank: int, world_size: int) -> tuple[int, ...]:
    """The ranks in the order ``rank`` copies their chunks: its own first, then from rank + 1 on (so no two ranks
    read the same peer at once)."""
    return tuple((rank + step) % world_size for step in range(world_size))


def exchange(peers: tuple[torch.Tensor, ...], signal_pad_ptrs: int, rank: int, out: torch.Tensor,
             progress: torch.Tensor, snapshot: torch.Tensor | None, order: tuple[int, ...], launcher,
             in_place: bool, flag_own: bool = True) -> None:
    """``start``'s side-stream work after my shard is staged, on the current stream: the first barrier, each
    peer's chunk and its flag in ``order``, my own rows (unless ``in_place``: my shard is my chunk of ``out``)
    and flag (if ``flag_own``), the snapshot, the closing barrier."""
    shard = peers[rank]
    rows = shard.shape[0]
    barrier(signal_pad_ptrs, rank, len(peers), launcher)  # every rank's shard is complete
    for peer in order[1:]:
        out[peer * rows:(peer + 1) * rows].copy_(peers[peer])
        set_flag(progress, peer)
    # My own rows last: the consumer can read them from the shard, the peers' are the ones it waits for.
    if not in_place:
        out[rank * rows:(rank + 1) * rows].copy_(shard)
    if flag_own:
        set_flag(progress, rank)
    if snapshot is not None:
        snapshot.copy_(out)
    barrier(signal_pad_ptrs, rank, len(peers), launcher)  # done reading: peers may write their shards again


# The exchange of a gather in place (my shard my own chunk of a symmetric ``out``: the GEMM consumers' prepared
# gather buffers) touches the same buffers, flags and signal pads on every call of a prepared call: its launches,
# copies and flag writes (two barriers, and one write unless ``flag_own`` is off, at world size 1; 2 (world_size - 1)
# more operations beyond) are replayed from CUDA graphs, one graph launch where each was a host call (with the reset,
# the fork and the join's record, when nothing is staged: ``graphs.ForkedGraph``). So is a standalone gather's (its own
# rows' copy too) whenever its ``out`` and ``progress`` come back at addresses seen before. Key: the launcher, the
# pads, the rank and every pointer touched.


def start(
    peers: tuple[torch.Tensor, ...],
    signal_pad_ptrs: int,
    rank: int,
    out: torch.Tensor,
    progress: torch.Tensor,
    stage_from: torch.Tensor | None = None,
    snapshot: torch.Tensor | None = None,
    stage_launch: Callable[[], None] | None = None,
    launcher=jit_launch,
    flag_own: bool = True,
) -> GatherInProgress:
    """``all_gather_with_progress`` on checked arguments: ``peers`` (every rank's shard, ``peers[rank]`` mine) and
    ``signal_pad_ptrs`` as ``symm.symm_context`` gives them.

    For consumers that gather in place (``all_gather_matmul``): ``stage_from``, an ordinary tensor, is first
    copied into my shard, for the peers (and ``snapshot``) to read; it is not flagged. The copy engine copies it
    on the side stream, before the first barrier, while the consumer on the current stream reads my rows from
    ``stage_from`` itself (so a group of one without ``snapshot``, where nobody reads the shard, skips the copy).
    ``stage_launch``, for shards that are no plain copy (the fp8 recipe's values and row scales): a function
    that launches the kernel writing my shard, called on the side stream where ``stage_from``'s copy would be,
    under the same rule. When my shard is my own chunk of ``out`` (each rank's shard a chunk of its symmetric
    ``out``), the own rows need no second copy. ``snapshot``: a copy of the whole ``out`` made on the side
    stream after the last chunk (overlapping the consumer), for callers that return it. ``launcher`` launches
    the barriers. ``flag_own=False``: the consumer never waits for my chunk (it reads my rows from its own copy),
    so ``progress[rank]`` is not written; at world size 1 no flag is, and ``progress`` is not even reset (its
    reset and the flag's write were 3 us of GPU time per call in a graph: all_gather_matmul 1024x6656x5120 1.059-1.061
    -> 1.030-1.033 x cuBLAS, 256x8192x8192 1.066 -> 1.022-1.025, one H200).
    """
    world_size, shard = len(peers), peers[rank]
    side = copy_stream(shard.device)
    has_reader = world_size > 1 or snapshot is not None  # of my shard: a peer, or the snapshot
    copy_in = stage_from is not None and has_reader
    stage = stage_launch is not None and has_reader
    in_place = out.data_ptr() + rank * shard.nbytes == shard.data_ptr()  # my shard is my chunk of out
    reset = world_size > 1 or flag_own  # some flag is written: none of the previous call survives into this one
    order = copy_order(rank, world_size)
    # The graphs' key: every pointer the call touches, and whether it stages (a pair of graphs if not, one after).
    key = (OP, id(launcher), signal_pad_ptrs, rank, out.data_ptr(), out.shape, progress.data_ptr(), flag_own,
           copy_in or stage, *(peer.data_ptr() for peer in peers))

    def reset_() -> None:
        if reset:
            reset_flags(progress)

    def exchange_() -> None:
        exchange(peers, signal_pad_ptrs, rank, out, progress, snapshot, order, launcher, in_place, flag_own)

    if snapshot is None and not copy_in and not stage:
        # The whole call from a pair of graphs kept per pointer set (a gather in place touches only a prepared
        # call's buffers; a fresh ``out`` and ``progress`` mostly come back at the same addresses from torch's
        # allocator): the reset on the current stream, the exchange on the side stream, the fork and the join's
        # record in them (``graphs.ForkedGraph``).
        def plain() -> None:
            reset_()
            fork(side)
            with on_stream(side):
                exchange_()

        return GatherInProgress(out, progress, side, order, graphs.forked(key, reset_, exchange_, plain, side))
    reset_()
    fork(side)
    with on_stream(side):
        if copy_in:
            shard.copy_(stage_from)
        if stage:
            stage_launch()
        if snapshot is None:  # after the staging, the exchange from a graph kept per pointer set, as above
            graphs.graphed(key, exchange_, shard.device)
        else:
            exchange_()
    return GatherInProgress(out, progress, side, order)
