// Threshold attention (spec/threshold.md) as row policies of the fused kernels. The kernels see
// queries and keys already L2-normalized (threshold_attention.cuh writes them once per call), so
// a score is a cosine and a weight is relu(s - tau_j)^p with tau_j = beta sqrt(2 log n_j / D):
// no running maximum, no rescaling, no normalization of the output.
//
// In the forward and the row backward one launch is one view: TDA's second view runs as a
// second launch whose weights carry the factor -lambda (the forward adds its output into the
// first view's, the row backward adds its dV into the same accumulator), so the signed weights
// w1 - lambda w2 are never formed in one tile: see threshold_attention.cuh for what that costs.
// The key-stationary backward (ThresholdKeys) runs a launch per view too, and keeps TDA's first
// view's dV in fp32 for the second.
#pragma once

#include <cstdint>

#include "cuda/attention/backward.cuh"
#include "cuda/attention/backward_keys_sm90.cuh"
#include "cuda/attention/forward.cuh"
#include "cuda/attention/unit_norm_rows.cuh"
#include "math/threshold.h"

namespace winnow::cuda {

// Per (sequence, query head, row group of 16 and key tile): one bit, set where the screen
// (threshold_screen_sm90.cuh) left the tile dense for the group, so that the fused forward
// computes the group's weights there. Row groups cover whole blocks of kCellRows rows.
inline constexpr int kScreenGroupRows = 16;  // one warp's rows
struct DenseTileBits {
  std::uint32_t* bits = nullptr;
  int row_groups = 0, words = 0;  // per (sequence, head); per group

  template <class Tile>
  __device__ __forceinline__ std::uint32_t* group(const AttentionParams& p, const Tile& qt, std::int64_t row) const {
    return bits + ((qt.b * p.heads_q + qt.h) * row_groups + row / kScreenGroupRows) * words;
  }
};

struct ThresholdCudaConfig {
  float power = 2.f;
  float dim = 64.f;  // D of the threshold's sqrt(2 log n / D)
  const float* beta = nullptr;
  std::int64_t beta_head = 0;    // stride between heads (0: one beta for every head)
  const float* lambda = nullptr;  // set: this launch is TDA's second view, weights * -lambda
  std::int64_t lambda_head = 0;
  bool clamp_lambda = true;
  bool add_to_output = false;  // forward: out = out (the first view's) + this view's
  // Backward: dq through the normalization from the normalized queries and their inverse norms
  // ([batch row][head], negative where the norm was clipped at eps); dbeta's and (second view)
  // sum_ij dp_ij w_ij's parts per query head, one slot per warp of 16 query rows
  // ([head][parts_per_head], at the warp's first batch row), which a reduction in a fixed order
  // sums, so that the backward's results repeat bit for bit (fp32 atomics would add the parts
  // in whatever order they arrive).
  detail::Operand q_hat;
  const float* q_inv_norm = nullptr;
  float* beta_parts = nullptr;
  float* lambda_parts = nullptr;
  std::int64_t parts_per_head = 0;
  // Forward after the screen: where this launch computes a row group's weights; elsewhere the
  // screen has added them already (or they are exact zeros), so they are zeroed here.
  DenseTileBits dense;
  // With the screen: the blocks it left a dense tile, {sequence, head, query tile from the left},
  // and how many (ScreenedThresholdRows::listed_block). Null: every block of the grid runs.
  const int4* listed_blocks = nullptr;
  const int* listed_block_count = nullptr;
  // TDA's forward with both views in one launch (ThresholdTwoViewRows): the second view's
  // normalized queries and keys; lambda is set, and the launch's output is the whole of TDA's.
  detail::Operand q2_hat, k2_hat;
  // Forward: where its weights can be nonzero, for the backward (forward_sm90.cuh,
  // kRecordsSupport; the candidate pass). bits == nullptr: not recorded.
  TileSupport support;

