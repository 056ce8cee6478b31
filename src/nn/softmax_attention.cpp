// Softmax attention and the small baselines around it (spec/softmax.md): RoPE (with its
// extrapolation scalings), NoPE or ALiBi; scalable softmax (SSMax); QK-norm; the output gate G1
// and the value gate G2 of gated attention.
#include <cmath>
#include <cstdlib>

#include "nn/attention.h"
#include "nn/composed.h"
#include "winnow/torch/ops.h"

namespace winnow::nn {
namespace {

struct SoftmaxOptions {
  // SSMax: logits times s_h log(n_j), n_j the number of keys query j sees, s_h learned.
  bool ssmax = false;
  // g1: the head's output times sigmoid(x_j W_g + b) (D_v gates per head);
  // g2: each value times sigmoid(x_i W_gv + b) (D_v gates per kv head); g1g2: both.
  std::string gate = "none";
  // QK-norm: RMSNorm over each head's query and key vectors (a learned scale of head_dim
  // channels, shared by the heads) before the positions are applied, which bounds the logits
  // by the learned scales instead of the activations' growth.
  bool qk_norm = false;

  template <class V>
  void fields(V& v) {
    v("ssmax", ssmax);
    v("qk_norm", qk_norm);
    v("gate", gate, config::one_of({"none", "g1", "g2", "g1g2"}));
  }
};

class SoftmaxAttention final : public AttentionLayer {
 public:
  SoftmaxAttention(const ModelConfig& model, std::int64_t /*layer_index*/)
      : options_(options_of<SoftmaxOptions>(model.attention)),
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
    if (options_.ssmax) {
      // s_h starts at 1 / log(training context): the logits are unchanged for the last query
      // of a training-length sequence and sharpen beyond it.
      const double n = static_cast<double>(std::max<std::int64_t>(model.context_len, 2));
      ssmax_scale_ = register_parameter("ssmax_scale", torch::full({h_.heads}, 1.0 / std::log(n)));
    }
    if (options_.qk_norm) {
      q_norm_ = register_module("q_norm", RMSNorm(h_.head_dim, model.norm_eps));
      k_norm_ = register_module("k_norm", RMSNorm(h_.head_dim, model.norm_eps));
    }
    if (position_.kind() == "alibi") {
      alibi_ = register_buffer("alibi_slopes", alibi_slopes(h_.heads).to(torch::kFloat32));
    }
    // Gate biases start at 0, so every gate starts at sigmoid(0) = 0.5.
    if (options_.gate == "g1" || options_.gate == "g1g2") {
      output_gate_ = make_linear(*this, "output_gate", d, h_.heads * h_.value_dim, init_std, true);
    }
    if (options_.gate == "g2" || options_.gate == "g1g2") {
      value_gate_ = make_linear(*this, "value_gate", d, h_.kv_heads * h_.value_dim, init_std, true);
    }
  }

  torch::Tensor forward(const torch::Tensor& x, LayerCache* cache) override {
    const std::int64_t B = x.size(0), L = x.size(1);
    const auto qkv = project(x, {q_->weight, k_->weight, v_->weight});
    torch::Tensor q = qkv[0].view({B, L, h_.heads, h_.head_dim});
    torch::Tensor k = qkv[1].view({B, L, h_.kv_heads, h_.head_dim});
    if (q_norm_) {
      q = q_norm_(q);
      k = k_norm_(k);
    }
    torch::Tensor v = qkv[2].view({B, L, h_.kv_heads, h_.value_dim});
    if (value_gate_) v = v * torch::sigmoid(value_gate_(x)).view({B, L, h_.kv_heads, h_.value_dim});
    // RoPE inside the operator where it can (a full pass, nothing between the rotation and the
    // kernels): one launch rotates q and k, and the gradients come back as one buffer.
    // WINNOW_ROPE_OUTSIDE_OPERATOR=1 rotates first instead (for A/B measurements).
    static const bool rope_outside = [] {
      const char* e = std::getenv("WINNOW_ROPE_OUTSIDE_OPERATOR");
      return e != nullptr && std::string(e) == "1";
    }();
    std::optional<std::pair<torch::Tensor, torch::Tensor>> rotary;
    if (kernel_ && !options_.ssmax && !probe() && !rope_outside) rotary = position_.operator_tables(q, k, cache);
    auto in = rotary ? PositionalEncoding::Prepared{q, k, v, 0} : position_.prepare(q, k, v, cache);
    if (options_.ssmax) {
      // Query j (absolute position p) sees n_j = p + 1 keys.
      const torch::Tensor n = torch::arange(in.offset + 1, in.offset + L + 1,
                                            ssmax_scale_.options());
      in.q = in.q * (torch::log(n).view({1, L, 1, 1}) * ssmax_scale_.view({1, 1, -1, 1}));
    }
    // Under autocast the projections return bf16 while the scalings above promote to float32;
    // the operators take q, k and v in one dtype.
    const torch::Tensor qv = in.q.to(in.v.scalar_type()), kv = in.k.to(in.v.scalar_type());
    torch::Tensor o;
    if (kernel_) {
      torch_ops::AttentionCall call;
      call.scale = h_.scale;
      if (rotary) {
        call.rotary_cos = rotary->first;
        call.rotary_sin = rotary->second;
      }
      o = torch_ops::softmax_attention(qv, kv, in.v, call);
    } else {
      o = composed::softmax_attention(qv, kv, in.v, h_.scale, /*attend_current=*/true, alibi());
    }
    if (probe()) {
      probe()->record(probe_layer(),
                      composed::softmax_weights(probed_queries(qv), kv, h_.scale, true, alibi()),
                      /*attend_current=*/true);
    }
    if (output_gate_) o = o * torch::sigmoid(output_gate_(x)).view({B, L, h_.heads, h_.value_dim});
    return project(o.reshape({B, L, h_.heads * h_.value_dim}), {o_->weight})[0];
  }

 private:
  std::optional<torch::Tensor> alibi() const {
    return alibi_.defined() ? std::optional<torch::Tensor>(alibi_) : std::nullopt;
  }

  SoftmaxOptions options_;
  HeadLayout h_;
  PositionalEncoding position_;
  bool kernel_;
  torch::nn::Linear q_{nullptr}, k_{nullptr}, v_{nullptr}, o_{nullptr};
  torch::nn::Linear output_gate_{nullptr}, value_gate_{nullptr};
  RMSNorm q_norm_{nullptr}, k_norm_{nullptr};
  torch::Tensor ssmax_scale_, alibi_;
};

}  // namespace

const Mechanism& softmax_mechanism() {
  static const Mechanism m = [] {
    Mechanism m;
    m.name = "softmax";
    m.summary = "softmax attention; RoPE (linear, ntk, dynamic, yarn) | NoPE | ALiBi, SSMax, "
                "QK-norm, output gate G1, value gate G2";
    m.fused_operator = "winnow::softmax_attention";
    m.graph_blocker = no_graph_blocker;
    m.positions = {"rope", "nope", "alibi"};
    m.option_keys = option_keys_of<SoftmaxOptions>();
    m.resolve_options = resolve_options_as<SoftmaxOptions>;
    m.kernel_gap = [](const AttentionConfig& a) -> std::string {
      if (a.position == "alibi") {
        return "the softmax operator takes no ALiBi bias yet; ALiBi runs as a composed expression";
      }
      return "";
    };
    m.make = [](const ModelConfig& model, std::int64_t layer) -> std::shared_ptr<AttentionLayer> {
      return std::make_shared<SoftmaxAttention>(model, layer);
    };
    return m;
  }();
  return m;
}

}  // namespace winnow::nn
