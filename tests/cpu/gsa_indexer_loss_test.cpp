// GSA's indexer loss (winnow/gsa.h, indexer_loss_*). The float64 reference against the KL
// recomputed here by plain loops from the logical inputs, and its gradients against central
// finite differences in the indexer's queries, key, head weights and bias; both score forms,
// with and without key lists, on batched, suffix and packed layouts with grouped-query
// attention. Properties: the KL is never negative, a row whose set is one key has none (and no
// gradient), an empty set gives 0 with log-sum-exps -inf, uniform distributions on both sides
// give 0, and lists of every visible key are the dense warm-up. Then the CPU kernels against
// the reference (float64 and float32), their results bit for bit under any thread count, and
// the API's errors.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "math/gsa.h"
#include "support/expect_error.h"
#include "support/gsa_case.h"
#include "support/host_tensor.h"
#include "winnow/gsa.h"

namespace winnow::testing {
namespace {

// An indexer shape and the attention's heads, kv heads and head dimension.
struct LossShape {
  IndexerShape indexer;
  std::int64_t heads, heads_kv, dim;
};

const std::vector<LossShape>& loss_shapes() {
  static const std::vector<LossShape> all = {
      {{{{7, 7}, {7, 7}}, false, 3, 5}, 6, 2, 7},                     // GQA, odd head dimensions
      {{{{4, 11}}, false, 2, 5}, 3, 3, 4},                            // suffix queries
      {{{{5, 5}, {0, 0}, {3, 9}, {1, 1}}, true, 3, 5}, 6, 2, 3},      // packed, an empty sequence
  };
  return all;
}

struct Variant {
  gsa::ScoreForm form;
  std::int64_t per_row;  // key lists (random_key_lists), or -1 for every visible key
  bool with_bias() const { return form == gsa::ScoreForm::sigmoid; }
};

const std::vector<Variant>& variants() {
  static const std::vector<Variant> all = {
      {gsa::ScoreForm::sigmoid, -1},
      {gsa::ScoreForm::sigmoid, 4},
      {gsa::ScoreForm::relu, -1},
      {gsa::ScoreForm::relu, 4},
  };
  return all;
}

IndexerLossCase make_case(const LossShape& s, DType dtype, std::uint64_t seed, std::int64_t per_row,
                          bool permuted = false) {
  return IndexerLossCase(s.indexer, s.heads, s.heads_kv, s.dim, dtype, seed, per_row, permuted);
}

gsa::IndexerLossOptions options_of(const Variant& v) {
  gsa::IndexerLossOptions o;
  o.form = v.form;
  return o;
}

std::string describe(const LossShape& s, const Variant& v) {
  return std::to_string(s.indexer.seqs.size()) + " sequences" + (s.indexer.varlen ? " packed" : "") + ", H " +
         std::to_string(s.heads) + "/" + std::to_string(s.heads_kv) + ", " +
         (v.form == gsa::ScoreForm::relu ? "relu" : "sigmoid") + (v.per_row >= 0 ? ", lists" : ", dense");
}

ExecContext threads(int n) {
  ExecContext ctx;
  ctx.num_threads = n;
  return ctx;
}

// The KL and log-sum-exps of every row (over all sequences) by plain loops over the logical
// values: softmax as exp / sum exp, p the heads' mean, KL = sum_S p log(p / q).
struct BruteForce {
  std::vector<double> loss, lse;
};

BruteForce brute_force(const IndexerLossCase& c, const gsa::IndexerLossOptions& o, bool with_bias) {
  gsa::IndexerOptions io;
  io.form = o.form;
  io.scale = o.scale;
  const std::vector<std::vector<double>> scores = scores_of(c.indexer, io, with_bias);
  const std::vector<double> q = c.q.values(), k = c.k.values();
  const std::vector<double> idx = c.with_lists ? c.indices.values() : std::vector<double>{};
  const std::vector<double> cnt = c.with_lists ? c.counts.values() : std::vector<double>{};
  const std::int64_t h_count = c.heads, group = c.heads / c.heads_kv, d_count = c.dim;
  const double scale = o.attention_scale.value_or(1.0 / std::sqrt(static_cast<double>(d_count)));
  BruteForce out;
  std::int64_t row = 0, k_base = 0;
  for (std::size_t b = 0; b < c.indexer.shape.seqs.size(); ++b) {
    const auto [lq, lk] = c.indexer.shape.seqs[b];
    const std::int64_t k0 = c.indexer.shape.varlen ? k_base : static_cast<std::int64_t>(b) * lk;
    for (std::int64_t r = 0; r < lq; ++r, ++row) {
      const std::int64_t t = r + lk - lq;
      std::vector<std::int64_t> set;
      if (c.with_lists) {
        for (std::int64_t i = 0; i < static_cast<std::int64_t>(cnt[static_cast<std::size_t>(row)]); ++i) {
          set.push_back(static_cast<std::int64_t>(idx[static_cast<std::size_t>(row * c.k_max + i)]));
        }
      } else {
        for (std::int64_t key = 0; key <= t; ++key) set.push_back(key);
      }
      std::vector<double> p(set.size(), 0.0), expq(set.size());
      std::vector<double> lse;
      for (std::int64_t h = 0; h < h_count; ++h) {
        std::vector<double> e(set.size());
        double total = 0;
        for (std::size_t i = 0; i < set.size(); ++i) {
          double dot = 0;
          for (std::int64_t d = 0; d < d_count; ++d) {
            dot += q[static_cast<std::size_t>((row * h_count + h) * d_count + d)] *
                   k[static_cast<std::size_t>(((k0 + set[i]) * c.heads_kv + h / group) * d_count + d)];
          }
          e[i] = std::exp(dot * scale);
          total += e[i];
        }
        for (std::size_t i = 0; i < set.size(); ++i) p[i] += e[i] / total / static_cast<double>(h_count);
        lse.push_back(std::log(total));
      }
      double total = 0;
      for (std::size_t i = 0; i < set.size(); ++i) {
        expq[i] = std::exp(scores[static_cast<std::size_t>(row)][static_cast<std::size_t>(set[i])]);
        total += expq[i];
      }
      lse.push_back(std::log(total));
      double kl = 0;
      for (std::size_t i = 0; i < set.size(); ++i) kl += p[i] * std::log(p[i] / (expq[i] / total));
      out.loss.push_back(kl);
      out.lse.insert(out.lse.end(), lse.begin(), lse.end());
    }
    k_base += lk;
  }
  return out;
}

TEST(GsaIndexerLoss, ReferenceMatchesABruteForceKl) {
  for (const LossShape& shape : loss_shapes()) {
    for (const Variant& v : variants()) {
      SCOPED_TRACE(describe(shape, v));
      const IndexerLossCase c = make_case(shape, DType::float64, 61, v.per_row);
      gsa::IndexerLossOptions o = options_of(v);
      o.scale = 0.7;
      o.attention_scale = 0.45;
      const IndexerLossResult got = run_indexer_loss(c, o, reference(), v.with_bias());
      const BruteForce want = brute_force(c, o, v.with_bias());
      EXPECT_LT(relative_error(got.loss, want.loss), 1e-12);
      EXPECT_LT(relative_error(got.lse, want.lse), 1e-13);
      for (std::size_t i = 0; i < got.loss.size(); ++i) EXPECT_GE(got.loss[i], -1e-15) << "row " << i;
    }
  }
}

TEST(GsaIndexerLoss, ReferenceGradientsMatchFiniteDifferences) {
  for (const LossShape& shape : loss_shapes()) {
    for (const Variant& v : variants()) {
      SCOPED_TRACE(describe(shape, v));
      IndexerLossCase c = make_case(shape, DType::float64, 62, v.per_row);
      const gsa::IndexerLossOptions o = options_of(v);
      const IndexerLossResult r = run_indexer_loss(c, o, reference(), v.with_bias());
      const std::vector<double> g = c.dloss.values();
      auto objective = [&] {
        const std::vector<double> loss = run_indexer_loss(c, o, reference(), v.with_bias()).loss;
        double sum = 0;
        for (std::size_t i = 0; i < loss.size(); ++i) sum += g[i] * loss[i];
        return sum;
      };
      std::vector<std::tuple<const char*, HostTensor*, const std::vector<double>*>> wrt = {
          {"q", &c.indexer.q, &r.dq}, {"k", &c.indexer.k, &r.dk}, {"head_weights", &c.indexer.weights, &r.dweights}};
      if (v.with_bias()) wrt.emplace_back("bias", &c.indexer.bias, &r.dbias);
      std::mt19937_64 pick(63);
      for (const auto& [name, tensor, analytic] : wrt) {
        std::vector<double> fd, want;
        for (int sample = 0; sample < 8; ++sample) {
          const std::size_t i = static_cast<std::size_t>(pick() % static_cast<std::uint64_t>(tensor->numel()));
          fd.push_back(central_difference(*tensor, i, 1e-5, objective));
          want.push_back((*analytic)[i]);
        }
        EXPECT_LT(relative_error(want, fd), 1e-6) << name;
      }
    }
  }
}

// Row 0 of each sequence sees one key, so its KL is 0; lists of one key do the same later, and
// an empty list gives 0 with every log-sum-exp -inf. Neither has a gradient.
TEST(GsaIndexerLoss, OneKeyAndEmptySetsHaveNoLoss) {
  IndexerLossCase c({{{6, 6}}, false, 2, 4}, 4, 2, 3, DType::float64, 64, /*per_row=*/3);
  std::vector<double> idx = c.indices.values(), cnt = c.counts.values();
  cnt[2] = 0;  // row 2: empty
  cnt[4] = 1;  // row 4: key 3 alone
  idx[4 * 3] = 3;
  c.counts.set_values(cnt);
  c.indices.set_values(idx);
  for (const ExecContext& ctx : {reference(), threads(2)}) {
    const IndexerLossResult r = run_indexer_loss(c, {}, ctx);
    for (const std::size_t row : {std::size_t{2}, std::size_t{4}}) {
      EXPECT_EQ(r.loss[row], 0.0) << "row " << row;
      for (std::size_t i = 0; i < 2 * 4; ++i) EXPECT_EQ(r.dq[row * 8 + i], 0.0) << "row " << row;
      for (std::size_t j = 0; j < 2; ++j) EXPECT_EQ(r.dweights[row * 2 + j], 0.0) << "row " << row;
    }
    for (std::size_t h = 0; h < 5; ++h) {
      EXPECT_TRUE(std::isinf(r.lse[2 * 5 + h]) && r.lse[2 * 5 + h] < 0) << "head " << h;
      EXPECT_TRUE(std::isfinite(r.lse[4 * 5 + h])) << "head " << h;
    }
  }
  // Without lists the first row's one visible key.
  const IndexerLossCase dense({{{6, 6}}, false, 2, 4}, 4, 2, 3, DType::float64, 64);
  EXPECT_EQ(run_indexer_loss(dense, {}, reference()).loss[0], 0.0);
}

// Zero attention queries make p uniform; zero indexer queries make every score sum_j
// sigmoid(w_tj) sigmoid(b_j), so the indexer's distribution is uniform too: no divergence, and
// q - p = 0 leaves no gradient.
TEST(GsaIndexerLoss, UniformDistributionsOnBothSidesGiveZero) {
  for (const std::int64_t per_row : {std::int64_t{-1}, std::int64_t{4}}) {
    IndexerLossCase c({{{9, 9}}, false, 3, 5}, 6, 2, 7, DType::float64, 65, per_row);
    c.q.fill(0.0);
    c.indexer.q.fill(0.0);
    for (const ExecContext& ctx : {reference(), threads(2)}) {
      const IndexerLossResult r = run_indexer_loss(c, {}, ctx);
      for (double x : r.loss) EXPECT_NEAR(x, 0.0, 1e-14);
      for (const std::vector<double>* g : {&r.dq, &r.dk, &r.dweights, &r.dbias}) {
        for (double x : *g) EXPECT_NEAR(x, 0.0, 1e-14);
      }
    }
  }
}

// spec/gsa.md's sparse phase with lists of every visible key is the dense warm-up.

// Every output bit for bit.
void expect_same(const IndexerLossResult& got, const IndexerLossResult& want) {
  EXPECT_EQ(got.loss, want.loss);
  EXPECT_EQ(got.lse, want.lse);
  EXPECT_EQ(got.dq, want.dq);
  EXPECT_EQ(got.dk, want.dk);
  EXPECT_EQ(got.dweights, want.dweights);
  EXPECT_EQ(got.dbias, want.dbias);
}

TEST(GsaIndexerLoss, ListsOfEveryVisibleKeyAreTheDenseLoss) {
  for (const LossShape& shape : loss_shapes()) {
    SCOPED_TRACE(describe(shape, {gsa::ScoreForm::sigmoid, 0}));
    const IndexerLossCase listed = make_case(shape, DType::float64, 66, /*per_row=*/0);
    const IndexerLossCase dense = make_case(shape, DType::float64, 66, -1);
    for (const ExecContext& ctx : {reference(), threads(2)}) {
      const IndexerLossResult a = run_indexer_loss(listed, {}, ctx), b = run_indexer_loss(dense, {}, ctx);
      expect_same(a, b);
    }
  }
}

void expect_close(const IndexerLossResult& got, const IndexerLossResult& want, double tol) {
  EXPECT_LT(relative_error(got.loss, want.loss), tol) << "loss";
  EXPECT_LT(relative_error(got.lse, want.lse), tol) << "lse";
  EXPECT_LT(relative_error(got.dq, want.dq), tol) << "dq";
  EXPECT_LT(relative_error(got.dk, want.dk), tol) << "dk";
  EXPECT_LT(relative_error(got.dweights, want.dweights), tol) << "dhead_weights";
  EXPECT_LT(relative_error(got.dbias, want.dbias), tol) << "dbias";
}

TEST(GsaIndexerLoss, CpuKernelsMatchTheReference) {
  for (const LossShape& shape : loss_shapes()) {
    for (const Variant& v : variants()) {
      for (const bool permuted : {false, true}) {
        SCOPED_TRACE(describe(shape, v) + (permuted ? ", permuted" : ""));
        const gsa::IndexerLossOptions o = options_of(v);
        const IndexerLossCase c64 = make_case(shape, DType::float64, 67, v.per_row, permuted);
        expect_close(run_indexer_loss(c64, o, cpu_kernels(), v.with_bias()),
                     run_indexer_loss(c64, o, reference(), v.with_bias()), 1e-12);
        // float32 against the reference on the same (rounded) values.
        const IndexerLossCase c32 = make_case(shape, DType::float32, 67, v.per_row, permuted);
        expect_close(run_indexer_loss(c32, o, cpu_kernels(), v.with_bias()),
                     run_indexer_loss(c32.as(DType::float64), o, reference(), v.with_bias()), 1e-5);
      }
    }
  }
}

// Longer rows than the kernels' key tiles (64), so the backward's key pass has several tiles.
TEST(GsaIndexerLoss, CpuKernelsMatchTheReferenceOverSeveralKeyTiles) {
  const LossShape shape{{{{70, 150}}, false, 4, 16}, 4, 1, 16};
  for (const Variant& v : {Variant{gsa::ScoreForm::sigmoid, -1}, Variant{gsa::ScoreForm::relu, 40}}) {
    SCOPED_TRACE(describe(shape, v));
    const IndexerLossCase c = make_case(shape, DType::float64, 68, v.per_row);
    expect_close(run_indexer_loss(c, options_of(v), cpu_kernels(), v.with_bias()),
                 run_indexer_loss(c, options_of(v), reference(), v.with_bias()), 1e-12);
  }
}

TEST(GsaIndexerLoss, CpuResultsDoNotDependOnTheThreadCount) {
  const LossShape shape{{{{40, 150}, {0, 3}, {90, 90}}, true, 4, 8}, 6, 2, 8};
  for (const DType dtype : {DType::float32, DType::float64}) {
    for (const Variant& v : variants()) {
      SCOPED_TRACE(describe(shape, v) + (dtype == DType::float32 ? ", float32" : ", float64"));
      const IndexerLossCase c = make_case(shape, dtype, 69, v.per_row == -1 ? -1 : 30);
      const IndexerLossResult one = run_indexer_loss(c, options_of(v), threads(1), v.with_bias());
      for (const int n : {2, 3}) {
        const IndexerLossResult many = run_indexer_loss(c, options_of(v), threads(n), v.with_bias());
        expect_same(many, one);
      }
    }
  }
}

// A bias shared by every head (shape (1)) gets the sum of the heads' gradients.
TEST(GsaIndexerLoss, ASharedBiasGetsEveryHeadsGradient) {
  IndexerLossCase c({{{8, 8}}, false, 3, 4}, 2, 1, 4, DType::float64, 70);
  c.indexer.bias = HostTensor({1}, DType::float64);
  c.indexer.bias.set_values({0.3});
  IndexerLossCase per_head = c;
  per_head.indexer.bias = HostTensor({3}, DType::float64);
  per_head.indexer.bias.set_values({0.3, 0.3, 0.3});
  for (const ExecContext& ctx : {reference(), threads(2)}) {
    const IndexerLossResult shared = run_indexer_loss(c, {}, ctx), split = run_indexer_loss(per_head, {}, ctx);
    EXPECT_EQ(shared.loss, split.loss);
    ASSERT_EQ(shared.dbias.size(), 1u);
    EXPECT_NEAR(shared.dbias[0], split.dbias[0] + split.dbias[1] + split.dbias[2], 1e-15);
  }
}

TEST(GsaIndexerLoss, ErrorsNameTheArgument) {
  const IndexerLossCase c({{{5, 5}}, false, 2, 4}, 2, 1, 4, DType::float64, 71, /*per_row=*/2);
  HostTensor loss({1, 5}, DType::float64), lse({1, 5, 3}, DType::float64);
  loss.fill(5.0);
  const gsa::IndexerLossOutputs out{loss.view(), lse.view()};
  auto forward = [&](const gsa::IndexerLossInputs& in, const gsa::IndexerLossOptions& o = {}) {
    return [&, in, o] { gsa::indexer_loss_forward(in, o, out); };
  };
  // The attention's sequences must be the indexer's.
  HostTensor short_q({1, 4, 2, 4}, DType::float64);
  gsa::IndexerLossInputs in = c.inputs();
  in.q = short_q.view();
  expect_error(forward(in), "the indexer's sequences");
  HostTensor long_k({1, 6, 1, 4}, DType::float64);
  in = c.inputs();
  in.k = long_k.view();
  expect_error(forward(in), "the indexer's sequences");
  // Packed: the attention's rows against the indexer's offsets.
  const IndexerLossCase packed({{{3, 3}, {2, 4}}, true, 2, 4}, 2, 1, 4, DType::float64, 72);
  HostTensor packed_loss({5}, DType::float64), packed_lse({5, 3}, DType::float64), extra_q({6, 2, 4}, DType::float64);
  in = packed.inputs();
  in.q = extra_q.view();
  expect_error([&] { gsa::indexer_loss_forward(in, {}, {packed_loss.view(), packed_lse.view()}); },
               "(attention operands): argument 'cu_seqlens_q'");
  // Attention operands in the indexer's dtype.
  const IndexerLossCase c32({{{5, 5}}, false, 2, 4}, 2, 1, 4, DType::float32, 71);
  in = c.inputs();
  in.q = c32.q.view();
  in.k = c32.k.view();
  expect_error(forward(in), "like the indexer's q");
  in = c.inputs();
  in.k = c32.k.view();
  expect_error(forward(in), "argument 'k'");
  // The score form's bias.
  gsa::IndexerLossOptions relu;
  relu.form = gsa::ScoreForm::relu;
  expect_error(forward(c.inputs(), relu), "argument 'bias'");
  // One log-sum-exp per attention head and the indexer's.
  HostTensor narrow({1, 5, 2}, DType::float64);
  expect_error([&] { gsa::indexer_loss_forward(c.inputs(), {}, {loss.view(), narrow.view()}); }, "argument 'lse'");
  HostTensor loss32({1, 5}, DType::float32);
  expect_error([&] { gsa::indexer_loss_forward(c.inputs(), {}, {loss32.view(), lse.view()}); }, "argument 'loss'");
  // Bad lists.
  IndexerLossCase bad = c;
  std::vector<double> idx = bad.indices.values();
  idx[0] = 1;  // row 0 sees key 0 only
  bad.indices.set_values(idx);
  bad.counts.set_values({1, 1, 1, 1, 1});
  expect_error(forward(bad.inputs()), "argument 'indices'");
  bad = c;
  bad.counts.set_values({0, 3, 0, 0, 0});
  expect_error(forward(bad.inputs()), "argument 'counts'");
  for (double x : loss.values()) EXPECT_EQ(x, 5.0);  // nothing written

  // The backward's gradients.
  gsa::indexer_loss_forward(c.inputs(), {}, out);
  HostTensor dq(c.indexer.q.shape(), DType::float64), dk(c.indexer.k.shape(), DType::float64),
      dw(c.indexer.weights.shape(), DType::float64), db({2}, DType::float64), dq32(c.indexer.q.shape(), DType::float32);
  auto backward = [&](const gsa::IndexerLossInputs& bin, const gsa::IndexerLossGrads& grads) {
    return [&, bin, grads] { gsa::indexer_loss_backward(bin, {}, out, c.dloss.view(), grads); };
  };
  expect_error(backward(c.inputs(/*with_bias=*/false), {dq.view(), dk.view(), dw.view(), db.view()}),
               "argument 'dbias'");
  expect_error(backward(c.inputs(), {dq32.view(), dk.view(), dw.view(), db.view()}), "argument 'dq'");
  expect_error(backward(c.inputs(), {dq.view(), dq.view(), dw.view(), db.view()}), "argument 'dk'");
  HostTensor dloss32({1, 5}, DType::float32);
  expect_error([&] {
    gsa::indexer_loss_backward(c.inputs(), {}, out, dloss32.view(), {dq.view(), dk.view(), dw.view(), db.view()});
  }, "argument 'dloss'");
}

}  // namespace
}  // namespace winnow::testing
