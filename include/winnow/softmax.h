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

struct Outputs {
  TensorView out;  // like q with v's head dimension
  TensorView lse;  // per-row log-sum-exp of the scaled scores; -inf for a row that sees no key
};

// Writes outputs.out and outputs.lse. A row with no visible key outputs zero.
void forward(const AttentionInputs& in, const Options& options, const Outputs& outputs,
             const ExecContext& ctx = {});

// Gradients of sum(dout * out) with respect to q, k, v; `saved` holds what forward wrote.
void backward(const AttentionInputs& in, const Options& options, const Outputs& saved,
              const TensorView& dout, const AttentionGrads& grads, const ExecContext& ctx = {});

}  // namespace winnow::softmax
