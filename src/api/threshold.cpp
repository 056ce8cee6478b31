#include "winnow/threshold.h"

#include <cmath>
#include <string>

#include "api/attention_call.h"
#include "api/view_checks.h"
#include "cpu/cpu.h"
#include "cuda/cuda.h"
#include "reference/reference.h"

namespace winnow::threshold {

using detail::AttentionCall;
using detail::Operand;
using detail::Route;

namespace {

struct Checked {
  detail::AttentionParams params;
  detail::ThresholdConfig config;
};

Checked checked(const AttentionCall& call, const Views& views,
                const Options& options) {
  call.check_option("power", std::isfinite(options.power) && options.power > 0,
                    "a finite number > 0 (2: 004's default, 1: ReLA)",
                    std::to_string(options.power));
  call.check_option("norm_eps", std::isfinite(options.norm_eps) && options.norm_eps > 0,
                    "a finite number > 0", std::to_string(options.norm_eps));
  Checked c{call.params(1.0, options.attend_current), {}};
  c.config.power = options.power;
  c.config.norm_eps = options.norm_eps;
  c.config.clamp_lambda = options.clamp_lambda;
  c.config.beta = call.per_head("beta", views.beta);
  const bool tda = views.lambda.has_value();
  if (!tda && (views.q2 || views.k2)) {
    call.fail(views.q2 ? "q2" : "k2", "no second view without lambda (TRA)", "a tensor");
  }
  if (tda) {
    if (!views.q2 || !views.k2) {
      call.fail(!views.q2 ? "q2" : "k2", "TDA's second view, shaped like " +
                                            std::string(!views.q2 ? "q" : "k"),
                "none");
    }
    c.config.lambda = call.per_head("lambda", *views.lambda);
    c.config.q2 = call.like_q("q2", *views.q2, /*value_dim=*/false);
    c.config.k2 = call.like_k("k2", *views.k2, /*value_dim=*/false);
  }
  return c;
}

// The saved rows' record, checked against the call's shapes; only the CUDA route keeps them.
void* saved_rows_record(const AttentionCall& call, const detail::AttentionParams& p, bool tda,
                        const TensorView& t) {
  if (call.route() != Route::cuda) {
    call.fail("saved_rows", "none: only the CUDA route keeps the normalized rows",
              "a record on the " + std::string(call.route() == Route::reference ? "reference" : "CPU") + " route");
  }
  const std::int64_t size = saved_rows_size<std::int64_t>(
      p.rows_q * p.heads_q, p.rows_k * p.heads_kv, p.dim_qk, static_cast<std::int64_t>(element_size(p.dtype)),
      tda ? 2 : 1, saved_support_words<std::int64_t>(p.num_seqs, p.heads_q, p.rows_q, p.key_len_bound()));
  return call.flat("saved_rows", t, DType::int32, size);
}

}  // namespace

void forward(const AttentionInputs& in, const Views& views, const Options& options,
             const Outputs& outputs, const ExecContext& ctx) {
  AttentionCall call("winnow::threshold::forward", in, ctx);
  Checked c = checked(call, views, options);
  c.params.out = call.like_q("out", outputs.out, /*value_dim=*/true);
  call.require_writable("out", outputs.out);
  if (outputs.nonzero) {
    c.config.nonzero = call.row_stats("nonzero", *outputs.nonzero, DType::int32);
    call.require_writable("nonzero", *outputs.nonzero);
  }
  if (outputs.saved_rows) {
    c.config.saved_rows = saved_rows_record(call, c.params, c.config.differential(), *outputs.saved_rows);
  }
  switch (call.route()) {
    case Route::reference: return reference::threshold_forward(c.params, c.config);
    case Route::cpu: return cpu::threshold_forward(c.params, c.config);
    case Route::cuda: return cuda::threshold_forward(c.params, c.config);
  }
}

void backward(const AttentionInputs& in, const Views& views, const Options& options,
              const TensorView& dout, const AttentionGrads& grads, const ViewGrads& view_grads,
              const ExecContext& ctx, const std::optional<TensorView>& saved_rows) {
  AttentionCall call("winnow::threshold::backward", in, ctx);
  Checked c = checked(call, views, options);
  const detail::GradientParams g = call.gradients(dout, grads);
  c.config.dbeta = call.per_head_grad("dbeta", view_grads.dbeta, "beta", views.beta);
  if (c.config.differential()) {
    const char* missing = !view_grads.dlambda ? "dlambda" : !view_grads.dq2 ? "dq2" : !view_grads.dk2 ? "dk2" : nullptr;
    if (missing != nullptr) call.fail(missing, "a gradient tensor (TDA)", "none");
    c.config.dlambda = call.per_head_grad("dlambda", *view_grads.dlambda, "lambda", *views.lambda);
    c.config.dq2 = call.like_q("dq2", *view_grads.dq2, /*value_dim=*/false);
    c.config.dk2 = call.like_k("dk2", *view_grads.dk2, /*value_dim=*/false);
    call.require_writable("dq2", *view_grads.dq2);
    call.require_writable("dk2", *view_grads.dk2);
  } else if (view_grads.dlambda || view_grads.dq2 || view_grads.dk2) {
    call.fail(view_grads.dlambda ? "dlambda" : view_grads.dq2 ? "dq2" : "dk2",
              "no gradient of a second view without lambda (TRA)", "a tensor");
  }
  if (saved_rows) c.config.saved_rows = saved_rows_record(call, c.params, c.config.differential(), *saved_rows);
  switch (call.route()) {
    case Route::reference: return reference::threshold_backward(c.params, g, c.config);
    case Route::cpu: return cpu::threshold_backward(c.params, g, c.config);
    case Route::cuda: return cuda::threshold_backward(c.params, g, c.config);
  }
}

}  // namespace winnow::threshold
