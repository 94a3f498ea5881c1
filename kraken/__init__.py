"""kraken: a cookbook of Triton kernels that communicate through symmetric memory.

    import kraken
    x = kraken.symm_empty((4096,), torch.bfloat16)   # collective: every rank calls it
    x.copy_(local_values)
    y = kraken.one_shot_all_reduce(x)                 # sum over the default group

``kraken.<name>`` is the installed recipe (``kraken.runtime.api``); ``kraken/comm/<name>.py`` and
``kraken/fused/<name>.py`` are the recipes themselves, one file each, to read and copy.
"""

from kraken._ptx_utils import timeout as _barrier_timeout  # noqa: F401 (a bad KRAKEN_BARRIER_TIMEOUT_S fails here)


def _lazy_exports(package_globals: dict, public_module: str):
    """A package's ``__getattr__`` and ``__dir__`` for the public functions of ``public_module``, imported on first
    use and then copied into the package, so that later ``package.<name>`` lookups are plain attribute reads (a
    module's ``__getattr__`` runs on every lookup of a name the module lacks). Shared with ``helion_ports``."""
    import importlib

    def __getattr__(name: str):
        public = importlib.import_module(public_module)
        if name not in public.__all__:
            raise AttributeError(f"module {package_globals['__name__']!r} has no attribute {name!r}")
        package_globals.update((n, getattr(public, n)) for n in public.__all__)
        return package_globals[name]

    def __dir__():
        return sorted(set(package_globals) | set(importlib.import_module(public_module).__all__))

    return __getattr__, __dir__


# The public functions, loaded on first use (``kraken.runtime.api``): importing a recipe module loads none of them.
__getattr__, __dir__ = _lazy_exports(globals(), "kraken.runtime.api")
