// GSA's indexer with selection (spec/gsa.md). The float64 reference against scores recomputed
// here from the logical inputs: the reported variance, the budget it implies, a selection of
// min(k_t, t + 1) distinct positions <= t in increasing order that outranks every key left
// out (ties toward the more recent key); every budget rule, both score forms. Then the CPU
// kernels against the reference (bitwise in float64, by rank in float32) on batched, suffix
// and packed layouts with permuted strides, and the API's errors.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <random>
#include <set>

#include "math/gsa.h"
#include "support/expect_error.h"
#include "support/host_tensor.h"
#include "winnow/gsa.h"

namespace winnow::testing {
namespace {

// Sequences as (q_len, k_len); packed when `varlen`.
struct IndexerShape {
  std::vector<std::pair<std::int64_t, std::int64_t>> seqs;
  bool varlen = false;
  std::int64_t heads = 3, dim = 8;
};

struct IndexerCase {
  IndexerShape shape;
  HostTensor q, k, weights, bias, cu_q, cu_k;
  std::int64_t rows_q = 0;

  IndexerCase(IndexerShape s, DType dtype, std::uint64_t seed, bool permuted = false) : shape(std::move(s)) {
    std::mt19937_64 rng(seed);
    const std::int64_t h = shape.heads, d = shape.dim;
    std::vector<std::int32_t> cq = {0}, ck = {0};
    for (const auto& [lq, lk] : shape.seqs) {
      cq.push_back(cq.back() + static_cast<std::int32_t>(lq));
      ck.push_back(ck.back() + static_cast<std::int32_t>(lk));
    }
    rows_q = cq.back();
    const std::int64_t b = static_cast<std::int64_t>(shape.seqs.size());
    if (shape.varlen) {
      q = HostTensor({cq.back(), h, d}, dtype, permuted ? std::vector<int>{1, 0, 2} : std::vector<int>{});
      k = HostTensor({ck.back(), 1, d}, dtype);
      weights = HostTensor({cq.back(), h}, dtype, permuted ? std::vector<int>{1, 0} : std::vector<int>{});
      cu_q = int32_tensor(cq);
      cu_k = int32_tensor(ck);
    } else {
      const std::int64_t lq = shape.seqs[0].first, lk = shape.seqs[0].second;
      q = HostTensor({b, lq, h, d}, dtype, permuted ? std::vector<int>{0, 2, 1, 3} : std::vector<int>{});
      k = HostTensor({b, lk, 1, d}, dtype);
      weights = HostTensor({b, lq, h}, dtype);
    }
    q.set_values(random_normal(q.numel(), rng));
    k.set_values(random_normal(k.numel(), rng));
    weights.set_values(random_normal(weights.numel(), rng));
    bias = HostTensor({h}, dtype == DType::float64 ? DType::float64 : DType::float32);
    bias.set_values(random_normal(h, rng, 0.5));
  }

  std::vector<std::int64_t> row_shape(std::int64_t width = 0) const {
    std::vector<std::int64_t> s = shape.varlen
                                      ? std::vector<std::int64_t>{rows_q}
                                      : std::vector<std::int64_t>{static_cast<std::int64_t>(shape.seqs.size()),
                                                                  shape.seqs[0].first};
    if (width > 0) s.push_back(width);
    return s;
  }

