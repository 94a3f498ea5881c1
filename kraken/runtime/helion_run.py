"""The twins' fast path: a Helion kernel run through a prepared call's ``Launcher``.

A twin calls ``kraken._blocks.helion.run(kernel, args, launcher)``; with a ``Launcher`` (the product's prepared
calls pass one) that goes to ``Launcher.helion``, which is ``run`` here: the kernel's generated host code recorded
once and replayed on later calls' addresses (``kraken.runtime.replay``). With ``jit_launch`` it is the plain call,
with Triton's scratch allocator set.
"""

from __future__ import annotations

import torch

from kraken.runtime import replay as replays  # (as a module: ``launcher`` imports this one while ``replay`` may be
# half-imported, so its names are read when a call runs)
from kraken.runtime.launcher import jit_launch, launch_hooked, scratch_allocator


def run(kernel, args: tuple, launcher=jit_launch, kernel_args=None):
    """Call a twin's Helion kernel on ``args``: plainly (``kernel(*args)``) with the default launcher, or, with
    a prepared call's ``Launcher``, through what that keeps for the kernel.

    With a ``Launcher``: the first call binds the kernel, compiles its config and runs the generated host code the
    plain way, keeping the ``BoundKernel`` (``Kernel.bind(args)`` in Helion 1.5.0: the kernel for the arguments'
    specialisation, one per config here, whose ``_run`` is the generated host code, taking the launcher as its
    keyword ``_launcher``; the code ``HELION_PRINT_OUTPUT_CODE=1`` prints). The second runs that host code once,
    launching through the launcher, and records it (``record_replay``); later calls replay its launches on their own
    arguments' addresses, with no host code (``Replay``), or run the host code again: where it cannot be replayed,
    while a Triton launch hook is set, and while a whole call's replay is being recorded (``replayed``: that one
    takes these launches). The plain way launches with ``scratch_allocator`` set, as ``jit_launch`` does: a kernel
    that builds TMA descriptors on the device takes its global scratch from it.

    ``kernel_args``: for a kernel that takes views of what the twin holds (a flat view of a [tokens, hidden]
    tensor, a buffer shaped as regions, a scale expanded to a row), a function of ``args`` that returns the
    kernel's arguments; only the paths that run host code call it. A replay makes no view: it reads each address
    from ``args`` themselves (a view's is its tensor's, or at a fixed offset from it), and a view costs about a
    microsecond of the host's time. With ``kernel_args``, ``run`` returns None (the twin holds its outputs).
    """
    if launcher is jit_launch:
        with scratch_allocator():
            result = kernel(*(args if kernel_args is None else kernel_args(args)))
        return result if kernel_args is None else None
    key = id(kernel)
    recording = launcher.recording  # a whole call's replay being recorded (``replayed``): it takes the launches
    recording = recording if recording is not None and recording.here() else None
    replay = launcher.replays.get(key)
    if replay is not None and recording is None and not launch_hooked():
        result = replay(args)
        if result is not replays.NOT_REPLAYED:
            return result
    call = args if kernel_args is None else kernel_args(args)
    bound = launcher.bound.get(key)
    if bound is None:
        if recording is not None:
            recording.past()
        # Compiled and run without Helion's own call: after a call, Helion 1.5.0 builds an argument guard for its
        # next ones that keeps this call's tensors in a reference cycle until Python's collector runs (a model's
        # activations would go back to the allocator late; docs/helion-notes.md). Our calls never take that path.
        bound = launcher.bound[key] = kernel.bind(call)
        if bound._run is None and len(kernel.configs) == 1:  # (every twin's kernel has its one explicit config)
            # As Helion's first call compiles: with the call's tensors at hand (their alignment picks TMA).
            tensors = {name: value for name, value in zip(kernel.signature.parameters, call)
                       if isinstance(value, torch.Tensor)}
            with bound.env.use_runtime_arg_values(tensors):
                bound.set_config(kernel.configs[0])
        with scratch_allocator():
            result = bound(*call) if bound._run is None else bound._run(*call)
    elif key not in launcher.replays and recording is None and not launch_hooked():
        replay, result = replays.record_replay(launcher, lambda: bound._run(*call, _launcher=launcher), args,
                                       viewed=call is not args)
        if replay is not replays.NOT_YET:
            launcher.replays[key] = replay
    else:
        result = bound._run(*call, _launcher=launcher)
    return result if kernel_args is None else None
