"""The host fast path on the GPUs: for every Triton recipe and Helion twin in the registry, the calls after
the first (prepared once, launched through the compiled kernel) return the same bits as the first call, on
fresh copies of the same inputs; after warm-up a bad call still raises on every rank, and a good one after
it is still right."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from gpu_utils import assert_close, heartbeat, needs_gpus, run_on_gpus

pytestmark = needs_gpus

CALLS = 30
OPS = ("all_reduce", "reduce_scatter", "all_gather", "all_reduce_bias", "all_reduce_bias_rms_norm",
       "gemm_all_reduce", "gemm_reduce_scatter", "all_gather_matmul")


def same_bits_worker() -> None:
    from benchmark import registry

    for name in OPS:
        op = registry.get(name)
        shape = op.default_shapes[0]
        backends = [b for pair in op.pairs for b in (pair.triton, pair.helion) if b in op.backends]
        for backend in backends:
            heartbeat(f"{name} {backend}")
            fn = op.backends[backend]
            first = fn(op.make_inputs(shape, torch.bfloat16, 7)).clone()
            for call in range(CALLS):
                out = fn(op.make_inputs(shape, torch.bfloat16, 7))  # fresh inputs: two-shot kernels work in place
                assert torch.equal(out, first), f"{name} {backend}: call {call + 2} differs from the first"
    torch.cuda.synchronize()


def test_warm_calls_give_the_first_calls_bits():
    run_on_gpus(same_bits_worker, name="fast path bits")


COLLECTIVES = ("comm.one_shot_all_reduce", "comm.two_shot_all_reduce", "comm.reduce_scatter", "comm.all_gather")


def staged_worker() -> None:
    """Ordinary (staged) inputs, recipes and twins: warm calls replay the whole call (a twin's staging copy is one
    of its launches), each on new values, some at a new address, against a float64 reference of every rank's."""
    import importlib

    world_size, rank = dist.get_world_size(), dist.get_rank()
    rows = 1003  # odd: tails
    for path in COLLECTIVES:
        for package in ("kraken", "helion_ports"):
            fn = getattr(importlib.import_module(package), path.rsplit(".", 1)[1])  # kraken.<name>, helion_ports.<name>
            numel = rows * world_size if "reduce_scatter" in path else rows
            buffers = [torch.empty(numel, dtype=torch.bfloat16, device="cuda") for _ in range(2)]
            for call in range(8):
                heartbeat(f"{package}.{path} call {call}")
                values = [torch.randn(numel, generator=torch.Generator().manual_seed(100 * call + r)).to(torch.bfloat16)
                          for r in range(world_size)]
                x = buffers[call % 3 == 2]  # mostly the same address (the replay), now and then another
                x.copy_(values[rank])
                out = fn(x)
                everyone = torch.stack([v.double() for v in values])
                if "all_gather" in path:
                    ref = everyone.flatten()
                elif "reduce_scatter" in path:
                    ref = everyone.sum(0)[rank * rows:(rank + 1) * rows]
                else:
                    ref = everyone.sum(0)
                assert_close(out.cpu(), ref, f"{package}.{path} call {call}")
                if "two_shot" in path:
                    assert out is x, "two-shot sums in place"
                else:
                    assert torch.equal(x.cpu(), values[rank]), f"{package}.{path}: the input changed"
    torch.cuda.synchronize()


def test_staged_inputs_replay_the_whole_call():
    run_on_gpus(staged_worker, name="staged calls")


def bad_after_warm_worker() -> None:
    import kraken
    from kraken import one_shot_all_reduce_bias

    rank, last = dist.get_rank(), dist.get_world_size() - 1  # the rank that alone passes bad input
    bad = rank == last
    world_size = dist.get_world_size()
    x = torch.full((8, 512), rank + 1.0, dtype=torch.bfloat16, device="cuda")
    bias = torch.full((512,), 0.5, dtype=torch.bfloat16, device="cuda")
    buf = kraken.symm_empty((4096,), torch.float32)
    expected = sum(r + 1.0 for r in range(world_size))
    for _ in range(10):  # warm: the signature is prepared and its kernels launch through the compiled path
        heartbeat("warm")
        buf.fill_(rank + 1.0)
        assert torch.all(kraken.one_shot_all_reduce(buf) == expected).item()
        assert torch.all(one_shot_all_reduce_bias(x, bias) == expected + 0.5).item()
    # A mistake is caught where a signature is new on every rank (one made on one rank alone in a call whose
    # signature is warm elsewhere cannot be, without a collective per call: see kraken.runtime.agreement.agreed).
    x2 = torch.full((16, 512), rank + 1.0, dtype=torch.bfloat16, device="cuda")
    with pytest.raises(ValueError, match=f"bad input on rank {last}: bias must have shape"):
        one_shot_all_reduce_bias(x2, bias[:-1] if bad else bias)
    buf2 = kraken.symm_empty((2048,), torch.float32)
    with pytest.raises(ValueError, match=f"bad input on rank {last}: tensor has dtype int32"):
        kraken.one_shot_all_reduce(buf2.view(torch.int32) if bad else buf2)
    staged = kraken.one_shot_all_reduce(torch.ones(4096, device="cuda"))  # every rank: an ordinary tensor, staged
    assert torch.all(staged == world_size).item(), "an ordinary input after the errors"
    buf.fill_(rank + 1.0)
    assert torch.all(kraken.one_shot_all_reduce(buf) == expected).item(), "a good call after the errors"
    assert torch.all(one_shot_all_reduce_bias(x, bias) == expected + 0.5).item()
    torch.cuda.synchronize()


def test_bad_input_after_warm_up_still_raises_on_every_rank():
    run_on_gpus(bad_after_warm_worker, name="fast path errors")
