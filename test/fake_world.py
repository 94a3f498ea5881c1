"""A two-rank world on one CPU process, for testing ``kraken.runtime.agreement.agreed`` and the recipes' ``prepare``:
this process is rank 0, and ``other(mine)`` says what rank 1 sends (by default the same as rank 0)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from kraken.runtime import agreement, groups


class FakeWorld:
    """Two ranks, this process rank 0: ``all_gather_object`` returns ours and ``other``'s (signature, verdict)."""

    group_name = "fake"

    def __init__(self, monkeypatch, other=None):
        self.exchanges = 0
        self.other = other
        monkeypatch.setattr(groups, "resolve_group", lambda group, op: self)
        monkeypatch.setattr(agreement, "_agreed", set())
        monkeypatch.setattr(dist, "is_initialized", lambda: True)
        monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
        monkeypatch.setattr(dist, "get_rank", lambda group=None: 0)
        monkeypatch.setattr(dist, "all_gather_object", self.all_gather_object)
        monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)

    def all_gather_object(self, seen, mine, group=None):
        self.exchanges += 1
        seen[0] = mine
        seen[1] = mine if self.other is None else self.other(mine)
