"""The host fast path, part one: a prepared call per call signature.

A recipe's ``prepare`` (checks, agreement, plan, symmetric buffers, a ``Launcher``) runs on the first call of
each signature; ``per_signature`` keeps its result under a key built from ``tensor_key``, ``scalar_key`` and
``config_key``, so that a warm call is one dictionary lookup. ``forget_prepared_calls`` empties every such
cache. ``MAX_PREPARED`` bounds each cache here and the other caches of the fast path.
"""

from __future__ import annotations

import functools
from typing import Callable

import torch

MAX_PREPARED = 256  # prepared calls kept per recipe; past that the cache starts over (a bound, not a tuning)


def tensor_key(tensor: object, address: bool = False) -> object:
    """What a prepared call may depend on of one argument: a tensor's shape, strides, dtype, device and whether
    its address is 16-byte aligned (Triton specialises kernels on it, TMA needs it), and with ``address`` the
    address itself (symmetric tensors: their peers are found from it); anything else as it is."""
    if not isinstance(tensor, torch.Tensor):
        return tensor
    ptr = tensor.data_ptr()  # one call, and flat tuples: this runs on every call (half the time of the nested form)
    if address:  # the address says its alignment
        return (tensor.shape, tensor.stride(), tensor.dtype, tensor.device, ptr)
    return (tensor.shape, tensor.stride(), tensor.dtype, tensor.device, ptr % 16 == 0)


def scalar_key(value: object) -> tuple:
    """A scalar argument in a key, with its type: ``1``, ``1.0`` and ``True`` are equal and hash alike in
    Python, but a check may accept one and refuse another (``eps=True`` is refused)."""
    return (type(value), value)


def config_key(config: dict) -> tuple:
    """A ``**config`` in a key: each item with its value's type (see ``scalar_key``)."""
    if not config:  # the common call: no generator to run
        return ()
    return tuple((name, type(value), value) for name, value in config.items())


def symmetric_key(tensor: torch.Tensor, group, op: str, config: dict) -> tuple:
    """``per_signature``'s key for a ``prepare(tensor, group, op, config)`` of one symmetric tensor."""
    return (op, group, tensor_key(tensor, address=True), config_key(config))


def per_signature(key: Callable[..., tuple]) -> Callable:
    """Decorate a recipe's ``prepare``: its result is kept per ``key(*args)`` and returned by later calls
    with the same key, with no check, collective or plan (the first call of each key ran them all, and a
    call that raised is not kept). ``key`` must hold everything ``prepare`` reads (``tensor_key`` of each
    tensor, ``scalar_key`` of each scalar, ``config_key`` of the config, the group, the op); a key that cannot
    be hashed (say, a list in the config) just skips the cache. The result is shared by every later call:
    treat it as read-only (change a launch argument in a copy: ``launch(**{**cfg, "out": mine})``).
    ``prepare.cache`` is the dictionary, ``prepare.uncached`` the original."""

    def decorate(prepare: Callable) -> Callable:
        cache: dict = {}

        @functools.wraps(prepare)
        def cached(*args):
            try:
                signature = key(*args)
                prepared = cache.get(signature)
            except TypeError:  # unhashable: a bad argument (prepare says so) or a list in the config
                return prepare(*args)
            if prepared is None:
                prepared = prepare(*args)
                if len(cache) >= MAX_PREPARED:
                    cache.clear()
                cache[signature] = prepared
            return prepared

        cached.cache, cached.uncached = cache, prepare
        _prepared_caches.append(cache)
        return cached

    return decorate


_prepared_caches: list[dict] = []


def forget_prepared_calls() -> None:
    """Empty every recipe's cache of prepared calls (the next call of each signature checks and agrees again);
    for tests, and for a process that destroys and recreates its process groups."""
    for cache in _prepared_caches:
        cache.clear()
