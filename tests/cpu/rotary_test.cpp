// winnow::rotary::apply on the CPU against the rotation written out in float64, its transpose as
// the inverse, layouts and in-place calls, and the errors bad arguments get; softmax's backward
// with rotary tables (gradients with respect to the unrotated q and k).
#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "support/expect_error.h"
#include "support/host_tensor.h"
#include "winnow/error.h"
#include "winnow/rotary.h"
#include "winnow/softmax.h"

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

// softmax::backward with rotary tables (Options::rotary_cos / rotary_sin): q and k were rotated
// before the call and dq, dk are wanted with respect to the unrotated ones. The float64
// reference against central differences of the whole composition
// sum(dout * softmax(R q, R k, v)), queries the last Lq of Lk positions; the CPU kernels
// (float32) against that reference.
struct RotatedSoftmax {
  static constexpr std::int64_t B = 2, Lq = 5, Lk = 9, H = 2, D = 8;
  std::vector<double> q, k, v, dout;
  Tables all = tables(Lk, D / 2, DType::float64, 1.1);

  // The last Lq rows of a (Lk, D/2) table.
  static HostTensor last_rows(const HostTensor& t, DType dtype) {
    HostTensor rows({Lq, D / 2}, dtype);
    const std::vector<double> v = t.values();
    rows.set_values(std::vector<double>(v.end() - Lq * (D / 2), v.end()));
    return rows;
  }
  static HostTensor tensor(std::vector<std::int64_t> shape, DType dtype, const std::vector<double>& values) {
    HostTensor t(std::move(shape), dtype);
    t.set_values(values);
    return t;
  }
  // sum(dout * out) for unrotated q and k.
  double loss(const std::vector<double>& q0, const std::vector<double>& k0) const {
    const ExecContext ctx{Backend::reference};
    HostTensor qr = tensor({B, Lq, H, D}, DType::float64, q0), kr = tensor({B, Lk, H, D}, DType::float64, k0);
    const HostTensor qc = last_rows(all.cos, DType::float64), qs = last_rows(all.sin, DType::float64);
    rotary::apply(qr.view(), qc.view(), qs.view(), false, qr.view(), ctx);
    rotary::apply(kr.view(), all.cos.view(), all.sin.view(), false, kr.view(), ctx);
    HostTensor vv = tensor({B, Lk, H, D}, DType::float64, v), out({B, Lq, H, D}, DType::float64),
               lse({B, Lq, H}, DType::float64);
    softmax::forward({qr.view(), kr.view(), vv.view()}, {}, {out.view(), lse.view()}, ctx);
    double sum = 0;
    const std::vector<double> o = out.values();
    for (std::size_t i = 0; i < o.size(); ++i) sum += o[i] * dout[i];
    return sum;
  }
  // dq and dk through softmax::backward with the tables, in `dtype` on `backend`.
  std::pair<std::vector<double>, std::vector<double>> grads(DType dtype, Backend backend) const {
    const ExecContext ctx{backend};
    const DType table_dtype = dtype;
    HostTensor cos = tensor({Lk, D / 2}, table_dtype, all.cos.values()), sin = tensor({Lk, D / 2}, table_dtype, all.sin.values());
    HostTensor qr = tensor({B, Lq, H, D}, dtype, q), kr = tensor({B, Lk, H, D}, dtype, k);
    const HostTensor qc = last_rows(cos, dtype), qs = last_rows(sin, dtype);
    rotary::apply(qr.view(), qc.view(), qs.view(), false, qr.view(), ctx);
    rotary::apply(kr.view(), cos.view(), sin.view(), false, kr.view(), ctx);
    HostTensor vv = tensor({B, Lk, H, D}, dtype, v), out({B, Lq, H, D}, dtype), lse({B, Lq, H}, dtype);
    HostTensor dd = tensor({B, Lq, H, D}, dtype, dout);
    HostTensor dq({B, Lq, H, D}, dtype), dk({B, Lk, H, D}, dtype), dv({B, Lk, H, D}, dtype);
    softmax::Options options;
    softmax::forward({qr.view(), kr.view(), vv.view()}, options, {out.view(), lse.view()}, ctx);
    options.rotary_cos = cos.view();
    options.rotary_sin = sin.view();
    softmax::backward({qr.view(), kr.view(), vv.view()}, options, {out.view(), lse.view()}, dd.view(),
                      {dq.view(), dk.view(), dv.view()}, ctx);
    return {dq.values(), dk.values()};
  }
};

