// Threshold attention's forward entry point (threshold_attention.cuh has the implementation;
// the fused path's kernels compile per element type in threshold_attention_forward_bf16.cu and
// threshold_attention_forward_fp16.cu).
#include "cuda/threshold_attention.cuh"

namespace winnow::cuda {

void threshold_forward(const detail::AttentionParams& p, const detail::ThresholdConfig& cfg) {
  // A forward that decoded (its kernels normalize as they read) still fills the saved rows.
  const bool decoded = decoded_forward(p, cfg);
  if (decoded && cfg.saved_rows == nullptr) return;
  if (!decoded && fused_applies(p, cfg, nullptr)) {
    return p.dtype == DType::bfloat16 ? threshold_fused_forward_bf16(p, cfg) : threshold_fused_forward_fp16(p, cfg);
  }
  NormalizedViews views(p, cfg);
  if (cfg.saved_rows != nullptr) views.clear_padding_and_support(p);
  if (decoded) return dispatch_simple(p, RowsOnly{p, cfg, views});
  dispatch_simple(p, SimpleForward{p, cfg, views});
}

}  // namespace winnow::cuda
