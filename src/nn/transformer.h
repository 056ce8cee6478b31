// The decoder-only language model: token embedding, pre-norm blocks (RMSNorm, the configured
// attention, SwiGLU or GeLU MLP), final norm, and a head tied to the embedding or its own.
#pragma once

#include <torch/torch.h>

#include <vector>

#include "nn/config.h"
#include "nn/layers.h"

namespace winnow::nn {

// The cache of a whole model for incremental decoding.
struct KVCache {
  std::vector<LayerCache> layers;
  std::int64_t length() const { return layers.empty() ? 0 : layers.front().length(); }
};

class BlockImpl : public torch::nn::Module {
 public:
  BlockImpl(const ModelConfig& c, std::int64_t layer_index);
  torch::Tensor forward(const torch::Tensor& x, LayerCache* cache);

 private:
  RMSNorm attention_norm_{nullptr}, mlp_norm_{nullptr};
  std::shared_ptr<AttentionLayer> attention_;
  MLP mlp_{nullptr};
};
TORCH_MODULE(Block);

class TransformerLMImpl : public torch::nn::Module {
 public:
  explicit TransformerLMImpl(const ModelConfig& c);

  // tokens (B, L) int64 -> logits (B, L, vocab). With a cache: tokens continue the cached
  // sequence (decoding), and the cache grows by L.
  torch::Tensor forward(const torch::Tensor& tokens, KVCache* cache = nullptr);
  KVCache new_cache() const { return KVCache{std::vector<LayerCache>(blocks_.size())}; }
  const ModelConfig& config() const { return config_; }

 private:
  ModelConfig config_;
  torch::nn::Embedding embedding_{nullptr};
  std::vector<Block> blocks_;
  RMSNorm final_norm_{nullptr};
  torch::nn::Linear head_{nullptr};
};
TORCH_MODULE(TransformerLM);

}  // namespace winnow::nn
