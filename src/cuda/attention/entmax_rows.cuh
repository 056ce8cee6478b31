// alpha-entmax's row threshold on the matrix units, and entmax's weights, as row policies of
// the fused forward kernel (spec/entmax.md, spec/sieve.md).
//
// The threshold tau_j solves f(tau) = sum_i [x_ij - tau]_+^(1 / (alpha - 1)) = 1 with
// x = (alpha - 1) z. Each step of the search is one sweep of the fused kernel without values
// (kUsesValues false): S = Q K^T tile by tile on the matrix units, and per score and probe a
// few operations into the row's f and f' at that probe. The search of each row
// (math::entmax::ThresholdSearch with kCudaSearchProbes probes: bracket, the values at its ends,
// the next probes) lives in a global buffer between sweeps:
//   ThresholdStartRows   the row maximum; bound filter: threshold = max - eps, done;
//                        otherwise ThresholdSearch::start, its bracket's left end raised to
//                        a floor found from the row's largest scores
//   ThresholdCollectRows the keys above the floor, kept in shared memory, and the search run
//                        to its end on them, by solve_published_lists_kernel right after the
//                        sweep (the lists published to global memory) or at the sweep's end:
//                        one sweep settles every row whose keys fit
//   ThresholdStepRows    one step; raises `unfinished` while some row of the problem still
//                        moves. A block whose rows have all settled returns at once, so late
//                        sweeps cost only the blocks still searching (rows whose lists
//                        overflowed: flat rows with many keys near the maximum).
// The host runs start and collect, then the step sweep until no row moves (at most
// kMaxSearchSteps). Every sweep writes its current threshold to `result` (scaled by
// result_scale: 1 for entmax's tau, 1 / (alpha - 1) for Sieve's score-unit threshold), so the
// last one leaves the answer. The sweeps keep raw scores q . k (maxima, candidate lists), which
// order like x only for a positive scale: other scales take the simple path
// (threshold_search_applies).
#pragma once

#include <cmath>
#include <cstdint>

#include "cuda/attention/forward.cuh"
#include "cuda/attention/key_tiles.cuh"
#include "math/entmax.h"
#include "winnow/entmax.h"

namespace winnow::cuda {

using CudaThresholdSearch = math::entmax::ThresholdSearch<float, math::entmax::kCudaSearchProbes>;

// A search between sweeps: its eight numbers (done is implied by them).
struct SavedSearch {
  float4 bracket;  // lo, hi, first, last
  float4 ends;     // f_lo, u_lo, f_hi, u_hi

