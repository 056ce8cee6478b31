#include "winnow/entmax.h"

#include <cmath>

#include "api/attention_call.h"
#include "cpu/cpu.h"
#include "cuda/cuda.h"
#include "reference/reference.h"

namespace winnow::entmax {

using detail::AttentionCall;
using detail::Route;

namespace {

struct Checked {
  detail::AttentionParams params;
  detail::EntmaxConfig config;
};

Checked checked(const AttentionCall& call, const Options& options, const Outputs& outputs) {
  call.check_option("alpha", std::isfinite(options.alpha) && options.alpha > 1.0,
                    "a finite number > 1 (2: sparsemax, 1.5: the seeds' default)",
                    std::to_string(options.alpha));
  Checked c{call.params(options.scale, options.attend_current), {}};
  c.params.out = call.like_q("out", outputs.out, /*value_dim=*/true);
  c.params.stats = call.row_stats("tau", outputs.tau);
  c.config.alpha = options.alpha;
  c.config.tolerance = detail::resolve_tolerance(call, options.tolerance);
  return c;
}

}  // namespace

void forward(const AttentionInputs& in, const Options& options, const Outputs& outputs,
             const ExecContext& ctx) {
  AttentionCall call("winnow::entmax::forward", in, ctx);
  const Checked c = checked(call, options, outputs);
  call.require_writable("out", outputs.out);
  call.require_writable("tau", outputs.tau);
  switch (call.route()) {
    case Route::reference: return reference::entmax_forward(c.params, c.config);
    case Route::cpu: return cpu::entmax_forward(c.params, c.config);
    case Route::cuda: return cuda::entmax_forward(c.params, c.config);
  }
}

void backward(const AttentionInputs& in, const Options& options, const Outputs& saved,
              const TensorView& dout, const AttentionGrads& grads, const ExecContext& ctx) {
  AttentionCall call("winnow::entmax::backward", in, ctx);
  const Checked c = checked(call, options, saved);
  const detail::GradientParams g = call.gradients(dout, grads);
  switch (call.route()) {
    case Route::reference: return reference::entmax_backward(c.params, g, c.config);
    case Route::cpu: return cpu::entmax_backward(c.params, g, c.config);
    case Route::cuda: return cuda::entmax_backward(c.params, g, c.config);
  }
}

}  // namespace winnow::entmax
