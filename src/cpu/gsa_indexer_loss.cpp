// GSA's indexer loss on the CPU (winnow/gsa.h, indexer_loss_*), row by row like the rest of GSA
// (cpu/gsa.cpp): a row's queries gathered once, then its set's keys scored one at a time.
// The forward runs query rows in parallel, each holding its set's logits in a row buffer (O(L H)
// per thread, never L x L) for the log-sum-exps and then the KL. The backward recomputes every
// key's terms from the saved log-sum-exps, in two passes so that no sum depends on the thread
// count: rows in parallel for dq, dhead_weights and each row's share of dbias (summed in row
// order afterwards), then key tiles in parallel for dk, each tile visiting the rows that see
// it in order. Sums over a row's keys (log-sum-exps, the KL, the gradients, whose key terms
// q - p cancel over the row) are kept in double.

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "cpu/cpu.h"
#include "cpu/query_rows.h"
#include "cpu/tiles.h"
#include "math/gsa.h"

namespace winnow::cpu {
namespace {

using detail::IndexerLossConfig;

template <class T>
T dot(const T* q, const T* k, std::int64_t k_step, std::int64_t n) {
  T sum = 0;
  if (k_step == 1) {
    for (std::int64_t d = 0; d < n; ++d) sum += q[d] * k[d];
  } else {
    for (std::int64_t d = 0; d < n; ++d) sum += q[d] * k[d * k_step];
  }
  return sum;
}

// One query row bound at a time: its set S_t (list slots, or keys 0 .. t), and its attention and
// indexer queries, gates and biases gathered contiguously, so that scoring a key reads the key's
// rows alone.
template <class T>
class LossRow {
 public:
  LossRow(const AttentionParams& p, const IndexerLossConfig& c)
      : p_(p),
        c_(c),
        a_(c.attention),
        q_(static_cast<std::size_t>(a_.heads_q * a_.dim_qk)),
        iq_(static_cast<std::size_t>(p.heads_q * p.dim_qk)),
        gate_(static_cast<std::size_t>(p.heads_q)),
        bias_(static_cast<std::size_t>(p.heads_q)) {}

  // Row r of sequence b's set; returns its size. load() then gathers its queries.
  std::int64_t bind(std::int64_t b, const SequenceExtent& s, std::int64_t r) {
    b_ = b;
    s_ = s;
    row_ = s.q_start + r;
    t_ = r + s.q_offset();
    return c_.has_lists() ? *c_.counts.at<const std::int32_t>(b, row_, 0) : t_ + 1;
  }
  void load() {
    for (std::int64_t h = 0; h < a_.heads_q; ++h) gather(a_.q, h, a_.dim_qk, q_.data() + h * a_.dim_qk);
    for (std::int64_t j = 0; j < p_.heads_q; ++j) {
      gather(p_.q, j, p_.dim_qk, iq_.data() + j * p_.dim_qk);
      gate_[static_cast<std::size_t>(j)] = math::gsa::gate(c_.form, *c_.weights.at<const T>(b_, row_, j));
      bias_[static_cast<std::size_t>(j)] = c_.bias_at<T>(j);
    }
  }

  std::int64_t key(std::int64_t slot) const {
    return c_.has_lists() ? *c_.indices.at<const std::int32_t>(b_, row_, slot) : slot;
  }
  // The first slot of the set's n whose key is >= key (the set is increasing).
  std::int64_t first_slot_from(std::int64_t key, std::int64_t n) const {
    if (!c_.has_lists()) return std::min(key, n);
    std::int64_t lo = 0, hi = n;
    while (lo < hi) {
      const std::int64_t mid = (lo + hi) / 2;
      if (this->key(mid) < key) {
        lo = mid + 1;
      } else {
        hi = mid;
      }
    }
    return lo;
  }

  // Key `key`'s attention logits (one per attention head) and scaled indexer dot products (one
  // per indexer head); returns its indexer score I_ts.
  T score(std::int64_t key, T* logits, T* dots) const {
    const T attention_scale = static_cast<T>(a_.scale), scale = static_cast<T>(p_.scale);
    for (std::int64_t h = 0; h < a_.heads_q; ++h) {
      const T* k = a_.k.at<const T>(b_, s_.k_start + key, a_.kv_head(h));
      logits[h] = dot(q_.data() + h * a_.dim_qk, k, a_.k.dim, a_.dim_qk) * attention_scale;
    }
    const T* ik = index_key(key);
    T sum = 0;
    for (std::int64_t j = 0; j < p_.heads_q; ++j) {
      dots[j] = dot(index_query(j), ik, p_.k.dim, p_.dim_qk) * scale;
      sum += math::gsa::gated_term(c_.form, gate(j), dots[j], bias(j));
    }
    return sum;
  }

