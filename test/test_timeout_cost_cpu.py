"""benchmark.timeout_cost without a GPU: the bar's arithmetic (0.3 us or 1 %, whichever is larger), the merge of
several child runs per setting and the side-by-side table, from made-up records; and its --help."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from benchmark import timeout_cost as tc

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("off,on,word", [
    (10.0, 10.3, "ok"),  # +0.3 us on 10 us: the 0.3-us floor
    (10.0, 10.31, "OVER"),
    (100.0, 101.0, "ok"),  # +1 % on 100 us: 1 % is larger than 0.3 us
    (100.0, 101.1, "OVER"),
    (5.0, 4.0, "ok"),  # faster with it on: noise, within the bar
    (None, 4.0, "-"),
])
def test_verdict(off, on, word):
    diff, pct, got = tc.verdict(off, on)
    assert got == word
    if off is not None:
        assert diff == pytest.approx(on - off) and pct == pytest.approx(100 * (on - off) / off)


def record(op, backend, shape, us, loop_us, status="ok"):
    return {"op": op, "backend": backend, "shape": shape, "us": us, "loop_us": loop_us, "status": status}


def test_table_merges_runs_and_compares():
    ar, gemm = ("all_reduce", "triton_1shot", "4096"), ("gemm_all_reduce", "triton", "64x4096x4096")
    off = [[record(*ar, 5.0, 8.0), record(*gemm, 50.0, 60.0)], [record(*ar, 5.4, 8.4), record(*gemm, 52.0, 60.0)]]
    on = [[record(*ar, 5.5, 8.2), record(*gemm, None, None, "FAIL (rel err 1.0e+00)")],
          [record(*ar, 5.9, 8.4), record(*gemm, 51.0, 61.0)]]
    header, body, rows = tc.table(off, on)
    assert len(header) == len(body[0]) == 12
    one_shot, gemm = rows
    assert one_shot["op"] == "kraken.one_shot_all_reduce" and gemm["op"] == "kraken.gemm_one_shot_all_reduce"
    # medians of two runs: off 5.2, on 5.7 -> +0.5 us > max(0.3, 0.052): over; loop 8.2 vs 8.3: within
    assert one_shot["us"]["off"] == pytest.approx(5.2) and one_shot["us"]["on"] == pytest.approx(5.7)
    assert one_shot["us"]["verdict"] == "OVER" and one_shot["loop_us"]["verdict"] == "ok"
    assert body[0][:7] == ["kraken.one_shot_all_reduce", "4096", "5.20", "5.70", "0.50", "9.62", "OVER"]
    # a failed check in one run: its time is the other run's, and the row says the check failed
    assert gemm["us"]["on"] == 51.0 and gemm["us"]["verdict"] == "ok"
    assert gemm["status"]["on"].startswith("FAIL") and "check: off ok, on FAIL" in body[1][-1]


def test_help():
    result = subprocess.run([sys.executable, "-m", "benchmark.timeout_cost", "--help"], capture_output=True, text=True,
                            cwd=ROOT, env={**os.environ, "PYTHONPATH": ROOT})
    assert result.returncode == 0 and "--rounds" in result.stdout and "KRAKEN_BARRIER_TIMEOUT_S" in result.stdout
