"""Compile kernels for sm_90 without a GPU, and read what the compiler made.

``capture_launches()`` intercepts every Triton launch (a kraken recipe's
``kernel[grid](...)`` and the launch inside a Helion kernel's generated host
code alike) and records the kernel with its exact arguments instead of running
it; Helion is told the target has an H100/H200's SM count, TMA and host-built
tensor descriptors. ``compile_sm90`` then pushes a recorded launch through
Triton's own argument binder and compiler for an H100/H200 target, and
``kernel_stats`` reads the numbers the code inspector prints.

Used by the CPU tests (every kernel and port compiles, ports carry the same
barrier atomics) and by ``python -m benchmark.inspect``. The CPU tests that run
kernels in the Triton interpreter call ``fix_interpreter_scalars`` first.
"""

from __future__ import annotations

import collections
import contextlib
from dataclasses import dataclass
import os
import re
import subprocess
import tempfile
from typing import Iterator

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, make_backend
from triton.runtime.jit import JITFunction, create_function_from_signature

SM90 = GPUTarget("cuda", 90, 32)
H200_NUM_SMS = 132
FAKE_SIGNAL_PADS = 0x7F0000001000  # a device-address stand-in for the signal pads in CPU compile examples


def example_rank(world_size: int) -> int:
    """The rank a CPU compile example launches as: 1 (not the first, so rank offsets show), or 0 alone."""
    return min(1, world_size - 1)


@dataclass
class Launch:
    kernel: JITFunction
    args: tuple
    kwargs: dict
    grid: object


@contextlib.contextmanager
def capture_launches() -> Iterator[list[Launch]]:
    """Record Triton launches instead of running them (works on a machine with no GPU)."""
    import helion._compat
    from helion.autotuner.config_spec import ConfigSpec
    import helion.runtime

    launches: list[Launch] = []
    real_run = JITFunction.run
    real_num_sm = helion.runtime.get_num_sm
    real_tma = helion._compat._supports_tensor_descriptor
    real_supports_key = ConfigSpec.supports_config_key

    def record(self, *args, grid, warmup, **kwargs):
        launches.append(Launch(self, args, kwargs, grid))

    def num_sm(device, reserved_sms=0):
        if torch.device(device).type == "cpu":
            return H200_NUM_SMS - reserved_sms
        return real_num_sm(device, reserved_sms=reserved_sms)

    JITFunction.run = record
    helion.runtime.get_num_sm = num_sm
    # Helion asks the current GPU whether it has TMA; the target here is sm_90, which has.
    helion._compat._supports_tensor_descriptor = lambda: True
    # ... and host-built tensor descriptors, which Helion offers only when compiling for a CUDA device.
    ConfigSpec.supports_config_key = lambda spec, key: key == "host_tensor_descriptors" or real_supports_key(spec, key)
    try:
        yield launches
    finally:
        JITFunction.run = real_run
        helion.runtime.get_num_sm = real_num_sm
        helion._compat._supports_tensor_descriptor = real_tma
        ConfigSpec.supports_config_key = real_supports_key


def compile_sm90(launch: Launch):
    """Compile a recorded launch for sm_90 exactly as ``kernel[grid](...)`` would on an H200."""
    fn = launch.kernel
    backend = make_backend(SM90)
    binder = create_function_from_signature(fn.signature, fn.params, backend)
    kwargs = {k: v for k, v in launch.kwargs.items() if k in fn.arg_names or k in ("num_warps", "num_stages")}
    bound_args, specialization, options = binder(*launch.args, **kwargs)
    options, signature, constexprs, attrs = fn._pack_args(backend, kwargs, bound_args, specialization, options)
    return triton.compile(ASTSource(fn, signature, constexprs, attrs), target=SM90, options=options.__dict__)


_SYS_ATOMIC = re.compile(r"\b(?:atom|red)\.[\w.]*\bsys\b|\b(?:ld|st)\.[\w.]*(?:acquire|release|relaxed)\.sys\b")
_PTXAS_REGISTERS = re.compile(r"Used (\d+) registers")
_PTXAS_SPILLS = re.compile(r"(\d+) bytes spill stores, (\d+) bytes spill loads")


