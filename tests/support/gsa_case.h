// GSA test cases shared by the CPU and CUDA tests: random indexer inputs and key lists over
// batched, suffix and packed layouts, runs through the API on the host or a device
// (support/attention_case.h's Placement), and the checks of a selection against scores
// recomputed here from the logical inputs; the indexer loss's cases (IndexerLossCase, with
// random_key_lists) and their runs.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <random>
#include <set>
#include <vector>

#include "math/gsa.h"
#include "support/attention_case.h"
#include "support/host_tensor.h"
#include "winnow/gsa.h"

namespace winnow::testing {

// d objective / d t[i] by central differences of step h; t holds its own values again after.
template <class Objective>
double central_difference(HostTensor& t, std::size_t i, double h, Objective&& objective) {
  std::vector<double> x = t.values();
  const double x0 = x[i];
  x[i] = x0 + h;
  t.set_values(x);
  const double up = objective();
  x[i] = x0 - h;
  t.set_values(x);
  const double down = objective();
  x[i] = x0;
  t.set_values(x);
  return (up - down) / (2 * h);
}

// Budget options: 003's inverse-variance rule, and a fixed k.
inline gsa::IndexerOptions inverse_variance(std::int64_t k_base, std::int64_t k_min, std::int64_t k_max, double vbar) {
  gsa::IndexerOptions o;
  o.k_base = k_base;
  o.k_min = k_min;
  o.k_max = k_max;
  o.mean_variance = vbar;
  return o;
}

inline gsa::IndexerOptions fixed(std::int64_t k, std::int64_t k_max) {
  gsa::IndexerOptions o;
  o.budget = gsa::Budget::fixed;
  o.k = k;
  o.k_max = k_max;
  return o;
}

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

// placement: where the call's tensors live (nullptr: host memory).
inline SelectionResult run_selection(const IndexerCase& c, const gsa::IndexerOptions& o, const ExecContext& ctx,
                                     bool with_bias = true, Placement* placement = nullptr) {
  const DType stats = c.q.dtype() == DType::float64 ? DType::float64 : DType::float32;
  HostTensor indices(c.row_shape(o.k_max), DType::int32), counts(c.row_shape(), DType::int32),
      variance(c.row_shape(), stats);
  indices.fill(-7);
  counts.fill(-7);
  variance.fill(-7);
  if (placement == nullptr) {
    gsa::select_keys(c.inputs(with_bias), o, {indices.view(), counts.view(), variance.view()}, ctx);
  } else {
    gsa::IndexerInputs in = c.inputs(with_bias);
    in.q = placement->place(c.q);
    in.k = placement->place(c.k);
    in.head_weights = placement->place(c.weights);
    if (with_bias) in.bias = placement->place(c.bias);
    if (c.shape.varlen) {
      in.cu_seqlens_q = placement->place(c.cu_q);
      in.cu_seqlens_k = placement->place(c.cu_k);
    }
    const TensorView di = placement->place(indices), dc = placement->place(counts), dv = placement->place(variance);
    gsa::select_keys(in, o, {di, dc, dv}, ctx);
    placement->fetch(di, indices);
    placement->fetch(dc, counts);
    placement->fetch(dv, variance);
  }
  return {indices.values(), counts.values(), variance.values()};
}

inline ExecContext reference() {
  ExecContext ctx;
  ctx.backend = Backend::reference;
  return ctx;
}

inline ExecContext cpu_kernels() {
  ExecContext ctx;
  ctx.num_threads = 3;
  return ctx;
}

// The scores of every row recomputed from the logical values: row i (over all sequences) ->
// scores of keys 0 .. t.
inline std::vector<std::vector<double>> scores_of(const IndexerCase& c, const gsa::IndexerOptions& o, bool with_bias = true) {
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

inline math::gsa::BudgetParams budget_of(const gsa::IndexerOptions& o) {
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
inline void expect_valid_selection(const IndexerCase& c, const gsa::IndexerOptions& o, const SelectionResult& got,
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

// placement: where the call's tensors live (nullptr: host memory).
inline SparseResult run_sparse(const SparseCase& c, const ExecContext& ctx, Placement* placement = nullptr) {
  const DType dtype = c.q.dtype(), stats = dtype == DType::float64 ? DType::float64 : DType::float32;
  std::vector<std::int64_t> out_shape = c.dout.shape(), lse_shape = c.q.shape();
  lse_shape.pop_back();
  HostTensor out(out_shape, dtype), lse(lse_shape, stats), dq(c.q.shape(), dtype), dk(c.k.shape(), dtype),
      dv(c.v.shape(), dtype);
  for (HostTensor* t : {&out, &lse, &dq, &dk, &dv}) t->fill(123.0);  // every entry must be written
  if (placement == nullptr) {
    gsa::sparse_forward(c.inputs(), c.lists(), std::nullopt, {out.view(), lse.view()}, ctx);
    gsa::sparse_backward(c.inputs(), c.lists(), std::nullopt, {out.view(), lse.view()}, c.dout.view(),
                         {dq.view(), dk.view(), dv.view()}, ctx);
  } else {
    AttentionInputs in = c.inputs();
    in.q = placement->place(c.q);
    in.k = placement->place(c.k);
    in.v = placement->place(c.v);
    if (c.shape.varlen) in.cu_seqlens_q = placement->place(c.cu);
    const gsa::KeyLists lists{placement->place(c.indices), placement->place(c.counts)};
    const TensorView o = placement->place(out), l = placement->place(lse), gq = placement->place(dq),
                     gk = placement->place(dk), gv = placement->place(dv), d = placement->place(c.dout);
    gsa::sparse_forward(in, lists, std::nullopt, {o, l}, ctx);
    gsa::sparse_backward(in, lists, std::nullopt, {o, l}, d, {gq, gk, gv}, ctx);
    placement->fetch(o, out);
    placement->fetch(l, lse);
    placement->fetch(gq, dq);
    placement->fetch(gk, dk);
    placement->fetch(gv, dv);
  }
  return {out.values(), lse.values(), dq.values(), dk.values(), dv.values()};
}

// The empty-list case: one sequence of 3 queries with 2 query heads of 4 features whose second
// row's list is empty; that row outputs zero, gets zero dq and lse -inf.
inline void expect_second_row_empty(const SparseResult& r) {
  for (std::int64_t h = 0; h < 2; ++h) {
    EXPECT_TRUE(std::isinf(r.lse[static_cast<std::size_t>(2 + h)]) && r.lse[static_cast<std::size_t>(2 + h)] < 0);
    for (std::int64_t d = 0; d < 4; ++d) {
      EXPECT_EQ(r.out[static_cast<std::size_t>((1 * 2 + h) * 4 + d)], 0.0);
      EXPECT_EQ(r.dq[static_cast<std::size_t>((1 * 2 + h) * 4 + d)], 0.0);
    }
  }
}

// Random key lists over a shape's rows (per_row > 0): a fifth of the rows empty, a fifth listing
// every visible key when they fit in per_row slots (the rest: min(per_row, t + 1) keys drawn at
// random); per_row = 0 lists every visible key in slots as many as the longest sequence's keys.
// Indices (rows, k_max) -1 padded and counts (rows), row-major over all sequences' query rows.
struct RandomLists {
  std::vector<double> indices, counts;
  std::int64_t k_max = 0;
};

inline RandomLists random_key_lists(const IndexerShape& shape, std::int64_t per_row, std::mt19937_64& rng) {
  RandomLists out;
  for (const auto& seq : shape.seqs) out.k_max = std::max(out.k_max, seq.second);
  if (per_row > 0) out.k_max = per_row;
  out.k_max = std::max<std::int64_t>(out.k_max, 1);
  for (const auto& [lq, lk] : shape.seqs) {
    for (std::int64_t r = 0; r < lq; ++r) {
      const std::int64_t visible = r + lk - lq + 1;
      std::vector<std::int64_t> keys(static_cast<std::size_t>(visible));
      for (std::size_t i = 0; i < keys.size(); ++i) keys[i] = static_cast<std::int64_t>(i);
      const std::uint64_t kind = per_row > 0 ? rng() % 5 : 1;
      if (kind == 0) {
        keys.clear();
      } else if (kind != 1 || visible > out.k_max) {
        std::shuffle(keys.begin(), keys.end(), rng);
        keys.resize(static_cast<std::size_t>(std::min(visible, out.k_max)));
        std::sort(keys.begin(), keys.end());
      }
      for (std::size_t i = 0; i < static_cast<std::size_t>(out.k_max); ++i) {
        out.indices.push_back(i < keys.size() ? static_cast<double>(keys[i]) : -1.0);
      }
      out.counts.push_back(static_cast<double>(keys.size()));
    }
  }
  return out;
}

// GSA's indexer loss (gsa::indexer_loss_*): the indexer's operands (an IndexerCase), the
// attention's q (heads of dim features) and k (heads_kv heads) over the same sequences, an
// incoming gradient per row, and optional key lists (random_key_lists).
struct IndexerLossCase {
  IndexerCase indexer;
  std::int64_t heads = 6, heads_kv = 2, dim = 7;
  HostTensor q, k, dloss, indices, counts;
  std::int64_t k_max = 0;
  bool with_lists = false;

  // per_row < 0: no lists (every visible key); otherwise random_key_lists(per_row).
  IndexerLossCase(const IndexerShape& shape, std::int64_t h, std::int64_t hkv, std::int64_t d, DType dtype,
                  std::uint64_t seed, std::int64_t per_row = -1, bool permuted = false)
      : indexer(shape, dtype, seed, permuted), heads(h), heads_kv(hkv), dim(d), with_lists(per_row >= 0) {
    std::mt19937_64 rng(seed + 1000);
    const std::int64_t b = static_cast<std::int64_t>(shape.seqs.size());
    std::int64_t rows_k = 0;
    for (const auto& seq : shape.seqs) rows_k += seq.second;
    const DType stats = dtype == DType::float64 ? DType::float64 : DType::float32;
    if (shape.varlen) {
      const std::vector<int> order = permuted ? std::vector<int>{1, 0, 2} : std::vector<int>{};
      q = HostTensor({indexer.rows_q, h, d}, dtype, order);
      k = HostTensor({rows_k, hkv, d}, dtype, order);
    } else {
      const std::vector<int> order = permuted ? std::vector<int>{0, 2, 1, 3} : std::vector<int>{};
      q = HostTensor({b, shape.seqs[0].first, h, d}, dtype, order);
      k = HostTensor({b, shape.seqs[0].second, hkv, d}, dtype, order);
    }
    q.set_values(random_normal(q.numel(), rng));
    k.set_values(random_normal(k.numel(), rng));
    dloss = HostTensor(indexer.row_shape(), stats);
    dloss.set_values(random_normal(dloss.numel(), rng));
    if (with_lists) {
      const RandomLists lists = random_key_lists(shape, per_row, rng);
      k_max = lists.k_max;
      indices = HostTensor(indexer.row_shape(k_max), DType::int32);
      counts = HostTensor(indexer.row_shape(), DType::int32);
      indices.set_values(lists.indices);
      counts.set_values(lists.counts);
    }
  }

  // The same values in another dtype (the bias and dloss in the statistics' dtype).
  IndexerLossCase as(DType dtype) const {
    IndexerLossCase c = *this;
    const DType stats = dtype == DType::float64 ? DType::float64 : DType::float32;
    for (HostTensor* t : {&c.q, &c.k, &c.indexer.q, &c.indexer.k, &c.indexer.weights}) *t = t->converted(dtype);
    c.indexer.bias = indexer.bias.converted(stats);
    c.dloss = dloss.converted(stats);
    return c;
  }

  gsa::IndexerLossInputs inputs(bool with_bias = true) const {
    gsa::IndexerLossInputs in;
    in.indexer = indexer.inputs(with_bias);
    in.q = q.view();
    in.k = k.view();
    if (with_lists) in.lists = gsa::KeyLists{indices.view(), counts.view()};
    return in;
  }
};

struct IndexerLossResult {
  std::vector<double> loss, lse, dq, dk, dweights, dbias;
};

// Forward then backward (with dbias when `with_bias`) through the API. placement: where the
// call's tensors live (nullptr: host memory).
inline IndexerLossResult run_indexer_loss(const IndexerLossCase& c, const gsa::IndexerLossOptions& o,
                                          const ExecContext& ctx, bool with_bias = true,
                                          Placement* placement = nullptr) {
  const DType stats = c.q.dtype() == DType::float64 ? DType::float64 : DType::float32;
  HostTensor loss(c.indexer.row_shape(), stats), lse(c.indexer.row_shape(c.heads + 1), stats),
      dq(c.indexer.q.shape(), stats), dk(c.indexer.k.shape(), stats), dweights(c.indexer.weights.shape(), stats),
      dbias(c.indexer.bias.shape(), stats);
  for (HostTensor* t : {&loss, &lse, &dq, &dk, &dweights, &dbias}) t->fill(123.0);  // every entry must be written
  auto at = [&](const HostTensor& t) { return placement == nullptr ? t.view() : placement->place(t); };
  gsa::IndexerLossInputs in = c.inputs(with_bias);
  in.indexer.q = at(c.indexer.q);
  in.indexer.k = at(c.indexer.k);
  in.indexer.head_weights = at(c.indexer.weights);
  if (with_bias) in.indexer.bias = at(c.indexer.bias);
  if (c.indexer.shape.varlen) {
    in.indexer.cu_seqlens_q = at(c.indexer.cu_q);
    in.indexer.cu_seqlens_k = at(c.indexer.cu_k);
  }
  in.q = at(c.q);
  in.k = at(c.k);
  if (c.with_lists) in.lists = gsa::KeyLists{at(c.indices), at(c.counts)};
  const TensorView l = at(loss), s = at(lse), g = at(c.dloss), gq = at(dq), gk = at(dk), gw = at(dweights),
                   gb = at(dbias);
  gsa::indexer_loss_forward(in, o, {l, s}, ctx);
  gsa::IndexerLossGrads grads{gq, gk, gw, std::nullopt};
  if (with_bias) grads.dbias = gb;
  gsa::indexer_loss_backward(in, o, {l, s}, g, grads, ctx);
  if (placement != nullptr) {
    placement->fetch(l, loss);
    placement->fetch(s, lse);
    placement->fetch(gq, dq);
    placement->fetch(gk, dk);
    placement->fetch(gw, dweights);
    if (with_bias) placement->fetch(gb, dbias);
  }
  IndexerLossResult r{loss.values(), lse.values(), dq.values(), dk.values(), dweights.values(), {}};
  if (with_bias) r.dbias = dbias.values();
  return r;
}

}  // namespace winnow::testing