  __device__ __forceinline__ void save(const CudaThresholdSearch& s) {
    bracket = make_float4(s.lo, s.hi, s.first, s.last);
    ends = make_float4(s.f_lo, s.u_lo, s.f_hi, s.u_hi);
  }
  __device__ __forceinline__ void restore(CudaThresholdSearch& s) const {
    s.lo = bracket.x, s.hi = bracket.y, s.first = bracket.z, s.last = bracket.w;
    s.f_lo = ends.x, s.u_lo = ends.y, s.f_hi = ends.z, s.u_hi = ends.w;
  }
  __device__ __forceinline__ bool settled() const { return !(bracket.y > bracket.x); }
};

// A row whose search the collect sweep left to solve_published_lists_kernel: each of its quad's
// four threads' lists as a stretch of ThresholdCudaConfig::list_pool. count[0] = -1: the sweep
// searched the row itself (or the row overflowed its lists). Rows the first sweep settled, in
// blocks the collect sweep skips, have none written: their SavedSearch says settled.
struct PublishedList {
  int offset[4];
  int count[4];
};

// Visits a thread's scores of one tile, (n, i) for s[n][i], with alpha's family fixed at compile
// time: fn(family, n, i). The loops stay fully unrolled for each family.
template <int NT, class Fn>
__device__ __forceinline__ void for_each_score(float alpha, Fn&& fn) {
  math::entmax::with_family(alpha, [&](auto family) {
#pragma unroll
    for (int n = 0; n < NT; ++n) {
#pragma unroll
      for (int i = 0; i < 4; ++i) fn(family, n, i);
    }
  });
}

// The scores as gaps x - tau (x = (alpha - 1) z), invisible keys at -infinity where every
// weight function is 0: fn(family, n, i, half, gap).
template <bool Masked, int NT, class Fn>
__device__ __forceinline__ void for_each_gap(const float (&s)[NT][4], const RowMask& mask, float x_scale,
                                             const float (&tau)[2], float alpha, Fn&& fn) {
  for_each_score<NT>(alpha, [&](auto family, int n, int i) {
    const int half = i / 2, e = i % 2;
    const float gap = !Masked || mask.visible<8 * NT>(half, n, e) ? fmaf(s[n][i], x_scale, -tau[half]) : -INFINITY;
    fn(family, n, i, half, gap);
  });
}

// As for_each_gap, but fn gets tau - x (+infinity for invisible keys), from an fma of its own
// rather than by negating the gap (-(+0) is -0): its sign bit is then set exactly where the gap
// is positive, for a tau that is not -0 (never_negative_zero), NaN scores aside (the GPU's NaN
// is positive). A support bit is then one funnel shift (SupportBitsOfTile::push) instead of a
// compare and a predicated add, and the weights take the gap as -below, a free operand
// negation.
template <bool Masked, int NT>
__device__ __forceinline__ float gap_below(const float (&s)[NT][4], const RowMask& mask, float x_scale,
                                           const float (&tau)[2], int n, int i) {
  const int half = i / 2, e = i % 2;
  return !Masked || mask.visible<8 * NT>(half, n, e) ? fmaf(s[n][i], -x_scale, tau[half]) : INFINITY;
}
template <bool Masked, int NT, class Fn>
__device__ __forceinline__ void for_each_gap_below(const float (&s)[NT][4], const RowMask& mask, float x_scale,
                                                   const float (&tau)[2], float alpha, Fn&& fn) {
  for_each_score<NT>(alpha, [&](auto family, int n, int i) {
    fn(family, n, i, i / 2, gap_below<Masked>(s, mask, x_scale, tau, n, i));
  });
}

// t, with -0 made +0: for_each_gap_below's fma gives -0 only for a zero product and tau = -0.
// (An addition, not a compare: x + 0 is not folded away, since it is not x for x = -0.)
__device__ __forceinline__ float never_negative_zero(float t) { return t + 0.f; }

struct ThresholdCudaConfig {
  float alpha = 1.5f, tolerance = 1e-5f;
  bool bound = false;  // Sieve's bound filter: threshold = max - eps, in score units
  float eps = 2.f;
  detail::Operand state;     // SavedSearch per row
  detail::Operand result;    // float per row
  float result_scale = 1.f;  // result = tau * result_scale (bound: the threshold itself)
  int* unfinished = nullptr;
  TileMaxMap tile_max;       // recorded by the first sweep when data != nullptr (key_tiles.cuh)
  // Given (entmax with a support record): [0] += each row's support size, at most the list
  // length of winnow/entmax.h; [1] = 1 where a support is longer; [2] = 1 where a row's support
  // was not counted (a row the first sweep settled with more than one visible key, which only
  // rounding allows). The first sweep counts the rows it settles (one visible key: one key), the
  // collect sweep those it settles. The host reads them with the collect sweep's flag, so that
  // entmax's backward knows the support record's totals without reading it back.
  int* support_totals = nullptr;
  // Given (the collect sweep): the pool its warps publish their lists to (ThresholdCollectRows::
  // publish), pool_capacity floats, pool_used the floats reserved (from zero), and a
  // PublishedList per row. Null: the collect sweep searches every row itself.
  float* list_pool = nullptr;
  int* pool_used = nullptr;
  int pool_capacity = 0;
  detail::Operand published;
};

// Adds a warp's rows' support sizes into support_totals (see ThresholdCudaConfig). `size`: the
// row's size on one thread of each row's quad (tig 0), 0 elsewhere; `longer`: some row's list
// overflows. Every lane of the warp calls it.
__device__ __forceinline__ void add_support_sizes(int* support_totals, int size, bool longer) {
  const int warp_size = __reduce_add_sync(0xffffffffu, size);
  const bool any_longer = __any_sync(0xffffffffu, longer);
  if ((threadIdx.x & 31) == 0) {
    if (warp_size > 0) atomicAdd(support_totals, warp_size);
    if (any_longer) atomicOr(support_totals + 1, 1);
  }
}

// What every threshold sweep shares: no values, no halting, nothing to rescale.
struct ThresholdSweepRows {
  static constexpr bool kCanHalt = false;
  static constexpr bool kUsesValues = false;
  template <int DT>
  __device__ __forceinline__ void rescale(float (&)[DT][4]) const {}
  __device__ __forceinline__ bool can_halt() const { return false; }
  __device__ __forceinline__ bool halted(const RowMask&) const { return false; }
};

// The first sweep: each row's maximum and, from its few largest scores, a floor under its
// threshold (math::entmax::threshold_floor) that the collect sweep filters keys by. Per tile,
// each thread takes the maximum of its scores of each row (one max per score, the only
// per-score work), and keeps the two largest of those tile maxima per row; the quad's union of
// 8 bounds the threshold closely enough that only a few dozen keys per row pass the filter on
// random scores at 16K keys (against ~500 above m - 1). Any subset of a row's keys gives a
// floor, and the top two tile maxima differ from the top two scores only where a thread's two
// largest scores share a tile. The larger of a tile's two row maxima is the block's largest
// score in that cell of keys, from which the output sweep learns which key tiles it may skip
// (key_tiles.cuh). (Keeping the top two scores themselves and the tile maximum took four
// float max operations per score, which ran on the ALU pipe at half rate: an H200 profile of
// the sweep showed 273 FMNMX per warp and tile, the pipe 54% busy, and the matrix units 40%.)
struct ThresholdStartRows : ThresholdSweepRows {
  static constexpr bool kPairsTiles = true;  // forward_sm90.cuh: two key tiles a round
  static constexpr int kKept = 2;  // per thread and row
  float scale;
  float top[2][kKept] = {{-INFINITY, -INFINITY}, {-INFINITY, -INFINITY}};  // raw scores q . k
  float quad_top[2][4 * kKept];    // the quad's, after finish
  std::int64_t visible[2];         // keys the row sees
  int* cell_max;                   // this block's row of the tile-max map, or null

  template <class Tile>
  __device__ __forceinline__ ThresholdStartRows(const AttentionParams& p, const ThresholdCudaConfig& cfg,
                                                const Tile& qt, std::int64_t row0)
      : scale(static_cast<float>(p.scale)),
        cell_max(cfg.tile_max.data != nullptr ? cfg.tile_max.block_row(qt.b, qt.h, p.heads_q, qt.r0) : nullptr) {
    visible[0] = qt.limit(p, row0) + 1;
    visible[1] = qt.limit(p, row0 + 8) + 1;
  }

