"""Helion twins of kraken.fused (same module names and signatures)."""

from .all_gather_matmul import all_gather_matmul
from .all_gather_matmul_fp8 import all_gather_matmul_fp8
from .all_reduce_bias import all_reduce_bias
from .all_reduce_bias_rms_norm import all_reduce_bias_rms_norm
from .context_parallel_attention import context_parallel_attention
from .gemm_one_shot_all_reduce import gemm_one_shot_all_reduce
from .gemm_reduce_scatter import gemm_reduce_scatter
from .gemm_reduce_scatter_fp8 import gemm_reduce_scatter_fp8
from .one_shot_all_reduce_bias import one_shot_all_reduce_bias
from .one_shot_all_reduce_bias_rms_norm import one_shot_all_reduce_bias_rms_norm
from .rms_norm import rms_norm
from .two_shot_all_reduce_bias import two_shot_all_reduce_bias
from .two_shot_all_reduce_bias_rms_norm import two_shot_all_reduce_bias_rms_norm

__all__ = [
    "all_gather_matmul",
    "all_gather_matmul_fp8",
    "all_reduce_bias",
    "all_reduce_bias_rms_norm",
    "context_parallel_attention",
    "gemm_one_shot_all_reduce",
    "gemm_reduce_scatter",
    "gemm_reduce_scatter_fp8",
    "one_shot_all_reduce_bias",
    "one_shot_all_reduce_bias_rms_norm",
    "rms_norm",
    "two_shot_all_reduce_bias",
    "two_shot_all_reduce_bias_rms_norm",
]

from kraken.runtime.library import install_front_doors  # noqa: E402  (after the exports it wraps)

# Each recipe above: a torch.library operator under torch.compile (kraken/runtime/library.py).
install_front_doors(__name__)
