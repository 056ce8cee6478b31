// The check every kernel-against-reference test ends with: the forward output, the per-row
// statistic and every gradient within a relative tolerance. Header-only, as it uses GoogleTest
// assertions and the support library does not link GoogleTest.
#pragma once

#include <gtest/gtest.h>

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

}  // namespace winnow::testing
