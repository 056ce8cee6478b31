#include "winnow/adamw.h"

#include <cmath>
#include <set>
#include <string>

#include "api/view_checks.h"
#include "core/optimizer_params.h"
#include "cpu/cpu.h"
#include "cuda/cuda.h"

namespace winnow::adamw {
namespace {

using api::describe;
using api::fail;

constexpr const char* kOp = "winnow::adamw::clipped_step";

// A float32 view on `device`: of `like`'s shape and contiguous, or (like == nullptr) one element.
void check_operand(const std::string& name, const TensorView& t, const Device& device, const TensorView* like) {
  const std::string expected_shape = like != nullptr ? like->shape_string() : "one element";
  const bool shape_ok = like != nullptr ? t.numel() == like->numel() && t.shape_string() == like->shape_string()
                                        : t.numel() == 1;
  if (!api::contiguous(t)) fail(kOp, name, "a contiguous tensor", "strides that are not row-major");
  if (t.dtype != DType::float32 || t.device != device || !shape_ok) {
    fail(kOp, name, describe(DType::float32, expected_shape, device), describe(t));
  }
  api::check_data(kOp, name.c_str(), t);
}

}  // namespace

void clipped_step(const std::vector<Group>& groups, const Options& options,
                  const std::vector<TensorView>& guards, const TensorView& norm, const ExecContext& ctx) {
  if (groups.size() > static_cast<std::size_t>(detail::AdamWParams::kMaxGroups)) {
    fail(kOp, "groups", "at most " + std::to_string(detail::AdamWParams::kMaxGroups) + " groups",
         std::to_string(groups.size()), ErrorKind::unsupported);
  }
  const auto finite_in = [](double x, double lo, double hi) { return std::isfinite(x) && x >= lo && x < hi; };
  if (!finite_in(options.beta1, 0, 1)) fail(kOp, "beta1", "a value in [0, 1)", std::to_string(options.beta1));
  if (!finite_in(options.beta2, 0, 1)) fail(kOp, "beta2", "a value in [0, 1)", std::to_string(options.beta2));
  if (!finite_in(options.eps, 0, INFINITY)) fail(kOp, "eps", "a finite value >= 0", std::to_string(options.eps));
  if (!std::isfinite(options.max_norm)) fail(kOp, "max_norm", "a finite value", std::to_string(options.max_norm));

  const Device device = norm.device;
  if (device.kind == DeviceKind::cuda && !built_with_cuda()) {
    fail(kOp, "norm", "a CPU tensor (this build has no CUDA kernels)", describe(norm), ErrorKind::unsupported);
  }
  check_operand("norm", norm, device, nullptr);

  if (guards.size() > static_cast<std::size_t>(detail::AdamWParams::kMaxGuards)) {
    fail(kOp, "guards", "at most " + std::to_string(detail::AdamWParams::kMaxGuards) + " values",
         std::to_string(guards.size()), ErrorKind::unsupported);
  }
  detail::AdamWParams p;
  p.norm = static_cast<float*>(norm.data);
  for (std::size_t i = 0; i < guards.size(); ++i) {
    check_operand("guards[" + std::to_string(i) + "]", guards[i], device, nullptr);
    p.guards.push_back(static_cast<const float*>(guards[i].data));
  }
  std::set<const void*> seen;
  for (std::size_t g = 0; g < groups.size(); ++g) {
    const Group& group = groups[g];
    const std::string at = "groups[" + std::to_string(g) + "]";
    if (!finite_in(group.weight_decay, 0, INFINITY)) {
      fail(kOp, at + ".weight_decay", "a finite value >= 0", std::to_string(group.weight_decay));
    }
    check_operand(at + ".lr", group.lr, device, nullptr);
    const std::size_t n = group.params.size();
    const std::pair<const char*, const std::vector<TensorView>*> lists[] = {
        {"grads", &group.grads}, {"exp_avgs", &group.exp_avgs}, {"exp_avg_sqs", &group.exp_avg_sqs}, {"steps", &group.steps}};
    for (const auto& [name, list] : lists) {
      if (list->size() != n) {
        fail(kOp, at + "." + name, std::to_string(n) + " tensors (one per parameter)", std::to_string(list->size()));
      }
    }
    for (std::size_t i = 0; i < n; ++i) {
      const std::string index = "[" + std::to_string(i) + "]";
      const TensorView& param = group.params[i];
      check_operand(at + ".params" + index, param, device, &param);
      check_operand(at + ".grads" + index, group.grads[i], device, &param);
      check_operand(at + ".exp_avgs" + index, group.exp_avgs[i], device, &param);
      check_operand(at + ".exp_avg_sqs" + index, group.exp_avg_sqs[i], device, &param);
      check_operand(at + ".steps" + index, group.steps[i], device, nullptr);
      for (const TensorView* other : {&group.grads[i], &group.exp_avgs[i], &group.exp_avg_sqs[i]}) {
        if (api::overlaps(param, *other)) {
          fail(kOp, at + ".params" + index, "memory apart from its gradient and moments", "an overlapping view");
        }
      }
      if (param.numel() > 0 && !seen.insert(param.data).second) {
        fail(kOp, at + ".params" + index, "each parameter once", "a parameter listed twice");
      }
      detail::AdamWTensor t;
      t.param = static_cast<float*>(param.data);
      t.grad = static_cast<const float*>(group.grads[i].data);
      t.exp_avg = static_cast<float*>(group.exp_avgs[i].data);
      t.exp_avg_sq = static_cast<float*>(group.exp_avg_sqs[i].data);
      t.step = static_cast<float*>(group.steps[i].data);
      t.numel = param.numel();
      t.group = static_cast<int>(g);
      p.tensors.push_back(t);
    }
    p.group_lr.push_back(static_cast<const float*>(group.lr.data));
    p.group_weight_decay.push_back(group.weight_decay);
  }
  p.beta1 = options.beta1;
  p.beta2 = options.beta2;
  p.eps = options.eps;
  p.max_norm = options.max_norm;
  p.num_threads = ctx.num_threads;
  p.cuda_stream = ctx.cuda_stream;
  p.allocator = ctx.allocator;
  if (device.kind == DeviceKind::cuda) {
    cuda::adamw_clipped_step(p);
  } else {
    cpu::adamw_clipped_step(p);
  }
}

}  // namespace winnow::adamw
