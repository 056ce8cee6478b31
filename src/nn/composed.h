// The attention mechanisms as plain LibTorch expressions on materialized (L x L) scores:
// the layers' `composed` implementation, the baseline the fused operators are measured
// against, and the only implementation of ALiBi's biased softmax for now. Same conventions
// as the operators: (B, L, H, D) inputs, GQA, queries as the last positions of the keys.
#pragma once

#include <torch/torch.h>

#include <optional>
#include <utility>

namespace winnow::nn::composed {

// alibi_slopes (H): adds -slope_h (j - i) to the logits.
torch::Tensor softmax_attention(const torch::Tensor& q, const torch::Tensor& k,
                                const torch::Tensor& v, double scale, bool attend_current,
                                const std::optional<torch::Tensor>& alibi_slopes = std::nullopt);

// Returns (out, rem).
std::pair<torch::Tensor, torch::Tensor> stick_breaking_attention(const torch::Tensor& q,
                                                                 const torch::Tensor& k,
                                                                 const torch::Tensor& v,
                                                                 double scale,
                                                                 bool attend_current);

}  // namespace winnow::nn::composed
