// alpha-entmax, per element and per threshold-search step (spec/entmax.md). Shared by the CPU
// kernels and the CUDA kernels; the float64 reference finds its thresholds its own way (sorting
// for alpha = 2 and 1.5, bisection otherwise).
//
// Everything is in x = (alpha - 1) z units, where a row's weights are
//   p_i = [x_i - tau]_+ ^ (1 / (alpha - 1))
// and the backward's u_i = p_i^(2 - alpha) = [x_i - tau]_+ ^ ((2 - alpha) / (alpha - 1)).
#pragma once

#include <cmath>

#include "math/host_device.h"

namespace winnow::math::entmax {

// p for the gap x - tau. alpha = 2 and 1.5 avoid pow.
template <class S>
WINNOW_HD S weight(S gap, S alpha) {
  using std::pow;
  if (!(gap > S(0))) return S(0);
  if (alpha == S(2)) return gap;
  if (alpha == S(1.5)) return gap * gap;
  return pow(gap, S(1) / (alpha - S(1)));
}

// u = p^(2 - alpha) for the gap x - tau: the weight each key's logit gradient gets, and
// (times -1 / (alpha - 1)) the derivative of sum_i p_i with respect to tau.
template <class S>
WINNOW_HD S grad_weight(S gap, S alpha) {
  using std::pow;
  if (!(gap > S(0))) return S(0);
  if (alpha == S(2)) return S(1);
  if (alpha == S(1.5)) return gap;
  return pow(gap, (S(2) - alpha) / (alpha - S(1)));
}

// dz_i = u_i (dp_i - delta), delta = sum_k u_k dp_k / sum_k u_k.
template <class U, class DP, class R>
WINNOW_HD auto grad_logit(const U& u, const DP& dp, const R& delta) {
  return u * (dp - delta);
}

// The threshold of one row, found by Newton's method safeguarded by bisection on
//   f(tau) = sum_i [x_i - tau]_+^(1 / (alpha - 1)),   f(tau) = 1,
// one sweep over the row's keys per step. The bracket comes from the row maximum m (in x
// units) and its n visible keys: m - 1 <= tau <= m - n^(1 - alpha). Newton starts at the left
// end; for alpha <= 2, where f is convex, its steps then rise monotonically to the root.
template <class S>
struct ThresholdSearch {
  S lo = S(0), hi = S(0), tau = S(0);
  bool done = true;

  WINNOW_HD void start(S x_max, S n_visible) {
    using std::pow;
    lo = x_max - S(1);
    tau = lo;
    hi = n_visible > S(1) ? x_max - pow(n_visible, S(1) - alpha_) : lo;
    done = !(hi > lo);
  }
  // Records f(tau) and sum_i u_i at the current tau; returns true once tau is final.
  WINNOW_HD bool step(S f, S sum_u) {
    using std::fabs;
    if (done) return true;
    if (fabs(f - S(1)) <= tolerance_) return done = true;
    if (f > S(1)) {
      lo = tau;
    } else {
      hi = tau;
    }
    // f'(tau) = -sum_i u_i / (alpha - 1).
    S next = tau + (alpha_ - S(1)) * (f - S(1)) / sum_u;
    if (!(next > lo && next < hi)) next = lo + (hi - lo) * S(0.5);
    if (!(next > lo && next < hi)) return done = true;  // the bracket cannot shrink further
    // A step within a few ulps of tau cannot improve it: near the root the sign of f - 1 is
    // decided by f's own rounding (hundreds of terms at long context), and Newton and
    // bisection would trade places for dozens of sweeps while the bracket closes.
    const S resolution = S(4) * (sizeof(S) == 4 ? S(1.1920929e-7) : S(2.220446049250313e-16));
    const S moved = next > tau ? next - tau : tau - next;
    tau = next;
    if (moved <= resolution * (fabs(tau) + S(1))) return done = true;
    return false;
  }

  WINNOW_HD ThresholdSearch(S alpha, S tolerance) : alpha_(alpha), tolerance_(tolerance) {}

 private:
  S alpha_, tolerance_;
};

// Sweeps a search takes at most: Newton usually needs under ten; bisection halves a bracket
// no wider than 1, so this bounds the worst case at float64 resolution.
inline constexpr int kMaxSearchSteps = 64;

}  // namespace winnow::math::entmax

namespace winnow::math::sieve {

// Whether key i is one of row j's candidates, given the row's threshold in score units
// (entmax: tau / (alpha - 1); bound: row max - eps).
template <class X, class R>
WINNOW_HD bool admitted(X z, R threshold) {
  return z > threshold;
}

}  // namespace winnow::math::sieve
