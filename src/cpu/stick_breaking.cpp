// Stick-breaking attention on the CPU (spec/stick-breaking.md, "Tiled algorithm").
//
// Forward, per query tile: visit key tiles from the diagonal leftwards carrying
// carry_j = -(softplus sum of the keys already visited). Inside a tile an in-place suffix scan
// over the key columns turns softplus(Z) into the inclusive suffix cost, and
// A = exp(Z - suffix + carry). After the tile, carry -= the row's tile cost.
//
// Backward visits the same tiles in the same order, so carry is recomputed bit for bit; with
// early halting it stops at the first key each row kept (the forward's kept_from). The prefix sum the gradient needs, sum_{i' <= i} g_i'j, is taken as
// G_j - sum_{i' > i} g_i'j with G_j = sum_i g_ij = <do_j, o_j>: the suffix part accumulates
// naturally in right-to-left order, and o_j is available in the working precision.
#include <algorithm>
#include <cmath>
#include <vector>

#include "cpu/cpu.h"
#include "cpu/tiles.h"
#include "math/elementwise.h"
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

// Zeroes the entries of a score-shaped tile for keys a row dropped by early halting (keys
// before the row's first kept key).
template <class M, class T>
void mask_dropped(const KeyRange& kr, const std::vector<std::int64_t>& kept_from, M& tile, T value) {
  for (std::int64_t r = 0; r < static_cast<std::int64_t>(kept_from.size()); ++r) {
    const std::int64_t dropped = std::min(kept_from[static_cast<std::size_t>(r)] - kr.i0, kr.size());
    for (std::int64_t c = 0; c < dropped; ++c) tile(r, c) = value;
  }
}

// Scores, costs and weights of key tile `kr` for the query tile, given the row carry.
// On return w holds A (zero where invisible) and cost.col(0) the rows' tile cost.
template <class T>
void weights(const AttentionParams& p, const QueryTile& qt, const SequenceExtent& s,
             const KeyRange& kr, const RowMatrix<T>& q_scaled, const RowVector<T>& carry,
             const std::vector<std::int64_t>& kept_from, SweepTiles<T>& t) {
  const std::int64_t hk = p.kv_head(qt.h);
  load_rows<T>(p.k, qt.b, s.k_start + kr.i0, kr.size(), hk, p.dim_qk, t.k);
  load_rows<T>(p.v, qt.b, s.k_start + kr.i0, kr.size(), hk, p.dim_v, t.v);
  t.z.noalias() = q_scaled * t.k.transpose();
  t.cost = sb::stick_cost(t.z.array());
  mask_invisible(qt, kr, t.cost, T(0));
  mask_dropped(kr, kept_from, t.cost, T(0));
  for (std::int64_t c = kr.size() - 2; c >= 0; --c) t.cost.col(c) += t.cost.col(c + 1);
  t.w.resize(qt.n, kr.size());
  for (std::int64_t c = 0; c < kr.size(); ++c) {
    t.w.col(c).array() = exp(sb::log_weight(t.z.col(c).array(), t.cost.col(c).array(), carry));
  }
  mask_invisible(qt, kr, t.w, T(0));
  mask_dropped(kr, kept_from, t.w, T(0));
}

template <class T>
bool halted(const detail::StickBreakingConfig& cfg, const RowVector<T>& carry) {
  return cfg.halt_cutoff > 0 && (carry < T(-cfg.halt_cutoff)).all();
}

template <class T>
void forward_impl(const AttentionParams& p, const detail::StickBreakingConfig& cfg) {
  for_each_query_tile(p, [&](const QueryTile& qt, const SequenceExtent& s) {
    thread_local SweepTiles<T> t;
    thread_local RowMatrix<T> q, o;
    thread_local RowVector<T> carry;
    static const std::vector<std::int64_t> keep_all;
    load_rows<T>(p.q, qt.b, s.q_start + qt.r0, qt.n, qt.h, p.dim_qk, q, T(p.scale));
    o.setZero(qt.n, p.dim_v);
    carry.setZero(qt.n);
    std::int64_t kept_from = 0;
    for (std::int64_t kt = qt.last_key_tile(); kt >= 0; --kt) {
      const KeyRange kr = key_range(qt, kt);
      weights(p, qt, s, kr, q, carry, keep_all, t);
      o.noalias() += t.w * t.v;
      carry -= t.cost.col(0).array();
      if (halted(cfg, carry)) {
        kept_from = kr.i0;
        break;
      }
    }
    store_rows<T>(o, p.out, qt.b, s.q_start + qt.r0, qt.h);
    store_row_stat<T>(carry, p.stats, qt.b, s.q_start + qt.r0, qt.h);
    if (cfg.kept_from.data != nullptr) {
      for (std::int64_t r = 0; r < qt.n; ++r) {
        *cfg.kept_from.at<std::int32_t>(qt.b, s.q_start + qt.r0 + r, qt.h) =
            static_cast<std::int32_t>(kept_from);
      }
    }
  });
}

