"""kraken: a cookbook of Triton kernels that communicate through symmetric memory.

    import kraken
    x = kraken.symm_empty((4096,), torch.bfloat16)   # collective: every rank calls it
    x.copy_(local_values)
    y = kraken.one_shot_all_reduce(x)                 # sum over the default group
"""

from .comm import all_gather, all_reduce, one_shot_all_reduce, reduce_scatter, two_shot_all_reduce
from .runtime.symm import symm_empty

__all__ = ["all_gather", "all_reduce", "one_shot_all_reduce", "reduce_scatter", "symm_empty", "two_shot_all_reduce"]
