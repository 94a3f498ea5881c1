"""The host-side helpers' old home, kept so that ``from kraken import host`` and ``host.X`` still work.

Everything here lives in ``kraken.runtime`` (its docstring says which module holds what); import it from there.
The functions, classes and constants are the same objects. Module-level state (caches, ``last_op``,
``MAX_PREPARED``) is not copied here: reading it here reads its module's. Replacing a name here (a test's
``monkeypatch.setattr``) changes nothing the runtime calls: replace it in the module that defines it.
"""

from __future__ import annotations

import importlib

from kraken.runtime.groups import (  # noqa: F401
    MAX_WORLD_SIZE, MIN_WORLD_SIZE, SIGNAL_SLOT_BYTES, SUPPORTED_DTYPES, cdiv, check_barrier_blocks, check_tensor,
    check_world_size, max_barrier_blocks, next_power_of_2, persistent_grid, resolve_config, resolve_group, round_up,
    signal_pad_bytes, world_size_of,
)
from kraken.runtime.agreement import (  # noqa: F401
    _agree, _differences, agree_once, agreed, signature_of,
)
from kraken.runtime.symm import (  # noqa: F401
    BlockWorkspace, SymmContext, block_workspace, is_symmetric, local_barrier_pads, local_scratch, symm_context,
    symm_empty, symm_workspace,
)
from kraken.runtime.timeout import (  # noqa: F401
    TIMEOUT_EXIT_CODE, _map_report_page, _report_once, _watch_report_page, arm_barrier_timeout,
    barrier_timeout_report,
)
from kraken.runtime.prepared import (  # noqa: F401
    config_key, forget_prepared_calls, per_signature, scalar_key, symmetric_key, tensor_key,
)
from kraken.runtime.launcher import (  # noqa: F401
    Address, Launcher, TmaOperand, _triton_scratch, jit_launch, launch_function, launch_hooked, scratch_allocator,
    tensor_maps, tma_operand, unwrap_descriptors,
)
from kraken.runtime.graphs import (  # noqa: F401
    NEVER, PLAIN_RUNS, ForkedGraph, _captured, _kept_graph, drop_graphs, forked, graphed,
)
from kraken.runtime.replay import (  # noqa: F401
    NOT_REPLAYED, NOT_YET, NotReplayable, Recording, Replay, _extent_bytes, _replay_of, _ViewsOnly, held_tensors,
    prepared_launch, record_replay, replay_source, replayed,
)

# name -> the kraken.runtime module that holds it (and may rebind it)
_STATE = {
    "_contexts": "symm", "_workspaces": "symm", "_symmetric_storages": "symm", "_block_workspaces": "symm",
    "_retired": "symm", "_local_pads": "symm", "_scratch": "symm", "_agreed": "agreement", "_armed": "timeout",
    "_reported": "timeout", "MAX_PREPARED": "prepared", "_prepared_caches": "prepared", "last_op": "launcher",
    "_graphs": "graphs", "_capture_streams": "graphs", "_recording_lock": "replay",
}


def __getattr__(name: str):
    if name in _STATE:
        return getattr(importlib.import_module(f"kraken.runtime.{_STATE[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
