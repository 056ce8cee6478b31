#include "winnow/cross_entropy.h"

#include <string>
#include <vector>

#include "api/view_checks.h"
#include "core/layer_params.h"
#include "cpu/cpu.h"
#include "cuda/cuda.h"

namespace winnow::cross_entropy {
namespace {

using api::describe;
using api::fail;

DType stat_dtype(const TensorView& logits) {
  return logits.dtype == DType::float64 ? DType::float64 : DType::float32;
}

void check_logits(const char* op, const char* name, const TensorView& t) {
  if (t.ndim != 2) fail(op, name, "an (N, V) tensor", describe(t));
  api::check_device(op, name, t);
  if (t.shape[1] > 1 && t.stride[1] != 1) fail(op, name, "unit stride along V", "stride " + std::to_string(t.stride[1]));
  api::check_data(op, name, t);
}

// A (N) vector (contiguous when asked) or a single value, in `dtype` on the logits' device.
void check_vector(const char* op, const char* name, const TensorView& t, DType dtype, const TensorView& logits,
                  bool single, bool contiguous = false) {
  const std::string shape = single ? "one element" : "(" + std::to_string(logits.shape[0]) + ",)";
  const bool shape_ok = single ? t.numel() == 1 : (t.ndim == 1 && t.shape[0] == logits.shape[0]);
  if (t.dtype != dtype || t.device != logits.device || !shape_ok) {
    fail(op, name, describe(dtype, shape, logits.device), describe(t));
  }
  if (contiguous && t.shape[0] > 1 && t.stride[0] != 1) fail(op, name, "a contiguous vector", "stride " + std::to_string(t.stride[0]));
  api::check_data(op, name, t);
}

// On the CPU the targets of counted rows can be checked before any work.
void check_targets(const char* op, const TensorView& targets, const TensorView& mask, std::int64_t cols) {
  if (targets.device.kind != DeviceKind::cpu) return;
  const auto* t = static_cast<const std::int64_t*>(targets.data);
  for (std::int64_t n = 0; n < targets.shape[0]; ++n) {
    const double m = mask.dtype == DType::float64 ? static_cast<const double*>(mask.data)[n * mask.stride[0]]
                                                  : static_cast<const float*>(mask.data)[n * mask.stride[0]];
    const std::int64_t target = t[n * targets.stride[0]];
    if (m != 0 && (target < 0 || target >= cols)) {
      fail(op, "targets", "values in [0, " + std::to_string(cols) + ") where mask is nonzero",
           std::to_string(target) + " at row " + std::to_string(n));
    }
  }
}

detail::CrossEntropyParams params_of(const TensorView& logits, const TensorView& targets, const TensorView& mask,
                                     const TensorView& lse, const std::optional<TensorView>& divisor,
                                     const ExecContext& ctx) {
  detail::CrossEntropyParams p;
  p.logits = logits.data;
  p.logits_dtype = logits.dtype;
  p.stat_dtype = stat_dtype(logits);
  p.rows = logits.shape[0];
  p.cols = logits.shape[1];
  p.logits_row_stride = logits.stride[0];
  p.targets = static_cast<const std::int64_t*>(targets.data);
  p.targets_stride = targets.stride[0];
  p.mask = mask.data;
  p.mask_stride = mask.stride[0];
  p.lse = lse.data;
  p.divisor = divisor ? divisor->data : nullptr;
  p.num_threads = ctx.num_threads;
  p.cuda_stream = ctx.cuda_stream;
  p.allocator = ctx.allocator;
  return p;
}

}  // namespace

void masked_sum_forward(const TensorView& logits, const TensorView& targets, const TensorView& mask,
                        const TensorView& loss, const TensorView& lse, const std::optional<TensorView>& divisor,
                        const ExecContext& ctx) {
  constexpr const char* op = "winnow::cross_entropy::masked_sum_forward";
  check_logits(op, "logits", logits);
  const DType stats = stat_dtype(logits);
  check_vector(op, "targets", targets, DType::int64, logits, false);
  check_vector(op, "mask", mask, stats, logits, false);
  check_vector(op, "loss", loss, stats, logits, true);
  check_vector(op, "lse", lse, stats, logits, false, true);
  if (divisor) check_vector(op, "divisor", *divisor, stats, logits, true);
  std::vector<const TensorView*> inputs = {&logits, &targets, &mask};
  if (divisor) inputs.push_back(&*divisor);
  for (const TensorView* in : inputs) {
    if (api::overlaps(loss, *in) || api::overlaps(loss, lse)) fail(op, "loss", "memory apart from the inputs and lse", "an overlapping view");
    if (api::overlaps(lse, *in)) fail(op, "lse", "memory apart from the inputs", "an overlapping view");
  }
  if (logits.shape[1] == 0 && logits.shape[0] > 0) fail(op, "logits", "at least one column", describe(logits));
  check_targets(op, targets, mask, logits.shape[1]);
  detail::CrossEntropyParams p = params_of(logits, targets, mask, lse, divisor, ctx);
  p.loss = loss.data;
  if (logits.device.kind == DeviceKind::cuda) {
    cuda::cross_entropy_forward(p);
  } else {
    cpu::cross_entropy_forward(p);
  }
}

void masked_sum_backward(const TensorView& dloss, const TensorView& logits, const TensorView& targets,
                         const TensorView& mask, const TensorView& lse, const TensorView& dlogits,
                         const std::optional<TensorView>& divisor, const ExecContext& ctx) {
  constexpr const char* op = "winnow::cross_entropy::masked_sum_backward";
  check_logits(op, "logits", logits);
  const DType stats = stat_dtype(logits);
  check_vector(op, "dloss", dloss, stats, logits, true);
  check_vector(op, "targets", targets, DType::int64, logits, false);
  check_vector(op, "mask", mask, stats, logits, false);
  check_vector(op, "lse", lse, stats, logits, false, true);
  if (divisor) check_vector(op, "divisor", *divisor, stats, logits, true);
  if (dlogits.ndim != 2 || dlogits.shape[0] != logits.shape[0] || dlogits.shape[1] != logits.shape[1] ||
      dlogits.dtype != logits.dtype || dlogits.device != logits.device) {
    fail(op, "dlogits", describe(logits.dtype, logits.shape_string(), logits.device), describe(dlogits));
  }
  if (dlogits.shape[1] > 1 && dlogits.stride[1] != 1) {
    fail(op, "dlogits", "unit stride along V", "stride " + std::to_string(dlogits.stride[1]));
  }
  api::check_data(op, "dlogits", dlogits);
  std::vector<const TensorView*> inputs = {&dloss, &logits, &targets, &mask, &lse};
  if (divisor) inputs.push_back(&*divisor);
  for (const TensorView* in : inputs) {
    if (api::overlaps(dlogits, *in)) fail(op, "dlogits", "memory apart from the inputs", "an overlapping view");
  }
  check_targets(op, targets, mask, logits.shape[1]);
  detail::CrossEntropyParams p = params_of(logits, targets, mask, lse, divisor, ctx);
  p.dloss = dloss.data;
  p.dlogits = dlogits.data;
  p.dlogits_row_stride = dlogits.stride[0];
  if (logits.numel() == 0) return;
  if (logits.device.kind == DeviceKind::cuda) {
    cuda::cross_entropy_backward(p);
  } else {
    cpu::cross_entropy_backward(p);
  }
}

}  // namespace winnow::cross_entropy
