// Multiscreen screening problems run through winnow::screening with any backend, on the host or
// placed on a device, so the CPU and CUDA tests compare against the same float64 reference.
#pragma once

#include <string>
#include <vector>

#include "support/attention_case.h"
#include "winnow/screening.h"

namespace winnow::testing {

struct ScreeningCase {
  std::string name;
  ProblemShape shape;  // dim: d_K, dim_v: d_V
  // Windows and acceptance widths by head (cycled over the heads), as w and r.
  std::vector<double> windows = {3.5, 12.0, 40.0, 300.0};
  std::vector<double> widths = {0.85, 0.7, 0.95, 0.8};
  bool shared_scalars = false;  // one s_w and one s_r for every head (the first of each list)
  double expand_above = 0.0;
};

struct ScreeningInputs {
  Problem main;
  HostTensor s_w, s_r;
  screening::Options options;
};

ScreeningInputs make_screening_inputs(const ScreeningCase& c, std::uint64_t seed);
// q, k, v and dout in dtype; s_w and s_r in the statistics' dtype (float32, float64 for float64).
ScreeningInputs converted_for_kernels(const ScreeningInputs& in, DType dtype);
// The dtype's rounding of every input, back in float64: what the reference should see.
ScreeningInputs rounded(const ScreeningInputs& in, DType dtype);

struct ScreeningResults {
  std::vector<double> out, h_norm, dq, dk, dv, ds_w, ds_r;
};

// Forward only (placement == nullptr: the tensors stay on the host).
ScreeningResults screening_forward(const ScreeningInputs& in, const ExecContext& ctx,
                                   Placement* placement = nullptr);
// Forward, then backward from its saved output and norms.
ScreeningResults screening_run(const ScreeningInputs& in, const ExecContext& ctx,
                               Placement* placement = nullptr);

}  // namespace winnow::testing