  __device__ __forceinline__ float factor(std::int64_t h) const {
    return lambda == nullptr ? 1.f : -math::threshold::lambda_used(lambda[h * lambda_head], clamp_lambda);
  }
  // tau_j / beta for a query whose last visible key is `limit` (-1: none).
  __device__ __forceinline__ float unit(std::int64_t limit) const {
    return math::threshold::threshold_unit(static_cast<float>(limit + 1), dim);
  }
};

// Powers the kernels specialize: p = 2 (004's default) and p = 1 (ReLA) without a pow.
enum class ThresholdPower { one, two, general };

template <ThresholdPower P>
__device__ __forceinline__ float threshold_p(float power) {
  return P == ThresholdPower::two ? 2.f : P == ThresholdPower::one ? 1.f : power;
}

// The power a launch specializes on (a branch per tile, uniform over the block).
__device__ __forceinline__ ThresholdPower power_kind(float power) {
  return power == 2.f ? ThresholdPower::two : power == 1.f ? ThresholdPower::one : ThresholdPower::general;
}

struct ThresholdRows {
  static constexpr bool kCanHalt = false;
  static constexpr bool kUsesValues = true;
  // No score above tau: the tile's P V is not issued (where zero_tiles_likely on Hopper).
  static constexpr bool kSkipsZeroTiles = true;
  static constexpr bool kWritesStats = false;
  static constexpr bool kFinishesOutput = true;
  // Three key and value stages on Hopper (forward_sm90.cuh, kSm90ForwardStages).
  static constexpr int kStages = 3;
  // A tile's scores tell a zero tile before its weights do (forward_sm90.cuh): no score above
  // its row's tau (a NaN score is not above it, and weighs zero too).
  static constexpr bool kPrescreens = true;
  // The Hopper forward records cfg.support for the backward: every tile but those the same test
  // (any_above) found without a score above tau.
  static constexpr bool kRecordsSupport = true;
  float tau[2], factor, power;

  template <class Tile>
  __device__ __forceinline__ ThresholdRows(const AttentionParams& p, const ThresholdCudaConfig& cfg,
                                           const Tile& qt, std::int64_t row0)
      : factor(cfg.factor(qt.h)), power(cfg.power) {
    const float beta = cfg.beta[qt.h * cfg.beta_head];
#pragma unroll
    for (int half = 0; half < 2; ++half) tau[half] = beta * cfg.unit(qt.limit(p, row0 + 8 * half));
  }

  template <bool Masked, int NT>
  __device__ __forceinline__ void weights(float (&s)[NT][4], const RowMask& mask) {
    switch (power_kind(power)) {
      case ThresholdPower::two: return weights_p<ThresholdPower::two, Masked>(s, mask);
      case ThresholdPower::one: return weights_p<ThresholdPower::one, Masked>(s, mask);
      default: return weights_p<ThresholdPower::general, Masked>(s, mask);
    }
  }
  template <ThresholdPower P, bool Masked, int NT>
  __device__ __forceinline__ void weights_p(float (&s)[NT][4], const RowMask& mask) const {
    const float pw = threshold_p<P>(power);
#pragma unroll
    for (int n = 0; n < NT; ++n) {
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int half = i / 2, e = i % 2;
        const float x = !Masked || mask.visible<8 * NT>(half, n, e) ? s[n][i] - tau[half] : -INFINITY;
        s[n][i] = math::threshold::weight_and_slope(x, pw).weight;
      }
    }
  }

  // Whether the consumer whose first row is first_row votes on each tile's weights being all
  // zeros (kSkipsZeroTiles); its smallest threshold decides (math::threshold::zero_tiles_likely).
  template <class Tile>
  static __device__ __forceinline__ bool zero_tiles_likely(const AttentionParams& p, const ThresholdCudaConfig& cfg,
                                                           const Tile& qt, std::int64_t first_row) {
    const float tau = cfg.beta[qt.h * cfg.beta_head] * cfg.unit(qt.limit(p, first_row));
    return math::threshold::zero_tiles_likely(tau, cfg.dim);
  }

