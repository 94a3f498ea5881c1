"""Calls of several launches, replayed from a CUDA graph per pointer set.

``graphed`` keeps a CUDA graph of a call's work under a key (the prepared call and the addresses it reads) and
replays it: one graph launch where the call made a host call per launch, stream operation and copy. ``forked``
does the same for work split between the current stream and a side stream (``ForkedGraph``). ``drop_graphs``
forgets them all, once the devices that captured them are idle.
"""

from __future__ import annotations

from typing import Callable

import torch

from kraken.runtime import prepared
from kraken.runtime.launcher import launch_hooked

_graphs: dict = {}  # key -> the CUDA graph of its work, or NEVER (its capture failed: always plain)
NEVER = -1
# A key is captured when it comes back within this many calls of its prepared call (the key's first item), replays
# counted: its first call binds the kernels through the JIT; a key that comes back so soon (a loop over a few buffers
# in turn) will come back again. A key that comes back only once a model's step (its first layer's fresh activations,
# while the other layers replay) would be captured for one replay a step.
RECENT_CALLS = 16
_calls: dict = {}  # prepared call -> its number of calls so far
_last_call: dict = {}  # key with no graph -> the number of its prepared call's call when it last ran
_capture_streams: dict[int, torch.cuda.Stream] = {}


def graphed(key: tuple, run: Callable[[], object], device: torch.device) -> None:
    """``run()``'s work on the current stream, from a CUDA graph of it kept under ``key``: captured (thread-local mode:
    other threads' CUDA calls go on) when the key comes back within ``RECENT_CALLS`` calls of its prepared call,
    replays included (a loop on the same tensors, or a few buffers in turn), and replayed from then on, one graph
    launch where ``run`` made a host call per launch, stream operation and copy. A prepared call whose calls come
    with new addresses each time (a model's layers on fresh activations) runs without a graph (in pieces where the
    caller has them): a capture costs about a millisecond and would be replayed at most once a step. ``key`` must
    hold everything ``run`` reads whose value can change from call to call: a prepared call (its ``Launcher``: its
    shapes, plan and buffers) and the address of every tensor passed in. Tensors ``run`` makes itself come from the
    graph's memory pool. ``run`` goes plainly where the device is no GPU, while the current stream is being captured
    (the caller's graph takes the launches), while a Triton launch hook is set (a profiler sees every launch), and
    for a key whose capture failed. Past ``MAX_PREPARED`` kept graphs the oldest is forgotten, with no synchronisation
    (``_forget_oldest``): a model whose allocations shift between steps (an optimizer step, an evaluation) brings its
    layers new address sets in turn, captured again, and must not meet a device synchronisation every so many shifts."""
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
    count = _calls.get(key[0], 0) + 1
    if count == 1 and len(_calls) >= prepared.MAX_PREPARED:  # bounds (no graph here: nothing to wait for)
        _calls.clear()
        _last_call.clear()
    _calls[key[0]] = count
    entry = _graphs.get(key)
    if entry is not None and entry != NEVER:
        return entry
    last = _last_call.get(key)
    if last is None and len(_last_call) >= prepared.MAX_PREPARED * RECENT_CALLS:
        _last_call.clear()
    _last_call[key] = count
    if entry == NEVER or last is None or count - last > RECENT_CALLS:
        run()
        return None
    if len(_graphs) >= prepared.MAX_PREPARED:
        _forget_oldest()
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


def _forget_oldest() -> None:
    """Forget the graph captured first (or a failed capture's mark), while a replay of it may still run. That is safe
    with no synchronisation: CUDA frees a destroyed executable graph that is in flight once it completes, and torch's
    allocator hands no block of a destroyed graph's private pool out again; it returns them to the driver only when it
    frees cached blocks, which synchronises first. The tensors the graph reads outside its pool are not freed here: a
    module cache of such tensors calls ``drop_graphs`` before it drops them."""
    del _graphs[next(iter(_graphs))]


def drop_graphs() -> None:
    """Forget every kept graph (``graphed``, ``forked``) once the devices that captured them are idle: before a
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
