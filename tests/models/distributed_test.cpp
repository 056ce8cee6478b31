// The gradient buckets of data-parallel training (train/distributed.h), in one process: a world
// of one over gloo sums nothing, so what comes back must be exactly the gradients an ordinary
// backward pass accumulates, whatever the bucketing. Two ranks against one process:
// Cli.DataParallelTrainingMatchesOneProcessAndResumesOnAnotherWorldSize.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cstdlib>
#include <filesystem>
#include <string>

#include "support/scoped_env.h"
#include "train/distributed.h"

namespace {
namespace fs = std::filesystem;
using winnow::train::Collective;
using winnow::train::GradientBuckets;
using winnow::train::WorldInfo;

torch::Tensor loss_of(const std::vector<torch::Tensor>& p, const torch::Tensor& x) {
  // p[2] takes no part (an unused parameter); p[3] is frozen; p[0] is used twice.
  const torch::Tensor h = torch::tanh(x.matmul(p[0]) + p[1]);
  return (h.matmul(p[4]).sin().sum() + (h * p[3]).sum() + (x.matmul(p[0])).pow(2).mean());
}

TEST(GradientBuckets, WorldOfOneGivesTheOrdinaryGradientsWithAccumulationAndUnusedParameters) {
  if (!winnow::train::gloo_available()) GTEST_SKIP() << "this LibTorch has no gloo process group";
  const fs::path store = fs::temp_directory_path() / ("winnow_buckets_" + std::to_string(::getpid()));
  fs::remove(store);
  const winnow::testing::ScopedEnv store_file("WINNOW_STORE_FILE", store.string());
  torch::manual_seed(3);
  auto make = [] {
    std::vector<torch::Tensor> p = {torch::randn({5, 9}), torch::randn({9}), torch::randn({4}),
                                    torch::randn({9}), torch::randn({9, 700})};
    for (std::size_t i = 0; i < p.size(); ++i) p[i].set_requires_grad(i != 3);
    return p;
  };
  std::vector<torch::Tensor> bucketed = make();
  std::vector<torch::Tensor> plain;
  for (const auto& t : bucketed) plain.push_back(t.detach().clone().set_requires_grad(t.requires_grad()));

  WorldInfo one;
  Collective collective(one, torch::Device(torch::kCPU));
  EXPECT_EQ(collective.backend(), "gloo");
  // 8 KiB buckets: p[4] (25 KiB) alone, the small ones together. Trainable: p[0], p[1], p[2],
  // p[4], numbered 0 to 3 in the buckets' order; first in reverse.
  GradientBuckets buckets(collective, bucketed, 8 << 10);
  EXPECT_EQ(buckets.buckets(), 2u);
  EXPECT_EQ(buckets.order(), (std::vector<std::size_t>{3, 2, 1, 0}));
  // The order in which autograd delivers the gradients, seen on the plain copies.
  std::vector<std::size_t> arrivals;
  const std::size_t trainable_index[] = {0, 1, 2, 0, 3};
  for (std::size_t i : {0, 1, 2, 4}) {
    plain[i].register_hook([&arrivals, &trainable_index, i](const torch::Tensor&) {
      if (arrivals.size() < 3) arrivals.push_back(trainable_index[i]);
    });
  }
  for (int step = 0; step < 2; ++step) {
    for (auto* set : {&bucketed, &plain}) {
      for (auto& t : *set) t.mutable_grad() = torch::Tensor();
    }
    const torch::Tensor reported = torch::full({}, 2.5 + step), other = torch::full({}, -7.0);
    for (int micro = 0; micro < 3; ++micro) {
      const torch::Tensor x = torch::randn({6, 5});
      loss_of(plain, x).backward();
      if (micro == 2) {
        // Report values ride in the last bucket (not a float64 one: the buckets hold float32).
        EXPECT_FALSE(buckets.arm({reported, torch::zeros({}, torch::kFloat64)}));
        EXPECT_TRUE(buckets.arm({reported, other}));
      }
      loss_of(bucketed, x).backward();
    }
    buckets.finish();
    EXPECT_EQ(reported.item<float>(), 2.5f + static_cast<float>(step)) << "summed over a world of one";
    EXPECT_EQ(other.item<float>(), -7.0f);
    for (std::size_t i = 0; i < plain.size(); ++i) {
      ASSERT_EQ(bucketed[i].grad().defined(), plain[i].grad().defined()) << "parameter " << i;
      if (plain[i].grad().defined()) {
        EXPECT_TRUE(torch::allclose(bucketed[i].grad(), plain[i].grad(), 1e-6, 1e-6)) << "parameter " << i;
      }
    }
    EXPECT_FALSE(bucketed[2].grad().defined()) << "unused: no gradient";
    EXPECT_FALSE(bucketed[3].grad().defined()) << "frozen: no gradient";
    if (step == 0) {
      // Rebuilt after the first step: arrival order, the unused parameter last.
      ASSERT_EQ(arrivals.size(), 3u);
      const std::vector<std::size_t> expected = {arrivals[0], arrivals[1], arrivals[2], 2};
      EXPECT_EQ(buckets.order(), expected);
    }
  }
  fs::remove(store);
}

}  // namespace
