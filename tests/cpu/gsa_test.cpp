// GSA's indexer with selection (spec/gsa.md). The float64 reference against scores recomputed
// here from the logical inputs: the reported variance, the budget it implies, a selection of
// min(k_t, t + 1) distinct positions <= t in increasing order that outranks every key left
// out (ties toward the more recent key); every budget rule, both score forms. Then the CPU
// kernels against the reference (bitwise in float64, by rank in float32) on batched, suffix
// and packed layouts with permuted strides, and the API's errors.
// The sparse attention over those lists: with every visible key listed it is softmax attention
// (spec/gsa.md's first check), its float64 gradients against finite differences, an empty list,
// the CPU kernels against the reference (GQA, Dv != D, suffix queries, packed sequences,
// permuted strides, float64 and float32), and bad lists refused before any work.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <random>
#include <set>
#include <tuple>

#include "math/gsa.h"
#include "support/expect_error.h"
#include "support/host_tensor.h"
#include "winnow/gsa.h"
#include "winnow/softmax.h"

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

// ------------------------------------------------------------------ sparse attention

struct SparseCase {
  IndexerShape shape;
  std::int64_t heads_kv = 2, dim_v = 6;
  HostTensor q, k, v, dout, indices, counts, cu;
  std::int64_t rows_q = 0, k_max = 0;

  // Lists of `per_row` keys drawn at random from each row's visible ones (all of them when
  // per_row >= t + 1); per_row = 0 lists every visible key.
  SparseCase(IndexerShape s, std::int64_t hkv, std::int64_t dv, DType dtype, std::uint64_t seed, std::int64_t per_row,
             bool permuted = false)
      : shape(std::move(s)), heads_kv(hkv), dim_v(dv) {
    std::mt19937_64 rng(seed);
    const std::int64_t h = shape.heads, d = shape.dim, b = static_cast<std::int64_t>(shape.seqs.size());
    std::vector<std::int32_t> cq = {0}, ck = {0};
    std::int64_t longest = 0;
    for (const auto& [lq, lk] : shape.seqs) {
      cq.push_back(cq.back() + static_cast<std::int32_t>(lq));
      ck.push_back(ck.back() + static_cast<std::int32_t>(lk));
      longest = std::max(longest, lk);
    }
    rows_q = cq.back();
    k_max = per_row > 0 ? per_row : longest;
    const std::vector<int> order = permuted ? std::vector<int>{0, 2, 1, 3} : std::vector<int>{};
    const std::vector<int> order3 = permuted ? std::vector<int>{1, 0, 2} : std::vector<int>{};
    if (shape.varlen) {
      q = HostTensor({cq.back(), h, d}, dtype, order3);
      k = HostTensor({ck.back(), hkv, d}, dtype, order3);
      v = HostTensor({ck.back(), hkv, dv}, dtype);
      dout = HostTensor({cq.back(), h, dv}, dtype);
      indices = HostTensor({cq.back(), k_max}, DType::int32);
      counts = HostTensor({cq.back()}, DType::int32);
      cu = int32_tensor(cq);
    } else {
      const std::int64_t lq = shape.seqs[0].first, lk = shape.seqs[0].second;
      q = HostTensor({b, lq, h, d}, dtype, order);
      k = HostTensor({b, lk, hkv, d}, dtype, order);
      v = HostTensor({b, lk, hkv, dv}, dtype);
      dout = HostTensor({b, lq, h, dv}, dtype);
      indices = HostTensor({b, lq, k_max}, DType::int32);
      counts = HostTensor({b, lq}, DType::int32);
    }
    for (HostTensor* t : {&q, &k, &v, &dout}) t->set_values(random_normal(t->numel(), rng));
    std::vector<double> idx(static_cast<std::size_t>(rows_q * k_max), -1.0), cnt;
    std::int64_t row = 0;
    for (const auto& [lq, lk] : shape.seqs) {
      for (std::int64_t r = 0; r < lq; ++r, ++row) {
        std::vector<std::int64_t> keys(static_cast<std::size_t>(r + lk - lq + 1));
        for (std::size_t i = 0; i < keys.size(); ++i) keys[i] = static_cast<std::int64_t>(i);
        std::shuffle(keys.begin(), keys.end(), rng);
        keys.resize(std::min<std::size_t>(keys.size(), static_cast<std::size_t>(k_max)));
        std::sort(keys.begin(), keys.end());
        for (std::size_t i = 0; i < keys.size(); ++i) idx[static_cast<std::size_t>(row * k_max) + i] = static_cast<double>(keys[i]);
        cnt.push_back(static_cast<double>(keys.size()));
      }
    }
    indices.set_values(idx);
    counts.set_values(cnt);
  }

