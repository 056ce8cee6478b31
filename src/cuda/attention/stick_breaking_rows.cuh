// Stick-breaking as a row policy of the fused forward kernel (spec/stick-breaking.md), in
// log2 units. Per tile: cost = log2(1 + 2^z) of every visible key, an inclusive suffix sum of
// the costs along the keys (thread-local over the thread's consecutive keys, then one quad
// scan), log2 A = z - suffix + carry, and carry -= the tile's cost. The carry is the log2 of
// the stick left to the right of the tile; at the end it is log2 rem.
//
// Sieve (spec/sieve.md) is the same process over each row's candidates only: a Filter decides
// per score whether the key takes part; a key left out adds no cost and gets no weight.
#pragma once

#include <cmath>

#include "cuda/attention/backward.cuh"
#include "cuda/attention/forward.cuh"
#include "math/entmax.h"
#include "math/stick_breaking.h"

namespace winnow::cuda {

struct StickBreakingCudaConfig {
  float halt_cutoff = 0.f;    // natural-log units; 0: never halt
  detail::Operand kept_from;  // int32 per row; written by the forward when data != nullptr
};

// Sieve: stick-breaking without halting, over the keys whose score exceeds the row's threshold.
struct SieveCudaConfig : StickBreakingCudaConfig {
  detail::Operand threshold;  // float per row, score units (written by the threshold sweeps)
  detail::Operand count;      // int32 per row; the forward writes it when data != nullptr
};

// Every visible key takes part (stick-breaking).
struct EveryKey {
  static constexpr bool kCounts = false;
  template <class Tile>
  __device__ __forceinline__ EveryKey(const AttentionParams&, const StickBreakingCudaConfig&,
                                      const Tile&, std::int64_t) {}
  __device__ __forceinline__ bool keep(int, float) const { return true; }
};

// A row's candidates: keys with z > threshold, compared in the log2 units the rows work in.
struct SieveCandidates {
  static constexpr bool kCounts = true;
  float threshold_log2[2];
  template <class Tile>
  __device__ __forceinline__ SieveCandidates(const AttentionParams&, const SieveCudaConfig& cfg,
                                             const Tile& qt, std::int64_t row0) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const std::int64_t row = row0 + 8 * half;
      threshold_log2[half] =
          row < qt.s.q_len
              ? *cfg.threshold.at<const float>(qt.b, qt.s.q_start + row, qt.h) * static_cast<float>(M_LOG2E)
              : INFINITY;
    }
  }
  __device__ __forceinline__ bool keep(int half, float z_log2) const {
    return math::sieve::admitted(z_log2, threshold_log2[half]);
  }
};

template <class Filter>
struct StickBreakingRowsOf {
  static constexpr bool kCanHalt = !Filter::kCounts;
  static constexpr bool kUsesValues = true;
  // Stick-breaking without halting (which drops keys) packs; Sieve, whose thresholds come from
  // other kernels, does not.
  static bool packs_short_sequences(const StickBreakingCudaConfig& cfg, std::int64_t len) {
    return !Filter::kCounts && cfg.halt_cutoff <= 0.f && cfg.kept_from.sequences_end_to_end(len);
  }
  float scale_log2, cutoff_log2;
  float carry[2];
  int candidates[2] = {0, 0};  // this thread's kept keys per row (Sieve's count)
  Filter filter;

  template <class Config, class Tile>
  __device__ __forceinline__ StickBreakingRowsOf(const AttentionParams& p, const Config& cfg,
                                                 const Tile& qt, std::int64_t row0)
      : scale_log2(static_cast<float>(p.scale * M_LOG2E)),
        cutoff_log2(cfg.halt_cutoff * static_cast<float>(M_LOG2E)),
        filter(p, cfg, qt, row0) {
    carry[0] = carry[1] = 0.f;
  }

