#include "nn/attention.h"

#include <cmath>

namespace winnow::nn {

// The mechanisms this build can make. A new mechanism adds its entry here.
const std::vector<Mechanism>& mechanisms() {
  static const std::vector<Mechanism> all = {
      softmax_mechanism(),
      differential_mechanism(),
      stick_breaking_mechanism(),
      entmax_mechanism(),
      sieve_mechanism(),
      threshold_mechanism(),
      gsa_mechanism(),
  };
  return all;
}

const Mechanism& find_mechanism(const std::string& name, const std::string& key) {
  std::vector<std::string> names;
  for (const Mechanism& m : mechanisms()) {
    if (m.name == name) return m;
    names.push_back(m.name);
  }
  config::fail(key, "one of " + config::join(names), "\"" + name + "\"");
}

HeadLayout head_layout(const ModelConfig& model) {
  const AttentionConfig& a = model.attention;
  HeadLayout h;
  h.heads = a.heads;
  h.kv_heads = a.kv_heads;
  h.head_dim = a.head_dim;
  h.value_dim = a.head_dim;
  h.scale = 1.0 / std::sqrt(static_cast<double>(a.head_dim));
  return h;
}

bool uses_kernel(const AttentionConfig& a) { return a.implementation == "kernel"; }

torch::Tensor alibi_slopes(std::int64_t heads) {
  const torch::Tensor h = torch::arange(1, heads + 1, torch::kFloat64);
  return torch::pow(2.0, -8.0 * h / static_cast<double>(heads));
}

PositionalEncoding::PositionalEncoding(const ModelConfig& model, std::int64_t head_dim)
    : kind_(model.attention.position) {
  if (kind_ == "rope") rope_.emplace(model.attention.rope, head_dim, model.context_len, uses_kernel(model.attention));
}

PositionalEncoding::Prepared PositionalEncoding::prepare(const torch::Tensor& q,
                                                         const torch::Tensor& k,
                                                         const torch::Tensor& v,
                                                         LayerCache* cache) const {
  const std::int64_t offset = cache ? cache->length() : 0;
  const std::int64_t seen = offset + q.size(1);
  Prepared p{q, k, v, offset};
  if (rope_ && rope_->length_dependent()) {
    // Keys are cached unrotated and all of them rotate with the base of the current length.
    if (cache) std::tie(p.k, p.v) = cache->append(k, v);
    p.q = rope_->apply(q, offset, seen);
    p.k = rope_->apply(p.k, 0, seen);
    return p;
  }
  if (rope_) {
    p.q = rope_->apply(q, offset, seen);
    p.k = rope_->apply(k, offset, seen);
  }
  if (cache) std::tie(p.k, p.v) = cache->append(p.k, v);
  return p;
}

std::optional<std::pair<torch::Tensor, torch::Tensor>> PositionalEncoding::operator_tables(
    const torch::Tensor& q, const torch::Tensor& k, const LayerCache* cache) const {
  if (!rope_ || cache != nullptr || q.dim() != 4 || k.dim() != 4 || q.size(1) != k.size(1)) return std::nullopt;
  return rope_->kernel_tables(q);
}

std::shared_ptr<AttentionLayer> make_attention(const ModelConfig& model, std::int64_t layer_index) {
  return find_mechanism(model.attention.kind, "model.attention.kind").make(model, layer_index);
}

}  // namespace winnow::nn
