// Sieve attention (seed 000; spec/sieve.md): an alpha-entmax filter picks each query's
// candidate keys, then stick-breaking allocates the query's mass over the candidates alone, so a
// recent key below the threshold takes no stick. Like stick-breaking it needs no positional
// encoding (000 uses none), and it takes stick-breaking's remainder bias and head-wise norm
// (002 appendix C), the remainder being the stick left over the candidates.
#include <optional>
#include <utility>

#include "nn/composed.h"
#include "nn/stick_breaking_layer.h"
#include "winnow/torch/ops.h"

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

  std::pair<torch::Tensor, torch::Tensor> attend(const torch::Tensor& q, const torch::Tensor& k,
                                                 const torch::Tensor& v, double scale,
                                                 bool kernel) const {
    if (!kernel) {
      return composed::sieve_attention(q, k, v, scale, attend_current, alpha, filter, margin());
    }
    torch_ops::AttentionCall call;
    call.scale = scale;
    call.attend_current = attend_current;
    torch_ops::Opt<double> op_margin;
    if (const auto m = margin()) op_margin = *m;
    auto [out, rem, count] = torch_ops::sieve_attention(q, k, v, call, alpha, filter, op_margin);
    return {out, rem};
  }
  std::pair<torch::Tensor, torch::Tensor> weights(const torch::Tensor& q, const torch::Tensor& k,
                                                  double scale) const {
    return composed::sieve_weights(q, k, scale, attend_current, alpha, filter, margin());
  }
};

nlohmann::json resolve_sieve_options(const nlohmann::json& given, const std::string& path) {
  const SieveOptions o = config::read<SieveOptions>(given, path);
  if (!o.eps.is_null() && !(o.eps.is_number() && o.eps.get<double>() > 0)) {
    config::fail(path + ".eps", "a number > 0, or null for 1 / (alpha - 1)", o.eps.dump());
  }
  return config::write(o);
}

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
    // The bound filter's threshold is the row maximum, from one sweep with no flag to read; the
    // exact filter's search reads whether a row still moves after its collecting sweep
    // (threshold_search.cu) on the CUDA kernels.
    m.graph_blocker = [](const AttentionConfig& a) -> std::string {
      const auto o = options_of<SieveOptions>(a);
      return o.filter == "bound" ? "" : "sieve attention's exact filter reads its threshold search's flag on the host";
    };
    m.check = [](const AttentionConfig& a, const std::string& path) {
      const auto o = options_of<SieveOptions>(a);
      if (o.filter != "bound" && !o.eps.is_null()) {
        config::fail(path + ".eps",
                     "null or absent unless filter is \"bound\" (filter is \"" + o.filter + "\")",
                     o.eps.dump());
      }
    };
    m.make = [](const ModelConfig& model, std::int64_t layer) -> std::shared_ptr<AttentionLayer> {
      return std::make_shared<StickBreakingLayer<SieveOptions>>(model, layer);
    };
    return m;
  }();
  return m;
}

}  // namespace winnow::nn
