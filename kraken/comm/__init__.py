"""Pure collectives over symmetric memory."""

from .all_gather import all_gather
from .all_gather_with_progress import all_gather_with_progress
from .all_reduce import all_reduce
from .moe_combine import moe_combine
from .moe_dispatch import moe_dispatch
from kraken.runtime.collectives import one_shot_all_reduce  # the recipe behind the product layer (fast path)
from .reduce_scatter import reduce_scatter
from .two_shot_all_reduce import two_shot_all_reduce

__all__ = ["all_gather", "all_gather_with_progress", "all_reduce", "moe_combine", "moe_dispatch", "one_shot_all_reduce", "reduce_scatter", "two_shot_all_reduce"]

from kraken.runtime.library import install_front_doors  # noqa: E402  (after the exports it wraps)

# Each recipe above: a torch.library operator under torch.compile (kraken/runtime/library.py).
install_front_doors(__name__)
