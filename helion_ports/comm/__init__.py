"""Helion twins of kraken.comm (same module names and signatures)."""

from .one_shot_all_reduce import one_shot_all_reduce
from .two_shot_all_reduce import two_shot_all_reduce

__all__ = ["one_shot_all_reduce", "two_shot_all_reduce"]
