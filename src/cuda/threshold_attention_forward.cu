// Threshold attention's forward entry point (threshold_attention.cuh has the implementation).
#include "cuda/threshold_attention.cuh"

namespace winnow::cuda {

void threshold_forward(const detail::AttentionParams& p, const detail::ThresholdConfig& cfg) {
  // A forward that decoded (its kernels normalize as they read) still fills the saved rows.
  const bool decoded = decoded_forward(p, cfg);
  if (decoded && cfg.saved_rows == nullptr) return;
  NormalizedViews views(p, cfg);
  if (cfg.saved_rows != nullptr) views.clear_padding(p);
  if (decoded) return dispatch_simple(p, RowsOnly{p, cfg, views});
  if (fused_applies(p, cfg, nullptr)) return dispatch_fused(p, FusedForward{p, cfg, views});
  dispatch_simple(p, SimpleForward{p, cfg, views});
}

}  // namespace winnow::cuda