  // Whether some score of this thread's (an unmasked tile's) is above its row's tau: four
  // maxima, one per row and parity of n, so that no chain is longer than NT / 2.
  template <int NT>
  __device__ __forceinline__ bool any_score_above(const float (&s)[NT][4]) const {
    float m[2][2] = {{-INFINITY, -INFINITY}, {-INFINITY, -INFINITY}};
#pragma unroll
    for (int n = 0; n < NT; ++n) {
      m[0][n % 2] = fmaxf(m[0][n % 2], fmaxf(s[n][0], s[n][1]));
      m[1][n % 2] = fmaxf(m[1][n % 2], fmaxf(s[n][2], s[n][3]));
    }
    return fmaxf(m[0][0], m[0][1]) > tau[0] || fmaxf(m[1][0], m[1][1]) > tau[1];
  }
  // The forward's question (forward_sm90.cuh, kPrescreens), for the tile of keys from key0.
  template <int NT, class Second>
  __device__ __forceinline__ bool any_above(const float (&s)[NT][4], const Second&, std::int64_t) const {
    return any_score_above(s);
  }

  template <int DT>
  __device__ __forceinline__ void rescale(float (&)[DT][4]) const {}
  __device__ __forceinline__ bool can_halt() const { return false; }
  __device__ __forceinline__ bool halted(const RowMask&) const { return false; }

  template <int DT>
  __device__ __forceinline__ void finish(float (&o)[DT][4], float (&stat)[2]) const {
#pragma unroll
    for (int n = 0; n < DT; ++n) {
#pragma unroll
      for (int i = 0; i < 4; ++i) o[n][i] *= factor;
    }
    stat[0] = stat[1] = 0.f;
  }

  // TDA's second view: add the first view's output, already in out.
  template <class T, int DT, class Tile>
  __device__ __forceinline__ void finish_output(float (&o)[DT][4], const AttentionParams& p,
                                                const ThresholdCudaConfig& cfg, const Tile& qt,
                                                std::int64_t row0, int tig) const {
    if (!cfg.add_to_output) return;
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const std::int64_t row = row0 + 8 * half;
      if (row >= qt.s.q_len) continue;
      const T* prior = p.out.at<const T>(qt.b, qt.s.q_start + row, qt.h);
#pragma unroll
      for (int n = 0; n < DT; ++n) {
        o[n][2 * half] += tile::to_float(prior[8 * n + 2 * tig]);
        o[n][2 * half + 1] += tile::to_float(prior[8 * n + 2 * tig + 1]);
      }
    }
  }

  __device__ __forceinline__ void store_extra(const AttentionParams&, const ThresholdCudaConfig&,
                                              std::int64_t, std::int64_t, std::int64_t,
                                              std::int64_t, int) const {}
};

// TDA's forward with both views in one launch of the Hopper kernel (forward_sm90.cuh, kViews):
// per key tile both views' scores, combined into P = w1 - lambda w2 before the one P V, so V
// is read and multiplied once where two launches (ThresholdRows, a view each) multiply it
// twice and the second reads and rewrites the first's output. cfg.lambda is set; the factor
// the base policy would apply to a second view's output is the second view's weights' here.
struct ThresholdTwoViewRows : ThresholdRows {
  static constexpr int kViews = 2;
  static constexpr bool kFinishesOutput = false;
  float second_factor;  // -lambda

  template <class Tile>
  __device__ __forceinline__ ThresholdTwoViewRows(const AttentionParams& p, const ThresholdCudaConfig& cfg,
                                                  const Tile& qt, std::int64_t row0)
      : ThresholdRows(p, cfg, qt, row0), second_factor(factor) {
    factor = 1.f;
  }

  static __device__ __forceinline__ const detail::Operand& second_queries(const ThresholdCudaConfig& cfg) {
    return cfg.q2_hat;
  }
  static __device__ __forceinline__ const detail::Operand& second_keys(const ThresholdCudaConfig& cfg) {
    return cfg.k2_hat;
  }

  // Either view's score above tau.
  template <int NT>
  __device__ __forceinline__ bool any_above(const float (&s)[NT][4], const float (&s2)[NT][4], std::int64_t) const {
    return any_score_above(s) || any_score_above(s2);
  }

