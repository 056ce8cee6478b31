// alpha-entmax's row threshold on the matrix units, and entmax's weights, as row policies of
// the fused forward kernel (spec/entmax.md, spec/sieve.md).
//
// The threshold tau_j solves f(tau) = sum_i [x_ij - tau]_+^(1 / (alpha - 1)) = 1 with
// x = (alpha - 1) z. Each step of the search is one sweep of the fused kernel without values
// (kUsesValues false): S = Q K^T tile by tile on the matrix units, and per score a few
// multiply-adds into the row's f and f' at the current tau. The search state of each row
// (math::entmax::ThresholdSearch: bracket, tau, done) lives in a global buffer between sweeps:
//   ThresholdStartRows   the row maximum; bound filter: threshold = max - eps, done;
//                        otherwise ThresholdSearch::start (Newton from max - 1, bracketed)
//   ThresholdStepRows    one Newton (or bisection) step; raises `unfinished` while some row
//                        of the problem still moves
// The host repeats the step sweep until no row moves (at most kMaxSearchSteps). Every sweep
// writes its current threshold to `result` (scaled by result_scale: 1 for entmax's tau,
// 1 / (alpha - 1) for Sieve's score-unit threshold), so the last one leaves the answer.
#pragma once

#include <cmath>
#include <cstdint>

#include "cuda/attention/forward.cuh"
#include "math/entmax.h"

namespace winnow::cuda {

struct ThresholdCudaConfig {
  float alpha = 1.5f, tolerance = 1e-6f;
  bool bound = false;  // Sieve's bound filter: threshold = max - eps, in score units
  float eps = 2.f;
  detail::Operand state;     // float4 per row: lo, hi, tau, done (x units)
  detail::Operand result;    // float per row
  float result_scale = 1.f;  // result = tau * result_scale (bound: the threshold itself)
  int* unfinished = nullptr;
};

// What every threshold sweep shares: no values, no halting, nothing to rescale.
struct ThresholdSweepRows {
  static constexpr bool kCanHalt = false;
  static constexpr bool kUsesValues = false;
  template <int DT>
  __device__ __forceinline__ void rescale(float (&)[DT][4]) const {}
  __device__ __forceinline__ bool can_halt() const { return false; }
  __device__ __forceinline__ bool halted(const RowMask&) const { return false; }
};

struct ThresholdStartRows : ThresholdSweepRows {
  float scale;
  float max[2] = {-INFINITY, -INFINITY};  // raw scores q . k
  std::int64_t visible[2];                // keys the row sees

  template <class Tile>
  __device__ __forceinline__ ThresholdStartRows(const AttentionParams& p, const ThresholdCudaConfig&,
                                                const Tile& qt, std::int64_t row0)
      : scale(static_cast<float>(p.scale)) {
    visible[0] = qt.limit(p, row0) + 1;
    visible[1] = qt.limit(p, row0 + 8) + 1;
  }

  template <bool Masked, int NT>
  __device__ __forceinline__ void weights(float (&s)[NT][4], const RowMask& mask) {
#pragma unroll
    for (int n = 0; n < NT; ++n) {
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int half = i / 2, e = i % 2;
        if (!Masked || mask.visible<8 * NT>(half, n, e)) max[half] = fmaxf(max[half], s[n][i]);
      }
    }
  }

  template <int DT>
  __device__ __forceinline__ void finish(float (&)[DT][4], float (&)[2]) {
    max[0] = tile::quad_max(max[0]);
    max[1] = tile::quad_max(max[1]);
  }

  __device__ __forceinline__ void store_extra(const AttentionParams&, const ThresholdCudaConfig& cfg,
                                              std::int64_t b, std::int64_t row, std::int64_t h,
                                              std::int64_t, int half) const {
    const float z_max = max[half] * scale;
    float4 st = make_float4(0.f, 0.f, 0.f, 1.f);  // a row that sees no key: tau 0, done
    float result = 0.f;
    if (visible[half] > 0) {
      if (cfg.bound) {
        result = z_max - cfg.eps;
      } else {
        math::entmax::ThresholdSearch<float> search(cfg.alpha, cfg.tolerance);
        search.start((cfg.alpha - 1.f) * z_max, static_cast<float>(visible[half]));
        st = make_float4(search.lo, search.hi, search.tau, search.done ? 1.f : 0.f);
        result = search.tau * cfg.result_scale;
        if (!search.done) atomicOr(cfg.unfinished, 1);
      }
    }
    if (!cfg.bound) *cfg.state.at<float4>(b, row, h) = st;
    *cfg.result.at<float>(b, row, h) = result;
  }
};

