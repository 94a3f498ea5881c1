"""kraken: a cookbook of Triton kernels that communicate through symmetric memory.

    import kraken
    x = kraken.symm_empty((4096,), torch.bfloat16)   # collective: every rank calls it
    x.copy_(local_values)
    y = kraken.one_shot_all_reduce(x)                 # sum over the default group
"""

from .comm import one_shot_all_reduce, two_shot_all_reduce
from .host import symm_empty

__all__ = ["one_shot_all_reduce", "symm_empty", "two_shot_all_reduce"]
