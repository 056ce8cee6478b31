// Gated Sparse Attention's indexer (spec/gsa.md; seed 003), per element: one indexer head's
// term of the score I_ts, the adaptive budget k_t, and the order that exact top-k selection
// follows. Shared by the float64 reference, the CPU kernels and CUDA device code.
#pragma once

#include <cmath>
#include <cstdint>

#include "math/host_device.h"

namespace winnow::math::gsa {

// GSA's form: sigmoid(w_tj) * sigmoid(<q_tj, k_s> scale + b_j), each term in (0, 1), so a score
// lies in (0, H_I). DeepSeek-V3.2's (003's sparse-only baseline): w_tj * relu(<q_tj, k_s> scale),
// unbounded, no bias.
enum class ScoreForm : int { sigmoid = 0, relu = 1 };

template <class T>
WINNOW_HD T sigmoid(T x) {
  using std::exp;
  return T(1) / (T(1) + exp(-x));
}

struct Sigmoid {
  template <class T>
  WINNOW_HD T operator()(T x) const {
    return sigmoid(x);
  }
};

// A head's gate at a query: sigmoid(w_tj) (GSA) or w_tj itself (DeepSeek). `weight` is the
// head's pre-activation weight (h_t W_Iw_j + c_j). Kernels compute it once per (query, head),
// not once per key.
template <class T>
WINNOW_HD T gate(ScoreForm form, T weight) {
  return form == ScoreForm::relu ? weight : sigmoid(weight);
}

// One head's term from its gate: `dot` is the scaled dot product <q_tj, k_s> scale, `bias` b_j
// (sigmoid form only). `logistic` is the sigmoid used: math::gsa::Sigmoid everywhere a score is
// ranked; a kernel that only needs a row's moments may pass a faster one (CUDA's __expf).
template <class T, class Logistic = Sigmoid>
WINNOW_HD T gated_term(ScoreForm form, T gate, T dot, T bias, Logistic logistic = {}) {
  if (form == ScoreForm::relu) return dot > T(0) ? gate * dot : T(0);
  return gate * logistic(dot + bias);
}

template <class T>
WINNOW_HD T head_term(ScoreForm form, T weight, T dot, T bias) {
  return gated_term(form, gate(form, weight), dot, bias);
}

// How many keys a query selects.
//   fixed:            k
//   inverse_variance: k_base * Vbar / Var  (003's text: a confident, high-variance row needs fewer)
//   eq8:              k_base * Var / Vbar  (003's eq. 8 as printed)
//   reference:        k_base * (0.5 + 1 / (1 + Var / Vbar))  (003's public code)
// then floor, clamped to [k_min, k_max] (fixed: to k_max). A flat row (Var = 0) under
// inverse_variance has no preference and takes k_max.
enum class Budget : int { fixed = 0, inverse_variance = 1, eq8 = 2, reference = 3 };

struct BudgetParams {
  Budget rule = Budget::inverse_variance;
  std::int64_t k = 0;  // fixed
  std::int64_t k_base = 0, k_min = 1, k_max = 1;
  double mean_variance = 1.0;  // Vbar, > 0
};

WINNOW_HD std::int64_t budget(const BudgetParams& b, double variance) {
  using std::floor;
  double k = 0;
  switch (b.rule) {
    case Budget::fixed: return b.k < b.k_max ? b.k : b.k_max;
    case Budget::inverse_variance:
      k = variance > 0 ? static_cast<double>(b.k_base) * b.mean_variance / variance : HUGE_VAL;
      break;
    case Budget::eq8: k = static_cast<double>(b.k_base) * variance / b.mean_variance; break;
    case Budget::reference:
      k = static_cast<double>(b.k_base) * (0.5 + 1.0 / (1.0 + variance / b.mean_variance));
      break;
  }
  if (!(k >= static_cast<double>(b.k_min))) return b.k_min;  // NaN included
  if (k >= static_cast<double>(b.k_max)) return b.k_max;
  return static_cast<std::int64_t>(floor(k));
}

// Selection order: a higher score first; among equal scores the more recent key (003 leaves
// ties open; the spec breaks them toward recency, as causal attention favours it).
template <class T>
WINNOW_HD bool ranks_before(T score_a, std::int64_t key_a, T score_b, std::int64_t key_b) {
  return score_a > score_b || (score_a == score_b && key_a > key_b);
}

// The slopes of one head's term (gated_term) in its pre-activation weight w_tj and in its scaled
// dot product (the same as in b_j for the sigmoid form), for the indexer loss's gradients.
template <class T>
struct TermSlopes {
  T weight, dot;
};

template <class T>
WINNOW_HD TermSlopes<T> term_slopes(ScoreForm form, T gate, T dot, T bias) {
  if (form == ScoreForm::relu) return dot > T(0) ? TermSlopes<T>{dot, gate} : TermSlopes<T>{T(0), T(0)};
  const T s = sigmoid(dot + bias);
  return {s * gate * (T(1) - gate), gate * s * (T(1) - s)};
}

// The indexer loss (003 section 6) per key of a row's set: p (log p - log q), with p the heads'
// mean attention probability and log q = I_ts - lse_I the indexer's log-probability; a key the
// heads give no mass adds nothing. Its slope in I_ts is q - p (the row's p sums to 1).
template <class T>
WINNOW_HD T kl_term(T p, T log_q) {
  using std::log;
  return p > T(0) ? p * (log(p) - log_q) : T(0);
}

template <class T>
WINNOW_HD T kl_score_slope(T p, T log_q) {
  using std::exp;
  return exp(log_q) - p;
}

}  // namespace winnow::math::gsa
