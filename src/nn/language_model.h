// What the trainer, the evaluator and the tools need of a language model, whatever its
// architecture: the transformer (nn/transformer.h, any attention mechanism of the registry) or
// Multiscreen (nn/multiscreen.h, its own architecture). make_language_model builds the one a
// config names (model.architecture).
#pragma once

#include <torch/torch.h>

#include <map>
#include <memory>
#include <string>
#include <vector>

#include "nn/config.h"
#include "nn/modules.h"

namespace winnow::nn {

class AttentionProbe;

// The cache of a whole model for incremental decoding: one per layer.
struct KVCache {
  std::vector<LayerCache> layers;
  std::int64_t length() const { return layers.empty() ? 0 : layers.front().length(); }
};

class LanguageModelImpl : public torch::nn::Module {
 public:
  // tokens (B, L) int64 -> logits (B, L, vocab). With a cache the tokens continue the cached
  // sequence (prefill in chunks, then one token at a time) and the cache grows by L.
  torch::Tensor forward(const torch::Tensor& tokens, KVCache* cache = nullptr) {
    return run(tokens, cache, nullptr);
  }
  virtual KVCache new_cache() const = 0;
  // The largest |value| of the residual stream after each layer (layers,) on the device, from a
  // forward pass over `tokens` without gradients: the "maximum activation" that 001 and 003
  // track for stability.
  torch::Tensor residual_maxima(const torch::Tensor& tokens);
  // The auxiliary losses of the last forward pass, summed over layers by name.
  virtual std::map<std::string, torch::Tensor> aux_losses() const { return {}; }
  virtual void set_phase(const std::string&) {}
  // Attaches a diagnostics probe to every attention layer (nullptr detaches); architectures
  // without the probe's attention layers ignore it.
  virtual void attach_probe(AttentionProbe*) {}
  virtual const ModelConfig& config() const = 0;

 protected:
  // The architecture's forward pass; with `maxima`, it also appends each layer's largest
  // |residual| (a 0-dimensional tensor) in order.
  virtual torch::Tensor run(const torch::Tensor& tokens, KVCache* cache, std::vector<torch::Tensor>* maxima) = 0;
};
using LanguageModel = std::shared_ptr<LanguageModelImpl>;

// The model of c.architecture, its config resolved (a bad value is an error naming its key).
LanguageModel make_language_model(const ModelConfig& c);

// A short description for logs: "softmax attention (rope, kernel)", "multiscreen (8 tiles of
// d_K 16 / d_V 64, kernel)".
std::string describe(const ModelConfig& c);

// Whether the model runs winnow's operators (which then pick the device) rather than composed
// LibTorch expressions only.
bool uses_kernel(const ModelConfig& c);

}  // namespace winnow::nn
