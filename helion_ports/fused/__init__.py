"""Helion twins of kraken.fused (same module names and signatures)."""

from .all_gather_matmul import all_gather_matmul
from .context_parallel_attention import context_parallel_attention
from .gemm_one_shot_all_reduce import gemm_one_shot_all_reduce
from .gemm_reduce_scatter import gemm_reduce_scatter
from .one_shot_all_reduce_bias import one_shot_all_reduce_bias
from .one_shot_all_reduce_bias_rms_norm import one_shot_all_reduce_bias_rms_norm
from .rms_norm import rms_norm
from .two_shot_all_reduce_bias import two_shot_all_reduce_bias
from .two_shot_all_reduce_bias_rms_norm import two_shot_all_reduce_bias_rms_norm

__all__ = [
    "all_gather_matmul",
    "context_parallel_attention",
    "gemm_one_shot_all_reduce",
    "gemm_reduce_scatter",
    "one_shot_all_reduce_bias",
    "one_shot_all_reduce_bias_rms_norm",
    "rms_norm",
    "two_shot_all_reduce_bias",
    "two_shot_all_reduce_bias_rms_norm",
]
