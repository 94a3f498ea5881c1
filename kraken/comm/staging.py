"""Moved to ``kraken.runtime.staging``; kept so that ``from kraken.comm import staging`` still works (the same
objects)."""

from kraken.runtime.staging import launched, new_rows, prepares, staged_key  # noqa: F401
