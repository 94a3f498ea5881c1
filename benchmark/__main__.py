"""python -m benchmark: see ``benchmark.cli`` (the spawned workers need an importable module)."""

from benchmark.cli import main

main()
