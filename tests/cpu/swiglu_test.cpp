// winnow::swiglu on the CPU against the gate and its derivative written out in float64, in
// every layout, and the errors bad arguments get.
#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <vector>

#include "support/expect_error.h"
#include "support/host_tensor.h"
#include "support/swiglu_reference.h"
#include "winnow/error.h"
#include "winnow/swiglu.h"

namespace winnow::testing {
namespace {

TEST(SwiGLU, ForwardAndGradientsMatchFloat64InEveryLayout) {
  std::mt19937_64 rng(8);
  const std::int64_t N = 23, H = 41;
  for (DType dtype : {DType::float32, DType::float64}) {
    for (const std::vector<int>& order : {std::vector<int>{}, std::vector<int>{1, 0}}) {
      HostTensor gate({N, H}, dtype, order), up({N, H}, dtype), dy({N, H}, dtype, order);
      HostTensor y({N, H}, dtype), dgate({N, H}, dtype, order), dup({N, H}, dtype);
      // Gates out to +-30: the sigmoid's saturated ends too.
      gate.set_values(random_normal(gate.numel(), rng, 8.0));
      up.set_values(random_normal(up.numel(), rng));
      dy.set_values(random_normal(dy.numel(), rng));
      swiglu::forward(gate.view(), up.view(), y.view());
      swiglu::backward(dy.view(), gate.view(), up.view(), dgate.view(), dup.view());
      const SwiGLUExpected want = swiglu_expected(gate.values(), up.values(), dy.values());
      const double tol = dtype == DType::float64 ? 1e-14 : 1e-6;
      EXPECT_LT(relative_error(y.values(), want.y), tol) << to_string(dtype);
      EXPECT_LT(relative_error(dgate.values(), want.dgate), tol) << to_string(dtype);
      EXPECT_LT(relative_error(dup.values(), want.dup), tol) << to_string(dtype);
    }
  }
}

TEST(SwiGLU, BadArgumentsNameTheArgumentAndWhatWasExpected) {
  HostTensor gate({4, 8}, DType::float32), up({4, 8}, DType::float32), y({4, 8}, DType::float32);
  HostTensor up64({4, 8}, DType::float64), y7({4, 7}, DType::float32), g16({4, 8}, DType::bfloat16);
  HostTensor g3({2, 2, 8}, DType::float32), dgate({4, 8}, DType::float32), dup({4, 8}, DType::float32);
  expect_error([&] { swiglu::forward(g3.view(), up.view(), y.view()); }, "'gate': expected an (N, H) tensor");
  expect_error([&] { swiglu::forward(gate.view(), up64.view(), y.view()); }, "'up': expected float32 (4, 8) on cpu");
  expect_error([&] { swiglu::forward(gate.view(), up.view(), y7.view()); }, "'y': expected float32 (4, 8)");
  expect_error([&] { swiglu::forward(g16.view(), g16.view(), g16.view()); },
               "'gate': expected float32 or float64 on the CPU");
  expect_error([&] { swiglu::forward(gate.view(), up.view(), gate.view()); },
               "'y': expected memory apart from gate and up");
  expect_error([&] { swiglu::backward(y.view(), gate.view(), up.view(), dgate.view(), dgate.view()); },
               "'dgate': expected memory apart from the inputs and dup");
  expect_error([&] { swiglu::backward(y.view(), gate.view(), up.view(), dgate.view(), y7.view()); },
               "'dup': expected float32 (4, 8)");
}

}  // namespace
}  // namespace winnow::testing
