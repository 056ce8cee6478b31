#include "winnow/softmax.h"

#include <string>
#include <utility>

#include "winnow/rotary.h"

#include "api/attention_call.h"
#include "api/view_checks.h"
#include "cpu/cpu.h"
#include "cuda/cuda.h"
#include "reference/reference.h"

namespace winnow::softmax {

using detail::AttentionCall;
using detail::Route;

namespace {

detail::AttentionParams checked(const AttentionCall& call, const Options& options,
                                const Outputs& outputs) {
  detail::AttentionParams p = call.params(options.scale, options.attend_current);
  p.out = call.like_q("out", outputs.out, /*value_dim=*/true);
  p.stats = call.row_stats("lse", outputs.lse);
  return p;
}

// The backward's RoPE tables (Options::rotary_cos / rotary_sin): both or neither, for batched
// inputs, (Lk, D/2) of the tables' dtype on q's device, with the same strides (as
// rotary::apply, which runs after the kernels off Hopper, asks: checked here, before any work).
// Whether there are any.
bool checked_rotary(const AttentionCall& call, const AttentionInputs& in, const Options& options) {
  const bool has_cos = options.rotary_cos.has_value(), has_sin = options.rotary_sin.has_value();
  if (has_cos != has_sin) {
    call.fail(has_cos ? "rotary_sin" : "rotary_cos", "a table, as the other one is given", "none");
  }
  if (!has_cos) return false;
  if (in.cu_seqlens_q.has_value() || in.cu_seqlens_k.has_value()) {
    call.fail("rotary_cos", "no tables with packed sequences (cu_seqlens): positions restart in each",
              "a table");
  }
  const DType table_dtype = in.q.dtype == DType::float64 ? DType::float64 : DType::float32;
  const std::int64_t half = in.q.shape[3] / 2, keys = in.k.shape[1];
  for (const auto& [name, t] : {std::pair<const char*, const TensorView&>{"rotary_cos", *options.rotary_cos},
                                std::pair<const char*, const TensorView&>{"rotary_sin", *options.rotary_sin}}) {
    if (t.ndim != 2 || t.shape[0] != keys || t.shape[1] != half || in.q.shape[3] % 2 != 0 || t.dtype != table_dtype ||
        !(t.device == in.q.device) || t.data == nullptr) {
      call.fail(name,
                std::string(to_string(table_dtype)) + " (" + std::to_string(keys) + ", " + std::to_string(half) +
                    ") on q's device (Lk, D/2)",
                api::describe(t));
    }
    if (t.stride[0] != options.rotary_cos->stride[0] || t.stride[1] != options.rotary_cos->stride[1]) {
      call.fail(name, "the strides of 'rotary_cos'", "other strides");
    }
  }
  return true;
}

}  // namespace

void forward(const AttentionInputs& in, const Options& options, const Outputs& outputs,
             const ExecContext& ctx) {
  AttentionCall call("winnow::softmax::forward", in, ctx);
  const detail::AttentionParams p = checked(call, options, outputs);
  call.require_writable("out", outputs.out);
  call.require_writable("lse", outputs.lse);
  switch (call.route()) {
    case Route::reference: return reference::softmax_forward(p);
    case Route::cpu: return cpu::softmax_forward(p);
    case Route::cuda: return cuda::softmax_forward(p);
  }
}

void backward(const AttentionInputs& in, const Options& options, const Outputs& saved,
              const TensorView& dout, const AttentionGrads& grads, const ExecContext& ctx) {
  AttentionCall call("winnow::softmax::backward", in, ctx);
  const detail::AttentionParams p = checked(call, options, saved);
  detail::GradientParams g = call.gradients(dout, grads);
  const bool rotated = checked_rotary(call, in, options);
  // The kernels read both tables at cos's row stride (checked_rotary: sin's strides are cos's).
  if (rotated && call.route() == Route::cuda && options.rotary_cos->dtype == DType::float32 &&
      options.rotary_cos->stride[1] == 1 && cuda::softmax_backward_rotates(p, g)) {
    g.rotary_cos = static_cast<const float*>(options.rotary_cos->data);
    g.rotary_sin = static_cast<const float*>(options.rotary_sin->data);
    g.rotary_row = options.rotary_cos->stride[0];
    return cuda::softmax_backward(p, g);
  }
  switch (call.route()) {
    case Route::reference: reference::softmax_backward(p, g); break;
    case Route::cpu: cpu::softmax_backward(p, g); break;
    case Route::cuda: cuda::softmax_backward(p, g); break;
  }
  if (rotated) {
    // The queries are the last Lq positions: their table rows are the last Lq.
    const std::int64_t skip = in.k.shape[1] - in.q.shape[1];
    auto last_rows = [&](TensorView t) {
      t.data = static_cast<char*>(t.data) + skip * t.stride[0] * static_cast<std::int64_t>(element_size(t.dtype));
      t.shape[0] -= skip;
      return t;
    };
    rotary::apply(grads.dq, last_rows(*options.rotary_cos), last_rows(*options.rotary_sin), /*transpose=*/true,
                  grads.dq, ctx);
    rotary::apply(grads.dk, *options.rotary_cos, *options.rotary_sin, /*transpose=*/true, grads.dk, ctx);
  }
}

}  // namespace winnow::softmax
