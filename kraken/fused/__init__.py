"""Fused communication + compute recipes."""

from .gemm_one_shot_all_reduce import gemm_one_shot_all_reduce
from .one_shot_all_reduce_bias import one_shot_all_reduce_bias
from .one_shot_all_reduce_bias_rms_norm import one_shot_all_reduce_bias_rms_norm
from .rms_norm import rms_norm
from .two_shot_all_reduce_bias import two_shot_all_reduce_bias
from .two_shot_all_reduce_bias_rms_norm import two_shot_all_reduce_bias_rms_norm

__all__ = [
    "gemm_one_shot_all_reduce",
    "one_shot_all_reduce_bias",
    "one_shot_all_reduce_bias_rms_norm",
    "rms_norm",
    "two_shot_all_reduce_bias",
    "two_shot_all_reduce_bias_rms_norm",
]
