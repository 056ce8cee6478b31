// Stick-breaking as a row policy of the fused forward kernel (spec/stick-breaking.md), logits
// in log2 units, in one of two forms (the same weights; which is faster depends on what bounds
// the kernel):
// - log form (StickForm::log): cost = log2(1 + 2^z) of every visible key, an inclusive suffix
//   sum of the costs (thread-local, then one quad scan), log2 A = z - suffix + carry: three
//   special-function operations per score, one running value per row.
// - odds grown from the left (StickForm::odds_grown): one special-function operation a score.
//   Per tile and row a thread puts its keys' odds o = 2^z in place and grows their product
//   G = prod (1 + o) from its first key (math::grown_by, one FFMA a key); its weights among its
//   own keys are o_k H_k with H grown again from 1 / G, and its cost is log2 G. The quad scan
//   supplies the costs of the threads to the right, scaled in as one exp2 per thread and row.
//   Past math's kOddsProductCeiling (the thread's keys cost more than 116 bits, or one has a
//   logit past 120 in log2 units) the odds take the walk from the right instead (OddsStickWalk:
//   sigmoid times the keeps' product to the right, a reciprocal a key) and the cost is summed
//   key by key from the logits recomputed from memory (the kernel's Rescore): exact, rare, slow.
// Either way carry -= the tile's cost; the carry is the log2 of the stick left to the right of
// the tile, and at the end it is log2 rem. Measured (H200, docs/performance.md, 2026-11-28 and
// 29): the forward's bound is the special-function unit. A walk from the right in odds (two
// special-function operations a score) was 4-8% faster than the log form at head dimension 128
// and no faster at 64; growing from the left (one) is 10-16% faster again at 128 and 18-26% at
// 64.
//
// Sieve (spec/sieve.md) is the same process over each row's candidates only: a Filter decides
// per score whether the key takes part; a key left out adds no cost and gets no weight.
#pragma once

#include <cmath>
#include <type_traits>

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

// A thread's walk over its consecutive keys of one row from the right, in linear form (the
// backward's weights; the forward walks in odds, the same process with one running value): each
// key's weight among the thread's keys is its sigmoid times the product of the keeps to its
// right (math::stick_shares_log2), and the keys' total cost in log2 is
// sum(max(z, 0)) + log2(product of d), which neither overflows nor underflows. A key left out
// comes as z = -inf: weight 0, keep 1, no cost.
struct LinearStickWalk {
  float keep_right = 1.f;  // product of the keeps of the keys right of the current one
  float relu_sum = 0.f, d_product = 1.f;

  // The next key leftwards: its weight among the thread's keys, and its sigmoid.
  __device__ __forceinline__ float step(float z, float& sigmoid) {
    const math::stick_breaking::StickShares share =
        math::stick_breaking::stick_shares_log2(z, tile::exp2_fast, tile::rcp_fast);
    sigmoid = share.sigmoid;
    relu_sum += fmaxf(z, 0.f);
    d_product *= share.d;
    const float weight = share.sigmoid * keep_right;
    keep_right *= share.keep;
    return weight;
  }
  __device__ __forceinline__ float cost() const { return relu_sum + tile::log2_fast(d_product); }
};

// The walk in odds from the right (math::stick_shares_of_odds), the grown form's fallback: stick
// is the product of the keeps of the keys right of the current one; a key's weight among the
// thread's keys is its sigmoid times that.
struct OddsStickWalk {
  float stick = 1.f;
  __device__ __forceinline__ float step_odds(float odds) {
    const math::stick_breaking::StickOdds share =
        math::stick_breaking::stick_shares_of_odds(odds, tile::rcp_fast);
    const float weight = share.sigmoid * stick;
    stick *= share.keep;
    return weight;
  }
};

// How a row policy turns a thread's logits into its weights (see the top of this file).
enum class StickForm { log, odds_grown };

// No scores to recompute (the forms that never go back to them).
struct NoRescore {
  __device__ float operator()(int, std::int64_t) const { return 0.f; }
};

// kWideChainKeys: the grown form's chain length (math::grow_odds) where a thread holds 32 keys
// of a row per tile (the Hopper kernels); 0: one chain. With 16 (the portable kernels) it grows
// one chain: two spilled 28-64 bytes at D = 64 (ptxas, sm_90a, 2026-11-29).
template <class Filter, StickForm kForm, int kWideChainKeys = 0>
struct StickBreakingRowsOf {
  static constexpr bool kCanHalt = !Filter::kCounts;
  static constexpr bool kUsesValues = true;
  // The grown form takes a rare thread's cost from its scores recomputed by the kernel.
  static constexpr bool kRescores = kForm == StickForm::odds_grown;
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

