// Threshold attention, per element (spec/threshold.md): the length-dependent threshold, the
// rectified power that makes a weight, its slope, and the L2 normalization of queries and keys
// with its gradient. Shared by the float64 reference, the CPU kernels and CUDA device code.
#pragma once

#include <cmath>

#include "math/host_device.h"

namespace winnow::math::threshold {

// tau_j / beta = sqrt(2 log(n) / D) for a query that sees n keys: about the largest of n
// cosine similarities between random directions in D dimensions, so that noise keys stay below
// the threshold at any length (004, theorem 4.3). 0 for n <= 1.
template <class T>
WINNOW_HD T threshold_unit(T visible_keys, T dim) {
  using std::log;
  using std::sqrt;
  return visible_keys > T(1) ? sqrt(T(2) * log(visible_keys) / dim) : T(0);
}

// w = relu(x)^p with x = s - tau; p = 1 and p = 2 without a pow.
template <class T>
WINNOW_HD T weight(T x, T p) {
  using std::pow;
  if (!(x > T(0))) return T(0);
  if (p == T(2)) return x * x;
  if (p == T(1)) return x;
  return pow(x, p);
}

// dw/dx = p relu(x)^(p - 1); 0 at and below the threshold (where the weight is exactly 0).
template <class T>
WINNOW_HD T weight_slope(T x, T p) {
  using std::pow;
  if (!(x > T(0))) return T(0);
  if (p == T(2)) return T(2) * x;
  if (p == T(1)) return T(1);
  return p * pow(x, p - T(1));
}

// The same two on arrays (Eigen expressions of a whole score tile), branch-free so they
// vectorize: relu(x) spelled (x + |x|) / 2, which is exact, and the slope at x <= 0 selected
// to 0 (pow(0, p - 1) is infinite for p < 1).
template <class X>
auto weight_array(const X& x, scalar_of_t<X> p) {
  using S = scalar_of_t<X>;
  const auto r = (x + x.abs()) * S(0.5);
  if (p == S(2)) return (r * r).eval();
  if (p == S(1)) return r.eval();
  return r.pow(p).eval();
}
template <class X>
auto weight_slope_array(const X& x, scalar_of_t<X> p) {
  using S = scalar_of_t<X>;
  const auto r = (x + x.abs()) * S(0.5);
  if (p == S(2)) return (S(2) * r).eval();
  if (p == S(1)) return (x > S(0)).template cast<S>().eval();
  return (x > S(0)).select(p * r.pow(p - S(1)), S(0)).eval();
}

// 1 / max(|x|, eps) from sum(x^2).
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

// TDA's lambda as the weights use it, and d(used)/d(lambda).
template <class T>
WINNOW_HD T lambda_used(T lambda, bool clamp) {
  return clamp ? (lambda < T(0) ? T(0) : (lambda > T(1) ? T(1) : lambda)) : lambda;
}
template <class T>
WINNOW_HD T lambda_slope(T lambda, bool clamp) {
  return clamp ? ((lambda >= T(0) && lambda <= T(1)) ? T(1) : T(0)) : T(1);
}

}  // namespace winnow::math::threshold
