// The spec's "checks worth having" and edge cases, on the reference and the CPU kernels:
// weights and remainder, recency, prefix invariance, empty rows, extreme logits, early
// halting (white-box: it knows the CPU key tile), determinism, explicit scale.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <random>
#include <utility>
#include <vector>

#include "cpu/tile_sizes.h"
#include "math/elementwise.h"
#include "math/stick_breaking.h"
#include "support/attention_case.h"

namespace winnow::testing {
namespace {

struct Backendish {
  const char* name;
  Backend backend;
  DType dtype;
  double tol;
};
const Backendish kBackends[] = {
    {"reference", Backend::reference, DType::float64, 1e-12},
    {"cpu_float64", Backend::automatic, DType::float64, 1e-12},
    {"cpu_float32", Backend::automatic, DType::float32, 2e-6},
};

// One head, v = identity: each output row is that query's weight row.
Problem identity_value_problem(std::int64_t len, std::int64_t dim, std::uint64_t seed) {
  Problem p = Problem::random({"identity_v", {{len, len}}, false, 1, 1, dim, len}, seed);
  std::vector<double> v(static_cast<std::size_t>(len * len), 0.0);
  for (std::int64_t i = 0; i < len; ++i) v[static_cast<std::size_t>(i * len + i)] = 1.0;
  p.v.set_values(v);
  return p;
}

TEST(StickBreakingChecks, WeightsAreNonNegativeAndSumToOneMinusRemainder) {
  const std::int64_t len = 90;
  const Problem p = identity_value_problem(len, 8, 11);
  for (const Backendish& b : kBackends) {
    for (bool current : {false, true}) {
      RunConfig cfg;
      cfg.mechanism = Mechanism::stick_breaking;
      cfg.backend = b.backend;
      cfg.dtype = b.dtype;
      cfg.attend_current = current;
      const Results r = run(p, cfg);
      for (std::int64_t j = 0; j < len; ++j) {
        double mass = 0;
        for (std::int64_t i = 0; i < len; ++i) {
          const double w = r.out[static_cast<std::size_t>(j * len + i)];
          EXPECT_GE(w, 0.0) << b.name << " row " << j << " key " << i;
          if (i > j || (i == j && !current)) EXPECT_EQ(w, 0.0) << "invisible key got weight";
          mass += w;
        }
        const double rem = std::exp(r.stat[static_cast<std::size_t>(j)]);
        EXPECT_NEAR(mass + rem, 1.0, b.tol * 10) << b.name << " row " << j;
      }
    }
  }
}

TEST(StickBreakingChecks, EqualLogitsGiveTheLaterKeyAtLeastTheEarliersWeight) {
  const std::int64_t len = 16;
  Problem p = identity_value_problem(len, 8, 12);
  std::vector<double> k = p.k.values();
  for (int d = 0; d < 8; ++d) k[static_cast<std::size_t>(9 * 8 + d)] = k[static_cast<std::size_t>(3 * 8 + d)];
  p.k.set_values(k);
  for (const Backendish& b : kBackends) {
    RunConfig cfg;
    cfg.mechanism = Mechanism::stick_breaking;
    cfg.backend = b.backend;
    cfg.dtype = b.dtype;
    cfg.attend_current = false;
    const Results r = run(p, cfg);
    for (std::int64_t j = 10; j < len; ++j) {
      EXPECT_GE(r.out[static_cast<std::size_t>(j * len + 9)], r.out[static_cast<std::size_t>(j * len + 3)])
          << b.name << " row " << j;
    }
  }
}

// If the keys just before the query take the whole stick, more context further left changes
// nothing.
TEST(StickBreakingChecks, PrefixInvarianceOnceTheStickIsGone) {
  const std::int64_t dim = 4, tail = 30, extra = 45;
  auto build = [&](std::int64_t prefix) {
    const std::int64_t len = prefix + tail;
    Problem p = Problem::random({"prefix", {{1, len}}, false, 1, 1, dim, 3}, 99);
    std::mt19937_64 prefix_rng(5), tail_rng(6);
    std::vector<double> k = random_normal(prefix * dim, prefix_rng);
    std::vector<double> v = random_normal(prefix * 3, prefix_rng);
    std::vector<double> tail_k = random_normal(tail * dim, tail_rng);
    const std::vector<double> tail_v = random_normal(tail * 3, tail_rng);
    // The last five keys the query sees point along it: z = 25 each, rem < exp(-125).
    for (std::int64_t i = tail - 6; i < tail - 1; ++i) {
      for (std::int64_t d = 0; d < dim; ++d) {
        tail_k[static_cast<std::size_t>(i * dim + d)] = d == 0 ? 1.0 : 0.0;
      }
    }
    k.insert(k.end(), tail_k.begin(), tail_k.end());
    v.insert(v.end(), tail_v.begin(), tail_v.end());
    p.k.set_values(k);
    p.v.set_values(v);
    p.q.set_values({50.0, 0.0, 0.0, 0.0});
    return p;
  };
  const Problem short_ctx = build(0), long_ctx = build(extra);
  for (const Backendish& b : kBackends) {
    RunConfig cfg;
    cfg.mechanism = Mechanism::stick_breaking;
    cfg.backend = b.backend;
    cfg.dtype = b.dtype;
    cfg.attend_current = false;
    const Results a = run(short_ctx, cfg), c = run(long_ctx, cfg);
    EXPECT_LT(relative_error(c.out, a.out), b.tol) << b.name;
    EXPECT_LT(std::exp(a.stat[0]), 1e-40) << "the stick should be exhausted";
  }
}

TEST(EdgeCases, QueryWithNoVisibleKeyOutputsZeroAndGetsZeroGradient) {
  const Problem p = Problem::random({"first", {{5, 5}, {5, 5}}, false, 2, 1, 16, 8}, 21);
  for (Mechanism m : {Mechanism::softmax, Mechanism::stick_breaking}) {
    for (const Backendish& b : kBackends) {
      RunConfig cfg;
      cfg.mechanism = m;
      cfg.backend = b.backend;
      cfg.dtype = b.dtype;
      cfg.attend_current = false;
      const Results r = run(p, cfg);
      // Row 0 of every (sequence, head): out is (B, L, H, Dv), stat (B, L, H).
      for (std::int64_t batch = 0; batch < 2; ++batch) {
        for (std::int64_t h = 0; h < 2; ++h) {
          for (std::int64_t d = 0; d < 8; ++d) {
            EXPECT_EQ(r.out[static_cast<std::size_t>(((batch * 5) * 2 + h) * 8 + d)], 0.0);
          }
          for (std::int64_t d = 0; d < 16; ++d) {
            EXPECT_EQ(r.dq[static_cast<std::size_t>(((batch * 5) * 2 + h) * 16 + d)], 0.0);
          }
          const double stat = r.stat[static_cast<std::size_t>((batch * 5) * 2 + h)];
          if (m == Mechanism::softmax) {
            EXPECT_TRUE(std::isinf(stat) && stat < 0) << b.name << ": lse " << stat;
          } else {
            EXPECT_EQ(stat, 0.0) << b.name << ": log_rem";
          }
        }
      }
    }
  }
}

TEST(EdgeCases, ExtremeLogitsStayFinite) {
  // q, k ~ N(0, 100^2), D = 64: |z| ~ 1e4.
  const Problem p = Problem::random({"extreme", {{150, 150}}, false, 2, 2, 64, 64}, 31, 100.0);
  for (Mechanism m : {Mechanism::softmax, Mechanism::stick_breaking}) {
    RunConfig ref;
    ref.mechanism = m;
    ref.backend = Backend::reference;
    const Results want = run(p, ref);
    for (DType dtype : {DType::float32, DType::float64}) {
      RunConfig cfg = ref;
      cfg.backend = Backend::automatic;
      cfg.dtype = dtype;
      const Results r = run(p, cfg);
      for (const auto* values : {&r.out, &r.dq, &r.dk, &r.dv}) {
        for (double x : *values) ASSERT_TRUE(std::isfinite(x)) << name_of(m) << " " << to_string(dtype);
      }
      if (dtype == DType::float64) {
        EXPECT_LT(relative_error(r.out, want.out), 1e-9) << name_of(m);
        EXPECT_LT(relative_error(r.dv, want.dv), 1e-9) << name_of(m);
      }
    }
  }
}

// The CUDA rows' forms, modelled in float as the kernels evaluate them, against the float64
// log form (log A_i = z_i - sum_{k >= i} softplus(z_k)) on rows with large logits and keys left
// out: tiles of 128 keys walked from the diagonal leftwards, a tile split over four threads of
// 32 consecutive keys each, a thread's weights among its own keys scaled by 2^(carry - the
// costs of the threads to its right).
constexpr float kLeftOut = -std::numeric_limits<float>::infinity();

// Keys of a row with a partial tile at the left; every 17th key left out.
std::vector<float> row_logits(std::mt19937_64& rng, double spread) {
  std::normal_distribution<double> normal(0.0, spread);
  std::vector<float> z(3 * 128 + 77);
  for (std::size_t i = 0; i < z.size(); ++i) z[i] = i % 17 == 5 ? kLeftOut : static_cast<float>(normal(rng));
  return z;
}

struct RowWeights {
  std::vector<double> weights;
  double log2_rem = 0.0;
};

RowWeights log_form_reference(const std::vector<float>& z) {
  RowWeights r;
  r.weights.resize(z.size());
  double suffix = 0.0;
  for (std::size_t i = z.size(); i-- > 0;) {
    const double x = z[i];
    suffix += std::isinf(x) ? 0.0 : std::max(x, 0.0) + std::log2(1.0 + std::exp2(-std::fabs(x)));
    r.weights[i] = std::isinf(x) ? 0.0 : std::exp2(x - suffix);
  }
  r.log2_rem = -suffix;
  return r;
}

// A row in tiles of 128 keys from the right, four threads of 32 keys each (keys past the row as
// kLeftOut), as the kernels take it: cost(thread, x) sees a thread's logits and returns their
// cost in log2; then, threads right to left, place(thread, share, out) writes the thread's
// weights given its share of the row's stick, 2^(carry - the costs of the threads to its right).
template <class Cost, class Place>
RowWeights tiled_row(const std::vector<float>& z, Cost cost_of, Place place) {
  const int keys = static_cast<int>(z.size());
  RowWeights r;
  r.weights.assign(z.size(), 0.0);
  float carry = 0.f;
  for (int t = (keys + 127) / 128 - 1; t >= 0; --t) {
    float cost[4];
    for (int thread = 0; thread < 4; ++thread) {
      float x[32];
      for (int j = 0; j < 32; ++j) {
        const int key = 128 * t + 32 * thread + j;
        x[j] = key < keys ? z[key] : kLeftOut;
      }
      cost[thread] = cost_of(thread, x);
    }
    float after = 0.f;  // costs of the threads to the right
    for (int thread = 3; thread >= 0; --thread) {
      float out[32];
      place(thread, std::exp2(carry - after), out);
      for (int j = 0; j < 32; ++j) {
        const int key = 128 * t + 32 * thread + j;
        if (key < keys) r.weights[key] = out[j];
      }
      after += cost[thread];
    }
    carry -= after;
  }
  r.log2_rem = carry;
  return r;
}

// thread_walk(x, local) turns a thread's 32 logits into its weights among its own keys and
// returns their cost in log2; the share multiplies them afterwards.
template <class ThreadWalk>
RowWeights tiled_float_walk(const std::vector<float>& z, ThreadWalk thread_walk) {
  float local[4][32];
  return tiled_row(
      z, [&](int thread, const float(&x)[32]) { return thread_walk(x, local[thread]); },
      [&](int thread, float share, float(&out)[32]) {
        for (int j = 0; j < 32; ++j) out[j] = local[thread][j] * share;
      });
}

// Largest absolute error, and largest relative error over the weights above `floor`.
std::pair<double, double> weight_errors(const RowWeights& got, const RowWeights& want, double floor) {
  double err = 0.0, rel = 0.0;
  for (std::size_t i = 0; i < want.weights.size(); ++i) {
    const double d = std::fabs(got.weights[i] - want.weights[i]);
    err = std::max(err, d);
    if (want.weights[i] > floor) rel = std::max(rel, d / want.weights[i]);
  }
  return {err, rel};
}

// Holds a form's row to the float64 log form: every weight within abs_bound, those above
// floor within 1e-5 relative, the remainder within 1e-5 relative, a key left out at zero.
void expect_log_form(const RowWeights& got, const RowWeights& want, double abs_bound, double floor, double spread) {
  const auto [err, rel] = weight_errors(got, want, floor);
  EXPECT_LT(err, abs_bound) << "spread " << spread;
  EXPECT_LT(rel, 1e-5) << "spread " << spread;
  EXPECT_NEAR(got.log2_rem, want.log2_rem, 1e-5 * std::max(1.0, std::fabs(want.log2_rem))) << "spread " << spread;
  EXPECT_EQ(got.weights[5], 0.0) << "spread " << spread;
}

// The odds forms' rows: row_logits, and at spread 0.5 a logit of 150 every 41 keys, one clamped
// key in a thread of small costs, where -log2 of the product would be the cost with 120 in
// place of 150.
constexpr double kOddsSpreads[] = {1.0, 8.0, 60.0, 400.0, 0.5};
std::vector<float> odds_row_logits(std::mt19937_64& rng, double spread) {
  std::vector<float> z = row_logits(rng, spread);
  if (spread == 0.5) {
    for (std::size_t i = 7; i < z.size(); i += 41) z[i] = 150.f;
  }
  return z;
}

// The odds forms' two walks, as the kernels take them. From the right, on a thread's odds in
// place: each becomes sigmoid times the keeps to its right; returns the last product of keeps.
float odds_walk_from_the_right(float (&local)[32]) {
  namespace sb = math::stick_breaking;
  float stick = 1.f;
  for (int j = 31; j >= 0; --j) {
    const sb::StickOdds share = sb::stick_shares_of_odds(local[j], [](float x) { return 1.f / x; });
    local[j] = share.sigmoid * stick;
    stick *= share.keep;
  }
  return stick;
}
// The fallback's cost: the keys' log-form costs summed one by one (the kernels'
// cost_from_memory).
float log_form_cost(const float (&x)[32]) {
  namespace sb = math::stick_breaking;
  float cost = 0.f;
  for (float xj : x) {
    if (!std::isinf(xj)) {
      cost += sb::stick_cost_log2(xj, [](float v) { return std::exp2(v); }, [](float v) { return std::log2(v); });
    }
  }
  return cost;
}

// The linear form (math::stick_shares_log2): a thread's weights are sigmoid times the keeps to
// its right, its keys' cost relu_sum + log2(product of d).
TEST(StickBreakingMath, LinearSharesGiveTheLogFormsWeightsAndRemainder) {
  namespace sb = math::stick_breaking;
  const auto exp2 = [](float x) { return std::exp2(x); };
  const auto rcp = [](float x) { return 1.f / x; };
  std::mt19937_64 rng(5);
  for (double spread : {1.0, 8.0, 60.0}) {
    const std::vector<float> z = row_logits(rng, spread);
    const RowWeights want = log_form_reference(z);
    const RowWeights got = tiled_float_walk(z, [&](const float (&x)[32], float (&local)[32]) {
      float keep_right = 1.f, relu_sum = 0.f, d_product = 1.f;
      for (int j = 31; j >= 0; --j) {
        const sb::StickShares share = sb::stick_shares_log2(x[j], exp2, rcp);
        relu_sum += std::max(x[j], 0.f);
        d_product *= share.d;
        local[j] = share.sigmoid * keep_right;
        keep_right *= share.keep;
      }
      return relu_sum + std::log2(d_product);
    });
    // Measured: at most 3e-8 absolute and 2.3e-6 relative (the keeps' products round once a key).
    expect_log_form(got, want, 2e-7, 1e-30, spread);
  }
  // Extreme logits: shares stay in [0, 1] and sum to one, d in [1, 2].
  for (float x : {-1e4f, -200.f, -30.f, -1e-3f, 0.f, 1e-3f, 30.f, 200.f, 1e4f}) {
    const sb::StickShares share = sb::stick_shares_log2(x, exp2, rcp);
    EXPECT_GE(share.sigmoid, 0.f);
    EXPECT_GE(share.keep, 0.f);
    EXPECT_NEAR(share.sigmoid + share.keep, 1.f, 1e-6f) << x;
    EXPECT_GE(share.d, 1.f);
    EXPECT_LE(share.d, 2.f);
    EXPECT_NEAR(share.sigmoid, 1.0 / (1.0 + std::exp2(-static_cast<double>(x))), 1e-7) << x;
  }
}

// The CUDA forward's odds form (math::stick_odds_log2) on the same rows: a thread's weights are
// sigmoid times the keeps to its right; its keys' cost is -log2 of the last product of keeps
// while that stays at or above kOddsStickFloor, and otherwise the keys' log-form costs summed
// one by one (the kernels' cost_from_memory). The large spreads make threads take that second
// path; the test counts them.
TEST(StickBreakingMath, OddsFormGivesTheLogFormsWeightsAndRemainder) {
  namespace sb = math::stick_breaking;
  const auto exp2 = [](float x) { return std::exp2(x); };
  const auto rcp = [](float x) { return 1.f / x; };
  std::mt19937_64 rng(7);
  int fallbacks = 0, walks = 0;
  for (double spread : kOddsSpreads) {
    const std::vector<float> z = odds_row_logits(rng, spread);
    const RowWeights want = log_form_reference(z);
    const RowWeights got = tiled_float_walk(z, [&](const float (&x)[32], float (&local)[32]) {
      for (int j = 0; j < 32; ++j) local[j] = sb::odds_log2(x[j], exp2);
      const float stick = odds_walk_from_the_right(local);
      ++walks;
      if (stick >= sb::kOddsStickFloor) return -std::log2(stick);
      ++fallbacks;
      return log_form_cost(x);
    });
    // Past a clamped key (x > 120) a weight is off by far more relatively, but it is below
    // 2^-120 of its thread's stick: only the weights above 1e-15 are held to the relative bound.
    expect_log_form(got, want, 2e-7, 1e-15, spread);
  }
  // The second path ran, and not everywhere.
  EXPECT_GT(fallbacks, 0);
  EXPECT_LT(fallbacks, walks);
  // Extreme logits: shares in [0, 1] summing to one, and a key left out takes nothing.
  for (float x : {-1e4f, -200.f, -30.f, -1e-3f, 0.f, 1e-3f, 30.f, 119.f, 120.f, 200.f, 1e4f}) {
    const sb::StickOdds share = sb::stick_odds_log2(x, exp2, rcp);
    EXPECT_GE(share.sigmoid, 0.f);
    EXPECT_LE(share.sigmoid, 1.f);
    EXPECT_GT(share.keep, 0.f) << x;
    EXPECT_NEAR(share.sigmoid + share.keep, 1.f, 1e-6f) << x;
    EXPECT_NEAR(share.sigmoid, 1.0 / (1.0 + std::exp2(-static_cast<double>(x))), 1e-7) << x;
  }
  const sb::StickOdds out = sb::stick_odds_log2(kLeftOut, exp2, rcp);
  EXPECT_EQ(out.sigmoid, 0.f);
  EXPECT_EQ(out.keep, 1.f);
}

// The odds form grown from the left (math::grow_odds, weigh_grown_odds): a thread's odds and the
// product G = prod (1 + o) from its first key, in chains of K keys (one chain for K = 0), then,
// while G stays at or under kOddsProductCeiling, the weights o_k H_k from H = 1 / G grown again,
// and the cost log2 G; past the ceiling, the walk from the right on the same odds, and the cost
// from the logits. Same rows as above.
template <int K>
void expect_grown_odds_give_the_log_form() {
  namespace sb = math::stick_breaking;
  const auto exp2 = [](float x) { return std::exp2(x); };
  const auto rcp = [](float x) { return 1.f / x; };
  std::mt19937_64 rng(7);
  int fallbacks = 0, walks = 0;
  for (double spread : kOddsSpreads) {
    const std::vector<float> z = odds_row_logits(rng, spread);
    const RowWeights want = log_form_reference(z);
    const RowWeights got = tiled_float_walk(z, [&](const float (&x)[32], float (&local)[32]) {
      for (int j = 0; j < 32; ++j) local[j] = sb::odds_log2(x[j], exp2);
      const auto odds = [&](int k) -> float& { return local[k]; };
      const sb::GrownOdds<32, K> grown = sb::grow_odds<32, K>(odds);
      ++walks;
      if (grown.total <= sb::kOddsProductCeiling) {
        sb::weigh_grown_odds(odds, grown, rcp);
        return std::log2(grown.total);
      }
      ++fallbacks;
      odds_walk_from_the_right(local);
      return log_form_cost(x);
    });
    // Measured (one chain): at most 2.0e-7 absolute and 9.7e-7 relative, against the walk's
    // 2.6e-8 and 1.0e-6: a weight here rounds once a key of the products G and H, about 64
    // times, where the walk's rounds once a key of its keeps.
    expect_log_form(got, want, 5e-7, 1e-15, spread);
  }
  EXPECT_GT(fallbacks, 0) << "chains of " << K;
  EXPECT_LT(fallbacks, walks) << "chains of " << K;
}

// One chain: the CUDA forward's arithmetic as it stands (its inline loops compute the same
// roundings in the same order as grow_odds and weigh_grown_odds with one chain).
TEST(StickBreakingMath, OddsGrownFromTheLeftGiveTheLogFormsWeightsAndRemainder) {
  namespace sb = math::stick_breaking;
  expect_grown_odds_give_the_log_form<0>();
  // A key left out grows nothing.
  EXPECT_EQ(sb::odds_log2(kLeftOut, [](float x) { return std::exp2(x); }), 0.f);
  EXPECT_EQ(sb::grown_by(3.f, 0.f), 3.f);
}

// Four chains of eight, as the parked chains patch holds a thread's 32 keys at D = 64.
TEST(StickBreakingMath, OddsGrownInChainsGiveTheLogFormsWeightsAndRemainder) {
  namespace sb = math::stick_breaking;
  static_assert(sb::kGrownChains<32, 8> == 4 && sb::kGrownChains<32, 16> == 2 && sb::kGrownChains<12, 8> == 1 &&
                sb::kGrownChains<32, 0> == 1);
  expect_grown_odds_give_the_log_form<8>();
}

// Any chain count gives one chain's weights and product: the chains' starting H is the single
// chain's H at their first key. Checked in float64 against the products taken key by key, for
// chains of 8 keys (1 to 4 chains of 8 to 32 keys, and 12 keys: one chain), of 16, and one chain.
template <int N, int K>
void expect_chains_match_one_chain(std::mt19937_64& rng) {
  namespace sb = math::stick_breaking;
  std::normal_distribution<double> logit(0.0, 3.0);
  for (int row = 0; row < 50; ++row) {
    float odds[N], weight[N];
    for (int k = 0; k < N; ++k) odds[k] = weight[k] = std::exp2(static_cast<float>(logit(rng)));
    double grown = 1.0;
    for (int k = 0; k < N; ++k) grown *= 1.0 + odds[k];
    const sb::GrownOdds<N, K> chains = sb::grow_odds<N, K>([&](int k) -> float& { return odds[k]; });
    EXPECT_NEAR(chains.total / grown, 1.0, 4e-6 * N / 32) << "N " << N << ", chains of " << K;
    sb::weigh_grown_odds([&](int k) -> float& { return weight[k]; }, chains, [](float x) { return 1.f / x; });
    double left = 1.0;  // prod_{j < k} (1 + o_j)
    for (int k = 0; k < N; ++k) {
      const double want = odds[k] * left / grown;
      EXPECT_NEAR(weight[k], want, 2e-6 * want + 1e-12) << "N " << N << ", chains of " << K << ", key " << k;
      left *= 1.0 + odds[k];
    }
  }
}
TEST(StickBreakingMath, OddsGrownInAnyNumberOfChainsMatchOneChain) {
  std::mt19937_64 rng(11);
  expect_chains_match_one_chain<8, 8>(rng);
  expect_chains_match_one_chain<12, 8>(rng);
  expect_chains_match_one_chain<16, 8>(rng);
  expect_chains_match_one_chain<24, 8>(rng);
  expect_chains_match_one_chain<32, 8>(rng);
  expect_chains_match_one_chain<32, 16>(rng);
  expect_chains_match_one_chain<32, 0>(rng);
}

// The grown form as the CUDA forward takes it: a thread's cost first (log2 G, or past the
// ceiling its keys' log-form costs), then its share of the row's stick, 2^(carry - the costs of
// the threads to its right), folded into H's start (weigh_grown_odds_from); past the ceiling, or
// where the fold would lose weights worth keeping (folded_share_keeps_weights), the walk from the
// right on the clamped odds, times the share. The odds are not clamped before the products.
template <int K>
RowWeights tiled_grown_folded(const std::vector<float>& z, int& ceiling_fallbacks, int& fold_fallbacks) {
  namespace sb = math::stick_breaking;
  float odds[4][32];
  sb::GrownOdds<32, K> grown[4];
  return tiled_row(
      z,
      [&](int thread, const float(&x)[32]) {
        for (int j = 0; j < 32; ++j) odds[thread][j] = sb::grown_odds_log2(x[j], [](float v) { return std::exp2(v); });
        grown[thread] = sb::grow_odds<32, K>([&](int k) -> float& { return odds[thread][k]; });
        return grown[thread].total <= sb::kOddsProductCeiling ? std::log2(grown[thread].total) : log_form_cost(x);
      },
      [&](int thread, float share, float(&out)[32]) {
        const float first = share * (1.f / grown[thread].total);
        float(&local)[32] = odds[thread];
        if (grown[thread].total <= sb::kOddsProductCeiling && sb::folded_share_keeps_weights(first, share)) {
          sb::weigh_grown_odds_from([&](int k) -> float& { return local[k]; }, grown[thread], first);
        } else {
          ++(grown[thread].total <= sb::kOddsProductCeiling ? fold_fallbacks : ceiling_fallbacks);
          for (float& o : local) o = sb::clamp_odds(o);
          odds_walk_from_the_right(local);
          for (float& w : local) w *= share;
        }
        std::copy(local, local + 32, out);
      });
}

// The folded form holds the log form's bounds on the odds rows: its weights differ from the
// unfolded ones by a rounding a key at most, and a weight it may lose is below 2^-64 of the
// row's stick (under the relative check's 1e-15 floor). The spreads reach both fallbacks.
TEST(StickBreakingMath, OddsGrownWithTheThreadsShareFoldedInGiveTheLogForm) {
  std::mt19937_64 rng(7);
  int ceiling_fallbacks = 0, fold_fallbacks = 0;
  for (double spread : kOddsSpreads) {
    const std::vector<float> z = odds_row_logits(rng, spread);
    const RowWeights want = log_form_reference(z);
    expect_log_form(tiled_grown_folded<0>(z, ceiling_fallbacks, fold_fallbacks), want, 5e-7, 1e-15, spread);
    expect_log_form(tiled_grown_folded<8>(z, ceiling_fallbacks, fold_fallbacks), want, 5e-7, 1e-15, spread);
  }
  EXPECT_GT(ceiling_fallbacks, 0);
  // A row whose rightmost thread costs 40 bits and the next 100: that thread's share is 2^-40
  // and its G 2^100, so share / G is below float's normal range and the walk takes it.
  std::vector<float> z(256, kLeftOut);
  for (int k = 128 + 96; k < 256; ++k) z[k] = 0.3f;        // 32 keys of about 1.25 bits
  for (int k = 128 + 64; k < 128 + 96; ++k) z[k] = 3.1f;  // 32 keys of about 3.2 bits
  const int before = fold_fallbacks;
  expect_log_form(tiled_grown_folded<8>(z, ceiling_fallbacks, fold_fallbacks), log_form_reference(z), 5e-7, 1e-15,
                  -1.0);
  EXPECT_GT(fold_fallbacks, before);
}

// The fold's test directly: for G about 2^103 and shares from 1 down to 2^-130, the fold is taken
// exactly when H's start stays normal or the share is below 2^-64, and then every weight is
// within 2e-6 relative of share o_k G_k / G_n, or below 2^-64 absolute.
TEST(StickBreakingMath, FoldedShareKeepsWeightsOrLeavesThemToTheWalk) {
  namespace sb = math::stick_breaking;
  float odds[32];
  double grown_exact = 1.0;
  for (int k = 0; k < 32; ++k) {
    odds[k] = std::exp2(2.9f + 0.01f * static_cast<float>(k));
    grown_exact *= 1.0 + odds[k];
  }
  const sb::GrownOdds<32, 8> grown = sb::grow_odds<32, 8>([&](int k) -> float& { return odds[k]; });
  ASSERT_LE(grown.total, sb::kOddsProductCeiling);
  ASSERT_GT(grown.total, 0x1p98f);
  int lost = 0;
  for (int e : {0, 20, 22, 24, 27, 40, 63, 64, 65, 100, 130}) {
    const float share = std::exp2(static_cast<float>(-e));
    const float first = share * (1.f / grown.total);
    const bool folds = sb::folded_share_keeps_weights(first, share);
    EXPECT_EQ(folds, std::exp2(-e) / grown_exact >= 0x1p-126 || e > 64) << "share 2^-" << e;
    float w[32];
    std::copy(odds, odds + 32, w);
    sb::weigh_grown_odds_from([&](int k) -> float& { return w[k]; }, grown, first);
    double left = 1.0, worst = 0.0;
    for (int k = 0; k < 32; ++k) {
      const double want = share * odds[k] * left / grown_exact;
      if (folds) EXPECT_LE(std::fabs(w[k] - want), 2e-6 * want + 0x1p-64) << "share 2^-" << e << ", key " << k;
      worst = std::max(worst, std::fabs(w[k] - want) / want);
      left *= 1.0 + odds[k];
    }
    // Where the fold is refused its start is subnormal, with fewer bits the deeper it goes (at
    // 2^-27 here, 19 bits: 5e-7 relative), and at 2^-40 it would have lost weights outright.
    if (!folds) ++lost;
    if (!folds && e >= 40) EXPECT_GT(worst, 1e-3) << "share 2^-" << e;
  }
  EXPECT_EQ(lost, 5);  // the shares 2^-24, 2^-27, 2^-40, 2^-63 and 2^-64
  // The clamp the fallback applies: odds past 2^120 (infinity included) become 2^120.
  EXPECT_EQ(sb::clamp_odds(0x1p119f), 0x1p119f);
  EXPECT_EQ(sb::clamp_odds(0x1p125f), 0x1p120f);
  EXPECT_EQ(sb::clamp_odds(INFINITY), 0x1p120f);
  EXPECT_EQ(sb::grown_odds_log2(kLeftOut, [](float x) { return std::exp2(x); }), 0.f);
}

TEST(Halting, LargeCutoffChangesNothingMeasurableButSkipsTiles) {
  const Problem p = Problem::random({"halt", {{300, 300}}, false, 2, 1, 32, 32}, 41);
  RunConfig ref;
  ref.mechanism = Mechanism::stick_breaking;
  ref.attend_current = false;
  ref.backend = Backend::reference;
  ref.with_dstat = false;
  const Results want = run(p, ref);
  for (DType dtype : {DType::float32, DType::float64}) {
    RunConfig cfg = ref;
    cfg.backend = Backend::automatic;
    cfg.dtype = dtype;
    cfg.halt_cutoff = 40.0;
    // log_rem itself reports the kept keys' cost (far from the full one), so its gradient is
    // left out here; rem = exp(log_rem) and its gradient are negligible either way.
    cfg.with_dstat = false;
    const Results got = run(p, cfg);
    const double tol = dtype == DType::float64 ? 1e-10 : 1e-5;
    EXPECT_LT(relative_error(got.out, want.out), tol);
    EXPECT_LT(relative_error(got.dq, want.dq), tol);
    EXPECT_LT(relative_error(got.dk, want.dk), tol);
    EXPECT_LT(relative_error(got.dv, want.dv), tol);
    int halted_rows = 0;
    for (std::size_t j = 0; j < got.stat.size(); ++j) {
      EXPECT_GE(got.stat[j], want.stat[j] - 1e-3);  // the kept keys' cost never exceeds the total
      if (got.stat[j] > want.stat[j] + 1.0) ++halted_rows;
    }
    EXPECT_GT(halted_rows, 100) << "random logits exhaust the stick within ~50 keys";
  }
}

// With a small cutoff many keys are dropped; what remains must be exactly stick-breaking over
// the kept keys (the key tiles from the diagonal down to the one where halting happened).
TEST(Halting, ResultIsExactStickBreakingOverTheKeptKeys) {
  const std::int64_t len = 300, dim = 16;
  const double cutoff = 5.0;
  const Problem p = Problem::random({"decode", {{1, len}}, false, 1, 1, dim, 8}, 51);
  const std::vector<double> q = p.q.values(), k = p.k.values();
  // The query sits at position len - 1 and sees keys 0 .. len - 2.
  const std::int64_t last = len - 2;
  std::int64_t kept_from = 0;
  double carry = 0;
  for (std::int64_t t = last / cpu::kKeyTile; t >= 0; --t) {
    for (std::int64_t i = std::min(last, (t + 1) * cpu::kKeyTile - 1); i >= t * cpu::kKeyTile; --i) {
      double dot = 0;
      for (std::int64_t d = 0; d < dim; ++d) dot += q[static_cast<std::size_t>(d)] * k[static_cast<std::size_t>(i * dim + d)];
      carry -= math::softplus(dot / std::sqrt(static_cast<double>(dim)));
    }
    if (carry < -cutoff) {
      kept_from = t * cpu::kKeyTile;
      break;
    }
  }
  ASSERT_GT(kept_from, 0) << "the test needs halting to drop keys";

  Problem truncated = Problem::random({"kept", {{1, len - kept_from}}, false, 1, 1, dim, 8}, 52);
  truncated.q = p.q;
  truncated.dout = p.dout;
  truncated.dstat = p.dstat;
  const std::vector<double> v = p.v.values();
  truncated.k.set_values(std::vector<double>(k.begin() + kept_from * dim, k.end()));
  truncated.v.set_values(std::vector<double>(v.begin() + kept_from * 8, v.end()));

  RunConfig cfg;
  cfg.mechanism = Mechanism::stick_breaking;
  cfg.attend_current = false;
  cfg.halt_cutoff = cutoff;
  cfg.dtype = DType::float64;
  const Results got = run(p, cfg);
  RunConfig ref = cfg;
  ref.backend = Backend::reference;
  const Results want = run(truncated, ref);

  EXPECT_LT(relative_error(got.out, want.out), 1e-12);
  EXPECT_LT(relative_error(got.stat, want.stat), 1e-12);
  EXPECT_LT(relative_error(got.dq, want.dq), 1e-12);
  const std::vector<double> dk_kept(got.dk.begin() + kept_from * dim, got.dk.end());
  const std::vector<double> dv_kept(got.dv.begin() + kept_from * 8, got.dv.end());
  EXPECT_LT(relative_error(dk_kept, want.dk), 1e-12);
  EXPECT_LT(relative_error(dv_kept, want.dv), 1e-12);
  for (std::int64_t i = 0; i < kept_from * dim; ++i) EXPECT_EQ(got.dk[static_cast<std::size_t>(i)], 0.0);
  for (std::int64_t i = 0; i < kept_from * 8; ++i) EXPECT_EQ(got.dv[static_cast<std::size_t>(i)], 0.0);
}

TEST(Determinism, CpuBackwardIsBitwiseRepeatable) {
  const Problem p = Problem::random({"repeat", {{200, 200}}, false, 4, 1, 32, 32}, 61);
  for (Mechanism m : {Mechanism::softmax, Mechanism::stick_breaking}) {
    RunConfig cfg;
    cfg.mechanism = m;
    cfg.dtype = DType::float32;
    cfg.num_threads = 3;
    const Results a = run(p, cfg), b = run(p, cfg);
    EXPECT_EQ(a.dq, b.dq);
    EXPECT_EQ(a.dk, b.dk);
    EXPECT_EQ(a.dv, b.dv);
  }
}

TEST(Options, ExplicitScaleMatchesReference) {
  const Problem p = Problem::random({"scale", {{50, 50}}, false, 2, 2, 16, 16}, 71);
  for (Mechanism m : {Mechanism::softmax, Mechanism::stick_breaking}) {
    RunConfig ref;
    ref.mechanism = m;
    ref.scale = 0.37;
    ref.backend = Backend::reference;
    RunConfig cfg = ref;
    cfg.backend = Backend::automatic;
    const Results want = run(p, ref), got = run(p, cfg);
    EXPECT_LT(relative_error(got.out, want.out), 1e-10);
    EXPECT_LT(relative_error(got.dq, want.dq), 1e-10);
    RunConfig unscaled = ref;
    unscaled.scale.reset();
    EXPECT_GT(relative_error(run(p, unscaled).out, want.out), 1e-3) << "scale must matter";
  }
}

}  // namespace
}  // namespace winnow::testing
