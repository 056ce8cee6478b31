// LibTorch modules: the attention layers (one per mechanism, each owning its projections,
// positional encoding and gates), their building blocks, and the key/value cache that lets
// every layer decode incrementally (the operators accept fewer queries than keys).
#pragma once

#include <torch/torch.h>

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "nn/config.h"
#include "nn/rope.h"

namespace winnow::nn {

// One layer's cached keys and values, (B, T, Hkv', D) each, grown along dimension 1.
struct LayerCache {
  torch::Tensor k, v;
  std::int64_t length() const { return k.defined() ? k.size(1) : 0; }
  // Appends this step's keys and values; returns the full ones.
  std::pair<torch::Tensor, torch::Tensor> append(const torch::Tensor& new_k, const torch::Tensor& new_v);
};

// RMSNorm over the last dimension with a learned scale; `groups` > 1 normalizes each of that
// many equal slices separately (a head-wise norm over (..., H, Dv) uses the head axis).
class RMSNormImpl : public torch::nn::Module {
 public:
  RMSNormImpl(std::int64_t dim, double eps);
  torch::Tensor forward(const torch::Tensor& x);

 private:
  torch::Tensor weight_;
  double eps_;
};
TORCH_MODULE(RMSNorm);

class MLPImpl : public torch::nn::Module {
 public:
  explicit MLPImpl(const ModelConfig& c);
  torch::Tensor forward(const torch::Tensor& x);

 private:
  bool swiglu_;
  torch::nn::Linear up_{nullptr}, gate_{nullptr}, down_{nullptr};
};
TORCH_MODULE(MLP);

// Every attention layer: x (B, L, d_model) -> (B, L, d_model). With a cache, the cached
// tokens come first and x's tokens sit at positions cache->length() onwards; the cache grows.
class AttentionLayer : public torch::nn::Module {
 public:
  virtual torch::Tensor forward(const torch::Tensor& x, LayerCache* cache) = 0;
};

// Projections shared by the layers: q (H heads), k and v (Hkv heads), output.
struct Projections {
  std::int64_t heads, kv_heads, head_dim, value_dim;
  torch::nn::Linear q{nullptr}, k{nullptr}, v{nullptr}, o{nullptr};
};

class SoftmaxAttention final : public AttentionLayer {
 public:
  SoftmaxAttention(const ModelConfig& model, std::int64_t layer_index);
  torch::Tensor forward(const torch::Tensor& x, LayerCache* cache) override;

 private:
  AttentionConfig cfg_;
  Projections p_;
  std::optional<Rope> rope_;
  torch::Tensor ssmax_scale_;   // (H): s_h of scalable softmax
  torch::Tensor alibi_slopes_;  // (H) buffer
  torch::nn::Linear output_gate_{nullptr}, value_gate_{nullptr};
};

class DifferentialAttention final : public AttentionLayer {
 public:
  DifferentialAttention(const ModelConfig& model, std::int64_t layer_index);
  torch::Tensor forward(const torch::Tensor& x, LayerCache* cache) override;

 private:
  AttentionConfig cfg_;
  Projections p_;  // q and k project to two views each
  std::optional<Rope> rope_;
  double lambda_init_;
  torch::Tensor lambda_q1_, lambda_k1_, lambda_q2_, lambda_k2_;
  RMSNorm head_norm_{nullptr};
};

class StickBreakingAttention final : public AttentionLayer {
 public:
  StickBreakingAttention(const ModelConfig& model, std::int64_t layer_index);
  torch::Tensor forward(const torch::Tensor& x, LayerCache* cache) override;

 private:
  AttentionConfig cfg_;
  Projections p_;
  std::optional<Rope> rope_;
  torch::Tensor remainder_bias_;  // (H, Dv)
  RMSNorm head_norm_{nullptr};
};

// The attention kinds this build can make, and the factory that makes them by config.
const std::vector<std::string>& attention_kinds();
std::shared_ptr<AttentionLayer> make_attention(const ModelConfig& model, std::int64_t layer_index);

}  // namespace winnow::nn
