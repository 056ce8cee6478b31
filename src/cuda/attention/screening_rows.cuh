// Multiscreen's screening (spec/screening.md) as row policies of the portable fused kernels.
// The kernels see queries and keys already unit-normalized and rotated by MiPE, and values
// unit-normalized (screening.cu writes them once per call, keys once per query head), so a
// score is the similarity s and a weight is the relevance
//   R = max(1 - (1 - s) / r, 0)^2 * 0.5 (cos(pi d / w) + 1),   d = key - query position > -w,
// with no running maximum, no rescaling and no normalization. Key tiles left of every row's
// window are never visited (kLimitsFirstKey in the forward, first_key in the backward), so a
// block's cost grows with min(L, w). The forward ends with TanhNorm, the per-row statistic
// being |h|; the backward's last step takes dq back through MiPE and the normalization.
#pragma once

#include <cstdint>

#include "cuda/attention/backward.cuh"
#include "cuda/attention/forward.cuh"
#include "cuda/attention/unit_norm_rows.cuh"
#include "cuda/tile/rows.cuh"
#include "math/elementwise.h"
#include "math/screening.h"

namespace winnow::cuda {

namespace ms = math::screening;

// sin and cos of MiPE's angle pos * rate: reduced to [-pi, pi] in double (positions reach 10^5
// and more), then evaluated in float.
__device__ __forceinline__ void mipe_sincos(std::int64_t pos, double rate, float* sn, float* cs) {
  const double angle = static_cast<double>(pos) * rate;
  const double turns = rint(angle * (0.5 / ms::kPi));
  sincosf(static_cast<float>(angle - turns * (2.0 * ms::kPi)), sn, cs);
}

// Coordinates 0 and 1 of x (a gradient) rotated back by MiPE's angle at pos.
__device__ __forceinline__ void unrotate(float* x, std::int64_t pos, double rate) {
  float sn, cs;
  mipe_sincos(pos, rate, &sn, &cs);
  const float x0 = x[0], x1 = x[1];
  x[0] = x0 * cs + x1 * sn;
  x[1] = -x0 * sn + x1 * cs;
}

// Each row's share of the per-head gradients, in double, head-major so that a block per head
// sums them reading contiguous memory: query rows' shares of ds_w (k = 0) and ds_r (k = 1),
// then (the fused backward) key rows' shares of ds_w.
struct ScalarParts {
  double* data = nullptr;
  std::int64_t rows_q = 0, rows_k = 0, heads = 0;
  ScalarParts() = default;
  __host__ __device__ ScalarParts(const AttentionParams& p, double* d)
      : data(d), rows_q(p.rows_q), rows_k(p.rows_k), heads(p.heads_q) {}
  __device__ __forceinline__ double& query(int k, std::int64_t h, std::int64_t row) const {
    return data[(k * heads + h) * rows_q + row];
  }
  __device__ __forceinline__ double& key(std::int64_t h, std::int64_t row) const {
    return data[2 * heads * rows_q + h * rows_k + row];
  }
};

struct ScreeningCudaConfig {
  const ms::Head<double>* heads = nullptr;  // one per query head (device memory)
  // Backward only: the rotated and the plain normalized queries (T, [batch row][head][dim]) with
  // their inverse norms (negated where clipped), and the rows' shares of ds_w and ds_r.
  detail::Operand q_rotated, q_unit;
  const float* q_inv_norm = nullptr;
  ScalarParts parts;
};

// One head's constants as the weights use them.
struct ScreeningHead {
  float w, inv_w, inv_r, one_minus_inv_r;
  bool infinite;
  __device__ __forceinline__ explicit ScreeningHead(const ms::Head<double>& h)
      : w(static_cast<float>(h.w)),
        inv_w(static_cast<float>(1.0 / h.w)),
        inv_r(static_cast<float>(1.0 / h.r)),
        one_minus_inv_r(static_cast<float>(1.0 - 1.0 / h.r)),
        infinite(h.infinite) {}

