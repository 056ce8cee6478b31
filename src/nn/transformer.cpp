#include "nn/transformer.h"

#include <cmath>

#include "winnow/error.h"

namespace winnow::nn {

BlockImpl::BlockImpl(const ModelConfig& c, std::int64_t layer_index) {
  attention_norm_ = register_module("attention_norm", RMSNorm(c.d_model, c.norm_eps));
  attention_ = register_module("attention", make_attention(c, layer_index));
  mlp_norm_ = register_module("mlp_norm", RMSNorm(c.d_model, c.norm_eps));
  mlp_ = register_module("mlp", MLP(c));
}

torch::Tensor BlockImpl::forward(const torch::Tensor& x, LayerCache* cache) {
  const torch::Tensor h = x + attention_->forward(attention_norm_(x), cache);
  return h + mlp_(mlp_norm_(h));
}

TransformerLMImpl::TransformerLMImpl(const ModelConfig& c) : config_(c) {
  auto check = [](bool ok, const char* key, const std::string& expected, std::int64_t got) {
    if (!ok) {
      throw Error(ErrorKind::invalid_argument, std::string("model config: key '") + key +
                                                   "': expected " + expected + ", got " + std::to_string(got));
    }
  };
  check(c.vocab_size >= 2, "model.vocab_size", ">= 2", c.vocab_size);
  check(c.d_model >= 1, "model.d_model", ">= 1", c.d_model);
  check(c.layers >= 1, "model.layers", ">= 1", c.layers);
  check(c.max_len >= 1, "model.max_len", ">= 1", c.max_len);
  embedding_ = register_module("embedding", torch::nn::Embedding(c.vocab_size, c.d_model));
  for (std::int64_t i = 0; i < c.layers; ++i) {
    blocks_.push_back(register_module("block" + std::to_string(i), Block(c, i)));
  }
  final_norm_ = register_module("final_norm", RMSNorm(c.d_model, c.norm_eps));
  if (!c.tie_embeddings) {
    head_ = register_module("head", torch::nn::Linear(torch::nn::LinearOptions(c.d_model, c.vocab_size).bias(false)));
  }
  // Normal(0, init_std) everywhere; residual output projections shrink with depth
  // (GPT-2's 1 / sqrt(2 layers)) so the residual stream starts near unit scale.
  torch::NoGradGuard no_grad;
  for (auto& item : named_parameters()) {
    const std::string& name = item.key();
    torch::Tensor& p = item.value();
    if (name.find("norm") != std::string::npos || name.find("lambda") != std::string::npos ||
        name.find("ssmax") != std::string::npos || name.find("remainder_bias") != std::string::npos) {
      continue;  // set by their modules
    }
    if (p.dim() == 1) {
      p.zero_();  // biases (the gates start at sigmoid(0) = 0.5)
      continue;
    }
    const bool residual_out = name.size() >= 8 && (name.compare(name.size() - 8, 8, "o.weight") == 0 ||
                                                   name.find("down.weight") != std::string::npos);
    p.normal_(0.0, residual_out ? c.init_std / std::sqrt(2.0 * static_cast<double>(c.layers)) : c.init_std);
  }
}

torch::Tensor TransformerLMImpl::forward(const torch::Tensor& tokens, KVCache* cache) {
  if (cache != nullptr && cache->layers.size() != blocks_.size()) {
    throw Error(ErrorKind::invalid_argument, "TransformerLM::forward: argument 'cache': expected " +
                                                 std::to_string(blocks_.size()) + " layers, got " +
                                                 std::to_string(cache->layers.size()));
  }
  torch::Tensor x = embedding_(tokens);
  for (std::size_t i = 0; i < blocks_.size(); ++i) {
    x = blocks_[i]->forward(x, cache ? &cache->layers[i] : nullptr);
  }
  x = final_norm_(x);
  if (head_) return head_(x);
  return torch::matmul(x, embedding_->weight.to(x.scalar_type()).t());
}

}  // namespace winnow::nn
