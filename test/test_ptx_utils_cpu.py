"""The barrier library: one PTX text per barrier, shared verbatim by Triton and the inline-Triton sources."""

from __future__ import annotations

import ast

import torch
import triton
import triton.language as tl

from benchmark import sm90
from kraken._ptx_utils import arrive, epoch_sync, get_flat_bid, get_flat_tid, inline_source, send_signal, symm_mem_sync
from kraken._ptx_utils import wait, wait_signal
from kraken._ptx_utils.gmem_barrier import GMEM_ARRIVE_PTX, GMEM_WAIT_PTX
from kraken._ptx_utils.symm_mem_barrier import EPOCH_SYNC_PTX, SYMM_MEM_SYNC_PTX


def string_constants(source: str) -> list[str]:
    return [n.value for n in ast.walk(ast.parse(source)) if isinstance(n, ast.Constant) and isinstance(n.value, str)]


def test_inline_sources_embed_the_same_ptx():
    names = {"signal_pad_ptrs": "pads", "block_id": "bid", "rank": "r", "world_size": "4"}
    for key, ptx in SYMM_MEM_SYNC_PTX.items():
        formatted = inline_source.SYMM_MEM_SYNC[key].format(**names)
        assert ptx in string_constants(formatted), key
        assert formatted.count("tl.debug_barrier()") == int(key[0]) + int(key[1])
    formatted = inline_source.EPOCH_SYNC.format(**names, epoch="e + 1")
    assert EPOCH_SYNC_PTX in string_constants(formatted) and formatted.count("tl.debug_barrier()") == 2
    for snippet, ptx in ((inline_source.GMEM_ARRIVE, GMEM_ARRIVE_PTX), (inline_source.GMEM_WAIT, GMEM_WAIT_PTX)):
        assert ptx in string_constants(snippet.format(flag="f", value="1"))


def test_sync_semantics_follow_the_flags():
    assert "atom.global.relaxed.sys.cas" in SYMM_MEM_SYNC_PTX[(False, False)]
    assert "atom.global.release.sys.cas" in SYMM_MEM_SYNC_PTX[(True, False)]
    assert "atom.global.acquire.sys.cas" in SYMM_MEM_SYNC_PTX[(False, True)]
    both = SYMM_MEM_SYNC_PTX[(True, True)]
    assert "release.sys.cas" in both and "acquire.sys.cas" in both
    # The send sets 0 -> 1 and the wait resets 1 -> 0: the pad is zero again after every barrier.
    assert "], 0, 1;" in both and "], 1, 0;" in both


def test_epoch_barrier_posts_its_signal_and_waits_wrap_safe():
    # A posted release store of the epoch (no CAS round trip), an acquire spin until our slot reaches it,
    # compared as a signed difference so that 0x7fffffff -> 0x80000000 still counts as "reached".
    assert "st.global.release.sys.u32 [%rd_pad], $5;" in EPOCH_SYNC_PTX and ".cas" not in EPOCH_SYNC_PTX
    assert "ld.global.acquire.sys.u32 %r_old, [%rd_pad];" in EPOCH_SYNC_PTX
    assert "sub.s32 %r_old, %r_old, $5;" in EPOCH_SYNC_PTX and "setp.lt.s32 %p_spin, %r_old, 0;" in EPOCH_SYNC_PTX
    # The same slots as symm_mem_sync: slot block * world_size + rank on peer tid, our slot for peer tid.
    assert EPOCH_SYNC_PTX.count("mad.lo.u32 %r_slot, $2, $4, $3;") == 1
    assert EPOCH_SYNC_PTX.count("mad.lo.u32 %r_slot, $2, $4, %r_tid;") == 1


@triton.jit
def every_barrier_kernel(flag_ptr, data_ptr, signal_pad_ptrs, rank, world_size: tl.constexpr):
    tid = get_flat_tid()
    bid = get_flat_bid()
    tl.store(data_ptr + bid, tid)
    symm_mem_sync(signal_pad_ptrs, bid, rank, world_size, True, True)
    symm_mem_sync(signal_pad_ptrs, bid, rank, world_size, False, False)
    send_signal(flag_ptr + 1, "release")
    wait_signal(flag_ptr + 1, "acquire")
    send_signal(flag_ptr + 2, "relaxed")
    wait_signal(flag_ptr + 2, "relaxed")
    arrive(flag_ptr, 1)
    wait(flag_ptr, 1)
    epoch_sync(signal_pad_ptrs, bid, rank, world_size, tid + 1)


def test_every_barrier_compiles_for_sm90():
    flags = torch.zeros(4, dtype=torch.int32)
    data = torch.zeros(4, dtype=torch.int32)
    launch = sm90.Launch(every_barrier_kernel, (flags, data, 0x7F0000001000, 1, 3), {"num_warps": 4}, (1,))
    stats = sm90.kernel_stats(launch)
    # 2 syncs x (send + wait) + 2 x (send_signal + wait_signal) + arrive (st.release) + wait (ld.acquire)
    # + epoch_sync (st.release + ld.acquire)
    assert stats["barrier_atomics"] == 12, stats["barrier_atomics"]
    assert sm90.signal_rounds(stats["ptx"]) == 4  # the syncs' and send_signal/wait_signal's CAS pairs
    assert "%tid.x" in stats["ptx"] and "%ctaid.y" in stats["ptx"]
