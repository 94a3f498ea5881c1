"""Helion twins of the kraken recipes: ``helion_ports.X.y`` computes what ``kraken.X.y`` does.

What the twins share lives in ``kraken._blocks.helion``; the fast path that runs them is
``kraken.runtime.helion_run``; ``helion_ports.<name>`` is the installed twin (``kraken.runtime.twins``).
"""

from kraken import _lazy_exports

# The public functions, loaded on first use (``kraken.runtime.twins``): importing a twin module loads none of them.
__getattr__, __dir__ = _lazy_exports(globals(), "kraken.runtime.twins")
