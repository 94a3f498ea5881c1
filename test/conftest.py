import os
import sys

import pytest

# The project root, so `import kraken`, `helion_ports`, `benchmark` work without installing.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# The barrier timeout (kraken._ptx_utils.timeout) is on by default, 300 s: a barrier that never completes reports
# and exits instead of hanging. The suite shortens it to 180 s, so that a hung GPU test ends sooner; still long
# enough for one rank to compile kernels while another already waits at the first barrier.
os.environ.setdefault("KRAKEN_BARRIER_TIMEOUT_S", "180")


def pytest_collection_modifyitems(config, items):
    """Under pytest-xdist (the README's test command: ``-n auto --dist loadgroup``) every GPU test runs on one
    worker, one after another as without xdist: they spawn a process per GPU, and two files at once would share
    the GPUs. CPU tests (compiles, interpreters) spread over the other workers."""
    for item in items:
        if item.path.name.endswith("_gpu.py"):
            item.add_marker(pytest.mark.xdist_group("gpu"))
