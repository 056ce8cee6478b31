// Threshold attention (spec/threshold.md). The float64 reference on its own: analytic gradients
// of q, k, v, beta, lambda and TDA's second view against central finite differences of its
// forward (TRA and TDA, p = 1, 2 and 1.5, GQA, suffix queries, packed sequences, shared and
// per-head beta), and the spec's checks: exact zeros below the threshold, the first query's
// zero threshold, ReLA on cosine scores at beta = 0 and p = 1, TDA's identities, invariance to
// the scale of queries and keys. Then the streaming CPU kernels against the reference (float64
// and float32, with tiles skipped and not), and the API's errors.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <optional>
#include <random>

#include "support/attention_case.h"
#include "support/expect_error.h"
#include "support/threshold_case.h"
#include "math/threshold.h"
#include "winnow/threshold.h"

namespace winnow::testing {
namespace {

using Case = ThresholdCase;
using Inputs = ThresholdInputs;
using Grads = ThresholdGrads;

Inputs make_inputs(const Case& c, std::uint64_t seed, double beta_value = 0.6, double lambda_value = 0.4) {
  return make_threshold_inputs(c, seed, beta_value, lambda_value);
}

ExecContext reference() { return reference_backend(); }

AttentionInputs attention_inputs(const Inputs& in) {
  AttentionInputs a{in.main.q.view(), in.main.k.view(), in.main.v.view(), std::nullopt, std::nullopt};
  if (in.main.cu_q) a.cu_seqlens_q = in.main.cu_q->view();
  if (in.main.cu_k) a.cu_seqlens_k = in.main.cu_k->view();
  return a;
}

threshold::Views views_of(const Inputs& in) {
  threshold::Views v;
  v.beta = in.beta.view();
  if (in.tda) {
    v.lambda = in.lambda.view();
    v.q2 = in.second.q.view();
    v.k2 = in.second.k.view();
  }
  return v;
}

std::vector<double> forward(const Inputs& in, const ExecContext& ctx = reference()) {
  return threshold_forward(in, ctx);
}
std::vector<double> survivors(const Inputs& in, const ExecContext& ctx = reference()) {
  return threshold_survivors(in, ctx);
}
Grads backward(const Inputs& in, const ExecContext& ctx = reference()) { return threshold_backward(in, ctx); }

double loss(const Inputs& in) {
  const std::vector<double> out = forward(in), dout = in.main.dout.values();
  double l = 0;
  for (std::size_t i = 0; i < out.size(); ++i) l += out[i] * dout[i];
  return l;
}

std::vector<double> finite_difference(Inputs in, HostTensor& (*pick)(Inputs&)) {
  const double h = 1e-6;
  std::vector<double> x = pick(in).values(), grad(x.size());
  for (std::size_t i = 0; i < x.size(); ++i) {
    const double x0 = x[i];
    x[i] = x0 + h;
    pick(in).set_values(x);
    const double up = loss(in);
    x[i] = x0 - h;
    pick(in).set_values(x);
    const double down = loss(in);
    x[i] = x0;
    pick(in).set_values(x);
    grad[i] = (up - down) / (2 * h);
  }
  return grad;
}

const std::vector<Case>& cases() {
  static const std::vector<Case> all = {
      {"tra_p2_gqa", {"gqa", {{7, 7}}, false, 2, 1, 4, 3}, false, 2.0, true, false},
      {"tra_p1_suffix_varlen", {"suffix_varlen", {{3, 6}, {0, 2}, {5, 5}}, true, 2, 2, 4, 2}, false, 1.0, true, false},
      {"tra_p1p5_exclusive_shared_beta", {"batched", {{6, 6}, {6, 6}}, false, 2, 1, 3, 3}, false, 1.5, false, true},
      {"tda_p2_gqa", {"gqa", {{7, 7}}, false, 4, 2, 4, 3}, true, 2.0, true, false},
      {"tda_p1_shared_varlen", {"varlen", {{4, 4}, {2, 5}}, true, 2, 1, 3, 2}, true, 1.0, true, true},
  };
  return all;
}

class ThresholdReference : public ::testing::TestWithParam<int> {};

TEST_P(ThresholdReference, GradientsMatchFiniteDifferences) {
  const Case& c = cases()[static_cast<std::size_t>(GetParam())];
  const Inputs in = make_inputs(c, 11);
  const Grads g = backward(in);
  constexpr double kTol = 1e-6;
  EXPECT_LT(relative_error(g.dq, finite_difference(in, [](Inputs& i) -> HostTensor& { return i.main.q; })), kTol) << "dq";
  EXPECT_LT(relative_error(g.dk, finite_difference(in, [](Inputs& i) -> HostTensor& { return i.main.k; })), kTol) << "dk";
  EXPECT_LT(relative_error(g.dv, finite_difference(in, [](Inputs& i) -> HostTensor& { return i.main.v; })), kTol) << "dv";
  EXPECT_LT(relative_error(g.dbeta, finite_difference(in, [](Inputs& i) -> HostTensor& { return i.beta; })), kTol) << "dbeta";
  if (c.tda) {
    EXPECT_LT(relative_error(g.dq2, finite_difference(in, [](Inputs& i) -> HostTensor& { return i.second.q; })), kTol) << "dq2";
    EXPECT_LT(relative_error(g.dk2, finite_difference(in, [](Inputs& i) -> HostTensor& { return i.second.k; })), kTol) << "dk2";
    EXPECT_LT(relative_error(g.dlambda, finite_difference(in, [](Inputs& i) -> HostTensor& { return i.lambda; })), kTol) << "dlambda";
  }
  // Some weights are zero and some are not, so both sides of the threshold are exercised.
  const std::vector<double> dbeta = g.dbeta;
  double total = 0;
  for (double d : dbeta) total += std::abs(d);
  EXPECT_GT(total, 1e-3);
}

INSTANTIATE_TEST_SUITE_P(Cases, ThresholdReference, ::testing::Range(0, static_cast<int>(cases().size())),
                         [](const ::testing::TestParamInfo<int>& info) {
                           return cases()[static_cast<std::size_t>(info.param)].name;
                         });

// The CPU kernels against the reference: float64 to rounding, float32 to its precision; with
// beta = 0.6 some key tiles have no weight (skipped), with beta = 0 none is skippable.
TEST_P(ThresholdReference, CpuKernelsMatchTheReference) {
  const Case& c = cases()[static_cast<std::size_t>(GetParam())];
  for (double beta : {0.0, 0.6}) {
    const Inputs in = make_inputs(c, 17, beta);
    const std::vector<double> want = forward(in);
    const Grads want_g = backward(in);
    for (DType dtype : {DType::float64, DType::float32}) {
      const double tol = dtype == DType::float64 ? 1e-12 : 2e-5;
      const Inputs x = converted(in, dtype);
      ExecContext cpu;
      cpu.num_threads = 3;
      SCOPED_TRACE(std::string(to_string(dtype)) + " beta " + std::to_string(beta));
      EXPECT_LT(relative_error(forward(x, cpu), want), tol) << "out";
      const Grads got = backward(x, cpu);
      EXPECT_LT(relative_error(got.dq, want_g.dq), tol) << "dq";
      EXPECT_LT(relative_error(got.dk, want_g.dk), tol) << "dk";
      EXPECT_LT(relative_error(got.dv, want_g.dv), tol) << "dv";
      EXPECT_LT(relative_error(got.dbeta, want_g.dbeta), tol) << "dbeta";
      if (c.tda) {
        EXPECT_LT(relative_error(got.dq2, want_g.dq2), tol) << "dq2";
        EXPECT_LT(relative_error(got.dk2, want_g.dk2), tol) << "dk2";
        EXPECT_LT(relative_error(got.dlambda, want_g.dlambda), tol) << "dlambda";
      }
    }
  }
}

// Long enough for several key tiles, so that whole tiles fall below the threshold and are
// skipped while others are not.
TEST(ThresholdCpu, LongSequencesMatchTheReference) {
  for (bool tda : {false, true}) {
    const Case c{"long", {"long", {{150, 150}}, false, 2, 1, 8, 4}, tda, 2.0, true, false};
    const Inputs in = make_inputs(c, 23, 0.8);
    ExecContext cpu;
    const Grads want = backward(in), got = backward(in, cpu);
    EXPECT_LT(relative_error(forward(in, cpu), forward(in)), 1e-12) << tda;
    EXPECT_LT(relative_error(got.dq, want.dq), 1e-12) << tda;
    EXPECT_LT(relative_error(got.dk, want.dk), 1e-12) << tda;
    EXPECT_LT(relative_error(got.dv, want.dv), 1e-12) << tda;
    EXPECT_LT(relative_error(got.dbeta, want.dbeta), 1e-12) << tda;
  }
}

// Cosine similarity of rows a and b of (L, H, D) tensors, head h.
double cosine(const std::vector<double>& q, std::int64_t jq, const std::vector<double>& k,
              std::int64_t ik, std::int64_t hq, std::int64_t hk, std::int64_t Hq, std::int64_t Hk,
              std::int64_t D) {
  double dot = 0, nq = 0, nk = 0;
  for (std::int64_t d = 0; d < D; ++d) {
    const double a = q[static_cast<std::size_t>((jq * Hq + hq) * D + d)];
    const double b = k[static_cast<std::size_t>((ik * Hk + hk) * D + d)];
    dot += a * b;
    nq += a * a;
    nk += b * b;
  }
  return dot / std::sqrt(nq) / std::sqrt(nk);
}

const Case kOneSequence{"one", {"one", {{9, 9}}, false, 2, 1, 5, 3}, false, 1.0, true, false};

TEST(ThresholdReference, BetaZeroPowerOneIsReLAOnCosineScores) {
  Inputs in = make_inputs(kOneSequence, 3);
  in.beta.fill(0.0);
  const std::vector<double> out = forward(in);
  const std::vector<double> q = in.main.q.values(), k = in.main.k.values(), v = in.main.v.values();
  std::vector<double> want(out.size(), 0.0);
  for (std::int64_t h = 0; h < 2; ++h) {
    for (std::int64_t j = 0; j < 9; ++j) {
      for (std::int64_t i = 0; i <= j; ++i) {
        const double w = std::max(0.0, cosine(q, j, k, i, h, 0, 2, 1, 5));
        for (std::int64_t d = 0; d < 3; ++d) {
          want[static_cast<std::size_t>((j * 2 + h) * 3 + d)] += w * v[static_cast<std::size_t>(i * 3 + d)];
        }
      }
    }
  }
  EXPECT_LT(relative_error(out, want), 1e-13);
}

TEST(ThresholdReference, HighThresholdLeavesExactZerosAndTheFirstQueryItsOwnKey) {
  // beta = 100 puts tau_j above any cosine for every query that sees two keys or more; the
  // first sees one, so tau_0 = 0 and it keeps relu(cos(q_0, k_0))^p of its own value.
  Case c = kOneSequence;
  c.power = 2.0;
  Inputs in = make_inputs(c, 5, /*beta=*/100.0);
  const std::vector<double> out = forward(in);
  const std::vector<double> q = in.main.q.values(), k = in.main.k.values(), v = in.main.v.values();
  for (std::int64_t h = 0; h < 2; ++h) {
    const double w = std::pow(std::max(0.0, cosine(q, 0, k, 0, h, 0, 2, 1, 5)), 2.0);
    for (std::int64_t d = 0; d < 3; ++d) {
      EXPECT_NEAR(out[static_cast<std::size_t>(h * 3 + d)], w * v[static_cast<std::size_t>(d)], 1e-14);
    }
  }
  for (std::size_t e = 2 * 3; e < out.size(); ++e) EXPECT_EQ(out[e], 0.0) << e;
  // Zero weights pass no gradient to q, k or v of the later rows, and beta's gradient is 0.
  const Grads g = backward(in);
  for (double d : g.dbeta) EXPECT_EQ(d, 0.0);
  for (std::size_t e = 2 * 5; e < g.dq.size(); ++e) EXPECT_EQ(g.dq[e], 0.0) << e;
}

// The CUDA forward's screen (math/threshold.h, screen_*): rows normalized and rounded to bf16
// and fp16 as the kernels store them, quantized to int8 as the kernels do (in float32); for
// every pair the 8-bit product is within screen_margin of the 16-bit score, and every pair at or
// below screen_cut (with tile-wide largest scale and error) scores at most tau. Random rows and
// the awkward ones: one-hot, flat, one large feature among small ones, the zero row.
TEST(ThresholdScreen, IntegerProductsBoundTheScores) {
  namespace mt = math::threshold;
  for (DType dtype : {DType::bfloat16, DType::float16}) {
    for (std::int64_t D : {64, 128}) {
      const std::int64_t n = 96;
      std::mt19937_64 rng(31 + static_cast<std::uint64_t>(D));
      std::normal_distribution<double> normal;
      HostTensor rows({n, D}, DType::float64);
      std::vector<double> x(static_cast<std::size_t>(n * D));
      for (std::int64_t r = 0; r < n; ++r) {
        for (std::int64_t d = 0; d < D; ++d) {
          double value = normal(rng);
          if (r == 0) value = d == 3 ? 1.0 : 0.0;                    // one-hot
          if (r == 1) value = 1.0;                                   // flat
          if (r == 2) value = d == 5 ? 40.0 : 1e-3 * normal(rng);    // one large feature
          if (r == 3) value = 0.0;                                   // the zero row
          if (r >= 4 && r < 8) value = x[static_cast<std::size_t>((r - 4) * D + d)] * 0.999 + 1e-3 * normal(rng);
          x[static_cast<std::size_t>(r * D + d)] = value;
        }
        double sum = 0;
        for (std::int64_t d = 0; d < D; ++d) sum += x[static_cast<std::size_t>(r * D + d)] * x[static_cast<std::size_t>(r * D + d)];
        const double inv = 1.0 / std::max(std::sqrt(sum), 1e-6);
        for (std::int64_t d = 0; d < D; ++d) x[static_cast<std::size_t>(r * D + d)] *= inv;
      }
      rows.set_values(x);
      const std::vector<double> hat = rows.converted(dtype).converted(DType::float64).values();
      std::vector<int> codes(hat.size());
      std::vector<float> scale(static_cast<std::size_t>(n)), err(static_cast<std::size_t>(n));
      for (std::int64_t r = 0; r < n; ++r) {
        float largest = 0.f;
        for (std::int64_t d = 0; d < D; ++d) largest = std::max(largest, std::abs(static_cast<float>(hat[static_cast<std::size_t>(r * D + d)])));
        const float s = mt::screen_scale(largest), inverse = mt::screen_inverse_scale(largest);
        float e2 = 0.f;
        for (std::int64_t d = 0; d < D; ++d) {
          const float a = static_cast<float>(hat[static_cast<std::size_t>(r * D + d)]);
          const int c = mt::screen_quantize(a, inverse);
          ASSERT_LE(std::abs(c), mt::kScreenLevels);
          codes[static_cast<std::size_t>(r * D + d)] = c;
          e2 += (a - s * static_cast<float>(c)) * (a - s * static_cast<float>(c));
        }
        scale[static_cast<std::size_t>(r)] = s;
        err[static_cast<std::size_t>(r)] = std::sqrt(e2);
      }
      const float scale_max = *std::max_element(scale.begin(), scale.end());
      const float err_max = *std::max_element(err.begin(), err.end());
      int ruled_out = 0;
      for (std::int64_t a = 0; a < n; ++a) {
        for (std::int64_t b = 0; b < n; ++b) {
          double score = 0;
          long long product = 0;
          for (std::int64_t d = 0; d < D; ++d) {
            score += hat[static_cast<std::size_t>(a * D + d)] * hat[static_cast<std::size_t>(b * D + d)];
            product += static_cast<long long>(codes[static_cast<std::size_t>(a * D + d)]) * codes[static_cast<std::size_t>(b * D + d)];
          }
          const double approx = static_cast<double>(scale[static_cast<std::size_t>(a)]) * scale[static_cast<std::size_t>(b)] * static_cast<double>(product);
          ASSERT_LE(std::abs(score - approx), mt::screen_margin(err[static_cast<std::size_t>(a)], err[static_cast<std::size_t>(b)]))
              << to_string(dtype) << " D " << D << " rows " << a << " " << b;
          for (float tau : {0.05f, 0.2f, 0.35f, 0.6f, 0.95f}) {
            const float cut = mt::screen_cut(tau, err[static_cast<std::size_t>(a)], scale[static_cast<std::size_t>(a)], err_max, scale_max);
            // The kernel's form: the row's terms once, the tile's reciprocal scale.
            const float tile_cut = mt::screen_tile_cut(
                mt::screen_row_cut(tau, err[static_cast<std::size_t>(a)], scale[static_cast<std::size_t>(a)]), err_max,
                1.f / scale_max);
            // Within a tenth of the slack, in score units, of the divided form.
            EXPECT_LE(std::abs(static_cast<double>(tile_cut) - cut) * scale[static_cast<std::size_t>(a)] * scale_max,
                      0.1 * mt::kScreenSlack)
                << to_string(dtype) << " D " << D << " rows " << a << " " << b << " tau " << tau;
            for (const float c : {cut, tile_cut}) {
              if (!(c >= 1.f) || static_cast<double>(product) > std::floor(c)) continue;
              ++ruled_out;
              EXPECT_LE(score, static_cast<double>(tau)) << to_string(dtype) << " D " << D << " rows " << a << " " << b;
            }
          }
        }
      }
      EXPECT_GT(ruled_out, 2 * n * n) << "the screen rules out most pairs of random rows at these thresholds";
    }
  }
}

// nonzero counts the keys a row keeps in some view: at beta = 0 and p = 1 (ReLA) the keys with
// a positive cosine; at a huge beta none but the first query's own key.
TEST(ThresholdReference, NonzeroCountsTheSurvivingKeys) {
  Inputs in = make_inputs(kOneSequence, 3);
  in.beta.fill(0.0);
  const std::vector<double> q = in.main.q.values(), k = in.main.k.values();
  std::vector<double> want;
  for (std::int64_t j = 0; j < 9; ++j) {
    for (std::int64_t h = 0; h < 2; ++h) {
      double n = 0;
      for (std::int64_t i = 0; i <= j; ++i) n += cosine(q, j, k, i, h, 0, 2, 1, 5) > 0 ? 1 : 0;
      want.push_back(n);
    }
  }
  ExecContext cpu;
  for (const ExecContext& ctx : {reference(), cpu}) {
    EXPECT_EQ(survivors(in, ctx), want);
    EXPECT_EQ(survivors(converted(in, DType::float32), ctx.backend == Backend::reference ? cpu : ctx), want);
  }
  in.beta.fill(100.0);
  const std::vector<double> none = survivors(in);
  for (std::size_t e = 2; e < none.size(); ++e) EXPECT_EQ(none[e], 0.0) << e;
  // TDA: a key counts once whichever views keep it; the kernels agree with the reference.
  Case c = kOneSequence;
  c.tda = true;
  const Case long_case{"long", {"long", {{150, 150}}, false, 2, 1, 8, 4}, true, 2.0, true, false};
  for (const Case& tc : {c, long_case}) {
    const Inputs t = make_inputs(tc, 29, 0.4);
    const std::vector<double> ref = survivors(t);
    EXPECT_EQ(survivors(t, cpu), ref);
    double total = 0;
    for (double x : ref) total += x;
    EXPECT_GT(total, 0.0);
  }
}

TEST(ThresholdReference, NormalizationMakesTheScaleOfQueriesAndKeysIrrelevant) {
  Inputs in = make_inputs(kOneSequence, 7);
  const std::vector<double> before = forward(in);
  std::vector<double> q = in.main.q.values(), k = in.main.k.values();
  for (double& x : q) x *= 7.5;
  for (double& x : k) x *= 0.01;
  in.main.q.set_values(q);
  in.main.k.set_values(k);
  EXPECT_LT(relative_error(forward(in), before), 1e-13);
}

TEST(ThresholdReference, DifferentialIdentities) {
  Case c = kOneSequence;
  c.tda = true;
  // lambda = 0: TDA is TRA of the first view.
  Inputs zero = make_inputs(c, 9, 0.3, /*lambda=*/0.0);
  zero.lambda.fill(0.0);
  Inputs tra = zero;
  tra.tda = false;
  EXPECT_EQ(forward(zero), forward(tra));
  // The same view twice with lambda = 1 cancels exactly.
  Inputs same = make_inputs(c, 9, 0.3);
  same.lambda.fill(1.0);
  same.second.q = same.main.q;
  same.second.k = same.main.k;
  for (double x : forward(same)) EXPECT_EQ(x, 0.0);
  // Clamped: lambda = 1.7 acts as 1 and gets no gradient; unclamped it acts as itself.
  Inputs over = same;
  over.lambda.fill(1.7);
  for (double x : forward(over)) EXPECT_EQ(x, 0.0);
  for (double d : backward(over).dlambda) EXPECT_EQ(d, 0.0);
  over.options.clamp_lambda = false;
  const std::vector<double> unclamped = forward(over), tra_out = forward([&] {
    Inputs t = over;
    t.tda = false;
    return t;
  }());
  for (std::size_t e = 0; e < unclamped.size(); ++e) EXPECT_NEAR(unclamped[e], -0.7 * tra_out[e], 1e-14);
}

TEST(ThresholdApi, ErrorsNameTheArgument) {
  const Inputs in = make_inputs(kOneSequence, 13);
  HostTensor out(in.main.dout.shape(), DType::float64);
  auto call = [&](const std::function<void(threshold::Views&, threshold::Options&)>& edit) {
    threshold::Views v = views_of(in);
    threshold::Options o = in.options;
    edit(v, o);
    threshold::forward(attention_inputs(in), v, o, {out.view()}, reference());
  };
  expect_error([&] { call([](threshold::Views&, threshold::Options& o) { o.power = 0; }); }, "'power'");
  expect_error([&] { call([](threshold::Views&, threshold::Options& o) { o.norm_eps = -1; }); }, "'norm_eps'");
  HostTensor wrong({3}, DType::float64), f32({2}, DType::float32);
  expect_error([&] { call([&](threshold::Views& v, threshold::Options&) { v.beta = wrong.view(); }); },
               "argument 'beta': expected float64 (2) or (1)");
  expect_error([&] { call([&](threshold::Views& v, threshold::Options&) { v.beta = f32.view(); }); }, "'beta'");
  expect_error([&] { call([&](threshold::Views& v, threshold::Options&) { v.q2 = in.main.q.view(); }); },
               "'q2': expected no second view without lambda");
  expect_error([&] {
    call([&](threshold::Views& v, threshold::Options&) { v.lambda = in.lambda.view(); });
  }, "'q2'");
  // beta in another dtype than the statistics' (float32 inputs take float32 scalars).
  const Inputs x = converted(in, DType::float32);
  HostTensor out32(in.main.dout.shape(), DType::float32);
  threshold::Views v = views_of(x);
  v.beta = in.beta.view();
  expect_error([&] { threshold::forward(attention_inputs(x), v, x.options, {out32.view()}); },
               "argument 'beta': expected float32");
}

// The saved rows are the CUDA route's: a forward or backward elsewhere is told so, by name,
// before it writes anything.
TEST(ThresholdApi, SavedRowsAreForTheCudaRouteOnly) {
  const Inputs in = make_inputs(kOneSequence, 13);
  HostTensor out(in.main.dout.shape(), DType::float64);
  out.fill(7.0);
  const std::int64_t dim = in.main.q.shape().back();
  HostTensor rows({threshold::saved_rows_size<std::int64_t>(in.main.q.numel() / dim, in.main.k.numel() / dim, dim, 8,
                                                            in.tda ? 2 : 1, 0)},
                  DType::int32);
  for (const ExecContext& ctx : {reference(), ExecContext{}}) {
    expect_error([&] { threshold::forward(attention_inputs(in), views_of(in), in.options, {out.view(), std::nullopt, rows.view()}, ctx); },
                 "argument 'saved_rows': expected none: only the CUDA route keeps the normalized rows");
    for (double x : out.values()) ASSERT_EQ(x, 7.0);
  }
  HostTensor dq(in.main.q.shape(), DType::float64), dk(in.main.k.shape(), DType::float64),
      dv(in.main.v.shape(), DType::float64), dbeta(in.beta.shape(), DType::float64);
  threshold::ViewGrads vg;
  vg.dbeta = dbeta.view();
  expect_error([&] {
    threshold::backward(attention_inputs(in), views_of(in), in.options, in.main.dout.view(),
                        {dq.view(), dk.view(), dv.view()}, vg, {}, rows.view());
  }, "argument 'saved_rows'");
}

// The record's length: per view the normalized q and k rows and their inverse norms, each
// segment rounded up to 256 bytes, then the support map, in int32 elements.
TEST(ThresholdApi, SavedRowsSize) {
  // 10 query rows x 2 heads and 7 key rows x 1 head of D 64 in bf16, TDA: q 2560 bytes, k 896
  // -> 1024, inverse norms 80 -> 256 and 28 -> 256.
  EXPECT_EQ(threshold::saved_rows_size<std::int64_t>(20, 7, 64, 2, 2, 5), 2 * (2560 + 1024 + 256 + 256) / 4 + 5);
  EXPECT_EQ(threshold::saved_rows_size<std::int64_t>(0, 0, 64, 2, 1, 0), 0);
  // The map: a flag padded to 256 bytes, then per head and row tile (sequences + ceil(rows / 64))
  // a row of words, a bit per 128 keys. 2 sequences of 100 rows, 3 heads, 5000 keys: 2 + 4 row
  // tiles, 40 cells in 2 words; 3 x 6 x 2 words = 144 bytes -> 256.
  EXPECT_EQ(threshold::saved_support_words<std::int64_t>(2, 3, 200, 5000), 64 + 64);
  // 4096 keys are 32 cells, one word; 4097 two.
  EXPECT_EQ(threshold::saved_support_words<std::int64_t>(1, 64, 64, 4096), 64 + 2 * 64 * 1 * 4 / 4);
  EXPECT_EQ(threshold::saved_support_words<std::int64_t>(1, 64, 64, 4097), 64 + 2 * 64 * 2 * 4 / 4);
}

// The CUDA kernels' per-score form (math::threshold::weight_and_slope, through relu) against the
// two separate definitions, bit for bit, in float as the kernels call it: around the threshold,
// far from it, at the -inf the kernels give the scores they leave out, and at NaN.
TEST(ThresholdMath, WeightAndSlopeAtOnceEqualTheSeparateForms) {
  namespace mt = math::threshold;
  const float inf = std::numeric_limits<float>::infinity();
  const float xs[] = {-inf, -3.f, -1e-30f, -0.f, 0.f, 1e-30f, 1e-7f, 0.3f, 1.f, 2.5f, 1e19f, std::nanf("")};
  for (float p : {2.f, 1.f, 1.5f, 0.5f, 3.f}) {
    for (float x : xs) {
      const mt::WeightSlope<float> ws = mt::weight_and_slope(x, p);
      SCOPED_TRACE("p " + std::to_string(p) + " x " + std::to_string(x));
      EXPECT_EQ(ws.weight, mt::weight(x, p));
      EXPECT_EQ(ws.slope, mt::weight_slope(x, p));
      // The form the key-stationary kernel takes (p = 2 and 1 there): the slope over p, which
      // times p gives the slope's bits back.
      const mt::WeightSlope<float> over = mt::weight_and_slope_over_p(x, p);
      EXPECT_EQ(over.weight, ws.weight);
      if (p == 2.f || p == 1.f) EXPECT_EQ(p * over.slope, ws.slope);
    }
  }
}

}  // namespace
}  // namespace winnow::testing
