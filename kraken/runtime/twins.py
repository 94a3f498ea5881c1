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
from helion_ports.fused.all_reduce_bias import all_reduce_bias
from helion_ports.fused.all_reduce_bias_rms_norm import all_reduce_bias_rms_norm
from helion_ports.fused.context_parallel_attention import context_parallel_attention
from helion_ports.fused import gemm_one_shot_all_reduce as gemm_all_reduce_twin
from helion_ports.fused import gemm_reduce_scatter as gemm_reduce_scatter_twin
from helion_ports.fused import gemm_reduce_scatter_fp8 as gemm_reduce_scatter_fp8_twin
from helion_ports.fused.one_shot_all_reduce_bias import one_shot_all_reduce_bias
from helion_ports.fused.one_shot_all_reduce_bias_rms_norm import one_shot_all_reduce_bias_rms_norm
from helion_ports.fused.rms_norm import rms_norm
from helion_ports.fused.two_shot_all_reduce_bias import two_shot_all_reduce_bias
from helion_ports.fused.two_shot_all_reduce_bias_rms_norm import two_shot_all_reduce_bias_rms_norm
from kraken.runtime import collectives
from kraken.runtime import gemm_all_reduce as gemm_all_reduce_product
from kraken.runtime import gemm_reduce_scatter as gemm_reduce_scatter_product
from kraken.runtime import gemm_reduce_scatter_fp8 as gemm_reduce_scatter_fp8_product
from kraken.runtime.api import COMM, FUSED
from kraken.runtime.library import install_front_doors

one_shot_all_reduce = collectives.one_shot_all_reduce_with(one_shot_twin.launch, "helion one_shot_all_reduce")
gemm_one_shot_all_reduce = gemm_all_reduce_product.gemm_one_shot_all_reduce_with(
    gemm_all_reduce_twin.launch, "helion gemm_one_shot_all_reduce", "helion_ports")
gemm_reduce_scatter = gemm_reduce_scatter_product.gemm_reduce_scatter_with(
    gemm_reduce_scatter_twin.launch, "helion gemm_reduce_scatter", "helion_ports")
gemm_reduce_scatter_fp8 = gemm_reduce_scatter_fp8_product.gemm_reduce_scatter_fp8_with(
    gemm_reduce_scatter_fp8_twin.launch, "helion gemm_reduce_scatter_fp8", "helion_ports")

__all__ = [*COMM, *FUSED]

install_front_doors(__name__, "kraken_helion")
