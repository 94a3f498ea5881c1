"""Cross-GPU barriers over the symmetric-memory signal pad.

Every rank's allocation comes with a signal pad: an array of uint32 slots that
peers can reach over NVLink. Block ``b`` of rank ``r`` owns the slots
``pad[b * world_size + p]`` for every peer ``p`` on every rank, so one barrier
needs ``world_size`` slots per block id and never touches another block's.

Every slot is a counting semaphore at system scope:

* send: ``red.add(slot, 1)`` on the *peer's* pad. A reduction is posted: the
  thread does not wait for NVLink to answer, so a barrier costs one crossing
  instead of a compare-and-swap's round trip (about 1 us less per barrier on
  2x H200, measured on the GEMM + all-reduce recipe).
* wait: spin on a load of *our own* slot until it is non-zero, then
  ``red.add(slot, -1)``. The next wait on the slot is this thread's next access
  to the same address, which the memory model orders after the decrement. Consuming the signal takes it back off the count, so
  the pad is all zeros again once every barrier has completed. No host reset is
  ever needed, which is what makes the kernels CUDA-graph safe.

A slot counts rather than toggles, so a peer that runs ahead (it signals the
next barrier, or the next launch's, before we consumed its last signal) never
waits and never loses a signal. That is safe because every kernel here pairs
the same sender with the same waiter on a slot: block ``b`` of rank ``p``
signals block ``b`` of rank ``r`` on ``pad_r[b * world_size + p]``, and each
waits as often as the other signals. A kernel that laid out its slots
differently on the same pad could consume another kernel's late signal.

``symm_mem_sync`` runs both in one asm block: thread ``t < world_size`` of the
block signals peer ``t`` and then waits for peer ``t``'s signal. The send is a
*release* when the block wrote memory that peers will read ("all my writes before
this are visible to you"), the wait's load an *acquire* when the block will read
what peers wrote ("all your writes before your signal are visible to me").
Otherwise both are relaxed, which is cheaper.

The PTX below is the only copy of these barriers in the project: the
``@triton.jit`` helpers here wrap it, and ``inline_source.py`` embeds the very
same strings in the inline-Triton snippets that Helion ports paste in with
``hl.inline_triton``.
"""

from __future__ import annotations

import triton
import triton.language as tl

# ---------------------------------------------------------------------------
# PTX text. Register names are local to the ``{ }`` scope of each asm block, so
# the blocks can be inlined any number of times in one kernel.
# ---------------------------------------------------------------------------


def _send(addr: str, sem: str) -> str:
    """Add one to the slot at ``addr`` (posted: no reply is awaited)."""
    return f"""
    red.{sem}.sys.global.add.u32 [{addr}], 1;"""


def _wait(addr: str, sem: str) -> str:
    """Spin until the slot at ``addr`` is non-zero, then take one signal off it."""
    return f"""
    WAIT_SIGNAL:
    ld.{sem}.sys.global.u32 %r_old, [{addr}];
    setp.eq.u32 %p_spin, %r_old, 0;
    @%p_spin bra WAIT_SIGNAL;
    red.relaxed.sys.global.add.u32 [{addr}], 4294967295;"""


def _signal_ptx(spin: str) -> str:
    # $0: dummy output, $1: address of the slot.
    return f"""{{
    .reg .u32 %r_old;
    .reg .pred %p_spin;{spin}
    mov.u32 $0, 0;
    }}"""


def _sync_ptx(send_sem: str, wait_sem: str) -> str:
    # $0: dummy output, $1: device array of every rank's signal-pad address
    # (uint64[world_size]), $2: block id, $3: rank, $4: world size.
    return f"""{{
    .reg .u32 %r_tid, %r_old;
    .reg .u64 %rd_pad, %rd_off;
    .reg .pred %p_idle, %p_spin;
    mov.u32 %r_tid, %tid.x;
    setp.ge.u32 %p_idle, %r_tid, $4;
    @%p_idle bra SYNC_DONE;
    mul.wide.u32 %rd_off, %r_tid, 8;
    add.u64 %rd_pad, $1, %rd_off;
    ld.global.u64 %rd_pad, [%rd_pad];
    mad.lo.u32 %r_old, $2, $4, $3;
    mul.wide.u32 %rd_off, %r_old, 4;
    add.u64 %rd_pad, %rd_pad, %rd_off;{_send("%rd_pad", send_sem)}
    mul.wide.u32 %rd_off, $3, 8;
    add.u64 %rd_pad, $1, %rd_off;
    ld.global.u64 %rd_pad, [%rd_pad];
    mad.lo.u32 %r_old, $2, $4, %r_tid;
    mul.wide.u32 %rd_off, %r_old, 4;
    add.u64 %rd_pad, %rd_pad, %rd_off;{_wait("%rd_pad", wait_sem)}
    SYNC_DONE:
    mov.u32 $0, 0;
    }}"""


SEND_SIGNAL_PTX = {sem: _signal_ptx(_send("$1", sem)) for sem in ("relaxed", "release")}
WAIT_SIGNAL_PTX = {sem: _signal_ptx(_wait("$1", sem)) for sem in ("relaxed", "acquire")}
# Keyed by (hasPreviousMemAccess, hasSubsequentMemAccess).
SYMM_MEM_SYNC_PTX = {
    (prev, subs): _sync_ptx("release" if prev else "relaxed", "acquire" if subs else "relaxed")
    for prev in (False, True)
    for subs in (False, True)
}
SYNC_CONSTRAINTS = "=r,l,r,r,r"
SIGNAL_CONSTRAINTS = "=r,l"
FLAT_TID_PTX = "mov.u32 $0, %tid.x;"
FLAT_BID_PTX = """{
    .reg .u32 %r_x, %r_y, %r_z, %r_nx, %r_ny;
    mov.u32 %r_x, %ctaid.x;
    mov.u32 %r_y, %ctaid.y;
    mov.u32 %r_z, %ctaid.z;
    mov.u32 %r_nx, %nctaid.x;
    mov.u32 %r_ny, %nctaid.y;
    mad.lo.u32 %r_z, %r_z, %r_ny, %r_y;
    mad.lo.u32 $0, %r_z, %r_nx, %r_x;
    }"""

