"""The barriers as inline-Triton source, for ``hl.inline_triton`` in Helion ports.

Helion pastes a snippet into its generated kernel after ``str.format``-ing it
with the names of the arguments, and the generated module imports only torch,
triton and ``tl``. So each snippet carries its PTX as a string literal, built
here from the very strings in ``symm_mem_barrier`` and ``gmem_barrier`` (never a
second copy), with literal braces doubled for ``str.format``.

Use::

    hl.inline_triton(
        SYMM_MEM_SYNC[(True, True)],
        args={"signal_pad_ptrs": signal_pad_ptrs, "block_id": tile.id,
              "rank": rank, "world_size": world_size},
        output_like=None,
    )
"""

from __future__ import annotations

from .gmem_barrier import (FENCE_CONSTRAINTS, FENCE_PROXY_ASYNC_PTX, GMEM_ARRIVE_PTX, GMEM_CONSTRAINTS,
                           GMEM_WAIT_EACH_THREAD_PTX, GMEM_WAIT_PTX)
from .symm_mem_barrier import (EPOCH_CONSTRAINTS, EPOCH_SEND_PTX, EPOCH_SYNC_PTX, EPOCH_WAIT_PTX, SYMM_MEM_SYNC_PTX,
                               SYNC_CONSTRAINTS)


def _literal(text: str) -> str:
    """``text`` as a Python literal that survives ``str.format``."""
    return repr(text).replace("{", "{{").replace("}", "}}")


def _asm(ptx: str, constraints: str, operands: str) -> str:
    return (
        f"tl.inline_asm_elementwise({_literal(ptx)}, {constraints!r}, [{operands}], "
        "dtype=tl.int32, is_pure=False, pack=1)"
    )


_SYNC_OPERANDS = (
    "tl.zeros([], tl.int64) + {signal_pad_ptrs}, "
    "(tl.zeros([], tl.int32) + {block_id}).to(tl.int32), "
    "(tl.zeros([], tl.int32) + {rank}).to(tl.int32), "
    "tl.zeros([], tl.int32) + {world_size}"
)


def _sync_source(has_previous: bool, has_subsequent: bool) -> str:
    lines = [_asm(SYMM_MEM_SYNC_PTX[(has_previous, has_subsequent)], SYNC_CONSTRAINTS, _SYNC_OPERANDS)]
    # Same thread barriers as kraken._ptx_utils.symm_mem_sync.
    if has_previous:
        lines.insert(0, "tl.debug_barrier()")
    if has_subsequent:
        lines.append("tl.debug_barrier()")
    return "\n".join(lines)


# symm_mem_sync, keyed by (hasPreviousMemAccess, hasSubsequentMemAccess).
# Placeholders: signal_pad_ptrs, block_id, rank, world_size.
SYMM_MEM_SYNC = {(p, s): _sync_source(p, s) for p in (False, True) for s in (False, True)}
# epoch_sync (always release + acquire). Placeholders: signal_pad_ptrs, block_id, rank, world_size, epoch.
_EPOCH_OPERANDS = _SYNC_OPERANDS + ", (tl.zeros([], tl.int32) + {epoch}).to(tl.int32)"
EPOCH_SYNC = "\n".join(
    ["tl.debug_barrier()", _asm(EPOCH_SYNC_PTX, EPOCH_CONSTRAINTS, _EPOCH_OPERANDS), "tl.debug_barrier()"])
# Its halves, as ``epoch_send`` (relaxed) and ``epoch_wait``. Placeholders: those of EPOCH_SYNC.
EPOCH_SEND = _asm(EPOCH_SEND_PTX, EPOCH_CONSTRAINTS, _EPOCH_OPERANDS)
EPOCH_WAIT = _asm(EPOCH_WAIT_PTX, EPOCH_CONSTRAINTS, _EPOCH_OPERANDS) + "\ntl.debug_barrier()"

_FLAG_OPERANDS = "{flag}, (tl.zeros([], tl.int32) + {value}).to(tl.int32)"
# Placeholders: flag (a pointer expression), value.
GMEM_ARRIVE = "tl.debug_barrier()\n" + _asm(GMEM_ARRIVE_PTX, GMEM_CONSTRAINTS, _FLAG_OPERANDS)
GMEM_WAIT = _asm(GMEM_WAIT_PTX, GMEM_CONSTRAINTS, _FLAG_OPERANDS) + "\ntl.debug_barrier()"
# A plain thread barrier (bar.sync), for ports that need one between phases.
THREAD_BARRIER = "tl.debug_barrier()"
# GMEM_WAIT, then every thread's async-proxy fence (``gmem_barrier.wait_async``: TMA reads what the flag guards).
GMEM_WAIT_ASYNC = GMEM_WAIT + "\n" + (
    f"tl.inline_asm_elementwise({_literal(FENCE_PROXY_ASYNC_PTX)}, {FENCE_CONSTRAINTS!r}, [], "
    "dtype=tl.int32, is_pure=False, pack=1)"
)
# ``gmem_barrier.wait_each_thread`` (warp-specialized kernels: every thread spins, then fences the async proxy; no
# thread barrier). Its value is an int32 0: add it into the coordinates of the TMA loads the flag guards. Placeholders:
# flag (a pointer expression), value.
GMEM_WAIT_EACH_THREAD = _asm(GMEM_WAIT_EACH_THREAD_PTX, GMEM_CONSTRAINTS, _FLAG_OPERANDS)
