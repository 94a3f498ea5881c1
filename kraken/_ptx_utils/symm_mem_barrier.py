"""Cross-GPU barriers over the symmetric-memory signal pad.

Every rank's allocation comes with a signal pad: an array of uint32 slots that
peers can reach over NVLink. Block ``b`` of rank ``r`` owns the slots
``pad[b * world_size + p]`` for every peer ``p`` on every rank, so one barrier
needs ``world_size`` slots per block id and never touches another block's.

A signal is a compare-and-swap at system scope:

* send: spin ``CAS(slot, 0 -> 1)`` on the *peer's* pad until it succeeds. If the
  slot is still 1, the peer has not consumed the previous signal yet and we wait.
* wait: spin ``CAS(slot, 1 -> 0)`` on *our own* pad. Consuming the signal resets
  the slot, so the pad is all zeros again after every completed barrier. No host
  reset is ever needed, which is what makes the kernels CUDA-graph safe.

``symm_mem_sync`` runs both in one asm block: thread ``t < world_size`` of the
block signals peer ``t`` and then waits for peer ``t``'s signal. The send is a
*release* when the block wrote memory that peers will read ("all my writes before
this are visible to you"), the wait an *acquire* when the block will read what
peers wrote ("all your writes before your signal are visible to me"). Otherwise
both are relaxed, which is cheaper.

The PTX below is the only copy of these barriers in the project: the
``@triton.jit`` helpers here wrap it, and ``inline_source.py`` embeds the very
same strings in the inline-Triton snippets that Helion ports paste in with
``hl.inline_triton``. With the barrier timeout on (the default: 300 s;
``KRAKEN_BARRIER_TIMEOUT_S`` sets the seconds, ``0`` turns it off), every spin loop
here gives up after that long, reports and traps (``timeout.py``).
"""

from __future__ import annotations

import triton
import triton.language as tl

from . import timeout

SIGNAL_SLOT_BYTES = 4  # one uint32 per (block id, peer)


def barrier_blocks(world_size: int, pad_bytes: int) -> int:
    """How many block ids a barrier can use on a signal pad of ``pad_bytes``: each needs ``world_size`` slots."""
    return pad_bytes // SIGNAL_SLOT_BYTES // world_size


# ---------------------------------------------------------------------------
# PTX text. Register names are local to the ``{ }`` scope of each asm block, so
# the blocks can be inlined any number of times in one kernel.
# ---------------------------------------------------------------------------


def _cas_spin(label: str, addr: str, sem: str, expected: int, desired: int, barrier: int, who: tuple[str, str]) -> str:
    """Spin on ``CAS(addr, expected -> desired)`` at system scope until it succeeds (or, with the barrier
    timeout on, until ``timeout.TIMEOUT_S`` has passed: then report ``barrier`` and ``who`` (rank, peer) and trap)."""
    return f"""{timeout.start_clock()}
    {label}:
    atom.global.{sem}.sys.cas.b32 %r_old, [{addr}], {expected}, {desired};
    setp.ne.u32 %p_spin, %r_old, {expected};{timeout.give_up(label, barrier, *who)}"""


_NOBODY = (str(timeout.NONE), str(timeout.NONE))  # a lone signal knows no rank or peer
_SYNC_WHO = ("$3", "%r_tid")  # in a sync, thread t signals and waits for peer t


def _send(addr: str, sem: str, who: tuple[str, str] = _NOBODY) -> str:
    return _cas_spin("SEND_SIGNAL", addr, sem, 0, 1, 1, who)


def _wait(addr: str, sem: str, who: tuple[str, str] = _NOBODY) -> str:
    return _cas_spin("WAIT_SIGNAL", addr, sem, 1, 0, 2, who)


def _signal_ptx(spin: str) -> str:
    # $0: dummy output, $1: address of the slot.
    return f"""{{
    .reg .u32 %r_old;
    .reg .pred %p_spin;{timeout.REGISTERS}{spin}
    mov.u32 $0, 0;
    }}"""


def _sync_ptx(send: str, wait: str) -> str:
    # $0: dummy output, $1: device array of every rank's signal-pad address
    # (uint64[world_size]), $2: block id, $3: rank, $4: world size (, $5: the epoch of ``epoch_sync``).
    # ``send`` signals the slot at %rd_pad on peer %r_tid, ``wait`` waits on our slot for that peer.
    # Either may be empty: one half of a barrier (``epoch_send``, ``epoch_wait``).
    peer_slot = """
    mul.wide.u32 %rd_off, %r_tid, 8;
    add.u64 %rd_pad, $1, %rd_off;
    ld.global.u64 %rd_pad, [%rd_pad];
    mad.lo.u32 %r_slot, $2, $4, $3;
    mul.wide.u32 %rd_off, %r_slot, 4;
    add.u64 %rd_pad, %rd_pad, %rd_off;"""
    my_slot = """
    mul.wide.u32 %rd_off, $3, 8;
    add.u64 %rd_pad, $1, %rd_off;
    ld.global.u64 %rd_pad, [%rd_pad];
    mad.lo.u32 %r_slot, $2, $4, %r_tid;
    mul.wide.u32 %rd_off, %r_slot, 4;
    add.u64 %rd_pad, %rd_pad, %rd_off;"""
    return f"""{{
    .reg .u32 %r_tid, %r_slot, %r_old;
    .reg .u64 %rd_pad, %rd_off;
    .reg .pred %p_idle, %p_spin;{timeout.REGISTERS}
    mov.u32 %r_tid, %tid.x;
    setp.ge.u32 %p_idle, %r_tid, $4;
    @%p_idle bra SYNC_DONE;{peer_slot + send if send else ""}{my_slot + wait if wait else ""}
    SYNC_DONE:
    mov.u32 $0, 0;
    }}"""


