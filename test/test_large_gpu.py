"""GPU test of calls past 2**31 elements: the collectives and the GEMM recipes take them (64-bit offsets, chosen
on the host), recipe and twin, against references on every element (the collectives) or on spot rows (the
GEMMs: a float64 product of a few rows, among them the last, whose offsets are the largest).

Inputs are small integers (exact in bf16, and their sums and products exact in fp32), drawn from a generator
seeded by rank, so that every rank rebuilds any peer's input for its reference. A tensor past 2**31 bf16
elements is 4 GiB: the test needs about 40 GiB per GPU and skips below that.
"""

from __future__ import annotations

import functools
import importlib

import pytest
import torch
import torch.distributed as dist

from benchmark.launch import spawn
from gpu_utils import GPU_COUNT, heartbeat, needs_gpus

pytestmark = [needs_gpus, pytest.mark.skipif(
    GPU_COUNT > 0 and torch.cuda.get_device_properties(0).total_memory < 40 * 2**30,
    reason="needs about 40 GiB per GPU (4 GiB tensors past 2**31 elements)")]
PAST = 2**31 + 2**20  # elements: past what 32-bit offsets reach, by a margin that no rounding takes back
BF16 = torch.bfloat16
PREFIXES = ("kraken", "helion_ports")


def values(seed: int, rank: int, shape: tuple, low: int = -4, high: int = 5) -> torch.Tensor:
    """Rank ``rank``'s input: small integers, the same on every rank that rebuilds it."""
    gen = torch.Generator(device="cuda").manual_seed(seed * 100 + rank)
    return torch.randint(low, high, shape, generator=gen, device="cuda", dtype=BF16)


def fn(prefix: str, module: str, name: str):
    return getattr(importlib.import_module(f"{prefix}.{module}"), name)


def check_collectives(world_size: int, rank: int) -> None:
    shard = -(-PAST // world_size // 64) * 64  # elements per rank: the output (gather) or the input (scatter) > 2**31
    mine = values(1, rank, (shard,))
    for prefix in PREFIXES:
        heartbeat(f"{prefix} all_gather")
        out = fn(prefix, "comm.all_gather", "all_gather")(mine)
        assert out.numel() == world_size * shard > 2**31
        for r in range(world_size):
            assert torch.equal(out[r * shard:(r + 1) * shard], values(1, r, (shard,))), f"{prefix} all_gather rank {r}"
        del out
    torch.cuda.empty_cache()

    x = values(2, rank, (world_size * shard,))
    expected = torch.zeros(shard, dtype=torch.float32, device="cuda")
    for r in range(world_size):
        expected += values(2, r, (world_size * shard,))[rank * shard:(rank + 1) * shard].float()
    for prefix in PREFIXES:
        heartbeat(f"{prefix} reduce_scatter")
        out = fn(prefix, "comm.reduce_scatter", "reduce_scatter")(x)
        assert torch.equal(out.float(), expected), f"{prefix} reduce_scatter"
        del out
    del expected
    torch.cuda.empty_cache()

    total = torch.zeros(world_size * shard, dtype=torch.float32, device="cuda")
    for r in range(world_size):
        total += values(2, r, (world_size * shard,)).float()
    for prefix in PREFIXES:
        for shot in ("one", "two"):
            heartbeat(f"{prefix} all_reduce shot={shot}")
            if (prefix, shot) == ("helion_ports", "two"):  # the twin refuses them (see its launch), before any launch
                with pytest.raises(ValueError, match="pass 2\\*\\*31 - 1"):
                    fn(prefix, "comm.all_reduce", "all_reduce")(x, shot=shot)
                continue
            summed = fn(prefix, "comm.all_reduce", "all_reduce")(x.clone(), shot=shot)
            assert torch.equal(summed.float(), total), f"{prefix} all_reduce shot={shot}"
            del summed
            torch.cuda.empty_cache()


def spot_rows(rows: int) -> torch.Tensor:
    """A few rows of an output of ``rows`` rows: the first, the last (the largest offsets), some between."""
    picks = {0, 1, rows // 2, rows - 2, rows - 1} | set(range(rows - 1, 0, -max(rows // 7, 1)))
    return torch.tensor(sorted(picks), device="cuda")


def check_gemms(world_size: int, rank: int) -> None:
    k, n = 64, 16448
    # gemm_reduce_scatter: this rank's band [M / ws, N] past 2**31 elements.
    band = -(-PAST // n // 128) * 128  # rows per rank, whole tiles
    m = world_size * band
    a, b = values(3, rank, (m, k)), values(4, rank, (k, n))
    assert band * n > 2**31
    rows = spot_rows(band)
    expected = sum(values(3, r, (m, k))[rank * band + rows].double() @ values(4, r, (k, n)).double()
                   for r in range(world_size))
    failures = forms_checked("gemm_reduce_scatter", a, b, (band, n), rows, expected)
    del a, b

    # all_gather_matmul: out [ws * M, N] past 2**31 elements.
    m = -(-PAST // (n * world_size) // 128) * 128  # my rows: the gathered output has world_size * m
    a, b = values(5, rank, (m, k)), values(6, rank, (k, n))
    rows = spot_rows(world_size * m)
    gathered = torch.cat([values(5, r, (m, k)) for r in range(world_size)])
    expected = gathered[rows].double() @ b.double()
    failures += forms_checked("all_gather_matmul", a, b, (world_size * m, n), rows, expected)
    assert not failures, "; ".join(failures)


def forms_checked(name: str, a: torch.Tensor, b: torch.Tensor, shape: tuple, rows: torch.Tensor,
                  expected: torch.Tensor) -> list[str]:
    """GEMM recipe ``name`` on (a, b), fused and sequential, and its twin, each spot-checked: what is wrong."""
    failures = []
    for prefix, form in (("kraken", "fused"), ("kraken", "sequential"), ("helion_ports", None)):
        what = f"{prefix} {name} form={form}"
        heartbeat(what)
        gemm = getattr(importlib.import_module(prefix), name)  # the installed recipe or twin (kraken.<name>)
        try:
            out = (functools.partial(gemm, form=form) if form else gemm)(a, b)
        except Exception as exc:  # noqa: BLE001 (every case runs; the test fails at the end with all of them)
            failures.append(f"{what}: {type(exc).__name__}: {exc}")
            continue
        failures += spot_check(out, shape, rows, expected, what)
        del out
        torch.cuda.empty_cache()
    return failures


def spot_check(out: torch.Tensor, shape: tuple, rows: torch.Tensor, expected: torch.Tensor, what: str) -> list[str]:
    """What is wrong with ``out`` (its shape, or its ``rows`` against ``expected``): [] if nothing."""
    if tuple(out.shape) != shape:
        return [f"{what}: shape {tuple(out.shape)}, expected {shape}"]
    got = out[rows].double()
    err = ((got - expected).norm() / expected.norm()).item()
    return [] if err < 1e-2 else [f"{what}: relative error {err:.2e} on rows {rows.tolist()}"]


def worker(check: str) -> None:
    world_size, rank = dist.get_world_size(), dist.get_rank()
    globals()[check](world_size, rank)
    torch.cuda.synchronize()
    dist.barrier()


@pytest.mark.parametrize("check", ["check_collectives", "check_gemms"])
def test_past_2_31_elements(check):
    # A 4 GiB reference takes longer between heartbeats than the usual 60 s on a busy host.
    spawn(worker, (check,), name=f"past 2**31: {check}", stall_s=300.0)
