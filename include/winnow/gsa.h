// Gated Sparse Attention's indexer with exact top-k selection (spec/gsa.md; seed 003).
// For every query position t the indexer scores each visible key s <= t,
//   I_ts = sum_j sigmoid(w_tj) * sigmoid(<q_tj, k_s> * scale + b_j)      (GSA, the default)
//   I_ts = sum_j w_tj * relu(<q_tj, k_s> * scale)                      (DeepSeek-V3.2's form)
// over H_I indexer heads j (queries q_tj of d_I, one key head k_s shared by them), takes the
// row's population variance over its visible keys, turns it into a budget k_t, and selects the
// k_t keys of highest score (all of them when t + 1 <= k_t; ties toward the more recent key).
// No L x L matrix is materialized. The selected positions are written in increasing order.
//
// Layout (winnow/attention.h): q (B, Lq, H_I, d_I) or (Tq, H_I, d_I) with cu_seqlens; k
// (B, Lk, 1, d_I) or (Tk, 1, d_I); queries are a suffix of the keys (decoding: one query over
// the cached keys). head_weights (B, Lq, H_I) or (Tq, H_I) in q's dtype; bias (H_I) or (1),
// float32 (float64 for float64 inputs).
//
// On CUDA (float32, float16, bfloat16) a block per query row keeps the row's queries and up to
// k_max selected positions in shared memory: at most 32 indexer heads, and k_max up to about
// 16K slots on an H100 (a larger request is refused naming k_max). The sparse attention's CUDA
// kernels take head dimensions up to 256.
#pragma once

#include <cstdint>
#include <optional>

#include "winnow/attention.h"

namespace winnow::gsa {

enum class ScoreForm { sigmoid, relu };
// spec/gsa.md: inverse_variance k_base * Vbar / Var (003's text; the default), eq8 k_base * Var /
// Vbar (003's eq. 8 as printed), reference k_base * (0.5 + 1 / (1 + Var / Vbar)) (003's public
// code); each floored and clamped to [k_min, k_max]. fixed: k (at most k_max) for every row.
enum class Budget { fixed, inverse_variance, eq8, reference };

struct IndexerOptions {
  ScoreForm form = ScoreForm::sigmoid;
  std::optional<double> scale;  // of the dot products; default 1 / sqrt(d_I)
  Budget budget = Budget::inverse_variance;
  std::int64_t k = 0;  // fixed
  std::int64_t k_base = 0, k_min = 1, k_max = 1;
  double mean_variance = 1.0;  // Vbar: the layer's running mean of the row variance
};

struct IndexerInputs {
  TensorView q;             // indexer queries
  TensorView k;             // indexer keys, one head
  TensorView head_weights;  // pre-activation head weights w_tj
  std::optional<TensorView> bias;  // b_j; sigmoid form only (absent: 0)
  std::optional<TensorView> cu_seqlens_q;
  std::optional<TensorView> cu_seqlens_k;
};

struct Selection {
  TensorView indices;   // int32 (B, Lq, k_max) or (Tq, k_max): positions in the sequence, -1 padded
  TensorView counts;    // int32 (B, Lq) or (Tq): keys selected, min(k_t, t + 1)
  TensorView variance;  // (B, Lq) or (Tq), float32 (float64 for float64 inputs): Var_s(I_ts)
};

void select_keys(const IndexerInputs& in, const IndexerOptions& options, const Selection& out,
                 const ExecContext& ctx = {});

// Softmax attention of every query over its own key list, one list per token shared by all
// of its heads (003 eq. 6's sparse SDPA; spec/gsa.md):
//   O_t,h = sum_{s in S_t} softmax_{s in S_t}(<q_t,h, k_s> * scale) v_s
// The lists are select_keys's output: indices (B, Lq, k_max) or (Tq, k_max), int32 positions
// in the sequence, strictly increasing and visible to the query (<= its position) in the first
// counts[t] slots; counts (B, Lq) or (Tq). An empty list gives zeros and lse -inf. The lists
// are checked before any work: every entry is read, on the GPU for CUDA lists (then the host
// waits for the verdict). `trusted` skips the check for lists that come unchanged from
// select_keys (a layer's forward, CUDA graph capture); the kernels still never read outside a
// sequence's keys, but a bad trusted list gives unspecified results.
struct KeyLists {
  TensorView indices;
  TensorView counts;
  bool trusted = false;
};

struct SparseOutputs {
  TensorView out;  // like q with v's head dimension
  TensorView lse;  // (B, Lq, Hq) or (Tq, Hq): each row's log-sum-exp over its list
};

void sparse_forward(const AttentionInputs& in, const KeyLists& lists, std::optional<double> scale,
                    const SparseOutputs& out, const ExecContext& ctx = {});
// Gradients of sum(dout * out) with respect to q, k and v; dk and dv get every query's share
// (keys outside every list get zero). On CUDA the key gradients are scattered with atomics, or,
// with ExecContext::deterministic, gathered per key over the lists inverted by a stable sort
// (the same bits on every run, at the cost of the sort's memory: 16 bytes per list slot).
void sparse_backward(const AttentionInputs& in, const KeyLists& lists, std::optional<double> scale,
                     const SparseOutputs& saved, const TensorView& dout, const AttentionGrads& grads,
                     const ExecContext& ctx = {});

}  // namespace winnow::gsa
