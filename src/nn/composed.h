// The attention mechanisms as plain LibTorch expressions on materialized (Lq x Lk) scores, the
// way a user would write them without winnow: the layers' `composed` implementation, the
// baseline the fused operators are measured against, and the only route for configurations no
// operator covers yet (ALiBi's biased softmax). Same conventions as the operators: (B, L, H, D)
// inputs, grouped-query attention, queries as the last positions of the keys. Scores are
// formed in float32 (float64 for float64 inputs); under autocast the products run in its dtype.
#pragma once

#include <torch/torch.h>

#include <optional>
#include <string>
#include <utility>

namespace winnow::nn::composed {

// The attention weights themselves, (B, Hq, Lq, Lk) in float32 (float64 for float64 inputs):
// what the attention functions below multiply the values by, and what diagnostics inspect.
// alibi_slopes (Hq): adds -slope_h (j - i) to the logits.
torch::Tensor softmax_weights(const torch::Tensor& q, const torch::Tensor& k, double scale,
                              bool attend_current,
                              const std::optional<torch::Tensor>& alibi_slopes = std::nullopt);
// Returns (weights, rem), rem (B, Hq, Lq) the unallocated stick.
std::pair<torch::Tensor, torch::Tensor> stick_breaking_weights(const torch::Tensor& q,
                                                               const torch::Tensor& k,
                                                               double scale, bool attend_current);

// alpha-entmax weights (spec/entmax.md), exactly zero off each row's support. The threshold is
// found without gradient (sorting for alpha 1.5 and 2, bisection otherwise) and enters the
// expression so that autograd yields the implicit-function gradient dz = u (dp - delta) of the
// spec; second derivatives through the threshold are not provided.
torch::Tensor entmax_weights(const torch::Tensor& q, const torch::Tensor& k, double scale,
                             bool attend_current, double alpha);
// Sieve (spec/sieve.md): returns (weights, rem), stick-breaking over each row's candidate set,
// rem (B, Hq, Lq) the stick left over it. filter "exact" takes the alpha-entmax support,
// "bound" the keys with z > rowmax - eps (eps absent: 1 / (alpha - 1)). The candidate set is a
// discrete choice and passes no gradient.
std::pair<torch::Tensor, torch::Tensor> sieve_weights(const torch::Tensor& q,
                                                      const torch::Tensor& k, double scale,
                                                      bool attend_current, double alpha,
                                                      const std::string& filter,
                                                      std::optional<double> eps);

// Threshold attention (spec/threshold.md): relu(cos(q_j, k_i) - tau_j)^power with
// tau_j = beta_h sqrt(2 log(n_j) / D); with lam, TDA's w1 - lam w2 (lam clamped to [0, 1] when
// clamp_lambda). beta and lam are (Hq) or (1). Signed, unnormalized weights.
struct ThresholdSpec {
  torch::Tensor beta;
  std::optional<torch::Tensor> lam, q2, k2;
  double power = 2.0;
  bool clamp_lambda = true;
  double norm_eps = 1e-6;
};
torch::Tensor threshold_weights(const torch::Tensor& q, const torch::Tensor& k,
                                bool attend_current, const ThresholdSpec& spec);

torch::Tensor softmax_attention(const torch::Tensor& q, const torch::Tensor& k,
                                const torch::Tensor& v, double scale, bool attend_current,
                                const std::optional<torch::Tensor>& alibi_slopes = std::nullopt);

torch::Tensor threshold_attention(const torch::Tensor& q, const torch::Tensor& k,
                                  const torch::Tensor& v, bool attend_current,
                                  const ThresholdSpec& spec);

// Returns (out, rem), rem (B, Lq, Hq) the unallocated stick, float32 (float64 for float64).
std::pair<torch::Tensor, torch::Tensor> stick_breaking_attention(const torch::Tensor& q,
                                                                 const torch::Tensor& k,
                                                                 const torch::Tensor& v,
                                                                 double scale,
                                                                 bool attend_current);

torch::Tensor entmax_attention(const torch::Tensor& q, const torch::Tensor& k,
                               const torch::Tensor& v, double scale, bool attend_current,
                               double alpha);

// Returns (out, rem), rem (B, Lq, Hq) like stick_breaking_attention's.
std::pair<torch::Tensor, torch::Tensor> sieve_attention(
    const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v, double scale,
    bool attend_current, double alpha, const std::string& filter, std::optional<double> eps);

// Multiscreen's screening unit (spec/screening.md) from its formulas: normalized q, k, v; MiPE on
// coordinates 0 and 1 by absolute position; Trim; the causal Softmask (1 for windows wider than
// expand_above when it is > 0); the unnormalized sum; TanhNorm. s_w and s_r are (Hq) or (1);
// autograd gives every gradient. (B, Lq, Hq, Dk), (B, Lk, Hkv, Dk), (B, Lk, Hkv, Dv).
torch::Tensor screening(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                        const torch::Tensor& s_w, const torch::Tensor& s_r, double mipe_threshold,
                        double expand_above, double norm_eps = 1e-6);

// GSA (spec/gsa.md). The key lists as a mask: indices (B, Lq, k_max) int32 with counts (B, Lq),
// as winnow::gsa::select_keys writes them, to (B, Lq, Lk) bool.
torch::Tensor list_mask(const torch::Tensor& indices, const torch::Tensor& counts, std::int64_t keys);
// Softmax weights over each row's allowed keys, allowed (B, Lq, Lk) shared by the heads;
// (B, Hq, Lq, Lk) like softmax_weights. A row with no allowed key gets zero weights.
torch::Tensor masked_softmax_weights(const torch::Tensor& q, const torch::Tensor& k, double scale,
                                     const torch::Tensor& allowed);
// Sparse softmax attention over the lists (gsa_sparse_attention's expression).
torch::Tensor gsa_sparse_attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                                   const torch::Tensor& indices, const torch::Tensor& counts, double scale);
// The indexer's scores I_ts (B, Lq, Lk) in float32 (float64 for float64 inputs), every key (no
// mask): q (B, Lq, H_I, d_I), k (B, Lk, 1, d_I), head_weights (B, Lq, H_I) pre-activation, bias
// (H_I) (sigmoid form; undefined: 0). relu: sum_j w_tj relu(<q_tj, k_s> scale).
torch::Tensor gsa_indexer_scores(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& head_weights,
                                 const torch::Tensor& bias, bool relu, double scale);

}  // namespace winnow::nn::composed
