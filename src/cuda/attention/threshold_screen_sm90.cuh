// The screen of threshold attention's forward on Hopper (sm_90a): sparsity used before the
// products, not after them.
//
// With beta near 1 well over 99% of the weights are exact zeros, but skipping P V for tiles
// without a survivor saves at most the half of the work that P V is: Q K^T must still be
// computed to know. The screen computes Q K^T with 8-bit operands instead (the rows quantized
// once per call, math/threshold.h: screen_*), at twice the 16-bit rate and half the bytes, and
// bounds how far each 8-bit product can be from the 16-bit score. A pair whose integer product
// is at or below its row's cut scores at most tau, so its weight is an exact zero; the few
// pairs above the cut ("candidates") get their exact score from the 16-bit rows and, when it
// clears tau, their weighted value row, on the CUDA cores. Per warp (16 rows) and key tile:
//   no candidate                nothing more;
//   a few (kSparseCandidates)   listed for the candidate pass (threshold_candidates_kernel,
//                               below), which handles them exactly after the screen;
//   many, or a row whose tau is within the bound (beta near 0, the first rows)
//                               the tile is "dense" for this warp: a bit in DenseTileBits, and the
//                               block's bit in live_bits, so the fused forward (forward_sm90.cuh
//                               with ThresholdRows) visits it afterwards and adds the warp's
//                               rows' weights for it, every other row's being zeroed there.
// A consumer warpgroup whose warps are all dense on the first (diagonal) tile gives up on its
// rows: every tile becomes dense for them (a low beta costs one 8-bit tile per block, not a
// whole screen). The candidate pass writes the output's candidates' part; the fused forward
// adds the dense tiles' part into it.
//
// Block: 128 query rows of one head, a producer warpgroup copying the 8-bit key tiles (natural
// key order, 128 keys x 128 bytes) into a ring of stages, and two consumer warpgroups of 64
// rows. Views = 2 (TDA) screens both views' products; a candidate of either view gets both
// exact scores and the weight w1 - lambda w2.
#pragma once

#include <climits>
#include <cstdint>

#include "cuda/attention/forward_sm90.cuh"
#include "cuda/attention/key_tiles.cuh"
#include "cuda/attention/threshold_rows.cuh"
#include "cuda/tile/hopper.cuh"
#include "cuda/tile/panel_tile.cuh"

namespace winnow::cuda {

inline constexpr int kScreenRowBytes = 128;  // int8 rows, zero past the head dimension
inline constexpr int kSparseCandidates = 24;  // per warp and key tile, above which the tile is dense
inline constexpr int kGroupCandidates = 256;  // per row group, over its key tiles; past them, dense

struct ThresholdScreenParams {
  ThresholdCudaConfig view;  // power, dim, beta; lambda set for TDA (the second view's factor)
  // Per view: the 16-bit normalized rows (the kernels' scores), the int8 rows
  // ([batch row][head][128 bytes]), per query row its {scale, error radius} ([batch row][head]),
  // per key tile the largest scale and error radius of its keys ([sequence][kv head][tile]).
  detail::Operand q_hat[2], k_hat[2], q8[2], k8[2];
  float2* q_meta[2] = {nullptr, nullptr};  // written by the normalization, read by the screen
  float2* tile_meta[2] = {nullptr, nullptr};
  int key_tiles = 0;  // tiles per (sequence, kv head) in tile_meta
  // The warps' dense tiles, and the blocks' live tiles in LiveKeyTiles' layout (as many words
  // per block as dense has per group). Both cleared before the launch.
  DenseTileBits dense;
  std::uint32_t* live_bits = nullptr;
  int q_blocks = 0;
  // Per row group (a warp's 16 rows, in DenseTileBits' order), the candidates the screen found
  // for the candidate pass: up to kGroupCandidates entries, key << 4 | row within the group, and
  // their count (cleared before the screen).
  std::uint32_t* candidates = nullptr;
  int* candidate_counts = nullptr;
  // Diagnostics (WINNOW_SCREEN_STATS): warp tiles screened, left dense, with candidates handled,
  // candidates handled. Null: not counted.
  unsigned long long* stats = nullptr;