  // One pass from the thread's last key to its first turns each logit into
  //   z - (its cost + the costs of the thread's keys to its right),
  // in place, so no second array of costs is live beside the scores; the quad scan then
  // supplies the costs held by the threads to the right, and the carry the tiles to the right:
  //   log2 A = z - (in-tile inclusive suffix of costs) + carry   (math::log_weight).
  template <bool Masked, int NT>
  __device__ __forceinline__ void weights(float (&s)[NT][4], const RowMask& mask) {
    namespace sb = math::stick_breaking;
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      float right = 0.f;  // costs of this thread's keys right of the current one
#pragma unroll
      for (int n = NT - 1; n >= 0; --n) {
#pragma unroll
        for (int e = 1; e >= 0; --e) {
          float& z = s[n][2 * half + e];
          z *= scale_log2;
          const bool kept = (!Masked || mask.visible<8 * NT>(half, n, e)) && filter.keep(half, z);
          if constexpr (Filter::kCounts) candidates[half] += kept ? 1 : 0;
          // A key left out becomes -inf at once: its cost is then 0 and its weight 0 with no
          // select further on, so no predicate has to live across the loop (with one per
          // score, the compiler spilled them into registers and rebuilt them bit by bit).
          z = kept ? z : -INFINITY;
          right += sb::stick_cost_log2(z, tile::exp2_fast, tile::log2_fast);
          // math::log_weight without the shift, which is added below.
          z -= right;
        }
      }
      const tile::QuadScan quad = tile::quad_scan(right, mask.tig);
      const float shift = carry[half] - quad.after;
#pragma unroll
      for (int n = 0; n < NT; ++n) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          float& z = s[n][2 * half + e];
          z = tile::exp2_fast(z + shift);
        }
      }
      carry[half] -= quad.total;
    }
  }

  // Weights are absolute (no running maximum): the output never needs rescaling.
  template <int DT>
  __device__ __forceinline__ void rescale(float (&)[DT][4]) const {}

  __device__ __forceinline__ bool can_halt() const { return kCanHalt && cutoff_log2 > 0.f; }
  __device__ __forceinline__ bool halted(const RowMask& mask) const {
    return (mask.limit[0] < 0 || carry[0] < -cutoff_log2) &&
           (mask.limit[1] < 0 || carry[1] < -cutoff_log2);
  }

  template <int DT>
  __device__ __forceinline__ void finish(float (&)[DT][4], float (&stat)[2]) {
    stat[0] = carry[0] * static_cast<float>(M_LN2);
    stat[1] = carry[1] * static_cast<float>(M_LN2);
    if constexpr (Filter::kCounts) {
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        candidates[half] += __shfl_xor_sync(0xffffffffu, candidates[half], 1);
        candidates[half] += __shfl_xor_sync(0xffffffffu, candidates[half], 2);
      }
    }
  }

  // row is absolute; the thread's rows are the first and the ninth of its 16.
  template <class Config>
  __device__ __forceinline__ void store_extra(const AttentionParams&, const Config& cfg,
                                              std::int64_t b, std::int64_t row, std::int64_t h,
                                              std::int64_t kept_from, int half = 0) const {
    if (cfg.kept_from.data != nullptr) {
      *cfg.kept_from.template at<std::int32_t>(b, row, h) = static_cast<std::int32_t>(kept_from);
    }
    if constexpr (Filter::kCounts) {
      if (cfg.count.data != nullptr) *cfg.count.template at<std::int32_t>(b, row, h) = candidates[half];
    }
  }
};

using StickBreakingRows = StickBreakingRowsOf<EveryKey>;
using SieveRows = StickBreakingRowsOf<SieveCandidates>;

// The backward rows, sweeping key tiles left to right. Per row: a = log2 of the stick left to
// the right of the tiles visited so far, starting from log2 rem (the forward's statistic) and
// growing by each tile's cost; b = the sum of g_ij = A_ij dP_ij over the keys visited so far.
// Per tile, three passes over the thread's consecutive keys, in place:
//   right to left   cost, sigmoid(z) = exp2(z - cost), s <- z - (thread-local suffix of costs);
//                   a quad scan adds the other threads' costs:
//                   log2 A = z - (in-tile suffix) + (a + tile cost)          (math::log_weight)
//   left to right   A, g = A dP (into dp), the thread's sum of g; a quad scan of the sums
//   left to right   the running prefix of g again, dS = scale (g - sigmoid(z) (prefix + drem))
//                   (math::grad_logit_given_sigmoid)
// so only the sigmoids need an array of their own. A key the filter leaves out gets cost 0,
// sigmoid 0 and log weight -inf, hence g = 0 and dS = 0.
template <class T, class Filter>
struct StickBreakingBackwardRowsOf {
  static bool packs_short_sequences(const StickBreakingCudaConfig& cfg, std::int64_t len) {
    return StickBreakingRowsOf<Filter>::packs_short_sequences(cfg, len);
  }
  float scale_log2, scale;
  float stick[2], g_sum[2], dlog_rem[2];
  std::int64_t kept_from[2];
  int tig;
  Filter filter;

