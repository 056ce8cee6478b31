// The masked cross-entropy (winnow/cross_entropy.h) on LibTorch tensors, with autograd: the
// trainer's loss in three kernels (two forward, one backward) instead of a dozen.
#include <ATen/ATen.h>
#include <torch/autograd.h>

#include "winnow/torch/ops.h"

namespace winnow::torch_ops {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

at::ScalarType stats_of(const at::Tensor& logits) {
  return logits.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
}

struct MaskedCrossEntropyFunction : public torch::autograd::Function<MaskedCrossEntropyFunction> {
  // An optional, not an undefined tensor: LibTorch 2's Function::apply rejects undefined inputs.
  static variable_list forward(AutogradContext* ctx, const at::Tensor& logits, const at::Tensor& targets,
                               const at::Tensor& mask, const c10::optional<at::Tensor>& divisor_arg) {
    const at::Tensor divisor = divisor_arg.has_value() ? *divisor_arg : at::Tensor();
    constexpr const char* op = "winnow::masked_cross_entropy_sum";
    return translate_errors([&]() -> variable_list {
      const auto stats = logits.options().dtype(stats_of(logits));
      at::Tensor loss = at::empty({}, stats);
      at::Tensor lse = at::empty({logits.size(0)}, stats);
      DeviceScope scope(logits);
      cross_entropy::masked_sum_forward(view_of(logits, op, "logits"), view_of(targets, op, "targets"),
                                        view_of(mask, op, "mask"), view_of(loss, op, "loss"),
                                        view_of(lse, op, "lse"), view_of(divisor_arg, op, "divisor"),
                                        scope.context(false, false));
      // The loss itself only for the divisor's gradient: callers may then change it in place.
      const bool divisor_grad = divisor.defined() && divisor.requires_grad();
      ctx->save_for_backward({logits, targets, mask, lse, divisor, divisor_grad ? loss : at::Tensor()});
      return {loss};
    });
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    constexpr const char* op = "winnow::masked_cross_entropy_sum_backward";
    const auto saved = ctx->get_saved_variables();
    const at::Tensor& divisor = saved[4];
    if (!grads[0].defined()) return {at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
    return translate_errors([&]() -> variable_list {
      const at::Tensor dloss = grads[0].to(stats_of(saved[0])).contiguous();
      at::Tensor dlogits;
      if (ctx->needs_input_grad(0)) {
        dlogits = at::empty_like(saved[0], at::MemoryFormat::Contiguous);
        DeviceScope scope(saved[0]);
        cross_entropy::masked_sum_backward(view_of(dloss, op, "dloss"), view_of(saved[0], op, "logits"),
                                           view_of(saved[1], op, "targets"), view_of(saved[2], op, "mask"),
                                           view_of(saved[3], op, "lse"), view_of(dlogits, op, "dlogits"),
                                           view_of(c10::optional<at::Tensor>(divisor), op, "divisor"),
                                           scope.context(false, false));
      }
      // loss = sum / divisor: d loss / d divisor = -loss / divisor (edge 3 exists only with a divisor).
      at::Tensor ddivisor;
      if (divisor.defined() && ctx->needs_input_grad(3)) ddivisor = (-dloss * saved[5] / divisor).reshape(divisor.sizes());
      return {dlogits, at::Tensor(), at::Tensor(), ddivisor};
    });
  }
};

}  // namespace

at::Tensor masked_cross_entropy_sum(const at::Tensor& logits, const at::Tensor& targets, const at::Tensor& mask,
                                    const at::Tensor& divisor) {
  TORCH_CHECK_VALUE(logits.defined() && logits.dim() >= 1,
                    "winnow::masked_cross_entropy_sum: argument 'logits': expected a tensor of at least 1 dimension");
  TORCH_CHECK_VALUE(targets.defined() && mask.defined() && targets.numel() * logits.size(-1) == logits.numel() &&
                        mask.numel() == targets.numel(),
                    "winnow::masked_cross_entropy_sum: arguments 'targets' and 'mask': expected one value per row "
                    "of logits (", logits.numel() / std::max<int64_t>(logits.size(-1), 1), "), got ",
                    targets.defined() ? targets.numel() : 0, " and ", mask.defined() ? mask.numel() : 0);
  TORCH_CHECK_VALUE(!divisor.defined() || divisor.numel() == 1,
                    "winnow::masked_cross_entropy_sum: argument 'divisor': expected one value, got ",
                    divisor.numel(), " values of shape ", divisor.sizes());
  const int64_t v = logits.size(-1);
  return MaskedCrossEntropyFunction::apply(logits.reshape({-1, v}), targets.reshape({-1}), mask.reshape({-1}),
                                           divisor.defined() ? c10::optional<at::Tensor>(divisor) : c10::nullopt)[0];
}

}  // namespace winnow::torch_ops