  template <class Tile>
  __device__ __forceinline__ std::int64_t group_index(const AttentionParams& p, const Tile& qt, std::int64_t row) const {
    return (qt.b * p.heads_q + qt.h) * dense.row_groups + row / kScreenGroupRows;
  }

  // A query row's {scale, error radius}, and a key tile's largest.
  template <class Tile>
  __device__ __forceinline__ float2 row_bound(int v, const AttentionParams& p, const Tile& qt, std::int64_t row) const {
    return q_meta[v][p.batch_row_q(qt.b, qt.s.q_start + row) * p.heads_q + qt.h];
  }
  template <class Tile>
  __device__ __forceinline__ const float2* tile_bounds(int v, const AttentionParams& p, const Tile& qt) const {
    return tile_meta[v] + (qt.b * p.heads_kv + qt.hk) * key_tiles;
  }
  template <class Tile>
  __device__ __forceinline__ float2 tile_bound(int v, const AttentionParams& p, const Tile& qt, int kt) const {
    return tile_bounds(v, p, qt)[kt];
  }
  template <class Tile>
  __device__ __forceinline__ std::uint32_t* live_row(const AttentionParams& p, const Tile& qt) const {
    return live_bits + map_block(qt.b, qt.h, p.heads_q, q_blocks, qt.r0) * dense.words;
  }
};

// Marks key tiles 0 .. n_tiles - 1 dense for a row group, and live for its block. By global
// reductions (tile::red_or_global), as everything the screen writes to global memory while its
// products are in flight.
__device__ __forceinline__ void mark_tiles_dense(std::uint32_t* dense_row, std::uint32_t* live_row, int n_tiles) {
  for (int w = 0; 32 * w < n_tiles; ++w) {
    const int left = n_tiles - 32 * w;
    const std::uint32_t bits = left >= 32 ? 0xffffffffu : (1u << left) - 1u;
    tile::red_or_global(dense_row + w, bits);
    tile::red_or_global(live_row + w, bits);
  }
}

struct Sm90ScreenShape {
  static constexpr int kBQ = 128, kBK = 128, kStages = 4, kThreads = 384;
  static constexpr int kProducerRegisters = 40;
  static constexpr int kConsumerRegisters = 232;
};

template <int Views>
struct Sm90ScreenSmem {
  using Shape = Sm90ScreenShape;
  using QTile = tile::PanelTile<std::int8_t, Shape::kBQ, kScreenRowBytes>;
  using KTile = tile::PanelTile<std::int8_t, Shape::kBK, kScreenRowBytes>;
  static constexpr int kQ = 0;  // view v at kQ + v * QTile::kBytes
  static constexpr int kK = Views * QTile::kBytes;  // stage s, view v at kK + (s * Views + v) * KTile::kBytes
  static constexpr int kSync = kK + Shape::kStages * Views * KTile::kBytes;
  // mbarriers k_full, k_empty [stages]; end[stages]; the consumers' halt flags.
  static constexpr int kSyncBytes = 16 * Shape::kStages + 4 * Shape::kStages + tile::StageHaltFlags::bytes(Shape::kStages);
  static constexpr int kBytes = kSync + kSyncBytes + 1024;
};

namespace screen {

// Features 8 n + 2 tig + 0..1 of a 16-bit row (a thread's accumulator columns), as floats.
template <class T>
__device__ __forceinline__ float2 feature_pair(const T* row, int n, int tig) {
  const std::uint32_t bits = *reinterpret_cast<const std::uint32_t*>(row + 8 * n + 2 * tig);
  const T* e = reinterpret_cast<const T*>(&bits);
  return make_float2(tile::to_float(e[0]), tile::to_float(e[1]));
}

// The exact score of (row, key) from the 16-bit rows, summed over a quad: each of its four
// threads takes the features of its accumulator columns.
template <class T, int D>
__device__ __forceinline__ float quad_score(const T* q, const T* k, bool active, int tig) {
  float part = 0.f;
  if (active) {
#pragma unroll
    for (int n = 0; n < D / 8; ++n) {
      const float2 a = feature_pair(q, n, tig), b = feature_pair(k, n, tig);
      part += a.x * b.x + a.y * b.y;
    }
  }
  return tile::quad_sum(part);
}

}  // namespace screen

// When no row of the block can be screened on its diagonal tile (tau within the bound, as for
// beta near 0), the block leaves every tile to the fused forward before loading anything: each
// row group's tiles dense, the block's live, no candidates (the counts start at zero). Returns
// whether it did.
template <class T, int D, int Views, class Tile>
__device__ __forceinline__ bool block_unscreenable(const AttentionParams& p, const ThresholdScreenParams& sp,
                                                   const Tile& qt) {
  const int tid = threadIdx.x, n_tiles = qt.key_tiles;
  bool unscreenable = true;
  if (tid < Tile::kRows && n_tiles > 0) {
    const std::int64_t row = qt.r0 + tid, limit = qt.limit(p, row);
    if (limit >= 0) {
      const float tau = sp.view.beta[qt.h * sp.view.beta_head] * sp.view.unit(limit);
#pragma unroll
      for (int v = 0; v < Views; ++v) {
        const float2 q = sp.row_bound(v, p, qt, row), k = sp.tile_bound(v, p, qt, n_tiles - 1);
        if (math::threshold::screen_cut(tau, q.y, q.x, k.y, k.x) >= 1.f) unscreenable = false;
      }
    }
  }
  if (!__syncthreads_and(unscreenable)) return false;
  if (tid < Tile::kRows / kScreenGroupRows) {
    mark_tiles_dense(sp.dense.group(p, qt, qt.r0 + kScreenGroupRows * tid), sp.live_row(p, qt), n_tiles);
  }
  return true;
}

template <class T, int D, int Views>
__global__ void __launch_bounds__(Sm90ScreenShape::kThreads, 1)
    threshold_screen_sm90_kernel(const AttentionParams p, const ThresholdScreenParams sp) {
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  namespace mt = math::threshold;
  using Shape = Sm90ScreenShape;
  using Smem = Sm90ScreenSmem<Views>;
  constexpr int BQ = Shape::kBQ, BK = Shape::kBK, S = Shape::kStages;
  extern __shared__ unsigned char smem_raw[];
  unsigned char* const smem = smem_raw + ((1024 - (tile::smem_address(smem_raw) & 1023)) & 1023);
  auto q_tile = [&](int v) { return typename Smem::QTile{smem + Smem::kQ + v * Smem::QTile::kBytes}; };
  auto k_tile = [&](int s, int v) {
    return typename Smem::KTile{smem + Smem::kK + (s * Views + v) * Smem::KTile::kBytes};
  };
  std::uint64_t* const k_full = reinterpret_cast<std::uint64_t*>(smem + Smem::kSync);
  std::uint64_t* const k_empty = k_full + S;
  volatile int* const end = reinterpret_cast<volatile int*>(k_empty + S);
  const tile::StageHaltFlags halted{end + S};

  const QueryTile<BQ, BK> qt(p);
  if (qt.empty()) return;
  const int tid = threadIdx.x;
  const int n_tiles = qt.key_tiles;
  if (block_unscreenable<T, D, Views>(p, sp, qt)) return;
  if (tid == 0) {
    for (int s = 0; s < S; ++s) {
      tile::mbar_init(&k_full[s], 128);
      tile::mbar_init(&k_empty[s], 256);
      end[s] = 0;
    }
    halted.clear(S);
    tile::mbar_init_fence();
  }
  __syncthreads();

  if (tid < 128) {
    // ---------------------------------------------------------------- producer
    tile::registers_release<Shape::kProducerRegisters>();
    const int ptid = tid;
    using K = typename Smem::KTile;
    constexpr int P = K::template row_stride_of<128>();
    const int r0 = K::template first_row_of<128>(ptid);
    auto rows_valid = [&](std::int64_t left) {  // of this thread's rows r0, r0 + P, ...
      return left <= 0 ? 0 : static_cast<int>(left < BK ? (left + P - 1) / P : BK);
    };
    for (int i = 0, kt = n_tiles - 1; i < n_tiles; ++i, --kt) {
      const int s = i % S;
      if (i >= S) {
        tile::mbar_wait_sleepy(&k_empty[s], ((i / S) - 1) & 1);
        if (tile::named_sync_or(kProducerBarrier, 128, ptid == 0 && halted.both(s))) {
          if (ptid == 0) end[s] = -1;
          tile::mbar_arrive(&k_full[s]);
          return;
        }
      }
      if (i == 0) {
        const int valid = rows_valid(qt.s.q_len - qt.r0 - r0);
#pragma unroll
        for (int v = 0; v < Views; ++v) {
          const detail::Operand& q8 = sp.q8[v];
          q_tile(v).template load_rows_async<128>(ptid, q8.at<const std::int8_t>(qt.b, qt.s.q_start + qt.r0 + r0, qt.h),
                                                  P * q8.row, valid);
        }
      }
      const std::int64_t key = static_cast<std::int64_t>(kt) * BK + r0;
      const int valid = rows_valid(qt.s.k_len - key);
#pragma unroll
      for (int v = 0; v < Views; ++v) {
        const detail::Operand& k8 = sp.k8[v];
        k_tile(s, v).template load_rows_async<128>(ptid, k8.at<const std::int8_t>(qt.b, qt.s.k_start + key, qt.hk),
                                                   P * k8.row, valid);
      }
      tile::mbar_arrive_on_copies(&k_full[s]);
    }
  } else {
    // ---------------------------------------------------------------- consumers
    tile::registers_claim<Shape::kConsumerRegisters>();
    const int ctid = tid - 128, wg = ctid / 128, wtid = ctid % 128;
    const int warp = wtid / 32, lane = tid % 32, g = lane / 4, tig = lane % 4;
    const std::int64_t group0 = qt.r0 + 64 * wg + 16 * warp;  // this warp's 16 rows
    const std::int64_t row0 = group0 + g;                      // this thread's rows: row0, row0 + 8
    std::uint32_t* const dense_row = sp.dense.group(p, qt, group0);
    std::uint32_t* const live_row = sp.live_row(p, qt);

    const float beta = sp.view.beta[qt.h * sp.view.beta_head];
    std::int64_t limit[2];
    // Each row's part of its cut, once (math::threshold::screen_row_cut): the loop over key tiles
    // then needs no division (an H200 profile of the divided form: 12% of the stall samples in
    // the cut's IEEE divisions and their slow-path branches). A row past the sequence gets the
    // offset +infinity: its cut is above every product, and it never makes a tile dense.
    mt::ScreenRowCut<float> row_cut[Views][2];
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const std::int64_t row = row0 + 8 * half;
      limit[half] = qt.limit(p, row);
      const float tau = beta * sp.view.unit(limit[half]);
#pragma unroll
      for (int v = 0; v < Views; ++v) {
        if (limit[half] >= 0) {
          const float2 m = sp.row_bound(v, p, qt, row);
          row_cut[v][half] = mt::screen_row_cut(tau, m.y, m.x);
        } else {
          row_cut[v][half] = {INFINITY, 1.f};
        }
      }
    }
    // The block's key tiles' bounds, tile kt at [kt].
    const float2* tile_bounds[Views];
#pragma unroll
    for (int v = 0; v < Views; ++v) tile_bounds[v] = sp.tile_bounds(v, p, qt);
    const bool counting = sp.stats != nullptr;

    bool done = false;  // this warpgroup gave its rows up to the fused forward

    // Everything written to memory while a product is in flight goes to global memory, named as
    // such (tile::red_or_global, st_global_b32): shared-memory stores or a named barrier in a
    // divergent path there make ptxas serialize every product of the kernel (C7518).
    auto mark_dense = [&](int kt) {
      tile::red_or_global(dense_row + (kt >> 5), 1u << (kt & 31));
      tile::red_or_global(live_row + (kt >> 5), 1u << (kt & 31));
    };
    const std::int64_t group = sp.group_index(p, qt, group0);
    std::uint32_t* const listed_candidates = sp.candidates + group * kGroupCandidates;
    int listed = 0;  // the same in every lane

    // The products, one per key tile and view (j = Views i + v over tiles i = 0, 1, ...; tile i
    // is key tile n_tiles - 1 - i, in stage i % S), two an iteration into two accumulators:
    // products j and j + 1 are issued back to back, product j is screened while j + 1 runs
    // (its tile's candidates listed and bits written too, where it is the tile's last view),
    // then j + 1 is screened. For TDA the two are one tile's views. Tile 0 goes first, alone:
    // its vote is a named barrier.
    //
    // ptxas keeps the products asynchronous only where every product issued in an iteration is
    // waited for in it (with one in flight across the loop's back edge it serializes them all:
    // C7514, an accumulator read in the pipeline stage), and only where nothing but global
    // memory is written while one runs (shared-memory stores or a named barrier in a divergent
    // path there: C7518): so the stages are released after both products are done, and the
    // tile's candidates go to global lists (tile::red_or_global, st_global_b32). An H200 profile
    // of the form with one product in flight at a time (2026-11-30, docs/performance.md): the
    // int8 tensor pipe 37% active, each warp's work a chain of about 217 instructions a tile.
    // Every iteration issues two products, with no branch around them; where no product is left
    // to issue (past the last, or once the producer ended) it issues a stand-in (Q against
    // itself, in shared memory for the whole kernel) whose result nobody reads.
    const int products = Views * n_tiles;
    auto issue = [&](int (&acc)[64], int i, int v, bool real) {
#pragma unroll
      for (int j = 0; j < 64; ++j) asm volatile("" : "=r"(acc[j]));
      tile::wgmma_fence();
#pragma unroll
      for (int ks = 0; ks < kScreenRowBytes / 32; ++ks) {
        const std::uint64_t keys = real ? k_tile(i % S, v).k_major(0, 32 * ks) : q_tile(0).k_major(0, 32 * ks);
        tile::wgmma_ss_s8_n128(acc, q_tile(real ? v : 0).k_major(64 * wg, 32 * ks), keys, ks > 0);
      }
      tile::wgmma_commit();
    };
    // Waits for tile i's stage; false when the producer ended instead (both warpgroups done).
    auto stage_ready = [&](int i) {
      tile::mbar_wait(&k_full[i % S], (i / S) & 1);
      if (end[i % S] < 0) return false;
      tile::fence_to_async_proxy();
      return true;
    };
    auto release = [&](int i) {
      if (wtid == 0) halted.publish(i % S, wg, done);
      tile::mbar_arrive(&k_empty[i % S]);
    };

    // One key tile's screening, across its views: the tile's largest key scale and error radius
    // (read an iteration ahead), each row's cut, whether the warp leaves the tile dense, whether
    // some row of the warp has a product above its cut (warp-uniform), and the candidates among
    // this thread's accumulator entries (bit 4 e + c), over the views.
    struct TileScreen {
      float2 bounds[Views];
      int cut[Views][2];
      bool dense, over;
      std::uint64_t cand;
    };
    auto read_bounds = [&](TileScreen& t, int i) {
#pragma unroll
      for (int v = 0; v < Views; ++v) t.bounds[v] = tile_bounds[v][n_tiles - 1 - i];
    };
    // Each row's cut; a row whose tau lies within the bound (a cut below 1, or NaN) makes the
    // tile dense. The conversion saturates: an infinite cut is INT_MAX.
    auto find_cuts = [&](TileScreen& t) {
      bool dense = false;
#pragma unroll
      for (int u = 0; u < Views; ++u) {
        // An approximate reciprocal: its error of an ulp or two is inside the cut's slack.
        const float inv_scale_k = __fdividef(1.f, t.bounds[u].x);
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          const float c = mt::screen_tile_cut(row_cut[u][half], t.bounds[u].y, inv_scale_k);
          dense = dense || !(c >= 1.f);
          t.cut[u][half] = __float2int_rz(c);
        }
      }
      t.dense = __any_sync(0xffffffffu, dense);
      t.over = false;
      t.cand = 0;
    };
    // A view's products against the rows' cuts: where some row of the warp is over, the
    // candidates among the visible keys.
    auto screen_product = [&](TileScreen& t, int v, const int (&acc)[64], std::int64_t key0) {
      // Two partial maxima per row, so that neither is one chain of 16 three-way maxima.
      int m[2][2] = {{INT_MIN, INT_MIN}, {INT_MIN, INT_MIN}};
#pragma unroll
      for (int e = 0; e < 16; ++e) {
        m[0][e % 2] = max(m[0][e % 2], max(acc[4 * e], acc[4 * e + 1]));
        m[1][e % 2] = max(m[1][e % 2], max(acc[4 * e + 2], acc[4 * e + 3]));
      }
      if (__any_sync(0xffffffffu, max(m[0][0], m[0][1]) > t.cut[v][0] || max(m[1][0], m[1][1]) > t.cut[v][1])) {
        t.over = true;
        // Entry (e, c) is key key0 + 2 tig + 8 e + (c & 1): visible to its row when 8 e + (c & 1)
        // is at most visible[c / 2], a 32-bit offset against compile-time columns. Comparing
        // each entry's 64-bit key with the row's limit took about four and a half instructions
        // an entry on this path (SASS, 2026-11-30), which about one warp tile in eight takes;
        // below the diagonal, where every key is visible, an entry takes its compare and its
        // bit.
        int visible[2];
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          const std::int64_t d = limit[half] - key0 - 2 * tig;
          visible[half] = d < 0 ? -1 : (d > BK ? BK : static_cast<int>(d));
        }
        if (min(visible[0], visible[1]) >= 8 * 15 + 1) {
          // Two masks, even and odd e, so that the bits go in as four chains of 16, not two of 32.
          std::uint64_t part[2] = {0, 0};
#pragma unroll
          for (int e = 0; e < 16; ++e) {
#pragma unroll
            for (int c = 0; c < 4; ++c) {
              if (acc[4 * e + c] > t.cut[v][c / 2]) part[e % 2] |= 1ull << (4 * e + c);
            }
          }
          t.cand |= part[0] | part[1];
        } else {
#pragma unroll
          for (int e = 0; e < 16; ++e) {
#pragma unroll
            for (int c = 0; c < 4; ++c) {
              if (acc[4 * e + c] > t.cut[v][c / 2] && 8 * e + (c & 1) <= visible[c / 2]) t.cand |= 1ull << (4 * e + c);
            }
          }
        }
      }
    };
    // After the tile's last view: its candidates listed for the candidate pass, or the tile left
    // dense (too many for one tile, or for the group's list).
    auto finish_tile = [&](TileScreen& t, int kt, std::int64_t key0) {
      bool dense = t.dense;
      // Products above the cut may all lie past the causal limit: then count is 0.
      if (!dense && t.over) {
        const int count = static_cast<int>(__reduce_add_sync(0xffffffffu, static_cast<unsigned>(__popcll(t.cand))));
        dense = count > kSparseCandidates || listed + count > kGroupCandidates;
        if (!dense && count > 0) {
          if (counting && lane == 0) {
            tile::red_add_global(sp.stats + 2, 1ull);
            tile::red_add_global(sp.stats + 3, static_cast<unsigned long long>(count));
          }
          int slot = listed + tile::warp_exclusive_sum(__popcll(t.cand));
          for (std::uint64_t left = t.cand; left != 0; left &= left - 1) {
            const int idx = __ffsll(left) - 1;
            const int row = g + 8 * ((idx & 3) >> 1);
            const std::int64_t key = key0 + 8 * (idx >> 2) + 2 * tig + (idx & 1);
            tile::st_global_b32(listed_candidates + slot++,
                                static_cast<std::uint32_t>(key) << 4 | static_cast<std::uint32_t>(row));
          }
          listed += count;
        }
      }
      if (dense && lane == 0) mark_dense(kt);
      if (counting && lane == 0) {
        tile::red_add_global(sp.stats, 1ull);
        if (dense) tile::red_add_global(sp.stats + 1, 1ull);
      }
      return dense;
    };

    int acc0[64], acc1[64];
    TileScreen ts[2];
    {
      // Tile 0 (the diagonal), nothing else in flight. The producer cannot end before its first
      // tiles: tile 0's stage is always filled.
      const int kt = n_tiles - 1;
      const std::int64_t key0 = static_cast<std::int64_t>(kt) * BK;
      read_bounds(ts[0], 0);
      stage_ready(0);
      issue(acc0, 0, 0, true);
      if constexpr (Views == 2) issue(acc1, 0, 1, true);
      find_cuts(ts[0]);
      tile::wgmma_wait<0>();
      tile::pin(acc0);
      if constexpr (Views == 2) tile::pin(acc1);
      release(0);
      if (!ts[0].dense) {
        screen_product(ts[0], 0, acc0, key0);
        if constexpr (Views == 2) screen_product(ts[0], 1, acc1, key0);
      }
      const bool dense = finish_tile(ts[0], kt, key0);
      // A warpgroup whose warps are all dense on the diagonal tile leaves every tile of its rows
      // to the fused forward.
      done = tile::named_sync_and(kConsumerBarrier + wg, 128, dense);
      if (done && lane == 0) mark_tiles_dense(dense_row, live_row, n_tiles);
    }

    // From tile 1 on: an iteration's products j + u (u = 0, 1) are of tiles i0 .. i0 + kTiles - 1,
    // product j + u's in ts[slot(u)] (j is a multiple of Views: TDA's two are one tile's views).
    constexpr int kTiles = Views == 1 ? 2 : 1;
    auto slot = [](int u) { return Views == 1 ? u : 0; };
