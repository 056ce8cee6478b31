// A clipped AdamW problem for winnow::torch_ops::clipped_adamw_step: float32 parameters in two
// groups (different learning rates and weight decays) on a device, and the same parameters in
// float64 on the CPU stepped by torch::optim::AdamW after clipping their gradients as
// torch.nn.utils.clip_grad_norm_ does: the independent oracle.
#pragma once

#include <torch/torch.h>

#include <cmath>
#include <memory>
#include <vector>

#include "winnow/torch/ops.h"

namespace winnow::testing {

struct AdamWCase {
  static constexpr double kBeta1 = 0.9, kBeta2 = 0.95, kEps = 1e-8;
  std::vector<double> lrs = {2e-3, 1e-3}, weight_decays = {0.1, 0.0};
  std::vector<torch::Tensor> params, exp_avgs, exp_avg_sqs, steps, lr;  // float32 on the device
  std::vector<int> group_of;
  std::vector<torch::Tensor> expected;  // float64 on the CPU
  std::unique_ptr<torch::optim::AdamW> reference;

  AdamWCase(const std::vector<std::vector<std::int64_t>>& shapes, const torch::Device& device) {
    const auto f32 = torch::TensorOptions().dtype(torch::kFloat32).device(device);
    std::vector<torch::Tensor> by_group[2];
    for (std::size_t i = 0; i < shapes.size(); ++i) {
      const torch::Tensor p = torch::randn(shapes[i], torch::kFloat64);
      params.push_back(p.to(f32));
      exp_avgs.push_back(torch::zeros(shapes[i], f32));
      exp_avg_sqs.push_back(torch::zeros(shapes[i], f32));
      steps.push_back(torch::zeros({}, f32));
      group_of.push_back(static_cast<int>(i % 2));
      // The reference starts from the float32 values, so that both run one problem.
      expected.push_back(params.back().to(torch::kCPU).to(torch::kFloat64).requires_grad_(true));
      by_group[i % 2].push_back(expected.back());
    }
    for (double l : lrs) lr.push_back(torch::full({}, l, f32));
    std::vector<torch::optim::OptimizerParamGroup> groups;
    for (int g = 0; g < 2; ++g) {
      auto o = std::make_unique<torch::optim::AdamWOptions>(lrs[g]);
      o->betas({kBeta1, kBeta2}).eps(kEps).weight_decay(weight_decays[g]);
      groups.emplace_back(by_group[g], std::move(o));
    }
    reference = std::make_unique<torch::optim::AdamW>(groups, torch::optim::AdamWOptions(1e-3));
  }

  std::vector<torch_ops::AdamWGroup> groups(const std::vector<torch::Tensor>& grads) const {
    std::vector<torch_ops::AdamWGroup> out(2);
    for (int g = 0; g < 2; ++g) {
      out[g].lr = lr[g];
      out[g].weight_decay = weight_decays[g];
    }
    for (std::size_t i = 0; i < params.size(); ++i) {
      torch_ops::AdamWGroup& g = out[group_of[i]];
      g.params.push_back(params[i]);
      g.grads.push_back(grads[i]);
      g.exp_avgs.push_back(exp_avgs[i]);
      g.exp_avg_sqs.push_back(exp_avg_sqs[i]);
      g.steps.push_back(steps[i]);
    }
    return out;
  }

  // Random gradients (times `size`) on the device; the reference takes the same values.
  std::vector<torch::Tensor> gradients(double size) const {
    std::vector<torch::Tensor> grads;
    for (const torch::Tensor& p : params) grads.push_back(torch::randn_like(p) * size);
    return grads;
  }

  // The reference's step with these gradients and clip; returns its norm before the clip.
  double reference_step(const std::vector<torch::Tensor>& grads, double max_norm) {
    double sum = 0;
    for (std::size_t i = 0; i < grads.size(); ++i) {
      expected[i].mutable_grad() = grads[i].to(torch::kCPU).to(torch::kFloat64);
      sum += expected[i].grad().pow(2).sum().item<double>();
    }
    const double norm = std::sqrt(sum);
    if (max_norm > 0) {
      const double coef = std::min(1.0, max_norm / (norm + 1e-6));
      for (auto& e : expected) e.mutable_grad().mul_(coef);
    }
    reference->step();
    return norm;
  }

  // The largest relative difference ||ours - reference|| / ||reference|| over the parameters.
  double worst_parameter_error() const {
    double worst = 0;
    for (std::size_t i = 0; i < params.size(); ++i) {
      const torch::Tensor e = expected[i].detach();
      const double scale = std::max(e.norm().item<double>(), 1e-30);
      const double diff = (params[i].to(torch::kCPU).to(torch::kFloat64) - e).norm().item<double>();
      worst = std::max(worst, diff / scale);
    }
    return worst;
  }
};

}  // namespace winnow::testing
