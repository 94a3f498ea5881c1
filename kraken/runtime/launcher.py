"""The host fast path, part two: launching a prepared call's kernels.

``jit_launch`` is Triton's own launch path (``kernel[grid](...)``), every recipe's default launcher.
``Launcher`` is a prepared call's cached one: after the first launch of a kernel through the JIT it calls the
compiled kernel's C launch function directly (``launch_function``), with host tensor descriptors
(``TmaOperand``, ``tma_operand``) turned into TMA maps once per address (``tensor_maps``; in a replay's code,
``Descriptor`` and ``MapsByAddress``).

``last_op`` lives here: the op last checked (``agreed``) or launched on this rank, which the barrier timeout's
report names (``kraken.runtime.timeout``). The launcher and the replays (``kraken.runtime.replay``, whose
generated code runs in this module's namespace) set it on every launch, so it is a global of this module: the
cheapest store there is.
"""

from __future__ import annotations

import contextlib
import sys
from typing import TYPE_CHECKING, Callable, Iterator, NamedTuple

import torch
from triton import knobs
from triton.runtime import _allocation
from triton.tools.tensor_descriptor import TensorDescriptor

from kraken.runtime import prepared

if TYPE_CHECKING:
    from kraken.runtime.replay import Recording

last_op = "none yet"  # the op last checked or launched on this rank: named by a barrier timeout


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
    kernel here too (``kraken.runtime.helion_run.run``).

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
        # cannot replay; (launch function, ``replay.FIRST_CALL``) -> None once its first call ran plainly
        self.replays: dict = {}
        self.recording: Recording | None = None  # what ``record_replay`` watches, while it runs (on one thread)

    def helion(self, kernel, args: tuple, kernel_args=None):
        """A twin's Helion kernel through this launcher (``kraken.runtime.helion_run.run``: replayed host code)."""
        return helion_run.run(kernel, args, self, kernel_args)

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
            if len(cache) >= prepared.MAX_PREPARED:
                cache.clear()
            value = cache[key] = tuple(encode(desc, meta))
        expanded[position:position + 1] = value
    return expanded


class Descriptor:
    """A host tensor descriptor as a replay reads it (``replay.Replay``): on a call's argument ``i`` (item ``j`` of a
    tuple) at ``offset`` bytes, its other fields (``rest``) fixed by the prepared call. Called on a call's arguments,
    the descriptor."""

    __slots__ = ("i", "j", "offset", "rest")

    def __init__(self, i: int, j: int | None, offset: int, rest: tuple):
        self.i, self.j, self.offset, self.rest = i, j, offset, rest

    def __call__(self, call: tuple) -> TmaOperand:
        base = call[self.i] if self.j is None else call[self.i][self.j]
        return TmaOperand(Address(base.data_ptr() + self.offset), *self.rest)


class MapsByAddress:
    """The TMA maps of one replayed descriptor by its base address (``replay.maps_in_line``): the replay fixes its
    other fields (``rest``), so the address alone names a map, where ``tensor_maps`` keys by every field of a
    descriptor made on every call. ``cache.get(address) or miss(address)``: a call's map fields."""

    def __init__(self, rest: tuple, meta, encode: Callable):
        self.cache: dict[int, tuple] = {}
        self.rest, self.meta, self.encode = rest, meta, encode

    def miss(self, address: int) -> tuple:
        if len(self.cache) >= prepared.MAX_PREPARED:
            self.cache.clear()
        value = self.cache[address] = tuple(self.encode(TmaOperand(Address(address), *self.rest), self.meta))
        return value


def _helion_plain(kernel, args: tuple, kernel_args=None):
    """A twin's Helion kernel called plainly, with Triton's scratch allocator set (``kraken._blocks.helion.run``
    hands a launcher's Helion kernels to its ``helion``)."""
    return helion_run.run(kernel, args, jit_launch, kernel_args)


jit_launch.helion = _helion_plain

# Last: ``helion_run`` imports this module's names above. Imported here, not inside ``Launcher.helion``: an import
# statement on every twin launch costs about a microsecond.
from kraken.runtime import helion_run  # noqa: E402
