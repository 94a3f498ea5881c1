"""``kraken._blocks``, the device-side building blocks the recipes share: it imports nothing of the project (a
recipe copied out needs it, not the recipe it came from), and every function in it compiles for sm_90 inside the
recipes that call it (the compile tests of those recipes); here, its slice bounds and rank-ordered sum run in
Triton's interpreter on odd sizes (the interpreter cannot run ``copy_slice``'s loop over runtime bounds)."""

from __future__ import annotations

import ast
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_the_triton_blocks_import_only_triton():
    """``kraken/_blocks/__init__.py`` (what the Triton recipes import) needs neither Helion nor the project: a Triton
    recipe copied out runs without Helion installed (the twins' helpers are ``kraken._blocks.helion``)."""
    tree = ast.parse(open(os.path.join(ROOT, "kraken", "_blocks", "__init__.py")).read())
    imported = {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
    imported |= {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    assert imported <= {"__future__", "triton", "triton.language"}, imported


def test_shared_device_functions_live_in_blocks_only():
    """No recipe defines its own copy of a shared block: each is defined once, in ``kraken._blocks``."""
    names = {"copy_slice", "block_range", "sum_peers", "rms_normalize"}
    for folder in ("comm", "fused"):
        for name in os.listdir(os.path.join(ROOT, "kraken", folder)):
            if name.endswith(".py"):
                tree = ast.parse(open(os.path.join(ROOT, "kraken", folder, name)).read())
                defined = {node.name for node in tree.body if isinstance(node, ast.FunctionDef)}
                assert not defined & names, f"kraken/{folder}/{name} defines {defined & names}"


INTERPRETED = r'''
import torch, triton, triton.language as tl
from kraken._blocks import block_range, sum_peers

@triton.jit
def bounds(out, shard, chunk, numel):
    owner = tl.program_id(0)
    block = tl.program_id(1)
    start, end = block_range(owner, block, shard, chunk, numel)
    tl.store(out + (owner * tl.num_programs(1) + block) * 2, start)
    tl.store(out + (owner * tl.num_programs(1) + block) * 2 + 1, end)

@triton.jit
def summed_slice(peers_a, peers_b, summed, start, end, BLOCK: tl.constexpr):
    offsets = start + tl.arange(0, BLOCK)
    mask = offsets < end
    tl.store(summed + offsets, sum_peers((peers_a, peers_b), offsets, mask, 2), mask=mask)

numel, shard, chunk = 1003, 502, 200  # odd: the last shard is short, chunks end mid-shard
out = torch.zeros(2 * 3 * 2, dtype=torch.int32)
bounds[(2, 3)](out, shard, chunk, numel)
expected = [(o * shard + b * chunk, min(o * shard + b * chunk + chunk, o * shard + shard, numel))
            for o in range(2) for b in range(3)]
assert [tuple(p) for p in out.view(-1, 2).tolist()] == expected, out.view(-1, 2).tolist()
a, b = torch.randn(numel), torch.randn(numel)
summed = torch.full((numel,), -7.0)
for start, end in expected:
    if start < end:
        summed_slice[(1,)](a, b, summed, start, end, BLOCK=256)
assert torch.equal(summed, a + b)  # the slices cover every element once
print("ok")
'''


def test_block_slices_cover_every_element_once_and_sum_in_the_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": ROOT}
    result = subprocess.run([sys.executable, "-c", INTERPRETED], env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr[-2000:]
