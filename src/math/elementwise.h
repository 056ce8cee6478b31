// Per-element functions several mechanisms share. Each is written once, generic over the
// argument type, so the float64 reference, the CPU kernels (scalars or Eigen arrays,
// vectorized) and CUDA device code evaluate the same expression.
#pragma once

#include <cmath>

#include "math/host_device.h"

namespace winnow::math {

// softplus(x) = log(1 + e^x) = max(x, 0) + log1p(exp(-|x|)), finite for every finite x.
// max(x, 0) is spelled (x + |x|) / 2, which is exact and also works on array expressions.
template <class X>
WINNOW_HD auto softplus(const X& x) {
  using std::abs;
  using std::exp;
  using std::log1p;
  using S = scalar_of_t<X>;
  return (x + abs(x)) * S(0.5) + log1p(exp(-abs(x)));
}

// sigmoid(x) = 1 / (1 + e^-x): exactly 0 or 1 at the extremes, never NaN.
template <class X>
WINNOW_HD auto sigmoid(const X& x) {
  using std::exp;
  using S = scalar_of_t<X>;
  return S(1) / (S(1) + exp(-x));
}

}  // namespace winnow::math
