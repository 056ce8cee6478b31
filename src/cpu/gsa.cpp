// GSA's indexer with selection on the CPU: one query row at a time (rows in parallel), its
// scores held in a row buffer (O(L) per thread, never L x L), the budget from the row's
// variance, then exact top-k by partial selection under the spec's order (higher score first,
// ties toward the more recent key) and the chosen positions written in increasing order.
#include <omp.h>

#include <algorithm>
#include <vector>

#include "cpu/cpu.h"
#include "math/gsa.h"

namespace winnow::cpu {
namespace {

template <class T>
void select_keys(const detail::AttentionParams& p, const detail::IndexerConfig& c) {
  struct Item {
    std::int64_t b, r;
  };
  std::vector<Item> items;
  for (std::int64_t b = 0; b < p.num_seqs; ++b) {
    const detail::SequenceExtent s = p.sequence(b);
    // Later rows see more keys: listing them first balances the dynamic schedule.
    for (std::int64_t r = s.q_len - 1; r >= 0; --r) items.push_back({b, r});
  }
  const std::int64_t count_items = static_cast<std::int64_t>(items.size());
  const std::int64_t k_max = c.budget.k_max;
  const int threads = p.num_threads > 0 ? p.num_threads : omp_get_max_threads();
#pragma omp parallel num_threads(threads)
  {
    std::vector<T> score;
    std::vector<std::int64_t> order;
    std::vector<T> q_row(static_cast<std::size_t>(p.dim_qk));
#pragma omp for schedule(dynamic, 16)
    for (std::int64_t it = 0; it < count_items; ++it) {
      const Item item = items[static_cast<std::size_t>(it)];
      const detail::SequenceExtent s = p.sequence(item.b);
      const std::int64_t t = item.r + s.q_offset(), row = s.q_start + item.r;
      score.assign(static_cast<std::size_t>(t + 1), T(0));
      for (std::int64_t j = 0; j < p.heads_q; ++j) {
        const T* q = p.q.at<T>(item.b, row, j);
        for (std::int64_t d = 0; d < p.dim_qk; ++d) q_row[static_cast<std::size_t>(d)] = q[d * p.q.dim];
        const T w = *c.weights.at<T>(item.b, row, j);
        const T bias = c.bias_at<T>(j);
        const T scale = static_cast<T>(p.scale);
        for (std::int64_t key = 0; key <= t; ++key) {
          const T* k = p.k.at<T>(item.b, s.k_start + key, 0);
          T dot = 0;
          for (std::int64_t d = 0; d < p.dim_qk; ++d) dot += q_row[static_cast<std::size_t>(d)] * k[d * p.k.dim];
          score[static_cast<std::size_t>(key)] += math::gsa::head_term(c.form, w, dot * scale, bias);
        }
      }
      // The variance in double: a row's scores may be many and close together.
      double sum = 0;
      for (T x : score) sum += static_cast<double>(x);
      const double n = static_cast<double>(t + 1), mean = sum / n;
      double variance = 0;
      for (T x : score) variance += (static_cast<double>(x) - mean) * (static_cast<double>(x) - mean);
      variance /= n;
      const std::int64_t count = std::min(math::gsa::budget(c.budget, variance), t + 1);

      order.resize(static_cast<std::size_t>(t + 1));
      for (std::int64_t key = 0; key <= t; ++key) order[static_cast<std::size_t>(key)] = key;
      if (count < t + 1) {
        std::nth_element(order.begin(), order.begin() + count, order.end(), [&](std::int64_t a, std::int64_t z) {
          return math::gsa::ranks_before(score[static_cast<std::size_t>(a)], a, score[static_cast<std::size_t>(z)], z);
        });
        std::sort(order.begin(), order.begin() + count);
      }

      *p.stats.at<T>(item.b, row, 0) = static_cast<T>(variance);
      *c.counts.at<std::int32_t>(item.b, row, 0) = static_cast<std::int32_t>(count);
      for (std::int64_t i = 0; i < k_max; ++i) {
        *c.indices.at<std::int32_t>(item.b, row, i) =
            i < count ? static_cast<std::int32_t>(order[static_cast<std::size_t>(i)]) : -1;
      }
    }
  }
}

}  // namespace

void gsa_select_keys(const detail::AttentionParams& p, const detail::IndexerConfig& c) {
  if (p.dtype == DType::float64) {
    select_keys<double>(p, c);
  } else {
    select_keys<float>(p, c);
  }
}

}  // namespace winnow::cpu
