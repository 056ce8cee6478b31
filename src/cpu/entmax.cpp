// alpha-entmax attention on the CPU (spec/entmax.md). Per query tile: the tile's score block,
// the rows' thresholds searched on it (score_block.h), then the weights p and the output P V,
// key tile by key tile; a key tile where no row has support is skipped (no value load, no
// product). The backward recomputes the block and the weights from the saved thresholds, forms
// dP = dO V^T for every key, delta_j = sum u dP / sum u, and dZ = u (dP - delta).
#include <cmath>
#include <limits>

#include "cpu/cpu.h"
#include "cpu/score_block.h"
#include "cpu/tiles.h"
#include "math/entmax.h"

namespace winnow::cpu {
namespace {

namespace em = math::entmax;

// w = p (and, when u is given, u) of the block's key columns [i0, i0 + n).
template <class T>
bool weights(const ScoreTile<T>& z, std::int64_t i0, std::int64_t n, const RowVector<T>& tau, T alpha,
             ScoreTile<T>& w, ScoreTile<T>* u) {
  w.resize(z.rows(), n);
  if (u != nullptr) u->resize(z.rows(), n);
  bool any = false;
  em::with_family(alpha, [&](auto family) {
    for (std::int64_t c = 0; c < n; ++c) {
      for (std::int64_t r = 0; r < z.rows(); ++r) {
        const T gap = (alpha - T(1)) * z(r, i0 + c) - tau[r];
        if (u != nullptr) {
          const auto both = em::weight_and_grad(family, gap);
          w(r, c) = both.p;
          (*u)(r, c) = both.u;
        } else {
          w(r, c) = em::weight(family, gap);
        }
        any |= gap > T(0);
      }
    }
  });
  return any;
}

template <class T>
void forward_impl(const AttentionParams& p, const detail::EntmaxConfig& cfg) {
  const T alpha = T(cfg.alpha);
  for_each_query_tile(p, [&](const QueryTile& qt, const SequenceExtent& s) {
    thread_local RowMatrix<T> q, k, v, o;
    thread_local ScoreTile<T> z, w;
    thread_local RowVector<T> tau;
    load_rows<T>(p.q, qt.b, s.q_start + qt.r0, qt.n, qt.h, p.dim_qk, q, T(p.scale));
    score_block(p, qt, s, q, k, z);
    entmax_thresholds(qt, z, cfg.alpha, cfg.tolerance, tau);
    o.setZero(qt.n, p.dim_v);
    for (std::int64_t kt = 0; kt <= qt.last_key_tile(); ++kt) {
      const KeyRange kr = key_range(qt, kt);
      if (!weights<T>(z, kr.i0, kr.size(), tau, alpha, w, nullptr)) continue;
      load_rows<T>(p.v, qt.b, s.k_start + kr.i0, kr.size(), p.kv_head(qt.h), p.dim_v, v);
      o.noalias() += w * v;
    }
    store_rows<T>(o, p.out, qt.b, s.q_start + qt.r0, qt.h);
    store_row_stat<T>(tau, p.stats, qt.b, s.q_start + qt.r0, qt.h);
  });
}

template <class T>
void backward_impl(const AttentionParams& p, const GradientParams& g, const detail::EntmaxConfig& cfg) {
  const T alpha = T(cfg.alpha);
  run_backward<T>(p, g, [&](const QueryTile& qt, const SequenceExtent& s, KeyValueGrads<T>& kv) {
    thread_local RowMatrix<T> q, k, v, dout, dq;
    thread_local ScoreTile<T> z, w, u, dp;
    thread_local RowVector<T> tau, sum_u, sum_udp, delta;
    const std::int64_t hk = p.kv_head(qt.h);
    const std::int64_t row0 = s.q_start + qt.r0;
    load_rows<T>(p.q, qt.b, row0, qt.n, qt.h, p.dim_qk, q, T(p.scale));
    load_rows<T>(g.dout, qt.b, row0, qt.n, qt.h, p.dim_v, dout);
    load_row_stat<T>(p.stats, qt.b, row0, qt.n, qt.h, tau);
    score_block(p, qt, s, q, k, z);
    const std::int64_t keys = z.cols();
    dp.resize(qt.n, keys);
    sum_u.setZero(qt.n);
    sum_udp.setZero(qt.n);
    // First sweep: dP for every key and the rows' sums of u and u dP.
    for (std::int64_t kt = 0; kt <= qt.last_key_tile(); ++kt) {
      const KeyRange kr = key_range(qt, kt);
      if (!weights<T>(z, kr.i0, kr.size(), tau, alpha, w, &u)) continue;
      load_rows<T>(p.v, qt.b, s.k_start + kr.i0, kr.size(), hk, p.dim_v, v);
      dp.middleCols(kr.i0, kr.size()).noalias() = dout * v.transpose();
      sum_u += u.array().rowwise().sum();
      sum_udp += (u.array() * dp.middleCols(kr.i0, kr.size()).array()).rowwise().sum();
    }
    delta = (sum_u > T(0)).select(sum_udp / sum_u, T(0));
    dq.setZero(qt.n, p.dim_qk);
    for (std::int64_t kt = 0; kt <= qt.last_key_tile(); ++kt) {
      const KeyRange kr = key_range(qt, kt);
      if (!weights<T>(z, kr.i0, kr.size(), tau, alpha, w, &u)) continue;
      load_rows<T>(p.k, qt.b, s.k_start + kr.i0, kr.size(), hk, p.dim_qk, k);
      auto dz = dp.middleCols(kr.i0, kr.size());
      for (std::int64_t c = 0; c < kr.size(); ++c) {
        dz.col(c).array() = em::grad_logit(u.col(c).array(), dz.col(c).array(), delta);
      }
      dq.noalias() += dz * k;
      kv.dk.middleRows(kr.i0, kr.size()).noalias() += dz.transpose() * q;
      kv.dv.middleRows(kr.i0, kr.size()).noalias() += w.transpose() * dout;
    }
    store_rows<T>(dq, g.dq, qt.b, row0, qt.h, T(p.scale));
  });
}

}  // namespace

void entmax_forward(const AttentionParams& p, const detail::EntmaxConfig& cfg) {
  if (p.dtype == DType::float64) return forward_impl<double>(p, cfg);
  forward_impl<float>(p, cfg);
}

void entmax_backward(const AttentionParams& p, const GradientParams& g, const detail::EntmaxConfig& cfg) {
  if (p.dtype == DType::float64) return backward_impl<double>(p, g, cfg);
  backward_impl<float>(p, g, cfg);
}

}  // namespace winnow::cpu
