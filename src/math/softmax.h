// Softmax attention, per element (spec/softmax.md).
#pragma once

#include <cmath>

#include "math/host_device.h"

namespace winnow::math::softmax {

// p_ij from the row's log-sum-exp.
template <class X, class R>
WINNOW_HD auto probability(const X& z, const R& lse) {
  using std::exp;
  return exp(z - lse);
}

// The same in base 2 (z and lse in log2 units) with the caller's exp2.
template <class X, class R, class Exp2>
WINNOW_HD X probability(X z, R lse, Exp2 exp2) {
  return exp2(z - lse);
}

// dz_ij = p_ij (dp_ij - delta_j), delta_j = <do_j, o_j> = sum_i p_ij dp_ij.
template <class P, class DP, class R>
WINNOW_HD auto grad_logit(const P& p, const DP& dp, const R& delta) {
  return p * (dp - delta);
}

// Split-KV decoding: a chunk of a row's keys is summarized by its largest logit m, its sum
// l = sum_i exp(z_i - m) and o = sum_i exp(z_i - m) v_i. Chunks merge in any order: m is the
// larger of the two, and each side's l and o are rescaled by this factor. A chunk without keys
// (m = -inf, l = 0) rescales by 0, and two such chunks by 1, never NaN.
template <class X, class Exp>
WINNOW_HD X merge_factor(X m_side, X m_merged, Exp exp) {
  return m_side == m_merged ? X(1) : exp(m_side - m_merged);
}

}  // namespace winnow::math::softmax
