"""Calls past 2**31 elements, without a GPU: the GEMM recipes accept them and compile their 64-bit epilogue for
sm_90 only where the output needs it (``WIDE``), without spills; the collectives' plans are in
``test_gather_scatter_cpu``. ``test_large_gpu`` runs them at those sizes."""

from __future__ import annotations

import importlib
import re

import pytest
import torch

from benchmark import sm90
from benchmark.ops import all_gather_matmul as agm_op, gemm_reduce_scatter as grs_op
from kraken.runtime import gemm_checks

agm = importlib.import_module("kraken.fused.all_gather_matmul")
grs = importlib.import_module("kraken.fused.gemm_reduce_scatter")

S64 = re.compile(r"\bmul\.lo\.s64\b")


def launched(example, module, monkeypatch, wide: bool):
    """The kernel launch of ``example(module)``; ``wide``: as if its output were past 2**31 elements."""
    if wide:
        monkeypatch.setattr(module, "MAX_INDEX", 0)
    with sm90.capture_launches() as launches:
        example(module)
    monkeypatch.undo()
    (launch,) = launches
    return launch


@pytest.mark.parametrize("module,example", [
    (grs, lambda module: grs_op.example(module, 2, shape=(1024, 1024, 256))),
    (agm, lambda module: agm_op.example(module, 2, shape=(512, 1024, 256))),
], ids=["gemm_reduce_scatter", "all_gather_matmul"])
def test_the_epilogue_goes_64_bit_only_past_2_31_elements(module, example, monkeypatch):
    narrow, wide = (launched(example, module, monkeypatch, w) for w in (False, True))
    assert narrow.kwargs["WIDE"] is False and wide.kwargs["WIDE"] is True
    stats = {w: sm90.kernel_stats(launch) for w, launch in ((False, narrow), (True, wide))}
    for s in stats.values():
        assert s["spill_bytes"] == 0, f"{s['kernel']} spills {s['spill_bytes']} bytes"
    # The store's row offsets: 64-bit products of the row and N under WIDE (more of them: one per store loop).
    assert len(S64.findall(stats[True]["ptx"])) > len(S64.findall(stats[False]["ptx"]))


def test_gemm_checks_refuse_past_2_31_only_where_the_recipe_is_not_wide(monkeypatch):
    """``check_inputs`` keeps its 32-bit limit for a recipe that addresses its output in 32 bits; ``wide`` lifts it."""
    monkeypatch.setattr(gemm_checks.groups, "check_tensor", lambda *args, **kwargs: None)  # CPU stand-ins
    a, b = torch.empty(2**16, 8, dtype=torch.bfloat16, device="meta"), torch.empty(8, 2**15 + 1, dtype=torch.bfloat16,
                                                                                     device="meta")
    with pytest.raises(ValueError, match="more than 2\\*\\*31 - 1 elements"):
        gemm_checks.check_inputs(a, b, torch.bfloat16, "gemm_one_shot_all_reduce")
    gemm_checks.check_inputs(a, b, torch.bfloat16, "gemm_reduce_scatter", wide=True)
