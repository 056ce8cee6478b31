// RMSNorm's formulas (winnow/rms_norm.h), shared by the CPU and CUDA kernels. A row's two
// reductions (mean of squares forward, mean of g x backward) are the caller's; these are what
// is done with them.
#pragma once

#include <cmath>

#include "math/host_device.h"

namespace winnow::math::rms_norm {

// 1 / sqrt(mean(x^2) + eps).
template <class T>
WINNOW_HD T inverse_rms(T sum_of_squares, T cols, T eps) {
  using std::sqrt;
  return T(1) / sqrt(sum_of_squares / cols + eps);
}

// dx for one element: rstd (g - x rstd^2 mean(g x)), g = dy w.
template <class T>
WINNOW_HD T input_grad(T g, T x, T rstd, T mean_gx) {
  return rstd * (g - x * rstd * rstd * mean_gx);
}

}  // namespace winnow::math::rms_norm
