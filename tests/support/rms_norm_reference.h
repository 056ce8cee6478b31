// RMSNorm written out in float64 on logical row-major values (N rows of C), independent of the
// kernels' shared formulas: y, rstd, and the gradients by the chain rule term by term.
#pragma once

#include <cmath>
#include <cstdint>
#include <vector>

namespace winnow::testing {

struct RMSNormExpected {
  std::vector<double> y, rstd, dx, dweight;
};

inline RMSNormExpected rms_norm_expected(const std::vector<double>& x, const std::vector<double>& w,
                                         const std::vector<double>& dy, std::int64_t N,
                                         std::int64_t C, double eps) {
  RMSNormExpected e{std::vector<double>(N * C), std::vector<double>(N), std::vector<double>(N * C),
                    std::vector<double>(C, 0.0)};
  for (std::int64_t n = 0; n < N; ++n) {
    double ms = 0;
    for (std::int64_t c = 0; c < C; ++c) ms += x[n * C + c] * x[n * C + c];
    ms /= static_cast<double>(C);
    const double r = 1.0 / std::sqrt(ms + eps);
    e.rstd[n] = r;
    // d r / d x_c = -r^3 x_c / C, so dx_c = dy_c w_c r - (r^3 x_c / C) sum_j dy_j w_j x_j.
    double s = 0;
    for (std::int64_t c = 0; c < C; ++c) s += dy[n * C + c] * w[c] * x[n * C + c];
    for (std::int64_t c = 0; c < C; ++c) {
      e.y[n * C + c] = x[n * C + c] * r * w[c];
      e.dx[n * C + c] = dy[n * C + c] * w[c] * r - r * r * r * x[n * C + c] * s / static_cast<double>(C);
      e.dweight[c] += dy[n * C + c] * x[n * C + c] * r;
    }
  }
  return e;
}

// The residual form: sum = x + r normalized; the sum's gradient is dsum_in (empty: none) plus
// the norm's input gradient, and x and r both receive it.
struct AddRMSNormExpected {
  std::vector<double> sum;
  RMSNormExpected norm;  // at sum; norm.dx includes dsum_in
};

inline AddRMSNormExpected add_rms_norm_expected(const std::vector<double>& x,
                                                const std::vector<double>& r,
                                                const std::vector<double>& w,
                                                const std::vector<double>& dy,
                                                const std::vector<double>& dsum_in, std::int64_t N,
                                                std::int64_t C, double eps) {
  AddRMSNormExpected e;
  e.sum.resize(x.size());
  for (std::size_t i = 0; i < x.size(); ++i) e.sum[i] = x[i] + r[i];
  e.norm = rms_norm_expected(e.sum, w, dy, N, C, eps);
  for (std::size_t i = 0; i < dsum_in.size(); ++i) e.norm.dx[i] += dsum_in[i];
  return e;
}

}  // namespace winnow::testing
