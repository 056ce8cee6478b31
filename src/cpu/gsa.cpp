// GSA on the CPU. The indexer with selection: one query row at a time (rows in parallel), its
// scores held in a row buffer (O(L) per thread, never L x L), the budget from the row's
// variance, then exact top-k by partial selection under the spec's order (higher score first,
// ties toward the more recent key) and the chosen positions written in increasing order.
// The sparse attention: the forward runs query rows in parallel, every head of a row over the
// row's one list; the backward runs (sequence, kv head) pairs in parallel, each accumulating
// its keys' dk and dv privately, so results do not depend on the thread count.

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "cpu/cpu.h"
#include "cpu/query_rows.h"
#include "cpu/tiles.h"
#include "math/gsa.h"
#include "math/softmax.h"

namespace winnow::cpu {
namespace {

template <class T>
void select_keys(const detail::AttentionParams& p, const detail::IndexerConfig& c) {
  const std::vector<RowItem> items = query_rows(p);
  const std::int64_t count_items = static_cast<std::int64_t>(items.size());
  const std::int64_t k_max = c.budget.k_max;
#pragma omp parallel num_threads(thread_count(p))
  {
    std::vector<T> score;
    std::vector<std::int64_t> order;
    std::vector<T> q_row(static_cast<std::size_t>(p.dim_qk));
#pragma omp for schedule(dynamic, 16)
    for (std::int64_t it = 0; it < count_items; ++it) {
      const RowItem item = items[static_cast<std::size_t>(it)];
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

// Row `row` of head h: its list's scaled scores turned into probabilities (in z), returning the
// log-sum-exp (-inf for an empty list).
template <class T>
T list_probabilities(const detail::AttentionParams& p, const detail::KeyListConfig& c, std::int64_t b,
                     const detail::SequenceExtent& s, std::int64_t row, std::int64_t h, std::vector<T>& z) {
  const std::int64_t n = *c.counts.at<const std::int32_t>(b, row, 0);
  z.resize(static_cast<std::size_t>(n));
  const T* q = p.q.at<const T>(b, row, h);
  T m = -std::numeric_limits<T>::infinity();
  for (std::int64_t i = 0; i < n; ++i) {
    const T* k = p.k.at<const T>(b, s.k_start + *c.indices.at<const std::int32_t>(b, row, i), p.kv_head(h));
    T dot = 0;
    for (std::int64_t d = 0; d < p.dim_qk; ++d) dot += q[d * p.q.dim] * k[d * p.k.dim];
    z[static_cast<std::size_t>(i)] = dot * static_cast<T>(p.scale);
    m = std::max(m, z[static_cast<std::size_t>(i)]);
  }
  if (n == 0) return -std::numeric_limits<T>::infinity();
  T sum = 0;
  for (T x : z) sum += std::exp(x - m);
  const T lse = m + std::log(sum);
  for (T& x : z) x = math::softmax::probability(x, lse);
  return lse;
}

template <class T>
void sparse_forward(const detail::AttentionParams& p, const detail::KeyListConfig& c) {
  const std::vector<RowItem> items = query_rows(p);
  const std::int64_t count = static_cast<std::int64_t>(items.size());
#pragma omp parallel num_threads(thread_count(p))
  {
    std::vector<T> w, acc(static_cast<std::size_t>(p.dim_v));
#pragma omp for schedule(dynamic, 16)
    for (std::int64_t it = 0; it < count; ++it) {
      const RowItem item = items[static_cast<std::size_t>(it)];
      const detail::SequenceExtent s = p.sequence(item.b);
      const std::int64_t row = s.q_start + item.r;
      for (std::int64_t h = 0; h < p.heads_q; ++h) {
        const T lse = list_probabilities(p, c, item.b, s, row, h, w);
        std::fill(acc.begin(), acc.end(), T(0));
        for (std::size_t i = 0; i < w.size(); ++i) {
          const std::int64_t key = *c.indices.at<const std::int32_t>(item.b, row, static_cast<std::int64_t>(i));
          const T* v = p.v.at<const T>(item.b, s.k_start + key, p.kv_head(h));
          for (std::int64_t d = 0; d < p.dim_v; ++d) acc[static_cast<std::size_t>(d)] += w[i] * v[d * p.v.dim];
        }
        T* out = p.out.at<T>(item.b, row, h);
        for (std::int64_t d = 0; d < p.dim_v; ++d) out[d * p.out.dim] = acc[static_cast<std::size_t>(d)];
        *p.stats.at<T>(item.b, row, h) = lse;
      }
    }
  }
}

template <class T>
void sparse_backward(const detail::AttentionParams& p, const detail::GradientParams& g,
                     const detail::KeyListConfig& c) {
  const std::int64_t pairs = p.num_seqs * p.heads_kv;
#pragma omp parallel num_threads(thread_count(p))
  {
    std::vector<T> w, dw, dk, dv, dq(static_cast<std::size_t>(p.dim_qk));
#pragma omp for schedule(dynamic, 1)
    for (std::int64_t pair = 0; pair < pairs; ++pair) {
      const std::int64_t b = pair / p.heads_kv, hk = pair % p.heads_kv;
      const detail::SequenceExtent s = p.sequence(b);
      dk.assign(static_cast<std::size_t>(s.k_len * p.dim_qk), T(0));
      dv.assign(static_cast<std::size_t>(s.k_len * p.dim_v), T(0));
      for (std::int64_t h = hk * p.group_size(); h < (hk + 1) * p.group_size(); ++h) {
        for (std::int64_t r = 0; r < s.q_len; ++r) {
          const std::int64_t row = s.q_start + r;
          (void)list_probabilities(p, c, b, s, row, h, w);
          const T* q = p.q.at<const T>(b, row, h);
          const T* dout = g.dout.at<const T>(b, row, h);
          const T* out = p.out.at<const T>(b, row, h);
          // delta = <dout, out> = sum_i w_i dw_i, from the saved output.
          T delta = 0;
          for (std::int64_t d = 0; d < p.dim_v; ++d) delta += dout[d * g.dout.dim] * out[d * p.out.dim];
          std::fill(dq.begin(), dq.end(), T(0));
          for (std::size_t i = 0; i < w.size(); ++i) {
            const std::int64_t key = *c.indices.at<const std::int32_t>(b, row, static_cast<std::int64_t>(i));
            const T* k = p.k.at<const T>(b, s.k_start + key, hk);
            const T* v = p.v.at<const T>(b, s.k_start + key, hk);
            T dwi = 0;
            for (std::int64_t d = 0; d < p.dim_v; ++d) dwi += dout[d * g.dout.dim] * v[d * p.v.dim];
            const T dz = math::softmax::grad_logit(w[i], dwi, delta) * static_cast<T>(p.scale);
            T* dk_row = dk.data() + key * p.dim_qk;
            T* dv_row = dv.data() + key * p.dim_v;
            for (std::int64_t d = 0; d < p.dim_qk; ++d) {
              dq[static_cast<std::size_t>(d)] += dz * k[d * p.k.dim];
              dk_row[d] += dz * q[d * p.q.dim];
            }
            for (std::int64_t d = 0; d < p.dim_v; ++d) dv_row[d] += w[i] * dout[d * g.dout.dim];
          }
          T* dq_out = g.dq.at<T>(b, row, h);
          for (std::int64_t d = 0; d < p.dim_qk; ++d) dq_out[d * g.dq.dim] = dq[static_cast<std::size_t>(d)];
        }
      }
      for (std::int64_t key = 0; key < s.k_len; ++key) {
        T* dk_out = g.dk.at<T>(b, s.k_start + key, hk);
        T* dv_out = g.dv.at<T>(b, s.k_start + key, hk);
        for (std::int64_t d = 0; d < p.dim_qk; ++d) dk_out[d * g.dk.dim] = dk[static_cast<std::size_t>(key * p.dim_qk + d)];
        for (std::int64_t d = 0; d < p.dim_v; ++d) dv_out[d * g.dv.dim] = dv[static_cast<std::size_t>(key * p.dim_v + d)];
      }
    }
  }
}

}  // namespace

void gsa_sparse_forward(const detail::AttentionParams& p, const detail::KeyListConfig& c) {
  if (p.dtype == DType::float64) {
    sparse_forward<double>(p, c);
  } else {
    sparse_forward<float>(p, c);
  }
}

void gsa_sparse_backward(const detail::AttentionParams& p, const detail::GradientParams& g,
                         const detail::KeyListConfig& c) {
  if (p.dtype == DType::float64) {
    sparse_backward<double>(p, g, c);
  } else {
    sparse_backward<float>(p, g, c);
  }
}

void gsa_select_keys(const detail::AttentionParams& p, const detail::IndexerConfig& c) {
  if (p.dtype == DType::float64) {
    select_keys<double>(p, c);
  } else {
    select_keys<float>(p, c);
  }
}

}  // namespace winnow::cpu