  // Trim's base t = 1 - (1 - s) / r (the weight is t^2 where t > 0) and the Softmask at d.
  __device__ __forceinline__ float trim_base(float s) const { return fmaf(s, inv_r, one_minus_inv_r); }
  __device__ __forceinline__ float softmask(int d) const {
    if (infinite) return 1.f;
    return static_cast<float>(d) > -w ? 0.5f * (__cosf(static_cast<float>(ms::kPi) * static_cast<float>(d) * inv_w) + 1.f)
                                      : 0.f;
  }
  __device__ __forceinline__ float softmask_slope(int d) const {
    if (infinite || !(static_cast<float>(d) > -w)) return 0.f;
    const float x = static_cast<float>(ms::kPi) * static_cast<float>(d) * inv_w;
    return 0.5f * __sinf(x) * x * inv_w;
  }
};

// Position of a query row of the tile (rows past the sequence get one past every key).
template <class Tile>
__device__ __forceinline__ std::int64_t query_position(const Tile& qt, std::int64_t row) {
  return row + qt.s.q_offset();
}

struct ScreeningRows {
  static constexpr bool kCanHalt = false;
  static constexpr bool kUsesValues = true;
  static constexpr bool kLimitsFirstKey = true;
  ScreeningHead head;
  std::int64_t pos[2];

  template <class Tile>
  __device__ __forceinline__ ScreeningRows(const AttentionParams&, const ScreeningCudaConfig& cfg, const Tile& qt,
                                           std::int64_t row0)
      : head(cfg.heads[qt.h]), pos{query_position(qt, row0), query_position(qt, row0 + 8)} {}

  template <class Tile>
  static __device__ __forceinline__ std::int64_t first_visible_key(const AttentionParams&, const ScreeningCudaConfig& cfg,
                                                                   const Tile& qt, std::int64_t row) {
    const ms::Head<double>& h = cfg.heads[qt.h];
    return ms::first_key(query_position(qt, row), h.w, h.infinite);
  }

  template <bool Masked, int NT>
  __device__ __forceinline__ void weights(float (&s)[NT][4], const RowMask& mask) const {
    const int base[2] = {static_cast<int>(mask.key0 - pos[0]), static_cast<int>(mask.key0 - pos[1])};
#pragma unroll
    for (int n = 0; n < NT; ++n) {
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int half = i / 2, e = i % 2;
        const float t = fmaxf(head.trim_base(s[n][i]), 0.f);
        const float rel = t * t * head.softmask(base[half] + key_of<8 * NT>(mask.tig, n, e));
        s[n][i] = !Masked || mask.visible<8 * NT>(half, n, e) ? rel : 0.f;
      }
    }
  }

  template <int DT>
  __device__ __forceinline__ void rescale(float (&)[DT][4]) const {}
  __device__ __forceinline__ bool can_halt() const { return false; }
  __device__ __forceinline__ bool halted(const RowMask&) const { return false; }

  // TanhNorm on each row; the statistic is |h|.
  template <int DT>
  __device__ __forceinline__ void finish(float (&o)[DT][4], float (&stat)[2]) const {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      float sum = 0.f;
#pragma unroll
      for (int n = 0; n < DT; ++n) sum += o[n][2 * half] * o[n][2 * half] + o[n][2 * half + 1] * o[n][2 * half + 1];
      const float norm = sqrtf(tile::quad_sum(sum));
      const float f = ms::tanh_norm_factor(norm);
#pragma unroll
      for (int n = 0; n < DT; ++n) {
        o[n][2 * half] *= f;
        o[n][2 * half + 1] *= f;
      }
      stat[half] = norm;
    }
  }

  __device__ __forceinline__ void store_extra(const AttentionParams&, const ScreeningCudaConfig&, std::int64_t,
                                              std::int64_t, std::int64_t, std::int64_t, int) const {}
};

// The backward rows: P = R and dS = dP m dalpha/ds, with the row sums ds_r and ds_w need
// (sum dP m dalpha/dr; sum dP alpha dm/dw), reduced at the end with MiPE's share of ds_w, which
// comes from dq itself: the rate moves query i's angle by i per unit, so it adds
// i <(-qm_1, qm_0), dqm> to d/d rate (the keys' share is added by screening.cu from dk).
template <class T>
struct ScreeningBackwardRows {
  static constexpr bool kFinishesDq = true;
  ScreeningHead head;
  std::int64_t pos[2];
  float dr_sum[2] = {0.f, 0.f};  // sum dP m dalpha/dr over this thread's keys
  float dw_sum[2] = {0.f, 0.f};  // sum dP alpha dm/dw

