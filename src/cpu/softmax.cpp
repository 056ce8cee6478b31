// Softmax attention on the CPU: the online-softmax forward (running row max and sum, one sweep
// over key tiles) and the recompute-from-lse backward.
#include <cmath>
#include <limits>

#include "cpu/cpu.h"
#include "cpu/tiles.h"
#include "math/softmax.h"

namespace winnow::cpu {
namespace {

namespace sm = math::softmax;

template <class T>
void forward_impl(const AttentionParams& p) {
  constexpr T kNegInf = -std::numeric_limits<T>::infinity();
  for_each_query_tile(p, [&](const QueryTile& qt, const SequenceExtent& s) {
    thread_local RowMatrix<T> q, k, v, o;
    thread_local ScoreTile<T> z;
    thread_local RowVector<T> row_max, row_sum, new_max, shift, rescale;
    const std::int64_t hk = p.kv_head(qt.h);
    load_rows<T>(p.q, qt.b, s.q_start + qt.r0, qt.n, qt.h, p.dim_qk, q, T(p.scale));
    o.setZero(qt.n, p.dim_v);
    row_max.setConstant(qt.n, kNegInf);
    row_sum.setZero(qt.n);
    for (std::int64_t kt = 0; kt <= qt.last_key_tile(); ++kt) {
      const KeyRange kr = key_range(qt, kt);
      load_rows<T>(p.k, qt.b, s.k_start + kr.i0, kr.size(), hk, p.dim_qk, k);
      load_rows<T>(p.v, qt.b, s.k_start + kr.i0, kr.size(), hk, p.dim_v, v);
      z.noalias() = q * k.transpose();
      mask_invisible(qt, kr, z, kNegInf);
      new_max = row_max.max(z.rowwise().maxCoeff().array());
      // A row that has seen no key yet keeps max -inf; shifting by 0 keeps exp(-inf) = 0.
      shift = (new_max == kNegInf).select(T(0), new_max);
      rescale = exp(row_max - shift);
      for (std::int64_t c = 0; c < kr.size(); ++c) {
        z.col(c).array() = sm::probability(z.col(c).array(), shift);
      }
      // Vectorized exp(-inf) is a tiny positive number, not 0: a row that sees no key must
      // keep a zero sum, or it would normalize those tiny weights into an average of v.
      mask_invisible(qt, kr, z, T(0));
      row_sum = row_sum * rescale + z.rowwise().sum().array();
      o = rescale.matrix().asDiagonal() * o;
      o.noalias() += z * v;
      row_max = new_max;
    }
    const RowVector<T> inv = (row_sum > T(0)).select(T(1) / row_sum, T(0));
    o = inv.matrix().asDiagonal() * o;
    const RowVector<T> lse = (row_sum > T(0)).select(row_max + log(row_sum), kNegInf);
    store_rows<T>(o, p.out, qt.b, s.q_start + qt.r0, qt.h);
    store_row_stat<T>(lse, p.stats, qt.b, s.q_start + qt.r0, qt.h);
  });
}

template <class T>
void backward_impl(const AttentionParams& p, const GradientParams& g) {
  run_backward<T>(p, g, [&](const QueryTile& qt, const SequenceExtent& s, KeyValueGrads<T>& kv) {
    thread_local RowMatrix<T> q, k, v, o, dout, dq;
    thread_local ScoreTile<T> pr, dpr;
    thread_local RowVector<T> lse, delta;
    const std::int64_t hk = p.kv_head(qt.h);
    const std::int64_t row0 = s.q_start + qt.r0;
    load_rows<T>(p.q, qt.b, row0, qt.n, qt.h, p.dim_qk, q, T(p.scale));
    load_rows<T>(p.out, qt.b, row0, qt.n, qt.h, p.dim_v, o);
    load_rows<T>(g.dout, qt.b, row0, qt.n, qt.h, p.dim_v, dout);
    load_row_stat<T>(p.stats, qt.b, row0, qt.n, qt.h, lse);
    delta = (dout.array() * o.array()).rowwise().sum();
    dq.setZero(qt.n, p.dim_qk);
    for (std::int64_t kt = 0; kt <= qt.last_key_tile(); ++kt) {
      const KeyRange kr = key_range(qt, kt);
      load_rows<T>(p.k, qt.b, s.k_start + kr.i0, kr.size(), hk, p.dim_qk, k);
      load_rows<T>(p.v, qt.b, s.k_start + kr.i0, kr.size(), hk, p.dim_v, v);
      pr.noalias() = q * k.transpose();
      for (std::int64_t c = 0; c < kr.size(); ++c) {
        pr.col(c).array() = sm::probability(pr.col(c).array(), lse);
      }
      // Also clears rows with lse = -inf, where exp(-inf - -inf) is NaN: they see no key.
      mask_invisible(qt, kr, pr, T(0));
      dpr.noalias() = dout * v.transpose();
      for (std::int64_t c = 0; c < kr.size(); ++c) {
        dpr.col(c).array() = sm::grad_logit(pr.col(c).array(), dpr.col(c).array(), delta);
      }
      dq.noalias() += dpr * k;
      kv.dk.middleRows(kr.i0, kr.size()).noalias() += dpr.transpose() * q;
      kv.dv.middleRows(kr.i0, kr.size()).noalias() += pr.transpose() * dout;
    }
    store_rows<T>(dq, g.dq, qt.b, row0, qt.h, T(p.scale));
  });
}

}  // namespace

void softmax_forward(const AttentionParams& p) {
  if (p.dtype == DType::float64) return forward_impl<double>(p);
  forward_impl<float>(p);
}

void softmax_backward(const AttentionParams& p, const GradientParams& g) {
  if (p.dtype == DType::float64) return backward_impl<double>(p, g);
  backward_impl<float>(p, g);
}

}  // namespace winnow::cpu
