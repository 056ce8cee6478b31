#include "winnow/screening.h"

#include <cmath>
#include <string>
#include <utility>

#include "api/attention_call.h"
#include "cpu/cpu.h"
#include "cuda/cuda.h"
#include "reference/reference.h"

namespace winnow::screening {

using detail::AttentionCall;
using detail::Route;

namespace {

struct Checked {
  detail::AttentionParams params;
  detail::ScreeningConfig config;
};

Checked checked(const AttentionCall& call, const Scalars& scalars, const Options& options) {
  call.check_option("mipe_threshold", std::isfinite(options.mipe_threshold) && options.mipe_threshold > 0,
                    "a finite number > 0 (001: 256)", std::to_string(options.mipe_threshold));
  call.check_option("expand_windows_above",
                    std::isfinite(options.expand_windows_above) && options.expand_windows_above >= 0,
                    "a finite number >= 0 (0: no window expansion)",
                    std::to_string(options.expand_windows_above));
  call.check_option("norm_eps", std::isfinite(options.norm_eps) && options.norm_eps > 0,
                    "a finite number > 0", std::to_string(options.norm_eps));
  // The Softmask includes the query's own position, and the scores are cosines: no scale.
  Checked c{call.params(1.0, /*attend_current=*/true), {}};
  c.config.mipe_threshold = options.mipe_threshold;
  c.config.expand_above = options.expand_windows_above;
  c.config.norm_eps = options.norm_eps;
  c.config.s_w = call.per_head("s_w", scalars.s_w);
  c.config.s_r = call.per_head("s_r", scalars.s_r);
  // MiPE rotates coordinates 0 and 1.
  if (c.params.dim_qk < 2) {
    call.fail("q", "head dimension >= 2 (MiPE rotates coordinates 0 and 1)",
              std::to_string(c.params.dim_qk));
  }
  if (call.route() == Route::cuda) {
    for (const auto& [name, dim] : {std::pair<const char*, std::int64_t>{"q", c.params.dim_qk}, {"v", c.params.dim_v}}) {
      if (dim > detail::kMaxScreeningCudaDim) {
        call.fail(name, "head dimension <= " + std::to_string(detail::kMaxScreeningCudaDim) + " on CUDA",
                  std::to_string(dim));
      }
    }
  }
  return c;
}

}  // namespace

void forward(const AttentionInputs& in, const Scalars& scalars, const Options& options,
             const Outputs& outputs, const ExecContext& ctx) {
  AttentionCall call("winnow::screening::forward", in, ctx);
  Checked c = checked(call, scalars, options);
  c.params.out = call.like_q("out", outputs.out, /*value_dim=*/true);
  c.params.stats = call.row_stats("h_norm", outputs.h_norm);
  call.require_writable("out", outputs.out);
  call.require_writable("h_norm", outputs.h_norm);
  switch (call.route()) {
    case Route::reference: return reference::screening_forward(c.params, c.config);
    case Route::cpu: return cpu::screening_forward(c.params, c.config);
    case Route::cuda: return cuda::screening_forward(c.params, c.config);
  }
}

void backward(const AttentionInputs& in, const Scalars& scalars, const Options& options,
              const Outputs& saved, const TensorView& dout, const AttentionGrads& grads,
              const ScalarGrads& scalar_grads, const ExecContext& ctx) {
  AttentionCall call("winnow::screening::backward", in, ctx);
  Checked c = checked(call, scalars, options);
  c.params.out = call.like_q("out", saved.out, /*value_dim=*/true);
  c.params.stats = call.row_stats("h_norm", saved.h_norm);
  const detail::GradientParams g = call.gradients(dout, grads);
  c.config.ds_w = call.per_head_grad("ds_w", scalar_grads.ds_w, "s_w", scalars.s_w);
  c.config.ds_r = call.per_head_grad("ds_r", scalar_grads.ds_r, "s_r", scalars.s_r);
  switch (call.route()) {
    case Route::reference: return reference::screening_backward(c.params, g, c.config);
    case Route::cpu: return cpu::screening_backward(c.params, g, c.config);
    case Route::cuda: return cuda::screening_backward(c.params, g, c.config);
  }
}

}  // namespace winnow::screening
