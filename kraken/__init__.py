"""kraken: a cookbook of Triton kernels that communicate through symmetric memory.

    import kraken
    x = kraken.symm_empty((4096,), torch.bfloat16)   # collective: every rank calls it
    x.copy_(local_values)
    y = kraken.one_shot_all_reduce(x)                 # sum over the default group

``kraken.<name>`` is the installed recipe (``kraken.runtime.api``); ``kraken/comm/<name>.py`` and
``kraken/fused/<name>.py`` are the recipes themselves, one file each, to read and copy.
"""

from kraken._ptx_utils import timeout as _barrier_timeout  # noqa: F401 (a bad KRAKEN_BARRIER_TIMEOUT_S fails here)


def __getattr__(name: str):
    """The public functions, loaded on first use (``kraken.runtime.api``): importing a recipe module loads none of them."""
    import importlib

    public = importlib.import_module("kraken.runtime.api")
    if name in public.__all__:
        return getattr(public, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    import importlib

    return sorted(set(globals()) | set(importlib.import_module("kraken.runtime.api").__all__))
