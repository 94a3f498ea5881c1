"""A rank that skips a call, with the barrier timeout on: the other rank reports which op and which
barrier gave up, and exits non-zero, within the timeout + 10 s, instead of hanging."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
import time

from gpu_utils import needs_gpus

pytestmark = needs_gpus

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TIMEOUT_S = 5

SCRIPT = textwrap.dedent("""
    import sys, time
    import torch, torch.distributed as dist
    from benchmark.launch import init_from_env
    init_from_env()
    import kraken
    rank = dist.get_rank()
    x = kraken.symm_empty(4096, torch.float32)
    x.fill_(1.0)
    kraken.one_shot_all_reduce(x)  # every rank: fine
    torch.cuda.synchronize()
    if rank == 0:
        print(f"stuck call at {time.time()}", flush=True)
        kraken.one_shot_all_reduce(x)  # rank 1 never makes this call
        torch.cuda.synchronize()
        print("rank 0 came back", flush=True)
    else:
        time.sleep(120)
""")


def test_a_skipped_call_is_an_error_not_a_hang(tmp_path):
    script = tmp_path / "skip.py"
    script.write_text(SCRIPT)
    # Two ranks whatever the GPU count: on one GPU they share it (KRAKEN_WORLD_SIZE), which is all this test needs.
    env = {**os.environ, "KRAKEN_BARRIER_TIMEOUT_S": str(TIMEOUT_S), "PYTHONPATH": ROOT, "PYTHONUNBUFFERED": "1",
           "KRAKEN_WORLD_SIZE": "2"}
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(script)],
        capture_output=True, text=True, env=env, cwd=ROOT, timeout=150,
    )
    ended = time.time()
    output = result.stdout + result.stderr
    assert result.returncode != 0, output[-3000:]
    assert "rank 0 came back" not in output
    started = float(re.search(r"stuck call at ([\d.]+)", output).group(1))
    assert ended - started < TIMEOUT_S + 10, f"took {ended - started:.1f} s to report: {output[-3000:]}"
    assert re.search(r"kraken: a barrier gave up after 5 s \(KRAKEN_BARRIER_TIMEOUT_S\) in block \d+ on rank 0, "
                     r"waiting for rank 1: signal wait", output), output[-3000:]
    assert "The last op checked on this rank was 'one_shot_all_reduce'" in output
