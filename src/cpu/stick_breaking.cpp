// Stick-breaking attention on the CPU (spec/stick-breaking.md, "Tiled algorithm"), and Sieve
// (spec/sieve.md), which is stick-breaking over each row's candidate keys: one kernel with a
// per-row admission threshold (-inf for stick-breaking).
//
// Forward, per query tile: visit key tiles from the diagonal leftwards carrying
// carry_j = -(softplus sum of the admitted keys already visited). Inside a tile an in-place
// suffix scan over the key columns turns softplus(Z) into the inclusive suffix cost, and
// A = exp(Z - suffix + carry). After the tile, carry -= the row's tile cost.
//
// Backward, per query tile, two sweeps. Right to left it recomputes the costs only, bit for
// bit as the forward did (with early halting it stops at the first key each row kept, the
// forward's kept_from), and keeps the carry at each key tile. Left to right it then forms the
// weights from those carries and sums g_ij = A_ij dA_ij in the order the gradient needs,
//   dz_ij = g_ij - sigmoid(z_ij) (sum_{i' <= i} g_i'j + dlog_rem_j),
// directly: a prefix taken as a difference of two large sums (all of g minus the suffix) loses
// the small prefixes left of a dominant key to cancellation.
#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "cpu/cpu.h"
#include "cpu/score_block.h"
#include "cpu/tiles.h"
#include "math/elementwise.h"
#include "math/entmax.h"
#include "math/stick_breaking.h"

namespace winnow::cpu {
namespace {

namespace sb = math::stick_breaking;

// Per-thread scratch of one query tile's sweep.
template <class T>
struct SweepTiles {
  RowMatrix<T> k, v;
  ScoreTile<T> z, w;
  CostTile<T> cost;
};

// Which keys a row's stick is broken over, beyond visibility: those at or right of the row's
// first kept key (early halting), and with a score above the row's admission threshold (Sieve).
template <class T>
struct KeyFilter {
  std::vector<std::int64_t> kept_from;  // empty: every key kept
  const RowVector<T>* threshold = nullptr;  // null: every key admitted

