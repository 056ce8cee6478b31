// Differential softmax attention (Ye et al. 2024; spec/softmax.md): two query/key views per
// head attend over the same values, and the second map is subtracted with a learned weight:
//   o = HeadRMSNorm(softmax(Q1 K1^T) V - lambda softmax(Q2 K2^T) V) (1 - lambda_init)
//   lambda = exp(<lq1, lk1>) - exp(<lq2, lk2>) + lambda_init,
//   lambda_init = 0.8 - 0.6 exp(-0.3 (layer - 1)), layers counted from 1.
// Two calls of the fused softmax operator on the same V.
#include <cmath>

#include "nn/attention.h"
#include "nn/composed.h"
#include "winnow/torch/ops.h"

namespace winnow::nn {
namespace {

struct DifferentialOptions {
  template <class V>
  void fields(V&) {}
};

class DifferentialAttention final : public AttentionLayer {
 public:
  DifferentialAttention(const ModelConfig& model, std::int64_t layer_index)
      : h_(head_layout(model)),
        position_(model, h_.head_dim),
        kernel_(uses_kernel(model.attention)),
        lambda_init_(0.8 - 0.6 * std::exp(-0.3 * static_cast<double>(layer_index))) {
    const std::int64_t d = model.d_model;
    const double init_std = model.init_std;
    const double out_std = residual_output_std(model);
    q_ = make_linear(*this, "q", d, 2 * h_.heads * h_.head_dim, init_std);
    k_ = make_linear(*this, "k", d, 2 * h_.kv_heads * h_.head_dim, init_std);
    v_ = make_linear(*this, "v", d, h_.kv_heads * h_.value_dim, init_std);
    o_ = make_linear(*this, "o", h_.heads * h_.value_dim, d, out_std);
    auto lambda_vector = [&](const char* name) {
      return register_parameter(name, torch::randn({h_.head_dim}) * 0.1);
    };
    lambda_q1_ = lambda_vector("lambda_q1");
    lambda_k1_ = lambda_vector("lambda_k1");
    lambda_q2_ = lambda_vector("lambda_q2");
    lambda_k2_ = lambda_vector("lambda_k2");
    head_norm_ = register_module(
        "head_norm", HeadNorm(h_.heads, h_.value_dim, model.norm_eps, /*centered=*/false));
  }

  torch::Tensor forward(const torch::Tensor& x, LayerCache* cache) override {
    const std::int64_t B = x.size(0), L = x.size(1), H = h_.heads, Hkv = h_.kv_heads;
    const auto qkv = project(x, {q_->weight, k_->weight, v_->weight});
    const torch::Tensor q = qkv[0].view({B, L, 2 * H, h_.head_dim});
    const torch::Tensor k = qkv[1].view({B, L, 2 * Hkv, h_.head_dim});
    const torch::Tensor v = qkv[2].view({B, L, Hkv, h_.value_dim});
    const auto in = position_.prepare(q, k, v, cache);
    const torch::Tensor qv = in.q.to(in.v.scalar_type()), kv = in.k.to(in.v.scalar_type());
    auto attend = [&](const torch::Tensor& qq, const torch::Tensor& kk) {
      if (!kernel_) return composed::softmax_attention(qq, kk, in.v, h_.scale, true);
      torch_ops::AttentionCall call;
      call.scale = h_.scale;
      return torch_ops::softmax_attention(qq, kk, in.v, call);
    };
    const torch::Tensor o1 = attend(qv.narrow(2, 0, H), kv.narrow(2, 0, Hkv));
    const torch::Tensor o2 = attend(qv.narrow(2, H, H), kv.narrow(2, Hkv, Hkv));
    const torch::Tensor lambda = torch::exp((lambda_q1_ * lambda_k1_).sum()) -
                                 torch::exp((lambda_q2_ * lambda_k2_).sum()) + lambda_init_;
    if (probe()) {
      // The signed difference of the two maps is the layer's effective weights.
      const torch::Tensor qp = probed_queries(qv);
      const torch::Tensor w1 = composed::softmax_weights(qp.narrow(2, 0, H), kv.narrow(2, 0, Hkv), h_.scale, true);
      const torch::Tensor w2 = composed::softmax_weights(qp.narrow(2, H, H), kv.narrow(2, Hkv, Hkv), h_.scale, true);
      probe()->record(probe_layer(), w1 - lambda.to(w1.scalar_type()) * w2, true);
    }
    const torch::Tensor o = head_norm_(o1 - lambda * o2) * (1.0 - lambda_init_);
    return project(o.reshape({B, L, H * h_.value_dim}), {o_->weight})[0];
  }

 private:
  HeadLayout h_;
  PositionalEncoding position_;
  bool kernel_;
  double lambda_init_;
  torch::nn::Linear q_{nullptr}, k_{nullptr}, v_{nullptr}, o_{nullptr};
  torch::Tensor lambda_q1_, lambda_k1_, lambda_q2_, lambda_k2_;
  HeadNorm head_norm_{nullptr};
};

}  // namespace

const Mechanism& differential_mechanism() {
  static const Mechanism m = [] {
    Mechanism m;
    m.name = "differential";
    m.summary = "differential softmax attention (two softmax maps on the same values, learned "
                "lambda, head-wise RMSNorm); RoPE | NoPE";
    m.fused_operator = "winnow::softmax_attention (two calls)";
    m.positions = {"rope", "nope"};
    m.option_keys = option_keys_of<DifferentialOptions>();
    m.resolve_options = resolve_options_as<DifferentialOptions>;
    m.make = [](const ModelConfig& model, std::int64_t layer) -> std::shared_ptr<AttentionLayer> {
      return std::make_shared<DifferentialAttention>(model, layer);
    };
    return m;
  }();
  return m;
}

}  // namespace winnow::nn
