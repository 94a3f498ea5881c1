"""Arrive/wait on a flag in global memory.

For producer/consumer hand-offs inside one launch (one block publishes a tile,
another consumes it) or across GPUs when the flag lives in symmetric memory.

* ``arrive(flag, value)``: every thread of the block has finished its writes
  (thread barrier), then one thread stores ``value`` with *release* semantics at
  system scope: "all writes before this are visible to whoever sees the flag".
* ``wait(flag, value)``: one thread spins on an *acquire* load until the flag
  equals ``value``, then the block's thread barrier lets everyone read what the
  producer wrote.

Flags count epochs (1, 2, 3, ...) rather than toggling, so nothing needs to
reset them between uses within a launch; reset them on the host (or in a later
kernel) before reusing the same values.
"""

from __future__ import annotations

import triton
import triton.language as tl

from . import timeout

# $0: dummy output, $1: flag address, $2: value.
GMEM_ARRIVE_PTX = """{
    .reg .u32 %r_tid;
    .reg .pred %p_idle;
    mov.u32 %r_tid, %tid.x;
    setp.ne.u32 %p_idle, %r_tid, 0;
    @%p_idle bra ARRIVE_DONE;
    st.global.release.sys.u32 [$1], $2;
    ARRIVE_DONE:
    mov.u32 $0, 0;
    }"""
GMEM_WAIT_PTX = f"""{{
    .reg .u32 %r_tid, %r_seen;
    .reg .pred %p_idle, %p_spin;{timeout.REGISTERS}
    mov.u32 %r_tid, %tid.x;
    setp.ne.u32 %p_idle, %r_tid, 0;
    @%p_idle bra WAIT_DONE;{timeout.start_clock()}
    WAIT_FLAG:
    ld.global.acquire.sys.u32 %r_seen, [$1];
    setp.ne.u32 %p_spin, %r_seen, $2;{timeout.give_up("WAIT_FLAG", 4)}
    WAIT_DONE:
    mov.u32 $0, 0;
    }}"""
GMEM_CONSTRAINTS = "=r,l,r"

_ARRIVE = tl.constexpr(GMEM_ARRIVE_PTX)
_WAIT = tl.constexpr(GMEM_WAIT_PTX)
_CONSTRAINTS = tl.constexpr(GMEM_CONSTRAINTS)


@triton.jit
def arrive(flag_ptr, value):
    """Publish this block's writes, then set ``*flag_ptr = value`` (release, system scope)."""
    tl.debug_barrier()
    v = (tl.zeros([], tl.int32) + value).to(tl.int32)
    tl.inline_asm_elementwise(_ARRIVE, _CONSTRAINTS, [flag_ptr, v], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def wait(flag_ptr, value):
    """Block until ``*flag_ptr == value`` (acquire, system scope), then let every thread read."""
    v = (tl.zeros([], tl.int32) + value).to(tl.int32)
    tl.inline_asm_elementwise(_WAIT, _CONSTRAINTS, [flag_ptr, v], dtype=tl.int32, is_pure=False, pack=1)
    tl.debug_barrier()


# After an acquire, a block that reads the flagged data through TMA (the async proxy) needs a proxy fence:
# the acquire orders the generic proxy only, and the data may have been written by the copy engine or by
# other SMs' generic stores. Every thread runs it (the thread that issues a TMA load is Triton's choice).
FENCE_PROXY_ASYNC_PTX = """{
    fence.proxy.async.global;
    mov.u32 $0, 0;
    }"""
FENCE_CONSTRAINTS = "=r"
_FENCE_PROXY_ASYNC = tl.constexpr(FENCE_PROXY_ASYNC_PTX)
_FENCE_CONSTRAINTS = tl.constexpr(FENCE_CONSTRAINTS)


@triton.jit
def wait_async(flag_ptr, value):
    """``wait``, then ``fence.proxy.async.global`` in every thread: for blocks that read what the flag
    guards through TMA descriptors (data landed by the copy engine or by another SM's stores)."""
    v = (tl.zeros([], tl.int32) + value).to(tl.int32)
    tl.inline_asm_elementwise(_WAIT, _CONSTRAINTS, [flag_ptr, v], dtype=tl.int32, is_pure=False, pack=1)
    tl.debug_barrier()
    tl.inline_asm_elementwise(_FENCE_PROXY_ASYNC, _FENCE_CONSTRAINTS, [], dtype=tl.int32, is_pure=False, pack=1)


# For warp-specialized kernels (``tl.range(..., warp_specialize=True)``): a partition cannot meet the others at a CTA
# barrier (they never arrive) and need not hold thread 0, so every thread of it spins on its own acquire load, then
# fences the async proxy (TMA reads what the flag guards). The output is 0: the caller adds it into the coordinates of
# the TMA loads the flag guards, and that data dependency puts the wait in the partition that issues them.
GMEM_WAIT_EACH_THREAD_PTX = f"""{{
    .reg .u32 %r_seen;
    .reg .pred %p_spin;{timeout.REGISTERS}{timeout.start_clock()}
    WAIT_EACH:
    ld.global.acquire.sys.u32 %r_seen, [$1];
    setp.ne.u32 %p_spin, %r_seen, $2;{timeout.give_up("WAIT_EACH", 4)}
    fence.proxy.async.global;
    mov.u32 $0, 0;
    }}"""
_WAIT_EACH_THREAD = tl.constexpr(GMEM_WAIT_EACH_THREAD_PTX)


@triton.jit
def wait_each_thread(flag_ptr, value):
    """Every thread spins until ``*flag_ptr == value`` (acquire, system scope), then fences the async proxy; no
    thread barrier. Returns 0, to add into the coordinates of the loads it guards (see above)."""
    v = (tl.zeros([], tl.int32) + value).to(tl.int32)
    return tl.inline_asm_elementwise(_WAIT_EACH_THREAD, _CONSTRAINTS, [flag_ptr, v], dtype=tl.int32, is_pure=False,
                                     pack=1)
