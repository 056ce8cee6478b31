#include "nn/transformer.h"

#include "winnow/error.h"

namespace winnow::nn {

BlockImpl::BlockImpl(const ModelConfig& c, std::int64_t layer_index) {
  attention_norm_ = register_module("attention_norm", RMSNorm(c.d_model, c.norm_eps));
  attention_ = register_module("attention", make_attention(c, layer_index));
  mlp_norm_ = register_module("mlp_norm", RMSNorm(c.d_model, c.norm_eps));
  mlp_ = register_module("mlp", MLP(c));
}

std::pair<torch::Tensor, torch::Tensor> BlockImpl::forward(const torch::Tensor& x,
                                                          const torch::Tensor& pending,
                                                          LayerCache* cache) {
  attention_->clear_aux_losses();
  const auto [stream, normed] = attention_norm_->add_forward(x, pending);
  const auto [h, h_normed] = mlp_norm_->add_forward(stream, attention_->forward(normed, cache));
  return {h, mlp_(h_normed)};
}

TransformerLMImpl::TransformerLMImpl(ModelConfig c) : config_(std::move(c)) {
  resolve(config_);
  const ModelConfig& m = config_;
  embedding_ = register_module("embedding", torch::nn::Embedding(m.vocab_size, m.d_model));
  {
    torch::NoGradGuard no_grad;
    embedding_->weight.normal_(0.0, m.init_std);
  }
  for (std::int64_t i = 0; i < m.layers; ++i) {
    blocks_.push_back(register_module("block" + std::to_string(i), Block(m, i)));
  }
  final_norm_ = register_module("final_norm", RMSNorm(m.d_model, m.norm_eps));
  if (!m.tie_embeddings) head_ = make_linear(*this, "head", m.d_model, m.vocab_size, m.init_std);
}

torch::Tensor TransformerLMImpl::run(const torch::Tensor& tokens, KVCache* cache,
                                     std::vector<torch::Tensor>* maxima) {
  if (tokens.dim() != 2 || tokens.scalar_type() != torch::kInt64) {
    throw Error(ErrorKind::invalid_argument,
                "TransformerLM::forward: argument 'tokens': expected (B, L) int64, got " +
                    c10::str(tokens.sizes()) + " " + c10::toString(tokens.scalar_type()));
  }
  if (cache != nullptr && cache->layers.size() != blocks_.size()) {
    throw Error(ErrorKind::invalid_argument,
                "TransformerLM::forward: argument 'cache': expected " +
                    std::to_string(blocks_.size()) + " layers, got " +
                    std::to_string(cache->layers.size()));
  }
  WeightCastPlan::Scope weight_casts(weight_casts_);
  // Each residual add happens inside the norm after it (RMSNormImpl::add_forward).
  torch::Tensor x = embed(embedding_->weight, tokens), pending;
  for (std::size_t i = 0; i < blocks_.size(); ++i) {
    std::tie(x, pending) = blocks_[i]->forward(x, pending, cache ? &cache->layers[i] : nullptr);
    if (maxima != nullptr) maxima->push_back((x + pending).abs().amax().to(torch::kFloat32));
  }
  const torch::Tensor normed = final_norm_->add_forward(x, pending).second;
  return project(normed, {head_ ? head_->weight : embedding_->weight})[0];
}

std::map<std::string, torch::Tensor> TransformerLMImpl::aux_losses() const {
  std::map<std::string, torch::Tensor> sums;
  for (const Block& block : blocks_) {
    for (const auto& [name, value] : block->attention().aux_losses()) {
      auto it = sums.find(name);
      if (it == sums.end()) {
        sums.emplace(name, value);
      } else {
        it->second = it->second + value;
      }
    }
  }
  return sums;
}

void TransformerLMImpl::attach_probe(AttentionProbe* probe) {
  for (std::size_t i = 0; i < blocks_.size(); ++i) {
    blocks_[i]->attention().attach_probe(probe, static_cast<std::int64_t>(i));
  }
}

void TransformerLMImpl::set_phase(const std::string& phase) {
  for (Block& block : blocks_) block->attention().set_phase(phase);
}

}  // namespace winnow::nn
