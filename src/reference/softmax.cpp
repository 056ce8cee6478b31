// Softmax attention from spec/softmax.md, materialized.
#include <cmath>
#include <limits>

#include "math/softmax.h"
#include "reference/dense.h"
#include "reference/reference.h"

namespace winnow::reference {
namespace {

void softmax_rows(const HeadProblem& hp, Dense& w, std::vector<double>& lse) {
  for (std::int64_t r = 0; r < hp.z.rows; ++r) {
    const std::int64_t n = hp.n[static_cast<std::size_t>(r)];
    if (n <= 0) {
      lse[static_cast<std::size_t>(r)] = -std::numeric_limits<double>::infinity();
      continue;
    }
    double m = -std::numeric_limits<double>::infinity();
    for (std::int64_t i = 0; i < n; ++i) m = std::max(m, hp.z(r, i));
    double sum = 0;
    for (std::int64_t i = 0; i < n; ++i) sum += std::exp(hp.z(r, i) - m);
    const double row_lse = m + std::log(sum);
    lse[static_cast<std::size_t>(r)] = row_lse;
    for (std::int64_t i = 0; i < n; ++i) w(r, i) = math::softmax::probability(hp.z(r, i), row_lse);
  }
}

}  // namespace

void softmax_forward(const detail::AttentionParams& p) { run_forward(p, softmax_rows); }

void softmax_backward(const detail::AttentionParams& p, const detail::GradientParams& g) {
  run_backward(p, g, softmax_rows,
               [](const HeadProblem& hp, const Dense& w, const Dense& dw,
                  const std::vector<double>&, Dense& dz) {
                 for (std::int64_t r = 0; r < hp.z.rows; ++r) {
                   const std::int64_t n = hp.n[static_cast<std::size_t>(r)];
                   double delta = 0;
                   for (std::int64_t i = 0; i < n; ++i) delta += w(r, i) * dw(r, i);
                   for (std::int64_t i = 0; i < n; ++i) {
                     dz(r, i) = math::softmax::grad_logit(w(r, i), dw(r, i), delta);
                   }
                 }
               });
}

}  // namespace winnow::reference
