// Stick-breaking attention, per element (spec/stick-breaking.md).
//
// In log space a row's weights need only softplus sums to the right of each key:
//   log A_ij = z_ij - sum_{k >= i} softplus(z_kj).
// Kernels visit keys in tiles from the diagonal leftwards, carrying
//   carry_j = -sum of softplus over the keys already visited (all to the right),
// so inside a tile log A_ij = z_ij - (in-tile inclusive suffix sum of softplus) + carry_j.
// At the end carry_j = -S_j = log rem_j.
#pragma once

#include <cmath>

#include "math/elementwise.h"
#include "math/host_device.h"

namespace winnow::math::stick_breaking {

// Each key's share of the stick it breaks off: softplus(z) = -log(1 - sigmoid(z)).
template <class X>
WINNOW_HD auto stick_cost(const X& z) {
  return softplus(z);
}

// The same cost in base 2, log2(1 + 2^x) = max(x, 0) + log2(1 + 2^-|x|), for kernels that
// keep logits in log2 units (x = z log2 e) to use the hardware's exp2 and log2.
template <class X, class Exp2, class Log2>
WINNOW_HD X stick_cost_log2(X x, Exp2 exp2, Log2 log2) {
  const X a = x < X(0) ? -x : x;
  return (x + a) * X(0.5) + log2(X(1) + exp2(-a));
}
// The same for float, where max and |.| are single instructions (or free operand modifiers on
// a GPU): kernels evaluate this once per score.
template <class Exp2, class Log2>
WINNOW_HD float stick_cost_log2(float x, Exp2 exp2, Log2 log2) {
  return fmaxf(x, 0.f) + log2(1.f + exp2(-fabsf(x)));
}

// A key's two shares of the stick in linear form, from its logit x in log2 units, with two
// special-function operations (2^-|x| and a reciprocal) where the cost above and the weight
// 2^(x - suffix) take three:
//   sigmoid = 2^min(x, 0) / d  (the share it takes),  keep = 2^-max(x, 0) / d  (1 - sigmoid,
//   without the cancellation),  d = 1 + 2^-|x| in (1, 2].
// Kernels multiply keep along a thread's keys for the weights (sigmoid_i times the keeps to its
// right; a product that underflows belongs to weights below float's range) and take the keys'
// total cost in log2 from relu and d, which neither overflow nor underflow:
//   sum_k cost_k = sum_k max(x_k, 0) + log2(prod_k d_k),  prod_k d_k <= 2^(keys).
// x = -inf (a key left out) gives sigmoid 0, keep 1, d 1: no weight and no cost.
struct StickShares {
  float sigmoid, keep, d;
};
template <class Exp2, class Rcp>
WINNOW_HD StickShares stick_shares_log2(float x, Exp2 exp2, Rcp rcp) {
  const float e = exp2(-fabsf(x));
  const float d = 1.f + e;
  const float r = rcp(d);
  return {x < 0.f ? e * r : r, x < 0.f ? r : e * r, d};
}

// The same shares from the odds 2^x, for a forward that needs only the weights and the keys'
// total cost:
//   odds = 2^min(x, kOddsClamp),  keep = 1 / (1 + odds),  sigmoid = odds * keep,
// the two special-function operations of the linear shares with no select. A thread walking its
// keys from the right keeps K, the product of the keeps to the right: a key's weight among the
// thread's keys is sigmoid * K, and the keys' total cost is -log2 of the final K. With d and
// relu gone that is 9 operations a score against 14.
// The clamp keeps the odds finite (past x = 24 the sigmoid is 1 to float's precision either way)
// and costs nothing in the weights: a clamped key's keep is 2^-120 instead of 2^-x, which only
// raises the weights to its left from below 2^-x of the thread's stick to below 2^-120 of it. The
// cost is another matter: it must stay exact (the remainder it makes is what the backward
// rebuilds every stick from), and -log2 K is exact only if no key was clamped and K did not
// underflow. Both leave K below kOddsStickFloor, and K only shrinks along the walk, so a walk that
// ends at or above the floor (keys costing up to 116 bits) has its exact cost in -log2 K; one
// that ends below it takes the cost from the keys' logits, key by key (stick_cost_log2).
// x = -inf (a key left out) gives sigmoid 0, keep 1: no weight and no cost.
inline constexpr float kOddsClamp = 120.f;
inline constexpr float kOddsStickFloor = 0x1p-116f;
struct StickOdds {
  float sigmoid, keep;
};
template <class Exp2>
WINNOW_HD float odds_log2(float x, Exp2 exp2) {
  return exp2(x < kOddsClamp ? x : kOddsClamp);
}
template <class Rcp>
WINNOW_HD StickOdds stick_shares_of_odds(float odds, Rcp rcp) {
  const float keep = rcp(1.f + odds);
  return {odds * keep, keep};
}
template <class Exp2, class Rcp>
WINNOW_HD StickOdds stick_odds_log2(float x, Exp2 exp2, Rcp rcp) {
  return stick_shares_of_odds(odds_log2(x, exp2), rcp);
}

// The same weights with one special-function operation a score, from the left. A thread's
// keys k = 0..n-1, left to right, with odds o_k: what key k leaves of the stick that reaches it
// from the right is 1 / prod_{j >= k} (1 + o_j), so with the product grown from the left,
//   G_0 = 1,  G_{k+1} = G_k (1 + o_k)  (one fused multiply-add, grown_by),
// key k's weight among the thread's keys is o_k G_k / G_n and their cost is log2 G_n. A second
// pass grows H_0 = 1 / G_n the same way for the weights, o_k H_k. G_n = 1 / K of the walk from
// the right, so it gives the exact cost under the same bound, G_n <= kOddsProductCeiling; past
// it (or at infinity), the odds still in hand take the walk from the right (stick_shares_of_odds)
// and the cost comes from the logits, as there. One exp2 a key against the walk's exp2 and
// reciprocal, and one reciprocal and one log2 per thread and row.
inline constexpr float kOddsProductCeiling = 0x1p116f;
WINNOW_HD float grown_by(float product, float odds) {
  return fmaf(product, odds, product);
}

// Grown in chains: one product grown key by key is a chain of n dependent multiply-adds, the
// latency a thread's walk waits on (ncu, 2026-11-29: each exp2 of the D = 64 forward waited on
// the multiply-add before it). So a thread's n keys may grow as chains of K consecutive keys
// (kGrownChains<n, K> of them; one if K does not divide n), side by side: chain c's product G^c, their prefixes
// P^c = G^0 ... G^(c-1) (P^0 = 1) and G_n = P^(C-1) G^(C-1). Chain c's second pass starts from
// H = P^c / G_n, the H of the single chain at the chain's first key. Rounding: each weight still
// passes through one rounding a key of the keys to its left, plus a few per chain.
template <int N, int K>
inline constexpr int kGrownChains = K > 0 && N % (K > 0 ? K : 1) == 0 ? N / (K > 0 ? K : 1) : 1;
template <int N, int K>
struct GrownOdds {
  float prefix[kGrownChains<N, K>];  // P^c
  float total;                       // G_n
};
// odds(k): key k's odds, left to right, k = 0..N-1; the products of the odds as they stand.
template <int N, int K, class Odds>
WINNOW_HD GrownOdds<N, K> grow_odds(Odds&& odds) {
  constexpr int C = kGrownChains<N, K>, L = N / C;
  float chain[C];
  WINNOW_UNROLL
  for (int c = 0; c < C; ++c) chain[c] = 1.f;
  WINNOW_UNROLL
  for (int j = 0; j < L; ++j) {
    WINNOW_UNROLL
    for (int c = 0; c < C; ++c) chain[c] = grown_by(chain[c], odds(c * L + j));
  }
  GrownOdds<N, K> grown;
  grown.prefix[0] = 1.f;
  WINNOW_UNROLL
  for (int c = 1; c < C; ++c) grown.prefix[c] = grown.prefix[c - 1] * chain[c - 1];
  grown.total = grown.prefix[C - 1] * chain[C - 1];
  return grown;
}
// The grown form's odds need no clamp: its products go on only while G <= kOddsProductCeiling
// (2^116, under 2^kOddsClamp), so no key the clamp would change reaches them, and the walk it
// falls back to clamps the odds it takes (clamp_odds). That leaves one operation a key, the exp2.
template <class Exp2>
WINNOW_HD float grown_odds_log2(float x, Exp2 exp2) {
  return exp2(x);
}
WINNOW_HD float clamp_odds(float odds) {
  constexpr float kClampedOdds = 0x1p120f;  // 2^kOddsClamp
  static_assert(kOddsClamp == 120.f, "kClampedOdds is 2^kOddsClamp");
  return odds < kClampedOdds ? odds : kClampedOdds;
}

// The weights in place of the odds (grown.total at most kOddsProductCeiling), each times a
// thread's share of its row's stick when `first` = share / G_n instead of 1 / G_n: o_k H_k with
// H_0 = first. The share comes in at the start of H, not as a multiply a key.
template <int N, int K, class Odds>
WINNOW_HD void weigh_grown_odds_from(Odds&& odds, const GrownOdds<N, K>& grown, float first) {
  constexpr int C = kGrownChains<N, K>, L = N / C;
  float h[C];
  WINNOW_UNROLL
  for (int c = 0; c < C; ++c) h[c] = c == 0 ? first : first * grown.prefix[c];
  WINNOW_UNROLL
  for (int j = 0; j < L; ++j) {
    WINNOW_UNROLL
    for (int c = 0; c < C; ++c) {
      float& w = odds(c * L + j);
      const float o = w;
      w = o * h[c];
      h[c] = grown_by(h[c], o);
    }
  }
}
template <int N, int K, class Odds, class Rcp>
WINNOW_HD void weigh_grown_odds(Odds&& odds, const GrownOdds<N, K>& grown, Rcp rcp) {
  weigh_grown_odds_from(odds, grown, rcp(grown.total));
}
// Whether first = share / G_n keeps the weights: a first below float's least normal value loses
// them (flushed, or a subnormal's few bits), which matters only if the weights could be worth
// keeping, i.e. the share is at least 2^-64 of the row's stick. Otherwise the walk from the right
// takes the thread's keys and the share multiplies its weights.
inline constexpr float kFoldedShareFloor = 0x1p-64f;
WINNOW_HD bool folded_share_keeps_weights(float first, float share) {
  return first >= 0x1p-126f || share < kFoldedShareFloor;
}

// log A_ij from the logit, the in-tile suffix cost (including key i) and the row's carry.
template <class X, class C, class R>
WINNOW_HD auto log_weight(const X& z, const C& suffix_cost, const R& carry) {
  return z - suffix_cost + carry;
}

// dz_ij = g_ij - sigmoid(z_ij) * (sum_{i' <= i} g_i'j + dlog_rem_j), g_ij = A_ij <do_j, v_i>.
// The dlog_rem term is d(log rem_j)/dz_ij = -sigmoid(z_ij) times the incoming gradient.
// Kernels that already hold sigmoid(z_ij) (as exp2(z - cost) in log2 units) call this form.
template <class G, class B, class P>
WINNOW_HD auto grad_logit_given_sigmoid(const G& g, const B& sigmoid_z,
                                        const P& prefix_g_plus_dlog_rem) {
  return g - sigmoid_z * prefix_g_plus_dlog_rem;
}

template <class G, class X, class P>
WINNOW_HD auto grad_logit(const G& g, const X& z, const P& prefix_g_plus_dlog_rem) {
  return grad_logit_given_sigmoid(g, sigmoid(z), prefix_g_plus_dlog_rem);
}

// Split-KV decoding (spec "Decode and split-KV"): a chunk c of a row's keys is summarized by
// its cost S_c (the sum of its keys' stick costs) and its output o_c over its own keys. Chunks
// combine right to left, o = o_right + exp(-S_right) o_left and S = S_left + S_right: the left
// chunk's weights lose what the right chunk broke off first. This is the left side's factor.
template <class X, class Exp>
WINNOW_HD X left_chunk_factor(X right_cost, Exp exp) {
  return exp(-right_cost);
}

}  // namespace winnow::math::stick_breaking
