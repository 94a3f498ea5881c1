"""Validate locally, agree globally.

Every recipe runs its argument checks on each rank, inside ``agreed``; on the first call of each call
signature (every argument's shape, dtype and value) the ranks exchange (signature, verdict) once, so a
mistake on one rank raises on every rank, naming the rank and its message, and ranks that pass
different shapes all raise too. ``agree_once`` is the bare exchange, for a signature of the caller's
own (a workspace size before it grows). A mistake made on one rank only *after* its signature was
agreed (say, a non-symmetric tensor on rank 1 alone) cannot be detected without a collective per
call; that rank raises alone and the others wait for it.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch
import torch.distributed as dist

from kraken.runtime import groups, launcher
from kraken.runtime.timeout import arm_barrier_timeout

def _agree(signature: tuple, group: dist.ProcessGroup, op: str, verdict: tuple[str, str] | None = None) -> None:
    """Every rank sends (``signature``, its ``verdict``: None, or the (type, message) of its local
    error) and all raise the same error if any rank failed or the signatures differ (a collective)."""
    if torch.cuda.is_current_stream_capturing():
        return  # no collectives inside a capture; first calls happen in eager warm-up
    seen = [None] * dist.get_world_size(group)
    dist.all_gather_object(seen, (signature, verdict), group=group)
    failed = {r: v for r, (_, v) in enumerate(seen) if v is not None}
    disagree = "" if all(s == signature for s, _ in seen) else (
        f"ranks disagree on the input's shape/dtype ({_differences([s for s, _ in seen])})")
    if failed:
        types = {kind for kind, _ in failed.values()}
        by_message: dict[str, list[int]] = {}
        for r, (_, message) in failed.items():
            by_message.setdefault(message, []).append(r)
        text = "; ".join(f"rank{'s' if len(rs) > 1 else ''} {', '.join(map(str, rs))}: {m}" for m, rs in by_message.items())
        error = TypeError if types == {"TypeError"} and not disagree else ValueError
        raise error(f"{op}: bad input on {text}" + (f"; and {disagree}" if disagree else ""))
    if disagree:
        raise ValueError(f"{op}: {disagree}")


def _differences(signatures: list) -> str:
    """What differs between the ranks' signatures: per differing argument, every rank's value."""
    if not all(isinstance(s, tuple) and all(isinstance(p, tuple) and len(p) == 2 for p in s) for s in signatures):
        return "; ".join(f"rank {r}: {s}" for r, s in enumerate(signatures))
    per_rank = [dict(s) for s in signatures]
    names = list(dict.fromkeys(name for d in per_rank for name in d))
    differing = [n for n in names if len({repr(d.get(n)) for d in per_rank}) > 1]
    return "; ".join(f"{n}: " + ", ".join(f"rank {r} {d.get(n)}" for r, d in enumerate(per_rank)) for n in differing)


def signature_of(value: object) -> object:
    """What the ranks compare of one argument: a tensor's shape, dtype, device type and contiguity, a
    scalar's value, a container's items; anything else, its type's name."""
    if isinstance(value, torch.Tensor):
        return ("tensor", tuple(value.shape), str(value.dtype).removeprefix("torch."), value.device.type,
                value.is_contiguous())
    if isinstance(value, (bool, int, float, str, type(None))):
        return value
    if isinstance(value, torch.dtype):
        return str(value)
    if isinstance(value, (tuple, list)):
        return tuple(signature_of(v) for v in value)
    if isinstance(value, dict):
        return tuple(sorted((str(k), signature_of(v)) for k, v in value.items()))
    return type(value).__name__


@contextlib.contextmanager
def agreed(op: str, group: dist.ProcessGroup | str | None, **arguments) -> Iterator[None]:
    """Validate locally, agree globally: run the local checks in the ``with`` body (no collectives
    there), and on the first call of this call signature (``arguments`` through ``signature_of``) every
    rank exchanges (signature, its verdict) once. If any rank's checks raised, every rank raises one
    error naming each failing rank and its message (a TypeError if all of them were TypeErrors, else
    a ValueError); if the signatures differ, every rank raises naming what differs. After an agreed
    success the same signature costs a set lookup.

    What this cannot see: a rank whose signature was agreed before and that fails alone later skips
    the exchange, as the others do; it raises its own error locally, and the others go on alone.
    """
    if not dist.is_available() or not dist.is_initialized():
        yield  # no group to agree in: the checks' own error, if any, then the missing group's
        groups.resolve_group(group, op)
        return
    launcher.last_op = op
    arm_barrier_timeout()
    pg = groups.resolve_group(group, op)  # a bad group raises here, alike on every rank: nothing to agree over
    signature = tuple((name, signature_of(value)) for name, value in arguments.items())
    key = (op, signature, pg.group_name)
    try:
        yield
    except (TypeError, ValueError) as exc:
        if key in _agreed:
            raise
        _agree(signature, pg, op, (type(exc).__name__, str(exc).removeprefix(f"{op}: ")))
        raise  # inside a CUDA graph capture nothing is exchanged: the local error stands
    if key not in _agreed:
        _agree(signature, pg, op)
        _agreed.add(key)


_agreed: set[tuple] = set()


def agree_once(signature: tuple, group: dist.ProcessGroup | str | None, op: str) -> None:
    """``_agree`` the first time this process sees ``signature`` from ``op`` in ``group`` (a collective
    then; a set lookup after). A failed agreement is not remembered: the next call checks again."""
    pg = groups.resolve_group(group, op)
    key = (op, signature, pg.group_name)
    if key not in _agreed:
        _agree(signature, pg, op)
        _agreed.add(key)
