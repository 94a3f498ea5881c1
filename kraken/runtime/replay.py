"""The host fast path, part three: replaying a call's launches with no host code.

Under one prepared call, host code (a Helion kernel's generated host code, or a recipe's or twin's whole
``launch``) launches the same kernels with the same constants every time; only the arguments' addresses move.
``record_replay`` runs the host code once, watching what it launches (``Recording``), and makes a ``Replay``: a
generated Python function of the call's arguments that calls each compiled kernel's launch function directly.
``replayed`` and ``prepared_launch`` are how the recipes and twins use it for a whole call; ``kraken.runtime.helion_run.run``
for one Helion kernel.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from triton.tools.tensor_descriptor import TensorDescriptor

from kraken.runtime import launcher as launcher_module
from kraken.runtime.launcher import Address, Descriptor, Launcher, MapsByAddress, TmaOperand, launch_hooked

if TYPE_CHECKING:
    from kraken.runtime.symm import SymmContext

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
# With a launch function, the key in a launcher's ``replays`` that says it ran once (``replayed``'s ``plain_first``).
FIRST_CALL = "first call"


@dataclass(frozen=True)
class Replay:
    """The launches of one call of host code (a Helion kernel's generated host code, or a recipe's or twin's whole
    ``launch`` on a prepared call: ``replayed``), as functions of the call's arguments.

    Host code turns its arguments into launches: a Triton kernel, a grid, and arguments that are the tensors given
    or views of them, host tensor descriptors on them, the prepared call's own tensors (``keep``: its peers and
    workspaces), and sizes, strides and scalars. Under one prepared call everything but the arguments' addresses is
    fixed (its key holds every tensor's shape, strides and dtype, and every scalar), so ``record_replay`` runs the
    host code once, watching what it launches, and keeps each launch argument as a constant (a kept tensor as its
    address) or as (argument, byte offset into it). Its ``function()`` launches the same compiled kernels with each
    tensor as its address (the C launch function then skips ``data_ptr()`` and the driver's pointer check) and each
    descriptor as its TMA map's fields (``maps_in_line``): no host code, no views, no descriptor objects. With
    ``checked``, a call whose scalars or top-level shapes differ from the recorded ones returns ``NOT_REPLAYED``,
    and the caller runs the host code (a whole call's arguments are fixed by its prepared call's key: not checked).
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
        """The replay as one Python function of a call's arguments (``replayed`` and ``kraken.runtime.helion_run.run`` keep and call
        it): its source is generated here, straight-line, one C launch call per kernel with every constant bound by
        name and each address an ``args[i].data_ptr() + offset``, because a loop over the plan read each launch's
        description again on every call (half the replay's Python; see ``replay_source``). It launches what the
        launcher had compiled for each kernel when the replay was made."""
        source, names = replay_source(self)
        namespace: dict = {}
        # It runs in the launcher module's namespace: it sets ``last_op`` there on every call, as
        # ``Launcher.__call__`` does, and finds ``torch`` and ``tensor_maps`` there.
        exec(compile(source, f"<replay of {self.launcher.op}>", "exec"), vars(launcher_module), namespace)
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
            names["NOT_REPLAYED"] = NOT_REPLAYED
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
        if descriptors:  # each descriptor's fields in place of it: in line, or through ``tensor_maps``
            in_line = [maps_in_line(position, meta, encode, constants[position], dict(others).get(position))
                       for position, meta, _, encode in descriptors]
            if None in in_line:
                arguments = f"*tensor_maps([{arguments}], {name(descriptors, 'descriptors')})"
            else:
                for (position, *_), (maps, fixed, i, j, offset) in zip(descriptors, in_line):
                    values[position] = (f"*{name(fixed, 'map')}" if maps is None else
                                        f"*({name(maps.cache.get, 'maps')}({address(i, j, offset)}) or "
                                        f"{name(maps.miss, 'miss')}({address(i, j, offset)}))")
                arguments = ", ".join(values)
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


def maps_in_line(position: int, meta, encode: Callable, constant, get) -> tuple | None:
    """How a replay's source expands a launch's descriptor at ``position``: (None, its map's fields) for one on the
    prepared call's own tensor (encoded once, here), (``MapsByAddress``, None, i, j, offset) for one on a call's
    argument, or None for neither (the launch goes through ``tensor_maps``)."""
    if isinstance(get, Descriptor):
        return MapsByAddress(get.rest, meta, encode), None, get.i, get.j, get.offset
    if get is None and isinstance(constant, TmaOperand):
        return None, tuple(encode(constant, meta)), None, None, 0
    return None


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


def replayed(launcher: Launcher, launch: Callable, args: tuple, host_code: Callable[[], object], keep: tuple,
             plain_first: bool = False) -> object:
    """``host_code()``: a prepared call's whole launch path (``launch``, a recipe's or twin's, on the prepared call's
    arguments, ``keep``, and the call's own tensors, ``args``), replayed from its second call on (``Replay``, kept
    in the launcher under ``launch``, so a prepared call that two launch functions share keeps one replay each): one
    launch per kernel from the call's addresses, with no host code, no keyword arguments, no layers of calls. Only
    for host code that does nothing but launch through ``launcher`` (views aside): a stream operation, an event or a
    driver call would not be repeated. Runs the host code itself while a Triton launch hook is set, and where no
    replay can be made (``record_replay``). ``plain_first``: the first call runs plainly and the second records,
    for host code whose first call makes tensors it keeps (a table cached per shape: an ATen op no replay
    repeats)."""
    replay = launcher.replays.get(launch)
    if replay is not None and not launch_hooked():
        return replay(args)
    if replay is not None or launch in launcher.replays or launch_hooked():
        return host_code()
    if plain_first and (launch, FIRST_CALL) not in launcher.replays:
        launcher.replays[(launch, FIRST_CALL)] = None
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


class _Origins:
    """Where a recorded launch's arguments come from: the call's arguments (``sources``: top-level position, position
    in a tuple or None, tensor) or the prepared call's tensors (``kept``). A class, not closures: ``constant`` and
    ``resolved`` recurse into tuples, and nested functions that call themselves form a reference cycle, which would
    keep the recorded call's tensors alive until Python's collector runs (a model's activations would come back to
    the allocator at a time that depends on it, and later layers land on other addresses: new graph captures)."""

    def __init__(self, args: tuple, keep: tuple):
        self.sources = []
        for i, arg in enumerate(args):
            if isinstance(arg, torch.Tensor):
                self.sources.append((i, None, arg))
            elif isinstance(arg, tuple):
                self.sources += [(i, j, t) for j, t in enumerate(arg) if isinstance(t, torch.Tensor)]
        self.kept = held_tensors(keep)

    def address_of(self, tensor: torch.Tensor) -> tuple[int | None, int | None, int]:
        """(None, None, its address) when ``tensor`` is, or lies in, a tensor of ``keep``: a constant (the prepared
        call holds it; where it is also an argument, as a symmetric input is one of its peers, the prepared call's
        key holds that argument's address). Else where its address is in a call's arguments: (argument, tuple
        index or None, byte offset), when it is one of them or a view into one."""
        ptr = tensor.data_ptr()
        if any(t is tensor for t in self.kept) or _inside(ptr, self.kept):
            return None, None, ptr
        found = next(((i, j, 0) for i, j, t in self.sources if t is tensor), None)
        if found is not None:
            return found
        hits = [(i, j, t) for i, j, t in self.sources if _inside(ptr, (t,))]
        if not hits or len({t.data_ptr() for _, _, t in hits}) > 1:  # none, or overlapping arguments
            raise NotReplayable
        i, j, t = hits[0]
        return i, j, ptr - t.data_ptr()

    def constant(self, value) -> object:
        """``value`` as a constant launch argument (a kept tensor as its address), or NotReplayable."""
        if isinstance(value, torch.Tensor):
            i, _, ptr = self.address_of(value)
            if i is None:
                return ptr
        elif isinstance(value, (TensorDescriptor, TmaOperand)):  # (a TmaOperand is a tuple: before tuples)
            if isinstance(value.base, Address):
                return value
            i, _, ptr = self.address_of(value.base)
            if i is None:
                return TmaOperand(Address(ptr), tuple(value.shape), tuple(value.strides), tuple(value.block_shape),
                                  value.padding)
        elif isinstance(value, tuple):
            return tuple(self.constant(item) for item in value)
        elif value is None or isinstance(value, (bool, int, float, str, torch.dtype)):
            return value
        raise NotReplayable

    def resolved(self, value) -> tuple[Callable | None, object]:
        """(None, the value as a constant), or (a getter of the value for a call's arguments, None): descriptors,
        tuples and the tensors in them (a launch's own tensor arguments are its ``pointers``)."""
        try:
            return None, self.constant(value)
        except NotReplayable:
            pass
        if isinstance(value, torch.Tensor):
            i, j, offset = self.address_of(value)
            return (lambda call: (call[i] if j is None else call[i][j]).data_ptr() + offset), None
        if isinstance(value, (TensorDescriptor, TmaOperand)):
            i, j, offset = self.address_of(value.base)
            return Descriptor(i, j, offset, (tuple(value.shape), tuple(value.strides), tuple(value.block_shape),
                                             value.padding)), None
        if isinstance(value, tuple):
            parts = tuple(self.resolved(item) for item in value)
            return (lambda call: tuple(item if get is None else get(call) for get, item in parts)), None
        raise NotReplayable


def _inside(ptr: int, tensors) -> list:
    return [t for t in tensors if t.data_ptr() <= ptr < t.data_ptr() + _extent_bytes(t)]


def _replay_of(launcher: Launcher, args: tuple, launches: list, result: object, keep: tuple, checked: bool
               ) -> Callable[[tuple], object]:
    origins = _Origins(args, keep)
    planned = []
    for kernel, grid, launch_args in launches:
        pointers, others, constants = [], [], []
        for position, value in enumerate(launch_args):
            if isinstance(value, torch.Tensor):  # its address: a constant (kept), or from an argument
                i, j, offset = origins.address_of(value)
                constants.append(offset if i is None else None)
                if i is not None:
                    pointers.append((position, i, j, offset))
                continue
            get, fixed = origins.resolved(value)
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
                  [args[i].shape for i in tensors], returned, tuple(origins.kept)).function()


def _extent_bytes(tensor: torch.Tensor) -> int:
    """Bytes from a tensor's first element to just past its last one (its strides' span)."""
    if tensor.numel() == 0:
        return 0
    return (1 + sum((size - 1) * stride for size, stride in zip(tensor.shape, tensor.stride()))) * tensor.element_size()
