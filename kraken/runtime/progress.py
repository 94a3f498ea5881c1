"""The copy-engine gather's product layer (``kraken.all_gather_with_progress`` and its twin), wrapped around the
recipe ``kraken.comm.all_gather_with_progress`` from outside.

The recipe holds the barrier kernel, the copy order (``plan``) and the exchange (``launch``: barrier, each peer's
chunk and its flag, my own rows, barrier). What the installed package adds lives here:

* the shard's checks and its peers, kept per signature (``shard_context``, ``prepare``), and the barriers'
  ``Launcher`` kept per (signal pad, rank, world size) (``barrier_launcher``);
* the flags' reset as a driver memset, the side stream, and the fork and join through events kept per thread
  (``reset_flags``, ``copy_stream``, ``fork``, ``join``, ``on_stream``): a quarter of torch's Python wrappers' cost;
* ``start``: the whole call replayed from a pair of CUDA graphs per pointer set (``graphs.ForkedGraph``): the reset and
  the fork's event on the current stream, and on the side stream the fork's wait, the exchange and the join's event,
  two host calls where there were a dozen; ``GatherInProgress.wait()`` is one.

``kraken.fused.context_parallel_attention`` exchanges K/V with the same primitives (``barrier``, ``set_flag``, ...).
"""

from __future__ import annotations

import functools
import importlib
import threading
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import _SymmetricMemory

from kraken.runtime import graphs, groups, prepared, symm
from kraken.runtime.launcher import Launcher, jit_launch

# The recipe's module: its barrier kernel (``barrier``) and its exchange (``launch``), driven by the installed one.
GATHER = importlib.import_module("kraken.comm.all_gather_with_progress")
OP = "all_gather_with_progress"
BARRIER_BLOCK, BARRIER_WARPS, LANDED = GATHER.BARRIER_BLOCK, GATHER.BARRIER_WARPS, GATHER.LANDED
shard_barrier_kernel = GATHER.shard_barrier_kernel


def barrier(signal_pad_ptrs: int, rank: int, world_size: int, launcher=jit_launch) -> None:
    """One cross-rank barrier on the current stream (one block, one warp): the recipe's, through ``launcher``."""
    launcher(shard_barrier_kernel, (1,), signal_pad_ptrs, rank, world_size, BLOCK_ID=BARRIER_BLOCK,
             num_warps=BARRIER_WARPS)


def set_flag(progress: torch.Tensor, index: int, value: int = LANDED) -> None:
    """``progress[index] = value`` on the current stream without a kernel: a stream memory operation
    (``cuStreamWriteValue32``, which fences the stream's earlier writes system-wide first), on a uint32 view kept
    with the flags. It is captured into CUDA graphs as a memory-operation node."""
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
    progress: torch.Tensor  # int32[world_size] (or one per piece: context_parallel_attention)
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
    """Check the arguments and find the peers: the shard's symmetric context (``shard_context``), and ``out`` and
    ``progress``, allocated where not given (checked where given)."""
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
    """The recipe's ``plan``, kept: the ranks in the order ``rank`` copies their chunks."""
    return GATHER.plan(rank, world_size)["order"]


def start(launch, peers: tuple[torch.Tensor, ...], signal_pad_ptrs: int, rank: int, out: torch.Tensor,
          progress: torch.Tensor, launcher=jit_launch, group_name: str = "") -> GatherInProgress:
    """The gather on checked arguments: ``peers`` (every rank's shard, ``peers[rank]`` mine) and ``signal_pad_ptrs``
    as ``symm.symm_context`` gives them; ``launch``, the recipe's exchange or its twin's, with ``launcher``.

    The whole call from a pair of graphs kept per pointer set (a fresh ``out`` and ``progress`` mostly come back at
    the same addresses from torch's allocator): the reset on the current stream, the exchange on the side stream,
    the fork and the join's record in them (``graphs.ForkedGraph``). Key: the exchange, the launcher, the pads, the
    rank and every pointer touched."""
    side = copy_stream(peers[rank].device)
    order = copy_order(rank, len(peers))
    key = (OP, launch, id(launcher), signal_pad_ptrs, rank, out.data_ptr(), out.shape, progress.data_ptr(),
           *(peer.data_ptr() for peer in peers))

    def reset() -> None:
        reset_flags(progress)

    def exchange() -> None:
        launch(peers, out, progress, signal_pad_ptrs, rank, order, group_name=group_name, launcher=launcher)

    def plain() -> None:
        reset()
        fork(side)
        with on_stream(side):
            exchange()

    return GatherInProgress(out, progress, side, order, graphs.forked(key, reset, exchange, plain, side))


def all_gather_with_progress_with(launch, op: str):
    """The installed gather, driving ``launch``: the recipe's (``kraken.all_gather_with_progress``) or its Helion
    twin's (``helion_ports.all_gather_with_progress``, ``op`` "helion all_gather_with_progress")."""

    def all_gather_with_progress(
        shard: torch.Tensor,
        group: dist.ProcessGroup | str | None = None,
        *,
        out: torch.Tensor | None = None,
        progress: torch.Tensor | None = None,
    ) -> GatherInProgress:
        """Start gathering every rank's ``shard`` into ``out`` on the copy engine; see the recipe's docstring.

        ``shard``: this rank's rows, a contiguous tensor in symmetric memory (``kraken.symm_empty``), the same
        shape on every rank. ``out``: [world_size * shard.shape[0], *shard.shape[1:]] (allocated if None).
        ``progress``: int32[world_size] (allocated if None), zeroed here on the current stream. Launch the
        consumer on the current stream, then call ``.wait()`` on the result.
        """
        ctx, out, progress = prepare(shard, group, out, progress)
        return start(launch, ctx.peers, ctx.signal_pad_ptrs, ctx.rank, out, progress, barrier_launcher(ctx),
                     ctx.group_name)

    return all_gather_with_progress


all_gather_with_progress = all_gather_with_progress_with(GATHER.launch, OP)
