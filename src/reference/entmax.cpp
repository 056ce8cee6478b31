// alpha-entmax attention from spec/entmax.md, materialized. The thresholds come from the exact
// sort-based forms for alpha = 2 (sparsemax) and alpha = 1.5, and from bisection to float64
// resolution for any other alpha: independent of the fast paths' Newton search.
#include <algorithm>
#include <cmath>
#include <functional>
#include <vector>

#include "reference/dense.h"
#include "reference/entmax_threshold.h"
#include "reference/reference.h"

namespace winnow::reference {

double entmax_threshold(std::vector<double> x, double alpha) {
  if (x.empty()) return 0.0;
  std::sort(x.begin(), x.end(), std::greater<double>());
  const std::size_t n = x.size();
  if (alpha == 2.0) {
    // Largest k with 1 + k x_(k) > sum_{i <= k} x_(i); tau = (sum_{i <= k} x_(i) - 1) / k.
    double sum = 0, tau = x[0] - 1;
    for (std::size_t k = 1; k <= n; ++k) {
      sum += x[k - 1];
      if (1 + static_cast<double>(k) * x[k - 1] > sum) tau = (sum - 1) / static_cast<double>(k);
    }
    return tau;
  }
  if (alpha == 1.5) {
    // With support of size k: k tau^2 - 2 tau S1 + S2 - 1 = 0, the smaller root; the support
    // is the largest k whose root lies at or below x_(k).
    double s1 = 0, s2 = 0, tau = x[0] - 1;
    for (std::size_t k = 1; k <= n; ++k) {
      s1 += x[k - 1];
      s2 += x[k - 1] * x[k - 1];
      const double kk = static_cast<double>(k), mean = s1 / kk;
      const double delta = (1 - (s2 / kk - mean * mean) * kk) / kk;
      const double t = mean - std::sqrt(std::max(delta, 0.0));
      if (t <= x[k - 1]) tau = t;
    }
    return tau;
  }
  double lo = x[0] - 1, hi = x[0] - std::pow(static_cast<double>(n), 1 - alpha);
  auto mass = [&](double tau) {
    double f = 0;
    for (double xi : x) f += xi > tau ? std::pow(xi - tau, 1 / (alpha - 1)) : 0.0;
    return f;
  };
  for (int it = 0; it < 200 && hi > lo; ++it) {
    const double mid = 0.5 * (lo + hi);
    if (mid <= lo || mid >= hi) break;
    (mass(mid) > 1 ? lo : hi) = mid;
  }
  return 0.5 * (lo + hi);
}

namespace {

double entmax_p(double x, double tau, double alpha) {
  return x > tau ? std::pow(x - tau, 1 / (alpha - 1)) : 0.0;
}

// p_ij = [(alpha - 1) z_ij - tau_j]_+^(1 / (alpha - 1)); the statistic is tau_j.
ForwardRows entmax_rows(double alpha) {
  return [alpha](const HeadProblem& hp, Dense& w, std::vector<double>& tau) {
    for (std::int64_t r = 0; r < hp.z.rows; ++r) {
      const std::int64_t n = hp.n[static_cast<std::size_t>(r)];
      std::vector<double> x(static_cast<std::size_t>(n));
      for (std::int64_t i = 0; i < n; ++i) x[static_cast<std::size_t>(i)] = (alpha - 1) * hp.z(r, i);
      const double t = entmax_threshold(x, alpha);
      tau[static_cast<std::size_t>(r)] = t;
      for (std::int64_t i = 0; i < n; ++i) w(r, i) = entmax_p(x[static_cast<std::size_t>(i)], t, alpha);
    }
  };
}

// u = p^(2 - alpha) on the support; dz = u (dp - sum u dp / sum u).
void entmax_grad_rows(double alpha, const HeadProblem& hp, const Dense& w, const Dense& dw, Dense& dz) {
  for (std::int64_t r = 0; r < hp.z.rows; ++r) {
    const std::int64_t n = hp.n[static_cast<std::size_t>(r)];
    std::vector<double> u(static_cast<std::size_t>(n), 0.0);
    double su = 0, sudp = 0;
    for (std::int64_t i = 0; i < n; ++i) {
      const double pi = w(r, i);
      const double ui = pi > 0 ? std::pow(pi, 2 - alpha) : 0.0;
      u[static_cast<std::size_t>(i)] = ui;
      su += ui;
      sudp += ui * dw(r, i);
    }
    const double delta = su > 0 ? sudp / su : 0.0;
    for (std::int64_t i = 0; i < n; ++i) dz(r, i) = u[static_cast<std::size_t>(i)] * (dw(r, i) - delta);
  }
}

}  // namespace

void entmax_forward(const detail::AttentionParams& p, const detail::EntmaxConfig& cfg) {
  run_forward(p, entmax_rows(cfg.alpha));
}

void entmax_backward(const detail::AttentionParams& p, const detail::GradientParams& g,
                     const detail::EntmaxConfig& cfg) {
  run_backward(p, g, entmax_rows(cfg.alpha),
               [&](const HeadProblem& hp, const Dense& w, const Dense& dw,
                   const std::vector<double>&, Dense& dz) { entmax_grad_rows(cfg.alpha, hp, w, dw, dz); });
}

}  // namespace winnow::reference
