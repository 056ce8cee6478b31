// Threshold attention layers (seed 004; spec/threshold.md): TRA, TDA, and their beta = 0,
// power-1 special cases ReLA and differential ReLA, all through one operator. Queries and keys
// are normalized inside it (rotation by RoPE commutes with that), so the scores are cosines and
// a row keeps relu(s - tau_j)^p with tau_j = beta sqrt(2 log(n_j) / D) growing with the
// context. The weights are not normalized: each head's output goes through an RMSNorm (004,
// and the ReLA baseline of spec/softmax.md). TDA's second query/key view shares the values and
// is subtracted with a learned lambda.
#include "nn/attention.h"
#include "nn/composed.h"
#include "winnow/error.h"
#include "winnow/torch/ops.h"

namespace winnow::nn {
namespace {

struct ThresholdOptions {
  // tra | tda | rela (TRA at beta = 0, power 1, beta not learned) | differential_rela (TDA the
  // same way).
  std::string variant = "tda";
  double power = 2.0;
  // beta's starting value. At 0.5 a random query keeps about 4% of its keys at any length in
  // 64 dimensions (tau is half the expected maximum of the noise cosines); 004's own value is
  // lost from the seed's text.
  double beta_init = 0.5;
  bool beta_per_head = false;  // one beta per head instead of one per layer
  double lambda_init = 0.5;    // TDA's inhibition strength at the start
  // scalar: lambda is learned directly, used clamped to [0, 1] when clamp_lambda (004's
  // kernel); reparam: the Differential Transformer's form, lambda = exp(<lq1, lk1>) -
  // exp(<lq2, lk2>) + lambda_init with learned head_dim vectors, never clamped (it may turn
  // negative, as 004 allows).
  std::string lambda_form = "scalar";
  bool clamp_lambda = true;
  bool head_norm = true;       // RMSNorm of each head's output

  template <class V>
  void fields(V& v) {
    v("variant", variant, config::one_of({"tra", "tda", "rela", "differential_rela"}));
    v("power", power, config::greater_than(0));
    v("beta_init", beta_init);
    v("beta_per_head", beta_per_head);
    v("lambda_init", lambda_init);
    v("lambda_form", lambda_form, config::one_of({"scalar", "reparam"}));
    v("clamp_lambda", clamp_lambda);
    v("head_norm", head_norm);
  }
  bool differential() const { return variant == "tda" || variant == "differential_rela"; }
  bool rela() const { return variant == "rela" || variant == "differential_rela"; }
};

class ThresholdAttention final : public AttentionLayer {
 public:
  ThresholdAttention(const ModelConfig& model, std::int64_t /*layer_index*/)
      : options_(options_of<ThresholdOptions>(model.attention)),
        h_(head_layout(model)),
        position_(model, h_.head_dim),
        kernel_(uses_kernel(model.attention)) {
    const std::int64_t d = model.d_model, views = options_.differential() ? 2 : 1;
    q_ = make_linear(*this, "q", d, views * h_.heads * h_.head_dim, model.init_std);
    k_ = make_linear(*this, "k", d, views * h_.kv_heads * h_.head_dim, model.init_std);
    v_ = make_linear(*this, "v", d, h_.kv_heads * h_.value_dim, model.init_std);
    o_ = make_linear(*this, "o", h_.heads * h_.value_dim, d, residual_output_std(model));
    const std::int64_t scalars = options_.beta_per_head ? h_.heads : 1;
    if (options_.rela()) {
      // ReLA: no threshold, and nothing to learn about it.
      beta_ = register_buffer("beta", torch::zeros({scalars}));
    } else {
      beta_ = register_parameter("beta", torch::full({scalars}, options_.beta_init));
    }
    if (options_.differential() && options_.lambda_form == "scalar") {
      lambda_ = register_parameter("lambda", torch::full({scalars}, options_.lambda_init));
    }
    if (options_.differential() && options_.lambda_form == "reparam") {
      auto vector = [&](const char* name) {
        return register_parameter(name, torch::randn({h_.head_dim}) * 0.1);
      };
      lambda_q1_ = vector("lambda_q1");
      lambda_k1_ = vector("lambda_k1");
      lambda_q2_ = vector("lambda_q2");
      lambda_k2_ = vector("lambda_k2");
    }
    if (options_.head_norm) {
      head_norm_ = register_module(
          "head_norm", HeadNorm(h_.heads, h_.value_dim, model.norm_eps, /*centered=*/false));
    }
  }