// The backward visits the forward's tiles in the forward's order, masking each row's keys
// before the first key it kept (kept_from, when halting was on).
template <class T>
void backward_impl(const AttentionParams& p, const GradientParams& g,
                   const detail::StickBreakingConfig& cfg) {
  const bool halting = cfg.halt_cutoff > 0 && cfg.kept_from.data != nullptr;
  run_backward<T>(p, g, [&](const QueryTile& qt, const SequenceExtent& s, KeyValueGrads<T>& kv) {
    thread_local SweepTiles<T> t;
    thread_local RowMatrix<T> q, o, dout, dq;
    thread_local ScoreTile<T> dw, dz;
    thread_local RowVector<T> carry, total_g, suffix_g, dlog_rem;
    thread_local std::vector<std::int64_t> kept_from;
    const std::int64_t row0 = s.q_start + qt.r0;
    load_rows<T>(p.q, qt.b, row0, qt.n, qt.h, p.dim_qk, q, T(p.scale));
    load_rows<T>(p.out, qt.b, row0, qt.n, qt.h, p.dim_v, o);
    load_rows<T>(g.dout, qt.b, row0, qt.n, qt.h, p.dim_v, dout);
    if (g.dstats.data != nullptr) {
      load_row_stat<T>(g.dstats, qt.b, row0, qt.n, qt.h, dlog_rem);
    } else {
      dlog_rem.setZero(qt.n);
    }
    kept_from.assign(halting ? static_cast<std::size_t>(qt.n) : 0, 0);
    std::int64_t first_tile = 0;
    if (halting) {
      std::int64_t first_key = qt.last_limit + 1;
      for (std::int64_t r = 0; r < qt.n; ++r) {
        kept_from[static_cast<std::size_t>(r)] = *cfg.kept_from.at<const std::int32_t>(qt.b, row0 + r, qt.h);
        first_key = std::min(first_key, kept_from[static_cast<std::size_t>(r)]);
      }
      first_tile = first_key / kKeyTile;
    }
    total_g = (dout.array() * o.array()).rowwise().sum();
    carry.setZero(qt.n);
    suffix_g.setZero(qt.n);
    dq.setZero(qt.n, p.dim_qk);
    for (std::int64_t kt = qt.last_key_tile(); kt >= first_tile; --kt) {
      const KeyRange kr = key_range(qt, kt);
      weights(p, qt, s, kr, q, carry, kept_from, t);
      dw.noalias() = dout * t.v.transpose();
      dz.resize(qt.n, kr.size());
      for (std::int64_t c = kr.size() - 1; c >= 0; --c) {
        const auto gc = t.w.col(c).array() * dw.col(c).array();
        dz.col(c).array() =
            sb::grad_logit(gc, t.z.col(c).array(), total_g - suffix_g + dlog_rem);
        suffix_g += gc;
      }
      mask_invisible(qt, kr, dz, T(0));
      mask_dropped(kr, kept_from, dz, T(0));
      dq.noalias() += dz * t.k;
      kv.dk.middleRows(kr.i0, kr.size()).noalias() += dz.transpose() * q;
      kv.dv.middleRows(kr.i0, kr.size()).noalias() += t.w.transpose() * dout;
      carry -= t.cost.col(0).array();
    }
    store_rows<T>(dq, g.dq, qt.b, row0, qt.h, T(p.scale));
  });
}

}  // namespace

void stick_breaking_forward(const AttentionParams& p, const detail::StickBreakingConfig& cfg) {
  if (p.dtype == DType::float64) return forward_impl<double>(p, cfg);
  forward_impl<float>(p, cfg);
}

void stick_breaking_backward(const AttentionParams& p, const GradientParams& g,
                             const detail::StickBreakingConfig& cfg) {
  if (p.dtype == DType::float64) return backward_impl<double>(p, g, cfg);
  backward_impl<float>(p, g, cfg);
}

}  // namespace winnow::cpu
