// Rotary position embedding (RoPE) on (B, L, H, D) tensors, with the extrapolation variants the
// seeds compare: linear position interpolation, NTK-aware, dynamic NTK, and YaRN. Applied
// outside the attention operators, as LibTorch element-wise operations (autograd gives the
// backward).
#pragma once

#include <torch/torch.h>

#include "nn/config.h"

namespace winnow::nn {

class Rope {
 public:
  Rope(const RopeConfig& config, std::int64_t head_dim, std::int64_t train_len);

  // Rotates x (B, L, H, D) whose tokens sit at positions offset .. offset + L - 1.
  torch::Tensor apply(const torch::Tensor& x, std::int64_t offset) const;

 private:
  // cos and sin (L, D) for positions offset .. offset + L - 1, already scaled by YaRN's
  // attention factor.
  std::pair<torch::Tensor, torch::Tensor> tables(std::int64_t offset, std::int64_t len,
                                                 const torch::Device& device) const;

  RopeConfig config_;
  std::int64_t head_dim_, train_len_;
};

}  // namespace winnow::nn