  template <bool Masked, int NT>
  __device__ __forceinline__ void weights2(float (&s)[NT][4], const float (&s2)[NT][4], const RowMask& mask) {
    switch (power_kind(power)) {
      case ThresholdPower::two: return weights2_p<ThresholdPower::two, Masked>(s, s2, mask);
      case ThresholdPower::one: return weights2_p<ThresholdPower::one, Masked>(s, s2, mask);
      default: return weights2_p<ThresholdPower::general, Masked>(s, s2, mask);
    }
  }
  template <ThresholdPower P, bool Masked, int NT>
  __device__ __forceinline__ void weights2_p(float (&s)[NT][4], const float (&s2)[NT][4], const RowMask& mask) const {
    const float pw = threshold_p<P>(power);
#pragma unroll
    for (int n = 0; n < NT; ++n) {
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int half = i / 2, e = i % 2;
        const bool visible = !Masked || mask.visible<8 * NT>(half, n, e);
        const float w1 = math::threshold::weight_and_slope(visible ? s[n][i] - tau[half] : -INFINITY, pw).weight;
        const float w2 = math::threshold::weight_and_slope(visible ? s2[n][i] - tau[half] : -INFINITY, pw).weight;
        s[n][i] = fmaf(second_factor, w2, w1);
      }
    }
  }
};

// The fused forward after the screen (threshold_screen_sm90.cuh): the weights of a row group
// only in the key tiles the screen left dense for it (cfg.dense), zero elsewhere (the
// screen has added them already, or they are exact zeros); a block whose row groups have no
// dense tile returns at once, the screen having written its output whole. A policy of its own
// so that the unscreened forward carries none of it.
struct ScreenedThresholdRows : ThresholdRows {
  static constexpr bool kSkipsSettledBlocks = true;
  static constexpr bool kListsBlocks = true;
  const std::uint32_t* dense_row;  // this thread's row group's dense tiles

  // The launch's blocks take the screen's listed ones in turn, the rest return at once: the full
  // grid with every block reading its rows' dense bits took 0.029 ms at 4K and 16K alike (H200,
  // session 83), about twelve waves of blocks that found none.
  template <int BQ>
  static __device__ __forceinline__ bool listed_block(const AttentionParams& p, const ThresholdCudaConfig& cfg,
                                                      uint3* block) {
    // The list holds the screen's 128-row tiles; a kernel of other tiles runs its whole grid.
    if (BQ != kCellRows || cfg.listed_blocks == nullptr) return true;
    // Many listed (a low beta, most tiles dense): the grid's own order, in which the blocks
    // running at once share a few heads' keys and values in L2; the list's order (the screen's:
    // every head at once) would stream them all from memory.
    const unsigned count = static_cast<unsigned>(*cfg.listed_block_count);
    if (8 * count > gridDim.x * gridDim.y * gridDim.z) return true;
    const unsigned linear = blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z);
    if (linear >= count) return false;
    const int4 e = cfg.listed_blocks[linear];
    *block = QueryTile<BQ, kCellKeys>::block_of(p, e.x, e.y, e.z);
    return true;
  }

  template <class Tile>
  __device__ __forceinline__ ScreenedThresholdRows(const AttentionParams& p, const ThresholdCudaConfig& cfg,
                                                   const Tile& qt, std::int64_t row0)
      : ThresholdRows(p, cfg, qt, row0), dense_row(cfg.dense.group(p, qt, row0)) {}

  template <class Tile>
  static __device__ __forceinline__ bool settled(const AttentionParams& p, const ThresholdCudaConfig& cfg,
                                                 const Tile& qt, std::int64_t row) {
    const std::uint32_t* group = cfg.dense.group(p, qt, row);
    for (int w = 0; w < cfg.dense.words; ++w) {
      if (group[w] != 0) return false;
    }
    return true;
  }

  // Whether the screen left the tile of keys from key0 dense for this row group: only such a
  // tile has weights here.
  __device__ __forceinline__ bool dense_tile(std::int64_t key0) const {
    const std::int64_t cell = key0 / kCellKeys;
    return ((dense_row[cell >> 5] >> (cell & 31)) & 1u) != 0;
  }

  template <int NT, class Second>
  __device__ __forceinline__ bool any_above(const float (&s)[NT][4], const Second&, std::int64_t key0) const {
    return dense_tile(key0) && any_score_above(s);
  }

  template <bool Masked, int NT>
  __device__ __forceinline__ void weights(float (&s)[NT][4], const RowMask& mask) {
    if (!dense_tile(mask.key0)) {
      tile::zero(s);
      return;
    }
    ThresholdRows::weights<Masked>(s, mask);
  }
};

