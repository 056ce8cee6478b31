// alpha-entmax attention (spec/entmax.md; the sparse baseline of seeds 000 and 004): softmax's
// layer with the normalization replaced by alpha-entmax, whose weights are exactly zero below
// each row's threshold. RoPE by default, with every scaling the softmax layer has; NoPE is an
// option.
#include "nn/attention.h"
#include "nn/composed.h"
#include "winnow/torch/ops.h"

namespace winnow::nn {
namespace {

struct EntmaxOptions {
  // 2 is sparsemax; 1.5 the seeds' default; toward 1 it approaches softmax.
  double alpha = 1.5;
  // Like softmax, query j sees key j; false restricts it to keys i < j.
  bool attend_current = true;

  template <class V>
  void fields(V& v) {
    v("alpha", alpha, config::with_words(config::greater_than(1), "2: sparsemax"));
    v("attend_current", attend_current);
  }
};

class EntmaxAttention final : public AttentionLayer {
 public:
  EntmaxAttention(const ModelConfig& model, std::int64_t /*layer_index*/)
      : options_(options_of<EntmaxOptions>(model.attention)),
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
  }

  torch::Tensor forward(const torch::Tensor& x, LayerCache* cache) override {
    const std::int64_t B = x.size(0), L = x.size(1);
    const auto qkv = project(x, {q_->weight, k_->weight, v_->weight});
    const torch::Tensor q = qkv[0].view({B, L, h_.heads, h_.head_dim});
    const torch::Tensor k = qkv[1].view({B, L, h_.kv_heads, h_.head_dim});
    const torch::Tensor v = qkv[2].view({B, L, h_.kv_heads, h_.value_dim});
    const auto in = position_.prepare(q, k, v, cache);
    // RoPE's scalings promote bf16 projections to float32 under autocast; the operators take
    // q, k and v in one dtype.
    const torch::Tensor qv = in.q.to(in.v.scalar_type()), kv = in.k.to(in.v.scalar_type());
    torch::Tensor o;
    if (kernel_) {
      torch_ops::AttentionCall call;
      call.scale = h_.scale;
      call.attend_current = options_.attend_current;
      o = torch_ops::entmax_attention(qv, kv, in.v, call, options_.alpha);
    } else {
      o = composed::entmax_attention(qv, kv, in.v, h_.scale, options_.attend_current,
                                     options_.alpha);
    }
    if (probe()) {
      probe()->record(probe_layer(),
                      composed::entmax_weights(probed_queries(qv), kv, h_.scale,
                                               options_.attend_current, options_.alpha),
                      options_.attend_current);
    }
    return project(o.reshape({B, L, h_.heads * h_.value_dim}), {o_->weight})[0];
  }

 private:
  EntmaxOptions options_;
  HeadLayout h_;
  PositionalEncoding position_;
  bool kernel_;
  torch::nn::Linear q_{nullptr}, k_{nullptr}, v_{nullptr}, o_{nullptr};
};

}  // namespace

const Mechanism& entmax_mechanism() {
  static const Mechanism m = [] {
    Mechanism m;
    m.name = "entmax";
    m.summary =
        "alpha-entmax attention (exactly sparse weights; alpha 2 is sparsemax); "
        "RoPE (linear, ntk, dynamic, yarn) | NoPE";
    m.fused_operator = "winnow::entmax_attention";
    m.graph_blocker = [](const AttentionConfig&) -> std::string {
      return "entmax attention's threshold search reads a flag on the host";
    };
    m.positions = {"rope", "nope"};
    m.option_keys = option_keys_of<EntmaxOptions>();
    m.resolve_options = resolve_options_as<EntmaxOptions>;
    m.make = [](const ModelConfig& model, std::int64_t layer) -> std::shared_ptr<AttentionLayer> {
      return std::make_shared<EntmaxAttention>(model, layer);
    };
    return m;
  }();
  return m;
}

}  // namespace winnow::nn
