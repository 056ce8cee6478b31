#include "nn/composed.h"

namespace winnow::nn::composed {
namespace {

struct Heads {
  torch::Tensor q, k, v;  // (B, H, L, D) with k, v repeated over the query heads of a group
};

Heads heads_first(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v) {
  const std::int64_t group = q.size(2) / k.size(2);
  return {q.transpose(1, 2), k.repeat_interleave(group, 2).transpose(1, 2),
          v.repeat_interleave(group, 2).transpose(1, 2)};
}

// (Lq, Lk) distance j - i of query row r (at position r + Lk - Lq) to key i.
torch::Tensor distance(std::int64_t lq, std::int64_t lk, const torch::Device& device) {
  const auto opts = torch::TensorOptions().dtype(torch::kInt64).device(device);
  const torch::Tensor pos_q = torch::arange(lk - lq, lk, opts);
  const torch::Tensor pos_k = torch::arange(0, lk, opts);
  return pos_q.unsqueeze(1) - pos_k.unsqueeze(0);
}

torch::Tensor visible(const torch::Tensor& dist, bool attend_current) {
  return attend_current ? dist.ge(0) : dist.gt(0);
}

// Scores in float32, or float64 for float64 inputs.
torch::ScalarType work_type(const torch::Tensor& q) {
  return q.scalar_type() == torch::kFloat64 ? torch::kFloat64 : torch::kFloat32;
}

}  // namespace

torch::Tensor softmax_attention(const torch::Tensor& q, const torch::Tensor& k,
                                const torch::Tensor& v, double scale, bool attend_current,
                                const std::optional<torch::Tensor>& alibi_slopes) {
  const Heads h = heads_first(q, k, v);
  const torch::Tensor dist = distance(q.size(1), k.size(1), q.device());
  const torch::ScalarType wt = work_type(q);
  torch::Tensor z = torch::matmul(h.q.to(wt), h.k.to(wt).transpose(-1, -2)) * scale;
  if (alibi_slopes) z = z - alibi_slopes->to(wt).view({1, -1, 1, 1}) * dist.to(wt);
  z = z.masked_fill(visible(dist, attend_current).logical_not(), -INFINITY);
  // A row with no visible key outputs zero (softmax of all -inf would be NaN).
  const torch::Tensor any = visible(dist, attend_current).any(-1, /*keepdim=*/true);
  torch::Tensor p = torch::softmax(z.masked_fill(any.logical_not(), 0), -1) * any;
  return torch::matmul(p, h.v.to(wt)).transpose(1, 2).to(q.scalar_type());
}

std::pair<torch::Tensor, torch::Tensor> stick_breaking_attention(const torch::Tensor& q,
                                                                 const torch::Tensor& k,
                                                                 const torch::Tensor& v,
                                                                 double scale,
                                                                 bool attend_current) {
  const Heads h = heads_first(q, k, v);
  const torch::Tensor mask = visible(distance(q.size(1), k.size(1), q.device()), attend_current);
  const torch::ScalarType wt = work_type(q);
  const torch::Tensor z = torch::matmul(h.q.to(wt), h.k.to(wt).transpose(-1, -2)) * scale;
  // log A_ij = z_ij - sum_{k >= i, visible} softplus(z_kj)  (spec/stick-breaking.md)
  const torch::Tensor cost = torch::where(mask, torch::softplus(z), torch::zeros_like(z));
  const torch::Tensor suffix = cost.flip(-1).cumsum(-1).flip(-1);
  const torch::Tensor w = torch::where(mask, torch::exp(z - suffix), torch::zeros_like(z));
  const torch::Tensor out = torch::matmul(w, h.v.to(wt)).transpose(1, 2);
  const torch::Tensor rem = torch::exp(-cost.sum(-1)).transpose(1, 2);
  return {out.to(q.scalar_type()), rem};
}

}  // namespace winnow::nn::composed
