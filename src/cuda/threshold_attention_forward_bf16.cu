// Threshold attention's fused forward for __nv_bfloat16 rows (threshold_attention.cuh has the
// implementation; threshold_attention_forward.cu the entry point that calls this).
#include "cuda/threshold_attention.cuh"

namespace winnow::cuda {

void threshold_fused_forward_bf16(const detail::AttentionParams& p, const detail::ThresholdConfig& cfg) {
  fused_forward_of_type<__nv_bfloat16>(p, cfg);
}

}  // namespace winnow::cuda
