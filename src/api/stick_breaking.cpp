#include "winnow/stick_breaking.h"

#include <cmath>

#include "api/attention_call.h"
#include "cpu/cpu.h"
#include "cuda/cuda.h"
#include "reference/reference.h"

namespace winnow::stick_breaking {

using detail::AttentionCall;
using detail::Route;

namespace {

struct Checked {
  detail::AttentionParams params;
  detail::StickBreakingConfig config;
};

Checked checked(const AttentionCall& call, const Options& options, const Outputs& outputs) {
  call.check_option("halt_cutoff", std::isfinite(options.halt_cutoff) && options.halt_cutoff >= 0,
                    "a finite number >= 0 (0 disables halting)",
                    std::to_string(options.halt_cutoff));
  Checked c{call.params(options.scale, options.attend_current), {}};
  c.params.out = call.like_q("out", outputs.out, /*value_dim=*/true);
  c.params.stats = call.row_stats("log_rem", outputs.log_rem);
  c.config.halt_cutoff = options.halt_cutoff;
  if (outputs.kept_from) {
    c.config.kept_from = call.row_stats("kept_from", *outputs.kept_from, DType::int32);
  }
  return c;
}

}  // namespace

void forward(const AttentionInputs& in, const Options& options, const Outputs& outputs,
             const ExecContext& ctx) {
  AttentionCall call("winnow::stick_breaking::forward", in, ctx);
  const Checked c = checked(call, options, outputs);
  call.require_writable("out", outputs.out);
  call.require_writable("log_rem", outputs.log_rem);
  if (outputs.kept_from) call.require_writable("kept_from", *outputs.kept_from);
  switch (call.route()) {
    case Route::reference: return reference::stick_breaking_forward(c.params, c.config);
    case Route::cpu: return cpu::stick_breaking_forward(c.params, c.config);
    case Route::cuda: return cuda::stick_breaking_forward(c.params, c.config);
  }
}

void backward(const AttentionInputs& in, const Options& options, const Outputs& saved,
              const TensorView& dout, const std::optional<TensorView>& dlog_rem,
              const AttentionGrads& grads, const ExecContext& ctx) {
  AttentionCall call("winnow::stick_breaking::backward", in, ctx);
  const Checked c = checked(call, options, saved);
  if (options.halt_cutoff > 0 && !saved.kept_from && call.route() != Route::reference) {
    call.fail("kept_from", "the forward's kept_from output whenever halt_cutoff > 0",
              "none");
  }
  const detail::GradientParams g = call.gradients(dout, grads, dlog_rem);
  switch (call.route()) {
    case Route::reference: return reference::stick_breaking_backward(c.params, g, c.config);
    case Route::cpu: return cpu::stick_breaking_backward(c.params, g, c.config);
    case Route::cuda: return cuda::stick_breaking_backward(c.params, g, c.config);
  }
}

}  // namespace winnow::stick_breaking
