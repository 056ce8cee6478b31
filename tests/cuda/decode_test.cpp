// The split-KV decoding kernels (cuda/attention/decode.cuh) against the float64 reference:
// paged caches with shuffled pages and odd page sizes, GQA groups up to 16 rows (two row
// groups), several queries per sequence, D from 40 to 256 with Dv != D, every dtype, both
// mechanisms and causal rules; contiguous caches through the forward calls, whose short query
// suffixes now take these kernels (their gradients too), Sieve's and entmax's behind their
// threshold search; the device-side check of the block
// table; repeatability. Label `cuda`.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <string>

#include "cuda_placement.h"
#include "reference_check.h"
#include "cuda/cuda.h"
#include "support/expect_error.h"
#include "support/expect_results.h"
#include "support/paged_case.h"

namespace winnow::testing {
namespace {

const std::vector<PagedShape>& paged_shapes() {
  static const std::vector<PagedShape> all = {
      {"d128_gqa4", {1, 700, 2500}, 1, 8, 2, 128, 128, 16},
      {"d64_mha_three_queries_page7", {3, 64, 1000}, 3, 4, 4, 64, 64, 7},
      {"d256_group16", {300, 33}, 1, 16, 1, 256, 256, 32},
      {"d40_dv24_two_queries_page1", {2, 90}, 2, 2, 1, 40, 24, 1},
      {"d128_long_two_queries", {9000}, 2, 8, 1, 128, 128, 64},
  };
  return all;
}

using PagedParam = std::tuple<int, Mechanism, DType, bool>;
class CudaPagedDecode : public ::testing::TestWithParam<PagedParam> {};

TEST_P(CudaPagedDecode, MatchesTheReferenceOnTheGatheredKeys) {
  const auto [index, mechanism, dtype, current] = GetParam();
  const PagedShape& shape = paged_shapes()[static_cast<std::size_t>(index)];
  const PagedProblem p = PagedProblem::random(shape, 70 + static_cast<std::uint64_t>(index));
  CudaPlacement gpu;
  const PagedResults got = run_paged(p, mechanism, dtype, current, &gpu);
  const PagedResults want = reference_paged(p, mechanism, dtype, current);
  EXPECT_LT(relative_error(got.out, want.out), tolerance(dtype)) << "out";
  EXPECT_LT(relative_error(got.stat, want.stat), tolerance(dtype)) << "statistic";
  const PagedResults again = run_paged(p, mechanism, dtype, current, &gpu);
  EXPECT_EQ(std::memcmp(got.out.data(), again.out.data(), got.out.size() * sizeof(double)), 0)
      << "a second call gives the same bits";
}

std::string paged_name(const ::testing::TestParamInfo<PagedParam>& info) {
  const auto [index, mechanism, dtype, current] = info.param;
  return paged_shapes()[static_cast<std::size_t>(index)].name + "_" + name_of(mechanism) + "_" + to_string(dtype) +
         (current ? "_current" : "_strict");
}

INSTANTIATE_TEST_SUITE_P(Cuda, CudaPagedDecode,
                         ::testing::Combine(::testing::Range(0, static_cast<int>(paged_shapes().size())),
                                            ::testing::Values(Mechanism::softmax, Mechanism::stick_breaking),
                                            ::testing::Values(DType::bfloat16, DType::float16, DType::float32),
                                            ::testing::Bool()),
                         paged_name);

// Short query suffixes against contiguous caches (batched inputs), which the forward calls decode.
const std::vector<ProblemShape>& suffix_shapes() {
  static const std::vector<ProblemShape> all = {
      {"one_query_6000_keys", {{1, 6000}, {1, 6000}}, false, 8, 2, 128, 128},
      {"three_queries_d64", {{3, 2100}}, false, 4, 4, 64, 64},
      {"eight_queries_group4", {{8, 1500}, {8, 1500}}, false, 4, 1, 128, 128},
  };
  return all;
}

// A suffix shape's run on the GPU; the three-query shape as (B, H, L, D) views (strided queries
// and outputs).
RunConfig suffix_config(const ProblemShape& shape, Mechanism m, DType dtype, CudaPlacement* gpu) {
  RunConfig cfg;
  cfg.mechanism = m;
  cfg.dtype = dtype;
  cfg.placement = gpu;
  cfg.permuted = shape.seqs[0].first == 3;
  return cfg;
}

// Contiguous caches: forward calls with up to 8 queries per sequence decode (batched inputs);
// the backward then runs from the decode path's statistics.
TEST(CudaContiguousDecode, ShortQuerySuffixesMatchTheReferenceWithGradients) {
  for (const ProblemShape& shape : suffix_shapes()) {
    const Problem problem = Problem::random(shape, 11);
    for (Mechanism m : {Mechanism::softmax, Mechanism::stick_breaking}) {
      for (DType dtype : {DType::bfloat16, DType::float32}) {
        SCOPED_TRACE(describe(shape) + " " + name_of(m) + " " + to_string(dtype));
        CudaPlacement gpu;
        const Results got = run(problem, suffix_config(shape, m, dtype, &gpu));
        RunConfig ref;
        ref.mechanism = m;
        ref.backend = Backend::reference;
        expect_results_close(got, run(rounded(problem, dtype), ref), tolerance(dtype));
      }
    }
  }
}

// Sieve (both filters) and alpha-entmax decode behind their threshold search over the whole
// cache, in their fused path's types: forward and gradients against the reference, Sieve's
// thresholds and candidate counts, and the decoding kernels seen to run. The search runs on the
// decoding kernels too where every row's keys above its floor fit a list; the flat rows (input
// std 0.05: most keys in each support) overflow those lists and the forward kernel's collect
// sweep's, so they take the forward kernel's search with its step sweeps.
void expect_decode_behind_search(const std::vector<ProblemShape>& shapes, const std::vector<Mechanism>& mechanisms,
                                 const std::vector<DType>& dtypes) {
  for (const ProblemShape& shape : shapes) {
    for (double input_std : {1.0, 0.05}) {
      const Problem problem = Problem::random(shape, 12, input_std);
      for (Mechanism m : mechanisms) {
        for (DType dtype : dtypes) {
          SCOPED_TRACE(describe(shape) + " " + name_of(m) + " " + to_string(dtype) + " input std " +
                       std::to_string(input_std));
          CudaPlacement gpu;
          const RunConfig cfg = suffix_config(shape, m, dtype, &gpu);
          const std::int64_t calls = cuda::decode_calls(), searches = cuda::decode_searches();
          const Results got = run(problem, cfg);
          EXPECT_GT(cuda::decode_calls(), calls) << "the decoding kernels ran";
          // Spread rows' few candidates fit the lists for alpha >= 1.5, so the search ran on
          // the decoding kernels (alpha 1.3's flatter weights leave hundreds of keys above the
          // floor; Sieve's bound filter has no search, its threshold is the row maximum's).
          if (input_std == 1.0 && m != Mechanism::sieve_bound && alpha_of(m) >= 1.5) {
            EXPECT_GT(cuda::decode_searches(), searches) << "the search ran on the decoding kernels";
            // Its lists are filed in arrival order and sorted before the solve.
            if (dtype == DType::bfloat16) {
              const Results again = run(problem, cfg);
              EXPECT_EQ(got.out, again.out) << "a second call gives the same bits";
              EXPECT_EQ(got.stat, again.stat) << "a second call gives the same statistic";
            }
          }
          RunConfig ref;
          ref.mechanism = m;
          ref.backend = Backend::reference;
          const Results want = run(rounded(problem, dtype), ref);
          expect_results_close(got, want, tolerance(dtype));
          if (is_sieve(m)) expect_sieve_rows_close(got, want, dtype, tolerance(dtype));
        }
      }
    }
  }
}

TEST(CudaContiguousDecode, SieveAndEntmaxDecodeBehindTheirSearch) {
  expect_decode_behind_search(suffix_shapes(),
                              {Mechanism::sieve_exact, Mechanism::sieve_bound, Mechanism::entmax15,
                               Mechanism::sparsemax, Mechanism::entmax13},
                              {DType::bfloat16, DType::float16});
}

// The same kernels on a cache small enough for compute-sanitizer's racecheck, which could not
// finish the test above in 500 s (sessions 73 and 75).
TEST(CudaSmallDecode, SieveAndEntmaxDecodeBehindTheirSearch) {
  expect_decode_behind_search({{"two_queries_300_keys", {{2, 300}, {2, 300}}, false, 4, 2, 64, 64}},
                              {Mechanism::sieve_exact, Mechanism::sieve_bound, Mechanism::entmax15,
                               Mechanism::entmax13},
                              {DType::bfloat16});
}

TEST(CudaSmallDecode, DeviceCheckNamesTheBadSequence) {
  const PagedProblem good = PagedProblem::random({"check", {5, 40}, 1, 4, 2, 64, 64, 8}, 5);
  CudaPlacement gpu;
  {
    PagedProblem p = good;
    std::vector<double> table = p.block_table.values();
    table[static_cast<std::size_t>(p.block_table.shape()[1])] = -3;  // sequence 1's first page
    p.block_table.set_values(table);
    expect_error([&] { run_paged(p, Mechanism::softmax, DType::bfloat16, true, &gpu); }, "sequence 1's pages in [0, ");
  }
  {
    PagedProblem p = good;
    p.seq_lens.set_values({5, static_cast<double>(p.block_table.shape()[1] * 8 + 1)});
    expect_error([&] { run_paged(p, Mechanism::stick_breaking, DType::bfloat16, true, &gpu); },
                 "sequence 1 holding at most");
  }
  const PagedResults ok = run_paged(good, Mechanism::stick_breaking, DType::float32, false, &gpu);
  const PagedResults want = reference_paged(good, Mechanism::stick_breaking, DType::float32, false);
  EXPECT_LT(relative_error(ok.out, want.out), 1e-5);
}

// Logits of about 1e4 (inputs with std 100): finite outputs and statistics, weights that sum
// to at most one (stick-breaking's log_rem <= 0).
TEST(CudaSmallDecode, ExtremeLogitsStayFinite) {
  const PagedProblem p = PagedProblem::random({"extreme", {40, 700}, 1, 4, 2, 64, 64, 16}, 8, 100.0);
  CudaPlacement gpu;
  for (Mechanism m : {Mechanism::softmax, Mechanism::stick_breaking}) {
    for (DType dtype : {DType::bfloat16, DType::float32}) {
      const PagedResults r = run_paged(p, m, dtype, false, &gpu);
      for (double x : r.out) ASSERT_TRUE(std::isfinite(x)) << name_of(m) << " " << to_string(dtype);
      for (double x : r.stat) {
        ASSERT_TRUE(std::isfinite(x)) << name_of(m) << " " << to_string(dtype);
        if (m == Mechanism::stick_breaking) EXPECT_LE(x, 0.0);
      }
    }
  }
}

}  // namespace
}  // namespace winnow::testing
