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
#include "support/gsa_case.h"
#include "support/host_tensor.h"
#include "winnow/gsa.h"
#include "winnow/softmax.h"

namespace winnow::testing {
namespace {

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
  options.push_back(fixed(5, 7));
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
      const SelectionResult r = run_selection(c, o, reference());
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
    expect_valid_selection(c, o, run_selection(c, o, reference(), /*with_bias=*/false), 0.0, 1e-12, false);
  }
}

// Equal scores (every key the same vector) go to the most recent keys; a budget that covers
// the row takes all of it (003: S_t is every visible key while t + 1 <= k_t).
TEST(GsaIndexer, TiesGoToTheMostRecentKeysAndShortRowsTakeEveryKey) {
  IndexerCase c({{{12, 12}}, false, 2, 4}, DType::float64, 13);
  std::vector<double> k = c.k.values();
  for (std::size_t i = 4; i < k.size(); ++i) k[i] = k[i % 4];
  c.k.set_values(k);
  const gsa::IndexerOptions o = fixed(3, 4);
  const SelectionResult r = run_selection(c, o, reference());
  for (std::int64_t t = 0; t < 12; ++t) {
    const std::int64_t n = std::min<std::int64_t>(3, t + 1);
    ASSERT_EQ(r.counts[static_cast<std::size_t>(t)], n);
    for (std::int64_t i = 0; i < n; ++i) {
      EXPECT_EQ(r.indices[static_cast<std::size_t>(t * 4 + i)], t - n + 1 + i) << "row " << t;
    }
  }
  gsa::IndexerOptions all = inverse_variance(1, 12, 12, 1.0);
  const SelectionResult every = run_selection(c, all, reference());
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
      const SelectionResult want = run_selection(c64, o, reference());
      // float64: the same sums in the same order, so the same selection bit for bit.
      const SelectionResult got = run_selection(c64, o, cpu_kernels());
      EXPECT_EQ(got.indices, want.indices);
      EXPECT_EQ(got.counts, want.counts);
      EXPECT_EQ(got.variance, want.variance);
      // float32: rounding may swap keys whose scores are within float32's reach, never more.
      const IndexerCase c32(shape, DType::float32, 21, permuted);
      expect_valid_selection(c32, o, run_selection(c32, o, cpu_kernels()), 1e-5, 1e-5);
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
    std::vector<double> fd(static_cast<std::size_t>(tensor->numel()));
    for (std::size_t i = 0; i < fd.size(); ++i) fd[i] = central_difference(*tensor, i, 1e-6, loss);
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
  for (const ExecContext& ctx : {reference(), cpu_kernels()}) expect_second_row_empty(run_sparse(c, ctx));
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
