// The vocabulary the CPU kernels are written in: Eigen tiles packed from strided operands, the
// causal geometry of a (query tile, key tile) pair, and the two parallel drivers (forward over
// independent query tiles; backward over key/value heads with private dk/dv accumulators).
// Kernels state only what one query tile does.
#pragma once

#include <Eigen/Core>
#include <algorithm>
#include <cstdint>
#include <utility>
#include <vector>

#include "core/params.h"
#include "cpu/tile_sizes.h"

namespace winnow::cpu {

using detail::AttentionParams;
using detail::GradientParams;
using detail::Operand;
using detail::SequenceExtent;

template <class T>
using RowMatrix = Eigen::Matrix<T, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
// Score tiles are column-major so one key's scores over the tile's rows are contiguous: the
// in-tile scans along keys then run vectorized across rows.
template <class T>
using ScoreTile = Eigen::Matrix<T, Eigen::Dynamic, Eigen::Dynamic, Eigen::ColMajor>;
template <class T>
using CostTile = Eigen::Array<T, Eigen::Dynamic, Eigen::Dynamic, Eigen::ColMajor>;
template <class T>
using RowVector = Eigen::Array<T, Eigen::Dynamic, 1>;  // one value per query row

// rows [start, start + n) of head h of sequence b, times `scale`, into dst (n x cols).
template <class T>
void load_rows(const Operand& op, std::int64_t b, std::int64_t start, std::int64_t n,
               std::int64_t h, std::int64_t cols, RowMatrix<T>& dst, T scale = T(1)) {
  dst.resize(n, cols);
  for (std::int64_t r = 0; r < n; ++r) {
    const T* src = op.at<const T>(b, start + r, h);
    T* out = dst.row(r).data();
    if (op.dim == 1) {
      for (std::int64_t c = 0; c < cols; ++c) out[c] = scale * src[c];
    } else {
      for (std::int64_t c = 0; c < cols; ++c) out[c] = scale * src[c * op.dim];
    }
  }
}

template <class T, class M>
void store_rows(const M& src, const Operand& op, std::int64_t b, std::int64_t start,
                std::int64_t h, T scale = T(1)) {
  for (std::int64_t r = 0; r < src.rows(); ++r) {
    T* dst = op.at<T>(b, start + r, h);
    for (std::int64_t c = 0; c < src.cols(); ++c) dst[c * op.dim] = scale * src(r, c);
  }
}

template <class T>
void load_row_stat(const Operand& op, std::int64_t b, std::int64_t start, std::int64_t n,
                   std::int64_t h, RowVector<T>& dst) {
  dst.resize(n);
  for (std::int64_t r = 0; r < n; ++r) dst[r] = *op.at<const T>(b, start + r, h);
}

template <class T>
void store_row_stat(const RowVector<T>& src, const Operand& op, std::int64_t b, std::int64_t start,
                    std::int64_t h) {
  for (std::int64_t r = 0; r < src.size(); ++r) *op.at<T>(b, start + r, h) = src[r];
}

// The causal geometry of one query tile: rows [r0, r0 + n) of a sequence. Row r sees keys
// 0 .. limit(r); limits grow by one per row.
struct QueryTile {
  std::int64_t b = 0, h = 0, r0 = 0, n = 0;
  std::int64_t first_limit = -1;  // limit of row r0
  std::int64_t last_limit = -1;   // limit of row r0 + n - 1