  template <bool Masked, int NT>
  __device__ __forceinline__ void weights(float (&s)[NT][4], const RowMask& mask) {
    static_assert(kKept == 2, "the update below keeps two");
    static_assert(NT % 4 == 0, "four partial maxima per row");
    // Four partial maxima per row, so that the maxima are not one chain of 2 NT per row.
    float part[2][4];
#pragma unroll
    for (int n = 0; n < NT; ++n) {
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int half = i / 2, e = i % 2;
        const float v = !Masked || mask.visible<8 * NT>(half, n, e) ? s[n][i] : -INFINITY;
        float& m = part[half][n % 4];
        m = n < 4 && e == 0 ? v : fmaxf(m, v);
      }
    }
    float row_max[2];
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const float m = fmaxf(fmaxf(part[half][0], part[half][1]), fmaxf(part[half][2], part[half][3]));
      row_max[half] = m;
      top[half][1] = fmaxf(top[half][1], fminf(top[half][0], m));
      top[half][0] = fmaxf(top[half][0], m);
    }
    const float tile_max = fmaxf(row_max[0], row_max[1]);
    if (cell_max != nullptr) {
      // ordered_int keeps the order, so one warp reduction on ints gives the warp's maximum.
      const int warp_max = __reduce_max_sync(0xffffffffu, ordered_int(tile_max));
      if ((threadIdx.x & 31) == 0 && warp_max > ordered_int(-INFINITY)) {
        atomicMax(cell_max + mask.key0 / kCellKeys, warp_max);
      }
    }
  }

  template <int DT>
  __device__ __forceinline__ void finish(float (&)[DT][4], float (&)[2]) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
#pragma unroll
      for (int t = 0; t < 4; ++t) {
#pragma unroll
        for (int k = 0; k < kKept; ++k) {
          quad_top[half][kKept * t + k] = t == 0 ? top[half][k] : __shfl_xor_sync(0xffffffffu, top[half][k], t);
        }
      }
    }
  }

  __device__ __forceinline__ void store_extra(const AttentionParams&, const ThresholdCudaConfig& cfg,
                                              std::int64_t b, std::int64_t row, std::int64_t h,
                                              std::int64_t, int half) const {
    float z_max = -INFINITY;
    for (int k = 0; k < 4 * kKept; ++k) z_max = fmaxf(z_max, quad_top[half][k]);
    z_max *= scale;
    CudaThresholdSearch search(cfg.alpha, cfg.tolerance);  // done: a row that sees no key
    float result = 0.f;
    if (visible[half] > 0) {
      if (cfg.bound) {
        result = z_max - cfg.eps;
      } else {
        float x[4 * kKept];
        const float x_scale = scale * (cfg.alpha - 1.f);
        for (int k = 0; k < 4 * kKept; ++k) x[k] = quad_top[half][k] * x_scale;
        float floor = -INFINITY;
        math::entmax::with_family(cfg.alpha, [&](auto family) {
          floor = math::entmax::threshold_floor(family, x);
        });
        search.start((cfg.alpha - 1.f) * z_max, static_cast<float>(visible[half]), floor);
        result = search.tau() * cfg.result_scale;
        // A settled row is one the collect sweep does not see: one visible key, its support.
        if (cfg.support_totals != nullptr && search.done()) {
          if (visible[half] == 1) {
            atomicAdd(cfg.support_totals, 1);
          } else {
            atomicOr(cfg.support_totals + 2, 1);
          }
        }
      }
    }
    if (!cfg.bound) cfg.state.at<SavedSearch>(b, row, h)->save(search);
    *cfg.result.at<float>(b, row, h) = result;
  }
};

struct ThresholdStepRows : ThresholdSweepRows {
  static constexpr int K = CudaThresholdSearch::kProbes;
  float x_scale, alpha;
  float probe[2][K], f[2][K] = {}, sum_u[2][K] = {};
  bool done[2];

  // Blocks whose rows have all settled skip the sweep (forward.cuh asks before anything else).
  static constexpr bool kSkipsSettledBlocks = true;
  template <class Tile>
  __device__ __forceinline__ static bool settled(const AttentionParams&, const ThresholdCudaConfig& cfg,
                                                 const Tile& qt, std::int64_t row) {
    return row >= qt.s.q_len || cfg.state.at<const SavedSearch>(qt.b, qt.s.q_start + row, qt.h)->settled();
  }

  template <class Tile>
  __device__ __forceinline__ ThresholdStepRows(const AttentionParams& p, const ThresholdCudaConfig& cfg,
                                               const Tile& qt, std::int64_t row0)
      : x_scale(static_cast<float>(p.scale) * (cfg.alpha - 1.f)), alpha(cfg.alpha) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const std::int64_t row = row0 + 8 * half;
      float first = 0.f, last = 0.f;
      done[half] = true;
      if (row < qt.s.q_len) {
        const SavedSearch* saved = cfg.state.at<const SavedSearch>(qt.b, qt.s.q_start + row, qt.h);
        first = saved->bracket.z;
        last = saved->bracket.w;
        done[half] = saved->settled();
      }
#pragma unroll
      for (int k = 0; k < K; ++k) probe[half][k] = CudaThresholdSearch::probe_between(first, last, k);
    }
  }

  template <bool Masked, int NT>
  __device__ __forceinline__ void weights(float (&s)[NT][4], const RowMask& mask) {
    namespace em = math::entmax;
    const float no_shift[2] = {0.f, 0.f};  // gaps from 0: x itself, set against each probe
    for_each_gap<Masked>(s, mask, x_scale, no_shift, alpha, [&](auto family, int, int, int half, float x) {
#pragma unroll
      for (int k = 0; k < K; ++k) {
        const auto w = em::weight_and_grad(family, x - probe[half][k]);
        f[half][k] += w.p;
        sum_u[half][k] += w.u;
      }
    });
  }

  template <int DT>
  __device__ __forceinline__ void finish(float (&)[DT][4], float (&)[2]) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
