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

// 003 section 6's indexer loss, per query row t (spec/gsa.md, "Training the indexer"):
//   KL_t = sum_{s in S_t} p_ts (log p_ts - log softmax_{s' in S_t}(I_ts')_s),
//   p_ts = (1 / H) sum_h softmax_{s' in S_t}(<q_th, k_s'> attention_scale)_s,
// I_ts the indexer's score (select_keys's form), q and k the attention layer's queries and keys
// (H query heads over its kv heads; they get no gradient: the indexer learns from the layer, not
// the other way round). S_t is the row's key list (the sparse phase) or, without lists, every
// visible key (the dense warm-up). An empty S_t gives KL_t = 0 and no gradient. No L x L matrix
// is materialized: the forward takes each row's log-sum-exps in one pass over S_t and the KL in a
// second; the backward makes that second pass again from the saved log-sum-exps.
//
// Layout: the indexer's operands as select_keys takes them, and its cu_seqlens serve q and k
// too; q (B, Lq, H, D) / k (B, Lk, H_kv, D) or packed, in the indexer's dtype.
struct IndexerLossInputs {
  IndexerInputs indexer;
  TensorView q, k;                 // the attention's queries and keys (after position encoding)
  std::optional<KeyLists> lists;   // absent: every visible key
};

struct IndexerLossOptions {
  ScoreForm form = ScoreForm::sigmoid;
  std::optional<double> scale;            // the indexer's dot products; default 1 / sqrt(d_I)
  std::optional<double> attention_scale;  // the attention's logits; default 1 / sqrt(D)
};

struct IndexerLossOutputs {
  TensorView loss;  // (B, Lq) or (Tq): KL_t, float32 (float64 for float64 inputs)
  TensorView lse;   // (B, Lq, H + 1) or (Tq, H + 1), like loss: each attention head's log-sum-exp
                    // over S_t, then the indexer's
};

// Gradients of sum_t dloss_t KL_t, float32 (float64 for float64 inputs), shaped like the
// indexer's q, k, head_weights and bias (dbias: the sigmoid form with a bias only).
struct IndexerLossGrads {
  TensorView dq, dk, dhead_weights;
  std::optional<TensorView> dbias;
};

void indexer_loss_forward(const IndexerLossInputs& in, const IndexerLossOptions& options,
                          const IndexerLossOutputs& out, const ExecContext& ctx = {});
// `saved` is the forward's output for the same inputs; dloss is like loss.
void indexer_loss_backward(const IndexerLossInputs& in, const IndexerLossOptions& options,
                           const IndexerLossOutputs& saved, const TensorView& dloss,
                           const IndexerLossGrads& grads, const ExecContext& ctx = {});

}  // namespace winnow::gsa
