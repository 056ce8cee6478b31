#include "nn/multiscreen.h"

#include <cmath>

#include "nn/composed.h"
#include "winnow/error.h"
#include "winnow/torch/ops.h"

namespace winnow::nn {

namespace F = torch::nn::functional;

MultiscreenLayerImpl::MultiscreenLayerImpl(const ModelConfig& c, std::int64_t) : config_(c.multiscreen) {
  const MultiscreenConfig& m = config_;
  const std::int64_t t = m.tiles, dk = m.key_dim, dv = m.value_dim, e = c.d_model;
  torch::NoGradGuard no_grad;
  // 001 appendix D: W_Q, W_K ~ N(0, (0.1 / sqrt(d_K))^2), W_V ~ (0.1 / sqrt(d_V)), W_G ~ 0.1,
  // W_O ~ 0.1 / sqrt(d_E); windows spaced from 2 to w_th + 1 over the tiles; r = 0.5;
  // s_O = log(1 / sqrt(tiles * layers)).
  in_ = register_parameter("input_projection", torch::empty({t * (2 * dk + 2 * dv), e}));
  in_.narrow(0, 0, 2 * t * dk).normal_(0.0, 0.1 / std::sqrt(static_cast<double>(dk)));
  in_.narrow(0, 2 * t * dk, t * dv).normal_(0.0, 0.1 / std::sqrt(static_cast<double>(dv)));
  in_.narrow(0, 2 * t * dk + t * dv, t * dv).normal_(0.0, 0.1);
  out_ = register_parameter("output_projection", torch::empty({e, t * dv}).normal_(0.0, 0.1 / std::sqrt(static_cast<double>(e))));
  s_w_ = register_parameter("s_w", torch::linspace(0.0, std::log(m.mipe_threshold), t, torch::kFloat32));
  s_r_ = register_parameter("s_r", torch::zeros({t}));
  s_o_ = register_parameter("s_o", torch::full({t}, std::log(1.0 / std::sqrt(static_cast<double>(t * c.layers)))));
}

torch::Tensor MultiscreenLayerImpl::forward(const torch::Tensor& x, LayerCache* cache) {
  const MultiscreenConfig& m = config_;
  const std::int64_t b = x.size(0), l = x.size(1), t = m.tiles, dk = m.key_dim, dv = m.value_dim;
  const torch::Tensor proj = F::linear(x, in_);  // (B, L, t (2 dk + 2 dv)): Q | K | V | G
  const torch::Tensor q = proj.narrow(2, 0, t * dk).view({b, l, t, dk});
  torch::Tensor k = proj.narrow(2, t * dk, t * dk).view({b, l, t, dk});
  torch::Tensor v = proj.narrow(2, 2 * t * dk, t * dv).view({b, l, t, dv});
  const torch::Tensor g = proj.narrow(2, 2 * t * dk + t * dv, t * dv).view({b, l, t, dv});
  if (cache != nullptr) std::tie(k, v) = cache->append(k, v);
  torch::Tensor u;
  if (m.implementation == "kernel") {
    const auto stats = torch_ops::stats_dtype(v);
    torch_ops::ScreeningOptions o;
    o.mipe_threshold = m.mipe_threshold;
    o.expand_windows_above = m.window_expansion;
    u = torch_ops::screening_attention(q, k, v, s_w_.to(stats), s_r_.to(stats), {}, o);
  } else {
    u = composed::screening(q, k, v, s_w_, s_r_, m.mipe_threshold, m.window_expansion);
  }
  if (cache != nullptr) {
    if (const std::int64_t keep = cache_keep(); keep > 0) cache->keep_last(keep);
  }
  const torch::Tensor gate = torch::tanh(F::silu(g)) * torch::exp(s_o_).to(g.scalar_type()).view({1, 1, t, 1});
  return F::linear((u * gate).reshape({b, l, t * dv}), out_);
}

// Keys at or beyond every tile's window have exactly zero relevance, and MiPE and the Softmask
// see positions only through i - j, so decoding needs only the last ceil(w_max) keys (one more
// for rounding between this double and the kernel's float); none can go once a window is
// expanded to infinity.
std::int64_t MultiscreenLayerImpl::cache_keep() {
  const auto version = static_cast<std::int64_t>(s_w_._version());
  const void* storage = s_w_.data_ptr();
  if (version != cache_keep_version_ || storage != cache_keep_storage_) {
    const double w_max = std::exp(s_w_.max().item<double>()) + 1.0;
    const bool infinite = config_.window_expansion > 0 && w_max > config_.window_expansion;
    cache_keep_ = infinite ? 0 : static_cast<std::int64_t>(std::ceil(w_max)) + 1;
    cache_keep_version_ = version;
    cache_keep_storage_ = storage;
  }
  return cache_keep_;
}

MultiscreenLMImpl::MultiscreenLMImpl(ModelConfig c) : config_(std::move(c)) {
  resolve(config_);
  const ModelConfig& m = config_;
  const double e = static_cast<double>(m.d_model);
  {
    torch::NoGradGuard no_grad;
    embedding_ = register_parameter("embedding", torch::empty({m.vocab_size, m.d_model}).normal_(0.0, 0.1 / std::sqrt(e)));
    s_e_ = register_parameter("s_e", torch::zeros({1}));
    s_f_ = register_parameter("s_f", torch::full({1}, std::log(std::sqrt(e))));
  }
  for (std::int64_t i = 0; i < m.layers; ++i) {
    layers_.push_back(register_module("layer" + std::to_string(i), MultiscreenLayer(m, i)));
  }
}

torch::Tensor MultiscreenLMImpl::run(const torch::Tensor& tokens, KVCache* cache, std::vector<torch::Tensor>* maxima) {
  if (tokens.dim() != 2 || tokens.scalar_type() != torch::kInt64) {
    throw Error(ErrorKind::invalid_argument,
                "MultiscreenLM::forward: argument 'tokens': expected (B, L) int64, got " + c10::str(tokens.sizes()) +
                    " " + c10::toString(tokens.scalar_type()));
  }
  if (cache != nullptr && cache->layers.size() != layers_.size()) {
    throw Error(ErrorKind::invalid_argument, "MultiscreenLM::forward: argument 'cache': expected " +
                                                 std::to_string(layers_.size()) + " layers, got " +
                                                 std::to_string(cache->layers.size()));
  }
  // Unit-norm embedding rows, for the input and (tied) the output.
  const torch::Tensor unit = F::normalize(embedding_, F::NormalizeFuncOptions().dim(1));
  torch::Tensor x = F::embedding(tokens, unit) * torch::exp(s_e_);
  for (std::size_t i = 0; i < layers_.size(); ++i) {
    x = x + layers_[i]->forward(x, cache ? &cache->layers[i] : nullptr);
    if (maxima != nullptr) maxima->push_back(x.abs().amax().to(torch::kFloat32));
  }
  return F::linear(x, unit) * torch::exp(s_f_);
}

}  // namespace winnow::nn
