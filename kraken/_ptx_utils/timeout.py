"""Barrier timeout, on by default: a barrier that never completes becomes an error, not a hang.

``KRAKEN_BARRIER_TIMEOUT_S`` (read when ``kraken`` is imported) sets it: unset, every spin loop of
``kraken._ptx_utils`` (the CAS send and wait, the epoch wait, the flag wait) gives up after
``DEFAULT_S`` (300) seconds; a positive number of seconds, after that long; ``0`` or ``off`` (any
case) turns it off. On, each loop reads ``%globaltimer`` before it spins and, once it has spun for
that long, writes what it was waiting for into a report page and executes ``trap``. Off, the PTX is
exactly the loop without any of this: no cost at all. On, a loop costs a timer read before it
spins and a timer read and compare per failed attempt (``python -m benchmark.timeout_cost`` measures
what that does to the recipes' time per call).

The report page is host memory mapped for the GPU at the fixed virtual address ``REPORT_ADDRESS``
(``kraken.runtime.timeout.arm_barrier_timeout`` maps it and starts a watchdog thread that prints the
report and exits the process). A trap leaves the CUDA context unusable, so the report travels through host
memory, not through anything the host would have to read back from the GPU. The address is a
constant so that the PTX text, and with it the compiled-kernel caches of Triton and Helion, is the
same in every process.

Record layout (uint32): [0] ``REPORT_MAGIC`` once written, [1] the barrier (``BARRIERS``), [2] the
block (``%ctaid.x``), [3] the rank (or ``NONE``), [4] the peer (the slot's rank, or ``NONE``).
"""

from __future__ import annotations

import os

ENV = "KRAKEN_BARRIER_TIMEOUT_S"
DEFAULT_S = 300.0  # unset: on, with this many seconds
MAX_S = 1e9  # (31 years) the nanoseconds must fit the PTX's 64-bit compare
REPORT_ADDRESS = 0x6F00_0000_0000
REPORT_BYTES = 4096
REPORT_MAGIC = 0x4B52_4B4E  # "KRKN"
NONE = 0xFFFF_FFFF
BARRIERS = {
    1: "signal send (compare-and-swap 0 -> 1 on the peer's slot: the peer has not consumed the last signal)",
    2: "signal wait (compare-and-swap 1 -> 0 on our slot: the peer never signalled)",
    3: "epoch wait (our slot never reached the round: the peer never arrived)",
    4: "flag wait (the flag never reached its value)",
}


def _seconds() -> float:
    """The timeout in seconds from ``ENV``: unset (or blank) -> ``DEFAULT_S``; ``0`` or ``off`` -> 0.0 (off);
    a positive number -> that; anything else raises, naming the variable and what it accepts."""
    text = os.environ.get(ENV, "").strip()
    if not text:
        return DEFAULT_S
    if text.lower() == "off":
        return 0.0
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not 0 <= value <= MAX_S:  # NaN, negative, not a number at all, or past what the PTX's u64 nanoseconds hold
        raise ValueError(f"{ENV}={text!r}: expected a number of seconds > 0 (at most {MAX_S:g}), or 0 or "
                         f"'off' to turn the barrier timeout off (unset: {DEFAULT_S:g} s)")
    return value


TIMEOUT_S = _seconds()

# Registers the guard uses; every asm block that spins declares them when the timeout is on.
REGISTERS = "\n    .reg .u64 %rd_t0, %rd_t1;\n    .reg .u32 %r_tb;\n    .reg .pred %p_late;" if TIMEOUT_S else ""


def start_clock() -> str:
    """PTX before a spin loop: remember when it started."""
    return "\n    mov.u64 %rd_t0, %globaltimer;" if TIMEOUT_S else ""


def give_up(label: str, barrier: int, rank: str = str(NONE), peer: str = str(NONE)) -> str:
    """PTX after a failed attempt of the loop at ``label``: spin again unless ``TIMEOUT_S`` has passed;
    then record (``barrier``, block, ``rank``, ``peer``: PTX operands) in the report page and trap."""
    if not TIMEOUT_S:
        return f"\n    @%p_spin bra {label};"
    return f"""
    @!%p_spin bra {label}_OK;
    mov.u64 %rd_t1, %globaltimer;
    sub.u64 %rd_t1, %rd_t1, %rd_t0;
    setp.lt.u64 %p_late, %rd_t1, {int(TIMEOUT_S * 1e9)};
    @%p_late bra {label};
    mov.u64 %rd_t1, {REPORT_ADDRESS};
    st.volatile.global.u32 [%rd_t1+4], {barrier};
    mov.u32 %r_tb, %ctaid.x;
    st.volatile.global.u32 [%rd_t1+8], %r_tb;
    st.volatile.global.u32 [%rd_t1+12], {rank};
    st.volatile.global.u32 [%rd_t1+16], {peer};
    membar.sys;
    st.volatile.global.u32 [%rd_t1], {REPORT_MAGIC};
    membar.sys;
    trap;
    {label}_OK:"""
