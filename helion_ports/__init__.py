"""Helion twins of the kraken recipes: ``helion_ports.X.y`` computes what ``kraken.X.y`` does.

What the twins share lives in ``kraken._blocks.helion``; the fast path that runs them is
``kraken.runtime.helion_run``; ``helion_ports.<name>`` is the installed twin (``kraken.runtime.twins``).
"""


def __getattr__(name: str):
    """The public functions, loaded on first use (``kraken.runtime.twins``): importing a recipe module loads none of them."""
    import importlib

    public = importlib.import_module("kraken.runtime.twins")
    if name in public.__all__:
        return getattr(public, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    import importlib

    return sorted(set(globals()) | set(importlib.import_module("kraken.runtime.twins").__all__))
