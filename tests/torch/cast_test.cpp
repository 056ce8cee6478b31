// The casting concatenation (winnow/cast.h) through its LibTorch entry point on the CPU: the same
// values as concatenating and converting with LibTorch, and errors naming the argument.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "support/expect_value_error.h"
#include "winnow/torch/ops.h"

namespace {

using torch::Tensor;
using winnow::testing::expect_value_error;
using winnow::torch_ops::cast_concatenate;

TEST(CastConcatenate, MatchesCatThenTo) {
  torch::manual_seed(3);
  for (const auto from : {torch::kFloat32, torch::kFloat64}) {
    for (const auto to : {torch::kFloat32, torch::kFloat64}) {
      // Any ranks and sizes, an empty source among them; a large one crosses the threads' split.
      std::vector<Tensor> sources = {torch::randn({3, 5}, from) * 1e3, torch::randn({0}, from),
                                     torch::randn({7}, from), torch::randn({2, 3, 4}, from) * 1e-30,
                                     torch::randn({70001}, from)};
      std::vector<Tensor> flat;
      for (const Tensor& s : sources) flat.push_back(s.reshape(-1));
      const Tensor out = cast_concatenate(sources, to);
      EXPECT_EQ(out.scalar_type(), to);
      EXPECT_TRUE(torch::equal(out, torch::cat(flat).to(to))) << from << " to " << to;
    }
  }
}

TEST(CastConcatenate, BadArgumentsRaiseValueErrorsNamingTheArgument) {
  const Tensor a = torch::randn({4, 3});
  expect_value_error([&] { cast_concatenate({}, torch::kFloat32); },
                     "argument 'sources': expected at least one tensor, got none");
  expect_value_error([&] { cast_concatenate({a, a.to(torch::kFloat64)}, torch::kFloat32); },
                     "argument 'sources[1]': expected float32 any shape on cpu (like sources[0]), got float64 (12,) on cpu");
  expect_value_error([&] { cast_concatenate({a, a.t()}, torch::kFloat32); },
                     "argument 'sources[1]': expected a contiguous tensor");
  expect_value_error([&] { cast_concatenate({a.to(torch::kInt64)}, torch::kFloat32); },
                     "argument 'sources[0]': expected a floating-point tensor, got int64 (12,) on cpu");
}

}  // namespace
