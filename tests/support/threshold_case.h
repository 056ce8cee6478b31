// Threshold attention problems (TRA and TDA) run through winnow::threshold with any backend,
// on the host or placed on a device, so the CPU and CUDA tests compare against the same float64
// reference.
#pragma once

#include <optional>
#include <string>
#include <vector>

#include "support/attention_case.h"
#include "winnow/threshold.h"

namespace winnow::testing {

struct ThresholdCase {
  std::string name;
  ProblemShape shape;
  bool tda = false;
  double power = 2.0;
  bool attend_current = true;
  bool shared_beta = false;
};

// Everything one call sees, in float64 (or converted).
struct ThresholdInputs {
  Problem main, second;  // second: q2 and k2 (its v and dout unused)
  HostTensor beta, lambda;
  bool tda = false;
  threshold::Options options;
};

// beta = beta_value + 0.1 h and lambda = lambda_value + 0.05 h per head (or one of each).
ThresholdInputs make_threshold_inputs(const ThresholdCase& c, std::uint64_t seed, double beta_value = 0.6,
                                      double lambda_value = 0.4);
// Every tensor in another dtype (beta and lambda too: the caller picks the statistics' dtype).
ThresholdInputs converted(const ThresholdInputs& in, DType dtype);
// The same values with q, k, v, dout, beta and lambda in dtype and the statistics in float32
// (float64 for float64): what the CUDA and CPU kernels take for 16-bit and float32 inputs.
ThresholdInputs converted_for_kernels(const ThresholdInputs& in, DType dtype);
// The 16-bit rounding of the inputs, back in float64: what the reference should see.
ThresholdInputs rounded(const ThresholdInputs& in, DType dtype);

struct ThresholdGrads {
  std::vector<double> dq, dk, dv, dq2, dk2, dbeta, dlambda;
};

// The float64 reference backend, what every test compares against.
ExecContext reference_backend();

// A record for the saved rows of `in` (winnow/threshold.h), on the host, zeroed: place it
// where the calls run and hand the same view to a forward and then its backward.
HostTensor saved_rows_record(const ThresholdInputs& in);

// placement == nullptr: the tensors stay on the host. saved_rows: the forward writes the
// normalized rows there, the backward reads them.
std::vector<double> threshold_forward(const ThresholdInputs& in, const ExecContext& ctx,
                                      Placement* placement = nullptr,
                                      const std::optional<TensorView>& saved_rows = std::nullopt);
// The per-row survivor counts (threshold::Outputs::nonzero) of a forward call.
std::vector<double> threshold_survivors(const ThresholdInputs& in, const ExecContext& ctx,
                                        Placement* placement = nullptr);
ThresholdGrads threshold_backward(const ThresholdInputs& in, const ExecContext& ctx,
                                  Placement* placement = nullptr,
                                  const std::optional<TensorView>& saved_rows = std::nullopt);

}  // namespace winnow::testing
