// Threshold attention (TRA, TDA) on the CPU, streaming over key tiles: queries and keys are
// normalized as they are loaded, weights are relu(s - tau)^p of the cosine scores, and a key
// tile in which no row's score clears its threshold skips the value load and the products
// (forward and backward): the sparsity 004 reports is used, not only reported. The backward
// recomputes the weights (nothing is saved); each key's gradient goes through its
// normalization's Jacobian as it is accumulated (linear, per key row), so the shared backward
// driver sums gradients of k itself.
#include <cmath>
#include <vector>

#include "cpu/cpu.h"
#include "cpu/tiles.h"
#include "cpu/unit_rows.h"
#include "math/threshold.h"

namespace winnow::cpu {
namespace {

namespace mt = math::threshold;
using detail::ThresholdConfig;

// tau_r / beta for the rows of a query tile: row r sees first_limit + r + 1 keys.
template <class T>
void threshold_units(const AttentionParams& p, const QueryTile& qt, RowVector<T>& unit) {
  unit.resize(qt.n);
  for (std::int64_t r = 0; r < qt.n; ++r) {
    const T visible = static_cast<T>(std::max<std::int64_t>(qt.first_limit + r + 1, 0));
    unit[r] = mt::threshold_unit(visible, static_cast<T>(p.dim_qk));
  }
}

// x = qh kh^T - tau (per row) and the weights relu(x)^p, invisible entries zeroed; returns
// whether any weight of the tile is nonzero.
template <class T>
bool view_tile(const QueryTile& qt, const KeyRange& kr, const RowMatrix<T>& qh, const RowMatrix<T>& kh,
               const RowVector<T>& tau, T power, ScoreTile<T>& x, ScoreTile<T>& w) {
  x.noalias() = qh * kh.transpose();
  x.array().colwise() -= tau;
  // Invisible entries get x = 0: weight and slope 0.
  mask_invisible(qt, kr, x, T(0));
  w = mt::weight_array(x.array(), power).matrix();
  return (w.array() != T(0)).any();
}

template <class T>
void forward_impl(const AttentionParams& p, const ThresholdConfig& cfg) {
  const T eps = T(cfg.norm_eps), power = T(cfg.power);
  const bool tda = cfg.differential();
  for_each_query_tile(p, [&](const QueryTile& qt, const SequenceExtent& s) {
    thread_local UnitRows<T> q1, q2, k1, k2;
    thread_local RowMatrix<T> v, o;
    thread_local ScoreTile<T> x1, w1, x2, w2;
    thread_local RowVector<T> unit, tau;
    thread_local Eigen::Array<std::int32_t, Eigen::Dynamic, 1> survivors;
    const bool counting = cfg.nonzero.data != nullptr;
    const std::int64_t hk = p.kv_head(qt.h), row0 = s.q_start + qt.r0;
    q1.load(p.q, qt.b, row0, qt.n, qt.h, p.dim_qk, eps);
    if (tda) q2.load(cfg.q2, qt.b, row0, qt.n, qt.h, p.dim_qk, eps);
    threshold_units<T>(p, qt, unit);
    tau = cfg.beta_at<T>(qt.h) * unit;
    const T lambda = tda ? mt::lambda_used(cfg.lambda_at<T>(qt.h), cfg.clamp_lambda) : T(0);
    o.setZero(qt.n, p.dim_v);
    if (counting) survivors.setZero(qt.n);
    for (std::int64_t kt = 0; kt <= qt.last_key_tile(); ++kt) {
      const KeyRange kr = key_range(qt, kt);
      k1.load(p.k, qt.b, s.k_start + kr.i0, kr.size(), hk, p.dim_qk, eps);
      bool any = view_tile(qt, kr, q1.hat, k1.hat, tau, power, x1, w1);
      if (tda) {
        k2.load(cfg.k2, qt.b, s.k_start + kr.i0, kr.size(), hk, p.dim_qk, eps);
        if (view_tile(qt, kr, q2.hat, k2.hat, tau, power, x2, w2)) {
          if (counting) survivors += ((w1.array() != T(0)) || (w2.array() != T(0))).template cast<std::int32_t>().rowwise().sum();
          any = true;
          w1 -= lambda * w2;
        } else if (counting && any) {
          survivors += (w1.array() != T(0)).template cast<std::int32_t>().rowwise().sum();
        }
      } else if (counting && any) {
        survivors += (w1.array() != T(0)).template cast<std::int32_t>().rowwise().sum();
      }
      if (!any) continue;  // no weight in the tile: its values are never read
      load_rows<T>(p.v, qt.b, s.k_start + kr.i0, kr.size(), hk, p.dim_v, v);
      o.noalias() += w1 * v;
    }
    store_rows<T>(o, p.out, qt.b, row0, qt.h);
    if (counting) {
      for (std::int64_t r = 0; r < qt.n; ++r) *cfg.nonzero.at<std::int32_t>(qt.b, row0 + r, qt.h) = survivors[r];
    }
  });
}

template <class T>
void backward_impl(const AttentionParams& p, const GradientParams& g, const ThresholdConfig& cfg) {
  const T eps = T(cfg.norm_eps), power = T(cfg.power);
  const bool tda = cfg.differential();
  // dbeta and dlambda of each (sequence, query head, query tile), summed in a fixed order
  // after the parallel sweep.
  const std::int64_t tiles = (p.max_len_q + kQueryTile - 1) / kQueryTile;
  std::vector<T> dbeta_parts(static_cast<std::size_t>(p.num_seqs * p.heads_q * tiles), T(0));
  std::vector<T> dlambda_parts(dbeta_parts.size(), T(0));
  const auto part = [&](const QueryTile& qt) {
    return static_cast<std::size_t>((qt.b * p.heads_q + qt.h) * tiles + qt.r0 / kQueryTile);
  };
  run_backward<T>(p, g, tda ? &cfg.dk2 : nullptr,
                  [&](const QueryTile& qt, const SequenceExtent& s, KeyValueGrads<T>& kv) {
    thread_local UnitRows<T> q1, q2, k1, k2;
    thread_local RowMatrix<T> v, dout, dq1, dq2, dk_tile;
    thread_local ScoreTile<T> x1, w1, x2, w2, dw, ds;
    thread_local RowVector<T> unit, tau, dtau;
    const std::int64_t hk = p.kv_head(qt.h), row0 = s.q_start + qt.r0;
    q1.load(p.q, qt.b, row0, qt.n, qt.h, p.dim_qk, eps);
    if (tda) q2.load(cfg.q2, qt.b, row0, qt.n, qt.h, p.dim_qk, eps);
    load_rows<T>(g.dout, qt.b, row0, qt.n, qt.h, p.dim_v, dout);
    threshold_units<T>(p, qt, unit);
    tau = cfg.beta_at<T>(qt.h) * unit;
    const T lambda = tda ? mt::lambda_used(cfg.lambda_at<T>(qt.h), cfg.clamp_lambda) : T(0);
    dtau.setZero(qt.n);
    dq1.setZero(qt.n, p.dim_qk);
    if (tda) dq2.setZero(qt.n, p.dim_qk);
    T w2_dot_dw = 0;
    // ds = sign * dw * slope(x); dtau -= rowsum(ds); dq_hat += ds kh; dk += J_k(ds^T qh).
    const auto view_grads = [&](const KeyRange& kr, const ScoreTile<T>& x, T sign, UnitRows<T>& k,
                                const UnitRows<T>& q, RowMatrix<T>& dq, RowMatrix<T>& dk) {
      ds = (sign * dw.array() * mt::weight_slope_array(x.array(), power)).matrix();
      dtau -= ds.rowwise().sum().array();
      dq.noalias() += ds * k.hat;
      dk_tile.noalias() = ds.transpose() * q.hat;
      k.backward(dk_tile);
      dk.middleRows(kr.i0, kr.size()) += dk_tile;
    };
    for (std::int64_t kt = 0; kt <= qt.last_key_tile(); ++kt) {
      const KeyRange kr = key_range(qt, kt);
      k1.load(p.k, qt.b, s.k_start + kr.i0, kr.size(), hk, p.dim_qk, eps);
      const bool any1 = view_tile(qt, kr, q1.hat, k1.hat, tau, power, x1, w1);
      bool any2 = false;
      if (tda) {
        k2.load(cfg.k2, qt.b, s.k_start + kr.i0, kr.size(), hk, p.dim_qk, eps);
        any2 = view_tile(qt, kr, q2.hat, k2.hat, tau, power, x2, w2);
      }
      // A weight is zero exactly where its slope is: such a tile has no gradient at all.
      if (!any1 && !any2) continue;
      load_rows<T>(p.v, qt.b, s.k_start + kr.i0, kr.size(), hk, p.dim_v, v);
      dw.noalias() = dout * v.transpose();
      if (any1) {
        view_grads(kr, x1, T(1), k1, q1, dq1, kv.dk);
        kv.dv.middleRows(kr.i0, kr.size()).noalias() += w1.transpose() * dout;
      }
      if (any2) {
        view_grads(kr, x2, -lambda, k2, q2, dq2, kv.dk2);
        kv.dv.middleRows(kr.i0, kr.size()).noalias() -= lambda * (w2.transpose() * dout);
        w2_dot_dw += (w2.array() * dw.array()).sum();
      }
    }
    q1.backward(dq1);
    store_rows<T>(dq1, g.dq, qt.b, row0, qt.h);
    if (tda) {
      q2.backward(dq2);
      store_rows<T>(dq2, cfg.dq2, qt.b, row0, qt.h);
      dlambda_parts[part(qt)] = -w2_dot_dw * mt::lambda_slope(cfg.lambda_at<T>(qt.h), cfg.clamp_lambda);
    }
    dbeta_parts[part(qt)] = (dtau * unit).sum();
  });
  const auto write = [&](const Operand& o, const std::vector<T>& parts) {
    auto* data = static_cast<T*>(o.data);
    if (o.head == 0) *data = T(0);
    for (std::int64_t h = 0; h < p.heads_q; ++h) {
      T sum = 0;
      for (std::int64_t b = 0; b < p.num_seqs; ++b) {
        for (std::int64_t t = 0; t < tiles; ++t) sum += parts[static_cast<std::size_t>((b * p.heads_q + h) * tiles + t)];
      }
      if (o.head == 0) {
        *data += sum;
      } else {
        data[h * o.head] = sum;
      }
    }
  };
  write(cfg.dbeta, dbeta_parts);
  if (tda) write(cfg.dlambda, dlambda_parts);
}

}  // namespace

void threshold_forward(const AttentionParams& p, const ThresholdConfig& cfg) {
  if (p.dtype == DType::float64) return forward_impl<double>(p, cfg);
  forward_impl<float>(p, cfg);
}

void threshold_backward(const AttentionParams& p, const GradientParams& g, const ThresholdConfig& cfg) {
  if (p.dtype == DType::float64) return backward_impl<double>(p, g, cfg);
  backward_impl<float>(p, g, cfg);
}

}  // namespace winnow::cpu
