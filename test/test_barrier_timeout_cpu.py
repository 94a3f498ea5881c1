"""The barrier timeout without a GPU: on by default (300 s when the variable is unset), off with 0 or "off",
anything else refused at import; off, the barriers' PTX has none of it; on, every spin loop reads
%globaltimer, reports and traps, the kernels still compile for sm_90 with the same barrier atomics, and the
report page reads back as a message naming the op, the barrier, the block and the ranks, and how to turn the
timeout off."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from kraken._ptx_utils import timeout
from kraken.runtime import launcher
from kraken.runtime.timeout import barrier_timeout_report

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_with_timeout(code: str, seconds: str | None = "7.5") -> subprocess.CompletedProcess:
    """``code`` in a fresh interpreter with the variable set to ``seconds`` (None: unset)."""
    env = {**os.environ, timeout.ENV: seconds, "PYTHONPATH": ROOT}
    if seconds is None:
        del env[timeout.ENV]
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=ROOT)


@pytest.mark.parametrize("text,seconds", [(None, 300.0), ("", 300.0), ("  ", 300.0), ("0", 0.0), ("0.0", 0.0),
                                          ("off", 0.0), ("OFF", 0.0), (" Off ", 0.0), ("7.5", 7.5), ("600", 600.0)])
def test_the_setting_reads_on_by_default(text, seconds, monkeypatch):
    if text is None:
        monkeypatch.delenv(timeout.ENV, raising=False)
    else:
        monkeypatch.setenv(timeout.ENV, text)
    assert timeout._seconds() == seconds


@pytest.mark.parametrize("text", ["soon", "-1", "nan", "inf", "1e12", "no", "5s"])
def test_anything_else_is_refused(text, monkeypatch):
    monkeypatch.setenv(timeout.ENV, text)
    with pytest.raises(ValueError, match=f"{timeout.ENV}={text!r}: expected a number of seconds > 0 .*'off'"):
        timeout._seconds()


def test_unset_the_loops_give_up_after_300_s():
    code = (
        "from kraken._ptx_utils import symm_mem_barrier as s, gmem_barrier as g, timeout\n"
        "assert timeout.TIMEOUT_S == 300.0, timeout.TIMEOUT_S\n"
        "loops = [*s.SYMM_MEM_SYNC_PTX.values(), s.EPOCH_SYNC_PTX, *s.SEND_SIGNAL_PTX.values(), "
        "*s.WAIT_SIGNAL_PTX.values(), g.GMEM_WAIT_PTX]\n"
        "assert all('300000000000' in p and p.count('trap;') > 0 for p in loops)\n"
    )
    result = run_with_timeout(code, seconds=None)
    assert result.returncode == 0, result.stderr[-3000:]


def test_off_the_loops_are_plain():
    code = (
        "from kraken._ptx_utils import symm_mem_barrier as s, gmem_barrier as g\n"
        "loops = [*s.SYMM_MEM_SYNC_PTX.values(), s.EPOCH_SYNC_PTX, *s.SEND_SIGNAL_PTX.values(), "
        "*s.WAIT_SIGNAL_PTX.values(), g.GMEM_WAIT_PTX]\n"
        "assert not any('globaltimer' in p or 'trap' in p or '_OK' in p for p in loops)\n"
    )
    for setting in ("0", "off", "OFF"):
        result = run_with_timeout(code, seconds=setting)
        assert result.returncode == 0, result.stderr[-3000:]


def test_on_every_spin_loop_gives_up_and_compiles_for_sm90():
    code = (
        "import importlib, re\n"
        "from benchmark import registry\n"
        "from benchmark.ops import all_reduce\n"
        "from benchmark import sm90\n"
        "from kraken._ptx_utils import symm_mem_barrier as s, gmem_barrier as g, inline_source as i\n"
        "loops = [*s.SYMM_MEM_SYNC_PTX.values(), s.EPOCH_SYNC_PTX, *s.SEND_SIGNAL_PTX.values(), "
        "*s.WAIT_SIGNAL_PTX.values(), g.GMEM_WAIT_PTX]\n"
        "assert all(p.count('%globaltimer') == p.count('trap;') * 2 > 0 for p in loops)\n"
        "assert all('7500000000' in p for p in loops)\n"
        "assert all('%globaltimer' in snippet and 'trap;' in snippet for snippet in (i.EPOCH_SYNC, i.GMEM_WAIT))\n"
        "for path in ('kraken.comm.one_shot_all_reduce', 'helion_ports.comm.one_shot_all_reduce'):\n"
        "    with sm90.capture_launches() as launches:\n"
        "        all_reduce.example(importlib.import_module(path), 2)\n"
        "    stats = sm90.kernel_stats(launches[0])\n"
        "    assert stats['spill_bytes'] == 0 and stats['ptx'].count('trap;') == 4, path\n"
        "    print(path, dict(sm90.barrier_opcodes(stats['ptx'])))\n"
    )
    result = run_with_timeout(code)
    assert result.returncode == 0, result.stderr[-3000:]
    recipe, twin = (line.split(" ", 1)[1] for line in result.stdout.splitlines())
    assert recipe == twin  # the same barrier atomics on both sides, timeout included


def test_a_bad_setting_is_refused_at_import():
    result = run_with_timeout("import kraken", seconds="soon")
    assert result.returncode != 0 and "KRAKEN_BARRIER_TIMEOUT_S='soon': expected a number of seconds" in result.stderr


def test_report_page_reads_back_as_a_message(monkeypatch):
    monkeypatch.setattr(timeout, "TIMEOUT_S", 5.0)
    monkeypatch.setattr(launcher, "last_op", "one_shot_all_reduce")
    assert barrier_timeout_report([0, 2, 3, 0, 1]) is None
    message = barrier_timeout_report([timeout.REPORT_MAGIC, 2, 3, 0, 1])
    assert message.startswith("kraken: a barrier gave up after 5 s (KRAKEN_BARRIER_TIMEOUT_S) in block 3 on rank 0, "
                              "waiting for rank 1: signal wait")
    assert "The last op checked on this rank was 'one_shot_all_reduce'" in message
    assert "set KRAKEN_BARRIER_TIMEOUT_S=0 to turn it off" in message
    lone = barrier_timeout_report([timeout.REPORT_MAGIC, 4, 0, timeout.NONE, timeout.NONE])
    assert "in block 0: flag wait" in lone