  // rescore(half, key): the row's score against a key of the sequence, q . k, as the products
  // gave it (the grown form's fallback; the kernel's ScoresFromMemory).
  template <bool Masked, int NT, class Rescore = NoRescore>
  __device__ __forceinline__ void weights(float (&s)[NT][4], const RowMask& mask, const Rescore& rescore = {}) {
    namespace sb = math::stick_breaking;
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      if constexpr (kForm == StickForm::odds_grown) {
        static_assert(!std::is_same_v<Rescore, NoRescore>, "the grown form needs the kernel's scores (weigh_scores)");
        // Left to right: the odds in place (unclamped: math::grown_odds_log2), and their product
        // G grown from the thread's first key in chains (math::grow_odds).
        const auto odds = [&](int k) -> float& { return s[k / 2][2 * half + k % 2]; };
#pragma unroll
        for (int n = 0; n < NT; ++n) {
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            float& z = s[n][2 * half + e];
            z = sb::grown_odds_log2(admit<Masked, NT>(z, half, n, e, mask), tile::exp2_fast);
          }
        }
        constexpr int kChainKeys = 2 * NT == 32 ? kWideChainKeys : 0;
        const sb::GrownOdds<2 * NT, kChainKeys> grown = sb::grow_odds<2 * NT, kChainKeys>(odds);
        const bool grows = grown.total <= sb::kOddsProductCeiling;
        // The thread's cost, log2 G; past the ceiling (rare), from the logits.
        const float cost = grows ? tile::log2_fast(grown.total) : cost_from_memory<Masked, 8 * NT>(half, mask, rescore);
        // Its share of the row's stick, and H's start with the share in it, so that the weights
        // come out placed with no multiply a key.
        const float share = thread_share(half, cost, mask.tig);
        const float first = share * tile::rcp_fast(grown.total);
        if (grows && sb::folded_share_keeps_weights(first, share)) {
          // Left to right again: weight o_k H_k, each chain's H grown from its prefix over G.
          sb::weigh_grown_odds_from(odds, grown, first);
        } else {
          // Rare: the walk from the right on the same odds, clamped, and the share after it.
          OddsStickWalk walk;
#pragma unroll
          for (int n = NT - 1; n >= 0; --n) {
#pragma unroll
            for (int e = 1; e >= 0; --e) {
              float& w = s[n][2 * half + e];
              w = walk.step_odds(sb::clamp_odds(w)) * share;
            }
          }
        }
      } else {
        // One pass from the thread's last key to its first turns each logit into
        //   z - (its cost + the costs of the thread's keys to its right),
        // in place, so no second array of costs is live beside the scores; the quad scan then
        // supplies the costs held by the threads to the right, and the carry the tiles to the
        // right: log2 A = z - (in-tile inclusive suffix of costs) + carry   (math::log_weight).
        float right = 0.f;  // costs of this thread's keys right of the current one
#pragma unroll
        for (int n = NT - 1; n >= 0; --n) {
#pragma unroll
          for (int e = 1; e >= 0; --e) {
            float& z = s[n][2 * half + e];
            z = admit<Masked, NT>(z, half, n, e, mask);
            right += sb::stick_cost_log2(z, tile::exp2_fast, tile::log2_fast);
            z -= right;  // math::log_weight without the shift, which is added below
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
  }

  // The grown form's share of a thread in its row's stick, 2^(carry - the costs of the threads to
  // its right), and the carry past the tile's cost. Every thread of the quad calls it.
  __device__ __forceinline__ float thread_share(int half, float cost, int tig) {
    const tile::QuadScan quad = tile::quad_scan(cost, tig);
    const float share = tile::exp2_fast(carry[half] - quad.after);
    carry[half] -= quad.total;
    return share;
  }

  // The logit in log2 units if the key takes part, else -inf at once: sigmoid 0, keep 1 and no
  // cost follow with no select further on, so no predicate has to live across the loop (with
  // one per score, the compiler spilled them into registers and rebuilt them bit by bit).
  template <bool Masked, int NT>
  __device__ __forceinline__ float admit(float z, int half, int n, int e, const RowMask& mask) {
    z *= scale_log2;
    const bool kept = (!Masked || mask.visible<8 * NT>(half, n, e)) && filter.keep(half, z);
    if constexpr (Filter::kCounts) candidates[half] += kept ? 1 : 0;
    return kept ? z : -INFINITY;
  }

  // The odds walk's fallback: the cost of the thread's keys of this row (BK / 4 consecutive
  // keys) summed key by key in the log form, their logits recomputed from memory. A loop, not
  // unrolled: it is rare, and its code is paid at every call site.
  template <bool Masked, int BK, class Rescore>
  __device__ __forceinline__ float cost_from_memory(int half, const RowMask& mask, const Rescore& rescore) const {
    float cost = 0.f;
    const std::int64_t first = mask.key0 + key_of<BK>(mask.tig, 0, 0);
#pragma unroll 1
    for (int j = 0; j < BK / 4; ++j) {
      const std::int64_t key = first + j;
      if (Masked && (key < mask.first_key(half) || key > mask.limit[half])) continue;
      const float x = rescore(half, key) * scale_log2;
      if (filter.keep(half, x)) cost += math::stick_breaking::stick_cost_log2(x, tile::exp2_fast, tile::log2_fast);
    }
    return cost;
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

// Four chains of eight keys on Hopper at D = 64; at D = 128, where a consumer thread also holds
// 64 output accumulators, two chains already spilled 40-64 bytes (ptxas, 2026-11-29). The chains
// measured within 1% of one chain (H200, 2026-11-29: the other consumer warpgroup hides the
// chain's latency); they stay because that build is the one the suite ran on.
template <int D>
using StickBreakingRowsFor = StickBreakingRowsOf<EveryKey, StickForm::odds_grown, D == 64 ? 8 : 0>;
// Sieve takes the log form at both head dimensions. The grown form's fallback would filter
// recomputed logits, which could fall on the other side of the threshold than the first
// pass's; the linear form, with the filter's threshold and candidate count beside its three
// running values, spilled 164-200 bytes at D = 64, 70-88 spill instructions inside the sweep's
// loop (ptxas, 2026-11-29), against 16-20 bytes and none there in the log form.
template <int D>
using SieveRowsFor = StickBreakingRowsOf<SieveCandidates, StickForm::log>;

// The backward rows, sweeping key tiles left to right. Per row: a = log2 of the stick left to
// the right of the tiles visited so far, starting from log2 rem (the forward's statistic) and
// growing by each tile's cost; b = the sum of g_ij = A_ij dP_ij over the keys visited so far.
// Per tile, three passes over the thread's consecutive keys, in place:
//   right to left   the shares (math::stick_shares_log2), s <- sigmoid times the keeps to the
//                   right; a quad scan of the threads' costs, and A = s 2^(a + tile cost -
//                   the costs of the threads to the right)
//   left to right   A, g = A dP (into dp), the thread's sum of g; a quad scan of the sums
//   left to right   the running prefix of g again, dS = scale (g - sigmoid(z) (prefix + drem))
//                   (math::grad_logit_given_sigmoid)
// so only the sigmoids need an array of their own. A key the filter leaves out gets cost 0,
// sigmoid 0 and log weight -inf, hence g = 0 and dS = 0. The backward is bound by the
// special-function unit at both head dimensions, so it takes the linear shares at both: two
// operations per score instead of four, 5.5% faster at D 128 and 11-12% at D 64 than the log
// form (H200, 2026-11-28).
template <class T, class Filter>
struct StickBreakingBackwardRowsOf {
  static bool packs_short_sequences(const StickBreakingCudaConfig& cfg, std::int64_t len) {
    return StickBreakingRowsOf<Filter, StickForm::log>::packs_short_sequences(cfg, len);
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
      LinearStickWalk walk;  // as in the forward's weights
#pragma unroll
      for (int n = NT - 1; n >= 0; --n) {
#pragma unroll
        for (int e = 1; e >= 0; --e) {
          float& z = s[n][2 * half + e];
          z *= scale_log2;
          const bool kept = (!Masked || mask.visible<8 * NT>(half, n, e)) && filter.keep(half, z);
          z = walk.step(kept ? z : -INFINITY, sigmoid[n][e]);  // sigmoid 0, keep 1, weight 0
        }
      }
      const tile::QuadScan costs = tile::quad_scan(walk.cost(), tig);
      const float stick_right = stick[half] + costs.total;
      const float factor = tile::exp2_fast(stick_right - costs.after);
      float g_thread = 0.f;
#pragma unroll
      for (int n = 0; n < NT; ++n) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int i = 2 * half + e;
          const float w = s[n][i] * factor;
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
