// Threshold attention, per element (spec/threshold.md): the length-dependent threshold, the
// rectified power that makes a weight, its slope, and the L2 normalization of queries and keys
// with its gradient. Shared by the float64 reference, the CPU kernels and CUDA device code.
#pragma once

#include <cmath>

#include "math/elementwise.h"
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

// Both at once, for the CUDA kernels' per-score step: through r = max(x, 0) (NaN: 0, as above)
// and with no branch or select for p = 2 (r^2, 2 r), one for p = 1; a score a kernel leaves out
// comes as x = -inf and gets (0, 0).
template <class T>
struct WeightSlope {
  T weight, slope;
};
template <class T>
WINNOW_HD WeightSlope<T> weight_and_slope(T x, T p) {
  using std::fmax;
  using std::pow;
  const T r = fmax(x, T(0));
  if (p == T(2)) return {r * r, T(2) * r};
  if (p == T(1)) return {r, x > T(0) ? T(1) : T(0)};
  return {x > T(0) ? pow(r, p) : T(0), x > T(0) ? p * pow(r, p - T(1)) : T(0)};
}

// The weight and the slope divided by p: {r^2, r} at p = 2, {r, [x > 0]} at p = 1. A kernel
// whose sums over dS are linear in it (dK, dQ, dbeta) takes this, one operation a score fewer
// at p = 2 (no 2 r), and multiplies those sums by p once: exact, a power of two.
template <class T>
WINNOW_HD WeightSlope<T> weight_and_slope_over_p(T x, T p) {
  using std::fmax;
  const T r = fmax(x, T(0));
  if (p == T(2)) return {r * r, r};
  if (p == T(1)) return {r, x > T(0) ? T(1) : T(0)};
  const WeightSlope<T> ws = weight_and_slope(x, p);
  return {ws.weight, ws.slope / p};
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

// TDA's lambda as the weights use it, and d(used)/d(lambda).
template <class T>
WINNOW_HD T lambda_used(T lambda, bool clamp) {
  return clamp ? (lambda < T(0) ? T(0) : (lambda > T(1) ? T(1) : lambda)) : lambda;
}
template <class T>
WINNOW_HD T lambda_slope(T lambda, bool clamp) {
  return clamp ? ((lambda >= T(0) && lambda <= T(1)) ? T(1) : T(0)) : T(1);
}

// Whether a row tile whose smallest threshold is tau (its first row's) is likely to have key
// tiles with no score above it, so that a kernel checking each tile for exact zeros (a vote
// over its threads, then skipping the tile's products) gains more than the check costs: tau at
// least three standard deviations (1 / sqrt(D)) of a cosine between random directions. A
// heuristic for speed only; the check is exact wherever it runs.
template <class T>
WINNOW_HD bool zero_tiles_likely(T tau, T dim) {
  using std::sqrt;
  return tau * sqrt(dim) >= T(3);
}

// The screen of the CUDA forward (cuda/attention/threshold_screen_sm90.cuh) rules pairs out
// with 8-bit products before any 16-bit one. A normalized row a, as the kernels store it in 16
// bits, is written as scale * c with c int8 (|c_d| <= 127, scale = max_d |a_d| / 127, c_d the
// nearest integer to a_d (127 / max_d |a_d|)) and
// err = |a - scale c| (the quantization's error radius). For two rows a, b:
//   |a.b - scale_a scale_b (c_a.c_b)| <= err_a |b| + |scale_a c_a| err_b
//                                     <= err_a N + (N + err_a) err_b
// with N >= |b| for any normalized row rounded to 16 bits (|x_hat| <= 1, rounding <= 2^-8 of it).
// So a pair whose integer product is at most screen_cut(tau, ...) scores at most tau: an exact
// zero for any power. kScreenSlack covers float32 rounding in the scores and in the cut itself.
inline constexpr float kScreenRowNorm = 1.004f;
inline constexpr float kScreenSlack = 1e-4f;
inline constexpr int kScreenLevels = 127;

template <class T>
WINNOW_HD T screen_scale(T max_abs) {
  return max_abs > T(0) ? max_abs / T(kScreenLevels) : T(1);
}
// Rows are quantized by a product with the reciprocal of their scale, not by a division: the
// bound above holds for any codes c (err is measured from the codes chosen), and eight IEEE
// divisions a lane were most of the normalization kernels' arithmetic (each a reciprocal, a
// refinement, a range check and a slow-path branch in SASS).
template <class T>
WINNOW_HD T screen_inverse_scale(T max_abs) {
  return max_abs > T(0) ? T(kScreenLevels) / max_abs : T(1);
}
template <class T>
WINNOW_HD int screen_quantize(T x, T inverse_scale) {
  using std::rint;
  const T c = rint(x * inverse_scale);
  return static_cast<int>(c > T(kScreenLevels) ? T(kScreenLevels) : (c < T(-kScreenLevels) ? T(-kScreenLevels) : c));
}
// The bound on |a.b - scale_a scale_b (c_a.c_b)| from the two error radii (err_k may be the
// largest of a tile's keys: the bound grows with it).
template <class T>
WINNOW_HD T screen_margin(T err_q, T err_k) {
  return err_q * T(kScreenRowNorm) + (T(kScreenRowNorm) + err_q) * err_k + T(kScreenSlack);
}
// Integer products at or below the cut are exact zeros. scale_k and err_k may be the largest of
// a tile's keys (the cut only falls). Below 1 the screen rules nothing out (tau within the
// margin, as for beta = 0): the caller computes every score.
template <class T>
WINNOW_HD T screen_cut(T tau, T err_q, T scale_q, T err_k, T scale_k) {
  return (tau - screen_margin(err_q, err_k)) / (scale_q * scale_k);
}
// The same cut with no division per key tile, for the kernel's loop over tiles: a row's two
// terms once (screen_row_cut), then per tile a subtraction and two products with the tile's
// reciprocal scale (screen_tile_cut):
//   cut = (tau - margin) / (scale_q scale_k) = (offset - err_k) (factor / scale_k),
//   offset = (tau - err_q N - slack) / (N + err_q),  factor = (N + err_q) / scale_q.
// Its rounding differs from screen_cut's by a few ulps of the cut, a score error of a few ulps
// of tau, far inside kScreenSlack: the argument above holds (ThresholdScreen.
// IntegerProductsBoundTheScores checks both forms). A row with no keys to screen gets offset
// +infinity: its cut is +infinity, above every product.
template <class T>
struct ScreenRowCut {
  T offset;
  T factor;
};
template <class T>
WINNOW_HD ScreenRowCut<T> screen_row_cut(T tau, T err_q, T scale_q) {
  const T err_weight = T(kScreenRowNorm) + err_q;
  return {(tau - err_q * T(kScreenRowNorm) - T(kScreenSlack)) / err_weight, err_weight / scale_q};
}
template <class T>
WINNOW_HD T screen_tile_cut(const ScreenRowCut<T>& row, T err_k, T inv_scale_k) {
  return (row.offset - err_k) * (row.factor * inv_scale_k);
}

}  // namespace winnow::math::threshold
