"""The installed package's public functions: ``kraken.<name>`` (``kraken/__init__.py`` loads this module on first use).

Each is a recipe behind the product layer (checks agreed across ranks, prepared calls, replayed launches) and, under
``torch.compile``, a ``torch.library`` operator (``install_front_doors``). Importing a recipe module
(``kraken.comm.<name>``) loads none of this.
"""

from kraken.runtime.attention import context_parallel_attention
from kraken.runtime.bias_doors import all_reduce_bias, all_reduce_bias_rms_norm
from kraken.runtime.bias_norm import (
    one_shot_all_reduce_bias, one_shot_all_reduce_bias_rms_norm, rms_norm, two_shot_all_reduce_bias,
    two_shot_all_reduce_bias_rms_norm,
)
from kraken.runtime.collectives import all_gather, all_reduce, one_shot_all_reduce, reduce_scatter, two_shot_all_reduce
from kraken.runtime.gather_matmul import all_gather_matmul, all_gather_matmul_fp8
from kraken.runtime.gemm_all_reduce import gemm_one_shot_all_reduce
from kraken.runtime.gemm_reduce_scatter import gemm_reduce_scatter
from kraken.runtime.gemm_reduce_scatter_fp8 import gemm_reduce_scatter_fp8
from kraken.runtime.library import install_front_doors
from kraken.runtime.moe import moe_combine, moe_dispatch
from kraken.runtime.progress import all_gather_with_progress
from kraken.runtime.symm import symm_empty

COMM = ("all_gather", "all_gather_with_progress", "all_reduce", "moe_combine", "moe_dispatch", "one_shot_all_reduce",
        "reduce_scatter", "two_shot_all_reduce")
FUSED = ("all_gather_matmul", "all_gather_matmul_fp8", "all_reduce_bias", "all_reduce_bias_rms_norm",
         "context_parallel_attention", "gemm_one_shot_all_reduce", "gemm_reduce_scatter", "gemm_reduce_scatter_fp8",
         "one_shot_all_reduce_bias", "one_shot_all_reduce_bias_rms_norm", "rms_norm", "two_shot_all_reduce_bias",
         "two_shot_all_reduce_bias_rms_norm")
__all__ = [
    "all_gather", "all_gather_matmul", "all_gather_matmul_fp8", "all_gather_with_progress", "all_reduce",
    "all_reduce_bias", "all_reduce_bias_rms_norm", "context_parallel_attention", "gemm_one_shot_all_reduce",
    "gemm_reduce_scatter", "gemm_reduce_scatter_fp8", "moe_combine", "moe_dispatch", "one_shot_all_reduce",
    "one_shot_all_reduce_bias", "one_shot_all_reduce_bias_rms_norm", "reduce_scatter", "rms_norm", "symm_empty",
    "two_shot_all_reduce", "two_shot_all_reduce_bias", "two_shot_all_reduce_bias_rms_norm",
]
assert sorted(__all__) == sorted([*COMM, *FUSED, "symm_empty"])

install_front_doors(__name__, "kraken")  # each recipe above: a torch.library operator under torch.compile
