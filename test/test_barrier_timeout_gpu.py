"""A rank that skips a call, with the barrier timeout on: every other rank reports which op and which
barrier gave up, and the job exits non-zero, within the timeout + 10 s, instead of hanging. One rank per GPU
(up to four); two ranks sharing a GPU where there is one."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
import time

from gpu_utils import GPU_COUNT, needs_gpus

pytestmark = needs_gpus

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TIMEOUT_S = 5
WORLD_SIZE = min(max(GPU_COUNT, 2), 4)

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
    if rank < dist.get_world_size() - 1:
        print(f"stuck call at {time.time()}", flush=True)
        kraken.one_shot_all_reduce(x)  # the last rank never makes this call
        torch.cuda.synchronize()
        print(f"rank {rank} came back", flush=True)
    else:
        time.sleep(120)
""")


def test_a_skipped_call_is_an_error_not_a_hang(tmp_path):
    script = tmp_path / "skip.py"
    script.write_text(SCRIPT)
    # On one GPU two ranks share it (KRAKEN_WORLD_SIZE), which is all this test needs.
    env = {**os.environ, "KRAKEN_BARRIER_TIMEOUT_S": str(TIMEOUT_S), "PYTHONPATH": ROOT, "PYTHONUNBUFFERED": "1",
           "KRAKEN_WORLD_SIZE": str(WORLD_SIZE)}
    result = subprocess.run(
        # The launcher looks at its ranks once a second, so the first rank's exit does not cut the others' reports.
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(WORLD_SIZE),
         "--monitor-interval", "1", str(script)],
        capture_output=True, text=True, env=env, cwd=ROOT, timeout=150,
    )
    ended = time.time()
    output = result.stdout + result.stderr
    assert result.returncode != 0, output[-3000:]
    assert "came back" not in output
    started = min(float(t) for t in re.findall(r"stuck call at ([\d.]+)", output))
    assert ended - started < TIMEOUT_S + 10, f"took {ended - started:.1f} s to report: {output[-3000:]}"
    last = WORLD_SIZE - 1
    for rank in range(last):  # every rank that made the call reports, naming the rank it waited for
        assert re.search(rf"kraken: a barrier gave up after 5 s \(KRAKEN_BARRIER_TIMEOUT_S\) in block \d+ on rank "
                         rf"{rank}, waiting for rank {last}: signal wait", output), (rank, output[-3000:])
    assert output.count("The last op checked on this rank was 'one_shot_all_reduce'") >= last
