// Sieve attention from spec/sieve.md, materialized: each row's candidate set (the entmax
// support, or the keys within eps of the row maximum), then stick-breaking over it.
#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "math/elementwise.h"
#include "reference/dense.h"
#include "reference/entmax_threshold.h"
#include "reference/reference.h"

namespace winnow::reference {
namespace {

// Threshold in score units: key i is a candidate of row r iff z_ri > threshold.
double row_threshold(const HeadProblem& hp, std::int64_t r, const detail::SieveConfig& cfg) {
  const std::int64_t n = hp.n[static_cast<std::size_t>(r)];
  if (n <= 0) return 0.0;
  if (cfg.bound) {
    double m = -std::numeric_limits<double>::infinity();
    for (std::int64_t i = 0; i < n; ++i) m = std::max(m, hp.z(r, i));
    return m - cfg.eps;
  }
  std::vector<double> x(static_cast<std::size_t>(n));
  for (std::int64_t i = 0; i < n; ++i) x[static_cast<std::size_t>(i)] = (cfg.alpha - 1) * hp.z(r, i);
  return entmax_threshold(x, cfg.alpha) / (cfg.alpha - 1);
}

std::vector<double> thresholds(const HeadProblem& hp, const detail::SieveConfig& cfg) {
  std::vector<double> t(static_cast<std::size_t>(hp.z.rows));
  for (std::int64_t r = 0; r < hp.z.rows; ++r) t[static_cast<std::size_t>(r)] = row_threshold(hp, r, cfg);
  return t;
}

// log A_ij = z_ij - sum_{k in S, k >= i} softplus(z_kj) on S, 0 off it; log rem = -sum over S.
ForwardRows sieve_rows(const detail::SieveConfig& cfg) {
  return [cfg](const HeadProblem& hp, Dense& w, std::vector<double>& log_rem) {
    const std::vector<double> t = thresholds(hp, cfg);
    for (std::int64_t r = 0; r < hp.z.rows; ++r) {
      double suffix = 0;
      for (std::int64_t i = hp.n[static_cast<std::size_t>(r)] - 1; i >= 0; --i) {
        if (!(hp.z(r, i) > t[static_cast<std::size_t>(r)])) continue;
        suffix += math::softplus(hp.z(r, i));
        w(r, i) = std::exp(hp.z(r, i) - suffix);
      }
      log_rem[static_cast<std::size_t>(r)] = -suffix;
    }
  };
}

}  // namespace

void sieve_forward(const detail::AttentionParams& p, const detail::SieveConfig& cfg) {
  run_forward(p, sieve_rows(cfg));
  for_each_head(p, [&](std::int64_t b, std::int64_t start, std::int64_t h, const HeadProblem& hp) {
    const std::vector<double> t = thresholds(hp, cfg);
    for (std::int64_t r = 0; r < hp.z.rows; ++r) {
      *cfg.threshold.at<double>(b, start + r, h) = t[static_cast<std::size_t>(r)];
      if (cfg.count.data == nullptr) continue;
      std::int32_t count = 0;
      for (std::int64_t i = 0; i < hp.n[static_cast<std::size_t>(r)]; ++i) {
        count += hp.z(r, i) > t[static_cast<std::size_t>(r)] ? 1 : 0;
      }
      *cfg.count.at<std::int32_t>(b, start + r, h) = count;
    }
  });
}

// Inside S the stick-breaking gradient with every sum restricted to S:
//   dz_ij = g_ij - sigmoid(z_ij) (sum_{i' in S, i' <= i} g_i'j + dlog_rem_j), 0 off S.
void sieve_backward(const detail::AttentionParams& p, const detail::GradientParams& g,
                    const detail::SieveConfig& cfg) {
  run_backward(p, g, sieve_rows(cfg),
               [&](const HeadProblem& hp, const Dense& w, const Dense& dw,
                   const std::vector<double>& dlog_rem, Dense& dz) {
                 const std::vector<double> t = thresholds(hp, cfg);
                 for (std::int64_t r = 0; r < hp.z.rows; ++r) {
                   double prefix = 0;
                   for (std::int64_t i = 0; i < hp.n[static_cast<std::size_t>(r)]; ++i) {
                     if (!(hp.z(r, i) > t[static_cast<std::size_t>(r)])) continue;
                     const double gi = w(r, i) * dw(r, i);
                     prefix += gi;
                     dz(r, i) = gi - math::sigmoid(hp.z(r, i)) * (prefix + dlog_rem[static_cast<std::size_t>(r)]);
                   }
                 }
               });
}

}  // namespace winnow::reference
