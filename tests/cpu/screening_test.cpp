// Multiscreen's screening (spec/screening.md). The float64 reference on its own: analytic
// gradients of q, k, v, s_w and s_r against central finite differences of its forward (GQA,
// suffix queries, packed sequences, shared scalars, window expansion), and the spec's checks:
// zeros outside the window and below the Trim threshold, a row whose keys are all rejected
// outputs exactly zero, MiPE's fade to the identity at w_th, invariance to a shift of every
// position, window expansion as the w -> infinity limit, one row worked by hand. Then the
// streaming CPU kernels against the reference (float64 and float32), and the API's errors.
#include <gtest/gtest.h>

#include <cmath>
#include <functional>

#include "math/screening.h"
#include "support/expect_error.h"
#include "support/screening_case.h"
#include "winnow/screening.h"

namespace winnow::testing {
namespace {

using Case = ScreeningCase;
using Inputs = ScreeningInputs;
using Results = ScreeningResults;

ExecContext reference() {
  ExecContext ctx;
  ctx.backend = Backend::reference;
  return ctx;
}

ExecContext cpu_kernels(int threads = 3) {
  ExecContext ctx;
  ctx.num_threads = threads;
  return ctx;
}

double loss(const Inputs& in) {
  const std::vector<double> out = screening_forward(in, reference()).out, dout = in.main.dout.values();
  double l = 0;
  for (std::size_t i = 0; i < out.size(); ++i) l += out[i] * dout[i];
  return l;
}

// A small step: Trim's square is only once differentiable where a score meets 1 - r, and a
// central difference straddling that point errs by O(h).
std::vector<double> finite_difference(Inputs in, const std::function<HostTensor&(Inputs&)>& pick) {
  const double h = 1e-7;
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

double abs_sum(const std::vector<double>& x) {
  double s = 0;
  for (double v : x) s += std::abs(v);
  return s;
}

const std::vector<Case>& cases() {
  static const std::vector<Case> all = {
      {"one_head", {"one", {{9, 9}}, false, 1, 1, 4, 3}},
      {"gqa_four_windows", {"gqa", {{12, 12}}, false, 4, 2, 4, 3}},
      {"suffix_varlen", {"suffix_varlen", {{3, 6}, {0, 2}, {5, 5}}, true, 2, 2, 5, 2}},
      {"batched_shared_scalars", {"batched", {{6, 6}, {6, 6}}, false, 2, 1, 3, 3}, {5.0}, {0.9}, true},
      {"window_expansion", {"expanded", {{10, 10}}, false, 2, 1, 4, 3}, {3.5, 12.0}, {0.85, 0.9}, false, 8.0},
      {"dk16_dv8", {"dk16", {{7, 7}}, false, 2, 1, 16, 8}, {2.5, 6.0}, {0.8, 0.9}},
  };
  return all;
}

class ScreeningReference : public ::testing::TestWithParam<int> {};

TEST_P(ScreeningReference, GradientsMatchFiniteDifferences) {
  const Case& c = cases()[static_cast<std::size_t>(GetParam())];
  const Inputs in = make_screening_inputs(c, 11);
  const Results g = screening_run(in, reference());
  constexpr double kTol = 1e-6;
  EXPECT_LT(relative_error(g.dq, finite_difference(in, [](Inputs& i) -> HostTensor& { return i.main.q; })), kTol) << "dq";
  EXPECT_LT(relative_error(g.dk, finite_difference(in, [](Inputs& i) -> HostTensor& { return i.main.k; })), kTol) << "dk";
  EXPECT_LT(relative_error(g.dv, finite_difference(in, [](Inputs& i) -> HostTensor& { return i.main.v; })), kTol) << "dv";
  EXPECT_LT(relative_error(g.ds_w, finite_difference(in, [](Inputs& i) -> HostTensor& { return i.s_w; })), kTol) << "ds_w";
  EXPECT_LT(relative_error(g.ds_r, finite_difference(in, [](Inputs& i) -> HostTensor& { return i.s_r; })), kTol) << "ds_r";
  // Both sides of the Trim are exercised: some relevance is nonzero.
  EXPECT_GT(abs_sum(g.ds_r), 1e-3);
  EXPECT_GT(abs_sum(g.out), 1e-3);
}

// The streaming CPU kernels against the reference: float64 to rounding, float32 to its precision.
TEST_P(ScreeningReference, CpuKernelsMatchTheReference) {
  const Case& c = cases()[static_cast<std::size_t>(GetParam())];
  const Inputs in = make_screening_inputs(c, 17);
  const Results want = screening_run(in, reference());
  for (DType dtype : {DType::float64, DType::float32}) {
    const double tol = dtype == DType::float64 ? 1e-12 : 2e-5;
    SCOPED_TRACE(to_string(dtype));
    const Results got = screening_run(converted_for_kernels(in, dtype), cpu_kernels());
    EXPECT_LT(relative_error(got.out, want.out), tol) << "out";
    EXPECT_LT(relative_error(got.h_norm, want.h_norm), tol) << "h_norm";
    EXPECT_LT(relative_error(got.dq, want.dq), tol) << "dq";
    EXPECT_LT(relative_error(got.dk, want.dk), tol) << "dk";
    EXPECT_LT(relative_error(got.dv, want.dv), tol) << "dv";
    EXPECT_LT(relative_error(got.ds_w, want.ds_w), tol) << "ds_w";
    EXPECT_LT(relative_error(got.ds_r, want.ds_r), tol) << "ds_r";
  }
}

INSTANTIATE_TEST_SUITE_P(Cases, ScreeningReference, ::testing::Range(0, static_cast<int>(cases().size())),
                         [](const ::testing::TestParamInfo<int>& info) {
                           return cases()[static_cast<std::size_t>(info.param)].name;
                         });

// Long enough for several key tiles: windows narrower than a tile, wider than one, and one past
// w_th (MiPE off), with query tiles whose windows start mid-tile.
TEST(ScreeningCpu, LongSequencesMatchTheReference) {
  const Case c{"long", {"long", {{150, 150}, {150, 150}}, false, 4, 2, 16, 24}, {3.5, 70.0, 300.0, 130.0}, {0.8, 0.85, 0.75, 0.9}};
  const Inputs in = make_screening_inputs(c, 23);
  const Results want = screening_run(in, reference());
  for (DType dtype : {DType::float64, DType::float32}) {
    const double tol = dtype == DType::float64 ? 1e-12 : 2e-5;
    SCOPED_TRACE(to_string(dtype));
    const Results got = screening_run(converted_for_kernels(in, dtype), cpu_kernels(2));
    EXPECT_LT(relative_error(got.out, want.out), tol) << "out";
    EXPECT_LT(relative_error(got.dq, want.dq), tol) << "dq";
    EXPECT_LT(relative_error(got.dk, want.dk), tol) << "dk";
    EXPECT_LT(relative_error(got.dv, want.dv), tol) << "dv";
    EXPECT_LT(relative_error(got.ds_w, want.ds_w), tol) << "ds_w";
    EXPECT_LT(relative_error(got.ds_r, want.ds_r), tol) << "ds_r";
  }
}

// With a tiny acceptance width no key clears the Trim: every output, norm and gradient is
// exactly zero (the model's "no relevant context"), on both backends.
TEST(ScreeningReference, AllRejectedRowsOutputExactZeros) {
  Case c{"rejected", {"rejected", {{20, 20}}, false, 2, 1, 8, 4}, {6.0, 300.0}, {1e-3, 1e-3}};
  const Inputs in = make_screening_inputs(c, 5);
  for (const ExecContext& ctx : {reference(), cpu_kernels()}) {
    const Results r = screening_run(in, ctx);
    for (const auto* x : {&r.out, &r.h_norm, &r.dq, &r.dk, &r.dv, &r.ds_w, &r.ds_r}) {
      for (double v : *x) EXPECT_EQ(v, 0.0);
    }
  }
}

// Keys at or beyond a head's window (j <= i - w) have no effect: rewriting them leaves the rows
// that cannot see them unchanged, bit for bit.
TEST(ScreeningReference, KeysOutsideTheWindowAreNeverSeen) {
  const Case c{"window", {"window", {{40, 40}}, false, 1, 1, 4, 3}, {5.5}, {0.9}};
  const Inputs in = make_screening_inputs(c, 7);
  Inputs far = in;
  std::vector<double> k = far.main.k.values(), v = far.main.v.values();
  for (std::size_t e = 0; e < 21 * 4; ++e) k[e] = -3.0 * k[e] + 1.0;
  for (std::size_t e = 0; e < 21 * 3; ++e) v[e] = 2.0 * v[e] - 0.5;
  far.main.k.set_values(k);
  far.main.v.set_values(v);
  for (const ExecContext& ctx : {reference(), cpu_kernels()}) {
    const std::vector<double> a = screening_forward(in, ctx).out, b = screening_forward(far, ctx).out;
    // Row i sees keys j > i - 5.5: rows from 26 on see none of keys 0 .. 20.
    for (std::size_t e = 26 * 3; e < a.size(); ++e) EXPECT_EQ(a[e], b[e]) << e;
    double changed = 0;
    for (std::size_t e = 0; e < 26 * 3; ++e) changed += std::abs(a[e] - b[e]);
    EXPECT_GT(changed, 0.0);
  }
}

// One query against two keys, written out by hand from the spec (no MiPE: w > w_th).
TEST(ScreeningReference, OneRowByHand) {
  const Case c{"hand", {"hand", {{1, 2}}, false, 1, 1, 3, 2}, {300.0}, {0.9}};
  Inputs in = make_screening_inputs(c, 3);
  in.main.q.set_values({1.0, 0.5, 0.0});
  in.main.k.set_values({2.0, 0.8, 0.2, 0.0, 0.0, 3.0});  // accepted, rejected
  in.main.v.set_values({3.0, 4.0, 1.0, 0.0});
  const double w = 300.0, r = 0.9;
  const double qn[3] = {1 / std::sqrt(1.25), 0.5 / std::sqrt(1.25), 0.0};
  const double kn = std::sqrt(4.0 + 0.64 + 0.04);
  const double s0 = (qn[0] * 2.0 + qn[1] * 0.8) / kn;
  const double t = 1 - (1 - s0) / r;
  ASSERT_GT(t, 0.0);
  const double m0 = 0.5 * (std::cos(-M_PI / w) + 1);  // key 0 is at d = -1
  const double rel = t * t * m0;
  const double h[2] = {rel * 0.6, rel * 0.8};
  const double n = std::hypot(h[0], h[1]);
  for (const ExecContext& ctx : {reference(), cpu_kernels()}) {
    const Results got = screening_forward(in, ctx);
    EXPECT_NEAR(got.out[0], std::tanh(n) / n * h[0], 1e-14);
    EXPECT_NEAR(got.out[1], std::tanh(n) / n * h[1], 1e-14);
    EXPECT_NEAR(got.h_norm[0], n, 1e-14);
  }
}

// MiPE fades out continuously and is exactly the identity from w_th on.
TEST(ScreeningMath, MipeFadesToTheIdentityAtTheThreshold) {
  namespace ms = math::screening;
  EXPECT_EQ(ms::mipe_rate(256.0, 256.0), 0.0);
  EXPECT_EQ(ms::mipe_rate(1e6, 256.0), 0.0);
  EXPECT_LT(ms::mipe_rate(256.0 - 1e-4, 256.0), 1e-10);
  EXPECT_NEAR(ms::mipe_rate(2.0, 256.0), M_PI * 0.5 * (std::cos(M_PI * 2.0 / 256.0) + 1) / 2.0, 1e-15);
  // The slope against a central difference, inside the fade.
  for (double w : {1.5, 20.0, 200.0}) {
    const double h = 1e-6;
    EXPECT_NEAR(ms::mipe_rate_slope(w, 256.0), (ms::mipe_rate(w + h, 256.0) - ms::mipe_rate(w - h, 256.0)) / (2 * h), 1e-7);
  }
  // TanhNorm's backward factor at small norms, against its closed form.
  // (Long double stands in for the exact value; its own cancellation stays below 1e-11 here.)
  for (double n : {1e-3, 3e-3, 0.049, 0.051, 0.1, 0.3, 0.499, 0.501, 0.8, 2.0, 9.0}) {
    const long double x = n, t = std::tanh(x), f = t / x;
    const long double fp = (x / (std::cosh(x) * std::cosh(x)) - t) / (x * x);
    const double want = static_cast<double>(fp / (x * f * f));
    if (n >= 0.04) EXPECT_NEAR(ms::tanh_norm_phi(n), want, 1e-10) << n;
    EXPECT_NEAR(ms::tanh_norm_phi(static_cast<float>(n)), want, 2e-6) << n;
  }
}

// Like RoPE, MiPE makes scores depend on positions through j - i only: prefixing every sequence
// with zero keys (which nothing accepts) shifts every position and changes no output.
TEST(ScreeningReference, ShiftingEveryPositionChangesNothing) {
  const std::int64_t L = 30, P = 11;
  const Case a_case{"a", {"a", {{L, L}}, false, 2, 1, 4, 3}, {4.5, 20.0}, {0.8, 0.9}};
  const Inputs a = make_screening_inputs(a_case, 19);
  const Case b_case{"b", {"b", {{L, L + P}}, false, 2, 1, 4, 3}, {4.5, 20.0}, {0.8, 0.9}};
  Inputs b = make_screening_inputs(b_case, 19);
  b.main.q = a.main.q;
  b.main.dout = a.main.dout;
  std::vector<double> k(static_cast<std::size_t>((L + P) * 4), 0.0), v(static_cast<std::size_t>((L + P) * 3), 0.0);
  const std::vector<double> ak = a.main.k.values(), av = a.main.v.values();
  std::copy(ak.begin(), ak.end(), k.begin() + P * 4);
  std::copy(av.begin(), av.end(), v.begin() + P * 3);
  b.main.k.set_values(k);
  b.main.v.set_values(v);
  for (const ExecContext& ctx : {reference(), cpu_kernels()}) {
    const Results ra = screening_run(a, ctx), rb = screening_run(b, ctx);
    EXPECT_LT(relative_error(rb.out, ra.out), 1e-12);
    EXPECT_LT(relative_error(rb.dq, ra.dq), 1e-10);
    EXPECT_LT(relative_error(rb.ds_w, ra.ds_w), 1e-9);
    EXPECT_LT(relative_error(rb.ds_r, ra.ds_r), 1e-10);
  }
}

// Window expansion is the w -> infinity limit: a head expanded at w = 20 matches one with an
// astronomically wide window, and gets no s_w gradient.
TEST(ScreeningReference, WindowExpansionIsTheInfiniteWindowLimit) {
  Case wide{"wide", {"wide", {{25, 25}}, false, 2, 1, 4, 3}, {1e9, 1e9}, {0.8, 0.9}};
  Case expanded = wide;
  expanded.windows = {20.0, 20.0};
  expanded.expand_above = 10.0;
  const Inputs a = make_screening_inputs(wide, 29), b0 = make_screening_inputs(expanded, 29);
  for (const ExecContext& ctx : {reference(), cpu_kernels()}) {
    const Results ra = screening_run(a, ctx), rb = screening_run(b0, ctx);
    EXPECT_LT(relative_error(rb.out, ra.out), 1e-9);
    EXPECT_LT(relative_error(rb.dq, ra.dq), 1e-9);
    EXPECT_LT(relative_error(rb.dk, ra.dk), 1e-9);
    EXPECT_LT(relative_error(rb.ds_r, ra.ds_r), 1e-9);
    for (double x : rb.ds_w) EXPECT_EQ(x, 0.0);
  }
}

TEST(ScreeningApi, ErrorsNameTheArgument) {
  const Case c{"api", {"api", {{5, 5}}, false, 2, 1, 4, 3}};
  const Inputs in = make_screening_inputs(c, 13);
  HostTensor out(in.main.dout.shape(), DType::float64), h_norm({1, 5, 2}, DType::float64);
  AttentionInputs a{in.main.q.view(), in.main.k.view(), in.main.v.view(), std::nullopt, std::nullopt};
  auto call = [&](const std::function<void(screening::Scalars&, screening::Options&, screening::Outputs&)>& edit) {
    screening::Scalars s{in.s_w.view(), in.s_r.view()};
    screening::Options o = in.options;
    screening::Outputs outputs{out.view(), h_norm.view()};
    edit(s, o, outputs);
    screening::forward(a, s, o, outputs, reference());
  };
  using S = screening::Scalars;
  using O = screening::Options;
  using Out = screening::Outputs;
  expect_error([&] { call([](S&, O& o, Out&) { o.mipe_threshold = 0; }); }, "'mipe_threshold'");
  expect_error([&] { call([](S&, O& o, Out&) { o.expand_windows_above = -1; }); }, "'expand_windows_above'");
  expect_error([&] { call([](S&, O& o, Out&) { o.norm_eps = 0; }); }, "'norm_eps'");
  HostTensor wrong({3}, DType::float64), f32({2}, DType::float32), bad_norm({1, 5, 2}, DType::float32);
  expect_error([&] { call([&](S& s, O&, Out&) { s.s_w = wrong.view(); }); }, "argument 's_w': expected float64 (2) or (1)");
  expect_error([&] { call([&](S& s, O&, Out&) { s.s_r = f32.view(); }); }, "'s_r'");
  expect_error([&] { call([&](S&, O&, Out& o) { o.h_norm = bad_norm.view(); }); }, "'h_norm'");
  // MiPE needs two coordinates.
  const Case one_dim{"dim1", {"dim1", {{5, 5}}, false, 2, 1, 1, 3}};
  const Inputs x = make_screening_inputs(one_dim, 13);
  const AttentionInputs ax{x.main.q.view(), x.main.k.view(), x.main.v.view(), std::nullopt, std::nullopt};
  expect_error([&] { screening::forward(ax, {x.s_w.view(), x.s_r.view()}, x.options, {out.view(), h_norm.view()}, reference()); },
               "head dimension >= 2");
  // The backward checks its scalar gradients' shapes.
  const Results saved = screening_run(in, reference());
  HostTensor dq(in.main.q.shape(), DType::float64), dk(in.main.k.shape(), DType::float64),
      dv(in.main.v.shape(), DType::float64), ds_r({2}, DType::float64);
  expect_error([&] {
    screening::backward(a, {in.s_w.view(), in.s_r.view()}, in.options, {out.view(), h_norm.view()},
                        in.main.dout.view(), {dq.view(), dk.view(), dv.view()}, {wrong.view(), ds_r.view()},
                        reference());
  }, "'ds_w': expected a tensor shaped like s_w");
}

}  // namespace
}  // namespace winnow::testing