struct ThresholdStepRows : ThresholdSweepRows {
  float x_scale, alpha;
  float tau[2], f[2] = {0.f, 0.f}, sum_u[2] = {0.f, 0.f};
  bool done[2];

  template <class Tile>
  __device__ __forceinline__ ThresholdStepRows(const AttentionParams& p, const ThresholdCudaConfig& cfg,
                                               const Tile& qt, std::int64_t row0)
      : x_scale(static_cast<float>(p.scale) * (cfg.alpha - 1.f)), alpha(cfg.alpha) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const std::int64_t row = row0 + 8 * half;
      tau[half] = 0.f;
      done[half] = true;
      if (row >= qt.s.q_len) continue;
      const float4 st = *cfg.state.at<const float4>(qt.b, qt.s.q_start + row, qt.h);
      tau[half] = st.z;
      done[half] = st.w != 0.f;
    }
  }

  template <bool Masked, int NT>
  __device__ __forceinline__ void weights(float (&s)[NT][4], const RowMask& mask) {
    namespace em = math::entmax;
#pragma unroll
    for (int n = 0; n < NT; ++n) {
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int half = i / 2, e = i % 2;
        // Invisible keys get a gap of -1: weight and u both 0.
        const float gap = !Masked || mask.visible<8 * NT>(half, n, e) ? fmaf(s[n][i], x_scale, -tau[half]) : -1.f;
        f[half] += em::weight(gap, alpha);
        sum_u[half] += em::grad_weight(gap, alpha);
      }
    }
  }

  template <int DT>
  __device__ __forceinline__ void finish(float (&)[DT][4], float (&)[2]) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      f[half] = tile::quad_sum(f[half]);
      sum_u[half] = tile::quad_sum(sum_u[half]);
    }
  }

  __device__ __forceinline__ void store_extra(const AttentionParams&, const ThresholdCudaConfig& cfg,
                                              std::int64_t b, std::int64_t row, std::int64_t h,
                                              std::int64_t, int half) const {
    if (done[half]) return;
    float4* st = cfg.state.at<float4>(b, row, h);
    math::entmax::ThresholdSearch<float> search(cfg.alpha, cfg.tolerance);
    search.lo = st->x;
    search.hi = st->y;
    search.tau = st->z;
    search.done = false;
    search.step(f[half], sum_u[half]);
    *st = make_float4(search.lo, search.hi, search.tau, search.done ? 1.f : 0.f);
    *cfg.result.at<float>(b, row, h) = search.tau * cfg.result_scale;
    if (!search.done) atomicOr(cfg.unfinished, 1);
  }
};

// The output sweep: p = [x - tau]_+^(1 / (alpha - 1)) with the row's final tau (absolute
// weights: no running maximum, no normalisation); the statistic is tau itself. With
// kGradWeights it weighs by u = p^(2 - alpha) instead and its statistic is sum_i u_i: the
// backward's first sweep, whose output U = sum_i u_i v_i gives delta = <dout, U> / sum_i u_i.
struct EntmaxCudaConfig {
  float alpha = 1.5f;
  detail::Operand tau;  // float per row, x units (the threshold sweeps' result)
};

template <bool kGradWeights>
struct EntmaxRowsOf {
  static constexpr bool kCanHalt = false;
  static constexpr bool kUsesValues = true;
  float x_scale, alpha;
  float tau[2], sum_u[2] = {0.f, 0.f};