// The backward rows: P = factor w and dS = factor dP p relu(s - tau)^(p - 1), with the row sums
// that dbeta (-sum dS, times tau / beta) and dlambda (sum dP w) need, reduced at the end.
template <class T>
struct ThresholdBackwardRows {
  static constexpr bool kFinishesDq = true;
  float tau[2], unit[2], factor, power;
  float dtau[2] = {0.f, 0.f};  // -sum_i dS_ij over this thread's keys
  float lambda_dot = 0.f;      // second view: sum_ij dP_ij w_ij over this thread's entries
  bool second_view;

  template <class Tile>
  __device__ __forceinline__ ThresholdBackwardRows(const AttentionParams& p, const detail::GradientParams&,
                                                   const ThresholdCudaConfig& cfg, const Tile& qt,
                                                   std::int64_t row0, int)
      : factor(cfg.factor(qt.h)), power(cfg.power), second_view(cfg.lambda != nullptr) {
    const float beta = cfg.beta[qt.h * cfg.beta_head];
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      unit[half] = cfg.unit(qt.limit(p, row0 + 8 * half));
      tau[half] = beta * unit[half];
    }
  }

  __device__ __forceinline__ std::int64_t first_key(int, const RowMask&) const { return 0; }

  template <bool Masked, int NT>
  __device__ __forceinline__ void grads(float (&s)[NT][4], float (&dp)[NT][4], const RowMask& mask) {
    switch (power_kind(power)) {
      case ThresholdPower::two: return grads_p<ThresholdPower::two, Masked>(s, dp, mask);
      case ThresholdPower::one: return grads_p<ThresholdPower::one, Masked>(s, dp, mask);
      default: return grads_p<ThresholdPower::general, Masked>(s, dp, mask);
    }
  }
  template <ThresholdPower P, bool Masked, int NT>
  __device__ __forceinline__ void grads_p(float (&s)[NT][4], float (&dp)[NT][4], const RowMask& mask) {
    const float pw = threshold_p<P>(power);
#pragma unroll
    for (int n = 0; n < NT; ++n) {
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int half = i / 2, e = i % 2;
        const bool visible = !Masked || mask.visible<8 * NT>(half, n, e);
        const auto ws = math::threshold::weight_and_slope(visible ? s[n][i] - tau[half] : -INFINITY, pw);
        const float ds = factor * dp[n][i] * ws.slope;
        lambda_dot += dp[n][i] * ws.weight;  // used by the second view only
        dtau[half] -= ds;
        s[n][i] = factor * ws.weight;
        dp[n][i] = ds;
      }
    }
  }

  // dq through the normalization, in place: (g - q_hat <q_hat, g>) / |q|; then this warp's
  // share of dbeta and of sum dP w into the per-head accumulators.
  template <int DT, class Tile>
  __device__ __forceinline__ void finish_dq(float (&dq)[DT][4], const AttentionParams& p,
                                            const ThresholdCudaConfig& cfg, const Tile& qt,
                                            std::int64_t row0, int tig) const {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const std::int64_t row = row0 + 8 * half;
      const bool in = row < qt.s.q_len;
      normalize_grad_row<T, DT>(dq, half, in ? cfg.q_hat.at<const T>(qt.b, qt.s.q_start + row, qt.h) : nullptr,
                                cfg.q_inv_norm + p.batch_row_q(qt.b, qt.s.q_start + row) * p.heads_q + qt.h, tig);
    }
    float beta_part = dtau[0] * unit[0] + dtau[1] * unit[1];
    float lambda_part = lambda_dot;
#pragma unroll
    for (int off = 16; off > 0; off /= 2) {
      beta_part += __shfl_xor_sync(0xffffffffu, beta_part, off);
      lambda_part += __shfl_xor_sync(0xffffffffu, lambda_part, off);
    }
    // Lane 0's rows start the warp's 16. A warp past its sequence's last row has parts of 0 and
    // a slot that may be the next sequence's first warp's: it writes nothing. The views' launches
    // run one after the other, so the second adds to the first's part without a race.
    if ((threadIdx.x & 31) == 0 && row0 < qt.s.q_len) {
      const std::int64_t slot = qt.h * cfg.parts_per_head + p.batch_row_q(qt.b, qt.s.q_start + row0);
      cfg.beta_parts[slot] += beta_part;
      if (second_view) cfg.lambda_parts[slot] += lambda_part;
    }
  }
};