#pragma unroll
    for (int u = 0; u < kTiles; ++u) {
      if (1 + u < n_tiles) read_bounds(ts[u], 1 + u);
    }
    bool ended = false;
    for (int j = Views; j < products && !ended; j += 2) {
      const int i0 = j / Views;
      bool real[2];
#pragma unroll
      for (int u = 0; u < 2; ++u) {
        const int i = (j + u) / Views, v = (j + u) % Views;
        real[u] = j + u < products && !ended;
        if (real[u] && v == 0 && !stage_ready(i)) ended = true, real[u] = false;
      }
      issue(acc0, j / Views, j % Views, real[0]);
      issue(acc1, (j + 1) / Views, (j + 1) % Views, real[1]);
      // While they run: the tiles' cuts, then the next iteration's bounds.
#pragma unroll
      for (int u = 0; u < 2; ++u) {
        if (real[u] && (j + u) % Views == 0) find_cuts(ts[slot(u)]);
      }
#pragma unroll
      for (int u = 0; u < kTiles; ++u) {
        if (i0 + kTiles + u < n_tiles) read_bounds(ts[u], i0 + kTiles + u);
      }
      auto screen = [&](int u, const int (&acc)[64]) {
        const int i = (j + u) / Views, v = (j + u) % Views, kt = n_tiles - 1 - i;
        const std::int64_t key0 = static_cast<std::int64_t>(kt) * BK;
        TileScreen& t = ts[slot(u)];
        if (done) return;
        if (!t.dense) screen_product(t, v, acc, key0);
        if (v == Views - 1) finish_tile(t, kt, key0);
      };
      tile::wgmma_wait<1>();
      tile::pin(acc0);
      if (real[0]) screen(0, acc0);
      tile::wgmma_wait<0>();
      tile::pin(acc1);
      // Both products done: their stages go back to the producer.
      if (real[0] && j % Views == Views - 1) release(j / Views);
      if (real[1] && (j + 1) % Views == Views - 1) release((j + 1) / Views);
      if (real[1]) screen(1, acc1);
    }
    if (lane == 0) sp.candidate_counts[group] = listed;
  }
