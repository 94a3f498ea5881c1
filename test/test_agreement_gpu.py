"""One rank alone passes bad input on a new call signature: every rank raises, naming that rank, nothing
hangs, and a correct call afterwards is right (``kraken.runtime.agreement.agreed``). The Triton recipes of the
all-reduce and GEMM families; the bias/RMSNorm family checks the same per backend in its own file."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from gpu_utils import assert_close, heartbeat, needs_gpus, run_on_gpus

pytestmark = needs_gpus


def worker() -> None:
    import kraken
    from kraken import gemm_one_shot_all_reduce

    rank, last = dist.get_rank(), dist.get_world_size() - 1  # the rank that alone passes bad input
    bad = rank == last
    buf = kraken.symm_empty((3001,), torch.float32)
    buf.fill_(rank + 1.0)
    odd = kraken.symm_empty((61, 3), torch.float32)
    for fn in (kraken.one_shot_all_reduce, kraken.two_shot_all_reduce):
        name = fn.__name__
        heartbeat(name)
        with pytest.raises(ValueError, match=rf"^{name}: bad input on rank {last}: tensor must be contiguous"):
            fn(odd.t() if bad else odd)  # the last rank passes a transposed (non-contiguous) view
        # The last rank's TypeError. Alone (world size 1) it stays a TypeError; at 2+ ranks the ranks' signatures
        # also differ in the config, which makes it a ValueError on every rank.
        error = TypeError if dist.get_world_size() == 1 else ValueError
        with pytest.raises(error, match=rf"^{name}: bad input on rank {last}: unknown config keys \['bogus'\]"):
            fn(buf, **({"bogus": 1} if bad else {}))
        out = fn(buf)
        torch.cuda.synchronize()
        expected = sum(r + 1.0 for r in range(dist.get_world_size()))
        assert torch.all(out == expected).item(), f"{name} after one rank's errors"
        buf.fill_(rank + 1.0)  # the two-shot reduced in place

    heartbeat("gemm")
    gen = torch.Generator(device="cuda").manual_seed(rank)
    a = torch.randn(40, 64, generator=gen, device="cuda").to(torch.bfloat16)
    b = torch.randn(64, 24, generator=gen, device="cuda").to(torch.bfloat16)
    with pytest.raises(ValueError, match=f"bad input on rank {last}: a and b must have the same dtype"):
        gemm_one_shot_all_reduce(a, b.half() if bad else b, out_dtype=torch.float32)
    with pytest.raises(ValueError, match=f"bad input on rank {last}: out_dtype torch.float16 is not supported"):
        gemm_one_shot_all_reduce(a, b, out_dtype=torch.float16 if bad else torch.float32)
    out = gemm_one_shot_all_reduce(a, b, out_dtype=torch.float32)
    parts = [torch.empty_like(a) for _ in range(dist.get_world_size())], [torch.empty_like(b) for _ in range(dist.get_world_size())]
    dist.all_gather(parts[0], a)
    dist.all_gather(parts[1], b)
    reference = sum(x.double() @ y.double() for x, y in zip(*parts))
    torch.cuda.synchronize()
    assert_close(out, reference.float(), "gemm_one_shot_all_reduce after one rank's errors")


def test_one_rank_alone_with_bad_input_raises_on_every_rank():
    run_on_gpus(worker, name="agreement")
