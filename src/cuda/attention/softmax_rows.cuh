// Softmax as a row policy of the fused forward kernel (spec/softmax.md): the online softmax in
// log2 units, a running maximum and sum per row, the output rescaled when the maximum moves.
#pragma once

#include <cmath>

#include "cuda/attention/backward.cuh"
#include "cuda/attention/forward.cuh"
#include "math/softmax.h"

namespace winnow::cuda {

struct SoftmaxConfig {};

struct SoftmaxRows {
  static constexpr bool kCanHalt = false;
  static constexpr bool kUsesValues = true;
  static bool packs_short_sequences(const SoftmaxConfig&, std::int64_t) { return true; }
  float scale_log2;
  float max[2], sum[2];
  float pending[2] = {1.f, 1.f};  // the output's rescale for the last tile's new maximum

  template <class Tile>
  __device__ __forceinline__ SoftmaxRows(const AttentionParams& p, const SoftmaxConfig&, const Tile&,
                                         std::int64_t)
      : scale_log2(static_cast<float>(p.scale * M_LOG2E)) {
    max[0] = max[1] = -INFINITY;
    sum[0] = sum[1] = 0.f;
  }

  // The running maximum is kept on raw scores (scale > 0 preserves order), so each weight
  // costs one fused multiply-add and one exp2: exp2(s * scale log2 e - max * scale log2 e).
  // The output's rescale for a moved maximum is left pending for rescale(o), so a kernel can
  // apply it once the product that is still adding into o has finished.
  template <bool Masked, int NT>
  __device__ __forceinline__ void weights(float (&s)[NT][4], const RowMask& mask) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      float tile_max = -INFINITY;
#pragma unroll
      for (int n = 0; n < NT; ++n) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          float& z = s[n][2 * half + e];
          if (Masked && !mask.visible<8 * NT>(half, n, e)) z = -INFINITY;
          tile_max = fmaxf(tile_max, z);
        }
      }
      const float new_max = fmaxf(max[half], tile::quad_max(tile_max));
      // A row that has seen no key keeps max -inf; shifting by 0 keeps exp2(-inf) = 0.
      const float shift = new_max == -INFINITY ? 0.f : new_max * scale_log2;
      pending[half] = tile::exp2_fast(max[half] * scale_log2 - shift);
      float tile_sum = 0.f;
#pragma unroll
      for (int n = 0; n < NT; ++n) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          float& z = s[n][2 * half + e];
          z = math::softmax::probability(fmaf(z, scale_log2, -shift), 0.f, tile::exp2_fast);
          tile_sum += z;
        }
      }
      sum[half] = sum[half] * pending[half] + tile_sum;  // quad-reduced once, in finish()
      max[half] = new_max;
    }
  }

  template <int DT>
  __device__ __forceinline__ void rescale(float (&o)[DT][4]) const {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
#pragma unroll
      for (int n = 0; n < DT; ++n) {
        o[n][2 * half] *= pending[half];
        o[n][2 * half + 1] *= pending[half];
      }
    }
  }

  __device__ __forceinline__ bool can_halt() const { return false; }
  __device__ __forceinline__ bool halted(const RowMask&) const { return false; }

  template <int DT>
  __device__ __forceinline__ void finish(float (&o)[DT][4], float (&stat)[2]) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const float total = tile::quad_sum(sum[half]);
      const float inv = total > 0.f ? 1.f / total : 0.f;
#pragma unroll
      for (int n = 0; n < DT; ++n) {
        o[n][2 * half] *= inv;
        o[n][2 * half + 1] *= inv;
      }
      stat[half] = total > 0.f
                       ? (max[half] * scale_log2 + tile::log2_fast(total)) * static_cast<float>(M_LN2)
                       : -INFINITY;
    }
  }

  __device__ __forceinline__ void store_extra(const AttentionParams&, const SoftmaxConfig&,
                                              std::int64_t, std::int64_t, std::int64_t,
                                              std::int64_t, int) const {}
};

// The backward rows: P = exp2(z - lse) recomputed from the saved log-sum-exp, and
// dS = scale * P (dP - delta), delta_j = <do_j, o_j>.
template <class T>
struct SoftmaxBackwardRows {
  static bool packs_short_sequences(const SoftmaxConfig&, std::int64_t) { return true; }
  float scale_log2, scale;
  float lse_log2[2], delta[2];

  template <class Tile>
  __device__ __forceinline__ SoftmaxBackwardRows(const AttentionParams& p,
                                                 const detail::GradientParams& g,
                                                 const SoftmaxConfig&, const Tile& qt,
                                                 std::int64_t row0, int tig)
      : scale_log2(static_cast<float>(p.scale * M_LOG2E)), scale(static_cast<float>(p.scale)) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const std::int64_t row = row0 + 8 * half;
      float partial = 0.f;
      lse_log2[half] = 0.f;
      if (row < qt.s.q_len) {
        const std::int64_t abs_row = qt.s.q_start + row;
        lse_log2[half] = *p.stats.at<const float>(qt.b, abs_row, qt.h) * static_cast<float>(M_LOG2E);
        const T* o = p.out.at<const T>(qt.b, abs_row, qt.h);
        const T* d = g.dout.at<const T>(qt.b, abs_row, qt.h);
        for (int c = 2 * tig; c < p.dim_v; c += 8) {
          partial += tile::to_float(o[c]) * tile::to_float(d[c]) +
                     tile::to_float(o[c + 1]) * tile::to_float(d[c + 1]);
        }
      }
      delta[half] = tile::quad_sum(partial);
    }
  }

  __device__ __forceinline__ std::int64_t first_key(int, const RowMask&) const { return 0; }

  template <bool Masked, int NT>
  __device__ __forceinline__ void grads(float (&s)[NT][4], float (&dp)[NT][4], const RowMask& mask) const {
#pragma unroll
    for (int n = 0; n < NT; ++n) {
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int half = i / 2, e = i % 2;
        const float pr = !Masked || mask.visible<8 * NT>(half, n, e)
                             ? math::softmax::probability(s[n][i] * scale_log2, lse_log2[half],
                                                          tile::exp2_fast)
                             : 0.f;
        s[n][i] = pr;
        dp[n][i] = scale * math::softmax::grad_logit(pr, dp[n][i], delta[half]);
      }
    }
  }
};

}  // namespace winnow::cuda
