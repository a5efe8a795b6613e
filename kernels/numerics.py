"""The numerics version of the kernels: part of every persistent-cache key.

A stored checkpoint is only valid for the arithmetic that produced it. Bump NUMERICS_VERSION whenever a kernel's
results change in their last bits (a different accumulation order, a fused op, another rounding of bf16 storage,
a new default for the chunked delta rule, ...): every entry written before then stops matching and is recomputed.
"""
from __future__ import annotations

# 2: bf16 prefill on tensor cores by default (wgmma attention on sm_90, the delta rule's tc form); 3: the delta rule's
# decode kernel (one-token steps sum S^T k, S^T q in another order); 4: row norms (RMSNorm, the fused add + RMSNorm,
# gated RMSNorm, L2) sum a row in 16-byte chunks over norm_launch's lanes (kernels/row_launch.py); 5: attention prefill at
# head dim 256 in the warp-specialised kernel (attn_prefill_kernel "auto"); 6: the delta rule's tensor-core prep pass
# gdn_tc_prep_v2_kernel (6 blocks per SM, "v2-6") by default (the same fp32 solve in another summation order); 7:
# Mamba2 bf16 prefills in the tensor-core chunked form (kernels/ssd_tc.cu), Mamba2 decode steps in ssd_decode_kernel
# (the state's dot with C summed over 4 columns a lane), ops.scale in one kernel (one rounding of the fp32 product);
# 8: a scaled branch added in the fused add + RMSNorm and a shared expert added (and the branch scaled) in
# moe_combine, each rounded once where they were rounded per op (Granite 4.0-H, Nemotron-H's MoE blocks)
NUMERICS_VERSION = 8
# the batch-invariant kernels' own version (--deterministic): 2: decode and verify rows attend over fixed 512-key
# ranges merged in order (kernels/tuning.py DETERMINISTIC_SEGMENT_KEYS); 3: prefill rows on sm_90a (head dims 64,
# 128, 256, no window) attend in the sm_90a prefill kernel
DETERMINISTIC_VERSION = 3


def numerics_id(ops) -> str:
    """The version, the backend and its storage dtype: a CPU fp32 checkpoint never serves a CUDA bf16 run; and
    whether the kernels were batch-invariant (--deterministic): a deterministic run never resumes from a state the
    other kernels computed, nor the other way round."""
    mode = f":deterministic-v{DETERMINISTIC_VERSION}" if ops.deterministic else ""
    return f"numerics-v{NUMERICS_VERSION}:{ops.display_name}:{ops.dtype_name}{mode}"
