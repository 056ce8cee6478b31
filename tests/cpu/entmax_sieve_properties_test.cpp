// alpha-entmax and Sieve against what their specs promise beyond matching the reference
// (spec/entmax.md, spec/sieve.md, 000's proposition 2), and stick-breaking's and Sieve's CPU
// backward at large logits, where a prefix sum taken as a difference would cancel.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <functional>
#include <limits>
#include <numeric>
#include <random>
#include <type_traits>
#include <vector>

#include "math/entmax.h"
#include "support/attention_case.h"

namespace winnow::testing {
namespace {

// One query at position n against n keys with chosen logits: D = 1 with q = 1 and scale 1
// makes z_i = k_i, and v = the identity (Dv = n) makes the output the row of weights.
Problem weights_problem(const std::vector<double>& logits) {
  const std::int64_t n = static_cast<std::int64_t>(logits.size());
  Problem p = Problem::random({"row", {{1, n}}, false, 1, 1, 1, n}, 3);
  p.q.set_values({1.0});
  p.k.set_values(logits);
  std::vector<double> eye(static_cast<std::size_t>(n * n), 0.0);
  for (std::int64_t i = 0; i < n; ++i) eye[static_cast<std::size_t>(i * n + i)] = 1.0;
  p.v.set_values(eye);
  return p;
}

std::vector<double> row_weights(const std::vector<double>& logits, Mechanism m, DType dtype,
                                std::optional<double> eps = std::nullopt) {
  RunConfig cfg;
  cfg.mechanism = m;
  cfg.dtype = dtype;
  cfg.scale = 1.0;
  cfg.attend_current = true;  // the query sees every key of the row
  cfg.eps = eps;
  return run(weights_problem(logits), cfg).out;
}

std::vector<double> random_logits(std::int64_t n, std::uint64_t seed, double std) {
  std::mt19937_64 rng(seed);
  return random_normal(n, rng, std);
}

// Sort-based sparsemax, written here independently of winnow's search and reference.
std::vector<double> sparsemax(const std::vector<double>& z) {
  std::vector<double> s = z;
  std::sort(s.begin(), s.end(), std::greater<double>());
  double sum = 0, tau = 0;
  for (std::size_t k = 0; k < s.size(); ++k) {
    sum += s[k];
    if (1 + static_cast<double>(k + 1) * s[k] > sum) tau = (sum - 1) / static_cast<double>(k + 1);
  }
  std::vector<double> p(z.size());
  for (std::size_t i = 0; i < z.size(); ++i) p[i] = std::max(z[i] - tau, 0.0);
  return p;
}

TEST(Entmax, RowsSumToOneWithinTheDefaultTolerance) {
  for (Mechanism m : {Mechanism::entmax15, Mechanism::sparsemax, Mechanism::entmax13}) {
    for (DType dtype : {DType::float32, DType::float64}) {
      for (std::int64_t n : {1, 2, 7, 300, 2000}) {
        const std::vector<double> w = row_weights(random_logits(n, 11 + n, 2.0), m, dtype);
        const double sum = std::accumulate(w.begin(), w.end(), 0.0);
        EXPECT_NEAR(sum, 1.0, dtype == DType::float32 ? 1e-4 : 1e-10) << name_of(m) << " n=" << n;
        for (double x : w) EXPECT_GE(x, 0.0);
      }
    }
  }
}

// The threshold search alone, with the CUDA kernels' four probes per sweep and the CPU's one:
// it reaches the tolerance on rows up to 16384 keys, spread and peaked, and in few sweeps
// (the count the fused kernels' speed rests on).
template <class S, int K>
void check_threshold_search(double alpha, double tolerance, int max_sweeps) {
  namespace em = math::entmax;
  for (double input_std : {0.5, 1.0, 3.0}) {
    for (std::int64_t n : {1, 2, 10, 300, 4096, 16384}) {
      const std::vector<double> z = random_logits(n, 7 * n + static_cast<std::uint64_t>(10 * input_std), input_std);
      std::vector<S> x(z.size());
      for (std::size_t i = 0; i < z.size(); ++i) x[i] = S(alpha - 1) * S(z[i]);
      em::ThresholdSearch<S, K> search{S(alpha), S(tolerance)};
      search.start(*std::max_element(x.begin(), x.end()), S(n));
      int sweeps = 1;  // the row maximum
      while (!search.done() && sweeps <= em::kMaxSearchSteps) {
        S f[K] = {}, u[K] = {};
        for (int k = 0; k < K; ++k) {
          for (S xi : x) {
            f[k] += em::weight(xi - search.probe(k), S(alpha));
            u[k] += em::grad_weight(xi - search.probe(k), S(alpha));
          }
        }
        search.step(f, u);
        ++sweeps;
      }
      double sum = 0;
      for (double zi : z) sum += em::weight((alpha - 1) * zi - double(search.tau()), alpha);
      SCOPED_TRACE(::testing::Message() << "alpha " << alpha << " K " << K << " n " << n << " std " << input_std);
      EXPECT_TRUE(search.done());
      EXPECT_NEAR(sum, 1.0, 10 * tolerance);
      EXPECT_LE(sweeps, max_sweeps);
    }
  }
}

// weight_and_grad (one power for both) against weight and grad_weight (a power each): u the
// same, p the same but for the general family, where p = u gap differs from gap^(1 / (alpha -
// 1)) by the exponents' float rounding, about 2^-23 |ln gap| / (alpha - 1) relative; p finite
// also where u overflows (alpha 10, the smallest gaps).
TEST(Entmax, WeightAndGradMatchesItsTwoParts) {
  namespace em = math::entmax;
  auto check = [](auto family, float alpha) {
    constexpr em::Family F = decltype(family)::value;
    for (float gap : {-1.f, 0.f, 1e-45f, 1e-38f, 1e-20f, 1e-6f, 0.3f, 1.f, 2.5f, 40.f}) {
      const auto both = em::weight_and_grad<F>(gap, alpha);
      const float p = em::weight<F>(gap, alpha), u = em::grad_weight<F>(gap, alpha);
      const float spread =
          F == em::Family::general && gap > 0.f ? 4e-7f * (1.f + std::abs(std::log(gap)) / (alpha - 1.f)) : 0.f;
      EXPECT_LE(std::abs(both.p - p), spread * std::abs(p)) << "alpha " << alpha << " gap " << gap;
      EXPECT_TRUE(both.u == u || (std::isinf(both.u) && std::isinf(u))) << "alpha " << alpha << " gap " << gap;
      EXPECT_TRUE(std::isfinite(both.p)) << "alpha " << alpha << " gap " << gap;
    }
  };
  for (float alpha : {1.2f, 1.3f, 3.f, 10.f}) {
    check(std::integral_constant<em::Family, em::Family::general>{}, alpha);
  }
  check(std::integral_constant<em::Family, em::Family::entmax15>{}, 1.5f);
  check(std::integral_constant<em::Family, em::Family::sparsemax>{}, 2.f);
}

TEST(Entmax, ThresholdSearchConvergesInFewSweeps) {
  // Four probes: at most 6 sweeps in float64 simulations of these rows (Newton: up to 12).
  check_threshold_search<double, 4>(1.5, 1e-5, 6);
  check_threshold_search<double, 4>(2.0, 1e-5, 6);
  check_threshold_search<double, 4>(1.3, 1e-5, 7);
  check_threshold_search<double, 1>(1.5, 1e-5, 14);
  check_threshold_search<float, 4>(1.5, 1e-5, 8);
  check_threshold_search<float, 1>(1.5, 1e-5, 16);
}

// Rows of equal scores (a zero scale, or keys that all tie): the root is the bracket's right
// end, x - n^(1 - alpha), which the search never evaluates. Where f is linear (sparsemax)
// Newton's estimate from the left end is exactly that end, so no probe fits between; the
// search used to end at the left end then (tau = -0.24 for -0.2 at 5 keys, float, four probes).
template <class S, int K>
void check_equal_scores(double alpha) {
  namespace em = math::entmax;
  for (double x0 : {0.0, 0.37, -2.5}) {
    for (std::int64_t n : {2, 3, 5, 7, 90, 300}) {
      em::ThresholdSearch<S, K> search{S(alpha), S(1e-5)};
      search.start(S(x0), S(n));
      for (int step = 0; step < em::kMaxSearchSteps && !search.done(); ++step) {
        S f[K] = {}, u[K] = {};
        for (int k = 0; k < K; ++k) {
          f[k] = S(n) * em::weight(S(x0) - search.probe(k), S(alpha));
          u[k] = S(n) * em::grad_weight(S(x0) - search.probe(k), S(alpha));
        }
        search.step(f, u);
      }
      SCOPED_TRACE(::testing::Message() << "alpha " << alpha << " K " << K << " n " << n << " x " << x0);
      EXPECT_TRUE(search.done());
      // In float, tau's last bits move f by n ulp(tau) (f' = -n for sparsemax): a few of those.
      const double resolution = 8.0 * double(n) * std::numeric_limits<S>::epsilon() * (std::abs(x0) + 1.0);
      EXPECT_NEAR(double(n) * em::weight(x0 - double(search.tau()), alpha), 1.0, 1e-4 + resolution);
    }
  }
}

TEST(Entmax, ThresholdSearchOverEqualScoresEndsAtTheRoot) {
  for (double alpha : {2.0, 1.5, 1.3}) {
    check_equal_scores<float, 4>(alpha);
    check_equal_scores<float, 1>(alpha);
    check_equal_scores<double, 4>(alpha);
  }
}

// 1.5-entmax's threshold by sorting (Peters et al. 2019), written here independently of
// winnow's searches: with the k largest x, sum_{i<=k} (x_i - tau)^2 = 1 gives
// tau_k = mean_k - sqrt((1 - ss_k) / k); the support is the largest k with tau_k <= x_k.
double entmax15_threshold_by_sorting(std::vector<double> x) {
  std::sort(x.begin(), x.end(), std::greater<double>());
  double sum = 0, sum_sq = 0, tau = x[0] - 1;
  for (std::size_t k = 1; k <= x.size(); ++k) {
    sum += x[k - 1];
    sum_sq += x[k - 1] * x[k - 1];
    const double n = static_cast<double>(k), mean = sum / n, ss = sum_sq - n * mean * mean;
    if (ss > 1) break;
    const double tau_k = mean - std::sqrt((1 - ss) / n);
    if (tau_k <= x[k - 1]) tau = tau_k;
  }
  return tau;
}

// The CUDA collect sweep's exact threshold on its lists (ListThreshold), run on the keys above
// the same floor the kernel uses: it lands on the sort-based threshold, in few steps.
template <class S, math::entmax::Family F>
void check_list_threshold(int max_steps) {
  namespace em = math::entmax;
  const double alpha = F == em::Family::sparsemax ? 2.0 : 1.5;
  int worst = 0, total = 0, rows = 0;
  for (double input_std : {0.5, 1.0, 3.0}) {
    for (std::int64_t n : {1, 2, 3, 10, 300, 4096, 16384}) {
      const std::vector<double> z = random_logits(n, 5 * n + static_cast<std::uint64_t>(10 * input_std), input_std);
      std::vector<double> x(z.size());
      for (std::size_t i = 0; i < z.size(); ++i) x[i] = (alpha - 1) * z[i];
      std::vector<double> sorted = x;
      std::sort(sorted.begin(), sorted.end(), std::greater<>());
      S top[8];
      for (int i = 0; i < 8; ++i) top[i] = i < n ? S(sorted[static_cast<std::size_t>(i)]) : S(-INFINITY);
      const S floor = std::max(em::threshold_floor(em::FamilyOf<F, S>(S(alpha)), top), S(sorted[0] - 1));
      std::vector<S> list;
      for (double v : x) {
        if (S(v) > floor) list.push_back(S(v));
      }
      em::ListThreshold<F, S> search(floor);
      int steps = 0;
      while (!search.done && steps < em::kMaxSearchSteps) {
        em::GapMoments<S> m;
        for (S v : list) m.add(v - search.tau);
        search.step(m, S(1e-5));
        ++steps;
      }
      worst = std::max(worst, steps);
      total += steps;
      ++rows;
      const double want = F == em::Family::sparsemax ? [&] {
        const std::vector<double> p = sparsemax(x);  // x = z for alpha = 2
        for (std::size_t i = 0; i < x.size(); ++i) {
          if (p[i] > 0) return x[i] - p[i];
        }
        return 0.0;
      }()
                                                     : entmax15_threshold_by_sorting(x);
      double sum = 0;
      for (double v : x) sum += em::weight<F>(v - double(search.tau), alpha);
      SCOPED_TRACE(::testing::Message() << "alpha " << alpha << " n " << n << " std " << input_std << " list "
                                        << list.size() << " steps " << steps);
      EXPECT_TRUE(search.done);
      const bool single = std::is_same_v<S, float>;
      EXPECT_NEAR(double(search.tau), want, (single ? 1e-6 : 1e-13) * (1 + std::fabs(want)));
      EXPECT_NEAR(sum, 1.0, single ? 1e-5 : 1e-12);
      EXPECT_LE(steps, max_steps);
    }
  }
  std::printf("ListThreshold alpha %.1f %s: %.1f steps on average, at most %d\n", alpha,
              std::is_same_v<S, float> ? "float" : "double", double(total) / rows, worst);
}

TEST(Entmax, ListThresholdIsTheSortBasedThreshold) {
  check_list_threshold<double, math::entmax::Family::entmax15>(6);
  check_list_threshold<float, math::entmax::Family::entmax15>(6);
  check_list_threshold<double, math::entmax::Family::sparsemax>(6);
  check_list_threshold<float, math::entmax::Family::sparsemax>(6);
}

// The CUDA search collects only keys above a floor from a few of the row's largest scores; the
// floor must never exceed the row's threshold (else support keys would be lost), and for
// alpha >= 1.5 it should leave few keys above it. Random rows of 4096 keys, the floor from 8
// of the top 16 (the kernel's eight are its threads' two largest, not always the row's top 8).
TEST(Entmax, ThresholdFloorFromAFewKeysBoundsTheRowThreshold) {
  namespace em = math::entmax;
  std::mt19937_64 rng(7);
  std::normal_distribution<double> normal(0.0, 1.0);
  for (double alpha : {1.25, 1.5, 2.0, 3.0}) {
    em::with_family(alpha, [&](auto family) {
      constexpr em::Family F = decltype(family)::value;
      for (int row = 0; row < 20; ++row) {
        std::vector<double> x(4096);
        for (double& v : x) v = (alpha - 1) * normal(rng);
        std::vector<double> sorted = x;
        std::sort(sorted.begin(), sorted.end(), std::greater<>());
        double subset[8];
        for (int i = 0; i < 8; ++i) subset[i] = sorted[static_cast<std::size_t>(2 * i)];
        const double floor = em::threshold_floor(family, subset);
        // The row's tau by bisection on all keys.
        double lo = sorted[0] - 1, hi = sorted[0];
        for (int step = 0; step < 100; ++step) {
          const double mid = 0.5 * (lo + hi);
          double f = 0;
          for (double v : x) f += em::weight<F>(v - mid, alpha);
          (f >= 1 ? lo : hi) = mid;
        }
        SCOPED_TRACE(::testing::Message() << "alpha " << alpha << " row " << row);
        EXPECT_LE(floor, lo);
        EXPECT_GE(floor, sorted[0] - 1);
        // Few keys pass at alpha >= 1.5 (the lists hold 192 per row on Hopper). At 1.25 the
        // spread in x units is a quarter of the scores' and about a quarter of the row passes:
        // such rows overflow and finish in step sweeps.
        const auto above = std::count_if(x.begin(), x.end(), [&](double v) { return v > floor; });
        if (alpha >= 1.5) EXPECT_LT(above, 150);
      }
    });
  }
}

TEST(Entmax, IsSparseAndAlphaTwoIsSortBasedSparsemax) {
  for (std::int64_t n : {5, 64, 65, 500}) {
    const std::vector<double> z = random_logits(n, 21 + n, 3.0);
    const std::vector<double> want = sparsemax(z);
    EXPECT_LT(relative_error(row_weights(z, Mechanism::sparsemax, DType::float64), want), 1e-12);
    EXPECT_LT(relative_error(row_weights(z, Mechanism::sparsemax, DType::float32), want), 1e-5);
    const std::vector<double> w15 = row_weights(z, Mechanism::entmax15, DType::float64);
    const auto zeros = std::count(w15.begin(), w15.end(), 0.0);
    if (n >= 64) EXPECT_GT(zeros, n / 2) << "1.5-entmax of spread logits is sparse";
  }
}

TEST(Sieve, EqualsStickBreakingWhenTheFilterAdmitsEveryKey) {
  const Problem p = Problem::random({"all", {{90, 90}, {90, 90}}, false, 4, 2, 16, 24}, 31);
  RunConfig sb;
  sb.mechanism = Mechanism::stick_breaking;
  sb.attend_current = false;
  sb.dtype = DType::float64;
  RunConfig sieve = sb;
  sieve.mechanism = Mechanism::sieve_bound;
  sieve.eps = 1e9;
  const Results want = run(p, sb), got = run(p, sieve);
  EXPECT_LT(relative_error(got.out, want.out), 1e-12);
  EXPECT_LT(relative_error(got.stat, want.stat), 1e-12);
  EXPECT_LT(relative_error(got.dq, want.dq), 1e-12);
  EXPECT_LT(relative_error(got.dk, want.dk), 1e-12);
  EXPECT_LT(relative_error(got.dv, want.dv), 1e-12);
  // Row j sees j keys (strict causality) and admits them all.
  for (std::size_t r = 0; r < got.count.size(); ++r) {
    EXPECT_EQ(got.count[r], static_cast<double>((r / 4) % 90));
  }
}

TEST(Sieve, CandidatesLieInsideTheEntmaxSupportAndTheBoundSet) {
  for (std::int64_t n : {10, 100, 700}) {
    const std::vector<double> z = random_logits(n, 41 + n, 2.5);
    const double m = *std::max_element(z.begin(), z.end());
    const std::vector<double> entmax = row_weights(z, Mechanism::entmax15, DType::float64);
    const std::vector<double> exact = row_weights(z, Mechanism::sieve_exact, DType::float64);
    const std::vector<double> bound = row_weights(z, Mechanism::sieve_bound, DType::float64);
    std::int64_t support = 0, bound_set = 0;
    for (std::int64_t i = 0; i < n; ++i) {
      const std::size_t k = static_cast<std::size_t>(i);
      support += entmax[k] > 0;
      bound_set += z[k] > m - 2.0;  // eps = 1 / (alpha - 1)
      if (exact[k] > 0) EXPECT_GT(entmax[k], 0.0) << "exact candidate outside the support, key " << i;
      if (bound[k] > 0) EXPECT_GT(z[k], m - 2.0) << "bound candidate outside the bound set, key " << i;
      if (entmax[k] > 0) EXPECT_GT(z[k], m - 2.0) << "the bound set contains the support";
    }
    EXPECT_LT(support, bound_set + 1);
    EXPECT_GE(support, 1);
  }
}

// 000's proposition 2: a far key with a high logit keeps its weight when a closer distractor
// falls below the filter's threshold; stick-breaking alone lets the distractor take it.
TEST(Sieve, FarHighLogitKeyBeatsACloserDistractorBelowTheThreshold) {
  std::vector<double> z(40, -6.0);
  z[2] = 5.0;    // far, relevant
  z[38] = 2.0;   // recent distractor, within softplus reach but below max - 2
  for (Mechanism m : {Mechanism::sieve_exact, Mechanism::sieve_bound}) {
    for (DType dtype : {DType::float32, DType::float64}) {
      const std::vector<double> w = row_weights(z, m, dtype);
      EXPECT_EQ(w[38], 0.0) << name_of(m);
      EXPECT_NEAR(w[2], 1.0 / (1.0 + std::exp(-5.0)), 1e-6) << name_of(m);
    }
  }
  const std::vector<double> sb = row_weights(z, Mechanism::stick_breaking, DType::float64);
  EXPECT_GT(sb[38], sb[2]) << "stick-breaking gives the recent distractor more";
}

// spec/stick-breaking.md's precision at logits of a few hundred: the CPU backward must meet
// the conventions' tolerances for dq and dk there too (issue: 2.4e-5 / 2.2e-9 before).
TEST(StickBreakingPrecision, LargeLogitsMeetTheTolerances) {
  struct Case {
    ProblemShape shape;
    double q_scale;
  };
  const std::vector<Case> cases = {
      {{"large_logits", {{300, 300}}, false, 2, 1, 64, 64}, 50.0},
      {{"suffix_2049", {{37, 2049}}, false, 2, 1, 64, 64}, 1.0},
  };
  for (const Case& c : cases) {
    Problem p = Problem::random(c.shape, 81);
    std::vector<double> q = p.q.values();
    for (double& x : q) x *= c.q_scale;
    p.q.set_values(q);
    for (Mechanism m : {Mechanism::stick_breaking, Mechanism::sieve_bound}) {
      RunConfig ref;
      ref.mechanism = m;
      ref.attend_current = false;
      ref.backend = Backend::reference;
      const Results want = run(p, ref);
      for (DType dtype : {DType::float32, DType::float64}) {
        RunConfig cfg = ref;
        cfg.backend = Backend::automatic;
        cfg.dtype = dtype;
        const Results got = run(p, cfg);
        const double tol = dtype == DType::float64 ? 1e-10 : 1e-5;
        SCOPED_TRACE(c.shape.name + " " + name_of(m) + " " + to_string(dtype));
        EXPECT_LT(relative_error(got.out, want.out), tol);
        EXPECT_LT(relative_error(got.dq, want.dq), tol);
        EXPECT_LT(relative_error(got.dk, want.dk), tol);
        EXPECT_LT(relative_error(got.dv, want.dv), tol);
      }
    }
  }
}

}  // namespace
}  // namespace winnow::testing