TEST(SoftmaxRotary, GradientsAreWithRespectToTheUnrotatedInputs) {
  std::mt19937_64 rng(21);
  RotatedSoftmax r;
  using S = RotatedSoftmax;
  r.q = random_normal(S::B * S::Lq * S::H * S::D, rng);
  r.k = random_normal(S::B * S::Lk * S::H * S::D, rng);
  r.v = random_normal(S::B * S::Lk * S::H * S::D, rng);
  r.dout = random_normal(S::B * S::Lq * S::H * S::D, rng);
  const auto [dq, dk] = r.grads(DType::float64, Backend::reference);
  const double h = 1e-6;
  std::vector<double> fd_q(r.q.size()), fd_k(r.k.size());
  for (std::size_t i = 0; i < r.q.size(); ++i) {
    std::vector<double> plus = r.q, minus = r.q;
    plus[i] += h;
    minus[i] -= h;
    fd_q[i] = (r.loss(plus, r.k) - r.loss(minus, r.k)) / (2 * h);
  }
  for (std::size_t i = 0; i < r.k.size(); ++i) {
    std::vector<double> plus = r.k, minus = r.k;
    plus[i] += h;
    minus[i] -= h;
    fd_k[i] = (r.loss(r.q, plus) - r.loss(r.q, minus)) / (2 * h);
  }
  EXPECT_LT(relative_error(dq, fd_q), 1e-7) << "dq against central differences";
  EXPECT_LT(relative_error(dk, fd_k), 1e-7) << "dk against central differences";
  const auto [dq32, dk32] = r.grads(DType::float32, Backend::automatic);
  EXPECT_LT(relative_error(dq32, dq), 1e-5) << "CPU kernels' dq";
  EXPECT_LT(relative_error(dk32, dk), 1e-5) << "CPU kernels' dk";
}

TEST(SoftmaxRotary, BadTablesNameTheArgument) {
  HostTensor q({1, 4, 2, 8}, DType::float32), k({1, 4, 2, 8}, DType::float32), v({1, 4, 2, 8}, DType::float32);
  HostTensor out({1, 4, 2, 8}, DType::float32), lse({1, 4, 2}, DType::float32);
  HostTensor dq({1, 4, 2, 8}, DType::float32), dk({1, 4, 2, 8}, DType::float32), dv({1, 4, 2, 8}, DType::float32);
  const Tables t = tables(4, 4, DType::float32), wrong = tables(3, 4, DType::float32);
  auto backward = [&](const softmax::Options& o) {
    softmax::backward({q.view(), k.view(), v.view()}, o, {out.view(), lse.view()}, out.view(),
                      {dq.view(), dk.view(), dv.view()});
  };
  softmax::Options only_cos;
  only_cos.rotary_cos = t.cos.view();
  expect_error([&] { backward(only_cos); }, "'rotary_sin': expected a table");
  softmax::Options short_table;
  short_table.rotary_cos = wrong.cos.view();
  short_table.rotary_sin = t.sin.view();
  expect_error([&] { backward(short_table); }, "'rotary_cos': expected float32 (4, 4)");
  // sin as columns 0-3 of a (4, 8) table: the right shape, other strides. Refused before the
  // backward writes anything (its rotation after the kernels would have failed on them).
  const Tables wide = tables(4, 8, DType::float32);
  TensorView strided_sin = wide.sin.view();
  strided_sin.shape[1] = 4;
  softmax::Options strided;
  strided.rotary_cos = t.cos.view();
  strided.rotary_sin = strided_sin;
  dq.set_values(std::vector<double>(dq.numel(), 7.0));
  expect_error([&] { backward(strided); }, "'rotary_sin': expected the strides of 'rotary_cos'");
  EXPECT_EQ(dq.values(), std::vector<double>(dq.numel(), 7.0)) << "dq written before the check failed";
  const HostTensor cu = int32_tensor({0, 2, 4});
  HostTensor pq({4, 2, 8}, DType::float32), pk({4, 2, 8}, DType::float32), pv({4, 2, 8}, DType::float32);
  HostTensor pout({4, 2, 8}, DType::float32), plse({4, 2}, DType::float32);
  HostTensor pdq({4, 2, 8}, DType::float32), pdk({4, 2, 8}, DType::float32), pdv({4, 2, 8}, DType::float32);
  softmax::Options both;
  both.rotary_cos = t.cos.view();
  both.rotary_sin = t.sin.view();
  expect_error(
      [&] {
        softmax::backward({pq.view(), pk.view(), pv.view(), cu.view()}, both, {pout.view(), plse.view()}, pout.view(),
                          {pdq.view(), pdk.view(), pdv.view()});
      },
      "'rotary_cos': expected no tables with packed sequences");
}

}  // namespace
}  // namespace winnow::testing