# The epoch barrier: send is a posted release store of the epoch (no round trip, unlike a CAS), wait
# spins on an acquire load until our slot has reached the epoch. Compared as a difference, so it
# survives the int32 wrap. A slot holds the last epoch its peer reached and is never reset, so this
# barrier needs a signal pad no other kind of barrier uses (torch's kernels expect 0/1 slots there).


def _epoch_send(sem: str) -> str:
    return f"""
    st.global.{sem}.sys.u32 [%rd_pad], $5;"""


_EPOCH_WAIT = f"""{timeout.start_clock()}
    EPOCH_WAIT:
    ld.global.acquire.sys.u32 %r_old, [%rd_pad];
    sub.s32 %r_old, %r_old, $5;
    setp.lt.s32 %p_spin, %r_old, 0;{timeout.give_up("EPOCH_WAIT", 3, *_SYNC_WHO)}"""
EPOCH_SYNC_PTX = _sync_ptx(_epoch_send("release"), _EPOCH_WAIT)
# Its halves, for a block that has something to do between them (``epoch_send``, ``epoch_wait``); the send relaxed.
EPOCH_SEND_PTX = _sync_ptx(_epoch_send("relaxed"), "")
EPOCH_WAIT_PTX = _sync_ptx("", _EPOCH_WAIT)
EPOCH_CONSTRAINTS = "=r,l,r,r,r,r"

SEND_SIGNAL_PTX = {sem: _signal_ptx(_send("$1", sem)) for sem in ("relaxed", "release")}
WAIT_SIGNAL_PTX = {sem: _signal_ptx(_wait("$1", sem)) for sem in ("relaxed", "acquire")}
# Keyed by (hasPreviousMemAccess, hasSubsequentMemAccess).
SYMM_MEM_SYNC_PTX = {
    (prev, subs): _sync_ptx(_send("%rd_pad", "release" if prev else "relaxed", _SYNC_WHO),
                            _wait("%rd_pad", "acquire" if subs else "relaxed", _SYNC_WHO))
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
_EPOCH_SYNC = tl.constexpr(EPOCH_SYNC_PTX)
_EPOCH_SEND = tl.constexpr(EPOCH_SEND_PTX)
_EPOCH_WAIT = tl.constexpr(EPOCH_WAIT_PTX)
_EPOCH_CONSTRAINTS = tl.constexpr(EPOCH_CONSTRAINTS)
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
    """Set the uint32 slot at ``addr`` (usually on a peer) from 0 to 1, spinning while it is 1."""
    if sem == "release":
        tl.inline_asm_elementwise(_SEND_RELEASE, _SIGNAL_CONSTRAINTS, [addr], dtype=tl.int32, is_pure=False, pack=1)
    else:
        tl.inline_asm_elementwise(_SEND_RELAXED, _SIGNAL_CONSTRAINTS, [addr], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def wait_signal(addr, sem: tl.constexpr = "acquire"):
    """Wait until the uint32 slot at ``addr`` is 1 and reset it to 0."""
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


@triton.jit
def _epoch_asm(PTX: tl.constexpr, signal_pad_ptrs, block_id, rank, world_size: tl.constexpr, epoch):
    # ``PTX`` (``EPOCH_SYNC_PTX`` or one of its halves) on its operands. Scalars may arrive as constexprs or tensors
    # of any int type: normalise.
    pads = tl.zeros([], tl.int64) + signal_pad_ptrs
    block = (tl.zeros([], tl.int32) + block_id).to(tl.int32)
    me = (tl.zeros([], tl.int32) + rank).to(tl.int32)
    peers = tl.zeros([], tl.int32) + world_size
    round_ = (tl.zeros([], tl.int32) + epoch).to(tl.int32)
    tl.inline_asm_elementwise(PTX, _EPOCH_CONSTRAINTS, [pads, block, me, peers, round_], dtype=tl.int32,
                              is_pure=False, pack=1)


@triton.jit
def epoch_sync(signal_pad_ptrs, block_id, rank, world_size: tl.constexpr, epoch):
    """Barrier between block ``block_id`` of every rank, release + acquire, on a private signal pad.

    Round ``epoch`` (counting up from 1 over the pad's life, the same on every rank) of
    block ``block_id``: every thread's earlier writes are visible to the peers, and theirs
    to every thread after it. Only for pads no other barrier uses (see ``EPOCH_SYNC_PTX``);
    ``kraken.runtime.symm.BlockWorkspace`` keeps the count per block.
    """
    tl.debug_barrier()
    _epoch_asm(_EPOCH_SYNC, signal_pad_ptrs, block_id, rank, world_size, epoch)
    tl.debug_barrier()


@triton.jit
def epoch_send(signal_pad_ptrs, block_id, rank, world_size: tl.constexpr, epoch):
    """The first half of ``epoch_sync``'s round ``epoch``: signal block ``block_id`` of every rank, and go on.

    Relaxed (no fence): only for a launch that wrote nothing the peers read before it (a group of one: no peers).
    ``epoch_wait`` (the same round) completes the barrier; nothing may touch the pad in between.
    """
    _epoch_asm(_EPOCH_SEND, signal_pad_ptrs, block_id, rank, world_size, epoch)


@triton.jit
def epoch_wait(signal_pad_ptrs, block_id, rank, world_size: tl.constexpr, epoch):
    """The second half of ``epoch_sync``'s round ``epoch`` (after ``epoch_send``'s): wait until block ``block_id``
    of every rank has sent it; their writes before their send are visible to every thread after it."""
    _epoch_asm(_EPOCH_WAIT, signal_pad_ptrs, block_id, rank, world_size, epoch)
    tl.debug_barrier()
