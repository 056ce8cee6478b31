// GSA's CUDA kernels. The selection against scores recomputed in float64 from the same
// (rounded) inputs: every budget rule and both score forms, batched, suffix and packed layouts,
// rows long enough for the histogram and candidate passes, and a tie group larger than the
// candidate buffer (ties go to the most recent keys). The sparse attention against the float64
// reference on the same rounded inputs: GQA, D = 128, Dv != D, packed sequences, permuted
// strides, float32 / bf16 / fp16, atomic and deterministic backward (the latter bitwise
// repeatable); empty lists; malformed lists refused by the device check, naming the row. The
// indexer loss against the float64 reference.
// Label `cuda`: runs only on a machine with a GPU (tools/gpu_check.sh).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <string>
#include <type_traits>

#include "cuda_placement.h"
#include "support/expect_error.h"
#include "support/gsa_case.h"
#include "support/scoped_env.h"

namespace winnow::testing {
namespace {

ExecContext on_cuda(bool deterministic = false) {
  ExecContext ctx;
  ctx.deterministic = deterministic;
  return ctx;
}

// The same case with its (rounded) values in float64, for the reference.
template <class Case>
Case as_float64(const Case& c) {
  Case d = c;
  for (HostTensor* t : {&d.q, &d.k}) *t = t->converted(DType::float64);
  if constexpr (std::is_same_v<Case, SparseCase>) {
    d.v = c.v.converted(DType::float64);
    d.dout = c.dout.converted(DType::float64);
  } else {
    d.weights = c.weights.converted(DType::float64);
    d.bias = c.bias.converted(DType::float64);
  }
  return d;
}

TEST(CudaGsaSelection, SelectsTheTopKeysOfEveryRow) {
  const std::vector<IndexerShape> shapes = {
      {{{37, 37}, {37, 37}}, false, 3, 8},
      {{{5, 40}}, false, 2, 16},
      {{{9, 9}, {0, 0}, {30, 33}, {1, 1}}, true, 4, 8},
      {{{24, 3000}}, false, 4, 64},  // long rows: histogram, candidates
      {{{20, 20}}, false, 2, 6},     // d_I not a multiple of the 16-byte pack: scalar loads
      // 16-bit inputs with d_I 64 or 128 are first counted on tensor cores (16 rows a block) when
      // k_max covers every row (the options with k_max = 512 below):
      // packed sequences, an empty one, query suffixes, a row tile cut short; 16 heads, the most.
      {{{9, 9}, {0, 0}, {30, 33}, {1, 1}, {70, 200}}, true, 4, 64},
      {{{100, 300}, {100, 300}}, false, 3, 128},
      {{{40, 40}}, false, 16, 64},
  };
  std::vector<std::pair<gsa::IndexerOptions, bool>> options;  // (options, with bias)
  options.push_back({inverse_variance(4, 2, 6, 0.05), true});
  options.push_back({fixed(5, 7), true});
  gsa::IndexerOptions eq8 = inverse_variance(20, 1, 9, 0.08);
  eq8.budget = gsa::Budget::eq8;
  options.push_back({eq8, true});
  gsa::IndexerOptions code = inverse_variance(6, 1, 8, 0.05);
  code.budget = gsa::Budget::reference;
  options.push_back({code, true});
  gsa::IndexerOptions relu = inverse_variance(3, 1, 5, 0.5);
  relu.form = gsa::ScoreForm::relu;
  relu.scale = 1.0;
  options.push_back({relu, false});
  options.push_back({fixed(300, 512), true});
  // k_max covering every row: the tensor-core statistics pass settles the rows whose budget
  // covers their keys and hands the others' counts to the row kernel.
  options.push_back({inverse_variance(40, 2, 512, 0.05), true});
  gsa::IndexerOptions relu_long = inverse_variance(30, 1, 512, 0.5);
  relu_long.form = gsa::ScoreForm::relu;
  relu_long.scale = 1.0;
  options.push_back({relu_long, false});
  for (const IndexerShape& shape : shapes) {
    for (const DType dtype : {DType::float32, DType::bfloat16, DType::float16}) {
      for (const auto& [o, with_bias] : options) {
        SCOPED_TRACE(::testing::Message() << shape.seqs.size() << " sequences of " << shape.seqs.back().second
                                          << " keys, " << to_string(dtype) << ", budget " << static_cast<int>(o.budget));
        const IndexerCase c(shape, dtype, 51);
        CudaPlacement gpu;
        const SelectionResult got = run_selection(c, o, on_cuda(), with_bias, &gpu);
        // scores_of reads the rounded values; the kernel's float32 sums trail them by ~1e-6.
        expect_valid_selection(c, o, got, 1e-4, 1e-4, with_bias);
      }
    }
  }
}

// The passes read stored scores unless the tensor-core statistics pass settles the rows. Scored
// by indexer_score (a block per row and 2048 keys), they are the recomputing selection's bits, so
// both must select the same keys bit for bit. Scored on tensor cores ("stored" forces that where
// the inputs allow it, whatever the row count), the rounding differs, so those selections are
// checked against the float64 scores. Groups of 7 rows (16 on tensor cores) take several groups.
TEST(CudaGsaSelection, StoredScoresSelectWhatRecomputedScoresSelect) {
  const std::vector<IndexerShape> shapes = {
      {{{37, 37}, {37, 37}}, false, 3, 8},
      {{{9, 9}, {0, 0}, {30, 33}, {1, 1}}, true, 4, 8},
      {{{24, 5000}}, false, 4, 64},  // keys over several scoring blocks (2048 keys each)
      {{{3, 4100}, {2, 2049}}, true, 4, 64},  // decoding-like: few rows, long caches
      {{{1, 4100}, {1, 4100}}, false, 4, 64},
      {{{40, 40}}, false, 16, 64},
      {{{9, 9}, {0, 0}, {70, 200}, {1, 1}}, true, 4, 64},  // tensor cores: packed, a row tile cut short
      {{{100, 300}, {100, 300}}, false, 3, 128},
  };
  std::vector<std::pair<gsa::IndexerOptions, bool>> options;
  options.push_back({inverse_variance(4, 2, 6, 0.05), true});
  options.push_back({fixed(300, 512), true});
  gsa::IndexerOptions relu = inverse_variance(30, 1, 512, 0.5);
  relu.form = gsa::ScoreForm::relu;
  relu.scale = 1.0;
  options.push_back({relu, false});
  for (const IndexerShape& shape : shapes) {
    for (const DType dtype : {DType::float32, DType::bfloat16}) {
      for (const auto& [o, with_bias] : options) {
        for (const char* group : {"65535", "7"}) {
          SCOPED_TRACE(::testing::Message() << shape.seqs.size() << " sequences of " << shape.seqs.back().second
                                            << " keys, " << to_string(dtype) << ", k_max " << o.k_max
                                            << ", groups of " << group);
          const IndexerCase c(shape, dtype, 53);
          const ScopedEnv rows("WINNOW_GSA_SELECT_GROUP_ROWS", group);
          auto select = [&](const char* path) {
            const ScopedEnv forced("WINNOW_GSA_SELECT_SCORES", path);
            CudaPlacement gpu;
            return run_selection(c, o, on_cuda(), with_bias, &gpu);
          };
          const SelectionResult scalar = select("stored-scalar"), recomputed = select("recompute");
          EXPECT_EQ(scalar.indices, recomputed.indices);
          EXPECT_EQ(scalar.counts, recomputed.counts);
          EXPECT_EQ(scalar.variance, recomputed.variance);
          expect_valid_selection(c, o, scalar, 1e-4, 1e-4, with_bias);
          SCOPED_TRACE("tensor-core scores where the inputs allow them");
          expect_valid_selection(c, o, select("stored"), 1e-4, 1e-4, with_bias);
        }
      }
    }
  }
}

// 3000 keys with one vector (one score) among 1000 random ones, 2500 selected: the cut falls
// inside the tie group, whose 3000 keys overflow the candidate buffer (2048), so the search
// refines by position and must take the group's most recent keys.
TEST(CudaGsaSelection, ATieGroupLargerThanTheCandidateBufferGoesToTheMostRecentKeys) {
  IndexerCase c({{{3, 4000}}, false, 2, 16}, DType::float32, 52);
  std::vector<double> k = c.k.values();
  for (std::size_t i = 16; i < 3000 * 16; ++i) k[i] = k[i % 16];
  c.k.set_values(k);
  const gsa::IndexerOptions o = fixed(2500, 4096);
  CudaPlacement gpu;
  const SelectionResult got = run_selection(c, o, on_cuda(), true, &gpu);
  const std::vector<std::vector<double>> scores = scores_of(c, o);
  for (std::size_t row = 0; row < 3; ++row) {
    ASSERT_EQ(got.counts[row], 2500);
    std::vector<std::int64_t> chosen;
    for (std::int64_t s = 0; s < 2500; ++s) chosen.push_back(static_cast<std::int64_t>(got.indices[row * 4096 + s]));
    const double tie = scores[row][0];
    std::int64_t above = 0;
    for (double x : scores[row]) above += x > tie + 1e-6 ? 1 : 0;
    ASSERT_LT(above, 2500);
    // The tied keys chosen are the group's last 2500 - above.
    const std::int64_t tied = 2500 - above;
    std::int64_t in_group = 0;
    for (std::int64_t key : chosen) {
      if (key < 3000) {
        EXPECT_GE(key, 3000 - tied) << "row " << row;
        ++in_group;
      }
    }
    EXPECT_EQ(in_group, tied) << "row " << row;
    EXPECT_TRUE(std::is_sorted(chosen.begin(), chosen.end()));
  }
}

TEST(CudaGsaSelection, OversizedRequestsAreRefused) {
  const IndexerCase c({{{4, 4}}, false, 2, 8}, DType::float32, 53);
  CudaPlacement gpu;
  expect_error([&] { run_selection(c, fixed(2, 1 << 20), on_cuda(), true, &gpu); }, "k_max");
}

struct Tolerances {
  double out, grad;
};
Tolerances tolerance(DType dtype) {
  switch (dtype) {
    case DType::bfloat16: return {2e-2, 3e-2};
    case DType::float16: return {5e-3, 5e-3};
    default: return {2e-5, 5e-5};
  }
}

TEST(CudaGsaSparse, MatchesTheReference) {
  struct Shape {
    IndexerShape s;
    std::int64_t heads_kv, dim_v, per_row;
    bool permuted;
  };
  const std::vector<Shape> shapes = {
      {{{{23, 23}, {23, 23}}, false, 4, 8}, 2, 6, 5, false},
      {{{{6, 31}}, false, 4, 8}, 2, 6, 5, true},                            // suffix, permuted strides
      {{{{7, 7}, {0, 0}, {19, 19}, {1, 1}}, true, 2, 4}, 1, 4, 5, false},   // packed, an empty sequence
      {{{{200, 200}}, false, 8, 128}, 2, 128, 50, false},                   // GQA 4:1, D = 128
      {{{{129, 300}}, false, 4, 64}, 1, 96, 77, true},                      // Dv != D, lists of 77
      {{{{70, 70}}, false, 4, 64}, 2, 64, 0, false},                        // every visible key
      {{{{300, 300}}, false, 4, 64}, 2, 64, 150, false},  // rows 0-127 complete: the dense kernel's block
      // The tensor-core forward (16-bit, D = Dv = 64 / 128): 16 heads on one kv head, suffix
      // queries, permuted strides, lists ending mid-chunk; three heads a group, a warp left idle.
      {{{{40, 300}}, false, 16, 64}, 1, 64, 37, true},
      {{{{150, 150}}, false, 12, 128}, 4, 128, 33, false},
  };
  for (const Shape& shape : shapes) {
    for (const DType dtype : {DType::float32, DType::bfloat16, DType::float16}) {
      SCOPED_TRACE(::testing::Message() << shape.s.seqs.back().first << "x" << shape.s.seqs.back().second << " D "
                                        << shape.s.dim << " Dv " << shape.dim_v << " " << to_string(dtype));
      const SparseCase c(shape.s, shape.heads_kv, shape.dim_v, dtype, 61, shape.per_row, shape.permuted);
      const SparseResult want = run_sparse(as_float64(c), reference());
      const Tolerances tol = tolerance(dtype);
      for (const bool deterministic : {false, true}) {
        SCOPED_TRACE(deterministic ? "deterministic" : "atomics");
        CudaPlacement gpu;
        const SparseResult got = run_sparse(c, on_cuda(deterministic), &gpu);
        EXPECT_LT(relative_error(got.out, want.out), tol.out) << "out";
        EXPECT_LT(relative_error(got.lse, want.lse), 1e-5) << "lse";
        EXPECT_LT(relative_error(got.dq, want.dq), tol.grad) << "dq";
        EXPECT_LT(relative_error(got.dk, want.dk), tol.grad) << "dk";
        EXPECT_LT(relative_error(got.dv, want.dv), tol.grad) << "dv";
        if (deterministic) {
          CudaPlacement again;
          const SparseResult repeat = run_sparse(c, on_cuda(true), &again);
          EXPECT_EQ(repeat.dk, got.dk);
          EXPECT_EQ(repeat.dv, got.dv);
          EXPECT_EQ(repeat.dq, got.dq);
        }
      }
    }
  }
}

TEST(CudaGsaSparse, AnEmptyListOutputsZero) {
  SparseCase c({{{3, 3}}, false, 2, 4}, 1, 4, DType::float32, 62, 2);
  std::vector<double> counts = c.counts.values();
  counts[1] = 0;
  c.counts.set_values(counts);
  CudaPlacement gpu;
  expect_second_row_empty(run_sparse(c, on_cuda(), &gpu));
}

TEST(CudaGsaSparse, MalformedListsAreRefusedByTheDeviceCheck) {
  SparseCase c({{{9, 9}, {0, 0}, {6, 6}}, true, 2, 4}, 1, 4, DType::float32, 63, 3);
  std::vector<double> idx = c.indices.values();
  // Sequence 2 (rows 9..14), its query row 1 (position 1): a future key.
  idx[static_cast<std::size_t>((9 + 1) * 3 + 1)] = 5;
  c.indices.set_values(idx);
  CudaPlacement gpu;
  expect_error([&] { run_sparse(c, on_cuda(), &gpu); }, "sequence 2, query row 1");
  // Trusted lists skip the check; the kernels still read nothing outside the keys.
  SparseCase t = c;
  CudaPlacement gpu2;
  AttentionInputs in = t.inputs();
  in.q = gpu2.place(t.q);
  in.k = gpu2.place(t.k);
  in.v = gpu2.place(t.v);
  in.cu_seqlens_q = gpu2.place(t.cu);
  HostTensor out(t.dout.shape(), DType::float32), lse({t.rows_q, 2}, DType::float32);
  gsa::KeyLists lists{gpu2.place(t.indices), gpu2.place(t.counts)};
  lists.trusted = true;
  const TensorView o = gpu2.place(out), l = gpu2.place(lse);
  gsa::sparse_forward(in, lists, std::nullopt, {o, l}, on_cuda());
  gpu2.fetch(o, out);
  for (double x : out.values()) EXPECT_TRUE(std::isfinite(x));
}

// The indexer loss against the float64 reference on the same rounded inputs: dense and listed
// sets (empty rows, full rows), both score forms, odd head dimensions (the scalar dot products),
// GQA, kv heads staged in several rounds (16 heads of 128), packed sequences with an empty one,
// suffix queries and permuted strides.
struct IndexerLossShape {
  IndexerShape s;
  std::int64_t heads, heads_kv, dim, per_row;
  bool permuted;
};

// Every shape in both list modes, three dtypes and both score forms.
void expect_indexer_loss_matches_the_reference(const std::vector<IndexerLossShape>& shapes) {
  for (const IndexerLossShape& shape : shapes) {
    for (const bool listed : {false, true}) {
      for (const DType dtype : {DType::float32, DType::bfloat16, DType::float16}) {
        for (const bool relu : {false, true}) {
          SCOPED_TRACE(::testing::Message() << shape.s.seqs.back().first << "x" << shape.s.seqs.back().second << " H "
                                            << shape.heads << "/" << shape.heads_kv << " D " << shape.dim
                                            << (listed ? " lists " : " dense ") << to_string(dtype)
                                            << (relu ? " relu" : " sigmoid"));
          const IndexerLossCase c(shape.s, shape.heads, shape.heads_kv, shape.dim, dtype, 71,
                                  listed ? shape.per_row : -1, shape.permuted);
          gsa::IndexerLossOptions o;
          o.form = relu ? gsa::ScoreForm::relu : gsa::ScoreForm::sigmoid;
          const IndexerLossResult want = run_indexer_loss(c.as(DType::float64), o, reference(), !relu);
          CudaPlacement gpu;
          const IndexerLossResult got = run_indexer_loss(c, o, on_cuda(), !relu, &gpu);
          EXPECT_LT(relative_error(got.loss, want.loss), 1e-4) << "loss";
          EXPECT_LT(relative_error(got.lse, want.lse), 1e-5) << "lse";
          EXPECT_LT(relative_error(got.dq, want.dq), 1e-4) << "dq";
          EXPECT_LT(relative_error(got.dk, want.dk), 1e-4) << "dk";
          EXPECT_LT(relative_error(got.dweights, want.dweights), 1e-4) << "dhead_weights";
          if (!relu) EXPECT_LT(relative_error(got.dbias, want.dbias), 1e-4) << "dbias";
        }
      }
    }
  }
}

// Small enough for racecheck (tools/gpu_check.sh sanitize), which takes minutes on the large ones.
TEST(CudaGsaIndexerLoss, SmallShapesMatchTheReference) {
  expect_indexer_loss_matches_the_reference({
      {{{{23, 23}, {23, 23}}, false, 4, 8}, 6, 2, 7, 5, false},
      {{{{6, 31}}, false, 3, 8}, 4, 4, 8, 0, true},                           // suffix, permuted, every key listed
      {{{{7, 7}, {0, 0}, {19, 19}, {1, 1}}, true, 2, 4}, 3, 3, 4, 3, false},  // packed, an empty sequence
  });
}

TEST(CudaGsaIndexerLoss, LargeShapesMatchTheReference) {
  expect_indexer_loss_matches_the_reference({
      {{{{200, 200}, {200, 200}}, false, 4, 64}, 8, 8, 64, 50, false},  // the LM study's layer
      {{{{100, 100}}, false, 4, 128}, 16, 4, 128, 40, false},           // kv heads staged in rounds
      // The tensor-core passes (bf16): D 128 and d_I 128 with GQA and permuted strides; packed
      // sequences (an empty one) with blocks of 64 rows cut short.
      {{{{130, 130}}, false, 4, 128}, 4, 2, 128, 40, true},
      {{{{70, 70}, {0, 0}, {90, 90}}, true, 2, 64}, 4, 4, 64, 20, false},
  });
}

}  // namespace
}  // namespace winnow::testing