  template <class Config, class Tile>
  __device__ __forceinline__ StickBreakingBackwardRowsOf(const AttentionParams& p,
                                                         const detail::GradientParams& g,
                                                         const Config& cfg, const Tile& qt,
                                                         std::int64_t row0, int tig_)
      : scale_log2(static_cast<float>(p.scale * M_LOG2E)),
        scale(static_cast<float>(p.scale)),
        tig(tig_),
        filter(p, cfg, qt, row0) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const std::int64_t row = row0 + 8 * half;
      stick[half] = g_sum[half] = dlog_rem[half] = 0.f;
      kept_from[half] = 0;
      if (row >= qt.s.q_len) continue;
      const std::int64_t abs_row = qt.s.q_start + row;
      stick[half] = *p.stats.at<const float>(qt.b, abs_row, qt.h) * static_cast<float>(M_LOG2E);
      if (g.dstats.data != nullptr) dlog_rem[half] = *g.dstats.at<const float>(qt.b, abs_row, qt.h);
      if (cfg.halt_cutoff > 0.f && cfg.kept_from.data != nullptr) {
        kept_from[half] = *cfg.kept_from.template at<const std::int32_t>(qt.b, abs_row, qt.h);
      }
    }
  }

  __device__ __forceinline__ std::int64_t first_key(int half, const RowMask&) const {
    return kept_from[half];
  }

  template <bool Masked, int NT>
  __device__ __forceinline__ void grads(float (&s)[NT][4], float (&dp)[NT][4], const RowMask& mask) {
    namespace sb = math::stick_breaking;
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      float sigmoid[NT][2];
      float right = 0.f;  // costs of this thread's keys from the current one rightwards
#pragma unroll
      for (int n = NT - 1; n >= 0; --n) {
#pragma unroll
        for (int e = 1; e >= 0; --e) {
          float& z = s[n][2 * half + e];
          z *= scale_log2;
          const bool kept = (!Masked || mask.visible<8 * NT>(half, n, e)) && filter.keep(half, z);
          z = kept ? z : -INFINITY;  // cost 0, sigmoid 0, weight 0: as in the forward
          const float c = sb::stick_cost_log2(z, tile::exp2_fast, tile::log2_fast);
          sigmoid[n][e] = tile::exp2_fast(z - c);
          right += c;
          z -= right;
        }
      }
      const tile::QuadScan costs = tile::quad_scan(right, tig);
      const float stick_right = stick[half] + costs.total;
      const float shift = stick_right - costs.after;
      float g_thread = 0.f;
#pragma unroll
      for (int n = 0; n < NT; ++n) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int i = 2 * half + e;
          const float w = tile::exp2_fast(s[n][i] + shift);
          s[n][i] = w;
          dp[n][i] *= w;  // g
          g_thread += dp[n][i];
        }
      }
      const tile::QuadScan gs = tile::quad_scan(g_thread, tig);
      float prefix = g_sum[half] + gs.before + dlog_rem[half];
#pragma unroll
      for (int n = 0; n < NT; ++n) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int i = 2 * half + e;
          prefix += dp[n][i];
          const float ds = scale * sb::grad_logit_given_sigmoid(dp[n][i], sigmoid[n][e], prefix);
          dp[n][i] = !Masked || mask.visible<8 * NT>(half, n, e) ? ds : 0.f;
        }
      }
      stick[half] = stick_right;
      g_sum[half] += gs.total;
    }
  }
};

template <class T>
using StickBreakingBackwardRows = StickBreakingBackwardRowsOf<T, EveryKey>;
template <class T>
using SieveBackwardRows = StickBreakingBackwardRowsOf<T, SieveCandidates>;

}  // namespace winnow::cuda
