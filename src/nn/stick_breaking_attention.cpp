// Stick-breaking attention (seed 002; spec/stick-breaking.md) with the options of 002's
// appendix C: the remainder bias o_j += rem_j r_h (rem_j the unallocated stick, which the
// fused operator returns alongside the output) and the head-wise norm (GroupNorm, one group per
// head, after the remainder bias). No positional encoding by default: the stick-breaking
// process is order-aware by itself (002 section 3); RoPE is an option.
#include <cmath>

#include "nn/attention.h"
#include "nn/composed.h"
#include "torch/ops.h"

namespace winnow::nn {
namespace {

struct StickBreakingOptions {
  bool remainder_bias = false;
  bool head_norm = false;
  // 002 defines the sum over keys i < j; true lets query j see key j too.
  bool attend_current = false;
  // The operator's early halting (include/winnow/stick_breaking.h); 0 disables it.
  double halt_cutoff = 0.0;

  template <class V>
  void fields(V& v) {
    v("remainder_bias", remainder_bias);
    v("head_norm", head_norm);
    v("attend_current", attend_current);
    v("halt_cutoff", halt_cutoff, config::with_words(config::at_least(0), "0: off"));
  }
};

class StickBreakingAttention final : public AttentionLayer {
 public:
  StickBreakingAttention(const ModelConfig& model, std::int64_t /*layer_index*/)
      : options_(options_of<StickBreakingOptions>(model.attention)),
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
    // r_h starts at zero: the layer starts as plain stick-breaking.
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
    const torch::Tensor q = q_(x).view({B, L, h_.heads, h_.head_dim});
    const torch::Tensor k = k_(x).view({B, L, h_.kv_heads, h_.head_dim});
    const torch::Tensor v = v_(x).view({B, L, h_.kv_heads, h_.value_dim});
    const auto in = position_.prepare(q, k, v, cache);
    const torch::Tensor qv = in.q.to(in.v.scalar_type()), kv = in.k.to(in.v.scalar_type());
    torch::Tensor o, rem;
    if (kernel_) {
      torch_ops::AttentionCall call;
      call.scale = h_.scale;
      call.attend_current = options_.attend_current;
      std::tie(o, rem) = torch_ops::stick_breaking_attention(qv, kv, in.v, call, options_.halt_cutoff);
    } else {
      std::tie(o, rem) =
          composed::stick_breaking_attention(qv, kv, in.v, h_.scale, options_.attend_current);
    }
    if (probe()) {
      const auto [w, r] = composed::stick_breaking_weights(probed_queries(qv), kv, h_.scale,
                                                           options_.attend_current);
      probe()->record(probe_layer(), w, options_.attend_current, {{"remainder", r}});
    }
    if (remainder_bias_.defined()) o = o + rem.unsqueeze(-1) * remainder_bias_;
    if (head_norm_) o = head_norm_(o);
    return o_(o.reshape({B, L, h_.heads * h_.value_dim}));
  }

 private:
  StickBreakingOptions options_;
  HeadLayout h_;
  PositionalEncoding position_;
  bool kernel_;
  torch::nn::Linear q_{nullptr}, k_{nullptr}, v_{nullptr}, o_{nullptr};
  torch::Tensor remainder_bias_;
  HeadNorm head_norm_{nullptr};
};

}  // namespace

const Mechanism& stick_breaking_mechanism() {
  static const Mechanism m = [] {
    Mechanism m;
    m.name = "stick_breaking";
    m.summary = "stick-breaking attention (keys i < j by default), remainder bias, head-wise "
                "GroupNorm, early halting; NoPE | RoPE";
    m.fused_operator = "winnow::stick_breaking_attention";
    m.positions = {"nope", "rope"};
    m.option_keys = option_keys_of<StickBreakingOptions>();
    m.resolve_options = resolve_options_as<StickBreakingOptions>;
    m.check = [](const AttentionConfig& a, const std::string& path) {
      const auto o = options_of<StickBreakingOptions>(a);
      if (a.implementation == "composed" && o.halt_cutoff > 0) {
        config::fail(path + ".halt_cutoff",
                     "0 with implementation \"composed\" (only the fused operator halts early)",
                     config::number_text(o.halt_cutoff));
      }
    };
    m.make = [](const ModelConfig& model, std::int64_t layer) -> std::shared_ptr<AttentionLayer> {
      return std::make_shared<StickBreakingAttention>(model, layer);
    };
    return m;
  }();
  return m;
}

}  // namespace winnow::nn