  AttentionInputs inputs() const {
    AttentionInputs in{q.view(), k.view(), v.view(), std::nullopt, std::nullopt};
    if (shape.varlen) in.cu_seqlens_q = cu.view();  // keys and queries share the offsets here
    return in;
  }
  gsa::KeyLists lists() const { return {indices.view(), counts.view()}; }
};

struct SparseResult {
  std::vector<double> out, lse, dq, dk, dv;
};

SparseResult run_sparse(const SparseCase& c, const ExecContext& ctx) {
  const DType dtype = c.q.dtype(), stats = dtype == DType::float64 ? DType::float64 : DType::float32;
  std::vector<std::int64_t> out_shape = c.dout.shape(), lse_shape = c.q.shape();
  lse_shape.pop_back();
  HostTensor out(out_shape, dtype), lse(lse_shape, stats), dq(c.q.shape(), dtype), dk(c.k.shape(), dtype),
      dv(c.v.shape(), dtype);
  for (HostTensor* t : {&out, &dq, &dk, &dv}) t->fill(123.0);  // every entry must be written
  gsa::sparse_forward(c.inputs(), c.lists(), std::nullopt, {out.view(), lse.view()}, ctx);
  gsa::sparse_backward(c.inputs(), c.lists(), std::nullopt, {out.view(), lse.view()}, c.dout.view(),
                       {dq.view(), dk.view(), dv.view()}, ctx);
  return {out.values(), lse.values(), dq.values(), dk.values(), dv.values()};
}

// The packed case's sequences have q_len == k_len, so one cu_seqlens serves both.
const std::vector<IndexerShape>& sparse_shapes() {
  static const std::vector<IndexerShape> all = {
      {{{23, 23}, {23, 23}}, false, 4, 8},
      {{{6, 31}}, false, 4, 8},                        // suffix queries
      {{{7, 7}, {0, 0}, {19, 19}, {1, 1}}, true, 2, 4},  // packed, an empty sequence
  };
  return all;
}

TEST(GsaSparse, EveryVisibleKeyListedIsSoftmaxAttention) {
  for (const IndexerShape& shape : sparse_shapes()) {
    const SparseCase c(shape, 2, 6, DType::float64, 41, /*per_row=*/0);
    const SparseResult sparse = run_sparse(c, reference());
    HostTensor out(c.dout.shape(), DType::float64), lse(std::vector<std::int64_t>(c.q.shape().begin(), c.q.shape().end() - 1), DType::float64),
        dq(c.q.shape(), DType::float64), dk(c.k.shape(), DType::float64), dv(c.v.shape(), DType::float64);
    AttentionInputs in = c.inputs();
    if (shape.varlen) in.cu_seqlens_k = c.cu.view();
    softmax::forward(in, {}, {out.view(), lse.view()}, reference());
    softmax::backward(in, {}, {out.view(), lse.view()}, c.dout.view(), {dq.view(), dk.view(), dv.view()}, reference());
    EXPECT_LT(relative_error(sparse.out, out.values()), 1e-13);
    EXPECT_LT(relative_error(sparse.lse, lse.values()), 1e-13);
    EXPECT_LT(relative_error(sparse.dq, dq.values()), 1e-12);
    EXPECT_LT(relative_error(sparse.dk, dk.values()), 1e-12);
    EXPECT_LT(relative_error(sparse.dv, dv.values()), 1e-12);
  }
}

TEST(GsaSparse, ReferenceGradientsMatchFiniteDifferences) {
  SparseCase c({{{9, 12}}, false, 4, 4}, 2, 3, DType::float64, 42, /*per_row=*/4);
  const SparseResult r = run_sparse(c, reference());
  auto loss = [&] {
    const SparseResult x = run_sparse(c, reference());
    const std::vector<double> g = c.dout.values();
    double l = 0;
    for (std::size_t i = 0; i < g.size(); ++i) l += g[i] * x.out[i];
    return l;
  };
  for (const auto& [name, tensor, want] : {std::tuple<const char*, HostTensor*, const std::vector<double>*>{"q", &c.q, &r.dq},
                                           {"k", &c.k, &r.dk}, {"v", &c.v, &r.dv}}) {
    std::vector<double> x = tensor->values(), fd(x.size());
    for (std::size_t i = 0; i < x.size(); ++i) {
      const double x0 = x[i], h = 1e-6;
      x[i] = x0 + h;
      tensor->set_values(x);
      const double up = loss();
      x[i] = x0 - h;
      tensor->set_values(x);
      const double down = loss();
      x[i] = x0;
      tensor->set_values(x);
      fd[i] = (up - down) / (2 * h);
    }
    EXPECT_LT(relative_error(*want, fd), 1e-8) << name;
  }
  // Keys no list holds get exactly zero gradient: 3 rows of 2 keys leave at least 6 of 12.
  const SparseCase few({{{3, 12}}, false, 4, 4}, 2, 3, DType::float64, 46, /*per_row=*/2);
  const SparseResult g = run_sparse(few, reference());
  std::set<std::int64_t> listed;
  const std::vector<double> idx = few.indices.values();
  for (double x : idx) {
    if (x >= 0) listed.insert(static_cast<std::int64_t>(x));
  }
  ASSERT_LE(listed.size(), 6u);
  for (std::int64_t key = 0; key < 12; ++key) {
    for (std::int64_t i = 0; i < 2 * 4; ++i) {  // kv heads x D
      const double dk = g.dk[static_cast<std::size_t>(key * 8 + i)];
      if (listed.count(key)) continue;
      EXPECT_EQ(dk, 0.0) << "key " << key;
    }
  }
}

