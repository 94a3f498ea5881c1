"""The barrier timeout's host half (the device half is ``kraken._ptx_utils.timeout``).

On by default (``KRAKEN_BARRIER_TIMEOUT_S``: unset 300 s, 0 or "off" off). A barrier that gives up writes
a report to host memory mapped for the GPU at a fixed address and traps; the trap leaves the CUDA context
unusable, so a watchdog thread here reads that page, prints the report (``barrier_timeout_report``) and
exits the process. The first recipe call of a process (``agreed``, ``symm_context``) arms it on a GPU
(``arm_barrier_timeout``).
"""

from __future__ import annotations

import atexit
import ctypes
import os
import sys
import threading
import time

import torch
import torch.distributed as dist

from kraken._ptx_utils import timeout
from kraken.runtime import launcher

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
    """The message for a report page's first five words, or None if no barrier gave up: the op last checked or
    launched on this rank (``launcher.last_op``), the barrier, the block, and for a signal the rank and the peer that
    did not arrive (ranks in the op's group); this process's global rank; and how to turn the timeout off."""
    magic, barrier, block, rank, peer = words[:5]
    if magic != timeout.REPORT_MAGIC:
        return None
    who = "" if rank == timeout.NONE else f" on rank {rank}, waiting for rank {peer}"
    process = f" (global rank {dist.get_rank()})" if dist.is_available() and dist.is_initialized() else ""
    return (f"kraken: a barrier gave up after {timeout.TIMEOUT_S:g} s ({timeout.ENV}) in block {block}{who}: "
            f"{timeout.BARRIERS.get(barrier, f'barrier {barrier}')}. The last op checked on this rank was "
            f"{launcher.last_op!r}; a peer that never made the matching call (or crashed) is the usual cause. The "
            f"kernel trapped, so this process's CUDA context is unusable: exiting{process}. The timeout is on by "
            f"default: set {timeout.ENV}=0 to turn it off, or to more seconds to wait longer.")


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
