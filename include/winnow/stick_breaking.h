// Causal stick-breaking attention (spec/stick-breaking.md, seed 002):
//   beta_ij = sigmoid(z_ij), A_ij = beta_ij prod_{i < k visible} (1 - beta_kj), o_j = sum_i A_ij v_i
// computed in log space: log A_ij = z_ij - sum_{k >= i visible} softplus(z_kj).
// The unallocated stick rem_j = exp(-sum_i softplus(z_ij)) is returned as log_rem_j.
#pragma once

#include <optional>

#include "winnow/attention.h"

namespace winnow::stick_breaking {

struct Options {
  std::optional<double> scale;  // default 1 / sqrt(D)
  bool attend_current = false;  // 002 defines the sum over i < j; true makes it i <= j
  // Early halting: once every row of a query tile has given away all but exp(-halt_cutoff)
  // of its stick, keys further left are dropped (their weights are below that bound). The
  // result is then exactly stick-breaking over the keys that were kept (kept_from reports
  // where each row's kept keys start), with exact gradients; log_rem reports the stick left
  // after the kept keys. 0 disables halting (the default: results then do not depend on the
  // tiling). 40 is below float32 resolution of any output.
  double halt_cutoff = 0.0;
};

struct Outputs {
  TensorView out;      // like q with v's head dimension
  TensorView log_rem;  // -sum of softplus over the row's kept keys: log of the stick left
  // int32 per row, shaped like log_rem: the first key the row kept (0 unless early halting
  // dropped keys). Forward writes it when present; backward needs it when halt_cutoff > 0.
  std::optional<TensorView> kept_from;
};

// Writes the outputs. A row with no visible key outputs zero and log_rem 0 (rem = 1).
void forward(const AttentionInputs& in, const Options& options, const Outputs& outputs,
             const ExecContext& ctx = {});

// Gradients of sum(dout * out) + sum(dlog_rem * log_rem) with respect to q, k, v.
// `saved` holds what forward wrote with the same options; dlog_rem may be absent (zero).
void backward(const AttentionInputs& in, const Options& options, const Outputs& saved,
              const TensorView& dout, const std::optional<TensorView>& dlog_rem,
              const AttentionGrads& grads, const ExecContext& ctx = {});

}  // namespace winnow::stick_breaking
