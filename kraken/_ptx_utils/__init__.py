"""Every PTX barrier of the project, defined once (see each module's docstring)."""

from . import inline_source
from .gmem_barrier import arrive, wait, wait_async, wait_each_thread
from .symm_mem_barrier import (SIGNAL_SLOT_BYTES, barrier_blocks, epoch_send, epoch_sync, epoch_wait, get_flat_bid,
                               get_flat_tid, send_signal, symm_mem_sync, wait_signal)

__all__ = [
    "SIGNAL_SLOT_BYTES",
    "arrive",
    "barrier_blocks",
    "epoch_send",
    "epoch_sync",
    "epoch_wait",
    "get_flat_bid",
    "get_flat_tid",
    "inline_source",
    "send_signal",
    "symm_mem_sync",
    "wait",
    "wait_async",
    "wait_each_thread",
    "wait_signal",
]