  // The heads' mean attention probability of a key from its logits and the saved log-sum-exps.
  T probability(const T* logits) const {
    T sum = 0;
    for (std::int64_t h = 0; h < a_.heads_q; ++h) sum += std::exp(logits[h] - lse(h));
    return sum / static_cast<T>(a_.heads_q);
  }

  T lse(std::int64_t h) const { return *c_.lse.at<const T>(b_, row_, h); }
  T gate(std::int64_t j) const { return gate_[static_cast<std::size_t>(j)]; }
  T bias(std::int64_t j) const { return bias_[static_cast<std::size_t>(j)]; }
  const T* index_query(std::int64_t j) const { return iq_.data() + j * p_.dim_qk; }
  const T* index_key(std::int64_t key) const { return p_.k.at<const T>(b_, s_.k_start + key, 0); }
  std::int64_t b() const { return b_; }
  std::int64_t row() const { return row_; }
  std::int64_t position() const { return t_; }

 private:
  void gather(const Operand& op, std::int64_t h, std::int64_t n, T* dst) const {
    const T* src = op.at<const T>(b_, row_, h);
    for (std::int64_t d = 0; d < n; ++d) dst[d] = src[d * op.dim];
  }

  const AttentionParams& p_;
  const IndexerLossConfig& c_;
  const AttentionParams& a_;
  std::vector<T> q_, iq_, gate_, bias_;
  SequenceExtent s_;
  std::int64_t b_ = 0, row_ = 0, t_ = 0;
};

template <class T>
void forward(const AttentionParams& p, const IndexerLossConfig& c) {
  const std::vector<RowItem> items = query_rows(p);
  const std::int64_t count = static_cast<std::int64_t>(items.size());
  const std::int64_t heads = c.attention.heads_q;
#pragma omp parallel num_threads(thread_count(p))
  {
    LossRow<T> row(p, c);
    std::vector<T> logits, scores, dots(static_cast<std::size_t>(p.heads_q)), lse(static_cast<std::size_t>(heads + 1));
#pragma omp for schedule(dynamic, 16)
    for (std::int64_t it = 0; it < count; ++it) {
      const RowItem item = items[static_cast<std::size_t>(it)];
      const std::int64_t n = row.bind(item.b, p.sequence(item.b), item.r);
      if (n == 0) {
        *p.stats.at<T>(item.b, row.row(), 0) = T(0);
        for (std::int64_t h = 0; h <= heads; ++h) {
          *c.lse.at<T>(item.b, row.row(), h) = -std::numeric_limits<T>::infinity();
        }
        continue;
      }
      row.load();
      // The set's logits, key-major (heads of a key together), the indexer's scores beside them.
      logits.resize(static_cast<std::size_t>(n * heads));
      scores.resize(static_cast<std::size_t>(n));
      for (std::int64_t i = 0; i < n; ++i) {
        scores[static_cast<std::size_t>(i)] = row.score(row.key(i), logits.data() + i * heads, dots.data());
      }
      for (std::int64_t h = 0; h <= heads; ++h) {
        // Column h of the logits; column `heads` is the indexer's scores.
        auto at = [&](std::int64_t i) {
          return h < heads ? logits[static_cast<std::size_t>(i * heads + h)] : scores[static_cast<std::size_t>(i)];
        };
        T m = -std::numeric_limits<T>::infinity();
        for (std::int64_t i = 0; i < n; ++i) m = std::max(m, at(i));
        double sum = 0;
        for (std::int64_t i = 0; i < n; ++i) sum += static_cast<double>(std::exp(at(i) - m));
        lse[static_cast<std::size_t>(h)] = static_cast<T>(static_cast<double>(m) + std::log(sum));
        *c.lse.at<T>(item.b, row.row(), h) = lse[static_cast<std::size_t>(h)];
      }
      // The KL from the stored (rounded) log-sum-exps, as the backward will see them.
      const T lse_index = lse[static_cast<std::size_t>(heads)];
      double loss = 0;
      for (std::int64_t i = 0; i < n; ++i) {
        const T log_q = scores[static_cast<std::size_t>(i)] - lse_index;
        loss += math::gsa::kl_term(static_cast<double>(row.probability(logits.data() + i * heads)),
                                   static_cast<double>(log_q));
      }
      *p.stats.at<T>(item.b, row.row(), 0) = static_cast<T>(loss);
    }
  }
}

// The slope of row t's loss in its score I_ts of `key`, g_t (q_ts - p_ts); the key's scaled
// indexer dot products are left in dots.
template <class T>
T score_slope(const LossRow<T>& row, std::int64_t key, T g, T lse_index, T* logits, T* dots) {
  const T score = row.score(key, logits, dots);
  return g * math::gsa::kl_score_slope(row.probability(logits), score - lse_index);
}

// dq, dhead_weights, and each row's dbias terms (parts[it * H_I + j]).
template <class T>
void backward_rows(const AttentionParams& p, const IndexerLossConfig& c, const std::vector<RowItem>& items,
                   std::vector<double>& dbias_parts) {
  const std::int64_t count = static_cast<std::int64_t>(items.size());
  const std::int64_t heads = c.attention.heads_q, index_heads = p.heads_q, dim = p.dim_qk;
  const bool want_dbias = c.dbias.data != nullptr;
#pragma omp parallel num_threads(thread_count(p))
  {
    LossRow<T> row(p, c);
    std::vector<T> logits(static_cast<std::size_t>(heads)), dots(static_cast<std::size_t>(index_heads));
    std::vector<double> dq(static_cast<std::size_t>(index_heads * dim));
    std::vector<double> dweights(static_cast<std::size_t>(index_heads)), dbias(dweights.size());
#pragma omp for schedule(dynamic, 16)
    for (std::int64_t it = 0; it < count; ++it) {
      const RowItem item = items[static_cast<std::size_t>(it)];
      const std::int64_t n = row.bind(item.b, p.sequence(item.b), item.r);
      std::fill(dq.begin(), dq.end(), 0.0);
      std::fill(dweights.begin(), dweights.end(), 0.0);
      std::fill(dbias.begin(), dbias.end(), 0.0);
      if (n > 0) {
        row.load();
        const T g = *c.dloss.at<const T>(item.b, row.row(), 0), lse_index = row.lse(heads);
        const double scale = p.scale;
        for (std::int64_t i = 0; i < n; ++i) {
          const std::int64_t key = row.key(i);
          const double dscore = score_slope(row, key, g, lse_index, logits.data(), dots.data());
          const T* ik = row.index_key(key);
          for (std::int64_t j = 0; j < index_heads; ++j) {
            const math::gsa::TermSlopes<T> slope = math::gsa::term_slopes(c.form, row.gate(j), dots[j], row.bias(j));
            const double dz = dscore * slope.dot;
            dweights[static_cast<std::size_t>(j)] += dscore * slope.weight;
            dbias[static_cast<std::size_t>(j)] += dz;
            double* dq_j = dq.data() + j * dim;
            for (std::int64_t d = 0; d < dim; ++d) dq_j[d] += scale * dz * ik[d * p.k.dim];
          }
        }
      }
      for (std::int64_t j = 0; j < index_heads; ++j) {
        T* out = c.dq.at<T>(item.b, row.row(), j);
        const double* dq_j = dq.data() + j * dim;
        for (std::int64_t d = 0; d < dim; ++d) out[d * c.dq.dim] = static_cast<T>(dq_j[d]);
        *c.dweights.at<T>(item.b, row.row(), j) = static_cast<T>(dweights[static_cast<std::size_t>(j)]);
      }
      if (want_dbias) std::copy(dbias.begin(), dbias.end(), dbias_parts.begin() + it * index_heads);
    }
  }
}

// dk of every key tile of every sequence: the rows that see the tile, in order, each adding its
// set's keys there.
template <class T>
void backward_keys(const AttentionParams& p, const IndexerLossConfig& c) {
  struct KeyTileItem {
    std::int64_t b, k0;
  };
  std::vector<KeyTileItem> tiles;
  for (std::int64_t b = 0; b < p.num_seqs; ++b) {
    // Earlier tiles are seen by more rows: listed first.
    for (std::int64_t k0 = 0; k0 < p.sequence(b).k_len; k0 += kKeyTile) tiles.push_back({b, k0});
  }
  const std::int64_t count = static_cast<std::int64_t>(tiles.size());
  const std::int64_t heads = c.attention.heads_q, index_heads = p.heads_q, dim = p.dim_qk;
#pragma omp parallel num_threads(thread_count(p))
  {
    LossRow<T> row(p, c);
    std::vector<T> logits(static_cast<std::size_t>(heads)), dots(static_cast<std::size_t>(index_heads));
    std::vector<double> dk(static_cast<std::size_t>(kKeyTile * dim));
#pragma omp for schedule(dynamic, 1)
    for (std::int64_t it = 0; it < count; ++it) {
      const KeyTileItem tile = tiles[static_cast<std::size_t>(it)];
      const SequenceExtent s = p.sequence(tile.b);
      const std::int64_t k1 = std::min(tile.k0 + kKeyTile, s.k_len);
      std::fill(dk.begin(), dk.end(), 0.0);
      const double scale = p.scale;
      // Rows before position k0 see none of the tile.
      for (std::int64_t r = std::max<std::int64_t>(0, tile.k0 - s.q_offset()); r < s.q_len; ++r) {
        const std::int64_t n = row.bind(tile.b, s, r);
        const std::int64_t first = row.first_slot_from(tile.k0, n), last = row.first_slot_from(k1, n);
        if (first == last) continue;
        row.load();
        const T g = *c.dloss.at<const T>(tile.b, row.row(), 0), lse_index = row.lse(heads);
        for (std::int64_t i = first; i < last; ++i) {
          const std::int64_t key = row.key(i);
          const double dscore = score_slope(row, key, g, lse_index, logits.data(), dots.data());
          double* dk_key = dk.data() + (key - tile.k0) * dim;
          for (std::int64_t j = 0; j < index_heads; ++j) {
            const double dz = dscore * math::gsa::term_slopes(c.form, row.gate(j), dots[j], row.bias(j)).dot;
            const T* iq = row.index_query(j);
            for (std::int64_t d = 0; d < dim; ++d) dk_key[d] += scale * dz * iq[d];
          }
        }
      }
      for (std::int64_t key = tile.k0; key < k1; ++key) {
        T* out = c.dk.at<T>(tile.b, s.k_start + key, 0);
        const double* dk_key = dk.data() + (key - tile.k0) * dim;
        for (std::int64_t d = 0; d < dim; ++d) out[d * c.dk.dim] = static_cast<T>(dk_key[d]);
      }
    }
  }
}

template <class T>
void backward(const AttentionParams& p, const IndexerLossConfig& c) {
  const std::vector<RowItem> items = query_rows(p);
  const bool want_dbias = c.dbias.data != nullptr;
  std::vector<double> dbias_parts(want_dbias ? items.size() * static_cast<std::size_t>(p.heads_q) : 0);
  backward_rows<T>(p, c, items, dbias_parts);
  backward_keys<T>(p, c);
  if (!want_dbias) return;
  // Summed in the items' order, whatever thread produced each part.
  std::vector<double> dbias(static_cast<std::size_t>(p.heads_q), 0.0);
  for (std::size_t it = 0; it < items.size(); ++it) {
    for (std::size_t j = 0; j < dbias.size(); ++j) dbias[j] += dbias_parts[it * dbias.size() + j];
  }
  T* out = static_cast<T*>(c.dbias.data);
  if (c.dbias.head == 0) {
    // One bias shared by every head: the sum of the heads' gradients.
    double sum = 0;
    for (double x : dbias) sum += x;
    *out = static_cast<T>(sum);
    return;
  }
  for (std::size_t j = 0; j < dbias.size(); ++j) {
    out[static_cast<std::int64_t>(j) * c.dbias.head] = static_cast<T>(dbias[j]);
  }
}

}  // namespace

void gsa_indexer_loss_forward(const detail::AttentionParams& p, const detail::IndexerLossConfig& c) {
  if (p.dtype == DType::float64) {
    forward<double>(p, c);
  } else {
    forward<float>(p, c);
  }
}

void gsa_indexer_loss_backward(const detail::AttentionParams& p, const detail::IndexerLossConfig& c) {
  if (p.dtype == DType::float64) {
    backward<double>(p, c);
  } else {
    backward<float>(p, c);
  }
}

}  // namespace winnow::cpu
