#include "winnow/softmax.h"

#include "api/attention_call.h"
#include "cpu/cpu.h"
#include "reference/reference.h"

namespace winnow::softmax {

using detail::AttentionCall;
using detail::Route;

void forward(const AttentionInputs& in, const Options& options, const TensorView& out,
             const TensorView& lse, const ExecContext& ctx) {
  AttentionCall call("winnow::softmax::forward", in, ctx);
  detail::AttentionParams p = call.params(options.scale, options.attend_current);
  p.out = call.like_q("out", out, /*value_dim=*/true);
  p.stats = call.row_stats("lse", lse);
  call.require_writable("out", out);
  call.require_writable("lse", lse);
  switch (call.route()) {
    case Route::reference: return reference::softmax_forward(p);
    case Route::cpu: return cpu::softmax_forward(p);
    case Route::cuda:
      call.fail("q", "a CPU tensor (the CUDA softmax kernel is not built yet)", "a CUDA tensor",
                ErrorKind::unsupported);
  }
}

void backward(const AttentionInputs& in, const Options& options, const TensorView& out,
              const TensorView& lse, const TensorView& dout, const AttentionGrads& grads,
              const ExecContext& ctx) {
  AttentionCall call("winnow::softmax::backward", in, ctx);
  detail::AttentionParams p = call.params(options.scale, options.attend_current);
  p.out = call.like_q("out", out, true);
  p.stats = call.row_stats("lse", lse);
  detail::GradientParams g;
  g.dout = call.like_q("dout", dout, true);
  g.dq = call.like_q("dq", grads.dq, false);
  g.dk = call.like_k("dk", grads.dk, false);
  g.dv = call.like_k("dv", grads.dv, true);
  call.require_writable("dq", grads.dq);
  call.require_writable("dk", grads.dk);
  call.require_writable("dv", grads.dv);
  switch (call.route()) {
    case Route::reference: return reference::softmax_backward(p, g);
    case Route::cpu: return cpu::softmax_backward(p, g);
    case Route::cuda:
      call.fail("q", "a CPU tensor (the CUDA softmax kernel is not built yet)", "a CUDA tensor",
                ErrorKind::unsupported);
  }
}

}  // namespace winnow::softmax
