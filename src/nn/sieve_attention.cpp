// Sieve attention (seed 000; spec/sieve.md): an alpha-entmax filter picks each query's
// candidate keys, then stick-breaking allocates the query's mass over the candidates alone, so a
// recent key below the threshold takes no stick. Like stick-breaking it needs no positional
// encoding (000 uses none), and it takes stick-breaking's remainder bias and head-wise norm
// (002 appendix C), the remainder being the stick left over the candidates.
#include <cmath>
#include <optional>

#include "nn/attention.h"
#include "nn/composed.h"
#include "torch/ops.h"

namespace winnow::nn {
namespace {

struct SieveOptions {
  // The filter's alpha: the exact filter keeps the alpha-entmax support, the bound filter's
  // default margin is 1 / (alpha - 1). 000's best is 1.5.
  double alpha = 1.5;
  // exact: the entmax support (a threshold search); bound: keys with z > rowmax - eps, a
  // superset of the support at the default eps (000's Algorithm 1).
  std::string filter = "exact";
  // The bound filter's margin; null: 1 / (alpha - 1). A number or null, so kept as JSON.
  nlohmann::json eps = nullptr;
  // 000 sums over keys i < j, like stick-breaking; true lets query j see key j too.
  bool attend_current = false;
  bool remainder_bias = false;
  bool head_norm = false;

  template <class V>
  void fields(V& v) {
    v("alpha", alpha, config::greater_than(1));
    v("filter", filter, config::one_of({"exact", "bound"}));
    v("eps", eps);
    v("attend_current", attend_current);
    v("remainder_bias", remainder_bias);
    v("head_norm", head_norm);
  }

  std::optional<double> margin() const {
    return eps.is_null() ? std::nullopt : std::optional<double>(eps.get<double>());
  }
};

nlohmann::json resolve_sieve_options(const nlohmann::json& given, const std::string& path) {
  const SieveOptions o = config::read<SieveOptions>(given, path);
  if (!o.eps.is_null() && !(o.eps.is_number() && o.eps.get<double>() > 0)) {
    config::fail(path + ".eps", "a number > 0, or null for 1 / (alpha - 1)", o.eps.dump());
  }
  return config::write(o);
}

class SieveAttention final : public AttentionLayer {
 public:
  SieveAttention(const ModelConfig& model, std::int64_t /*layer_index*/)
      : options_(options_of<SieveOptions>(model.attention)),
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
    // r_h starts at zero: the layer starts as plain Sieve.
    if (options_.remainder_bias) {
      remainder_bias_ =
          register_parameter("remainder_bias", torch::zeros({h_.heads, h_.value_dim}));
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
    const std::optional<double> eps = options_.margin();
    torch::Tensor o, rem;
    if (kernel_) {
      torch_ops::AttentionCall call;
      call.scale = h_.scale;
      call.attend_current = options_.attend_current;
      torch_ops::Opt<double> margin;
      if (eps) margin = *eps;
      std::tie(o, rem, std::ignore) =
          torch_ops::sieve_attention(qv, kv, in.v, call, options_.alpha, options_.filter, margin);
    } else {
      std::tie(o, rem) = composed::sieve_attention(qv, kv, in.v, h_.scale, options_.attend_current,
                                                   options_.alpha, options_.filter, eps);
    }
    if (probe()) {
      const auto [w, r] =
          composed::sieve_weights(probed_queries(qv), kv, h_.scale, options_.attend_current,
                                  options_.alpha, options_.filter, eps);
      probe()->record(probe_layer(), w, options_.attend_current, {{"remainder", r}});
    }
    if (remainder_bias_.defined()) o = o + rem.unsqueeze(-1) * remainder_bias_;
    if (head_norm_) o = head_norm_(o);
    return o_(o.reshape({B, L, h_.heads * h_.value_dim}));
  }

 private:
  SieveOptions options_;
  HeadLayout h_;
  PositionalEncoding position_;
  bool kernel_;
  torch::nn::Linear q_{nullptr}, k_{nullptr}, v_{nullptr}, o_{nullptr};
  torch::Tensor remainder_bias_;
  HeadNorm head_norm_{nullptr};
};

}  // namespace

const Mechanism& sieve_mechanism() {
  static const Mechanism m = [] {
    Mechanism m;
    m.name = "sieve";
    m.summary =
        "Sieve: stick-breaking over each query's alpha-entmax candidates (filter exact "
        "| bound), remainder bias, head-wise GroupNorm; NoPE";
    m.fused_operator = "winnow::sieve_attention";
    m.positions = {"nope"};
    m.option_keys = option_keys_of<SieveOptions>();
    m.resolve_options = resolve_sieve_options;
    m.check = [](const AttentionConfig& a, const std::string& path) {
      const auto o = options_of<SieveOptions>(a);
      if (o.filter != "bound" && !o.eps.is_null()) {
        config::fail(path + ".eps",
                     "null or absent unless filter is \"bound\" (filter is \"" + o.filter + "\")",
                     o.eps.dump());
      }
    };
    m.make = [](const ModelConfig& model, std::int64_t layer) -> std::shared_ptr<AttentionLayer> {
      return std::make_shared<SieveAttention>(model, layer);
    };
    return m;
  }();
  return m;
}

}  // namespace winnow::nn
