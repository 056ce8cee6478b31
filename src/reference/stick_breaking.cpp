// Stick-breaking attention from spec/stick-breaking.md, materialized.
#include <cmath>

#include "math/elementwise.h"
#include "math/stick_breaking.h"
#include "reference/dense.h"
#include "reference/reference.h"

namespace winnow::reference {
namespace {

namespace sb = math::stick_breaking;

// log A_ij = z_ij - sum_{k >= i} softplus(z_kj), summed right to left; log rem = -S_j.
void stick_breaking_rows(const HeadProblem& hp, Dense& w, std::vector<double>& log_rem) {
  for (std::int64_t r = 0; r < hp.z.rows; ++r) {
    double suffix = 0;
    for (std::int64_t i = hp.n[static_cast<std::size_t>(r)] - 1; i >= 0; --i) {
      suffix += sb::stick_cost(hp.z(r, i));
      w(r, i) = std::exp(sb::log_weight(hp.z(r, i), suffix, 0.0));
    }
    log_rem[static_cast<std::size_t>(r)] = -suffix;
  }
}

// g_ij = A_ij dA_ij; dz_ij = g_ij - sigmoid(z_ij) (sum_{i' <= i} g_i'j + dlog_rem_j).
void stick_breaking_grad_rows(const HeadProblem& hp, const Dense& w, const Dense& dw,
                              const std::vector<double>& dlog_rem, Dense& dz) {
  for (std::int64_t r = 0; r < hp.z.rows; ++r) {
    double prefix = 0;
    for (std::int64_t i = 0; i < hp.n[static_cast<std::size_t>(r)]; ++i) {
      const double g = w(r, i) * dw(r, i);
      prefix += g;
      dz(r, i) = sb::grad_logit(g, hp.z(r, i), prefix + dlog_rem[static_cast<std::size_t>(r)]);
    }
  }
}

}  // namespace

void stick_breaking_forward(const detail::AttentionParams& p, const detail::StickBreakingConfig& cfg) {
  run_forward(p, stick_breaking_rows);
  // Exact stick-breaking keeps every key.
  if (cfg.kept_from.data != nullptr) {
    for (std::int64_t b = 0; b < p.num_seqs; ++b) {
      const detail::SequenceExtent s = p.sequence(b);
      for (std::int64_t r = 0; r < s.q_len; ++r) {
        for (std::int64_t h = 0; h < p.heads_q; ++h) *cfg.kept_from.at<std::int32_t>(b, s.q_start + r, h) = 0;
      }
    }
  }
}

void stick_breaking_backward(const detail::AttentionParams& p, const detail::GradientParams& g,
                             const detail::StickBreakingConfig&) {
  run_backward(p, g, stick_breaking_rows, stick_breaking_grad_rows);
}

}  // namespace winnow::reference