#endif
}

// The candidates' part of the output, after the screen: it writes every output row of the
// screened problem (zero where a row has no candidate), and the fused forward then adds the
// dense tiles' part. Same grid as the screen, a warp per row group: each candidate (the
// screen's list for the group) gets its exact score from the 16-bit rows and, where the weight
// is nonzero, its weighted value row, handled by the quad that holds its row's output; per pass
// every quad takes its next one, so up to eight candidates' rows are loaded at once.
template <class T, int D, int Views>
__global__ void __launch_bounds__(32 * Sm90ScreenShape::kBQ / kScreenGroupRows)
    threshold_candidates_kernel(const AttentionParams p, const ThresholdScreenParams sp) {
  namespace mt = math::threshold;
  const QueryTile<Sm90ScreenShape::kBQ, Sm90ScreenShape::kBK> qt(p);
  if (qt.empty()) return;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, tig = lane % 4;
  const std::int64_t group0 = qt.r0 + kScreenGroupRows * warp;
  if (group0 >= qt.s.q_len) return;
  const std::int64_t row0 = group0 + g;
  const float beta = sp.view.beta[qt.h * sp.view.beta_head];
  const float lambda = Views == 2 ? -sp.view.factor(qt.h) : 0.f;
  float tau[2];
  const T* q_rows[Views][2];
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const std::int64_t row = row0 + 8 * half;
    const std::int64_t limit = qt.limit(p, row);
    tau[half] = beta * sp.view.unit(limit);
#pragma unroll
    for (int v = 0; v < Views; ++v) {
      q_rows[v][half] = limit >= 0 ? sp.q_hat[v].at<const T>(qt.b, qt.s.q_start + row, qt.h) : nullptr;
    }
  }
  const std::int64_t group = sp.group_index(p, qt, group0);
  const int count = min(sp.candidate_counts[group], kGroupCandidates);
  const std::uint32_t* const list = sp.candidates + group * kGroupCandidates;

  float o[D / 8][4];
  tile::zero(o);
  int cursor = 0;
  while (true) {
    std::uint32_t entry = 0;
    bool active = false;
    for (; cursor < count; ++cursor) {
      const std::uint32_t x = list[cursor];
      if (static_cast<int>(x & 7u) == g) {
        entry = x;
        active = true;
        ++cursor;
        break;
      }
    }
    if (!__any_sync(0xffffffffu, active)) break;
    const int half = static_cast<int>((entry >> 3) & 1u);
    const std::int64_t key = static_cast<std::int64_t>(entry >> 4);
    float w = 0.f;
#pragma unroll
    for (int v = 0; v < Views; ++v) {
      const T* k = active ? sp.k_hat[v].at<const T>(qt.b, qt.s.k_start + key, qt.hk) : nullptr;
      const float score = screen::quad_score<T, D>(half == 0 ? q_rows[v][0] : q_rows[v][1], k, active, tig);
      const float wv = mt::weight(score - tau[half], sp.view.power);
      w += v == 0 ? wv : -lambda * wv;
    }
    if (active && w != 0.f) {
      const T* vrow = p.v.at<const T>(qt.b, qt.s.k_start + key, qt.hk);
      const float w_lo = half == 0 ? w : 0.f, w_hi = half == 0 ? 0.f : w;
#pragma unroll
      for (int n = 0; n < D / 8; ++n) {
        const float2 x = screen::feature_pair(vrow, n, tig);
        o[n][0] += w_lo * x.x;
        o[n][1] += w_lo * x.y;
        o[n][2] += w_hi * x.x;
        o[n][3] += w_hi * x.y;
      }
    }
  }
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const std::int64_t row = row0 + 8 * half;
    if (row >= qt.s.q_len) continue;
    tile::store_fragment_row<T>(p.out.at<T>(qt.b, qt.s.q_start + row, qt.h), o, half, tig);
  }
}

}  // namespace winnow::cuda
