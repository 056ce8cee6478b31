// The masked cross-entropy (winnow/cross_entropy.h) through its LibTorch entry point on the CPU,
// against log_softmax, gather and sum in float64 with autograd, with and without a divisor;
// errors naming the argument.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <limits>
#include <string>

#include "support/expect_value_error.h"
#include "winnow/torch/ops.h"

namespace {

using torch::Tensor;
using winnow::testing::expect_value_error;
using winnow::torch_ops::masked_cross_entropy_sum;

Tensor composed(const Tensor& logits, const Tensor& targets, const Tensor& mask) {
  const Tensor logp = torch::log_softmax(logits.to(torch::kFloat64), -1);
  return -(logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1) * mask.to(torch::kFloat64)).sum();
}

double relative_difference(const Tensor& a, const Tensor& b) {
  const Tensor a64 = a.to(torch::kFloat64), b64 = b.to(torch::kFloat64);
  return ((a64 - b64).norm() / b64.norm().clamp_min(1e-300)).item<double>();
}

TEST(MaskedCrossEntropy, MatchesLogSoftmaxGatherAndSum) {
  torch::manual_seed(6);
  for (auto dtype : {torch::kFloat32, torch::kFloat64}) {
    for (std::int64_t v : {1, 7, 300}) {
      // (3, 37) positions; logits a column slice of a wider tensor (row stride > V).
      const Tensor wide = torch::randn({3, 37, v + 5}, torch::TensorOptions().dtype(dtype)) * 4;
      const Tensor logits = wide.narrow(-1, 2, v).detach().requires_grad_(true);
      const Tensor targets = torch::randint(0, v, {3, 37}, torch::kInt64);
      Tensor mask = (torch::rand({3, 37}) > 0.3).to(dtype) * torch::rand({3, 37}).to(dtype);
      const Tensor loss = masked_cross_entropy_sum(logits, targets, mask);
      const Tensor mine = torch::autograd::grad({loss * 1.7}, {logits})[0];
      const Tensor reference_logits = logits.detach().to(torch::kFloat64).requires_grad_(true);
      const Tensor expected = composed(reference_logits, targets, mask);
      const Tensor theirs = torch::autograd::grad({expected * 1.7}, {reference_logits})[0];
      const double tol = dtype == torch::kFloat32 ? 2e-6 : 1e-12;
      EXPECT_EQ(loss.scalar_type(), dtype);
      EXPECT_EQ(loss.dim(), 0);
      EXPECT_NEAR(loss.item<double>(), expected.item<double>(), tol * std::abs(expected.item<double>()) + 1e-12)
          << dtype << " V " << v;
      EXPECT_EQ(mine.scalar_type(), dtype);
      EXPECT_LT(relative_difference(mine, theirs), tol) << dtype << " V " << v;
    }
  }
}

// The divisor divides inside the kernels: the same bits as dividing the sum afterwards, forward
// and backward, and the divisor's own gradient -loss / divisor against autograd on the division.
TEST(MaskedCrossEntropy, DivisorEqualsDividingTheSumAfterwards) {
  torch::manual_seed(11);
  for (auto dtype : {torch::kFloat32, torch::kFloat64}) {
    const Tensor logits = (torch::randn({41, 13}, torch::TensorOptions().dtype(dtype)) * 3).requires_grad_(true);
    const Tensor targets = torch::randint(0, 13, {41}, torch::kInt64);
    const Tensor mask = (torch::rand({41}) > 0.2).to(dtype);
    const Tensor divisor = torch::full({}, 29.0, torch::TensorOptions().dtype(dtype)).requires_grad_(true);
    const Tensor inside = masked_cross_entropy_sum(logits, targets, mask, divisor);
    const auto [dlogits, ddivisor] = [&] {
      const auto g = torch::autograd::grad({inside * 1.3}, {logits, divisor});
      return std::make_pair(g[0], g[1]);
    }();
    const Tensor divisor2 = divisor.detach().clone().requires_grad_(true);
    const Tensor after = masked_cross_entropy_sum(logits, targets, mask) / divisor2;
    const auto g = torch::autograd::grad({after * 1.3}, {logits, divisor2});
    EXPECT_TRUE(torch::equal(inside, after)) << dtype;
    EXPECT_TRUE(torch::equal(dlogits, g[0])) << dtype;
    EXPECT_EQ(ddivisor.sizes(), divisor.sizes());
    EXPECT_NEAR(ddivisor.item<double>(), g[1].item<double>(), 1e-6 * std::abs(g[1].item<double>())) << dtype;
    const Tensor reference = composed(logits.detach(), targets, mask) / 29.0;
    EXPECT_NEAR(inside.item<double>(), reference.item<double>(), (dtype == torch::kFloat32 ? 2e-6 : 1e-12) *
                                                                     std::abs(reference.item<double>()));
  }
}

