// Multiscreen's screening on the CPU, streaming over key tiles: queries, keys and values are
// normalized as they are loaded and queries and keys rotated by MiPE; a query tile visits only
// the key tiles that meet its rows' windows, so a head costs O(L min(L, w)). A tile in which no
// pair clears the Trim skips the value product (forward and backward). The backward reads the
// saved output and |h| for TanhNorm's Jacobian and recomputes R; each key's gradient goes back
// through MiPE and its normalization as it is accumulated (both linear per key row).
#include <algorithm>
#include <cmath>
#include <vector>

#include "cpu/cpu.h"
#include "cpu/tiles.h"
#include "cpu/unit_rows.h"
#include "math/screening.h"

namespace winnow::cpu {
namespace {

namespace ms = math::screening;
using detail::ScreeningConfig;

// A head's constants from its scalars (stored as T, the statistics' dtype), in double: angles
// are formed from positions that reach 10^5 and more.
template <class T>
ms::Head<double> head_of(const ScreeningConfig& cfg, std::int64_t h) {
  return {static_cast<double>(cfg.s_w_at<T>(h)), static_cast<double>(cfg.s_r_at<T>(h)), cfg.mipe_threshold,
          cfg.expand_above};
}

// Rotates coordinates 0 and 1 of every row r of x by (first_position + r) * rate * sign.
template <class T>
void rotate_rows(RowMatrix<T>& x, std::int64_t first_position, double rate, double sign) {
  if (rate == 0) return;
  for (std::int64_t r = 0; r < x.rows(); ++r) {
    const double angle = sign * static_cast<double>(first_position + r) * rate;
    const T c = static_cast<T>(std::cos(angle)), s = static_cast<T>(std::sin(angle));
    const T x0 = x(r, 0), x1 = x(r, 1);
    x(r, 0) = x0 * c - x1 * s;
    x(r, 1) = x0 * s + x1 * c;
  }
}

// The key tiles a query tile visits: those holding keys from its first row's window start to
// its last row's causal limit.
struct WindowTiles {
  std::int64_t first_key, first_tile, last_tile;
};
WindowTiles window_tiles(const QueryTile& qt, std::int64_t first_position, const ms::Head<double>& hd) {
  WindowTiles t;
  t.first_key = ms::first_key(first_position, hd.w, hd.infinite);
  t.first_tile = t.first_key / kKeyTile;
  t.last_tile = qt.last_key_tile();
  return t;
}

// R (relevance) of one (query tile, key range) from the scores; returns whether any is nonzero.
// Entries past a row's causal limit or outside its window are exact zeros.
template <class T>
bool relevance(const ScoreTile<T>& s, std::int64_t first_position, std::int64_t key0,
               const ms::Head<double>& hd, ScoreTile<T>& r_tile) {
  const T w = static_cast<T>(hd.w), r = static_cast<T>(hd.r);
  r_tile.resize(s.rows(), s.cols());
  bool any = false;
  for (std::int64_t c = 0; c < s.cols(); ++c) {
    for (std::int64_t row = 0; row < s.rows(); ++row) {
      const std::int64_t d = key0 + c - (first_position + row);
      const T x = d > 0 ? T(0) : ms::trim(s(row, c), r) * ms::softmask(T(d), w, hd.infinite);
      r_tile(row, c) = x;
      any = any || x != T(0);
    }
  }
  return any;
}

// One query tile's sweep over its windows: its rows normalized and rotated by MiPE, then each
// key range its windows reach, with the keys loaded (k.hat), rotated (km) and scored, and R in
// rel. Forward and backward share it; buffers are reused across work items.
template <class T>
struct WindowSweep {
  UnitRows<T> q, k;
  RowMatrix<T> qm, km;
  ScoreTile<T> scores, rel;

  void load_queries(const AttentionParams& p, const QueryTile& qt, const SequenceExtent& s,
                    std::int64_t position0, const ms::Head<double>& hd, T eps) {
    q.load(p.q, qt.b, s.q_start + qt.r0, qt.n, qt.h, p.dim_qk, eps);
    qm = q.hat;
    rotate_rows(qm, position0, hd.rate, 1.0);
  }

