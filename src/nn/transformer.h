// The decoder-only language model: token embedding, pre-norm blocks (RMSNorm, the configured
// attention layer, RMSNorm, SwiGLU or GeLU MLP, each added to the residual stream), a final
// RMSNorm, and an output head tied to the embedding or its own.
#pragma once

#include <torch/torch.h>

#include <map>
#include <string>
#include <vector>

#include "nn/attention.h"
#include "nn/config.h"
#include "nn/language_model.h"
#include "nn/modules.h"

namespace winnow::nn {

class BlockImpl : public torch::nn::Module {
 public:
  BlockImpl(const ModelConfig& c, std::int64_t layer_index);
  // x + attention(norm(x)), then + mlp(norm(.)), with the residual adds deferred into the next
  // norm: takes the stream x and the previous block's MLP output still to be added (undefined
  // for the first block), returns the stream and this block's MLP output still to be added.
  std::pair<torch::Tensor, torch::Tensor> forward(const torch::Tensor& x,
                                                  const torch::Tensor& pending, LayerCache* cache);
  AttentionLayer& attention() { return *attention_; }
  const AttentionLayer& attention() const { return *attention_; }

 private:
  RMSNorm attention_norm_{nullptr}, mlp_norm_{nullptr};
  std::shared_ptr<AttentionLayer> attention_;
  MLP mlp_{nullptr};
};
TORCH_MODULE(Block);

class TransformerLMImpl : public LanguageModelImpl {
 public:
  // Resolves (and so checks) the config first: a bad value is an error naming its key.
  explicit TransformerLMImpl(ModelConfig c);

  KVCache new_cache() const override { return KVCache{std::vector<LayerCache>(blocks_.size())}; }
  const WeightCastPlan& weight_casts() const { return weight_casts_; }
  std::map<std::string, torch::Tensor> aux_losses() const override;
  void set_phase(const std::string& phase) override;
  void attach_probe(AttentionProbe* probe) override;
  const ModelConfig& config() const override { return config_; }

 private:
  // forward(), and the residual stream's largest |value| after each block into `maxima`.
  torch::Tensor run(const torch::Tensor& tokens, KVCache* cache, std::vector<torch::Tensor>* maxima) override;

  ModelConfig config_;
  torch::nn::Embedding embedding_{nullptr};
  std::vector<Block> blocks_;
  RMSNorm final_norm_{nullptr};
  torch::nn::Linear head_{nullptr};
  WeightCastPlan weight_casts_;  // the low-precision weights of a pass, in one launch
};
TORCH_MODULE(TransformerLM);

}  // namespace winnow::nn
