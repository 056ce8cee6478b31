// Stick-breaking attention (seed 002; spec/stick-breaking.md) with the options of 002's
// appendix C, remainder bias and head-wise norm (the layer itself: nn/stick_breaking_layer.h).
// No positional encoding by default: the stick-breaking process is order-aware by itself (002
// section 3); RoPE is an option.
#include <utility>

#include "nn/composed.h"
#include "nn/stick_breaking_layer.h"
#include "winnow/torch/ops.h"

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

  std::pair<torch::Tensor, torch::Tensor> attend(const torch::Tensor& q, const torch::Tensor& k,
                                                 const torch::Tensor& v, double scale,
                                                 bool kernel) const {
    if (!kernel) return composed::stick_breaking_attention(q, k, v, scale, attend_current);
    torch_ops::AttentionCall call;
    call.scale = scale;
    call.attend_current = attend_current;
    auto [out, rem] = torch_ops::stick_breaking_attention(q, k, v, call, halt_cutoff);
    return {out, rem};
  }
  std::pair<torch::Tensor, torch::Tensor> weights(const torch::Tensor& q, const torch::Tensor& k,
                                                  double scale) const {
    return composed::stick_breaking_weights(q, k, scale, attend_current);
  }
};

}  // namespace

const Mechanism& stick_breaking_mechanism() {
  static const Mechanism m = [] {
    Mechanism m;
    m.name = "stick_breaking";
    m.summary = "stick-breaking attention (keys i < j by default), remainder bias, head-wise "
                "GroupNorm, early halting; NoPE | RoPE";
    m.fused_operator = "winnow::stick_breaking_attention";
    m.graph_blocker = no_graph_blocker;
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
      return std::make_shared<StickBreakingLayer<StickBreakingOptions>>(model, layer);
    };
    return m;
  }();
  return m;
}

}  // namespace winnow::nn
