#include "winnow/softmax.h"

#include "api/attention_call.h"
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
  const detail::GradientParams g = call.gradients(dout, grads);
  switch (call.route()) {
    case Route::reference: return reference::softmax_backward(p, g);
    case Route::cpu: return cpu::softmax_backward(p, g);
    case Route::cuda: return cuda::softmax_backward(p, g);
  }
}

}  // namespace winnow::softmax
