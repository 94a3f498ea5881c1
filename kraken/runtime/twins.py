"""The Helion twins' public functions: ``helion_ports.<name>``, the twin of ``kraken.<name>`` (same arguments),
behind the same product layer (each family's factory around the twin's ``launch``); operators
``torch.ops.kraken_helion.<name>`` under ``torch.compile``.
"""

from helion_ports.comm import all_gather as all_gather_twin
from helion_ports.comm import all_gather_with_progress as progress_twin
from helion_ports.comm import moe_combine as moe_combine_twin
from helion_ports.comm import moe_dispatch as moe_dispatch_twin
from helion_ports.comm import one_shot_all_reduce as one_shot_twin
from helion_ports.comm import reduce_scatter as reduce_scatter_twin
from helion_ports.comm import two_shot_all_reduce as two_shot_twin
from helion_ports.fused import all_gather_matmul as agm_twin
from helion_ports.fused import all_gather_matmul_fp8 as agm_fp8_twin
from helion_ports.fused import context_parallel_attention as cp_twin
from helion_ports.fused import gemm_one_shot_all_reduce as gemm_all_reduce_twin
from helion_ports.fused import gemm_reduce_scatter as gemm_reduce_scatter_twin
from helion_ports.fused import gemm_reduce_scatter_fp8 as gemm_reduce_scatter_fp8_twin
from helion_ports.fused import one_shot_all_reduce_bias as one_shot_bias_twin
from helion_ports.fused import one_shot_all_reduce_bias_rms_norm as one_shot_norm_twin
from helion_ports.fused import rms_norm as rms_norm_twin
from helion_ports.fused import two_shot_all_reduce_bias as two_shot_bias_twin
from helion_ports.fused import two_shot_all_reduce_bias_rms_norm as two_shot_norm_twin
from kraken.runtime import attention, bias_doors, bias_norm, collectives, gather_matmul, gemm_all_reduce, moe, progress
from kraken.runtime import gemm_reduce_scatter as grs_product
from kraken.runtime import gemm_reduce_scatter_fp8 as grs_fp8_product
from kraken.runtime.api import COMM, FUSED
from kraken.runtime.library import install_front_doors

one_shot_all_reduce = collectives.one_shot_all_reduce_with(one_shot_twin.launch, "helion one_shot_all_reduce")
two_shot_all_reduce = collectives.two_shot_all_reduce_with(two_shot_twin.launch, "helion two_shot_all_reduce")
reduce_scatter = collectives.reduce_scatter_with(reduce_scatter_twin.launch, "helion reduce_scatter")
all_gather = collectives.all_gather_with(all_gather_twin.launch, "helion all_gather")
all_reduce = collectives.all_reduce_with(one_shot_twin, two_shot_twin, "helion all_reduce")
all_gather_with_progress = progress.all_gather_with_progress_with(progress_twin.launch,
                                                                  "helion all_gather_with_progress")
moe_combine = moe.moe_combine_with(moe_combine_twin.launch, "helion moe_combine")
moe_dispatch = moe.moe_dispatch_with(moe_dispatch_twin.launch, "helion moe_dispatch")
all_gather_matmul = gather_matmul.all_gather_matmul_with(agm_twin, "helion all_gather_matmul", "helion_ports")
all_gather_matmul_fp8 = gather_matmul.all_gather_matmul_fp8_with(agm_fp8_twin, "helion all_gather_matmul_fp8",
                                                                 "helion_ports")
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
context_parallel_attention = attention.context_parallel_attention_with(cp_twin.launch_attention,
                                                                        "helion context_parallel_attention")
attention_on_gathered = attention.attention_on_gathered_with(cp_twin.launch_attention,
                                                              "helion context_parallel_attention")
gemm_one_shot_all_reduce = gemm_all_reduce.gemm_one_shot_all_reduce_with(
    gemm_all_reduce_twin.launch, "helion gemm_one_shot_all_reduce", "helion_ports")
gemm_reduce_scatter = grs_product.gemm_reduce_scatter_with(
    gemm_reduce_scatter_twin.launch, "helion gemm_reduce_scatter", "helion_ports")
gemm_reduce_scatter_fp8 = grs_fp8_product.gemm_reduce_scatter_fp8_with(
    gemm_reduce_scatter_fp8_twin.launch, "helion gemm_reduce_scatter_fp8", "helion_ports")

__all__ = [*COMM, *FUSED]

install_front_doors(__name__, "kraken_helion")
