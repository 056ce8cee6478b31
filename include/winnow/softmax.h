// Causal softmax attention (spec/softmax.md): the baseline every experiment compares against.
//   z_ij = scale <q_j, k_i> over visible keys, p = softmax_i(z), o_j = sum_i p_ij v_i.
#pragma once

#include <optional>

#include "winnow/attention.h"

namespace winnow::softmax {

struct Options {
  std::optional<double> scale;  // default 1 / sqrt(D)
  bool attend_current = true;   // query j sees key j
};

// Writes out (like q with Dv) and lse, the per-row log-sum-exp of the scaled scores
// (-inf for a row with no visible key, whose output is zero).
void forward(const AttentionInputs& in, const Options& options, const TensorView& out,
             const TensorView& lse, const ExecContext& ctx = {});

// Gradients of sum(dout * out) with respect to q, k, v; out and lse come from forward.
void backward(const AttentionInputs& in, const Options& options, const TensorView& out,
              const TensorView& lse, const TensorView& dout, const AttentionGrads& grads,
              const ExecContext& ctx = {});

}  // namespace winnow::softmax
