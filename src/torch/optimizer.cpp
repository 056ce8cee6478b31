// The clipped AdamW step (winnow/adamw.h) on LibTorch tensors.
#include <ATen/ATen.h>

#include "winnow/torch/ops.h"

namespace winnow::torch_ops {

at::Tensor clipped_adamw_step(const std::vector<AdamWGroup>& groups, double beta1, double beta2, double eps,
                              double max_norm, const std::vector<at::Tensor>& guards) {
  constexpr const char* op = "winnow::clipped_adamw_step";
  return translate_errors([&] {
    at::Tensor anchor;  // the device the step runs on: its first parameter's, else the first lr's
    for (const AdamWGroup& g : groups) {
      if (!anchor.defined() && !g.params.empty()) anchor = g.params.front();
    }
    if (!anchor.defined() && !groups.empty()) anchor = groups.front().lr;
    if (!anchor.defined()) anchor = at::zeros({});
    at::Tensor norm = at::empty({}, anchor.options().dtype(at::kFloat));
    // Contiguous tensors travel flat (the update is element-wise, and any rank fits a view);
    // the API names any other as not contiguous.
    const auto views = [&](const std::vector<at::Tensor>& list, const char* name) {
      std::vector<TensorView> out;
      for (const at::Tensor& t : list) {
        out.push_back(view_of(t.defined() && t.is_contiguous() ? t.view({-1}) : t, op, name));
      }
      return out;
    };
    std::vector<adamw::Group> view_groups;
    for (const AdamWGroup& g : groups) {
      adamw::Group v;
      v.lr = view_of(g.lr, op, "lr");
      v.weight_decay = g.weight_decay;
      v.params = views(g.params, "params");
      v.grads = views(g.grads, "grads");
      v.exp_avgs = views(g.exp_avgs, "exp_avgs");
      v.exp_avg_sqs = views(g.exp_avg_sqs, "exp_avg_sqs");
      v.steps = views(g.steps, "steps");
      view_groups.push_back(std::move(v));
    }
    adamw::Options options;
    options.beta1 = beta1;
    options.beta2 = beta2;
    options.eps = eps;
    options.max_norm = max_norm;
    DeviceScope scope(anchor);
    adamw::clipped_step(view_groups, options, views(guards, "guards"), view_of(norm, op, "norm"),
                        scope.context(false, false));
    return norm;
  });
}

}  // namespace winnow::torch_ops
