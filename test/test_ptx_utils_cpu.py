"""The barrier library: one PTX text per barrier, shared verbatim by Triton and the inline-Triton sources."""

from __future__ import annotations

import ast

import torch
import triton
import triton.language as tl

from kraken import sm90
from kraken._ptx_utils import arrive, get_flat_bid, get_flat_tid, inline_source, send_signal, symm_mem_sync, wait
from kraken._ptx_utils import wait_signal
from kraken._ptx_utils.gmem_barrier import GMEM_ARRIVE_PTX, GMEM_WAIT_PTX
from kraken._ptx_utils.symm_mem_barrier import SYMM_MEM_SYNC_PTX


def string_constants(source: str) -> list[str]:
    return [n.value for n in ast.walk(ast.parse(source)) if isinstance(n, ast.Constant) and isinstance(n.value, str)]


def test_inline_sources_embed_the_same_ptx():
    names = {"signal_pad_ptrs": "pads", "block_id": "bid", "rank": "r", "world_size": "4"}
    for key, ptx in SYMM_MEM_SYNC_PTX.items():
        formatted = inline_source.SYMM_MEM_SYNC[key].format(**names)
        assert ptx in string_constants(formatted), key
        assert formatted.count("tl.debug_barrier()") == int(key[0]) + int(key[1])
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


def test_every_barrier_compiles_for_sm90():
    flags = torch.zeros(4, dtype=torch.int32)
    data = torch.zeros(4, dtype=torch.int32)
    launch = sm90.Launch(every_barrier_kernel, (flags, data, 0x7F0000001000, 1, 3), {"num_warps": 4}, (1,))
    stats = sm90.kernel_stats(launch)
    # 2 syncs x (send + wait) + 2 x (send_signal + wait_signal) + arrive (st.release) + wait (ld.acquire)
    assert stats["barrier_atomics"] == 10, stats["barrier_atomics"]
    assert sm90.signal_rounds(stats["ptx"]) == 4  # the syncs' and send_signal/wait_signal's CAS pairs
    assert "%tid.x" in stats["ptx"] and "%ctaid.y" in stats["ptx"]