def _ptxas_resources(ptx: str) -> tuple[int, int]:
    """(registers, spill bytes) from ``ptxas -v`` on the kernel's PTX."""
    ptxas = triton.knobs.nvidia.ptxas.path
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "kernel.ptx")
        with open(path, "w") as f:
            f.write(ptx)
        arch = re.search(r"\.target\s+(sm_\w+)", ptx).group(1)
        result = subprocess.run(
            [ptxas, "-v", f"--gpu-name={arch}", path, "-o", os.devnull], capture_output=True, text=True, check=True
        )
    registers = int(_PTXAS_REGISTERS.search(result.stderr).group(1))
    spill_stores, spill_loads = (int(g) for g in _PTXAS_SPILLS.search(result.stderr).groups())
    return registers, spill_stores + spill_loads


def ptx_instructions(ptx: str) -> list[str]:
    """The instruction lines of a PTX listing (no directives, labels, braces or comments)."""
    lines = []
    for raw in ptx.splitlines():
        line = raw.split("//")[0].strip()
        if line.endswith(";") and not line.startswith("."):
            lines.append(line)
    return lines


def barrier_atomics(ptx: str) -> int:
    """System-scope atomics and acquire/release accesses: the cross-GPU barrier traffic."""
    return sum(barrier_opcodes(ptx).values())


def barrier_opcodes(ptx: str) -> collections.Counter:
    """Opcode of every barrier instruction, e.g. ``{'atom.global.release.sys.cas.b32': 1, ...}``."""
    return collections.Counter(line.split()[0] for line in ptx_instructions(ptx) if _SYS_ATOMIC.search(line))


def signal_rounds(ptx: str) -> int:
    """Barrier rounds of a kernel that signals through ``kraken._ptx_utils``: each round is one
    send (``CAS 0 -> 1`` on a peer's slot) and one wait (``CAS 1 -> 0`` on the local slot)."""
    lines = [line for line in ptx_instructions(ptx) if _SYS_ATOMIC.search(line)]
    sends = sum(1 for line in lines if ".sys.cas.b32" in line and line.endswith("], 0, 1;"))
    waits = sum(1 for line in lines if ".sys.cas.b32" in line and line.endswith("], 1, 0;"))
    if sends != waits:
        raise AssertionError(f"{sends} signal sends but {waits} waits: {lines}")
    return sends


def sass_instructions(launch: Launch) -> list[str]:
    """The kernel's sm_90 machine code (``nvdisasm`` of the cubin), one instruction per line.

    For schedules the PTX cannot show: ptxas reorders loads and arithmetic, and
    whether a thread's loads from every peer are all in flight before the first
    add (one NVLink round trip) or not (two) is decided here.
    """
    cubin = compile_sm90(launch).asm["cubin"]
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "kernel.cubin")
        with open(path, "wb") as f:
            f.write(cubin)
        listing = subprocess.run(
            [triton.knobs.nvidia.nvdisasm.path, "-c", path], capture_output=True, text=True, check=True
        ).stdout
    lines = (re.sub(r"/\*.*?\*/", "", line).strip().rstrip(";").strip() for line in listing.splitlines())
    return [line for line in lines if line and not line.startswith((".", "//"))]


def kernel_stats(launch: Launch) -> dict:
    """What the code inspector prints for one kernel."""
    compiled = compile_sm90(launch)
    ptx = compiled.asm["ptx"]
    registers, spills = _ptxas_resources(ptx)
    signature = compiled.src.signature

    def runtime_params(kind) -> int:  # a tuple argument counts once per element
        if isinstance(kind, (tuple, list)):
            return sum(runtime_params(k) for k in kind)
        return 0 if kind == "constexpr" else 1

    params = sum(runtime_params(kind) for kind in signature.values())
    return {
        "kernel": launch.kernel.fn.__name__,
        "source_chars": len(launch.kernel.src),
        "params": params,
        "registers": registers,
        "spill_bytes": spills,
        "shared_bytes": compiled.metadata.shared,
        "ptx_instructions": len(ptx_instructions(ptx)),
        "barrier_atomics": barrier_atomics(ptx),
        "ptx": ptx,
    }


def fix_interpreter_scalars() -> None:
    """Make Triton 3.6's interpreter work with numpy 2 (call it in a ``TRITON_INTERPRET=1`` process before
    launching): it holds scalars (a loop bound, a ``tl.minimum`` of scalars) as 1-element arrays and turns them
    into Python ints with ``int(array)``, which numpy 2 refuses for an array of shape (1,); give its tensors an
    ``__index__`` that takes the element."""
    import numpy as np
    from triton.runtime import interpreter

    original = interpreter._patch_lang_tensor
    if getattr(original, "fixes_scalars", False):
        return

    def patched(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(np.asarray(self.handle.data).reshape(-1)[0]))

    patched.fixes_scalars = True
    interpreter._patch_lang_tensor = patched
