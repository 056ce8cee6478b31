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

// The gradients written into the two halves of one (N, 2H) buffer, as the packed gate-and-up
// projection takes them (nn::project): the halves share a range of memory but no byte, so the
// views are accepted and the results are those of separate outputs; halves that would share
// bytes (the second starting inside the first's columns) are still refused.
TEST(SwiGLU, BackwardWritesIntoTheHalvesOfOneBuffer) {
  std::mt19937_64 rng(5);
  HostTensor gate({5, 8}, DType::float32), up({5, 8}, DType::float32), dy({5, 8}, DType::float32);
  HostTensor dgate({5, 8}, DType::float32), dup({5, 8}, DType::float32), both({5, 16}, DType::float32);
  gate.set_values(random_normal(gate.numel(), rng));
  up.set_values(random_normal(up.numel(), rng));
  dy.set_values(random_normal(dy.numel(), rng));
  swiglu::backward(dy.view(), gate.view(), up.view(), dgate.view(), dup.view());
  const auto half = [&](std::int64_t first_column, std::int64_t columns) {
    TensorView v = both.view();
    v.data = static_cast<float*>(v.data) + first_column;
    v.shape[1] = columns;
    return v;
  };
  swiglu::backward(dy.view(), gate.view(), up.view(), half(0, 8), half(8, 8));
  const std::vector<double> packed = both.values(), want_gate = dgate.values(), want_up = dup.values();
  for (std::int64_t r = 0; r < 5; ++r) {
    for (std::int64_t c = 0; c < 8; ++c) {
      EXPECT_EQ(packed[r * 16 + c], want_gate[r * 8 + c]) << r << ", " << c;
      EXPECT_EQ(packed[r * 16 + 8 + c], want_up[r * 8 + c]) << r << ", " << c;
    }
  }
  TensorView narrow_up = half(7, 8);
  narrow_up.shape[1] = 8;
  expect_error([&] { swiglu::backward(dy.view(), gate.view(), up.view(), half(0, 8), narrow_up); },
               "'dgate': expected memory apart from the inputs and dup");
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