  template <class M>
  void apply(const KeyRange& kr, const ScoreTile<T>& z, M& tile) const {
    for (std::int64_t r = 0; r < static_cast<std::int64_t>(kept_from.size()); ++r) {
      const std::int64_t dropped = std::min(kept_from[static_cast<std::size_t>(r)] - kr.i0, kr.size());
      for (std::int64_t c = 0; c < dropped; ++c) tile(r, c) = T(0);
    }
    if (threshold == nullptr) return;
    for (std::int64_t c = 0; c < kr.size(); ++c) {
      for (std::int64_t r = 0; r < z.rows(); ++r) {
        if (!math::sieve::admitted(z(r, c), (*threshold)[r])) tile(r, c) = T(0);
      }
    }
  }
};

// Scores and costs of key tile `kr`: on return cost holds the in-tile inclusive suffix sums of
// the admitted keys' costs, so cost.col(0) is the rows' tile cost.
template <class T>
void costs(const AttentionParams& p, const QueryTile& qt, const SequenceExtent& s,
           const KeyRange& kr, const RowMatrix<T>& q_scaled, const KeyFilter<T>& filter,
           SweepTiles<T>& t) {
  load_rows<T>(p.k, qt.b, s.k_start + kr.i0, kr.size(), p.kv_head(qt.h), p.dim_qk, t.k);
  t.z.noalias() = q_scaled * t.k.transpose();
  t.cost = sb::stick_cost(t.z.array());
  mask_invisible(qt, kr, t.cost, T(0));
  filter.apply(kr, t.z, t.cost);
  for (std::int64_t c = kr.size() - 2; c >= 0; --c) t.cost.col(c) += t.cost.col(c + 1);
}

// costs(), then the weights A given the row carry (zero where invisible or filtered out), and
// the value tile.
template <class T>
void weights(const AttentionParams& p, const QueryTile& qt, const SequenceExtent& s,
             const KeyRange& kr, const RowMatrix<T>& q_scaled, const RowVector<T>& carry,
             const KeyFilter<T>& filter, SweepTiles<T>& t) {
  costs(p, qt, s, kr, q_scaled, filter, t);
  load_rows<T>(p.v, qt.b, s.k_start + kr.i0, kr.size(), p.kv_head(qt.h), p.dim_v, t.v);
  t.w.resize(qt.n, kr.size());
  for (std::int64_t c = 0; c < kr.size(); ++c) {
    t.w.col(c).array() = exp(sb::log_weight(t.z.col(c).array(), t.cost.col(c).array(), carry));
  }
  mask_invisible(qt, kr, t.w, T(0));
  filter.apply(kr, t.z, t.w);
}

template <class T>
bool halted(double halt_cutoff, const RowVector<T>& carry) {
  return halt_cutoff > 0 && (carry < T(-halt_cutoff)).all();
}

// Sieve's admission thresholds of a query tile (score units) and the rows' candidate counts.
template <class T>
void sieve_thresholds(const AttentionParams& p, const detail::SieveConfig& cfg, const QueryTile& qt,
                      const SequenceExtent& s, const RowMatrix<T>& q_scaled, RowVector<T>& threshold,
                      std::vector<std::int32_t>& count) {
  thread_local RowMatrix<T> k;
  thread_local ScoreTile<T> z;
  score_block(p, qt, s, q_scaled, k, z);
  threshold.setZero(qt.n);
  if (z.cols() > 0) {
    if (cfg.bound) {
      threshold = z.rowwise().maxCoeff().array() - T(cfg.eps);
    } else {
      entmax_thresholds(qt, z, cfg.alpha, cfg.tolerance, threshold);
      threshold /= T(cfg.alpha - 1);
    }
  }
  count.assign(static_cast<std::size_t>(qt.n), 0);
  for (std::int64_t c = 0; c < z.cols(); ++c) {
    for (std::int64_t r = 0; r < qt.n; ++r) {
      count[static_cast<std::size_t>(r)] += math::sieve::admitted(z(r, c), threshold[r]) ? 1 : 0;
    }
  }
  // A row that sees no key has no threshold to speak of.
  for (std::int64_t r = 0; r < qt.n; ++r) {
    if (qt.first_limit + r < 0 || z.cols() == 0) threshold[r] = T(0);
  }
}

template <class T>
void forward_impl(const AttentionParams& p, double halt_cutoff, const detail::Operand& kept_from_out,
                  const detail::SieveConfig* sieve) {
  for_each_query_tile(p, [&](const QueryTile& qt, const SequenceExtent& s) {
    thread_local SweepTiles<T> t;
    thread_local RowMatrix<T> q, o;
    thread_local RowVector<T> carry, threshold;
    thread_local std::vector<std::int32_t> count;
    const std::int64_t row0 = s.q_start + qt.r0;
    load_rows<T>(p.q, qt.b, row0, qt.n, qt.h, p.dim_qk, q, T(p.scale));
    KeyFilter<T> filter;
    if (sieve != nullptr) {
      sieve_thresholds(p, *sieve, qt, s, q, threshold, count);
      filter.threshold = &threshold;
      store_row_stat<T>(threshold, sieve->threshold, qt.b, row0, qt.h);
      if (sieve->count.data != nullptr) {
        for (std::int64_t r = 0; r < qt.n; ++r) {
          *sieve->count.at<std::int32_t>(qt.b, row0 + r, qt.h) = count[static_cast<std::size_t>(r)];
        }
      }
    }
    o.setZero(qt.n, p.dim_v);
    carry.setZero(qt.n);
    std::int64_t kept_from = 0;
    for (std::int64_t kt = qt.last_key_tile(); kt >= 0; --kt) {
      const KeyRange kr = key_range(qt, kt);
      weights(p, qt, s, kr, q, carry, filter, t);
      o.noalias() += t.w * t.v;
      carry -= t.cost.col(0).array();
      if (halted(halt_cutoff, carry)) {
        kept_from = kr.i0;
        break;
      }
    }
    store_rows<T>(o, p.out, qt.b, row0, qt.h);
    store_row_stat<T>(carry, p.stats, qt.b, row0, qt.h);
    if (kept_from_out.data != nullptr) {
      for (std::int64_t r = 0; r < qt.n; ++r) {
        *kept_from_out.at<std::int32_t>(qt.b, row0 + r, qt.h) = static_cast<std::int32_t>(kept_from);
      }
    }
  });
}

template <class T>
void backward_impl(const AttentionParams& p, const GradientParams& g, double halt_cutoff,
                   const detail::Operand& kept_from_in, const detail::SieveConfig* sieve) {
  const bool halting = halt_cutoff > 0 && kept_from_in.data != nullptr;
  run_backward<T>(p, g, [&](const QueryTile& qt, const SequenceExtent& s, KeyValueGrads<T>& kv) {
    thread_local SweepTiles<T> t;
    thread_local RowMatrix<T> q, dout, dq;
    thread_local ScoreTile<T> dw, dz;
    thread_local RowVector<T> carry, prefix_g, dlog_rem, threshold;
    thread_local std::vector<RowVector<T>> carry_at;  // carry before each key tile
    thread_local KeyFilter<T> filter;
    const std::int64_t row0 = s.q_start + qt.r0;
    load_rows<T>(p.q, qt.b, row0, qt.n, qt.h, p.dim_qk, q, T(p.scale));
    load_rows<T>(g.dout, qt.b, row0, qt.n, qt.h, p.dim_v, dout);
    if (g.dstats.data != nullptr) {
      load_row_stat<T>(g.dstats, qt.b, row0, qt.n, qt.h, dlog_rem);
    } else {
      dlog_rem.setZero(qt.n);
    }
    filter.kept_from.assign(halting ? static_cast<std::size_t>(qt.n) : 0, 0);
    filter.threshold = nullptr;
    if (sieve != nullptr) {
      load_row_stat<T>(sieve->threshold, qt.b, row0, qt.n, qt.h, threshold);
      filter.threshold = &threshold;
    }
    std::int64_t first_tile = 0;
    if (halting) {
      std::int64_t first_key = qt.last_limit + 1;
      for (std::int64_t r = 0; r < qt.n; ++r) {
        const std::int64_t k0 = *kept_from_in.at<const std::int32_t>(qt.b, row0 + r, qt.h);
        filter.kept_from[static_cast<std::size_t>(r)] = k0;
        first_key = std::min(first_key, k0);
      }
      first_tile = first_key / kKeyTile;
    }
    const std::int64_t last_tile = qt.last_key_tile();
    if (last_tile < 0) {
      dq.setZero(qt.n, p.dim_qk);
      store_rows<T>(dq, g.dq, qt.b, row0, qt.h);
      return;
    }
    carry_at.resize(static_cast<std::size_t>(last_tile + 1));
    carry.setZero(qt.n);
    for (std::int64_t kt = last_tile; kt >= first_tile; --kt) {
      costs(p, qt, s, key_range(qt, kt), q, filter, t);
      carry_at[static_cast<std::size_t>(kt)] = carry;
      carry -= t.cost.col(0).array();
    }
    prefix_g.setZero(qt.n);
    dq.setZero(qt.n, p.dim_qk);
    for (std::int64_t kt = first_tile; kt <= last_tile; ++kt) {
      const KeyRange kr = key_range(qt, kt);
      weights(p, qt, s, kr, q, carry_at[static_cast<std::size_t>(kt)], filter, t);
      dw.noalias() = dout * t.v.transpose();
      dz.resize(qt.n, kr.size());
      for (std::int64_t c = 0; c < kr.size(); ++c) {
        const auto gc = t.w.col(c).array() * dw.col(c).array();
        prefix_g += gc;
        dz.col(c).array() = sb::grad_logit(gc, t.z.col(c).array(), prefix_g + dlog_rem);
      }
      mask_invisible(qt, kr, dz, T(0));
      filter.apply(kr, t.z, dz);
      dq.noalias() += dz * t.k;
      kv.dk.middleRows(kr.i0, kr.size()).noalias() += dz.transpose() * q;
      kv.dv.middleRows(kr.i0, kr.size()).noalias() += t.w.transpose() * dout;
    }
    store_rows<T>(dq, g.dq, qt.b, row0, qt.h, T(p.scale));
  });
}

}  // namespace

void stick_breaking_forward(const AttentionParams& p, const detail::StickBreakingConfig& cfg) {
  if (p.dtype == DType::float64) return forward_impl<double>(p, cfg.halt_cutoff, cfg.kept_from, nullptr);
  forward_impl<float>(p, cfg.halt_cutoff, cfg.kept_from, nullptr);
}

void stick_breaking_backward(const AttentionParams& p, const GradientParams& g,
                             const detail::StickBreakingConfig& cfg) {
  if (p.dtype == DType::float64) return backward_impl<double>(p, g, cfg.halt_cutoff, cfg.kept_from, nullptr);
  backward_impl<float>(p, g, cfg.halt_cutoff, cfg.kept_from, nullptr);
}

void sieve_forward(const AttentionParams& p, const detail::SieveConfig& cfg) {
  if (p.dtype == DType::float64) return forward_impl<double>(p, 0.0, {}, &cfg);
  forward_impl<float>(p, 0.0, {}, &cfg);
}

void sieve_backward(const AttentionParams& p, const GradientParams& g, const detail::SieveConfig& cfg) {
  if (p.dtype == DType::float64) return backward_impl<double>(p, g, 0.0, {}, &cfg);
  backward_impl<float>(p, g, 0.0, {}, &cfg);
}

}  // namespace winnow::cpu
