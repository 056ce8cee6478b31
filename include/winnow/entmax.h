// Causal alpha-entmax attention (spec/entmax.md; the baseline of seeds 000 and 004):
//   p_ij = [(alpha - 1) z_ij - tau_j]_+ ^ (1 / (alpha - 1)),  tau_j such that sum_i p_ij = 1,
//   o_j = sum_i p_ij v_i.
// alpha = 2 is sparsemax, 1.5 the seeds' default; alpha -> 1 approaches softmax. Keys whose
// scaled score falls below tau_j / (alpha - 1) get exactly zero weight.
#pragma once

#include <optional>

#include "winnow/attention.h"

namespace winnow::entmax {

struct Options {
  std::optional<double> scale;  // default 1 / sqrt(D)
  bool attend_current = true;   // query j sees key j
  double alpha = 1.5;           // any alpha > 1
  // The threshold search stops once |sum_i p_ij - 1| <= tolerance (or its bracket can shrink
  // no further). Default: 1e-5 for float32 / float16 / bfloat16 inputs, 1e-12 for float64.
  std::optional<double> tolerance;
};

struct Outputs {
  TensorView out;  // like q with v's head dimension
  TensorView tau;  // per-row threshold tau_j (0 for a row that sees no key)
};

// Writes the outputs. A row with no visible key outputs zero.
void forward(const AttentionInputs& in, const Options& options, const Outputs& outputs,
             const ExecContext& ctx = {});

// Gradients of sum(dout * out) with respect to q, k, v; `saved` holds what forward wrote with
// the same options (the threshold carries no gradient of its own: it is a function of z whose
// effect the formula dz = u (dp - delta) already contains).
void backward(const AttentionInputs& in, const Options& options, const Outputs& saved,
              const TensorView& dout, const AttentionGrads& grads, const ExecContext& ctx = {});

}  // namespace winnow::entmax