TEST(MaskedCrossEntropy, MaskedRowsContributeNothingWhateverTheyHold) {
  Tensor logits = torch::randn({4, 6}).requires_grad_(false);
  logits[1][2] = std::numeric_limits<float>::quiet_NaN();
  logits = logits.requires_grad_(true);
  const Tensor targets = torch::tensor({0, -5, 3, 99}, torch::kInt64);
  const Tensor mask = torch::tensor({1.0f, 0.0f, 1.0f, 0.0f});
  const Tensor loss = masked_cross_entropy_sum(logits, targets, mask);
  const Tensor rows = torch::tensor({0, 2}, torch::kInt64);
  const Tensor expected = composed(logits.detach().index_select(0, rows), targets.index_select(0, rows),
                                   mask.index_select(0, rows));
  EXPECT_NEAR(loss.item<double>(), expected.item<double>(), 1e-5);
  loss.backward();
  EXPECT_TRUE(torch::equal(logits.grad()[1], torch::zeros({6})));
  EXPECT_TRUE(torch::equal(logits.grad()[3], torch::zeros({6})));
  EXPECT_TRUE(torch::isfinite(logits.grad()).all().item<bool>());
}

TEST(MaskedCrossEntropy, BadArgumentsRaiseValueErrorsNamingTheArgument) {
  const Tensor logits = torch::randn({5, 4});
  const Tensor targets = torch::tensor({0, 1, 2, 3, 0}, torch::kInt64);
  const Tensor mask = torch::ones({5});
  expect_value_error([&] { masked_cross_entropy_sum(logits, torch::tensor({0, 1, 4, 3, 0}, torch::kInt64), mask); },
                     "argument 'targets': expected values in [0, 4) where mask is nonzero, got 4 at row 2");
  expect_value_error([&] { masked_cross_entropy_sum(logits, targets.to(torch::kInt32), mask); },
                     "argument 'targets': expected int64 (5,) on cpu, got int32 (5,) on cpu");
  expect_value_error([&] { masked_cross_entropy_sum(logits, targets, mask.to(torch::kFloat64)); },
                     "argument 'mask': expected float32 (5,) on cpu");
  expect_value_error([&] { masked_cross_entropy_sum(logits, targets.narrow(0, 0, 4), mask); },
                     "arguments 'targets' and 'mask': expected one value per row of logits (5), got 4 and 5");
  expect_value_error([&] { masked_cross_entropy_sum(logits.t(), targets.narrow(0, 0, 4), mask.narrow(0, 0, 4)); },
                     "argument 'logits': expected unit stride along V");
  expect_value_error([&] { masked_cross_entropy_sum(logits, targets, mask, torch::ones({2})); },
                     "argument 'divisor': expected one value, got 2 values of shape [2]");
  expect_value_error([&] { masked_cross_entropy_sum(logits, targets, mask, torch::ones({}, torch::kFloat64)); },
                     "argument 'divisor': expected float32 one element on cpu, got float64");
}

}  // namespace
