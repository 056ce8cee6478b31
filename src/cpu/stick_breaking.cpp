// Stick-breaking attention on the CPU (spec/stick-breaking.md, "Tiled algorithm").
//
// Forward, per query tile: visit key tiles from the diagonal leftwards carrying
// carry_j = -(softplus sum of the keys already visited). Inside a tile an in-place suffix scan
// over the key columns turns softplus(Z) into the inclusive suffix cost, and
// A = exp(Z - suffix + carry). After the tile, carry -= the row's tile cost.
//
// Backward visits the same tiles in the same order, so carry (and any halting decision) is
// recomputed bit for bit. The prefix sum the gradient needs, sum_{i' <= i} g_i'j, is taken as
// G_j - sum_{i' > i} g_i'j with G_j = sum_i g_ij = <do_j, o_j>: the suffix part accumulates
// naturally in right-to-left order, and o_j is available in the working precision.
#include <cmath>

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

// Scores, costs and weights of key tile `kr` for the query tile, given the row carry.
// On return w holds A (zero where invisible) and cost.col(0) the rows' tile cost.
template <class T>
void weights(const AttentionParams& p, const QueryTile& qt, const SequenceExtent& s,
             const KeyRange& kr, const RowMatrix<T>& q_scaled, const RowVector<T>& carry,
             SweepTiles<T>& t) {
  const std::int64_t hk = p.kv_head(qt.h);
  load_rows<T>(p.k, qt.b, s.k_start + kr.i0, kr.size(), hk, p.dim_qk, t.k);
  load_rows<T>(p.v, qt.b, s.k_start + kr.i0, kr.size(), hk, p.dim_v, t.v);
  t.z.noalias() = q_scaled * t.k.transpose();
  t.cost = sb::stick_cost(t.z.array());
  mask_invisible(qt, kr, t.cost, T(0));
  for (std::int64_t c = kr.size() - 2; c >= 0; --c) t.cost.col(c) += t.cost.col(c + 1);
  t.w.resize(qt.n, kr.size());
  for (std::int64_t c = 0; c < kr.size(); ++c) {
    t.w.col(c).array() = exp(sb::log_weight(t.z.col(c).array(), t.cost.col(c).array(), carry));
  }
  mask_invisible(qt, kr, t.w, T(0));
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
    load_rows<T>(p.q, qt.b, s.q_start + qt.r0, qt.n, qt.h, p.dim_qk, q, T(p.scale));
    o.setZero(qt.n, p.dim_v);
    carry.setZero(qt.n);
    for (std::int64_t kt = qt.last_key_tile(); kt >= 0; --kt) {
      const KeyRange kr = key_range(qt, kt);
      weights(p, qt, s, kr, q, carry, t);
      o.noalias() += t.w * t.v;
      carry -= t.cost.col(0).array();
      if (halted(cfg, carry)) break;
    }
    store_rows<T>(o, p.out, qt.b, s.q_start + qt.r0, qt.h);
    store_row_stat<T>(carry, p.stats, qt.b, s.q_start + qt.r0, qt.h);
  });
}

template <class T>
void backward_impl(const AttentionParams& p, const GradientParams& g,
                   const detail::StickBreakingConfig& cfg) {
  run_backward<T>(p, g, [&](const QueryTile& qt, const SequenceExtent& s, KeyValueGrads<T>& kv) {
    thread_local SweepTiles<T> t;
    thread_local RowMatrix<T> q, o, dout, dq;
    thread_local ScoreTile<T> dw, dz;
    thread_local RowVector<T> carry, total_g, suffix_g, dlog_rem;
    const std::int64_t row0 = s.q_start + qt.r0;
    load_rows<T>(p.q, qt.b, row0, qt.n, qt.h, p.dim_qk, q, T(p.scale));
    load_rows<T>(p.out, qt.b, row0, qt.n, qt.h, p.dim_v, o);
    load_rows<T>(g.dout, qt.b, row0, qt.n, qt.h, p.dim_v, dout);
    if (g.dstats.data != nullptr) {
      load_row_stat<T>(g.dstats, qt.b, row0, qt.n, qt.h, dlog_rem);
    } else {
      dlog_rem.setZero(qt.n);
    }
    total_g = (dout.array() * o.array()).rowwise().sum();
    carry.setZero(qt.n);
    suffix_g.setZero(qt.n);
    dq.setZero(qt.n, p.dim_qk);
    for (std::int64_t kt = qt.last_key_tile(); kt >= 0; --kt) {
      const KeyRange kr = key_range(qt, kt);
      weights(p, qt, s, kr, q, carry, t);
      dw.noalias() = dout * t.v.transpose();
      dz.resize(qt.n, kr.size());
      for (std::int64_t c = kr.size() - 1; c >= 0; --c) {
        const auto gc = t.w.col(c).array() * dw.col(c).array();
        dz.col(c).array() =
            sb::grad_logit(gc, t.z.col(c).array(), total_g - suffix_g + dlog_rem);
        suffix_g += gc;
      }
      mask_invisible(qt, kr, dz, T(0));
      dq.noalias() += dz * t.k;
      kv.dk.middleRows(kr.i0, kr.size()).noalias() += dz.transpose() * q;
      kv.dv.middleRows(kr.i0, kr.size()).noalias() += t.w.transpose() * dout;
      carry -= t.cost.col(0).array();
      if (halted(cfg, carry)) break;
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
