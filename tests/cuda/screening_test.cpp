// Multiscreen screening's CUDA kernels against the float64 reference on the same rounded
// inputs: d_K 16 / 32 / 64 with d_V 64 / 128, windows narrower than a tile, wider than one and
// past w_th, grouped heads, suffix queries, packed sequences with empty ones, a single token,
// window expansion, shared scalars; bf16, fp16 and float32; every gradient, ds_w's and ds_r's
// included. The kernels compute in fp32 from the rounded inputs and round only their outputs
// (and the saved output the backward reads), so the tolerances are the output dtype's.
// Label `cuda`: runs only on a machine with a GPU (tools/gpu_check.sh).
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <string>
#include <tuple>

#include "cuda_placement.h"
#include "support/screening_case.h"

namespace winnow::testing {
namespace {

double tolerance(DType dtype) {
  switch (dtype) {
    case DType::bfloat16: return 2e-2;
    case DType::float16: return 5e-3;
    default: return 2e-5;
  }
}

const std::vector<ScreeningCase>& cases() {
  static const std::vector<ScreeningCase> all = {
      {"dk16_dv64_four_windows", {"b", {{300, 300}, {300, 300}}, false, 4, 4, 16, 64}, {3.5, 70.0, 300.0, 130.0}, {0.8, 0.85, 0.75, 0.9}},
      {"dk32_gqa_suffix", {"s", {{77, 333}}, false, 4, 2, 32, 64}, {20.0, 257.0}, {0.9, 0.8}},
      {"dk16_varlen", {"v", {{5, 5}, {0, 0}, {200, 200}, {129, 300}, {1, 1}}, true, 4, 2, 16, 64}, {2.0, 9.0, 64.5, 500.0}, {0.85, 0.9, 0.8, 0.75}},
      {"dk64_dv128_expanded_shared", {"e", {{150, 150}}, false, 2, 1, 64, 128}, {200.0}, {0.9}, true, 100.0},
      {"single_token", {"one", {{1, 1}}, false, 2, 1, 16, 64}, {3.0, 40.0}, {0.9, 0.9}},
  };
  return all;
}

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
  EXPECT_LT(relative_error(got.ds_w, want.ds_w), tol) << "ds_w";
  EXPECT_LT(relative_error(got.ds_r, want.ds_r), tol) << "ds_r";
}

INSTANTIATE_TEST_SUITE_P(Cases, ScreeningCuda,
                         ::testing::Combine(::testing::Range(0, static_cast<int>(cases().size())),
                                            ::testing::Values(DType::bfloat16, DType::float16, DType::float32)),
                         [](const ::testing::TestParamInfo<std::tuple<int, DType>>& info) {
                           return cases()[static_cast<std::size_t>(std::get<0>(info.param))].name + "_" +
                                  to_string(std::get<1>(info.param));
                         });

// All keys rejected: exact zeros on the device too.
TEST(ScreeningCudaSpec, AllRejectedRowsOutputExactZeros) {
  const ScreeningCase c{"rejected", {"r", {{100, 100}}, false, 2, 1, 16, 64}, {6.0, 300.0}, {1e-3, 1e-3}};
  CudaPlacement placement;
  const ScreeningResults r = screening_run(converted_for_kernels(make_screening_inputs(c, 5), DType::bfloat16), {}, &placement);
  for (const auto* x : {&r.out, &r.h_norm, &r.dq, &r.dk, &r.dv, &r.ds_w, &r.ds_r}) {
    for (double v : *x) EXPECT_EQ(v, 0.0);
  }
}

}  // namespace
}  // namespace winnow::testing
