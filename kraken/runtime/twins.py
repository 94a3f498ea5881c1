"""The Helion twins' public functions: ``helion_ports.<name>``, the twin of ``kraken.<name>`` (same arguments),
behind the same product layer; operators ``torch.ops.kraken_helion.<name>`` under ``torch.compile``.
"""

from helion_ports.comm import one_shot_all_reduce as one_shot_twin
from helion_ports.comm.all_gather import all_gather
from helion_ports.comm.all_gather_with_progress import all_gather_with_progress
from helion_ports.comm.all_reduce import all_reduce
from helion_ports.comm.moe_combine import moe_combine
from helion_ports.comm.moe_dispatch import moe_dispatch
from helion_ports.comm.reduce_scatter import reduce_scatter
from helion_ports.comm.two_shot_all_reduce import two_shot_all_reduce
from helion_ports.fused.all_gather_matmul import all_gather_matmul
from helion_ports.fused.all_gather_matmul_fp8 import all_gather_matmul_fp8
from helion_ports.fused.context_parallel_attention import context_parallel_attention
from helion_ports.fused.gemm_one_shot_all_reduce import gemm_one_shot_all_reduce
from helion_ports.fused.gemm_reduce_scatter import gemm_reduce_scatter
from helion_ports.fused.gemm_reduce_scatter_fp8 import gemm_reduce_scatter_fp8
from helion_ports.fused import one_shot_all_reduce_bias as one_shot_bias_twin
from helion_ports.fused import one_shot_all_reduce_bias_rms_norm as one_shot_norm_twin
from helion_ports.fused import rms_norm as rms_norm_twin
from helion_ports.fused import two_shot_all_reduce_bias as two_shot_bias_twin
from helion_ports.fused import two_shot_all_reduce_bias_rms_norm as two_shot_norm_twin
from kraken.runtime import bias_doors, bias_norm, collectives
from kraken.runtime.api import COMM, FUSED
from kraken.runtime.library import install_front_doors

one_shot_all_reduce = collectives.one_shot_all_reduce_with(one_shot_twin.launch, "helion one_shot_all_reduce")
rms_norm = bias_norm.rms_norm_with(rms_norm_twin.launch, "helion rms_norm")
one_shot_all_reduce_bias = bias_norm.one_shot_all_reduce_bias_with(
    one_shot_bias_twin.launch, "helion one_shot_all_reduce_bias")
two_shot_all_reduce_bias = bias_norm.two_shot_all_reduce_bias_with(
    two_shot_bias_twin.launch, "helion two_shot_all_reduce_bias")
one_shot_all_reduce_bias_rms_norm = bias_norm.one_shot_all_reduce_bias_rms_norm_with(
    one_shot_norm_twin.launch, "helion one_shot_all_reduce_bias_rms_norm")
two_shot_all_reduce_bias_rms_norm = bias_norm.two_shot_all_reduce_bias_rms_norm_with(
    two_shot_norm_twin.launch, "helion two_shot_all_reduce_bias_rms_norm")
all_reduce_bias = bias_doors.all_reduce_bias_with((one_shot_bias_twin, two_shot_bias_twin), "helion all_reduce_bias")
all_reduce_bias_rms_norm = bias_doors.all_reduce_bias_rms_norm_with(
    (one_shot_norm_twin, two_shot_norm_twin), "helion all_reduce_bias_rms_norm")

__all__ = [*COMM, *FUSED]

install_front_doors(__name__, "kraken_helion")
