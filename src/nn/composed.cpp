#include "nn/composed.h"

#include <cmath>

namespace winnow::nn::composed {
namespace {

// (Lq, Lk): j - i for query row r (at position r + Lk - Lq) and key i.
torch::Tensor distance(std::int64_t lq, std::int64_t lk, const torch::Device& device) {
  const auto opts = torch::TensorOptions().dtype(torch::kInt64).device(device);
  return torch::arange(lk - lq, lk, opts).unsqueeze(1) - torch::arange(0, lk, opts).unsqueeze(0);
}

torch::ScalarType work_type(const torch::Tensor& q) {
  return q.scalar_type() == torch::kFloat64 ? torch::kFloat64 : torch::kFloat32;
}

// Query heads first: (B, L, H, D) -> (B, Hq, L, D), k repeated over each group's query heads.
torch::Tensor keys_per_query_head(const torch::Tensor& k, std::int64_t query_heads) {
  return k.repeat_interleave(query_heads / k.size(2), 2).transpose(1, 2);
}
}  // namespace

torch::Tensor softmax_weights(const torch::Tensor& q, const torch::Tensor& k, double scale,
                              bool attend_current,
                              const std::optional<torch::Tensor>& alibi_slopes) {
  const torch::Tensor qh = q.transpose(1, 2), kh = keys_per_query_head(k, q.size(2));
  const torch::Tensor dist = distance(q.size(1), k.size(1), q.device());
  const torch::Tensor visible = attend_current ? dist.ge(0) : dist.gt(0);
  const torch::ScalarType wt = work_type(q);
  torch::Tensor z = torch::matmul(qh, kh.transpose(-1, -2)).to(wt) * scale;
  if (alibi_slopes) z = z - alibi_slopes->to(wt).view({1, -1, 1, 1}) * dist.to(wt);
  // A row that sees no key outputs zero: softmax over a row of -inf alone would be NaN.
  const torch::Tensor any = visible.any(-1, /*keepdim=*/true);
  return torch::softmax(z.masked_fill(visible.logical_not(), -INFINITY)
                            .masked_fill(any.logical_not(), 0),
                        -1) *
         any;
}

std::pair<torch::Tensor, torch::Tensor> stick_breaking_weights(const torch::Tensor& q,
                                                               const torch::Tensor& k,
                                                               double scale, bool attend_current) {
  const torch::Tensor qh = q.transpose(1, 2), kh = keys_per_query_head(k, q.size(2));
  const torch::Tensor dist = distance(q.size(1), k.size(1), q.device());
  const torch::Tensor hidden = (attend_current ? dist.ge(0) : dist.gt(0)).logical_not();
  const torch::ScalarType wt = work_type(q);
  // Invisible logits are zeroed before anything is exponentiated, so no inf or NaN can reach
  // the gradient through the masked branch.
  const torch::Tensor z =
      (torch::matmul(qh, kh.transpose(-1, -2)).to(wt) * scale).masked_fill(hidden, 0);
  // log A_ij = z_ij - sum_{k >= i, visible} softplus(z_kj)   (spec/stick-breaking.md)
  const torch::Tensor cost = torch::nn::functional::softplus(z).masked_fill(hidden, 0);
  const torch::Tensor suffix = cost.flip(-1).cumsum(-1).flip(-1);
  return {torch::exp(z - suffix).masked_fill(hidden, 0), torch::exp(-cost.sum(-1))};
}

torch::Tensor softmax_attention(const torch::Tensor& q, const torch::Tensor& k,
                                const torch::Tensor& v, double scale, bool attend_current,
                                const std::optional<torch::Tensor>& alibi_slopes) {
  const torch::Tensor p = softmax_weights(q, k, scale, attend_current, alibi_slopes);
  const torch::Tensor vh = keys_per_query_head(v, q.size(2));
  return torch::matmul(p.to(vh.scalar_type()), vh).transpose(1, 2).to(q.scalar_type());
}

std::pair<torch::Tensor, torch::Tensor> stick_breaking_attention(const torch::Tensor& q,
                                                                 const torch::Tensor& k,
                                                                 const torch::Tensor& v,
                                                                 double scale,
                                                                 bool attend_current) {
  const auto [w, rem] = stick_breaking_weights(q, k, scale, attend_current);
  const torch::Tensor vh = keys_per_query_head(v, q.size(2));
  const torch::Tensor out = torch::matmul(w.to(vh.scalar_type()), vh).transpose(1, 2);
  return {out.to(q.scalar_type()), rem.transpose(1, 2)};
}

}  // namespace winnow::nn::composed