  gsa::IndexerInputs inputs(bool with_bias = true) const {
    gsa::IndexerInputs in;
    in.q = q.view();
    in.k = k.view();
    in.head_weights = weights.view();
    if (with_bias) in.bias = bias.view();
    if (shape.varlen) {
      in.cu_seqlens_q = cu_q.view();
      in.cu_seqlens_k = cu_k.view();
    }
    return in;
  }
};

struct SelectionResult {
  std::vector<double> indices, counts, variance;
};

SelectionResult run(const IndexerCase& c, const gsa::IndexerOptions& o, const ExecContext& ctx, bool with_bias = true) {
  const DType stats = c.q.dtype() == DType::float64 ? DType::float64 : DType::float32;
  HostTensor indices(c.row_shape(o.k_max), DType::int32), counts(c.row_shape(), DType::int32),
      variance(c.row_shape(), stats);
  indices.fill(-7);
  gsa::select_keys(c.inputs(with_bias), o, {indices.view(), counts.view(), variance.view()}, ctx);
  return {indices.values(), counts.values(), variance.values()};
}

ExecContext reference() {
  ExecContext ctx;
  ctx.backend = Backend::reference;
  return ctx;
}

ExecContext cpu_kernels() {
  ExecContext ctx;
  ctx.num_threads = 3;
  return ctx;
}

// The scores of every row recomputed from the logical values: row i (over all sequences) ->
// scores of keys 0 .. t.
std::vector<std::vector<double>> scores_of(const IndexerCase& c, const gsa::IndexerOptions& o, bool with_bias = true) {
  const std::vector<double> q = c.q.values(), k = c.k.values(), w = c.weights.values(), bias = c.bias.values();
  const std::int64_t h = c.shape.heads, d = c.shape.dim;
  const double scale = o.scale.value_or(1.0 / std::sqrt(static_cast<double>(d)));
  const auto form = o.form == gsa::ScoreForm::relu ? math::gsa::ScoreForm::relu : math::gsa::ScoreForm::sigmoid;
  std::vector<std::vector<double>> out;
  std::int64_t q_base = 0, k_base = 0;
  for (std::size_t b = 0; b < c.shape.seqs.size(); ++b) {
    const auto [lq, lk] = c.shape.seqs[b];
    // Batched rows sit at b * L; packed ones at the running offsets.
    const std::int64_t q0 = c.shape.varlen ? q_base : static_cast<std::int64_t>(b) * lq;
    const std::int64_t k0 = c.shape.varlen ? k_base : static_cast<std::int64_t>(b) * lk;
    for (std::int64_t r = 0; r < lq; ++r) {
      const std::int64_t t = r + lk - lq;
      std::vector<double> s(static_cast<std::size_t>(t + 1), 0.0);
      for (std::int64_t j = 0; j < h; ++j) {
        for (std::int64_t key = 0; key <= t; ++key) {
          double dot = 0;
          for (std::int64_t e = 0; e < d; ++e) {
            dot += q[static_cast<std::size_t>(((q0 + r) * h + j) * d + e)] * k[static_cast<std::size_t>((k0 + key) * d + e)];
          }
          s[static_cast<std::size_t>(key)] += math::gsa::head_term(
              form, w[static_cast<std::size_t>((q0 + r) * h + j)], dot * scale, with_bias ? bias[static_cast<std::size_t>(j)] : 0.0);
        }
      }
      out.push_back(s);
    }
    q_base += lq;
    k_base += lk;
  }
  return out;
}

math::gsa::BudgetParams budget_of(const gsa::IndexerOptions& o) {
  math::gsa::BudgetParams b;
  b.rule = static_cast<math::gsa::Budget>(static_cast<int>(o.budget));
  b.k = o.k;
  b.k_base = o.k_base;
  b.k_min = o.budget == gsa::Budget::fixed ? 1 : o.k_min;
  b.k_max = o.k_max;
  b.mean_variance = o.mean_variance;
  return b;
}

// The reference's selection of every row, checked against the recomputed scores. `slack`
// allows float32 scores: a selected key may trail a left-out one by that much.
void expect_valid_selection(const IndexerCase& c, const gsa::IndexerOptions& o, const SelectionResult& got,
                            double slack, double variance_tol, bool with_bias = true) {
  const std::vector<std::vector<double>> scores = scores_of(c, o, with_bias);
  ASSERT_EQ(got.counts.size(), scores.size());
  for (std::size_t i = 0; i < scores.size(); ++i) {
    const std::vector<double>& s = scores[i];
    const std::int64_t visible = static_cast<std::int64_t>(s.size());
    double mean = 0, var = 0;
    for (double x : s) mean += x / static_cast<double>(visible);
    for (double x : s) var += (x - mean) * (x - mean) / static_cast<double>(visible);
    EXPECT_NEAR(got.variance[i], var, variance_tol * (1 + var)) << "row " << i;
    const std::int64_t count = static_cast<std::int64_t>(got.counts[i]);
    EXPECT_EQ(count, std::min(math::gsa::budget(budget_of(o), got.variance[i]), visible)) << "row " << i;
    std::set<std::int64_t> chosen;
    for (std::int64_t slot = 0; slot < o.k_max; ++slot) {
      const double v = got.indices[i * static_cast<std::size_t>(o.k_max) + static_cast<std::size_t>(slot)];
      if (slot >= count) {
        EXPECT_EQ(v, -1.0) << "row " << i << " slot " << slot;
        continue;
      }
      const auto key = static_cast<std::int64_t>(v);
      ASSERT_GE(key, 0);
      ASSERT_LT(key, visible);
      if (!chosen.empty()) EXPECT_GT(key, *chosen.rbegin()) << "row " << i << ": increasing positions";
      chosen.insert(key);
    }
    // Every chosen key outranks every key left out.
    for (std::int64_t a : chosen) {
      for (std::int64_t z = 0; z < visible; ++z) {
        if (chosen.count(z)) continue;
        const double sa = s[static_cast<std::size_t>(a)], sz = s[static_cast<std::size_t>(z)];
        if (slack == 0) {
          EXPECT_TRUE(math::gsa::ranks_before(sa, a, sz, z)) << "row " << i << ": " << a << " vs " << z;
        } else {
          EXPECT_GE(sa, sz - slack) << "row " << i << ": " << a << " vs " << z;
        }
      }
    }
  }
}

gsa::IndexerOptions inverse_variance(std::int64_t k_base, std::int64_t k_min, std::int64_t k_max, double vbar) {
  gsa::IndexerOptions o;
  o.k_base = k_base;
  o.k_min = k_min;
  o.k_max = k_max;
  o.mean_variance = vbar;
  return o;
}

const std::vector<IndexerShape>& shapes() {
  static const std::vector<IndexerShape> all = {
      {{{37, 37}, {37, 37}}, false, 3, 8},
      {{{5, 40}}, false, 2, 16},                           // suffix queries (chunked prefill)
      {{{9, 9}, {0, 0}, {30, 33}, {1, 1}}, true, 4, 8},    // packed, an empty sequence
  };
  return all;
}

TEST(GsaIndexer, ReferenceSelectsTheTopKeysOfEveryRowUnderEachBudget) {
  std::vector<gsa::IndexerOptions> options;
  options.push_back(inverse_variance(4, 2, 6, 0.05));
  gsa::IndexerOptions fixed;
  fixed.budget = gsa::Budget::fixed;
  fixed.k = 5;
  fixed.k_max = 7;
  options.push_back(fixed);
  gsa::IndexerOptions eq8 = inverse_variance(20, 1, 9, 0.08);
  eq8.budget = gsa::Budget::eq8;
  options.push_back(eq8);
  gsa::IndexerOptions code = inverse_variance(6, 1, 8, 0.05);
  code.budget = gsa::Budget::reference;
  options.push_back(code);
  for (const auto& o : options) {
    SCOPED_TRACE(static_cast<int>(o.budget));
    std::set<double> counts;
    for (const IndexerShape& shape : shapes()) {
      const IndexerCase c(shape, DType::float64, 11);
      const SelectionResult r = run(c, o, reference());
      expect_valid_selection(c, o, r, 0.0, 1e-12);
      counts.insert(r.counts.begin(), r.counts.end());
    }
    // Rows get different budgets (the rule is exercised, not pinned at a clamp).
    EXPECT_GT(counts.size(), 2u);
  }
}

TEST(GsaIndexer, DeepSeeksReluFormAndAnUnscaledProduct) {
  gsa::IndexerOptions o = inverse_variance(3, 1, 5, 0.5);
  o.form = gsa::ScoreForm::relu;
  o.scale = 1.0;
  for (const IndexerShape& shape : shapes()) {
    const IndexerCase c(shape, DType::float64, 12);
    expect_valid_selection(c, o, run(c, o, reference(), /*with_bias=*/false), 0.0, 1e-12, false);
  }
}

// Equal scores (every key the same vector) go to the most recent keys; a budget that covers
// the row takes all of it (003: S_t is every visible key while t + 1 <= k_t).
TEST(GsaIndexer, TiesGoToTheMostRecentKeysAndShortRowsTakeEveryKey) {
  IndexerCase c({{{12, 12}}, false, 2, 4}, DType::float64, 13);
  std::vector<double> k = c.k.values();
  for (std::size_t i = 4; i < k.size(); ++i) k[i] = k[i % 4];
  c.k.set_values(k);
  gsa::IndexerOptions o;
  o.budget = gsa::Budget::fixed;
  o.k = 3;
  o.k_max = 4;
  const SelectionResult r = run(c, o, reference());
  for (std::int64_t t = 0; t < 12; ++t) {
    const std::int64_t n = std::min<std::int64_t>(3, t + 1);
    ASSERT_EQ(r.counts[static_cast<std::size_t>(t)], n);
    for (std::int64_t i = 0; i < n; ++i) {
      EXPECT_EQ(r.indices[static_cast<std::size_t>(t * 4 + i)], t - n + 1 + i) << "row " << t;
    }
  }
  gsa::IndexerOptions all = inverse_variance(1, 12, 12, 1.0);
  const SelectionResult every = run(c, all, reference());
  for (std::int64_t t = 0; t < 12; ++t) {
    EXPECT_EQ(every.counts[static_cast<std::size_t>(t)], t + 1);
    for (std::int64_t i = 0; i <= t; ++i) EXPECT_EQ(every.indices[static_cast<std::size_t>(t * 12 + i)], i);
  }
}

TEST(GsaIndexer, CpuKernelsMatchTheReference) {
  const gsa::IndexerOptions o = inverse_variance(5, 2, 8, 0.05);
  for (const IndexerShape& shape : shapes()) {
    for (const bool permuted : {false, true}) {
      const IndexerCase c64(shape, DType::float64, 21, permuted);
      const SelectionResult want = run(c64, o, reference());
      // float64: the same sums in the same order, so the same selection bit for bit.
      const SelectionResult got = run(c64, o, cpu_kernels());
      EXPECT_EQ(got.indices, want.indices);
      EXPECT_EQ(got.counts, want.counts);
      EXPECT_EQ(got.variance, want.variance);
      // float32: rounding may swap keys whose scores are within float32's reach, never more.
      const IndexerCase c32(shape, DType::float32, 21, permuted);
      expect_valid_selection(c32, o, run(c32, o, cpu_kernels()), 1e-5, 1e-5);
    }
  }
}

TEST(GsaIndexer, ErrorsNameTheArgument) {
  const IndexerCase c({{{6, 6}}, false, 2, 4}, DType::float64, 31);
  const gsa::IndexerOptions good = inverse_variance(2, 1, 3, 1.0);
  HostTensor indices({1, 6, 3}, DType::int32), counts({1, 6}, DType::int32), variance({1, 6}, DType::float64);
  const gsa::Selection out{indices.view(), counts.view(), variance.view()};
  expect_error([&] {
    gsa::IndexerOptions o = good;
    o.k_max = 0;
    gsa::select_keys(c.inputs(), o, out);
  }, "k_max");
  expect_error([&] {
    gsa::IndexerOptions o = good;
    o.k_min = 4;
    gsa::select_keys(c.inputs(), o, out);
  }, "k_min");
  expect_error([&] {
    gsa::IndexerOptions o = good;
    o.mean_variance = 0;
    gsa::select_keys(c.inputs(), o, out);
  }, "mean_variance");
  expect_error([&] {
    gsa::IndexerOptions o = good;
    o.budget = gsa::Budget::fixed;
    gsa::select_keys(c.inputs(), o, out);
  }, "'k'");
  expect_error([&] {
    gsa::IndexerOptions o = good;
    o.form = gsa::ScoreForm::relu;
    gsa::select_keys(c.inputs(), o, out);
  }, "bias");
  expect_error([&] {
    HostTensor wrong({1, 6, 4}, DType::int32);
    gsa::select_keys(c.inputs(), good, {wrong.view(), counts.view(), variance.view()});
  }, "indices");
  expect_error([&] {
    HostTensor wrong({1, 6}, DType::float32);
    gsa::select_keys(c.inputs(), good, {indices.view(), counts.view(), wrong.view()});
  }, "variance");
  expect_error([&] {
    HostTensor two_heads({1, 6, 2, 4}, DType::float64);
    gsa::IndexerInputs in = c.inputs();
    in.k = two_heads.view();
    gsa::select_keys(in, good, out);
  }, "one key head");
  expect_error([&] {
    HostTensor w({1, 6, 3}, DType::float64);
    gsa::IndexerInputs in = c.inputs();
    in.head_weights = w.view();
    gsa::select_keys(in, good, out);
  }, "head_weights");
}

}  // namespace
}  // namespace winnow::testing