#pragma unroll
      for (int k = 0; k < K; ++k) {
        f[half][k] = tile::quad_sum(f[half][k]);
        sum_u[half][k] = tile::quad_sum(sum_u[half][k]);
      }
    }
  }

  __device__ __forceinline__ void store_extra(const AttentionParams&, const ThresholdCudaConfig& cfg,
                                              std::int64_t b, std::int64_t row, std::int64_t h,
                                              std::int64_t, int half) const {
    if (done[half]) return;
    SavedSearch* saved = cfg.state.at<SavedSearch>(b, row, h);
    CudaThresholdSearch search(cfg.alpha, cfg.tolerance);
    saved->restore(search);
    search.step(f[half], sum_u[half]);
    saved->save(search);
    *cfg.result.at<float>(b, row, h) = search.tau() * cfg.result_scale;
    if (!search.done()) atomicOr(cfg.unfinished, 1);
  }
};

// What both collect sweeps do with a tile's scores: each visible key above its row's floor (raw
// scores q . k; the thread's rows row0 and row0 + 8 as half 0 and 1) goes to file(half, v), or,
// when Checked and room(half) says the row's list is full, raises full[half] instead. Unchecked
// where the caller knows both lists have room for the tile, so the test stays off each key's path.
template <bool Masked, bool Checked, int NT, class Room, class File>
__device__ __forceinline__ void file_above_floors(const float (&s)[NT][4], const RowMask& mask, const float (&floor)[2],
                                                  int (&full)[2], Room&& room, File&& file) {
#pragma unroll
  for (int n = 0; n < NT; ++n) {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int half = i / 2, e = i % 2;
      const float v = s[n][i];
      if (v > floor[half] && (!Masked || mask.visible<8 * NT>(half, n, e))) {
        if (!Checked || room(half)) {
          file(half, v);
        } else {
          full[half] = 1;
        }
      }
    }
  }
}

// One row's threshold from its quad's four lists of the keys above its floor (raw scores q . k:
// the collect sweep's lists in shared memory, or as it published them), exactly as a sweep
// would find it, since no key outside the lists lies above the floor: for sparsemax and
// 1.5-entmax by math::entmax::ListThreshold (exact), for other alphas by the sweeps' bracketed
// search (f and f' at K probes), the sums taken over the quad. A lane not `searching` takes part
// in the quad's sums only. Every lane of the warp calls it, and all run the same number of steps.
template <class Family, class List>
__device__ __forceinline__ void solve_on_lists(Family family, CudaThresholdSearch& search, bool searching,
                                               const List& list, float x_scale, float tolerance) {
  namespace em = math::entmax;
  constexpr em::Family F = Family::value;
  constexpr int K = CudaThresholdSearch::kProbes;
  if constexpr (F == em::Family::sparsemax || F == em::Family::entmax15) {
    em::ListThreshold<F, float> list_search(search.tau());
#pragma unroll 1
    for (int step = 0; step < em::kMaxSearchSteps; ++step) {
      const bool moving = searching && !list_search.done;
      if (!__any_sync(0xffffffffu, moving)) break;
      em::GapMoments<float> m;
      if (moving) {
        list.for_each([&](float v) { m.add(fmaf(v, x_scale, -list_search.tau)); });
      }
      m.count = tile::quad_sum(m.count);
      m.sum = tile::quad_sum(m.sum);
      if constexpr (F == em::Family::entmax15) m.sum_sq = tile::quad_sum(m.sum_sq);
      m.min = tile::quad_min(m.min);
      if (moving) list_search.step(m, tolerance);
    }
    // At the step limit tau is still a lower bound within Newton's reach of the root.
    if (searching) search.settle(list_search.tau);
  } else {
#pragma unroll 1
    for (int step = 0; step < em::kMaxSearchSteps; ++step) {
      const bool moving = searching && !search.done();
      if (!__any_sync(0xffffffffu, moving)) break;
      float f[K] = {}, u[K] = {};
      if (moving) {
        list.for_each([&](float v) {
#pragma unroll
          for (int k = 0; k < K; ++k) {
            // One rounding, spelled out: left to contraction, the kernel and the sweep rounded
            // x - probe differently (a last-bit difference in tau at alpha 1.3).
            const auto w = em::weight_and_grad(family, fmaf(v, x_scale, -search.probe(k)));
            f[k] += w.p;
            u[k] += w.u;
          }
        });
      }
#pragma unroll
      for (int k = 0; k < K; ++k) {
        f[k] = tile::quad_sum(f[k]);
        u[k] = tile::quad_sum(u[k]);
      }
      if (moving) search.step(f, u);
    }
  }
}

// The second sweep: every visible key above the row's floor (the bracket's left end) goes to
// the thread's list in shared memory; the threshold is then found on the lists (solve_on_lists),
// after the sweep (published to global memory for solve_published_lists_kernel) or at its end.
// A row whose lists overflow keeps its bracket and goes on with step sweeps.
struct ThresholdCollectRows : ThresholdSweepRows {
  static constexpr int K = CudaThresholdSearch::kProbes;
  // Per thread and row on Hopper. On random scores a thread's list at 16K keys averages about
  // 10 and reached 47 in 200000 simulated rows: at 48, a few of the 196608 rows of a 16K x 12
  // head problem overflowed, and each such row left the whole search to step sweeps (four,
  // 1.6 ms, measured). 64 fills the Hopper kernel's shared memory.
  static constexpr int kListLength = 64;
  static constexpr int kScratchBytes = kForwardBQ * 4 * kListLength * static_cast<int>(sizeof(float));
  static constexpr bool kSkipsSettledBlocks = true;
  template <class Tile>
  __device__ __forceinline__ static bool settled(const AttentionParams& p, const ThresholdCudaConfig& cfg,
                                                 const Tile& qt, std::int64_t row) {
    return ThresholdStepRows::settled(p, cfg, qt, row);
  }

