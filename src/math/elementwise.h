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

// Unit normalization x / max(|x|, eps) (threshold attention, Multiscreen): the inverse norm
// from sum(x^2), whether eps was taken, and the gradient.
template <class T>
WINNOW_HD T inverse_norm(T sum_of_squares, T eps) {
  using std::sqrt;
  const T n = sqrt(sum_of_squares);
  return T(1) / (n > eps ? n : eps);
}

// Whether max(|x|, eps) took eps (then x_hat = x / eps is linear in x).
template <class T>
WINNOW_HD bool norm_clipped(T sum_of_squares, T eps) {
  return !(sum_of_squares > eps * eps);
}

// dx_e from g = dL/dx_hat: (g_e - x_hat_e <x_hat, g>) / |x| where |x| > eps, else g_e / eps.
template <class T>
WINNOW_HD T normalize_grad(T g, T x_hat, T x_hat_dot_g, T inv_norm, bool clipped) {
  return clipped ? g * inv_norm : (g - x_hat * x_hat_dot_g) * inv_norm;
}

}  // namespace winnow::math
