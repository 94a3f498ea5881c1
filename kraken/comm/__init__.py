"""Pure collectives over symmetric memory."""

from .one_shot_all_reduce import one_shot_all_reduce
from .two_shot_all_reduce import two_shot_all_reduce

__all__ = ["one_shot_all_reduce", "two_shot_all_reduce"]