  QueryTile(const AttentionParams& p, const SequenceExtent& s, std::int64_t b_, std::int64_t h_,
            std::int64_t r0_)
      : b(b_), h(h_), r0(r0_), n(std::min(kQueryTile, s.q_len - r0_)) {
    first_limit = std::min(p.last_visible_key(r0 + s.q_offset()), s.k_len - 1);
    last_limit = std::min(p.last_visible_key(r0 + n - 1 + s.q_offset()), s.k_len - 1);
  }
  // Key tiles 0 .. last_key_tile() hold every visible key (-1: the tile sees no key at all).
  std::int64_t last_key_tile() const { return last_limit < 0 ? -1 : last_limit / kKeyTile; }
  // First row of the tile that sees key i: rows before it must be masked for that key.
  std::int64_t first_row_seeing(std::int64_t i) const {
    return std::clamp<std::int64_t>(i - first_limit, 0, n);
  }
  // Whether any row of the tile misses a key of [i0, i1): only then is masking needed.
  bool needs_mask(std::int64_t i1) const { return i1 - 1 > first_limit; }
};

// The key range [i0, i1) of key tile t, cut at the last key the query tile can see.
struct KeyRange {
  std::int64_t i0, i1;
  std::int64_t size() const { return i1 - i0; }
};
inline KeyRange key_range(const QueryTile& qt, std::int64_t t) {
  return {t * kKeyTile, std::min((t + 1) * kKeyTile, qt.last_limit + 1)};
}

// Sets entries of columns [0, nk) of a score-shaped tile to `value` where the row does not
// see the key.
template <class M, class T>
void mask_invisible(const QueryTile& qt, const KeyRange& kr, M& tile, T value) {
  if (!qt.needs_mask(kr.i1)) return;
  for (std::int64_t c = 0; c < kr.size(); ++c) {
    const std::int64_t rows = qt.first_row_seeing(kr.i0 + c);
    if (rows > 0) tile.col(c).head(rows).setConstant(value);
  }
}

int thread_count(const AttentionParams& p);

// Runs fn(QueryTile) for every (sequence, query head, query tile) in parallel.
template <class Fn>
void for_each_query_tile(const AttentionParams& p, Fn&& fn) {
  struct Item {
    std::int64_t b, h, r0;
  };
  std::vector<Item> items;
  for (std::int64_t b = 0; b < p.num_seqs; ++b) {
    const SequenceExtent s = p.sequence(b);
    // Later tiles see more keys: listing them first balances the dynamic schedule.
    for (std::int64_t r0 = (s.q_len - 1) / kQueryTile * kQueryTile; r0 >= 0 && s.q_len > 0;
         r0 -= kQueryTile) {
      for (std::int64_t h = 0; h < p.heads_q; ++h) items.push_back({b, h, r0});
    }
  }
  const std::int64_t count = static_cast<std::int64_t>(items.size());
#pragma omp parallel for schedule(dynamic, 1) num_threads(thread_count(p))
  for (std::int64_t it = 0; it < count; ++it) {
    const Item& item = items[static_cast<std::size_t>(it)];
    const SequenceExtent s = p.sequence(item.b);
    fn(QueryTile(p, s, item.b, item.h, item.r0), s);
  }
}

// dk and dv of one key/value head of one sequence, accumulated by one backward work item.
template <class T>
struct KeyValueGrads {
  RowMatrix<T> dk, dv;  // k_len x D, k_len x Dv
  RowMatrix<T> dk2;     // a second key view's (TDA), k_len x D; empty unless asked for
};

// Backward driver. Work items are (sequence, kv head, split); an item runs
// fn(QueryTile, SequenceExtent, KeyValueGrads&) for every query head of its group and every
// query tile of its split, accumulating dk/dv privately. Splits exist only when there are
// fewer (sequence, kv head) pairs than threads; their partial sums are added in split order,
// so results are deterministic for a given thread count. dq is the kernels' to write. With dk2
// (a second key view's gradient operand) the items also accumulate KeyValueGrads::dk2.
template <class T, class Fn>
void run_backward(const AttentionParams& p, const GradientParams& g, const Operand* dk2, Fn&& fn) {
  const int threads = thread_count(p);
  const std::int64_t pairs = p.num_seqs * p.heads_kv;
  const std::int64_t max_tiles = (p.max_len_q + kQueryTile - 1) / kQueryTile;
  const std::int64_t splits =
      pairs == 0 ? 1
                 : std::clamp<std::int64_t>((threads + pairs - 1) / pairs, 1,
                                            std::max<std::int64_t>(max_tiles, 1));
  std::vector<KeyValueGrads<T>> partial(static_cast<std::size_t>(pairs * splits));
  const std::int64_t items = pairs * splits;

#pragma omp parallel for schedule(dynamic, 1) num_threads(threads)
  for (std::int64_t it = 0; it < items; ++it) {
    const std::int64_t pair = it / splits, split = it % splits;
    const std::int64_t b = pair / p.heads_kv, hk = pair % p.heads_kv;
    const SequenceExtent s = p.sequence(b);
    KeyValueGrads<T>& acc = partial[static_cast<std::size_t>(it)];
    acc.dk.setZero(s.k_len, p.dim_qk);
    acc.dv.setZero(s.k_len, p.dim_v);
    if (dk2 != nullptr) acc.dk2.setZero(s.k_len, p.dim_qk);
    const std::int64_t tiles = (s.q_len + kQueryTile - 1) / kQueryTile;
    for (std::int64_t h = hk * p.group_size(); h < (hk + 1) * p.group_size(); ++h) {
      for (std::int64_t t = tiles - 1 - split; t >= 0; t -= splits) {
        fn(QueryTile(p, s, b, h, t * kQueryTile), s, acc);
      }
    }
  }

#pragma omp parallel for schedule(dynamic, 1) num_threads(threads)
  for (std::int64_t pair = 0; pair < pairs; ++pair) {
    const std::int64_t b = pair / p.heads_kv, hk = pair % p.heads_kv;
    const SequenceExtent s = p.sequence(b);
    KeyValueGrads<T>& total = partial[static_cast<std::size_t>(pair * splits)];
    for (std::int64_t split = 1; split < splits; ++split) {
      KeyValueGrads<T>& part = partial[static_cast<std::size_t>(pair * splits + split)];
      total.dk += part.dk;
      total.dv += part.dv;
      if (dk2 != nullptr) total.dk2 += part.dk2;
      part = KeyValueGrads<T>{};
    }
    store_rows<T>(total.dk, g.dk, b, s.k_start, hk);
    store_rows<T>(total.dv, g.dv, b, s.k_start, hk);
    if (dk2 != nullptr) store_rows<T>(total.dk2, *dk2, b, s.k_start, hk);
    total = KeyValueGrads<T>{};
  }
}

template <class T, class Fn>
void run_backward(const AttentionParams& p, const GradientParams& g, Fn&& fn) {
  run_backward<T>(p, g, static_cast<const Operand*>(nullptr), std::forward<Fn>(fn));
}

}  // namespace winnow::cpu
