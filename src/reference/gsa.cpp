// GSA's indexer with selection from spec/gsa.md, in float64: every visible key of a row is
// scored, the row's population variance gives the budget, and the keys are fully sorted by the
// selection order; the first min(k_t, t + 1) are written in increasing position order.
#include <algorithm>
#include <numeric>
#include <vector>

#include "math/gsa.h"
#include "reference/reference.h"

namespace winnow::reference {

void gsa_select_keys(const detail::AttentionParams& p, const detail::IndexerConfig& c) {
  const std::int64_t k_max = c.budget.k_max;
  for (std::int64_t b = 0; b < p.num_seqs; ++b) {
    const detail::SequenceExtent s = p.sequence(b);
    for (std::int64_t r = 0; r < s.q_len; ++r) {
      const std::int64_t t = r + s.q_offset();  // the query's position; it sees keys 0 .. t
      const std::int64_t row = s.q_start + r;
      std::vector<double> score(static_cast<std::size_t>(t + 1), 0.0);
      for (std::int64_t j = 0; j < p.heads_q; ++j) {
        const double* q = p.q.at<double>(b, row, j);
        const double w = *c.weights.at<double>(b, row, j);
        const double bias = c.bias_at<double>(j);
        for (std::int64_t key = 0; key <= t; ++key) {
          const double* k = p.k.at<double>(b, s.k_start + key, 0);
          double dot = 0;
          for (std::int64_t d = 0; d < p.dim_qk; ++d) dot += q[d * p.q.dim] * k[d * p.k.dim];
          score[static_cast<std::size_t>(key)] += math::gsa::head_term(c.form, w, dot * p.scale, bias);
        }
      }
      const double n = static_cast<double>(t + 1);
      const double mean = std::accumulate(score.begin(), score.end(), 0.0) / n;
      double variance = 0;
      for (double x : score) variance += (x - mean) * (x - mean);
      variance /= n;
      const std::int64_t budget = math::gsa::budget(c.budget, variance);
      const std::int64_t count = std::min(budget, t + 1);

      std::vector<std::int64_t> order(static_cast<std::size_t>(t + 1));
      std::iota(order.begin(), order.end(), 0);
      std::sort(order.begin(), order.end(), [&](std::int64_t a, std::int64_t z) {
        return math::gsa::ranks_before(score[static_cast<std::size_t>(a)], a, score[static_cast<std::size_t>(z)], z);
      });
      order.resize(static_cast<std::size_t>(count));
      std::sort(order.begin(), order.end());

      *p.stats.at<double>(b, row, 0) = variance;
      *c.counts.at<std::int32_t>(b, row, 0) = static_cast<std::int32_t>(count);
      for (std::int64_t i = 0; i < k_max; ++i) {
        *c.indices.at<std::int32_t>(b, row, i) =
            i < count ? static_cast<std::int32_t>(order[static_cast<std::size_t>(i)]) : -1;
      }
    }
  }
}

}  // namespace winnow::reference