  torch::Tensor forward(const torch::Tensor& x, LayerCache* cache) override {
    const std::int64_t B = x.size(0), L = x.size(1), H = h_.heads, Hkv = h_.kv_heads;
    const std::int64_t views = options_.differential() ? 2 : 1;
    const auto qkv = project(x, {q_->weight, k_->weight, v_->weight});
    const torch::Tensor q = qkv[0].view({B, L, views * H, h_.head_dim});
    const torch::Tensor k = qkv[1].view({B, L, views * Hkv, h_.head_dim});
    const torch::Tensor v = qkv[2].view({B, L, Hkv, h_.value_dim});
    const auto in = position_.prepare(q, k, v, cache);
    const torch::Tensor qv = in.q.to(in.v.scalar_type()), kv = in.k.to(in.v.scalar_type());
    composed::ThresholdSpec spec;
    spec.beta = beta_;
    spec.power = options_.rela() ? 1.0 : options_.power;
    spec.clamp_lambda = options_.clamp_lambda && options_.lambda_form == "scalar";
    const torch::Tensor q1 = qv.narrow(2, 0, H), k1 = kv.narrow(2, 0, Hkv);
    if (options_.differential()) {
      spec.lam = options_.lambda_form == "scalar"
                     ? lambda_
                     : (torch::exp((lambda_q1_ * lambda_k1_).sum()) -
                        torch::exp((lambda_q2_ * lambda_k2_).sum()) + options_.lambda_init)
                           .reshape({1});
      spec.q2 = qv.narrow(2, H, H);
      spec.k2 = kv.narrow(2, Hkv, Hkv);
    }
    torch::Tensor o;
    if (kernel_) {
      torch_ops::ThresholdViews tv;
      if (options_.differential()) {
        // Narrowed head ranges are strided views; the operator takes any strides.
        tv.lam = *spec.lam;
        tv.q2 = *spec.q2;
        tv.k2 = *spec.k2;
      }
      torch_ops::ThresholdOptions to;
      to.power = spec.power;
      to.clamp_lambda = spec.clamp_lambda;
      o = torch_ops::threshold_attention(q1, k1, in.v, beta_.to(torch_ops::stats_dtype(in.v)), {}, tv, to);
    } else {
      o = composed::threshold_attention(q1, k1, in.v, /*attend_current=*/true, spec);
    }
    if (probe()) {
      composed::ThresholdSpec probed = spec;
      if (probed.q2) probed.q2 = probed_queries(*probed.q2);
      probe()->record(probe_layer(), composed::threshold_weights(probed_queries(q1), k1, true, probed),
                      /*attend_current=*/true);
    }
    if (head_norm_) o = head_norm_(o);
    return project(o.reshape({B, L, H * h_.value_dim}), {o_->weight})[0];
  }

 private:
  ThresholdOptions options_;
  HeadLayout h_;
  PositionalEncoding position_;
  bool kernel_;
  torch::nn::Linear q_{nullptr}, k_{nullptr}, v_{nullptr}, o_{nullptr};
  torch::Tensor beta_, lambda_;
  torch::Tensor lambda_q1_, lambda_k1_, lambda_q2_, lambda_k2_;  // lambda_form reparam
  HeadNorm head_norm_{nullptr};
};

}  // namespace

const Mechanism& threshold_mechanism() {
  static const Mechanism m = [] {
    Mechanism m;
    m.name = "threshold";
    m.summary = "threshold attention (004): TRA | TDA | ReLA | differential ReLA; cosine "
                "scores, length-dependent threshold, learned beta and lambda, head RMSNorm; "
                "RoPE | NoPE";
    m.fused_operator = "winnow::threshold_attention";
    m.positions = {"rope", "nope"};
    m.option_keys = option_keys_of<ThresholdOptions>();
    m.resolve_options = resolve_options_as<ThresholdOptions>;
    m.make = [](const ModelConfig& model, std::int64_t layer) -> std::shared_ptr<AttentionLayer> {
      return std::make_shared<ThresholdAttention>(model, layer);
    };
    return m;
  }();
  return m;
}

}  // namespace winnow::nn
