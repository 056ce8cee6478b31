// GSA from spec/gsa.md, in float64. The indexer with selection: every visible key of a row is
// scored, the row's population variance gives the budget, and the keys are fully sorted by the
// selection order; the first min(k_t, t + 1) are written in increasing position order. The
// sparse attention: each row's softmax over its own list, gathered key by key.
#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <vector>

#include "math/gsa.h"
#include "math/softmax.h"
#include "reference/dense.h"
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

namespace {

// One (sequence, query head) as dense matrices, with each row's list.
struct SparseHead {
  Dense q, k, v;                                 // Lq x D, Lk x D, Lk x Dv
  std::vector<std::vector<std::int64_t>> lists;  // per query row
  SparseHead(const detail::AttentionParams& p, const detail::KeyListConfig& c, std::int64_t b, std::int64_t h)
      : q(0, 0), k(0, 0), v(0, 0) {
    const detail::SequenceExtent s = p.sequence(b);
    q = gather(p.q, b, s.q_start, s.q_len, h, p.dim_qk);
    k = gather(p.k, b, s.k_start, s.k_len, p.kv_head(h), p.dim_qk);
    v = gather(p.v, b, s.k_start, s.k_len, p.kv_head(h), p.dim_v);
    for (std::int64_t r = 0; r < s.q_len; ++r) {
      const std::int64_t row = s.q_start + r;
      std::vector<std::int64_t> list(static_cast<std::size_t>(*c.counts.at<const std::int32_t>(b, row, 0)));
      for (std::size_t i = 0; i < list.size(); ++i) {
        list[i] = *c.indices.at<const std::int32_t>(b, row, static_cast<std::int64_t>(i));
      }
      lists.push_back(std::move(list));
    }
  }
  // Row r's probabilities over its list, and its log-sum-exp.
  std::vector<double> probabilities(const detail::AttentionParams& p, std::int64_t r, double& lse) const {
    const std::vector<std::int64_t>& list = lists[static_cast<std::size_t>(r)];
    std::vector<double> z(list.size());
    double m = -std::numeric_limits<double>::infinity();
    for (std::size_t i = 0; i < list.size(); ++i) {
      double dot = 0;
      for (std::int64_t d = 0; d < p.dim_qk; ++d) dot += q(r, d) * k(list[i], d);
      z[i] = dot * p.scale;
      m = std::max(m, z[i]);
    }
    double sum = 0;
    for (double x : z) sum += std::exp(x - m);
    lse = list.empty() ? -std::numeric_limits<double>::infinity() : m + std::log(sum);
    for (double& x : z) x = math::softmax::probability(x, lse);
    return z;
  }
};

}  // namespace

void gsa_sparse_forward(const detail::AttentionParams& p, const detail::KeyListConfig& c) {
  for (std::int64_t b = 0; b < p.num_seqs; ++b) {
    const detail::SequenceExtent s = p.sequence(b);
    for (std::int64_t h = 0; h < p.heads_q; ++h) {
      const SparseHead head(p, c, b, h);
      Dense out(s.q_len, p.dim_v);
      for (std::int64_t r = 0; r < s.q_len; ++r) {
        double lse = 0;
        const std::vector<double> w = head.probabilities(p, r, lse);
        const std::vector<std::int64_t>& list = head.lists[static_cast<std::size_t>(r)];
        for (std::size_t i = 0; i < list.size(); ++i) {
          for (std::int64_t d = 0; d < p.dim_v; ++d) out(r, d) += w[i] * head.v(list[i], d);
        }
        *p.stats.at<double>(b, s.q_start + r, h) = lse;
      }
      scatter(out, p.out, b, s.q_start, h);
    }
  }
}

void gsa_sparse_backward(const detail::AttentionParams& p, const detail::GradientParams& g,
                         const detail::KeyListConfig& c) {
  for (std::int64_t b = 0; b < p.num_seqs; ++b) {
    const detail::SequenceExtent s = p.sequence(b);
    for (std::int64_t hk = 0; hk < p.heads_kv; ++hk) {
      Dense dk(s.k_len, p.dim_qk), dv(s.k_len, p.dim_v);
      for (std::int64_t h = hk * p.group_size(); h < (hk + 1) * p.group_size(); ++h) {
        const SparseHead head(p, c, b, h);
        const Dense dout = gather(g.dout, b, s.q_start, s.q_len, h, p.dim_v);
        Dense dq(s.q_len, p.dim_qk);
        for (std::int64_t r = 0; r < s.q_len; ++r) {
          double lse = 0;
          const std::vector<double> w = head.probabilities(p, r, lse);
          const std::vector<std::int64_t>& list = head.lists[static_cast<std::size_t>(r)];
          std::vector<double> dw(list.size(), 0.0);
          double delta = 0;
          for (std::size_t i = 0; i < list.size(); ++i) {
            for (std::int64_t d = 0; d < p.dim_v; ++d) dw[i] += dout(r, d) * head.v(list[i], d);
            delta += w[i] * dw[i];
          }
          for (std::size_t i = 0; i < list.size(); ++i) {
            const double dz = math::softmax::grad_logit(w[i], dw[i], delta) * p.scale;
            for (std::int64_t d = 0; d < p.dim_qk; ++d) {
              dq(r, d) += dz * head.k(list[i], d);
              dk(list[i], d) += dz * head.q(r, d);
            }
            for (std::int64_t d = 0; d < p.dim_v; ++d) dv(list[i], d) += w[i] * dout(r, d);
          }
        }
        scatter(dq, g.dq, b, s.q_start, h);
      }
      scatter(dk, g.dk, b, s.k_start, hk);
      scatter(dv, g.dv, b, s.k_start, hk);
    }
  }
}

}  // namespace winnow::reference