  // fn(kr) for every key range of the windows in which some pair has relevance (elsewhere R and
  // every slope vanish, so the values are never read).
  template <class Fn>
  void for_each_relevant_range(const AttentionParams& p, const QueryTile& qt, const SequenceExtent& s,
                               std::int64_t position0, const ms::Head<double>& hd, T eps, Fn&& fn) {
    const WindowTiles tiles = window_tiles(qt, position0, hd);
    for (std::int64_t kt = tiles.first_tile; kt <= tiles.last_tile; ++kt) {
      KeyRange kr = key_range(qt, kt);
      kr.i0 = std::max(kr.i0, tiles.first_key);
      if (kr.size() <= 0) continue;
      k.load(p.k, qt.b, s.k_start + kr.i0, kr.size(), p.kv_head(qt.h), p.dim_qk, eps);
      km = k.hat;
      rotate_rows(km, kr.i0, hd.rate, 1.0);
      scores.noalias() = qm * km.transpose();
      if (relevance(scores, position0, kr.i0, hd, rel)) fn(kr);
    }
  }
};

template <class T>
void forward_impl(const AttentionParams& p, const ScreeningConfig& cfg) {
  const T eps = T(cfg.norm_eps);
  for_each_query_tile(p, [&](const QueryTile& qt, const SequenceExtent& s) {
    thread_local WindowSweep<T> sweep;
    thread_local UnitRows<T> v;
    thread_local RowMatrix<T> h;
    const ms::Head<double> hd = head_of<T>(cfg, qt.h);
    const std::int64_t hk = p.kv_head(qt.h), row0 = s.q_start + qt.r0;
    const std::int64_t position0 = qt.r0 + s.q_offset();
    sweep.load_queries(p, qt, s, position0, hd, eps);
    h.setZero(qt.n, p.dim_v);
    sweep.for_each_relevant_range(p, qt, s, position0, hd, eps, [&](const KeyRange& kr) {
      v.load(p.v, qt.b, s.k_start + kr.i0, kr.size(), hk, p.dim_v, eps);
      h.noalias() += sweep.rel * v.hat;
    });
    for (std::int64_t r = 0; r < qt.n; ++r) {
      const T n = h.row(r).norm();
      h.row(r) *= ms::tanh_norm_factor(n);
      *p.stats.at<T>(qt.b, row0 + r, qt.h) = n;
    }
    store_rows<T>(h, p.out, qt.b, row0, qt.h);
  });
}

template <class T>
void backward_impl(const AttentionParams& p, const GradientParams& g, const ScreeningConfig& cfg) {
  const T eps = T(cfg.norm_eps);
  // ds_w and ds_r of each (sequence, query head, query tile), in double, summed in a fixed order
  // after the parallel sweep.
  const std::int64_t tiles_q = (p.max_len_q + kQueryTile - 1) / kQueryTile;
  std::vector<double> dsw_parts(static_cast<std::size_t>(p.num_seqs * p.heads_q * tiles_q), 0.0);
  std::vector<double> dsr_parts(dsw_parts.size(), 0.0);
  run_backward<T>(p, g, [&](const QueryTile& qt, const SequenceExtent& s, KeyValueGrads<T>& kv) {
    thread_local WindowSweep<T> sweep;
    thread_local UnitRows<T> v;
    thread_local RowMatrix<T> u, du, gh, dqm, dk_tile, dv_tile;
    thread_local ScoreTile<T> dr, ds;
    thread_local RowVector<T> norm;
    const ms::Head<double> hd = head_of<T>(cfg, qt.h);
    const T w = static_cast<T>(hd.w), r_acc = static_cast<T>(hd.r);
    const std::int64_t hk = p.kv_head(qt.h), row0 = s.q_start + qt.r0;
    const std::int64_t position0 = qt.r0 + s.q_offset();
    sweep.load_queries(p, qt, s, position0, hd, eps);
    const RowMatrix<T>& qm = sweep.qm;
    const RowMatrix<T>& km = sweep.km;
    const ScoreTile<T>& scores = sweep.scores;
    const ScoreTile<T>& rel = sweep.rel;
    // dL/dh through TanhNorm from the saved output: f du + phi <u, du> u.
    load_rows<T>(p.out, qt.b, row0, qt.n, qt.h, p.dim_v, u);
    load_rows<T>(g.dout, qt.b, row0, qt.n, qt.h, p.dim_v, du);
    load_row_stat<T>(p.stats, qt.b, row0, qt.n, qt.h, norm);
    gh.resize(qt.n, p.dim_v);
    for (std::int64_t r = 0; r < qt.n; ++r) {
      const T f = ms::tanh_norm_factor(norm[r]);
      const T phi = ms::tanh_norm_phi(norm[r]);
      gh.row(r) = f * du.row(r) + (phi * u.row(r).dot(du.row(r))) * u.row(r);
    }
    dqm.setZero(qt.n, p.dim_qk);
    double dw = 0, drate = 0, dr_total = 0;
    sweep.for_each_relevant_range(p, qt, s, position0, hd, eps, [&](const KeyRange& kr) {
      v.load(p.v, qt.b, s.k_start + kr.i0, kr.size(), hk, p.dim_v, eps);
      dr.noalias() = gh * v.hat.transpose();
      ds.resize(qt.n, kr.size());
      for (std::int64_t c = 0; c < kr.size(); ++c) {
        for (std::int64_t row = 0; row < qt.n; ++row) {
          const std::int64_t d = kr.i0 + c - (position0 + row);
          if (d > 0 || rel(row, c) == T(0)) {
            ds(row, c) = T(0);
            continue;
          }
          const T sc = scores(row, c), m = ms::softmask(T(d), w, hd.infinite);
          const T x = dr(row, c) * m * ms::trim_slope_s(sc, r_acc);
          ds(row, c) = x;
          dr_total += static_cast<double>(dr(row, c) * m * ms::trim_slope_r(sc, r_acc));
          dw += static_cast<double>(dr(row, c) * ms::trim(sc, r_acc) * ms::softmask_slope(T(d), w, hd.infinite));
          drate += static_cast<double>(x * T(d) * (qm(row, 1) * km(c, 0) - qm(row, 0) * km(c, 1)));
        }
      }
      dqm.noalias() += ds * km;
      dk_tile.noalias() = ds.transpose() * qm;
      rotate_rows(dk_tile, kr.i0, hd.rate, -1.0);
      sweep.k.backward(dk_tile);
      kv.dk.middleRows(kr.i0, kr.size()) += dk_tile;
      dv_tile.noalias() = rel.transpose() * gh;
      v.backward(dv_tile);
      kv.dv.middleRows(kr.i0, kr.size()) += dv_tile;
    });
    rotate_rows(dqm, position0, hd.rate, -1.0);
    sweep.q.backward(dqm);
    store_rows<T>(dqm, g.dq, qt.b, row0, qt.h);
    const auto part = static_cast<std::size_t>((qt.b * p.heads_q + qt.h) * tiles_q + qt.r0 / kQueryTile);
    dsw_parts[part] = (dw + drate * hd.rate_slope) * hd.dw_ds();
    dsr_parts[part] = dr_total * hd.dr_ds();
  });
  const auto write = [&](const Operand& o, const std::vector<double>& parts) {
    auto* data = static_cast<T*>(o.data);
    double shared = 0;
    for (std::int64_t h = 0; h < p.heads_q; ++h) {
      double sum = 0;
      for (std::int64_t b = 0; b < p.num_seqs; ++b) {
        for (std::int64_t t = 0; t < tiles_q; ++t) sum += parts[static_cast<std::size_t>((b * p.heads_q + h) * tiles_q + t)];
      }
      if (o.head == 0) {
        shared += sum;
      } else {
        data[h * o.head] = static_cast<T>(sum);
      }
    }
    if (o.head == 0) *data = static_cast<T>(shared);
  };
  write(cfg.ds_w, dsw_parts);
  write(cfg.ds_r, dsr_parts);
}

}  // namespace

void screening_forward(const AttentionParams& p, const ScreeningConfig& cfg) {
  if (p.dtype == DType::float64) return forward_impl<double>(p, cfg);
  forward_impl<float>(p, cfg);
}

void screening_backward(const AttentionParams& p, const GradientParams& g, const ScreeningConfig& cfg) {
  if (p.dtype == DType::float64) return backward_impl<double>(p, g, cfg);
  backward_impl<float>(p, g, cfg);
}

}  // namespace winnow::cpu