TEST(GsaSparse, AnEmptyListOutputsZero) {
  SparseCase c({{{3, 3}}, false, 2, 4}, 1, 4, DType::float64, 43, 2);
  std::vector<double> counts = c.counts.values();
  counts[1] = 0;
  c.counts.set_values(counts);
  for (const ExecContext& ctx : {reference(), cpu_kernels()}) {
    const SparseResult r = run_sparse(c, ctx);
    for (std::int64_t h = 0; h < 2; ++h) {
      EXPECT_TRUE(std::isinf(r.lse[static_cast<std::size_t>(2 + h)]) && r.lse[static_cast<std::size_t>(2 + h)] < 0);
      for (std::int64_t d = 0; d < 4; ++d) {
        EXPECT_EQ(r.out[static_cast<std::size_t>((1 * 2 + h) * 4 + d)], 0.0);
        EXPECT_EQ(r.dq[static_cast<std::size_t>((1 * 2 + h) * 4 + d)], 0.0);
      }
    }
  }
}

TEST(GsaSparse, CpuKernelsMatchTheReference) {
  for (const IndexerShape& shape : sparse_shapes()) {
    for (const bool permuted : {false, true}) {
      SCOPED_TRACE(::testing::Message() << shape.seqs.size() << " sequences, permuted " << permuted);
      const SparseCase c64(shape, 2, 6, DType::float64, 44, 5, permuted);
      const SparseResult want = run_sparse(c64, reference());
      const SparseCase c32(shape, 2, 6, DType::float32, 44, 5, permuted);
      for (const auto& [c, tol] : {std::pair<const SparseCase*, double>{&c64, 1e-12}, {&c32, 1e-5}}) {
        const SparseResult got = run_sparse(*c, cpu_kernels());
        EXPECT_LT(relative_error(got.out, want.out), tol);
        EXPECT_LT(relative_error(got.lse, want.lse), tol);
        EXPECT_LT(relative_error(got.dq, want.dq), tol);
        EXPECT_LT(relative_error(got.dk, want.dk), tol);
        EXPECT_LT(relative_error(got.dv, want.dv), tol);
      }
    }
  }
}

TEST(GsaSparse, BadListsAreRefusedBeforeAnyWork) {
  SparseCase c({{{4, 4}}, false, 2, 4}, 1, 4, DType::float64, 45, 2);
  HostTensor out(c.dout.shape(), DType::float64), lse({1, 4, 2}, DType::float64);
  out.fill(5.0);
  auto call = [&] { gsa::sparse_forward(c.inputs(), c.lists(), std::nullopt, {out.view(), lse.view()}); };
  const std::vector<double> idx = c.indices.values(), cnt = c.counts.values();
  auto with = [&](std::vector<double> i, std::vector<double> n, const std::string& fragment) {
    c.indices.set_values(i);
    c.counts.set_values(n);
    expect_error(call, fragment);
    c.indices.set_values(idx);
    c.counts.set_values(cnt);
  };
  std::vector<double> future = idx;
  future[0] = 1;  // row 0 sees key 0 only
  with(future, cnt, "strictly increasing positions in [0, 0]");
  std::vector<double> repeated = idx;
  repeated[3 * 2 + 0] = repeated[3 * 2 + 1] = 2;  // row 3 lists key 2 twice
  with(repeated, cnt, "indices");
  std::vector<double> many = cnt;
  many[2] = 3;
  with(idx, many, "counts");
  std::vector<double> negative = cnt;
  negative[2] = -1;
  with(idx, negative, "counts");
  for (double x : out.values()) EXPECT_EQ(x, 5.0);  // nothing written
  HostTensor wide({1, 4, 2}, DType::float32);
  expect_error([&] { gsa::sparse_forward(c.inputs(), {wide.view(), c.counts.view()}, std::nullopt, {out.view(), lse.view()}); },
               "indices");
}

}  // namespace
}  // namespace winnow::testing