  float x_scale, alpha, tolerance, result_scale;
  // The row's floor in units of raw scores q . k, so that a score is tested as it comes out of
  // the product.
  float floor[2];
  SavedSearch* state[2] = {nullptr, nullptr};  // null: the row is past the sequence or settled
  float* result[2];
  int* unfinished;
  // Shared addresses: each row's first slot, the next free one and the end. A key is filed with
  // one compare, one store and one add; a per-tile check for room keeps the end test off that
  // path. Lists hold raw scores.
  std::uint32_t list[2], next[2], end[2];
  int full[2] = {0, 0};           // a key found no room (ints: bools get packed into bytes)
  int stride = 0;                 // bytes between a list's entries
  // From finish, for counting the support (cfg.support_totals): the row's settled tau, or
  // +infinity (settled by the first sweep, which counted it; past the sequence; still searching).
  float count_tau[2] = {INFINITY, INFINITY};
  static constexpr bool kFinishesOutput = true;

  template <class Tile>
  __device__ __forceinline__ ThresholdCollectRows(const AttentionParams& p, const ThresholdCudaConfig& cfg,
                                                  const Tile& qt, std::int64_t row0)
      : x_scale(static_cast<float>(p.scale) * (cfg.alpha - 1.f)),
        alpha(cfg.alpha),
        tolerance(cfg.tolerance),
        result_scale(cfg.result_scale),
        unfinished(cfg.unfinished) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const std::int64_t row = row0 + 8 * half;
      floor[half] = INFINITY;
      if (row < qt.s.q_len) {
        SavedSearch* saved = cfg.state.at<SavedSearch>(qt.b, qt.s.q_start + row, qt.h);
        result[half] = cfg.result.at<float>(qt.b, qt.s.q_start + row, qt.h);
        if (!saved->settled()) {
          state[half] = saved;
          floor[half] = saved->bracket.x / x_scale;
        }
      }
    }
  }

  __device__ __forceinline__ void borrow_scratch(float* slot, int slot_stride, int slot_capacity) {
    stride = slot_stride * static_cast<int>(sizeof(float));
    list[0] = next[0] = tile::smem_address(slot);
    list[1] = next[1] = tile::smem_address(slot + 4 * 8);  // row + 8
    end[0] = list[0] + slot_capacity * stride;
    end[1] = list[1] + slot_capacity * stride;
  }

  template <bool Masked, int NT>
  __device__ __forceinline__ void weights(float (&s)[NT][4], const RowMask& mask) {
    // A thread files at most 2 NT keys per row and tile.
    const std::uint32_t need = 2 * NT * stride;
    if (next[0] + need <= end[0] && next[1] + need <= end[1]) {
      collect<Masked, false>(s, mask);
    } else {
      collect<Masked, true>(s, mask);
    }
  }

  template <bool Masked, bool Checked, int NT>
  __device__ __forceinline__ void collect(const float (&s)[NT][4], const RowMask& mask) {
    file_above_floors<Masked, Checked>(
        s, mask, floor, full, [&](int half) { return next[half] < end[half]; },
        [&](int half, float v) {
          tile::st_shared_f32(next[half], v);
          next[half] += stride;
        });
  }

  // The threshold search happens in finish_output, which has the config (the pool of
  // published lists); finish has nothing to add to a sweep without values.
  template <int DT>
  __device__ __forceinline__ void finish(float (&)[DT][4], float (&)[2]) const {}

  // A thread's list of a row in shared memory, for solve_on_lists.
  struct SharedList {
    std::uint32_t first, last, stride;
    template <class Fn>
    __device__ __forceinline__ void for_each(Fn&& fn) const {
      for (std::uint32_t a = first; a < last; a += stride) fn(tile::ld_shared_f32(a));
    }
  };

  // Where the warp's lists went: to the pool of published lists (ThresholdCudaConfig::
  // list_pool), for solve_published_lists_kernel to search at full occupancy, where the search
  // here runs with the matrix units idle and only the consumers' warps to hide its latency (an
  // H200 profile at 4K keys: 29% of the consumers' stall samples in it). Returns whether the
  // warp published (warp-uniform): every row of the warp still searching, or none, by one pool
  // reservation for the warp; when the pool has no room left, the rows are searched here. A
  // row published gets its four threads' stretches in its PublishedList.
  template <class Tile>
  __device__ __forceinline__ bool publish(const ThresholdCudaConfig& cfg, const Tile& qt, std::int64_t row0, int tig,
                                          const bool (&searching)[2]) const {
    if (cfg.list_pool == nullptr) return false;
    int n[2], mine = 0;
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      n[half] = searching[half] ? static_cast<int>((next[half] - list[half]) / static_cast<std::uint32_t>(stride)) : 0;
      mine += n[half];
    }
    const int lane = static_cast<int>(threadIdx.x & 31);
    const int total = static_cast<int>(__reduce_add_sync(0xffffffffu, static_cast<unsigned>(mine)));
    if (total == 0) return false;
    int base = 0;
    if (lane == 0) base = atomicAdd(cfg.pool_used, total);
    base = __shfl_sync(0xffffffffu, base, 0);
    // (pool_used may pass the capacity by the reservations that failed: they stay under 2^31,
    // every row's lists holding at most 4 x kListLength keys.)
    if (base > cfg.pool_capacity - total) return false;
    int at = base + tile::warp_exclusive_sum(mine);
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      if (!searching[half]) continue;
      PublishedList* const meta = cfg.published.at<PublishedList>(qt.b, qt.s.q_start + row0 + 8 * half, qt.h);
      meta->offset[tig] = at;
      meta->count[tig] = n[half];
      for (std::uint32_t a = list[half]; a < next[half]; a += stride) cfg.list_pool[at++] = tile::ld_shared_f32(a);
    }
    return true;
  }

  // The rows' searches: published (see publish), or here, on the lists. Then the support sizes of
  // the rows settled here: the candidates with a positive gap, tested as the output sweep tests
  // them. Every lane of the warp calls it.
  template <class T, int DT, class Tile>
  __device__ __forceinline__ void finish_output(float (&)[DT][4], const AttentionParams&,
                                                const ThresholdCudaConfig& cfg, const Tile& qt, std::int64_t row0,
                                                int tig) {
    bool searching[2];
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const bool overflow = tile::quad_max(static_cast<float>(full[half])) > 0.f;
      searching[half] = state[half] != nullptr && !overflow;
    }
    const bool published = publish(cfg, qt, row0, tig, searching);
    namespace em = math::entmax;
    em::with_family(alpha, [&](auto family) {
#pragma unroll 1
      for (int half = 0; half < 2; ++half) {
        // Selects, not indexing by half: the loop is not unrolled, and an indexed member array
        // would live in local memory for the whole kernel.
        const SharedList rows_list{half == 0 ? list[0] : list[1], half == 0 ? next[0] : next[1],
                                   static_cast<std::uint32_t>(stride)};
        SavedSearch* const saved = half == 0 ? state[0] : state[1];
        const bool row_searching = half == 0 ? searching[0] : searching[1];
        CudaThresholdSearch search(alpha, tolerance);
        if (saved != nullptr) saved->restore(search);
        solve_on_lists(family, search, row_searching && !published, rows_list, x_scale, tolerance);
        // A published row is left as it is: its search happens after this sweep. Every other
        // row still searching (its lists overflowed) says so in its PublishedList.
        const bool here = saved != nullptr && !(published && row_searching);
        if (here && (threadIdx.x & 3) == 0) {
          saved->save(search);
          *(half == 0 ? result[0] : result[1]) = search.tau() * result_scale;
          if (!search.done()) atomicOr(unfinished, 1);
          if (cfg.list_pool != nullptr) {
            cfg.published.at<PublishedList>(qt.b, qt.s.q_start + row0 + 8 * half, qt.h)->count[0] = -1;
          }
        }
        // The tau the output sweep reads (result_scale is 1 for entmax, the only counter). A
        // row still searching raises `unfinished`, and the host then does not take the count.
        const float tau = here && search.done() ? search.tau() * result_scale : INFINITY;
        if (half == 0) {
          count_tau[0] = tau;
        } else {
          count_tau[1] = tau;
        }
      }
    });
    if (cfg.support_totals == nullptr) return;
    constexpr int kLength = static_cast<int>(entmax::kSupportListLength);
    int size = 0;
    bool longer = false;
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      int mine = 0;
      if (count_tau[half] < INFINITY) {
        for (std::uint32_t a = list[half]; a < next[half]; a += stride) {
          mine += fmaf(tile::ld_shared_f32(a), x_scale, -count_tau[half]) > 0.f ? 1 : 0;
        }
      }
      const int row_size = static_cast<int>(tile::quad_sum(static_cast<float>(mine)));
      if (tig == 0) size += min(row_size, kLength);
      longer = longer || row_size > kLength;
    }
    add_support_sizes(cfg.support_totals, size, longer);
  }

  __device__ __forceinline__ void store_extra(const AttentionParams&, const ThresholdCudaConfig&,
                                              std::int64_t, std::int64_t, std::int64_t,
                                              std::int64_t, int) const {}
};

