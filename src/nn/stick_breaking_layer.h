// The layer stick-breaking and Sieve share (002 appendix C): q, k, v, o projections, the
// positional encoding, then the remainder bias o_j += rem_j r_h (rem_j the unallocated stick,
// which the operators return alongside the output) and the head-wise norm (GroupNorm, one
// group per head, after the remainder bias). The mechanism's options struct says how to attend:
//   bool remainder_bias, head_norm, attend_current       (config fields)
//   attend(q, k, v, scale, kernel) -> (out, rem)         fused operator or composed expression
//   weights(q, k, scale) -> (weights, rem)               what the probe records
#pragma once

#include <utility>

#include "nn/attention.h"

namespace winnow::nn {

template <class Options>
class StickBreakingLayer final : public AttentionLayer {
 public:
  StickBreakingLayer(const ModelConfig& model, std::int64_t /*layer_index*/)
      : options_(options_of<Options>(model.attention)),
        h_(head_layout(model)),
        position_(model, h_.head_dim),
        kernel_(uses_kernel(model.attention)) {
    const std::int64_t d = model.d_model;
    const double init_std = model.init_std;
    const double out_std = residual_output_std(model);
    q_ = make_linear(*this, "q", d, h_.heads * h_.head_dim, init_std);
    k_ = make_linear(*this, "k", d, h_.kv_heads * h_.head_dim, init_std);
    v_ = make_linear(*this, "v", d, h_.kv_heads * h_.value_dim, init_std);
    o_ = make_linear(*this, "o", h_.heads * h_.value_dim, d, out_std);
    // r_h starts at zero: the layer starts as the plain mechanism.
    if (options_.remainder_bias) {
      remainder_bias_ = register_parameter("remainder_bias", torch::zeros({h_.heads, h_.value_dim}));
    }
    if (options_.head_norm) {
      head_norm_ = register_module(
          "head_norm", HeadNorm(h_.heads, h_.value_dim, model.norm_eps, /*centered=*/true));
    }
  }

  torch::Tensor forward(const torch::Tensor& x, LayerCache* cache) override {
    const std::int64_t B = x.size(0), L = x.size(1);
    const auto qkv = project(x, {q_->weight, k_->weight, v_->weight});
    const torch::Tensor q = qkv[0].view({B, L, h_.heads, h_.head_dim});
    const torch::Tensor k = qkv[1].view({B, L, h_.kv_heads, h_.head_dim});
    const torch::Tensor v = qkv[2].view({B, L, h_.kv_heads, h_.value_dim});
    const auto in = position_.prepare(q, k, v, cache);
    const torch::Tensor qv = in.q.to(in.v.scalar_type()), kv = in.k.to(in.v.scalar_type());
    auto [o, rem] = options_.attend(qv, kv, in.v, h_.scale, kernel_);
    if (probe()) {
      const auto [w, r] = options_.weights(probed_queries(qv), kv, h_.scale);
      probe()->record(probe_layer(), w, options_.attend_current, {{"remainder", r}});
    }
    if (remainder_bias_.defined()) o = o + rem.unsqueeze(-1) * remainder_bias_;
    if (head_norm_) o = head_norm_(o);
    return project(o.reshape({B, L, h_.heads * h_.value_dim}), {o_->weight})[0];
  }

 private:
  Options options_;
  HeadLayout h_;
  PositionalEncoding position_;
  bool kernel_;
  torch::nn::Linear q_{nullptr}, k_{nullptr}, v_{nullptr}, o_{nullptr};
  torch::Tensor remainder_bias_;
  HeadNorm head_norm_{nullptr};
};

}  // namespace winnow::nn
