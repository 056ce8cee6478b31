// Causal Sieve attention (spec/sieve.md, seed 000): an alpha-entmax filter picks each row's
// candidate keys S_j, then stick-breaking allocates the row's mass over S_j alone:
//   log A_ij = z_ij - sum_{k in S_j, k >= i} softplus(z_kj)  for i in S_j, A_ij = 0 otherwise,
//   o_j = sum_i A_ij v_i,  rem_j = exp(-sum_{k in S_j} softplus(z_kj)).
// The entmax probabilities themselves are not used, only their support.
#pragma once

#include <optional>

#include "winnow/attention.h"

namespace winnow::sieve {

enum class Filter {
  // S_j = { i : (alpha - 1) z_ij > tau_j }, the true alpha-entmax support (a threshold search
  // over the row's keys).
  exact,
  // S_j = { i : z_ij > max_k z_kj - eps }, 000's Algorithm 1: only the row maximum is needed.
  // With eps = 1 / (alpha - 1) (the default) it is a superset of the exact support.
  bound,
};

struct Options {
  std::optional<double> scale;  // default 1 / sqrt(D)
  bool attend_current = false;  // like stick-breaking, 000 sums over keys i < j
  double alpha = 1.5;           // the filter's alpha, > 1
  Filter filter = Filter::exact;
  std::optional<double> eps;        // bound filter only: default 1 / (alpha - 1)
  std::optional<double> tolerance;  // exact filter's threshold search (see entmax::Options)
};

struct Outputs {
  TensorView out;        // like q with v's head dimension
  TensorView log_rem;    // -sum of softplus over S_j: log of the stick left
  TensorView threshold;  // per row, in score units: key i is a candidate iff z_ij > threshold_j
  std::optional<TensorView> count;  // int32 per row: |S_j| (forward writes it when present)
};

// Writes the outputs. A row with no visible key outputs zero, log_rem 0 and count 0.
void forward(const AttentionInputs& in, const Options& options, const Outputs& outputs,
             const ExecContext& ctx = {});

// Gradients of sum(dout * out) + sum(dlog_rem * log_rem) with respect to q, k, v. The filter
// is piecewise constant in the scores, so it passes no gradient; `saved` holds what forward
// wrote (the threshold decides the candidate sets again).
void backward(const AttentionInputs& in, const Options& options, const Outputs& saved,
              const TensorView& dout, const std::optional<TensorView>& dlog_rem,
              const AttentionGrads& grads, const ExecContext& ctx = {});

}  // namespace winnow::sieve
