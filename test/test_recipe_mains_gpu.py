"""Every recipe and twin file runs on its own: ``torchrun --nproc-per-node N <file>`` runs its ``__main__``, which
checks the file's plain host function against NCCL / torch and prints its time per call.

One process per GPU (NCCL refuses two ranks on one GPU): with ``KRAKEN_WORLD_SIZE`` above the GPU count the files run
at the GPU count. The files run a few at a time (each its own ``torchrun --standalone``, its own port); on one GPU
they share it, which costs time, not correctness.
"""

from __future__ import annotations

import concurrent.futures
import os
import subprocess
import sys
from pathlib import Path

import torch

from gpu_utils import WORLD_SIZE, needs_gpus
from test_recipes_standalone_cpu import STANDALONE

pytestmark = needs_gpus
ROOT = Path(__file__).resolve().parent.parent
AT_ONCE = 8


def run_main(path: str, nproc: int) -> tuple[str, int, str, str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, (str(ROOT), os.environ.get("PYTHONPATH"))))}
    result = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                             f"--nproc-per-node={nproc}", path], cwd=ROOT, env=env, capture_output=True, text=True,
                            timeout=900)
    return path, result.returncode, result.stdout, result.stderr


def test_every_recipe_and_twin_runs_under_torchrun():
    assert len(STANDALONE) >= 36, STANDALONE  # every recipe and twin
    nproc = max(1, min(WORLD_SIZE, torch.cuda.device_count()))
    with concurrent.futures.ThreadPoolExecutor(AT_ONCE) as pool:
        results = list(pool.map(lambda path: run_main(path, nproc), STANDALONE))
    failed = [(path, rc, err[-1500:]) for path, rc, _, err in results if rc != 0]
    assert not failed, failed
    silent = [path for path, _, out, _ in results if "matches" not in out and "every row" not in out]
    assert not silent, f"no check reported by {silent}"
