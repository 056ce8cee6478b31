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
  if (outputs.support) {
    const detail::AttentionParams& p = c.params;
    const std::int64_t size = support_record_size(p.rows_q * p.heads_q, p.rows_k * p.heads_kv);
    c.config.support = static_cast<std::int32_t*>(call.flat("support", *outputs.support, DType::int32, size));
  }
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
    case Route::reference: reference::entmax_forward(c.params, c.config); break;
    case Route::cpu: cpu::entmax_forward(c.params, c.config); break;
    case Route::cuda: return cuda::entmax_forward(c.params, c.config);  // writes the record's [0]
  }
  // Host memory: the CPU paths list no supports.
  if (c.config.support != nullptr) c.config.support[0] = 0;
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
