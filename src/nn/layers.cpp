#include "nn/layers.h"

#include <cmath>

#include "nn/composed.h"
#include "torch/ops.h"
#include "winnow/error.h"

namespace winnow::nn {
namespace {

[[noreturn]] void bad_config(const std::string& key, const std::string& expected,
                             const std::string& got) {
  throw Error(ErrorKind::invalid_argument,
              "model config: key '" + key + "': expected " + expected + ", got " + got);
}

Projections make_projections(torch::nn::Module& m, const ModelConfig& model, std::int64_t q_views,
                             std::int64_t k_views) {
  const AttentionConfig& a = model.attention;
  Projections p;
  p.heads = a.heads;
  p.kv_heads = a.kv_heads > 0 ? a.kv_heads : a.heads;
  if (p.heads < 1) bad_config("model.attention.heads", ">= 1", std::to_string(p.heads));
  if (p.heads % p.kv_heads != 0) {
    bad_config("model.attention.kv_heads", "a divisor of heads (" + std::to_string(p.heads) + ")",
               std::to_string(p.kv_heads));
  }
  p.head_dim = a.head_dim > 0 ? a.head_dim : model.d_model / p.heads;
  if (p.head_dim < 1 || (a.head_dim == 0 && model.d_model % p.heads != 0)) {
    bad_config("model.attention.heads", "a divisor of d_model (" + std::to_string(model.d_model) + ")",
               std::to_string(p.heads));
  }
  p.value_dim = p.head_dim;
  const std::int64_t d = model.d_model;
  p.q = m.register_module("q", torch::nn::Linear(torch::nn::LinearOptions(d, q_views * p.heads * p.head_dim).bias(false)));
  p.k = m.register_module("k", torch::nn::Linear(torch::nn::LinearOptions(d, k_views * p.kv_heads * p.head_dim).bias(false)));
  p.v = m.register_module("v", torch::nn::Linear(torch::nn::LinearOptions(d, p.kv_heads * p.value_dim).bias(false)));
  p.o = m.register_module("o", torch::nn::Linear(torch::nn::LinearOptions(p.heads * p.value_dim, d).bias(false)));
  return p;
}

std::optional<Rope> make_rope(const ModelConfig& model, const Projections& p) {
  const std::string& pos = model.attention.position;
  if (pos == "rope") return Rope(model.attention.rope, p.head_dim, model.max_len);
  if (pos == "nope" || pos == "alibi") return std::nullopt;
  bad_config("model.attention.position", "rope, nope or alibi", "'" + pos + "'");
}

bool uses_composed(const AttentionConfig& a) {
  if (a.implementation == "kernel") return false;
  if (a.implementation == "composed") return true;
  bad_config("model.attention.implementation", "kernel or composed", "'" + a.implementation + "'");
}

// Under autocast the projections return 16-bit tensors while parameters stay fp32: the
// operators need q, k and v in one dtype.
torch::Tensor like(const torch::Tensor& t, const torch::Tensor& ref) {
  return t.scalar_type() == ref.scalar_type() ? t : t.to(ref.scalar_type());
}

}  // namespace

std::pair<torch::Tensor, torch::Tensor> LayerCache::append(const torch::Tensor& new_k,
                                                          const torch::Tensor& new_v) {
  k = k.defined() ? torch::cat({k, new_k}, 1) : new_k;
  v = v.defined() ? torch::cat({v, new_v}, 1) : new_v;
  return {k, v};
}

RMSNormImpl::RMSNormImpl(std::int64_t dim, double eps) : eps_(eps) {
  weight_ = register_parameter("weight", torch::ones({dim}));
}

torch::Tensor RMSNormImpl::forward(const torch::Tensor& x) {
  const torch::Tensor xf = x.to(torch::kFloat32);
  const torch::Tensor normed = xf * torch::rsqrt(xf.pow(2).mean(-1, /*keepdim=*/true) + eps_);
  return (normed * weight_).to(x.scalar_type());
}

MLPImpl::MLPImpl(const ModelConfig& c) : swiglu_(c.mlp == "swiglu") {
  if (c.mlp != "swiglu" && c.mlp != "gelu") bad_config("model.mlp", "swiglu or gelu", "'" + c.mlp + "'");
  std::int64_t hidden = c.mlp_hidden;
  if (hidden == 0) hidden = ((swiglu_ ? 8 * c.d_model / 3 : 4 * c.d_model) + 63) / 64 * 64;
  up_ = register_module("up", torch::nn::Linear(torch::nn::LinearOptions(c.d_model, hidden).bias(false)));
  if (swiglu_) {
    gate_ = register_module("gate", torch::nn::Linear(torch::nn::LinearOptions(c.d_model, hidden).bias(false)));
  }
  down_ = register_module("down", torch::nn::Linear(torch::nn::LinearOptions(hidden, c.d_model).bias(false)));
}

torch::Tensor MLPImpl::forward(const torch::Tensor& x) {
  if (swiglu_) return down_(torch::silu(gate_(x)) * up_(x));
  return down_(torch::gelu(up_(x)));
}

// ------------------------------------------------------------------ softmax family

SoftmaxAttention::SoftmaxAttention(const ModelConfig& model, std::int64_t)
    : cfg_(model.attention), p_(make_projections(*this, model, 1, 1)), rope_(make_rope(model, p_)) {
  uses_composed(cfg_);
  if (cfg_.ssmax) {
    // s_h starts at 1 / log(training length): the logits are unchanged at that length and
    // sharpen beyond it.
    ssmax_scale_ = register_parameter(
        "ssmax_scale", torch::full({p_.heads}, 1.0 / std::log(static_cast<double>(std::max<std::int64_t>(model.max_len, 2)))));
  }
  if (cfg_.position == "alibi") {
    torch::Tensor h = torch::arange(1, p_.heads + 1, torch::kFloat64);
    alibi_slopes_ = register_buffer("alibi_slopes", torch::pow(2.0, -8.0 * h / static_cast<double>(p_.heads)).to(torch::kFloat32));
  }
  const std::string& gate = cfg_.gate;
  if (gate != "none" && gate != "g1" && gate != "g2" && gate != "g1g2") {
    bad_config("model.attention.gate", "none, g1, g2 or g1g2", "'" + gate + "'");
  }
  if (gate == "g1" || gate == "g1g2") {
    output_gate_ = register_module("output_gate", torch::nn::Linear(model.d_model, p_.heads * p_.value_dim));
  }
  if (gate == "g2" || gate == "g1g2") {
    value_gate_ = register_module("value_gate", torch::nn::Linear(model.d_model, p_.kv_heads * p_.value_dim));
  }
}

torch::Tensor SoftmaxAttention::forward(const torch::Tensor& x, LayerCache* cache) {
  const std::int64_t B = x.size(0), L = x.size(1);
  const std::int64_t offset = cache ? cache->length() : 0;
  torch::Tensor q = p_.q(x).view({B, L, p_.heads, p_.head_dim});
  torch::Tensor k = p_.k(x).view({B, L, p_.kv_heads, p_.head_dim});
  torch::Tensor v = p_.v(x).view({B, L, p_.kv_heads, p_.value_dim});
  if (value_gate_) v = v * torch::sigmoid(value_gate_(x)).view({B, L, p_.kv_heads, p_.value_dim});
  if (rope_) {
    q = rope_->apply(q, offset);
    k = rope_->apply(k, offset);
  }
  if (cache) std::tie(k, v) = cache->append(k, v);
  if (cfg_.ssmax) {
    // z_ij = s_h log(n_j) <q_j, k_i> scale, n_j = number of keys row j sees.
    const torch::Tensor n = torch::arange(offset + 1, offset + L + 1, x.options().dtype(torch::kFloat32));
    q = q * (torch::log(n).view({1, L, 1, 1}) * ssmax_scale_.view({1, 1, -1, 1}));
  }
  q = like(q, v);
  k = like(k, v);
  const double scale = 1.0 / std::sqrt(static_cast<double>(p_.head_dim));
  torch::Tensor o;
  if (cfg_.position == "alibi" || uses_composed(cfg_)) {
    o = composed::softmax_attention(q, k, v, scale, true,
                                    cfg_.position == "alibi" ? std::optional<torch::Tensor>(alibi_slopes_) : std::nullopt);
  } else {
    torch_ops::AttentionCall call;
    call.scale = scale;
    o = torch_ops::softmax_attention(q, k, v, call);
  }
  if (output_gate_) o = o * torch::sigmoid(output_gate_(x)).view({B, L, p_.heads, p_.value_dim});
  return p_.o(o.reshape({B, L, p_.heads * p_.value_dim}));
}

DifferentialAttention::DifferentialAttention(const ModelConfig& model, std::int64_t layer_index)
    : cfg_(model.attention), p_(make_projections(*this, model, 2, 2)), rope_(make_rope(model, p_)) {
  uses_composed(cfg_);
  if (cfg_.position == "alibi") bad_config("model.attention.position", "rope or nope for differential attention", "'alibi'");
  // lambda_init = 0.8 - 0.6 exp(-0.3 (layer - 1)), layers counted from 1 (spec/softmax.md).
  lambda_init_ = 0.8 - 0.6 * std::exp(-0.3 * static_cast<double>(layer_index));
  auto vec = [&](const char* name) {
    return register_parameter(name, torch::randn({p_.head_dim}) * 0.1);
  };
  lambda_q1_ = vec("lambda_q1");
  lambda_k1_ = vec("lambda_k1");
  lambda_q2_ = vec("lambda_q2");
  lambda_k2_ = vec("lambda_k2");
  head_norm_ = register_module("head_norm", RMSNorm(p_.value_dim, model.norm_eps));
}

torch::Tensor DifferentialAttention::forward(const torch::Tensor& x, LayerCache* cache) {
  const std::int64_t B = x.size(0), L = x.size(1);
  const std::int64_t offset = cache ? cache->length() : 0;
  torch::Tensor q = p_.q(x).view({B, L, 2 * p_.heads, p_.head_dim});
  torch::Tensor k = p_.k(x).view({B, L, 2 * p_.kv_heads, p_.head_dim});
  torch::Tensor v = p_.v(x).view({B, L, p_.kv_heads, p_.value_dim});
  if (rope_) {
    q = rope_->apply(q, offset);
    k = rope_->apply(k, offset);
  }
  if (cache) std::tie(k, v) = cache->append(k, v);
  q = like(q, v);
  k = like(k, v);
  const double scale = 1.0 / std::sqrt(static_cast<double>(p_.head_dim));
  auto attend = [&](const torch::Tensor& qq, const torch::Tensor& kk) {
    if (uses_composed(cfg_)) return composed::softmax_attention(qq, kk, v, scale, true);
    torch_ops::AttentionCall call;
    call.scale = scale;
    return torch_ops::softmax_attention(qq, kk, v, call);
  };
  const torch::Tensor o1 = attend(q.narrow(2, 0, p_.heads), k.narrow(2, 0, p_.kv_heads));
  const torch::Tensor o2 = attend(q.narrow(2, p_.heads, p_.heads), k.narrow(2, p_.kv_heads, p_.kv_heads));
  const torch::Tensor lambda = torch::exp((lambda_q1_ * lambda_k1_).sum()) -
                               torch::exp((lambda_q2_ * lambda_k2_).sum()) + lambda_init_;
  const torch::Tensor o = head_norm_(o1 - lambda * o2) * (1.0 - lambda_init_);
  return p_.o(o.reshape({B, L, p_.heads * p_.value_dim}).to(x.scalar_type()));
}

// ------------------------------------------------------------------ stick-breaking

StickBreakingAttention::StickBreakingAttention(const ModelConfig& model, std::int64_t)
    : cfg_(model.attention), p_(make_projections(*this, model, 1, 1)), rope_(make_rope(model, p_)) {
  uses_composed(cfg_);
  if (cfg_.position == "alibi") bad_config("model.attention.position", "rope or nope for stick-breaking", "'alibi'");
  if (cfg_.halt_cutoff < 0) bad_config("model.attention.halt_cutoff", ">= 0", std::to_string(cfg_.halt_cutoff));
  if (cfg_.remainder_bias) {
    remainder_bias_ = register_parameter("remainder_bias", torch::zeros({p_.heads, p_.value_dim}));
  }
  if (cfg_.head_norm) head_norm_ = register_module("head_norm", RMSNorm(p_.value_dim, model.norm_eps));
}

torch::Tensor StickBreakingAttention::forward(const torch::Tensor& x, LayerCache* cache) {
  const std::int64_t B = x.size(0), L = x.size(1);
  const std::int64_t offset = cache ? cache->length() : 0;
  torch::Tensor q = p_.q(x).view({B, L, p_.heads, p_.head_dim});
  torch::Tensor k = p_.k(x).view({B, L, p_.kv_heads, p_.head_dim});
  torch::Tensor v = p_.v(x).view({B, L, p_.kv_heads, p_.value_dim});
  if (rope_) {
    q = rope_->apply(q, offset);
    k = rope_->apply(k, offset);
  }
  if (cache) std::tie(k, v) = cache->append(k, v);
  q = like(q, v);
  k = like(k, v);
  const double scale = 1.0 / std::sqrt(static_cast<double>(p_.head_dim));
  torch::Tensor o, rem;
  if (uses_composed(cfg_)) {
    std::tie(o, rem) = composed::stick_breaking_attention(q, k, v, scale, false);
  } else {
    torch_ops::AttentionCall call;
    call.scale = scale;
    call.attend_current = false;  // 002's sum over i < j
    std::tie(o, rem) = torch_ops::stick_breaking_attention(q, k, v, call, cfg_.halt_cutoff);
  }
  if (cfg_.remainder_bias) o = o + rem.unsqueeze(-1).to(o.scalar_type()) * remainder_bias_;
  if (cfg_.head_norm) o = head_norm_(o);
  return p_.o(o.reshape({B, L, p_.heads * p_.value_dim}).to(x.scalar_type()));
}

// ------------------------------------------------------------------ factory

const std::vector<std::string>& attention_kinds() {
  static const std::vector<std::string> kinds = {"softmax", "differential", "stick_breaking"};
  return kinds;
}

std::shared_ptr<AttentionLayer> make_attention(const ModelConfig& model, std::int64_t layer_index) {
  const std::string& kind = model.attention.kind;
  if (kind == "softmax") return std::make_shared<SoftmaxAttention>(model, layer_index);
  if (kind == "differential") return std::make_shared<DifferentialAttention>(model, layer_index);
  if (kind == "stick_breaking") return std::make_shared<StickBreakingAttention>(model, layer_index);
  std::string known;
  for (const std::string& k : attention_kinds()) known += (known.empty() ? "" : ", ") + k;
  bad_config("model.attention.kind", "one of " + known, "'" + kind + "'");
}

}  // namespace winnow::nn
