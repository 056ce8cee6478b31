// GSA's indexer loss (winnow/gsa.h, indexer_loss_*) in float64, row by row as the formulas read:
// every score of the row's set, its log-sum-exps, the heads' mean attention p and the KL of the
// indexer's distribution from it; the backward recomputes each key's terms from the saved
// log-sum-exps and adds the chain rule's products one key and one indexer head at a time.
#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <vector>

#include "math/gsa.h"
#include "reference/dense.h"
#include "reference/reference.h"

namespace winnow::reference {
namespace {

double dot(const double* a, std::int64_t a_step, const double* b, std::int64_t b_step, std::int64_t n) {
  double sum = 0;
  for (std::int64_t d = 0; d < n; ++d) sum += a[d * a_step] * b[d * b_step];
  return sum;
}

// Row r of sequence b: its set S_t as key positions in the sequence.
std::vector<std::int64_t> key_set(const detail::IndexerLossConfig& c, std::int64_t b, std::int64_t row,
                                  std::int64_t t) {
  std::vector<std::int64_t> keys;
  if (!c.has_lists()) {
    keys.resize(static_cast<std::size_t>(t + 1));
    std::iota(keys.begin(), keys.end(), 0);
    return keys;
  }
  const std::int32_t n = *c.counts.at<const std::int32_t>(b, row, 0);
  for (std::int32_t i = 0; i < n; ++i) keys.push_back(*c.indices.at<const std::int32_t>(b, row, i));
  return keys;
}

double logsumexp(const std::vector<double>& z) {
  if (z.empty()) return -std::numeric_limits<double>::infinity();
  const double m = *std::max_element(z.begin(), z.end());
  double sum = 0;
  for (double x : z) sum += std::exp(x - m);
  return m + std::log(sum);
}

// One key of a row: the attention heads' logits, and the indexer heads' scaled dot products.
struct KeyScores {
  std::vector<double> logits, dots;
};

KeyScores key_scores(const detail::AttentionParams& p, const detail::IndexerLossConfig& c, std::int64_t b,
                     const detail::SequenceExtent& s, std::int64_t row, std::int64_t key) {
  const detail::AttentionParams& a = c.attention;
  KeyScores out;
  for (std::int64_t h = 0; h < a.heads_q; ++h) {
    const double* q = a.q.at<const double>(b, row, h);
    const double* k = a.k.at<const double>(b, s.k_start + key, a.kv_head(h));
    out.logits.push_back(dot(q, a.q.dim, k, a.k.dim, a.dim_qk) * a.scale);
  }
  const double* ik = p.k.at<const double>(b, s.k_start + key, 0);
  for (std::int64_t j = 0; j < p.heads_q; ++j) {
    out.dots.push_back(dot(p.q.at<const double>(b, row, j), p.q.dim, ik, p.k.dim, p.dim_qk) * p.scale);
  }
  return out;
}

double indexer_score(const detail::AttentionParams& p, const detail::IndexerLossConfig& c, std::int64_t b,
                     std::int64_t row, const KeyScores& z) {
  double score = 0;
  for (std::int64_t j = 0; j < p.heads_q; ++j) {
    score += math::gsa::head_term(c.form, *c.weights.at<const double>(b, row, j), z.dots[static_cast<std::size_t>(j)],
                                  c.bias_at<double>(j));
  }
  return score;
}

}  // namespace

void gsa_indexer_loss_forward(const detail::AttentionParams& p, const detail::IndexerLossConfig& c) {
  const std::int64_t heads = c.attention.heads_q;
  const std::size_t h_count = static_cast<std::size_t>(heads);
  for (std::int64_t b = 0; b < p.num_seqs; ++b) {
    const detail::SequenceExtent s = p.sequence(b);
    for (std::int64_t r = 0; r < s.q_len; ++r) {
      const std::int64_t row = s.q_start + r;
      const std::vector<std::int64_t> keys = key_set(c, b, row, r + s.q_offset());
      const std::size_t n = keys.size();
      // logits[h][i] over the set's keys i, and the indexer's scores.
      std::vector<std::vector<double>> logits(h_count, std::vector<double>(n));
      std::vector<double> scores(n);
      for (std::size_t i = 0; i < n; ++i) {
        const KeyScores z = key_scores(p, c, b, s, row, keys[i]);
        for (std::size_t h = 0; h < h_count; ++h) logits[h][i] = z.logits[h];
        scores[i] = indexer_score(p, c, b, row, z);
      }
      std::vector<double> lse(h_count);
      for (std::size_t h = 0; h < h_count; ++h) lse[h] = logsumexp(logits[h]);
      const double lse_index = logsumexp(scores);
      double loss = 0;
      for (std::size_t i = 0; i < n; ++i) {
        double prob = 0;
        for (std::size_t h = 0; h < h_count; ++h) prob += std::exp(logits[h][i] - lse[h]);
        loss += math::gsa::kl_term(prob / static_cast<double>(heads), scores[i] - lse_index);
      }
      *p.stats.at<double>(b, row, 0) = loss;
      for (std::size_t h = 0; h < h_count; ++h) *c.lse.at<double>(b, row, static_cast<std::int64_t>(h)) = lse[h];
      *c.lse.at<double>(b, row, heads) = lse_index;
    }
  }
}

void gsa_indexer_loss_backward(const detail::AttentionParams& p, const detail::IndexerLossConfig& c) {
  const std::int64_t heads = c.attention.heads_q, index_heads = p.heads_q;
  std::vector<double> dbias(static_cast<std::size_t>(index_heads), 0.0);
  for (std::int64_t b = 0; b < p.num_seqs; ++b) {
    const detail::SequenceExtent s = p.sequence(b);
    Dense dk(s.k_len, p.dim_qk);
    for (std::int64_t r = 0; r < s.q_len; ++r) {
      const std::int64_t row = s.q_start + r;
      const double g = *c.dloss.at<const double>(b, row, 0);
      const double lse_index = *c.lse.at<const double>(b, row, heads);
      Dense dq(index_heads, p.dim_qk);
      std::vector<double> dweights(static_cast<std::size_t>(index_heads), 0.0);
      for (const std::int64_t key : key_set(c, b, row, r + s.q_offset())) {
        const KeyScores z = key_scores(p, c, b, s, row, key);
        double prob = 0;
        for (std::int64_t h = 0; h < heads; ++h) {
          prob += std::exp(z.logits[static_cast<std::size_t>(h)] - *c.lse.at<const double>(b, row, h));
        }
        prob /= static_cast<double>(heads);
        const double dscore = g * math::gsa::kl_score_slope(prob, indexer_score(p, c, b, row, z) - lse_index);
        const double* ik = p.k.at<const double>(b, s.k_start + key, 0);
        for (std::int64_t j = 0; j < index_heads; ++j) {
          const math::gsa::TermSlopes<double> slope =
              math::gsa::term_slopes(c.form, math::gsa::gate(c.form, *c.weights.at<const double>(b, row, j)),
                                     z.dots[static_cast<std::size_t>(j)], c.bias_at<double>(j));
          const double dz = dscore * slope.dot;
          dweights[static_cast<std::size_t>(j)] += dscore * slope.weight;
          dbias[static_cast<std::size_t>(j)] += dz;
          const double* iq = p.q.at<const double>(b, row, j);
          for (std::int64_t d = 0; d < p.dim_qk; ++d) {
            dq(j, d) += p.scale * dz * ik[d * p.k.dim];
            dk(key, d) += p.scale * dz * iq[d * p.q.dim];
          }
        }
      }
      for (std::int64_t j = 0; j < index_heads; ++j) {
        double* out = c.dq.at<double>(b, row, j);
        for (std::int64_t d = 0; d < p.dim_qk; ++d) out[d * c.dq.dim] = dq(j, d);
        *c.dweights.at<double>(b, row, j) = dweights[static_cast<std::size_t>(j)];
      }
    }
    scatter(dk, c.dk, b, s.k_start, 0);
  }
  if (c.dbias.data != nullptr) write_per_head(c.dbias, dbias);
}

}  // namespace winnow::reference