// Threshold attention in the key-stationary Hopper backward (backward_keys_sm90.cuh), a launch
// per view. Row statistics: tau_j (padding rows +inf: weight 0) and tau_j / beta (padding 0),
// per (query head, sequence, padded row). Scores are cosines of the view's normalized rows (unit
// scale): dQ goes into the fp32 dq_hat ([batch row][head][dim]) and through the normalization
// afterwards; dK goes through it as it is stored. P is a template parameter (p = 2 and p = 1; any
// other power takes the row kernel) so the per-score work has no branch on it.
//
// TDA's second view: the kernel computes with the unsigned weights w2 and applies its factor
// -lambda where the sums leave a head: to dQ per tile, to dbeta's share per head, and to dK and
// dV as they are stored, which needs one lambda for all the block's heads (threshold_attention.cuh
// takes this kernel for TDA with one query head per kv head only). Then sum dP w2, which
// dlambda needs, is <V, W2^T dO> over the block's keys, from the dV registers as they are
// stored (summed per score beside P, with dbeta's share, it took ptxas to 140 bytes of spills at
// D 128; this form has 88-120, all but about six reloads a tile outside the loop).
// The first view leaves its dV in fp32 (dv_partial, [batch row][kv head][dim]) and the second
// adds it before storing: one rounding.
enum class KeysDv { store, write_partial, add_partial };

template <ThresholdPower P>
struct ThresholdKeys {
  // A tile where no score is above tau has P = 0 and dS = 0: its dV, dK and dQ products are
  // not issued (backward_keys_sm90.cuh), checked where the tile's first row's tau makes such
  // tiles likely.
  static constexpr bool kSkipsZeroTiles = true;
  static __device__ __forceinline__ bool zero_tiles_likely(float first_tau, const AttentionParams& p) {
    return math::threshold::zero_tiles_likely(first_tau, static_cast<float>(p.dim_qk));
  }
  detail::Operand q_hat, k_hat, dk;
  const float* k_inv = nullptr;
  float* dq_hat = nullptr;
  float* dv_partial = nullptr;
  KeysDv dv_mode = KeysDv::store;
  float power = 2.f;
  const float* lambda = nullptr;  // set: the second view, factor -lambda
  std::int64_t lambda_head = 0;
  bool clamp_lambda = true;
  float* dbeta = nullptr;       // per query head: sum of -dS tau / beta
  float* lambda_dot = nullptr;  // per query head: the second view's sum of dP w2
  float factor = 1.f;           // the current head's: 1, or -lambda in the second view
  float beta_part = 0.f;

  // Host and device: the host maps them for tensor copies.
  WINNOW_HD const detail::Operand& queries(const AttentionParams&) const { return q_hat; }
  WINNOW_HD const detail::Operand& keys(const AttentionParams&) const { return k_hat; }
  __device__ __forceinline__ void begin(const AttentionParams&, std::int64_t h) {
    factor = lambda == nullptr ? 1.f : -math::threshold::lambda_used(lambda[h * lambda_head], clamp_lambda);
  }
  // dS leaves grad divided by p (math::threshold::weight_and_slope_over_p: at p = 2 no 2 r a
  // score); every sum over it (dQ, dK, dbeta) is multiplied by kSlopeScale = p once instead.
  static constexpr float kSlopeScale = P == ThresholdPower::two ? 2.f : 1.f;
  __device__ __forceinline__ void grad(float& z, float& dp, float tau, float, bool visible) const {
    // A score left out (masked, or a padding row: tau = +inf) is x = -inf: weight and slope 0.
    const auto ws = math::threshold::weight_and_slope_over_p(visible ? z - tau : -INFINITY, threshold_p<P>(power));
    dp *= ws.slope;
    z = ws.weight;
  }
  // dbeta's share, -sum dS tau / beta, a column (query row) at a time once P is packed.
  template <int NT>
  __device__ __forceinline__ void after_grads(const float (&ds)[NT][4], const float* unit, int tig) {
#pragma unroll
    for (int n = 0; n < NT; ++n) {
      const float2 u = *reinterpret_cast<const float2*>(unit + 8 * n + 2 * tig);
      beta_part -= (ds[n][0] + ds[n][2]) * u.x + (ds[n][1] + ds[n][3]) * u.y;
    }
  }
  __device__ __forceinline__ float dq_scale() const { return factor * kSlopeScale; }
  // Called by every consumer thread at once: a warp's share into the head's accumulator.
  __device__ __forceinline__ void end(const AttentionParams&, std::int64_t h) {
    const float total = warp_sum(beta_part);
    if ((threadIdx.x & 31) == 0) atomicAdd(dbeta + h, factor * kSlopeScale * total);
    beta_part = 0.f;
  }
  static __device__ __forceinline__ float warp_sum(float x) {
#pragma unroll
    for (int off = 16; off > 0; off /= 2) x += __shfl_xor_sync(0xffffffffu, x, off);
    return x;
  }
  __device__ __forceinline__ float* dq_row(const AttentionParams& p, const KeysBackwardBuffers&,
                                           const SequenceExtent& seq, std::int64_t h, std::int64_t b,
                                           std::int64_t row) const {
    return dq_hat + (p.batch_row_q(b, seq.q_start + row) * p.heads_q + h) * p.dim_qk;
  }

