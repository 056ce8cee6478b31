// The checks every kernel-against-reference test ends with: the forward output, the per-row
// statistic and every gradient within a relative tolerance; Sieve's rows. Header-only, as they
// use GoogleTest assertions and the support library does not link GoogleTest.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>

#include "support/attention_case.h"
#include "support/host_tensor.h"

namespace winnow::testing {

inline void expect_results_close(const Results& got, const Results& want, double tol) {
  EXPECT_LT(relative_error(got.out, want.out), tol) << "out";
  EXPECT_LT(relative_error(got.stat, want.stat), tol) << "per-row statistic";
  EXPECT_LT(relative_error(got.dq, want.dq), tol) << "dq";
  EXPECT_LT(relative_error(got.dk, want.dk), tol) << "dk";
  EXPECT_LT(relative_error(got.dv, want.dv), tol) << "dv";
}

// Sieve's thresholds and candidate counts. Float32 counts match exactly. In bf16 / fp16 the
// scores carry the matrix units' or the decoding kernel's float rounding, which the float64
// reference does not share: a key within rounding of its row's threshold may fall either way.
// That is allowed for a few keys, never more than one per row.
inline void expect_sieve_rows_close(const Results& got, const Results& want, DType dtype, double tol) {
  EXPECT_LT(relative_error(got.threshold, want.threshold), tol) << "threshold";
  if (dtype == DType::float32) {
    EXPECT_EQ(got.count, want.count) << "candidate counts";
    return;
  }
  ASSERT_EQ(got.count.size(), want.count.size());
  double differing = 0, total = 0;
  for (std::size_t i = 0; i < got.count.size(); ++i) {
    EXPECT_LE(std::abs(got.count[i] - want.count[i]), 1.0) << "row " << i;
    differing += std::abs(got.count[i] - want.count[i]);
    total += want.count[i];
  }
  EXPECT_LE(differing, std::max(2.0, 1e-3 * total)) << "candidate counts";
}

}  // namespace winnow::testing
