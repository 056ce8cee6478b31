#include "winnow/sieve.h"

#include <cmath>

#include "api/attention_call.h"
#include "cpu/cpu.h"
#include "cuda/cuda.h"
#include "reference/reference.h"

namespace winnow::sieve {

using detail::AttentionCall;
using detail::Route;

namespace {

struct Checked {
  detail::AttentionParams params;
  detail::SieveConfig config;
};

Checked checked(const AttentionCall& call, const Options& options, const Outputs& outputs) {
  call.check_option("alpha", std::isfinite(options.alpha) && options.alpha > 1.0,
                    "a finite number > 1 (1.5: 000's default)", std::to_string(options.alpha));
  if (options.eps) {
    call.check_option("eps", options.filter == Filter::bound,
                      "absent unless filter is bound", "eps with the exact filter");
    call.check_option("eps", std::isfinite(*options.eps) && *options.eps >= 0,
                      "a finite number >= 0", std::to_string(*options.eps));
  }
  Checked c{call.params(options.scale, options.attend_current), {}};
  c.params.out = call.like_q("out", outputs.out, /*value_dim=*/true);
  c.params.stats = call.row_stats("log_rem", outputs.log_rem);
  c.config.alpha = options.alpha;
  c.config.bound = options.filter == Filter::bound;
  c.config.eps = options.eps ? *options.eps : 1.0 / (options.alpha - 1.0);
  c.config.tolerance = detail::resolve_tolerance(call, options.tolerance);
  c.config.threshold = call.row_stats("threshold", outputs.threshold);
  if (outputs.count) c.config.count = call.row_stats("count", *outputs.count, DType::int32);
  return c;
}

}  // namespace

void forward(const AttentionInputs& in, const Options& options, const Outputs& outputs,
             const ExecContext& ctx) {
  AttentionCall call("winnow::sieve::forward", in, ctx);
  const Checked c = checked(call, options, outputs);
  call.require_writable("out", outputs.out);
  call.require_writable("log_rem", outputs.log_rem);
  call.require_writable("threshold", outputs.threshold);
  if (outputs.count) call.require_writable("count", *outputs.count);
  switch (call.route()) {
    case Route::reference: return reference::sieve_forward(c.params, c.config);
    case Route::cpu: return cpu::sieve_forward(c.params, c.config);
    case Route::cuda: return cuda::sieve_forward(c.params, c.config);
  }
}

void backward(const AttentionInputs& in, const Options& options, const Outputs& saved,
              const TensorView& dout, const std::optional<TensorView>& dlog_rem,
              const AttentionGrads& grads, const ExecContext& ctx) {
  AttentionCall call("winnow::sieve::backward", in, ctx);
  const Checked c = checked(call, options, saved);
  const detail::GradientParams g = call.gradients(dout, grads, dlog_rem);
  switch (call.route()) {
    case Route::reference: return reference::sieve_backward(c.params, g, c.config);
    case Route::cpu: return cpu::sieve_backward(c.params, g, c.config);
    case Route::cuda: return cuda::sieve_backward(c.params, g, c.config);
  }
}

}  // namespace winnow::sieve
