"""The shared benchmark harness: ``python -m benchmark [op ...]`` (see ``--help``)."""
