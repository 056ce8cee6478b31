// Multiscreen's screening unit, per element (spec/screening.md; seed 001): the learned window
// and acceptance width, MiPE's rotation rate, Trim, the causal Softmask, TanhNorm, and each
// one's derivative. Shared by the float64 reference, the CPU kernels and CUDA device code.
//
// For query position i and key position j <= i (d = j - i <= 0):
//   s_ij = <qm_i, km_j>,  alpha_ij = max(1 - (1 - s_ij) / r, 0)^2,
//   m_ij = 0.5 (cos(pi d / w) + 1) for d > -w, else 0,   R_ij = alpha_ij m_ij,
//   h_i = sum_j R_ij vn_j,  u_i = tanh(|h_i|) / |h_i| h_i.
#pragma once

#include <cmath>
#include <cstdint>

#include "math/host_device.h"

namespace winnow::math::screening {

inline constexpr double kPi = 3.14159265358979323846;

// w = exp(s_w) + 1 > 1 and r = sigmoid(s_r) in (0, 1).
template <class T>
WINNOW_HD T window(T s_w) {
  using std::exp;
  return exp(s_w) + T(1);
}
template <class T>
WINNOW_HD T acceptance(T s_r) {
  using std::exp;
  return T(1) / (T(1) + exp(-s_r));
}

// MiPE rotates coordinates 0 and 1 of a unit query or key at position i by i * rate(w), with
// rate = pi gamma(w) / w and gamma(w) = (cos(pi w / w_th) + 1) / 2 below w_th, 0 above: the
// rotation fades out as the window grows and is the identity from w_th on.
template <class T>
WINNOW_HD T mipe_rate(T w, T w_th) {
  using std::cos;
  if (!(w < w_th)) return T(0);
  const T gamma = T(0.5) * (cos(T(kPi) * w / w_th) + T(1));
  return T(kPi) * gamma / w;
}
// d rate / d w.
template <class T>
WINNOW_HD T mipe_rate_slope(T w, T w_th) {
  using std::cos;
  using std::sin;
  if (!(w < w_th)) return T(0);
  const T gamma = T(0.5) * (cos(T(kPi) * w / w_th) + T(1));
  const T gamma_slope = T(-0.5) * sin(T(kPi) * w / w_th) * T(kPi) / w_th;
  return T(kPi) * (gamma_slope * w - gamma) / (w * w);
}

// Trim: alpha = t^2 with t = max(1 - (1 - s) / r, 0), exactly 0 unless s > 1 - r.
template <class T>
WINNOW_HD T trim_base(T s, T r) {
  const T t = T(1) - (T(1) - s) / r;
  return t > T(0) ? t : T(0);
}
template <class T>
WINNOW_HD T trim(T s, T r) {
  const T t = trim_base(s, r);
  return t * t;
}
// d alpha / d s = 2 t / r and d alpha / d r = 2 t (1 - s) / r^2 (0 where alpha is).
template <class T>
WINNOW_HD T trim_slope_s(T s, T r) {
  return T(2) * trim_base(s, r) / r;
}
template <class T>
WINNOW_HD T trim_slope_r(T s, T r) {
  return T(2) * trim_base(s, r) * (T(1) - s) / (r * r);
}

// The Softmask at offset d = j - i <= 0 for window w; `infinite` (window expansion): 1.
template <class T>
WINNOW_HD T softmask(T d, T w, bool infinite) {
  using std::cos;
  if (infinite) return T(1);
  return d > -w ? T(0.5) * (cos(T(kPi) * d / w) + T(1)) : T(0);
}
// d m / d w = sin(pi d / w) pi d / (2 w^2) inside the window; 0 at its edge, where m is flat,
// so a support that moves with w adds nothing.
template <class T>
WINNOW_HD T softmask_slope(T d, T w, bool infinite) {
  using std::sin;
  if (infinite || !(d > -w)) return T(0);
  return T(0.5) * sin(T(kPi) * d / w) * T(kPi) * d / (w * w);
}

// The first key position inside the window of query position i: j > i - w. 0 for an infinite
// window. Kernels visit keys from here to the causal limit only.
template <class T>
WINNOW_HD std::int64_t first_key(std::int64_t i, T w, bool infinite) {
  using std::floor;
  if (infinite) return 0;
  const T edge = T(i) - w;
  const std::int64_t first = static_cast<std::int64_t>(floor(edge)) + 1;
  return first > 0 ? first : 0;
}

// TanhNorm u = f(n) h with n = |h| and f(n) = tanh(n) / n (1 at n = 0).
template <class T>
WINNOW_HD T tanh_norm_factor(T n) {
  using std::tanh;
  return n < T(1e-4) ? T(1) - n * n / T(3) : tanh(n) / n;
}
// The backward from the output: with du = dL/du, dL/dh = f du + phi(n) <u, du> u where
// phi(n) = f'(n) / (n f(n)^2) = (n sech^2 n - tanh n) / (n tanh^2 n), -2/3 at 0. Its numerator
// cancels at small n, so there the series -2/3 + 4n^2/45 - 4n^4/315 + 8n^6/4725 stands in
// (below 0.5 in float and 0.05 in double: both sides then within about 1e-6 and 1e-13).
template <class T>
WINNOW_HD T tanh_norm_phi(T n) {
  using std::tanh;
  const T small = sizeof(T) >= 8 ? T(0.05) : T(0.5);
  if (n < small) {
    const T n2 = n * n;
    return T(-2) / T(3) + n2 * (T(4) / T(45) + n2 * (T(-4) / T(315) + n2 * (T(8) / T(4725))));
  }
  const T t = tanh(n);
  const T sech2 = T(1) - t * t;
  return (n * sech2 - t) / (n * t * t);
}

// One head's constants, resolved once per call from its learned scalars.
template <class T>
struct Head {
  T w, r;
  bool infinite;     // window expansion: Softmask 1 on every visible key, no MiPE
  T rate;            // MiPE's angle per position
  T rate_slope;      // d rate / d w
  WINNOW_HD Head(T s_w, T s_r, T w_th, T expand_above)
      : w(window(s_w)), r(acceptance(s_r)), infinite(expand_above > T(0) && w > expand_above) {
    rate = infinite ? T(0) : mipe_rate(w, w_th);
    rate_slope = infinite ? T(0) : mipe_rate_slope(w, w_th);
  }
  // dw / ds_w = exp(s_w) = w - 1 (0 for an infinite window, which no longer depends on it) and
  // dr / ds_r = r (1 - r).
  WINNOW_HD T dw_ds() const { return infinite ? T(0) : w - T(1); }
  WINNOW_HD T dr_ds() const { return r * (T(1) - r); }
};

}  // namespace winnow::math::screening
