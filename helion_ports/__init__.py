"""Helion twins of the kraken recipes: ``helion_ports.X.y`` computes what ``kraken.X.y`` does.

Every twin's ``helion.Config`` says ``pid_type="flat"``: ``hl.grid(num_blocks)`` then launches
exactly the recipe's ``num_blocks`` programs, and the grid index is the barrier's block id. Left to
itself, Helion 1.5 picks a persistent pid type for kernels with symmetric-memory arguments: one
program per SM, all but ``num_blocks`` of them idle. An explicit ``pid_type`` is honoured.
"""

from __future__ import annotations

import functools

import helion


@functools.cache
def flat_kernel(body, block_sizes: tuple[int, ...], num_warps: int, num_stages: int = 1, **settings) -> helion.Kernel:
    """``body`` as a Helion kernel with one explicit config: the given block sizes (in loop order),
    warps and stages, ``pid_type="flat"`` (above) and ``static_shapes=False``; ``settings`` are further
    ``helion.Config`` keys (tuples stand for lists, to stay hashable). Cached per config."""
    settings = {key: list(value) if isinstance(value, tuple) else value for key, value in settings.items()}
    config = helion.Config(
        block_sizes=list(block_sizes), num_warps=num_warps, num_stages=num_stages, pid_type="flat", **settings
    )
    return helion.kernel(body, config=config, static_shapes=False)
