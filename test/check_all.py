"""Run every check of a GPU worker and report all failures at the end, not just the first.

A functional GPU run (ranks sharing one GPU) is slow to start and to compile, so one spawn runs many checks.
A check that fails an assertion after its collectives leaves the ranks in step, so the next check still runs;
anything else (a kernel error, a collective that raised) is re-raised at once, since the ranks may no longer be
in step."""

from __future__ import annotations

from typing import Callable


def check_all(checks: list[tuple[str, Callable[[], None]]]) -> None:
    failures = []
    for name, check in checks:
        try:
            check()
        except AssertionError as exc:
            failures.append(f"{name}: {exc}")
    assert not failures, f"{len(failures)} of {len(checks)} checks failed:\n" + "\n".join(failures)