// The collect sweep on Hopper when the pool holds every row's lists (ThresholdCudaConfig::
// list_pool, kListLength floats for each of a row's four threads): a thread files each key above
// its row's floor straight into its stretch of the pool, so the sweep lends no shared memory to
// lists and takes two key tiles a round over four stages, as the start sweep does (the lists in
// shared memory take the room of those stages: ThresholdCollectRows). Every row it does not
// leave to step sweeps is then searched by solve_published_lists_kernel.
struct ThresholdCollectToPoolRows : ThresholdSweepRows {
  static constexpr bool kPairsTiles = true;  // forward_sm90.cuh: two key tiles a round
  static constexpr int kListLength = ThresholdCollectRows::kListLength;
  static constexpr bool kSkipsSettledBlocks = true;
  static constexpr bool kFinishesOutput = true;
  template <class Tile>
  __device__ __forceinline__ static bool settled(const AttentionParams& p, const ThresholdCudaConfig& cfg,
                                                 const Tile& qt, std::int64_t row) {
    return ThresholdStepRows::settled(p, cfg, qt, row);
  }

  // The row's floor in raw scores q . k (+infinity: past the sequence or settled, nothing filed),
  // the thread's stretch of the pool, the keys filed there and whether one found no room.
  float floor[2] = {INFINITY, INFINITY};
  float* list[2] = {nullptr, nullptr};
  int count[2] = {0, 0};
  int full[2] = {0, 0};

