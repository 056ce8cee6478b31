#include "winnow/stick_breaking.h"

#include <cmath>

#include "api/attention_call.h"
#include "cpu/cpu.h"
#include "reference/reference.h"

namespace winnow::stick_breaking {

using detail::AttentionCall;
using detail::Route;

namespace {

detail::StickBreakingConfig config(const AttentionCall& call, const Options& options) {
  call.check_option("halt_cutoff", std::isfinite(options.halt_cutoff) && options.halt_cutoff >= 0,
                    "a finite number >= 0 (0 disables halting)",
                    std::to_string(options.halt_cutoff));
  detail::StickBreakingConfig cfg;
  cfg.halt_cutoff = options.halt_cutoff;
  return cfg;
}

}  // namespace

void forward(const AttentionInputs& in, const Options& options, const TensorView& out,
             const TensorView& log_rem, const ExecContext& ctx) {
  AttentionCall call("winnow::stick_breaking::forward", in, ctx);
  detail::AttentionParams p = call.params(options.scale, options.attend_current);
  const detail::StickBreakingConfig cfg = config(call, options);
  p.out = call.like_q("out", out, /*value_dim=*/true);
  p.stats = call.row_stats("log_rem", log_rem);
  call.require_writable("out", out);
  call.require_writable("log_rem", log_rem);
  switch (call.route()) {
    case Route::reference: return reference::stick_breaking_forward(p, cfg);
    case Route::cpu: return cpu::stick_breaking_forward(p, cfg);
    case Route::cuda:
      call.fail("q", "a CPU tensor (the CUDA stick-breaking kernel is not built yet)",
                "a CUDA tensor", ErrorKind::unsupported);
  }
}

void backward(const AttentionInputs& in, const Options& options, const TensorView& out,
              const TensorView& log_rem, const TensorView& dout,
              const std::optional<TensorView>& dlog_rem, const AttentionGrads& grads,
              const ExecContext& ctx) {
  AttentionCall call("winnow::stick_breaking::backward", in, ctx);
  detail::AttentionParams p = call.params(options.scale, options.attend_current);
  const detail::StickBreakingConfig cfg = config(call, options);
  p.out = call.like_q("out", out, true);
  p.stats = call.row_stats("log_rem", log_rem);
  detail::GradientParams g;
  g.dout = call.like_q("dout", dout, true);
  if (dlog_rem) g.dstats = call.row_stats("dlog_rem", *dlog_rem);
  g.dq = call.like_q("dq", grads.dq, false);
  g.dk = call.like_k("dk", grads.dk, false);
  g.dv = call.like_k("dv", grads.dv, true);
  call.require_writable("dq", grads.dq);
  call.require_writable("dk", grads.dk);
  call.require_writable("dv", grads.dv);
  switch (call.route()) {
    case Route::reference: return reference::stick_breaking_backward(p, g, cfg);
    case Route::cpu: return cpu::stick_breaking_backward(p, g, cfg);
    case Route::cuda:
      call.fail("q", "a CPU tensor (the CUDA stick-breaking kernel is not built yet)",
                "a CUDA tensor", ErrorKind::unsupported);
  }
}

}  // namespace winnow::stick_breaking
