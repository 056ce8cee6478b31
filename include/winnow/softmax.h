// Causal softmax attention (spec/softmax.md): the baseline every experiment compares against.
//   z_ij = scale <q_j, k_i> over visible keys, p = softmax_i(z), o_j = sum_i p_ij v_i.
#pragma once

#include <optional>

#include "winnow/attention.h"

namespace winnow::softmax {

struct Options {
  std::optional<double> scale;  // default 1 / sqrt(D)
  bool attend_current = true;   // query j sees key j
  // Backward only. q and k were rotated by these RoPE tables before the call (rotary::apply's
  // (Lk, D/2) cos and sin, float32, or float64 for float64 inputs; the queries at the last Lq
  // positions), and dq and dk are wanted with respect to the unrotated q and k: they are
  // written rotated back, on Hopper by the kernels as they store them. Both or neither;
  // batched inputs only.
  std::optional<TensorView> rotary_cos = std::nullopt, rotary_sin = std::nullopt;
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
