// Threshold attention's fused forward for __half rows (threshold_attention.cuh has the
// implementation; threshold_attention_forward.cu the entry point that calls this).
#include "cuda/threshold_attention.cuh"

namespace winnow::cuda {

void threshold_fused_forward_fp16(const detail::AttentionParams& p, const detail::ThresholdConfig& cfg) {
  fused_forward_of_type<__half>(p, cfg);
}

}  // namespace winnow::cuda