# Triton reads module globals only as constexprs.
_SEND_RELAXED = tl.constexpr(SEND_SIGNAL_PTX["relaxed"])
_SEND_RELEASE = tl.constexpr(SEND_SIGNAL_PTX["release"])
_WAIT_RELAXED = tl.constexpr(WAIT_SIGNAL_PTX["relaxed"])
_WAIT_ACQUIRE = tl.constexpr(WAIT_SIGNAL_PTX["acquire"])
_SYNC_RELAXED = tl.constexpr(SYMM_MEM_SYNC_PTX[(False, False)])
_SYNC_RELEASE = tl.constexpr(SYMM_MEM_SYNC_PTX[(True, False)])
_SYNC_ACQUIRE = tl.constexpr(SYMM_MEM_SYNC_PTX[(False, True)])
_SYNC_ACQ_REL = tl.constexpr(SYMM_MEM_SYNC_PTX[(True, True)])
_SYNC_CONSTRAINTS = tl.constexpr(SYNC_CONSTRAINTS)
_SIGNAL_CONSTRAINTS = tl.constexpr(SIGNAL_CONSTRAINTS)
_FLAT_TID = tl.constexpr(FLAT_TID_PTX)
_FLAT_BID = tl.constexpr(FLAT_BID_PTX)


@triton.jit
def get_flat_tid():
    """This thread's index in its block (Triton launches 1-D blocks)."""
    return tl.inline_asm_elementwise(_FLAT_TID, "=r", [], dtype=tl.int32, is_pure=True, pack=1)


@triton.jit
def get_flat_bid():
    """This block's index in the (up to 3-D) grid, flattened x-fastest."""
    return tl.inline_asm_elementwise(_FLAT_BID, "=r", [], dtype=tl.int32, is_pure=True, pack=1)


@triton.jit
def send_signal(addr, sem: tl.constexpr = "release"):
    """Add one signal to the uint32 slot at ``addr`` (usually on a peer's pad); never waits."""
    if sem == "release":
        tl.inline_asm_elementwise(_SEND_RELEASE, _SIGNAL_CONSTRAINTS, [addr], dtype=tl.int32, is_pure=False, pack=1)
    else:
        tl.inline_asm_elementwise(_SEND_RELAXED, _SIGNAL_CONSTRAINTS, [addr], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def wait_signal(addr, sem: tl.constexpr = "acquire"):
    """Wait until the uint32 slot at ``addr`` holds a signal and take it off."""
    if sem == "acquire":
        tl.inline_asm_elementwise(_WAIT_ACQUIRE, _SIGNAL_CONSTRAINTS, [addr], dtype=tl.int32, is_pure=False, pack=1)
    else:
        tl.inline_asm_elementwise(_WAIT_RELAXED, _SIGNAL_CONSTRAINTS, [addr], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def symm_mem_sync(
    signal_pad_ptrs,
    block_id,
    rank,
    world_size: tl.constexpr,
    hasPreviousMemAccess: tl.constexpr = False,
    hasSubsequentMemAccess: tl.constexpr = False,
):
    """Barrier between block ``block_id`` of every rank.

    ``signal_pad_ptrs`` is the int64 device address of the array holding every
    rank's signal-pad address (``handle.signal_pad_ptrs_dev``). Pass
    ``hasPreviousMemAccess=True`` when peers must see this block's earlier writes
    and ``hasSubsequentMemAccess=True`` when this block will read peers' writes.
    """
    # Scalars may arrive as constexprs or tensors of any int type: normalise.
    pads = tl.zeros([], tl.int64) + signal_pad_ptrs
    block = (tl.zeros([], tl.int32) + block_id).to(tl.int32)
    me = (tl.zeros([], tl.int32) + rank).to(tl.int32)
    peers = tl.zeros([], tl.int32) + world_size
    if hasPreviousMemAccess:
        # Every thread's writes happen before the signalling threads' release.
        tl.debug_barrier()
    if hasPreviousMemAccess and hasSubsequentMemAccess:
        tl.inline_asm_elementwise(
            _SYNC_ACQ_REL, _SYNC_CONSTRAINTS, [pads, block, me, peers], dtype=tl.int32, is_pure=False, pack=1
        )
    elif hasPreviousMemAccess:
        tl.inline_asm_elementwise(
            _SYNC_RELEASE, _SYNC_CONSTRAINTS, [pads, block, me, peers], dtype=tl.int32, is_pure=False, pack=1
        )
    elif hasSubsequentMemAccess:
        tl.inline_asm_elementwise(
            _SYNC_ACQUIRE, _SYNC_CONSTRAINTS, [pads, block, me, peers], dtype=tl.int32, is_pure=False, pack=1
        )
    else:
        tl.inline_asm_elementwise(
            _SYNC_RELAXED, _SYNC_CONSTRAINTS, [pads, block, me, peers], dtype=tl.int32, is_pure=False, pack=1
        )
    if hasSubsequentMemAccess:
        # The waiting threads' acquire happens before every thread's later reads.
        tl.debug_barrier()
