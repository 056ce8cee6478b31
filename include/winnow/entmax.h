// Causal alpha-entmax attention (spec/entmax.md; the baseline of seeds 000 and 004):
//   p_ij = [(alpha - 1) z_ij - tau_j]_+ ^ (1 / (alpha - 1)),  tau_j such that sum_i p_ij = 1,
//   o_j = sum_i p_ij v_i.
// alpha = 2 is sparsemax, 1.5 the seeds' default; alpha -> 1 approaches softmax. Keys whose
// scaled score falls below tau_j / (alpha - 1) get exactly zero weight.
#pragma once

#include <cstdint>
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

// The support record: each row's support keys, which a forward can list as it computes the
// weights so that its backward need not find them again (a sweep of Q K^T over every key
// tile, about a third of the backward's time on random scores at 4K keys). An int32 vector of
// support_record_size() elements on q's device, laid out as
//   [0] 1 if the forward listed the supports, else 0   [1] entries listed   [2] nonzero if some
//   row's support outgrew its list   [3] 0   then per key row and kv head: the rows whose
//   support holds it; per query row and head: the support's size; per query row and head:
//   kSupportListLength key rows (the first min(size, length) meaningful).
// Query and key rows count over the whole batch (B L, or T packed), heads included. Only the
// CUDA fused path lists; every other path writes 0 at [0], and a backward given a record
// whose [0] is not 1, or one that overflowed, finds the supports its own way. Memory: 516
// bytes per query row and head.
inline constexpr std::int64_t kSupportListLength = 128;
inline constexpr std::int64_t kSupportRecordHeader = 4;
template <class Int>
Int support_record_size(Int query_row_heads, Int key_row_heads) {
  return key_row_heads + query_row_heads * (kSupportListLength + 1) + kSupportRecordHeader;
}

struct Outputs {
  TensorView out;  // like q with v's head dimension
  TensorView tau;  // per-row threshold tau_j (0 for a row that sees no key)
  std::optional<TensorView> support;  // the support record, when the caller keeps one
};

// Writes the outputs. A row with no visible key outputs zero.
void forward(const AttentionInputs& in, const Options& options, const Outputs& outputs,
             const ExecContext& ctx = {});

// Gradients of sum(dout * out) with respect to q, k, v; `saved` holds what forward wrote with
// the same inputs and options, its support record included if it was given one (the threshold
// carries no gradient of its own: it is a function of z whose effect the formula
// dz = u (dp - delta) already contains).
void backward(const AttentionInputs& in, const Options& options, const Outputs& saved,
              const TensorView& dout, const AttentionGrads& grads, const ExecContext& ctx = {});

}  // namespace winnow::entmax
