import os
import sys

# The project root, so `import kraken`, `helion_ports`, `benchmark` work without installing.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# The test suite runs with the opt-in barrier timeout on (kraken._ptx_utils.timeout): a barrier that never
# completes reports and exits instead of hanging. Long enough for one rank to compile kernels while another
# already waits at the first barrier.
os.environ.setdefault("KRAKEN_BARRIER_TIMEOUT_S", "180")
