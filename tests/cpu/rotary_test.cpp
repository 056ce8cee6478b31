// winnow::rotary::apply on the CPU against the rotation written out in float64, its transpose as
// the inverse, layouts and in-place calls, and the errors bad arguments get.
#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <string>
#include <vector>

#include "support/expect_error.h"
#include "support/host_tensor.h"
#include "winnow/error.h"
#include "winnow/rotary.h"

namespace winnow::testing {
namespace {

struct Tables {
  HostTensor cos, sin;
};

// Angles of a plain RoPE at positions 0..L-1, times `scale` (YaRN's attention factor).
Tables tables(std::int64_t L, std::int64_t half, DType dtype, double scale = 1.0) {
  Tables t{HostTensor({L, half}, dtype), HostTensor({L, half}, dtype)};
  std::vector<double> c(L * half), s(L * half);
  for (std::int64_t l = 0; l < L; ++l) {
    for (std::int64_t i = 0; i < half; ++i) {
      const double angle = static_cast<double>(l) * std::pow(10000.0, -static_cast<double>(i) / half);
      c[l * half + i] = scale * std::cos(angle);
      s[l * half + i] = scale * std::sin(angle);
    }
  }
  t.cos.set_values(c);
  t.sin.set_values(s);
  return t;
}

// The rotation written out, in float64, on logical (B, L, H, D) values.
std::vector<double> rotated(const std::vector<double>& x, const std::vector<double>& c,
                            const std::vector<double>& s, std::int64_t B, std::int64_t L,
                            std::int64_t H, std::int64_t D, bool transpose) {
  std::vector<double> y(x.size());
  const std::int64_t half = D / 2;
  for (std::int64_t row = 0; row < B * L * H; ++row) {
    const std::int64_t l = (row / H) % L;
    for (std::int64_t i = 0; i < half; ++i) {
      const double a = x[row * D + i], b = x[row * D + i + half];
      const double cs = c[l * half + i], sn = transpose ? -s[l * half + i] : s[l * half + i];
      y[row * D + i] = a * cs - b * sn;
      y[row * D + i + half] = b * cs + a * sn;
    }
  }
  return y;
}

TEST(Rotary, MatchesTheRotationWrittenOutInEveryLayout) {
  std::mt19937_64 rng(3);
  const std::int64_t B = 2, L = 7, H = 3, D = 10;
  for (DType dtype : {DType::float32, DType::float64}) {
    for (const std::vector<int>& order : {std::vector<int>{}, std::vector<int>{0, 2, 1, 3}, std::vector<int>{3, 0, 1, 2}}) {
      for (bool transpose : {false, true}) {
        HostTensor x({B, L, H, D}, dtype, order), out({B, L, H, D}, dtype);
        x.set_values(random_normal(x.numel(), rng));
        const Tables t = tables(L, D / 2, dtype, 1.3);
        rotary::apply(x.view(), t.cos.view(), t.sin.view(), transpose, out.view());
        const std::vector<double> want =
            rotated(x.values(), t.cos.values(), t.sin.values(), B, L, H, D, transpose);
        EXPECT_LT(relative_error(out.values(), want), dtype == DType::float64 ? 1e-15 : 1e-6)
            << to_string(dtype) << " transpose " << transpose << " order " << order.size();
      }
    }
  }
}

TEST(Rotary, TransposeUndoesTheRotationAndInPlaceWorks) {
  std::mt19937_64 rng(4);
  const std::int64_t B = 1, L = 33, H = 2, D = 64;
  HostTensor x({B, L, H, D}, DType::float64), y({B, L, H, D}, DType::float64);
  const std::vector<double> start = random_normal(x.numel(), rng);
  x.set_values(start);
  const Tables t = tables(L, D / 2, DType::float64);
  rotary::apply(x.view(), t.cos.view(), t.sin.view(), false, y.view());
  rotary::apply(y.view(), t.cos.view(), t.sin.view(), true, y.view());  // in place
  EXPECT_LT(relative_error(y.values(), start), 1e-14);
}

TEST(Rotary, BadArgumentsNameTheArgumentAndWhatWasExpected) {
  const Tables t = tables(4, 4, DType::float32);
  HostTensor x({1, 4, 2, 8}, DType::float32), out({1, 4, 2, 8}, DType::float32);
  HostTensor odd({1, 4, 2, 7}, DType::float32);
  HostTensor x64({1, 4, 2, 8}, DType::float64), half({1, 4, 2, 8}, DType::bfloat16);
  const Tables short_tables = tables(3, 4, DType::float32);
  expect_error([&] { rotary::apply(odd.view(), t.cos.view(), t.sin.view(), false, odd.view()); },
               "'x': expected an even head dimension");
  expect_error([&] { rotary::apply(x.view(), short_tables.cos.view(), t.sin.view(), false, out.view()); },
               "'cos': expected (4, 4) float32");
  expect_error([&] { rotary::apply(x64.view(), t.cos.view(), t.sin.view(), false, x64.view()); },
               "'cos': expected (4, 4) float64");
  expect_error([&] { rotary::apply(x.view(), t.cos.view(), t.sin.view(), false, x64.view()); },
               "'out': expected float32 (1, 4, 2, 8)");
  expect_error([&] { rotary::apply(half.view(), t.cos.view(), t.sin.view(), false, half.view()); },
               "'x': expected float32 or float64 on the CPU");
  TensorView shifted = x.view();
  shifted.data = static_cast<float*>(shifted.data) + 1;
  shifted.shape[1] = 3;
  TensorView head = x.view();
  head.shape[1] = 3;
  const Tables three = tables(3, 4, DType::float32);
  expect_error([&] { rotary::apply(head, three.cos.view(), three.sin.view(), false, shifted); },
               "'out': expected memory apart from x's");
}

}  // namespace
}  // namespace winnow::testing
