"""The host-side helpers' old home, kept so that ``from kraken import host`` and ``host.X`` still work.

Everything here lives in ``kraken.runtime`` (see its docstring for which module holds what); import it from
there. These are the same objects, so reading one here reads the original. Replacing one here (a test's
``monkeypatch.setattr``) does not change what the runtime's code calls: patch the module that defines it.
State that its module rebinds (``last_op``, ``_armed``, ``_symmetric_storages``) is read through to that module.
"""

from __future__ import annotations

from kraken.runtime import launcher as _launcher, symm as _symm, timeout as _timeout
from kraken.runtime.groups import (  # noqa: F401
    MAX_WORLD_SIZE, MIN_WORLD_SIZE, SIGNAL_SLOT_BYTES, SUPPORTED_DTYPES, cdiv, check_barrier_blocks, check_tensor,
    check_world_size, max_barrier_blocks, next_power_of_2, persistent_grid, resolve_config, resolve_group, round_up,
    signal_pad_bytes, world_size_of,
)
from kraken.runtime.agreement import (  # noqa: F401
    _agree, _agreed, _differences, agree_once, agreed, signature_of,
)
from kraken.runtime.symm import (  # noqa: F401
    BlockWorkspace, SymmContext, _block_workspaces, _contexts, _local_pads, _retired, _scratch, _workspaces,
    block_workspace, is_symmetric, local_barrier_pads, local_scratch, symm_context, symm_empty, symm_workspace,
)
from kraken.runtime.timeout import (  # noqa: F401
    TIMEOUT_EXIT_CODE, _map_report_page, _report_once, _reported, _watch_report_page, arm_barrier_timeout,
    barrier_timeout_report,
)
from kraken.runtime.prepared import (  # noqa: F401
    MAX_PREPARED, _prepared_caches, config_key, forget_prepared_calls, per_signature, scalar_key, symmetric_key,
    tensor_key,
)
from kraken.runtime.launcher import (  # noqa: F401
    Address, Launcher, TmaOperand, _triton_scratch, jit_launch, launch_function, launch_hooked, scratch_allocator,
    tensor_maps, tma_operand, unwrap_descriptors,
)
from kraken.runtime.graphs import (  # noqa: F401
    NEVER, PLAIN_RUNS, ForkedGraph, _capture_streams, _captured, _graphs, _kept_graph, drop_graphs, forked, graphed,
)
from kraken.runtime.replay import (  # noqa: F401
    NOT_REPLAYED, NOT_YET, NotReplayable, Recording, Replay, _extent_bytes, _recording_lock, _replay_of, _ViewsOnly,
    held_tensors, prepared_launch, record_replay, replay_source, replayed,
)


_REBOUND = {"last_op": _launcher, "_armed": _timeout, "_symmetric_storages": _symm}


def __getattr__(name: str):
    if name in _REBOUND:
        return getattr(_REBOUND[name], name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