  // dK through the normalization (normalize_grad_row), times the view's factor; dV as dv_mode
  // says. Every consumer thread calls it.
  template <class T, int D, int DT>
  __device__ __forceinline__ void store_keys(const AttentionParams& p, const detail::GradientParams& g,
                                             float (&dk_rows)[DT][4], float (&dv)[DT][4], std::int64_t b,
                                             const SequenceExtent& seq, std::int64_t hk, std::int64_t my_key,
                                             int tig) const {
    float v_dot_dv = 0.f;  // the second view: <V, W2^T dO> over this thread's entries
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const std::int64_t key = my_key + 8 * half;
      const bool in = key < seq.k_len;
      const std::int64_t key_row = p.batch_row_k(b, seq.k_start + key) * p.heads_kv + hk;
      normalize_grad_row<T, DT>(dk_rows, half, in ? k_hat.template at<const T>(b, seq.k_start + key, hk) : nullptr,
                                k_inv + key_row, tig);
      if (!in) continue;
      const float dk_scale = factor * kSlopeScale;
#pragma unroll
      for (int n = 0; n < DT; ++n) {
        dk_rows[n][2 * half] *= dk_scale;
        dk_rows[n][2 * half + 1] *= dk_scale;
      }
      if (dv_mode == KeysDv::store) continue;
      float2* const partial_row = reinterpret_cast<float2*>(dv_partial + key_row * p.dim_v + 2 * tig);
      const T* const v_row = p.v.at<const T>(b, seq.k_start + key, hk);
#pragma unroll
      for (int n = 0; n < DT; ++n) {
        float& v0 = dv[n][2 * half];
        float& v1 = dv[n][2 * half + 1];
        if (dv_mode == KeysDv::write_partial) {
          partial_row[4 * n] = make_float2(v0, v1);
        } else {
          v_dot_dv += tile::to_float(v_row[8 * n + 2 * tig]) * v0 + tile::to_float(v_row[8 * n + 2 * tig + 1]) * v1;
          const float2 first = partial_row[4 * n];
          v0 = first.x + factor * v0;
          v1 = first.y + factor * v1;
        }
      }
    }
    if (dv_mode == KeysDv::add_partial) {
      const float total = warp_sum(v_dot_dv);
      // One query head per kv head (threshold_attention.cuh): the sum is head hk's.
      if ((threadIdx.x & 31) == 0) atomicAdd(lambda_dot + hk * p.group_size(), total);
    }
    store_key_rows<T, DT>(dk.template at<T>(b, seq.k_start, hk), dk.row, dk_rows, seq.k_len, my_key, tig);
    if (dv_mode != KeysDv::write_partial) {
      store_key_rows<T, DT>(g.dv.at<T>(b, seq.k_start, hk), g.dv.row, dv, seq.k_len, my_key, tig);
    }
  }
};

}  // namespace winnow::cuda