  // Row (b, row, h)'s first float in the pool: rows in the order of its PublishedList.
  template <class Tile>
  __device__ __forceinline__ static float* stretch(const ThresholdCudaConfig& cfg, const Tile& qt, std::int64_t row,
                                                  int tig) {
    const PublishedList* const meta = cfg.published.at<const PublishedList>(qt.b, qt.s.q_start + row, qt.h);
    const std::int64_t flat = meta - static_cast<const PublishedList*>(cfg.published.data);
    return cfg.list_pool + (4 * flat + tig) * kListLength;
  }

  template <class Tile>
  __device__ __forceinline__ ThresholdCollectToPoolRows(const AttentionParams& p, const ThresholdCudaConfig& cfg,
                                                        const Tile& qt, std::int64_t row0) {
    const float x_scale = static_cast<float>(p.scale) * (cfg.alpha - 1.f);
    const int tig = static_cast<int>(threadIdx.x & 3);
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const std::int64_t row = row0 + 8 * half;
      if (row < qt.s.q_len) {
        const SavedSearch* saved = cfg.state.at<const SavedSearch>(qt.b, qt.s.q_start + row, qt.h);
        if (!saved->settled()) {
          floor[half] = saved->bracket.x / x_scale;
          list[half] = stretch(cfg, qt, row, tig);
        }
      }
    }
  }

  template <bool Masked, int NT>
  __device__ __forceinline__ void weights(float (&s)[NT][4], const RowMask& mask) {
    // A thread files at most 2 NT keys per row and tile: with that much room in both lists the
    // end test stays off the path of each key.
    if (count[0] + 2 * NT <= kListLength && count[1] + 2 * NT <= kListLength) {
      collect<Masked, false>(s, mask);
    } else {
      collect<Masked, true>(s, mask);
    }
  }

  template <bool Masked, bool Checked, int NT>
  __device__ __forceinline__ void collect(const float (&s)[NT][4], const RowMask& mask) {
    file_above_floors<Masked, Checked>(
        s, mask, floor, full, [&](int half) { return count[half] < kListLength; },
        [&](int half, float v) {
          tile::st_global_b32(reinterpret_cast<std::uint32_t*>(list[half] + count[half]), __float_as_uint(v));
          ++count[half];
        });
  }

  template <int DT>
  __device__ __forceinline__ void finish(float (&)[DT][4], float (&)[2]) const {}

  // Each searching row's stretches into its PublishedList, for solve_published_lists_kernel; a
  // row whose lists overflowed keeps its bracket for the step sweeps and says so there, as
  // ThresholdCollectRows does. Every lane of the warp calls it.
  template <class T, int DT, class Tile>
  __device__ __forceinline__ void finish_output(float (&)[DT][4], const AttentionParams&,
                                                const ThresholdCudaConfig& cfg, const Tile& qt, std::int64_t row0,
                                                int tig) const {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const bool overflow = tile::quad_max(static_cast<float>(full[half])) > 0.f;
      if (list[half] == nullptr) continue;
      const std::int64_t row = qt.s.q_start + row0 + 8 * half;
      PublishedList* const meta = cfg.published.at<PublishedList>(qt.b, row, qt.h);
      if (!overflow) {
        meta->offset[tig] = static_cast<int>(list[half] - cfg.list_pool);
        meta->count[tig] = count[half];
      } else if (tig == 0) {
        CudaThresholdSearch search(cfg.alpha, cfg.tolerance);
        cfg.state.at<const SavedSearch>(qt.b, row, qt.h)->restore(search);
        *cfg.result.at<float>(qt.b, row, qt.h) = search.tau() * cfg.result_scale;
        if (!search.done()) atomicOr(cfg.unfinished, 1);
        meta->count[0] = -1;
      }
    }
  }

  __device__ __forceinline__ void store_extra(const AttentionParams&, const ThresholdCudaConfig&,
                                              std::int64_t, std::int64_t, std::int64_t,
                                              std::int64_t, int) const {}
};

// A thread's stretch of the pool (solve_published_lists_kernel), its first kHeldListEntries
// entries in registers, loaded once and all at once, so that each step of the search goes over
// them without a load (read from memory at every step, the kernel took 0.056 ms at 4K keys on
// the H200, about what the search took in the sweep); the rest are read at each step. A
// thread's list at 4K keys holds about 14 on random scores. Held entries past the list's end are
// -infinity, a key below every threshold, which every use of an entry weighs at zero: the held
// part runs without a test per entry. With one, its branches took a third of the kernel's
// instructions, it needed 116 registers against 64 now, and the kernel took 0.103 ms at 4K keys
// (B 4, 12 heads; H200, 2026-11-30) against 0.051 now.
inline constexpr int kHeldListEntries = 16;
struct HeldList {
  float held[kHeldListEntries];
  const float* first;
  int n;
  __device__ __forceinline__ void load(const float* list, int entries) {
    first = list;
    n = entries;
#pragma unroll
    for (int i = 0; i < kHeldListEntries; ++i) held[i] = i < n ? __ldg(first + i) : -INFINITY;
  }
  template <class Fn>
  __device__ __forceinline__ void for_each(Fn&& fn) const {
#pragma unroll
    for (int i = 0; i < kHeldListEntries; ++i) fn(held[i]);
    for (int i = kHeldListEntries; i < n; ++i) fn(__ldg(first + i));
  }
};

