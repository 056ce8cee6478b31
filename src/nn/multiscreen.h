// Multiscreen (seed 001; spec/screening.md), an architecture of its own: the input is a
// unit-norm embedding row scaled by exp(s_E); each layer adds to the residual stream the sum of
// its gated screening tiles' updates,
//   q, k, v, g = x W_Q, x W_K, x W_V, x W_G        (per tile: d_K, d_K, d_V, d_V wide)
//   u = screening(q, k, v; s_w, s_r)               (winnow::screening: windowed, Trim, TanhNorm)
//   update = (u * tanh(SiLU(g)) * exp(s_O)) W_O,
// with no norm layer and no MLP; the logits are the stream against the unit-norm embedding rows,
// scaled by exp(s_F). Initialization as 001's appendix D.
#pragma once

#include <torch/torch.h>

#include <vector>

#include "nn/language_model.h"

namespace winnow::nn {

// One layer's tiles, all computed together: a fused input projection (every tile's W_Q, W_K,
// W_V, W_G), one screening call over the tiles as heads, one output projection.
class MultiscreenLayerImpl : public torch::nn::Module {
 public:
  MultiscreenLayerImpl(const ModelConfig& c, std::int64_t layer_index);
  // x (B, L, d_E) -> the layer's update (B, L, d_E). With a cache, x continues the cached
  // sequence and its keys and values join the cache.
  torch::Tensor forward(const torch::Tensor& x, LayerCache* cache);

 private:
  MultiscreenConfig config_;
  torch::Tensor in_;   // (tiles * (2 d_K + 2 d_V), d_E): rows of W_Q, W_K, W_V, W_G
  torch::Tensor out_;  // (d_E, tiles * d_V)
  torch::Tensor s_w_, s_r_, s_o_;  // (tiles)
  // How many cached keys decoding needs (0: all, a window is infinite), read from s_w once per
  // version of it (in-place updates bump the version, loads across devices swap the storage)
  // rather than with a device sync at every decoding step.
  std::int64_t cache_keep();
  std::int64_t cache_keep_ = 0;
  std::int64_t cache_keep_version_ = -1;
  const void* cache_keep_storage_ = nullptr;
};
TORCH_MODULE(MultiscreenLayer);

class MultiscreenLMImpl : public LanguageModelImpl {
 public:
  // Resolves (and so checks) the config first.
  explicit MultiscreenLMImpl(ModelConfig c);

  KVCache new_cache() const override { return KVCache{std::vector<LayerCache>(layers_.size())}; }
  const ModelConfig& config() const override { return config_; }

 private:
  torch::Tensor run(const torch::Tensor& tokens, KVCache* cache, std::vector<torch::Tensor>* maxima) override;

  ModelConfig config_;
  torch::Tensor embedding_;  // W_E (vocab, d_E)
  torch::Tensor s_e_, s_f_;  // (1)
  std::vector<MultiscreenLayer> layers_;
};
TORCH_MODULE(MultiscreenLM);

}  // namespace winnow::nn
