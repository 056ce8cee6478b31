// Threshold attention's backward entry point (threshold_attention.cuh has the implementation).
#include "cuda/threshold_attention.cuh"

namespace winnow::cuda {

void threshold_backward(const detail::AttentionParams& p, const detail::GradientParams& g,
                        const detail::ThresholdConfig& cfg) {
  NormalizedViews views(p, cfg);
  if (fused_applies(p, cfg, &g)) return dispatch_fused(p, FusedBackward{p, g, cfg, views});
  dispatch_simple(p, SimpleBackward{p, g, cfg, views});
}

}  // namespace winnow::cuda