// The searches the collect sweep published (ThresholdCollectRows::publish), a quad per row as
// in the sweep: each thread reads its stretch of the pool, the quad sums. Then what the sweep
// does for a row it settles: the state, the threshold, the flag when the search goes on, and
// the support size when counted. A grid of (row blocks, heads, sequences). With the pool
// collect sweep before it, entmax-1.5's forward kernels took 1.063-1.070 ms at 4K keys against
// 1.101-1.104 with the search in the sweep, and 3.025 against 3.148 ms at 16K (H200,
// 2026-11-30): the sweep 0.298 against 0.382, this kernel 0.051.
inline constexpr int kSolveRowsPerBlock = 64;
template <int RowsPerBlock = kSolveRowsPerBlock>
__global__ void __launch_bounds__(4 * RowsPerBlock)
    solve_published_lists_kernel(const AttentionParams p, const ThresholdCudaConfig cfg) {
  const int tig = static_cast<int>(threadIdx.x & 3);
  const std::int64_t b = blockIdx.z, h = blockIdx.y;
  const SequenceExtent s = p.sequence(b);
  const std::int64_t row = static_cast<std::int64_t>(blockIdx.x) * RowsPerBlock + threadIdx.x / 4;
  // Every lane stays to the end: the sums are quad shuffles, the support sizes a warp's.
  SavedSearch* saved = nullptr;
  const float* first = cfg.list_pool;
  int entries = 0;
  if (row < s.q_len) {
    SavedSearch* const state = cfg.state.at<SavedSearch>(b, s.q_start + row, h);
    if (!state->settled()) {
      const PublishedList* const meta = cfg.published.at<const PublishedList>(b, s.q_start + row, h);
      if (meta->count[0] >= 0) {
        saved = state;
        first = cfg.list_pool + meta->offset[tig];
        entries = meta->count[tig];
      }
    }
  }
  HeldList list;
  list.load(first, entries);
  const float x_scale = static_cast<float>(p.scale) * (cfg.alpha - 1.f);
  CudaThresholdSearch search(cfg.alpha, cfg.tolerance);
  if (saved != nullptr) saved->restore(search);
  math::entmax::with_family(cfg.alpha, [&](auto family) {
    solve_on_lists(family, search, saved != nullptr, list, x_scale, cfg.tolerance);
  });
  if (saved != nullptr && tig == 0) {
    saved->save(search);
    *cfg.result.at<float>(b, s.q_start + row, h) = search.tau() * cfg.result_scale;
    if (!search.done()) atomicOr(cfg.unfinished, 1);
  }
  if (cfg.support_totals == nullptr) return;
  constexpr int kLength = static_cast<int>(entmax::kSupportListLength);
  const float tau = saved != nullptr && search.done() ? search.tau() * cfg.result_scale : INFINITY;
  int mine = 0;
  if (tau < INFINITY) list.for_each([&](float v) { mine += fmaf(v, x_scale, -tau) > 0.f ? 1 : 0; });
  const int row_size = static_cast<int>(tile::quad_sum(static_cast<float>(mine)));
  add_support_sizes(cfg.support_totals, tig == 0 ? min(row_size, kLength) : 0, row_size > kLength);
}

// The output sweep: p = [x - tau]_+^(1 / (alpha - 1)) with the row's final tau (absolute
// weights: no running maximum, no normalisation); the statistic is tau itself. With
// kGradWeights it weighs by u = p^(2 - alpha) instead and its statistic is sum_i u_i: the
// backward's first sweep, whose output U = sum_i u_i v_i gives delta = <dout, U> / sum_i u_i.
// That sweep also marks the cells of keys where some row of the block has support (u > 0),
// so that the backward kernel skips the others.
struct EntmaxCudaConfig {
  float alpha = 1.5f;
  detail::Operand tau;  // float per row, x units (the threshold sweeps' result)
  SupportBits support;  // kGradWeights: set where u > 0, when bits != nullptr
};

template <bool kGradWeights>
struct EntmaxRowsOf {
  static constexpr bool kCanHalt = false;
  static constexpr bool kUsesValues = true;
  float x_scale, alpha;
  float tau[2], sum_u[2] = {0.f, 0.f};
  std::uint32_t* support;  // this block's bits, or null

  template <class Tile>
  __device__ __forceinline__ EntmaxRowsOf(const AttentionParams& p, const EntmaxCudaConfig& cfg,
                                          const Tile& qt, std::int64_t row0)
      : x_scale(static_cast<float>(p.scale) * (cfg.alpha - 1.f)),
        alpha(cfg.alpha),
        support(kGradWeights ? cfg.support.block_row(qt.b, qt.h, p.heads_q, qt.r0) : nullptr) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const std::int64_t row = row0 + 8 * half;
      tau[half] = row < qt.s.q_len ? *cfg.tau.at<const float>(qt.b, qt.s.q_start + row, qt.h) : 0.f;
    }
  }

  template <bool Masked, int NT>
  __device__ __forceinline__ void weights(float (&s)[NT][4], const RowMask& mask) {
    namespace em = math::entmax;
    float tile_u = 0.f;
    for_each_gap<Masked>(s, mask, x_scale, tau, alpha, [&](auto family, int n, int i, int half, float gap) {
      if constexpr (kGradWeights) {
        s[n][i] = em::grad_weight(family, gap);
        sum_u[half] += s[n][i];
        tile_u += s[n][i];
      } else {
        s[n][i] = em::weight(family, gap);
      }
    });
    if constexpr (kGradWeights) mark_support(support, mask.key0, tile_u > 0.f);
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
    for_each_gap<Masked>(s, mask, x_scale, tau, alpha, [&](auto family, int n, int i, int half, float gap) {
      const auto w = em::weight_and_grad(family, gap);
      s[n][i] = w.p;
      dp[n][i] = scale * em::grad_logit(w.u, dp[n][i], delta[half]);
    });
  }
};

}  // namespace winnow::cuda
