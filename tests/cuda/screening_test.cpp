// Multiscreen screening's CUDA kernels against the float64 reference on the same rounded
// inputs: d_K 16 / 32 / 64 with d_V 64 / 128 (and 24 / 40 on the simple path), windows narrower
// than a tile, wider than one and past w_th, grouped heads, suffix queries, packed sequences
// with empty ones, a single token, window expansion, shared scalars; bf16, fp16 and float32;
// every gradient, ds_w's and ds_r's included. The fused kernels score rows rounded to the
// input dtype and round the relevance and dS to it for the matrix products (as FlashAttention
// rounds P), so the tolerances are the dtype's.
// Label `cuda`: runs only on a machine with a GPU (tools/gpu_check.sh).
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cstdlib>
#include <string>
#include <tuple>

#include "cuda_placement.h"
#include "support/screening_case.h"
#include "support/scoped_env.h"

namespace winnow::testing {
namespace {

double tolerance(DType dtype) {
  switch (dtype) {
    case DType::bfloat16: return 2e-2;
    case DType::float16: return 5e-3;
    default: return 2e-5;
  }
}

// With one kv head per query head, 16-bit inputs take the fused kernels; grouped heads, float32
// and the rest take the simple path.
const std::vector<ScreeningCase>& cases() {
  static const std::vector<ScreeningCase> all = {
      {"dk16_dv64_four_windows", {"b", {{300, 300}, {300, 300}}, false, 4, 4, 16, 64}, {3.5, 70.0, 300.0, 130.0}, {0.8, 0.85, 0.75, 0.9}},
      {"dk16_long_narrow_windows", {"l", {{1000, 1000}}, false, 2, 2, 16, 64}, {2.0, 40.0}, {0.85, 0.9}},
      {"dk32_suffix", {"s", {{77, 333}}, false, 2, 2, 32, 64}, {20.0, 257.0}, {0.9, 0.8}},
      {"dk16_varlen", {"v", {{5, 5}, {0, 0}, {200, 200}, {129, 300}, {1, 1}}, true, 4, 4, 16, 64}, {2.0, 9.0, 64.5, 500.0}, {0.85, 0.9, 0.8, 0.75}},
      {"dk64_dv128_expanded_shared", {"e", {{150, 150}}, false, 2, 2, 64, 128}, {200.0}, {0.9}, true, 100.0},
      {"dk16_gqa_simple", {"g", {{100, 100}}, false, 4, 2, 16, 64}, {5.0, 30.0}, {0.85, 0.9}},
      {"dk24_dv40_simple", {"o", {{90, 90}}, false, 2, 2, 24, 40}, {6.0, 300.0}, {0.85, 0.9}},
      {"single_token", {"one", {{1, 1}}, false, 2, 2, 16, 64}, {3.0, 40.0}, {0.9, 0.9}},
  };
  return all;
}

// ds_w and ds_r sum terms of both signs over every pair, each moved by the rounding of the 16-bit
// rows the fused kernels score (Trim's slope grows from 0 at the threshold, where a rounded
// score may fall either way): in bf16 they move by several percent on random inputs. The same
// kernels in fp16, whose rounding is 8x finer, check them at fp16's tolerance.
double scalar_tolerance(DType dtype) { return dtype == DType::bfloat16 ? 8e-2 : tolerance(dtype); }

class ScreeningCuda : public ::testing::TestWithParam<std::tuple<int, DType>> {};

TEST_P(ScreeningCuda, MatchesTheReference) {
  const auto [index, dtype] = GetParam();
  const ScreeningCase& c = cases()[static_cast<std::size_t>(index)];
  const ScreeningInputs in = make_screening_inputs(c, 41);
  ExecContext ref;
  ref.backend = Backend::reference;
  const ScreeningResults want = screening_run(rounded(in, dtype), ref);
  CudaPlacement placement;
  const ScreeningResults got = screening_run(converted_for_kernels(in, dtype), {}, &placement);
  const double tol = tolerance(dtype);
  EXPECT_LT(relative_error(got.out, want.out), tol) << "out";
  EXPECT_LT(relative_error(got.h_norm, want.h_norm), tol) << "h_norm";
  EXPECT_LT(relative_error(got.dq, want.dq), tol) << "dq";
  EXPECT_LT(relative_error(got.dk, want.dk), tol) << "dk";
  EXPECT_LT(relative_error(got.dv, want.dv), tol) << "dv";
  EXPECT_LT(relative_error(got.ds_w, want.ds_w), scalar_tolerance(dtype)) << "ds_w";
  EXPECT_LT(relative_error(got.ds_r, want.ds_r), scalar_tolerance(dtype)) << "ds_r";
}

INSTANTIATE_TEST_SUITE_P(Cases, ScreeningCuda,
                         ::testing::Combine(::testing::Range(0, static_cast<int>(cases().size())),
                                            ::testing::Values(DType::bfloat16, DType::float16, DType::float32)),
                         [](const ::testing::TestParamInfo<std::tuple<int, DType>>& info) {
                           return cases()[static_cast<std::size_t>(std::get<0>(info.param))].name + "_" +
                                  to_string(std::get<1>(info.param));
                         });

// The simple path on 16-bit inputs (forced), and the fused backward's deterministic mode: two
// runs agree bit for bit.
TEST(ScreeningCudaPaths, SimplePathOn16BitAndDeterministicFusedBackward) {
  const ScreeningCase& c = cases()[0];
  const ScreeningInputs in = make_screening_inputs(c, 43);
  ExecContext ref;
  ref.backend = Backend::reference;
  const ScreeningResults want = screening_run(rounded(in, DType::bfloat16), ref);
  const ScreeningInputs x = converted_for_kernels(in, DType::bfloat16);
  {
    const ScopedEnv simple("WINNOW_SCREENING_SIMPLE", "1");
    CudaPlacement placement;
    const ScreeningResults got = screening_run(x, {}, &placement);
    EXPECT_LT(relative_error(got.out, want.out), 2e-2);
    EXPECT_LT(relative_error(got.dq, want.dq), 2e-2);
    EXPECT_LT(relative_error(got.ds_w, want.ds_w), 2e-2);
  }
  ExecContext deterministic;
  deterministic.deterministic = true;
  CudaPlacement p1, p2;
  const ScreeningResults a = screening_run(x, deterministic, &p1), b = screening_run(x, deterministic, &p2);
  EXPECT_EQ(a.dk, b.dk);
  EXPECT_EQ(a.dv, b.dv);
  EXPECT_EQ(a.ds_w, b.ds_w);
  EXPECT_LT(relative_error(a.dk, want.dk), 2e-2);
}

// All keys rejected: exact zeros on the device too.
TEST(ScreeningCudaSpec, AllRejectedRowsOutputExactZeros) {
  for (std::int64_t kv_heads : {1, 2}) {  // simple path, fused
    const ScreeningCase c{"rejected", {"r", {{100, 100}}, false, 2, kv_heads, 16, 64}, {6.0, 300.0}, {1e-3, 1e-3}};
    CudaPlacement placement;
    const ScreeningResults r = screening_run(converted_for_kernels(make_screening_inputs(c, 5), DType::bfloat16), {}, &placement);
    for (const auto* x : {&r.out, &r.h_norm, &r.dq, &r.dk, &r.dv, &r.ds_w, &r.ds_r}) {
      for (double v : *x) EXPECT_EQ(v, 0.0);
    }
  }
}

}  // namespace
}  // namespace winnow::testing
