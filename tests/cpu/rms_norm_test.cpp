// winnow::rms_norm on the CPU against RMSNorm written out in float64: forward and both
// gradients in every layout, thread-count independence of the weight gradient, empty inputs,
// and the errors bad arguments get.
#include <gtest/gtest.h>

#include <random>
#include <string>
#include <vector>

#include "support/expect_error.h"
#include "support/host_tensor.h"
#include "support/rms_norm_reference.h"
#include "winnow/error.h"
#include "winnow/rms_norm.h"

namespace winnow::testing {
namespace {

TEST(RMSNorm, ForwardAndGradientsMatchFloat64InEveryLayout) {
  std::mt19937_64 rng(5);
  const double eps = 1e-5;
  // 67 rows: a partial chunk of the weight gradient's sum; C = 37: no convenient width.
  const std::int64_t N = 67, C = 37;
  for (DType dtype : {DType::float32, DType::float64}) {
    for (const std::vector<int>& order : {std::vector<int>{}, std::vector<int>{1, 0}}) {
      HostTensor x({N, C}, dtype, order), dy({N, C}, dtype, order), w({C}, dtype);
      HostTensor y({N, C}, dtype), rstd({N}, dtype), dx({N, C}, dtype, order), dw({C}, dtype);
      x.set_values(random_normal(x.numel(), rng, 3.0));
      dy.set_values(random_normal(dy.numel(), rng));
      w.set_values(random_normal(C, rng));
      rms_norm::forward(x.view(), w.view(), eps, y.view(), rstd.view());
      rms_norm::backward(dy.view(), x.view(), w.view(), rstd.view(), dx.view(), dw.view());
      const RMSNormExpected want = rms_norm_expected(x.values(), w.values(), dy.values(), N, C, eps);
      const double tol = dtype == DType::float64 ? 1e-13 : 2e-6;
      EXPECT_LT(relative_error(y.values(), want.y), tol) << to_string(dtype) << " order " << order.size();
      EXPECT_LT(relative_error(rstd.values(), want.rstd), tol);
      EXPECT_LT(relative_error(dx.values(), want.dx), tol);
      EXPECT_LT(relative_error(dw.values(), want.dweight), tol);
    }
  }
}

TEST(RMSNorm, ResidualFormMatchesFloat64InEveryLayout) {
  std::mt19937_64 rng(15);
  const double eps = 1e-5;
  const std::int64_t N = 67, C = 37;
  for (DType dtype : {DType::float32, DType::float64}) {
    for (const std::vector<int>& order : {std::vector<int>{}, std::vector<int>{1, 0}}) {
      for (bool with_dsum : {false, true}) {
        HostTensor x({N, C}, dtype, order), r({N, C}, dtype), w({C}, dtype), dy({N, C}, dtype, order);
        HostTensor dsum({N, C}, dtype), sum({N, C}, dtype, order), y({N, C}, dtype), rstd({N}, dtype);
        HostTensor dx({N, C}, dtype), dr({N, C}, dtype, order), dw({C}, dtype);
        x.set_values(random_normal(x.numel(), rng, 3.0));
        r.set_values(random_normal(r.numel(), rng));
        dy.set_values(random_normal(dy.numel(), rng));
        dsum.set_values(random_normal(dsum.numel(), rng));
        w.set_values(random_normal(C, rng));
        rms_norm::add_forward(x.view(), r.view(), w.view(), eps, sum.view(), y.view(), rstd.view());
        const TensorView dsum_view = dsum.view();
        rms_norm::add_backward(dy.view(), with_dsum ? &dsum_view : nullptr, sum.view(), w.view(),
                               rstd.view(), dx.view(), dr.view(), dw.view());
        const AddRMSNormExpected want =
            add_rms_norm_expected(x.values(), r.values(), w.values(), dy.values(),
                                  with_dsum ? dsum.values() : std::vector<double>{}, N, C, eps);
        const double tol = dtype == DType::float64 ? 1e-13 : 2e-6;
        const std::string label = std::string(to_string(dtype)) + " order " +
                                  std::to_string(order.size()) + (with_dsum ? " dsum" : "");
        EXPECT_LT(relative_error(sum.values(), want.sum), tol) << label;
        EXPECT_LT(relative_error(y.values(), want.norm.y), tol) << label;
        EXPECT_LT(relative_error(rstd.values(), want.norm.rstd), tol) << label;
        EXPECT_LT(relative_error(dx.values(), want.norm.dx), tol) << label;
        EXPECT_EQ(dr.values(), dx.values()) << label;
        EXPECT_LT(relative_error(dw.values(), want.norm.dweight), tol) << label;
      }
    }
  }
}

TEST(RMSNorm, ResidualFormChecksItsExtraArguments) {
  HostTensor x({4, 8}, DType::float32), r({4, 8}, DType::float32), w({8}, DType::float32);
  HostTensor sum({4, 8}, DType::float32), y({4, 8}, DType::float32), rstd({4}, DType::float32);
  HostTensor r64({4, 8}, DType::float64), r5({5, 8}, DType::float32), dr64({4, 8}, DType::float64);
  HostTensor dx({4, 8}, DType::float32), dr({4, 8}, DType::float32), dw({8}, DType::float32);
  expect_error([&] { rms_norm::add_forward(x.view(), r64.view(), w.view(), 1e-6, sum.view(), y.view(), rstd.view()); },
               "argument 'residual': expected float32 (4, 8)");
  expect_error([&] { rms_norm::add_forward(x.view(), r5.view(), w.view(), 1e-6, sum.view(), y.view(), rstd.view()); },
               "argument 'residual': expected float32 (4, 8)");
  expect_error([&] { rms_norm::add_forward(x.view(), r.view(), w.view(), 1e-6, x.view(), y.view(), rstd.view()); },
               "argument 'sum': expected memory apart from the inputs");
  rms_norm::add_forward(x.view(), r.view(), w.view(), 1e-6, sum.view(), y.view(), rstd.view());
  expect_error([&] { rms_norm::add_backward(y.view(), nullptr, sum.view(), w.view(), rstd.view(), dx.view(), dr64.view(), dw.view()); },
               "argument 'dresidual': expected float32 (4, 8)");
  expect_error([&] { rms_norm::add_backward(y.view(), nullptr, sum.view(), w.view(), rstd.view(), dx.view(), dx.view(), dw.view()); },
               "argument 'dresidual': expected memory apart");
  const TensorView r5_view = r5.view();
  expect_error([&] { rms_norm::add_backward(y.view(), &r5_view, sum.view(), w.view(), rstd.view(), dx.view(), dr.view(), dw.view()); },
               "argument 'dsum_in': expected float32 (4, 8)");
}

TEST(RMSNorm, WeightGradientDoesNotDependOnTheThreadCount) {
  std::mt19937_64 rng(6);
  const std::int64_t N = 300, C = 16;
  HostTensor x({N, C}, DType::float32), dy({N, C}, DType::float32), w({C}, DType::float32);
  HostTensor rstd({N}, DType::float32), y({N, C}, DType::float32);
  x.set_values(random_normal(x.numel(), rng));
  dy.set_values(random_normal(dy.numel(), rng));
  w.set_values(random_normal(C, rng));
  rms_norm::forward(x.view(), w.view(), 1e-6, y.view(), rstd.view());
  std::vector<std::vector<double>> grads;
  for (int threads : {1, 2, 3}) {
    HostTensor dx({N, C}, DType::float32), dw({C}, DType::float32);
    ExecContext ctx;
    ctx.num_threads = threads;
    rms_norm::backward(dy.view(), x.view(), w.view(), rstd.view(), dx.view(), dw.view(), ctx);
    grads.push_back(dw.values());
  }
  EXPECT_EQ(grads[0], grads[1]);
  EXPECT_EQ(grads[0], grads[2]);
}

TEST(RMSNorm, NoRowsGiveAZeroWeightGradient) {
  HostTensor x({0, 8}, DType::float32), dy({0, 8}, DType::float32), w({8}, DType::float32);
  HostTensor y({0, 8}, DType::float32), rstd({0}, DType::float32), dx({0, 8}, DType::float32);
  HostTensor dw({8}, DType::float32);
  w.fill(1.0);
  dw.fill(7.0);
  rms_norm::forward(x.view(), w.view(), 1e-6, y.view(), rstd.view());
  rms_norm::backward(dy.view(), x.view(), w.view(), rstd.view(), dx.view(), dw.view());
  EXPECT_EQ(dw.values(), std::vector<double>(8, 0.0));
}

TEST(RMSNorm, BadArgumentsNameTheArgumentAndWhatWasExpected) {
  HostTensor x({4, 8}, DType::float32), y({4, 8}, DType::float32), w({8}, DType::float32);
  HostTensor rstd({4}, DType::float32), w7({7}, DType::float32), w64({8}, DType::float64);
  HostTensor y16({4, 8}, DType::bfloat16), rstd5({5}, DType::float32), x3({2, 2, 8}, DType::float32);
  HostTensor dx({4, 8}, DType::float32), dw({8}, DType::float32), dx64({4, 8}, DType::float64);
  expect_error([&] { rms_norm::forward(x3.view(), w.view(), 1e-6, y.view(), rstd.view()); },
               "'x': expected an (N, C) tensor");
  expect_error([&] { rms_norm::forward(x.view(), w7.view(), 1e-6, y.view(), rstd.view()); },
               "'weight': expected float32 (8) on cpu");
  expect_error([&] { rms_norm::forward(x.view(), w64.view(), 1e-6, y.view(), rstd.view()); },
               "'weight': expected float32 (8)");
  expect_error([&] { rms_norm::forward(x.view(), w.view(), -1.0, y.view(), rstd.view()); },
               "'eps': expected >= 0");
  expect_error([&] { rms_norm::forward(x.view(), w.view(), 1e-6, y16.view(), rstd.view()); },
               "'y': expected float32 (x's dtype) on the CPU");
  expect_error([&] { rms_norm::forward(x.view(), w.view(), 1e-6, y.view(), rstd5.view()); },
               "'rstd': expected float32 (4)");
  expect_error([&] { rms_norm::forward(x.view(), w.view(), 1e-6, x.view(), rstd.view()); },
               "'y': expected memory apart from the inputs");
  expect_error([&] { rms_norm::backward(y.view(), x.view(), w.view(), rstd.view(), dx64.view(), dw.view()); },
               "'dx': expected float32 (4, 8)");
  expect_error([&] { rms_norm::backward(y.view(), x.view(), w.view(), rstd.view(), dx.view(), w7.view()); },
               "'dweight': expected float32 (8)");
  expect_error([&] { rms_norm::backward(y.view(), x.view(), w.view(), rstd.view(), y.view(), dw.view()); },
               "'dx': expected memory apart from the inputs");
}

}  // namespace
}  // namespace winnow::testing