  template <class Tile>
  __device__ __forceinline__ ScreeningBackwardRows(const AttentionParams&, const detail::GradientParams&,
                                                   const ScreeningCudaConfig& cfg, const Tile& qt, std::int64_t row0,
                                                   int)
      : head(cfg.heads[qt.h]), pos{query_position(qt, row0), query_position(qt, row0 + 8)} {}

  __device__ __forceinline__ std::int64_t first_key(int half, const RowMask&) const {
    if (head.infinite) return 0;
    return ms::first_key(pos[half], static_cast<double>(head.w), false);
  }

  template <bool Masked, int NT>
  __device__ __forceinline__ void grads(float (&s)[NT][4], float (&dp)[NT][4], const RowMask& mask) {
    const int base[2] = {static_cast<int>(mask.key0 - pos[0]), static_cast<int>(mask.key0 - pos[1])};
#pragma unroll
    for (int n = 0; n < NT; ++n) {
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int half = i / 2, e = i % 2;
        const bool visible = !Masked || mask.visible<8 * NT>(half, n, e);
        const int d = base[half] + key_of<8 * NT>(mask.tig, n, e);
        const float sc = s[n][i];
        const float t = visible ? fmaxf(head.trim_base(sc), 0.f) : 0.f;
        const float m = head.softmask(d);
        const float g = dp[n][i];
        // dalpha/ds = 2 t / r and dalpha/dr = 2 t (1 - s) / r^2: both 0 with t.
        const float two_t_over_r = 2.f * t * head.inv_r;
        dr_sum[half] += g * m * two_t_over_r * (1.f - sc) * head.inv_r;
        dw_sum[half] += g * t * t * head.softmask_slope(d);
        s[n][i] = t * t * m;
        dp[n][i] = g * m * two_t_over_r;
      }
    }
  }

  // dq_m -> dq: the rate's share, back through MiPE (coordinates 0 and 1, held by the thread of
  // tig 0 in n-tile 0), then through the normalization; the row's shares of ds_w and ds_r.
  template <int DT, class Tile>
  __device__ __forceinline__ void finish_dq(float (&dq)[DT][4], const AttentionParams& p,
                                            const ScreeningCudaConfig& cfg, const Tile& qt, std::int64_t row0,
                                            int tig) const {
    const ms::Head<double>& hd = cfg.heads[qt.h];
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const std::int64_t row = row0 + 8 * half;
      const bool in = row < qt.s.q_len;
      const float dr = tile::quad_sum(dr_sum[half]);
      const float dw = tile::quad_sum(dw_sum[half]);
      const std::int64_t abs_row = qt.s.q_start + row;
      const T* qn = in ? cfg.q_unit.at<const T>(qt.b, abs_row, qt.h) : nullptr;
      double rate_share = 0;
      if (in && tig == 0 && hd.rate != 0) {
        const T* qm = cfg.q_rotated.at<const T>(qt.b, abs_row, qt.h);
        const float q0 = tile::to_float(qm[0]), q1 = tile::to_float(qm[1]);
        float g[2] = {dq[0][2 * half], dq[0][2 * half + 1]};
        rate_share = static_cast<double>(pos[half]) * static_cast<double>(q0 * g[1] - q1 * g[0]);
        unrotate(g, pos[half], hd.rate);
        dq[0][2 * half] = g[0];
        dq[0][2 * half + 1] = g[1];
      }
      normalize_grad_row<T, DT>(dq, half, qn, cfg.q_inv_norm + p.batch_row_q(qt.b, abs_row) * p.heads_q + qt.h, tig);
      if (!in) continue;
      if (tig == 0) {
        const std::int64_t batch_row = p.batch_row_q(qt.b, abs_row);
        cfg.parts.query(0, qt.h, batch_row) = (static_cast<double>(dw) + rate_share * hd.rate_slope) * hd.dw_ds();
        cfg.parts.query(1, qt.h, batch_row) = static_cast<double>(dr) * hd.dr_ds();
      }
    }
  }
};

}  // namespace winnow::cuda
