// winnow's clipped AdamW (winnow/adamw.h) through its LibTorch entry point on the CPU, against
// torch::optim::AdamW in float64 after torch's clip; skipped steps; errors naming the argument.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <limits>
#include <string>

#include "support/adamw_case.h"
#include "support/expect_value_error.h"
#include "winnow/torch/ops.h"

namespace {

using torch::Tensor;
using winnow::testing::AdamWCase;
using winnow::testing::expect_value_error;
using winnow::torch_ops::clipped_adamw_step;

const std::vector<std::vector<std::int64_t>> kShapes = {{64, 48}, {48}, {7, 3, 5}, {0}, {3, 2, 2, 2, 2}, {40000}};

TEST(ClippedAdamW, MatchesTorchOptimAdamWAfterTheClip) {
  torch::manual_seed(3);
  AdamWCase c(kShapes, torch::kCPU);
  // Steps with the clip taking effect (norm far above 1), not taking it, and no clip at all.
  const std::pair<double, double> steps[] = {{1.0, 1.0}, {1.0, 1.0}, {1e-3, 1.0}, {1.0, 0.0}, {5.0, 2.0}};
  for (const auto& [size, max_norm] : steps) {
    const std::vector<Tensor> grads = c.gradients(size);
    const Tensor norm = clipped_adamw_step(c.groups(grads), AdamWCase::kBeta1, AdamWCase::kBeta2, AdamWCase::kEps,
                                           max_norm);
    const double expected_norm = c.reference_step(grads, max_norm);
    EXPECT_EQ(norm.scalar_type(), torch::kFloat32);
    EXPECT_NEAR(norm.item<double>(), expected_norm, 1e-6 * expected_norm);
    EXPECT_LT(c.worst_parameter_error(), 1e-6) << "gradient size " << size << ", max_norm " << max_norm;
  }
  for (const Tensor& s : c.steps) EXPECT_EQ(s.item<float>(), 5.0f);
}

TEST(ClippedAdamW, NonFiniteNormOrGuardChangesNothing) {
  torch::manual_seed(4);
  AdamWCase c(kShapes, torch::kCPU);
  const std::vector<Tensor> first = c.gradients(1.0);
  clipped_adamw_step(c.groups(first), AdamWCase::kBeta1, AdamWCase::kBeta2, AdamWCase::kEps, 1.0);
  c.reference_step(first, 1.0);
  const auto snapshot = [&] {
    std::vector<Tensor> all;
    for (const auto* list : {&c.params, &c.exp_avgs, &c.exp_avg_sqs, &c.steps}) {
      for (const Tensor& t : *list) all.push_back(t.clone());
    }
    return all;
  };
  const std::vector<Tensor> before = snapshot();
  std::vector<Tensor> bad = c.gradients(1.0);
  bad[2].view({-1})[5] = std::numeric_limits<float>::infinity();
  const Tensor norm = clipped_adamw_step(c.groups(bad), AdamWCase::kBeta1, AdamWCase::kBeta2, AdamWCase::kEps, 1.0);
  EXPECT_FALSE(std::isfinite(norm.item<float>()));
  const Tensor nan_loss = torch::full({}, std::numeric_limits<float>::quiet_NaN());
  const Tensor finite_norm = clipped_adamw_step(c.groups(c.gradients(1.0)), AdamWCase::kBeta1, AdamWCase::kBeta2,
                                                AdamWCase::kEps, 1.0, {torch::ones({}), nan_loss});
  EXPECT_TRUE(std::isfinite(finite_norm.item<float>()));
  const std::vector<Tensor> after = snapshot();
  for (std::size_t i = 0; i < before.size(); ++i) EXPECT_TRUE(torch::equal(before[i], after[i])) << i;
  // The next good step is the reference's second.
  const std::vector<Tensor> good = c.gradients(1.0);
  clipped_adamw_step(c.groups(good), AdamWCase::kBeta1, AdamWCase::kBeta2, AdamWCase::kEps, 1.0);
  c.reference_step(good, 1.0);
  EXPECT_LT(c.worst_parameter_error(), 1e-6);
}

TEST(ClippedAdamW, BadArgumentsRaiseValueErrorsNamingTheArgument) {
  AdamWCase c({{4, 3}, {5}}, torch::kCPU);
  const std::vector<Tensor> grads = c.gradients(1.0);
  auto step = [&](std::vector<winnow::torch_ops::AdamWGroup> g, double beta1 = 0.9) {
    clipped_adamw_step(g, beta1, 0.95, 1e-8, 1.0);
  };
  {
    auto g = c.groups(grads);
    g[0].grads.pop_back();
    expect_value_error([&] { step(g); }, "argument 'groups[0].grads': expected 1 tensors (one per parameter), got 0");
  }
  {
    auto g = c.groups(grads);
    g[0].grads[0] = grads[0].t();
    expect_value_error([&] { step(g); }, "argument 'groups[0].grads[0]': expected a contiguous tensor");
  }
  {
    auto g = c.groups(grads);
    g[1].exp_avgs[0] = torch::zeros({6});
    expect_value_error([&] { step(g); }, "argument 'groups[1].exp_avgs[0]': expected float32 (5,) on cpu");
  }
  {
    auto g = c.groups(grads);
    g[0].params[0] = c.params[0].to(torch::kFloat64);
    expect_value_error([&] { step(g); }, "argument 'groups[0].params[0]'");
  }
  {
    auto g = c.groups(grads);
    g[1].lr = torch::ones({2});
    expect_value_error([&] { step(g); }, "argument 'groups[1].lr': expected float32 one element on cpu");
  }
  {
    auto g = c.groups(grads);
    g[1].params.push_back(c.params[0]);
    g[1].grads.push_back(grads[0]);
    g[1].exp_avgs.push_back(torch::zeros({4, 3}));
    g[1].exp_avg_sqs.push_back(torch::zeros({4, 3}));
    g[1].steps.push_back(torch::zeros({}));
    expect_value_error([&] { step(g); }, "expected each parameter once");
  }
  expect_value_error([&] { step(c.groups(grads), 1.0); }, "argument 'beta1': expected a value in [0, 1)");
  for (const Tensor& p : c.steps) EXPECT_EQ(p.item<float>(), 0.0f);
}

}  // namespace