  template <class Tile>
  __device__ __forceinline__ EntmaxRowsOf(const AttentionParams& p, const EntmaxCudaConfig& cfg,
                                          const Tile& qt, std::int64_t row0)
      : x_scale(static_cast<float>(p.scale) * (cfg.alpha - 1.f)), alpha(cfg.alpha) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const std::int64_t row = row0 + 8 * half;
      tau[half] = row < qt.s.q_len ? *cfg.tau.at<const float>(qt.b, qt.s.q_start + row, qt.h) : 0.f;
    }
  }

  template <bool Masked, int NT>
  __device__ __forceinline__ void weights(float (&s)[NT][4], const RowMask& mask) {
#pragma unroll
    for (int n = 0; n < NT; ++n) {
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int half = i / 2, e = i % 2;
        const float gap = !Masked || mask.visible<8 * NT>(half, n, e) ? fmaf(s[n][i], x_scale, -tau[half]) : -1.f;
        if constexpr (kGradWeights) {
          s[n][i] = math::entmax::grad_weight(gap, alpha);
          sum_u[half] += s[n][i];
        } else {
          s[n][i] = math::entmax::weight(gap, alpha);
        }
      }
    }
  }

  template <int DT>
  __device__ __forceinline__ void rescale(float (&)[DT][4]) const {}
  __device__ __forceinline__ bool can_halt() const { return false; }
  __device__ __forceinline__ bool halted(const RowMask&) const { return false; }

  template <int DT>
  __device__ __forceinline__ void finish(float (&)[DT][4], float (&stat)[2]) const {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      stat[half] = kGradWeights ? tile::quad_sum(sum_u[half]) : tau[half];
    }
  }

  __device__ __forceinline__ void store_extra(const AttentionParams&, const EntmaxCudaConfig&,
                                              std::int64_t, std::int64_t, std::int64_t,
                                              std::int64_t, int) const {}
};

using EntmaxRows = EntmaxRowsOf<false>;
using EntmaxGradWeightRows = EntmaxRowsOf<true>;

// The backward rows: P recomputed from tau, and dS = scale u (dP - delta) (math::entmax::
// grad_logit), delta_j = <dout_j, U_j> / sum_i u_ij from the grad-weight sweep.
struct EntmaxBackwardConfig {
  float alpha = 1.5f;
  detail::Operand weighted_values;  // U: like out (dtype T), rows of sum_i u_i v_i
  detail::Operand sum_u;            // float per row
};

template <class T>
struct EntmaxBackwardRows {
  float x_scale, scale, alpha;
  float tau[2], delta[2];

  template <class Tile>
  __device__ __forceinline__ EntmaxBackwardRows(const AttentionParams& p,
                                                const detail::GradientParams& g,
                                                const EntmaxBackwardConfig& cfg, const Tile& qt,
                                                std::int64_t row0, int tig)
      : x_scale(static_cast<float>(p.scale) * (cfg.alpha - 1.f)),
        scale(static_cast<float>(p.scale)),
        alpha(cfg.alpha) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const std::int64_t row = row0 + 8 * half;
      float partial = 0.f, total_u = 0.f;
      tau[half] = 0.f;
      if (row < qt.s.q_len) {
        const std::int64_t abs_row = qt.s.q_start + row;
        tau[half] = *p.stats.at<const float>(qt.b, abs_row, qt.h);
        total_u = *cfg.sum_u.at<const float>(qt.b, abs_row, qt.h);
        const T* u = cfg.weighted_values.at<const T>(qt.b, abs_row, qt.h);
        const T* d = g.dout.at<const T>(qt.b, abs_row, qt.h);
        for (int c = 2 * tig; c < p.dim_v; c += 8) {
          partial += tile::to_float(u[c]) * tile::to_float(d[c]) +
                     tile::to_float(u[c + 1]) * tile::to_float(d[c + 1]);
        }
      }
      partial = tile::quad_sum(partial);
      delta[half] = total_u > 0.f ? partial / total_u : 0.f;
    }
  }

  __device__ __forceinline__ std::int64_t first_key(int, const RowMask&) const { return 0; }

  template <bool Masked, int NT>
  __device__ __forceinline__ void grads(float (&s)[NT][4], float (&dp)[NT][4], const RowMask& mask) const {
    namespace em = math::entmax;
#pragma unroll
    for (int n = 0; n < NT; ++n) {
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int half = i / 2, e = i % 2;
        const float gap = !Masked || mask.visible<8 * NT>(half, n, e) ? fmaf(s[n][i], x_scale, -tau[half]) : -1.f;
        s[n][i] = em::weight(gap, alpha);
        dp[n][i] = scale * em::grad_logit(em::grad_weight(gap, alpha), dp[n][i], delta[half]);
      }
    }
  }
};

}  // namespace winnow::cuda
