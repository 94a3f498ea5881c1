"""The Helion twins' public functions: ``helion_ports.<name>``, the twin of ``kraken.<name>`` (same arguments),
behind the same product layer; operators ``torch.ops.kraken_helion.<name>`` under ``torch.compile``.
"""

from helion_ports.comm import one_shot_all_reduce as one_shot_twin
from kraken.runtime.collectives import helion_all_gather as all_gather
from kraken.runtime.collectives import helion_all_reduce as all_reduce
from kraken.runtime.collectives import helion_reduce_scatter as reduce_scatter
from kraken.runtime.collectives import helion_two_shot_all_reduce as two_shot_all_reduce
from helion_ports.comm import moe_combine as moe_combine_twin
from helion_ports.comm import moe_dispatch as moe_dispatch_twin
from helion_ports.comm import all_gather_with_progress as progress_twin
from helion_ports.fused import all_gather_matmul as agm_twin
from helion_ports.fused import all_gather_matmul_fp8 as agm_fp8_twin
from helion_ports.fused.all_reduce_bias import all_reduce_bias
from helion_ports.fused.all_reduce_bias_rms_norm import all_reduce_bias_rms_norm
from helion_ports.fused.context_parallel_attention import context_parallel_attention
from helion_ports.fused.gemm_one_shot_all_reduce import gemm_one_shot_all_reduce
from helion_ports.fused.gemm_reduce_scatter import gemm_reduce_scatter
from helion_ports.fused.gemm_reduce_scatter_fp8 import gemm_reduce_scatter_fp8
from helion_ports.fused.one_shot_all_reduce_bias import one_shot_all_reduce_bias
from helion_ports.fused.one_shot_all_reduce_bias_rms_norm import one_shot_all_reduce_bias_rms_norm
from helion_ports.fused.rms_norm import rms_norm
from helion_ports.fused.two_shot_all_reduce_bias import two_shot_all_reduce_bias
from helion_ports.fused.two_shot_all_reduce_bias_rms_norm import two_shot_all_reduce_bias_rms_norm
from kraken.runtime import collectives, gather_matmul, moe, progress
from kraken.runtime.api import COMM, FUSED
from kraken.runtime.library import install_front_doors

one_shot_all_reduce = collectives.one_shot_all_reduce_with(one_shot_twin.launch, "helion one_shot_all_reduce")
moe_combine = moe.moe_combine_with(moe_combine_twin.launch, "helion moe_combine")
moe_dispatch = moe.moe_dispatch_with(moe_dispatch_twin.launch, "helion moe_dispatch")
all_gather_with_progress = progress.all_gather_with_progress_with(progress_twin.launch,
                                                                  "helion all_gather_with_progress")
all_gather_matmul = gather_matmul.all_gather_matmul_with(agm_twin.launch, "helion all_gather_matmul", "helion_ports")
all_gather_matmul_fp8 = gather_matmul.all_gather_matmul_fp8_with(agm_fp8_twin.launch, "helion all_gather_matmul_fp8",
                                                                 "helion_ports")

__all__ = [*COMM, *FUSED]

install_front_doors(__name__, "kraken_helion")
