import os
import sys

# The project root, so `import kraken`, `helion_ports`, `benchmark` work without installing.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
