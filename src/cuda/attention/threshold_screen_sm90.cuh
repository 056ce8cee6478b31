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
// whole screen). A row group that listed candidates has its output rows written by the candidate
// pass, every other one by the screen, as zeros; the fused forward adds the dense tiles' part.
//
// Block: resident, one per multiprocessor, taking work items in turn (ScreenItems: 128 query
// rows of one head each), a producer warpgroup copying each item's 8-bit query tile and key
// tiles (natural key order, 128 keys x 128 bytes) into two query buffers and a ring of stages,
// and two consumer warpgroups of 64 rows. Views = 2 (TDA) screens both views' products; a
// candidate of either view gets both exact scores and the weight w1 - lambda w2.
#pragma once

#include <climits>
#include <cstdint>
#include <type_traits>

#include "cuda/attention/forward_sm90.cuh"
#include "cuda/attention/key_tiles.cuh"
#include "cuda/attention/threshold_rows.cuh"
#include "cuda/tile/hopper.cuh"
#include "cuda/tile/panel_tile.cuh"

namespace winnow::cuda {

inline constexpr int kScreenRowBytes = 128;  // int8 rows, zero past the head dimension
inline constexpr int kSparseCandidates = 24;  // per warp and key tile, above which the tile is dense
inline constexpr int kGroupCandidates = 256;  // per row group, over its key tiles; past them, dense
inline constexpr int kCandidateWarps = 8;     // per block of the candidate pass

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
  // The row groups (group_index) per (sequence, head) whole blocks' worth: candidate_counts'
  // extent. A row group that listed no candidate has its output rows written by the screen, as
  // zeros; the candidate pass writes the others'.
  int groups = 0;
  // The items (query tiles) with a dense tile, as {sequence, head, tile from the left}, and how
  // many, for the fused forward that adds them (ThresholdCudaConfig::listed_blocks); per item, how
  // many of its warps have marked one (cleared before the screen), so that each is listed once.
  int4* listed_blocks = nullptr;
  int* listed_block_count = nullptr;
  int* item_marks = nullptr;

  template <class Tile>
  __device__ __forceinline__ void list_block(const Tile& qt) const {
    listed_blocks[atomicAdd(listed_block_count, 1)] =
        make_int4(static_cast<int>(qt.b), static_cast<int>(qt.h), static_cast<int>(qt.r0 / Tile::kRows), 0);
  }
  // Diagnostics (WINNOW_SCREEN_STATS): warp tiles screened, left dense, with candidates handled,
  // candidates handled. Null: not counted.
  unsigned long long* stats = nullptr;

  template <class Tile>
  __device__ __forceinline__ std::int64_t group_index(const AttentionParams& p, const Tile& qt, std::int64_t row) const {
    return (qt.b * p.heads_q + qt.h) * dense.row_groups + row / kScreenGroupRows;
  }
  // The query tile holding row group `group` (group_index's inverse), and the group's first row.
  template <class Tile>
  __device__ __forceinline__ Tile tile_of_group(const AttentionParams& p, std::int64_t group, std::int64_t* row) const {
    const std::int64_t pair = group / dense.row_groups, b = pair / p.heads_q, h = pair % p.heads_q;
    *row = (group % dense.row_groups) * kScreenGroupRows;
    return Tile(p, Tile::block_of(p, b, h, *row / Tile::kRows));
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
  static constexpr int kBQ = 128, kBK = 128, kThreads = 384;
  // The producer's loop over items keeps more than 40 registers' worth (ptxas spilled it there).
  static constexpr int kProducerRegisters = 56;
  static constexpr int kConsumerRegisters = 224;
};

template <int Views>
struct Sm90ScreenSmem {
  using Shape = Sm90ScreenShape;
  using QTile = tile::PanelTile<std::int8_t, Shape::kBQ, kScreenRowBytes>;
  using KTile = tile::PanelTile<std::int8_t, Shape::kBK, kScreenRowBytes>;
  // Key-tile stages. TRA's eight are 0-3% faster than four (H200, session 82); TDA's five
  // (227 KB of shared memory) were 5-6% slower than four.
  static constexpr int kStages = Views == 1 ? 8 : 4;
  // Two query tiles (per view), the block's items taking them in turn: the producer loads the
  // next item's while the consumers' products still read this one's.
  static constexpr int kQ = 0;  // tile q, view v at kQ + (q * Views + v) * QTile::kBytes
  static constexpr int kK = 2 * Views * QTile::kBytes;  // stage s, view v at kK + (s * Views + v) * KTile::kBytes
  static constexpr int kSync = kK + kStages * Views * KTile::kBytes;
  // mbarriers k_full, k_empty [stages], q_empty [2]; end[stages]; the consumers' halt flags.
  static constexpr int kSyncBytes =
      16 * kStages + 16 + 4 * kStages + tile::StageHaltFlags::bytes(kStages);
  // What the producer computes for the consumers, released with a stage's barrier: per query
  // buffer, view and row the row's part of its cut (math::threshold::ScreenRowCut, two floats),
  // with the item's first stage; per stage and view its key tile's {scale, error radius}.
  static constexpr int kRowCuts = kSync + kSyncBytes;  // [q][v][row]
  static constexpr int kTileBounds = kRowCuts + 2 * Views * Shape::kBQ * 8;  // [s][v]
  static constexpr int kBytes = kTileBounds + kStages * Views * 8 + 1024;
  static_assert(kBytes <= 227 * 1024, "Hopper's shared memory for a block");
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

// The screen's work items, one per query tile of a (sequence, query head), and the order in
// which a block takes them. The blocks stay resident, one per multiprocessor (or fewer:
// WINNOW_SCREEN_BLOCKS), so that the producer loads an item's first tiles while the consumers
// still screen the last one's: a block of its own per item paid that latency at its start,
// about ten key tiles' time a block by the H200's kernel times at 4K and 16K (session 82). Item
// i is the (i / pairs)-th query tile from the right (the heaviest first) of pair i % pairs,
// and block c takes item r G + c in its even rounds r and r G + G - 1 - c in its odd ones (G
// blocks), so that the blocks' key tiles add up to about the same (tools/block_schedule.py
// --screen).
struct ScreenItems {
  int count, pairs, heads_q, group;
  __device__ __forceinline__ explicit ScreenItems(const AttentionParams& p, int bq) {
    heads_q = static_cast<int>(p.heads_q);
    group = p.heads_per_sweep;
    pairs = static_cast<int>(p.num_seqs) * heads_q;
    count = static_cast<int>((p.max_len_q + bq - 1) / bq) * pairs;
  }
  __device__ __forceinline__ int of_round(int r) const {
    const int blocks = static_cast<int>(gridDim.x), c = static_cast<int>(blockIdx.x);
    return r * blocks + ((r & 1) != 0 ? blocks - 1 - c : c);
  }
  // The item's grid coordinates as QueryTile reads them.
  __device__ __forceinline__ uint3 block(int item) const {
    const int tile = item / pairs, pair = item % pairs, b = pair / heads_q, h = pair % heads_q;
    return make_uint3(static_cast<unsigned>(tile * group + h % group), static_cast<unsigned>(h / group),
                      static_cast<unsigned>(b));
  }
};

// A row group's output rows as zeros, written by the warp that screened them (quad g: rows g and
// g + 8 of the group): the rows that listed no candidate, which the candidate pass leaves alone,
// and to which the fused forward then adds the dense tiles' part.
template <class T, int D, class Tile>
__device__ __forceinline__ void store_zero_rows(const AttentionParams& p, const Tile& qt, std::int64_t row0, int tig) {
  const float zero[D / 8][4] = {};
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const std::int64_t row = row0 + 8 * half;
    if (row < qt.s.q_len) tile::store_fragment_row<T>(p.out.at<T>(qt.b, qt.s.q_start + row, qt.h), zero, half, tig);
  }
}

// Whether no row of the item can be screened on its diagonal tile (tau within the bound, as for
// beta near 0): then the producer leaves every tile to the fused forward before loading
// anything (each row group's tiles dense, the block's live, no candidates: the counts start at
// zero). Called by the producer's threads, one row each; `cut` gets the row's part of its cut
// per view (math::threshold::screen_row_cut), which the consumers then read from shared memory
// instead of loading the row's bounds themselves: offset +infinity for a row past the sequence,
// whose cut is then above every product and which never makes a tile dense.
template <int Views, class Tile>
__device__ __forceinline__ bool item_unscreenable(const AttentionParams& p, const ThresholdScreenParams& sp,
                                                  const Tile& qt, int ptid, float2 (&cut)[Views]) {
  static_assert(Tile::kRows == 128, "a producer thread per row");
  bool unscreenable = true;
  const std::int64_t row = qt.r0 + ptid, limit = qt.limit(p, row);
#pragma unroll
  for (int v = 0; v < Views; ++v) cut[v] = make_float2(INFINITY, 1.f);
  if (limit >= 0) {
    const float tau = sp.view.beta[qt.h * sp.view.beta_head] * sp.view.unit(limit);
#pragma unroll
    for (int v = 0; v < Views; ++v) {
      const float2 q = sp.row_bound(v, p, qt, row), k = sp.tile_bound(v, p, qt, qt.key_tiles - 1);
      if (math::threshold::screen_cut(tau, q.y, q.x, k.y, k.x) >= 1.f) unscreenable = false;
      const math::threshold::ScreenRowCut<float> c = math::threshold::screen_row_cut(tau, q.y, q.x);
      cut[v] = make_float2(c.offset, c.factor);
    }
  }
  return tile::named_sync_and(kProducerBarrier, 128, unscreenable);
}

template <class T, int D, int Views>
__global__ void __launch_bounds__(Sm90ScreenShape::kThreads, 1)
    threshold_screen_sm90_kernel(const AttentionParams p, const ThresholdScreenParams sp) {
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  namespace mt = math::threshold;
  using Shape = Sm90ScreenShape;
  using Smem = Sm90ScreenSmem<Views>;
  constexpr int BQ = Shape::kBQ, BK = Shape::kBK, S = Smem::kStages;
  extern __shared__ unsigned char smem_raw[];
  const std::uint32_t smem_pad = (1024 - (tile::smem_address(smem_raw) & 1023)) & 1023;
  unsigned char* const smem = smem_raw + smem_pad;
  // Query tile q (of two) and key stage s, view v: bytes from the aligned base.
  auto q_offset = [](int q, int v) { return Smem::kQ + (q * Views + v) * Smem::QTile::kBytes; };
  auto k_offset = [](int s, int v) { return Smem::kK + (s * Views + v) * Smem::KTile::kBytes; };
  auto q_tile = [&](int q, int v) { return typename Smem::QTile{smem + q_offset(q, v)}; };
  auto k_tile = [&](int s, int v) { return typename Smem::KTile{smem + k_offset(s, v)}; };
  // Synchronization, from Smem::kSync: mbarriers k_full [S], k_empty [S], q_empty [2]; then
  // end [S]; then the consumers' halt flags [S][2] (tile::StageHaltFlags).
  constexpr int kEmpty = Smem::kSync + 8 * S, kQEmpty = kEmpty + 8 * S, kEnd = kQEmpty + 16, kHalted = kEnd + 4 * S;
  std::uint64_t* const k_full = reinterpret_cast<std::uint64_t*>(smem + Smem::kSync);
  std::uint64_t* const k_empty = reinterpret_cast<std::uint64_t*>(smem + kEmpty);
  std::uint64_t* const q_empty = reinterpret_cast<std::uint64_t*>(smem + kQEmpty);
  // Per stage, what the producer put there besides a tile, by the fill that did (fill f: the
  // block's f-th use of a stage, over its items, stage f % S): 2 (f + 1) where it ended the item
  // there instead (both consumer warpgroups gave their rows up), 2 (f + 1) + 1 where it passed
  // the item (nothing to screen); any other value, a tile (one shift and compare tell). Written
  // before a plain arrival.
  volatile int* const end = reinterpret_cast<volatile int*>(smem + kEnd);
  const tile::StageHaltFlags halted{reinterpret_cast<volatile int*>(smem + kHalted)};
  // The same places by shared address, for the consumers' loop, the base held in a register
  // (tile::opaque): with pointers converted there, or the base recomputed, ptxas rebuilt the
  // shared window's base from the CTA id at each use (TDA's loop head, up to its first product,
  // 91 instructions against 73 so, in SASS).
  const std::uint32_t smem_at = tile::opaque(tile::smem_address(smem_raw) + smem_pad);
  auto q_at = [&](int q, int v) { return smem_at + static_cast<std::uint32_t>(q_offset(q, v)); };
  auto k_at = [&](int s, int v) { return smem_at + static_cast<std::uint32_t>(k_offset(s, v)); };
  auto full_at = [&](int s) { return smem_at + static_cast<std::uint32_t>(Smem::kSync + 8 * s); };
  auto empty_at = [&](int s) { return smem_at + static_cast<std::uint32_t>(kEmpty + 8 * s); };
  auto q_empty_at = [&](int q) { return smem_at + static_cast<std::uint32_t>(kQEmpty + 8 * q); };
  auto end_at = [&](int s) { return smem_at + static_cast<std::uint32_t>(kEnd + 4 * s); };
  auto halted_at = [&](int s, int consumer) {
    return smem_at + static_cast<std::uint32_t>(kHalted + 4 * (2 * s + consumer));
  };
  auto row_cut_at = [&](int q, int v, int row) {
    return smem_at + static_cast<std::uint32_t>(Smem::kRowCuts + 8 * ((q * Views + v) * BQ + row));
  };
  auto tile_bound_at = [&](int s, int v) {
    return smem_at + static_cast<std::uint32_t>(Smem::kTileBounds + 8 * (s * Views + v));
  };

  const ScreenItems items(p, BQ);
  // Fill f (never negative) is in stage f % S, in its phase (f / S) & 1; unsigned, so that
  // neither takes a signed division's fix-ups.
  auto stage_of = [](int f) { return static_cast<int>(static_cast<unsigned>(f) % S); };
  auto phase_of = [](int f) { return static_cast<int>((static_cast<unsigned>(f) / S) & 1u); };
  const int tid = threadIdx.x;
  if (tid == 0) {
    for (int s = 0; s < S; ++s) {
      // Each producer thread arrives twice a stage: on its copies, and after its shared-memory
      // stores (row cuts, the tile's bounds), which the plain arrival releases.
      tile::mbar_init(&k_full[s], 256);
      tile::mbar_init(&k_empty[s], 256);
      end[s] = 0;
    }
    for (int q = 0; q < 2; ++q) tile::mbar_init(&q_empty[q], 256);
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
    auto wait_free = [&](int f) {
      if (f >= S) tile::mbar_wait_sleepy(&k_empty[stage_of(f)], phase_of(f) ^ 1);
    };
    int fill = 0, loaded = 0;  // stages filled and items loaded, over the block's items
    for (int r = 0;; ++r) {
      const int item = items.of_round(r);
      if (item >= items.count) break;
      const QueryTile<BQ, BK> qt(p, items.block(item));
      if (qt.empty() || qt.key_tiles == 0) continue;
      const int n_tiles = qt.key_tiles;
      float2 cut[Views];
      if (item_unscreenable<Views>(p, sp, qt, ptid, cut)) {
        if (ptid < BQ / kScreenGroupRows) {
          mark_tiles_dense(sp.dense.group(p, qt, qt.r0 + kScreenGroupRows * ptid), sp.live_row(p, qt), n_tiles);
        }
        if (ptid == 0) sp.list_block(qt);
        const int f = fill++;
        wait_free(f);
        if (ptid == 0) end[stage_of(f)] = 2 * (f + 1) + 1;
        tile::mbar_arrive(&k_full[stage_of(f)]);
        tile::mbar_arrive(&k_full[stage_of(f)]);
        continue;
      }
      // The query tile goes where the item before last had its: once its products are done.
      const int q = loaded & 1;
      if (loaded >= 2) tile::mbar_wait_sleepy(&q_empty[q], ((loaded >> 1) - 1) & 1);
      ++loaded;
#pragma unroll
      for (int v = 0; v < Views; ++v) {
        tile::st_shared_v2_b32(row_cut_at(q, v, ptid), __float_as_uint(cut[v].x), __float_as_uint(cut[v].y));
      }
      for (int i = 0, kt = n_tiles - 1; i < n_tiles; ++i, --kt) {
        const int f = fill++, s = stage_of(f);
        // Thread v < Views: view v's bounds of this key tile, loaded while the stage frees.
        float2 bound = make_float2(0.f, 0.f);
        if (ptid < Views) bound = sp.tile_bound(ptid, p, qt, kt);
        wait_free(f);
        // The consumers' halt flags as they released this item's tile i - S from this stage.
        if (i >= S && tile::named_sync_or(kProducerBarrier, 128, ptid == 0 && halted.both(s))) {
          if (ptid == 0) end[s] = 2 * (f + 1);
          tile::mbar_arrive(&k_full[s]);
          tile::mbar_arrive(&k_full[s]);
          break;
        }
        if (i == 0) {
          const int valid = rows_valid(qt.s.q_len - qt.r0 - r0);
#pragma unroll
          for (int v = 0; v < Views; ++v) {
            const detail::Operand& q8 = sp.q8[v];
            q_tile(q, v).template load_rows_async<128>(
                ptid, q8.at<const std::int8_t>(qt.b, qt.s.q_start + qt.r0 + r0, qt.h), P * q8.row, valid);
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
        if (ptid < Views) tile::st_shared_v2_b32(tile_bound_at(s, ptid), __float_as_uint(bound.x), __float_as_uint(bound.y));
        tile::mbar_arrive_on_copies(&k_full[s]);
        tile::mbar_arrive(&k_full[s]);
      }
    }
  } else {
    // ---------------------------------------------------------------- consumers
    tile::registers_claim<Shape::kConsumerRegisters>();
    const int ctid = tid - 128, wg = ctid / 128, wtid = ctid % 128;
    const int warp = wtid / 32, lane = tid % 32, g = lane / 4, tig = lane % 4;
    const bool counting = sp.stats != nullptr;
    int fill = 0, loaded = 0;  // as the producer counts them
    for (int r = 0;; ++r) {
      const int item = items.of_round(r);
      if (item >= items.count) break;
      const QueryTile<BQ, BK> qt(p, items.block(item));
      if (qt.empty()) continue;
      const std::int64_t group0 = qt.r0 + 64 * wg + 16 * warp;  // this warp's 16 rows
      const std::int64_t row0 = group0 + g;                      // this thread's rows: row0, row0 + 8
      if (qt.key_tiles == 0) {  // rows without keys (an empty key sequence): zero
        store_zero_rows<T, D>(p, qt, row0, tig);
        continue;
      }
      const int n_tiles = qt.key_tiles;
      const int base = fill;  // the item's tile i is in fill base + i
      const int q = loaded & 1;  // its query tile (unless it is passed: then loaded stays)
      std::uint32_t* const dense_row = sp.dense.group(p, qt, group0);
      std::uint32_t* const live_row = sp.live_row(p, qt);

      std::int64_t limit[2];
#pragma unroll
      for (int half = 0; half < 2; ++half) limit[half] = qt.limit(p, row0 + 8 * half);
      // Each row's part of its cut (math::threshold::screen_row_cut), so that the loop over key
      // tiles needs no division (an H200 profile of the divided form: 12% of the stall samples
      // in the cut's IEEE divisions and their slow-path branches): computed by the producer, which
      // loads the rows' bounds for its own test of the item anyway, and read once tile 0's stage
      // is there. The consumers loaded them themselves before, and the key tiles' bounds, each
      // a round trip to L2 at the item's start (SASS: about four in series, and 740
      // instructions before the first product).
      mt::ScreenRowCut<float> row_cut[Views][2];

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
      int listed = 0;        // the same in every lane
      bool marked = false;   // whether this warp left a tile of the item dense (the same in every lane)

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
      static_assert(std::is_same_v<typename Smem::QTile, typename Smem::KTile>, "a stand-in's keys are queries");
      auto issue = [&](int (&acc)[64], int i, int v, bool real) {
        // Both tiles chosen before the fence, by selection: a branch between the products makes
        // ptxas wait for each before the next (C7519, an arrival injected in a divergent path).
        using Tile = typename Smem::KTile;
        const std::uint32_t keys = real ? k_at(stage_of(base + i), v) : q_at(q, 0);
        const std::uint32_t rows = q_at(q, real ? v : 0);
#pragma unroll
        for (int j = 0; j < 64; ++j) asm volatile("" : "=r"(acc[j]));
        tile::wgmma_fence();
#pragma unroll
        for (int ks = 0; ks < kScreenRowBytes / 32; ++ks) {
          tile::wgmma_ss_s8_n128(acc, Tile::k_major_at(rows, 64 * wg, 32 * ks), Tile::k_major_at(keys, 0, 32 * ks),
                                 ks > 0);
        }
        tile::wgmma_commit();
      };
      // Waits for tile i's stage: 0 when its tile is there, 1 when the producer ended the item
      // there instead (both warpgroups done), -1 when it passed the item (tile 0 only).
      auto stage_ready = [&](int i) {
        const int f = base + i;
        tile::mbar_wait_at(full_at(stage_of(f)), phase_of(f));
        const int e = tile::ld_volatile_shared_s32(end_at(stage_of(f)));
        if ((e >> 1) == f + 1) return (e & 1) != 0 ? -1 : 1;
        tile::fence_to_async_proxy();
        return 0;
      };
      auto release = [&](int i) {
        if (wtid == 0) tile::st_volatile_shared_s32(halted_at(stage_of(base + i), wg), done);
        tile::mbar_arrive_at(empty_at(stage_of(base + i)));
      };

      // One key tile's screening, across its views: the tile's largest key scale and error radius
      // (from beside its tile), each row's cut, whether the warp leaves the tile dense, whether
      // some row of the warp has a product above its cut (warp-uniform), and the candidates among
      // this thread's accumulator entries (bit 4 e + c), over the views.
      struct TileScreen {
        float2 bounds[Views];
        int cut[Views][2];
        bool dense, over;
        std::uint64_t cand;
      };
      // Tile i's bounds, as the producer put them beside it: once its stage is there.
      auto read_bounds = [&](TileScreen& t, int i) {
#pragma unroll
        for (int v = 0; v < Views; ++v) t.bounds[v] = tile::ld_shared_v2_f32(tile_bound_at(stage_of(base + i), v));
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
        marked = marked || dense;
        if (counting && lane == 0) {
          tile::red_add_global(sp.stats, 1ull);
          if (dense) tile::red_add_global(sp.stats + 1, 1ull);
        }
        return dense;
      };

      int acc0[64], acc1[64];
      TileScreen ts[2];
      {
        // Tile 0 (the diagonal), nothing else in flight. The producer cannot end an item before its
        // first S tiles: tile 0's stage holds a tile unless the item is passed.
        const int kt = n_tiles - 1;
        const std::int64_t key0 = static_cast<std::int64_t>(kt) * BK;
        if (stage_ready(0) < 0) {  // passed: no stage but this one was used, nothing to screen
          tile::mbar_arrive_at(empty_at(stage_of(base)));
          ++fill;
          store_zero_rows<T, D>(p, qt, row0, tig);  // every tile dense: the fused forward adds them all
          continue;
        }
        ++loaded;
#pragma unroll
        for (int v = 0; v < Views; ++v) {
#pragma unroll
          for (int half = 0; half < 2; ++half) {
            const float2 c = tile::ld_shared_v2_f32(row_cut_at(q, v, static_cast<int>(row0 + 8 * half - qt.r0)));
            row_cut[v][half] = {c.x, c.y};
          }
        }
        read_bounds(ts[0], 0);
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
        marked = marked || done;
      }

      // From tile 1 on: an iteration's products j + u (u = 0, 1) are of two tiles (TRA) or of one
      // tile's two views (TDA: j is a multiple of Views), product j + u's in ts[slot(u)].
      auto slot = [](int u) { return Views == 1 ? u : 0; };
      bool ended = false;
      int ended_at = n_tiles;  // the tile whose stage ended the item instead
      for (int j = Views; j < products && !ended; j += 2) {
        bool real[2];
#pragma unroll
        for (int u = 0; u < 2; ++u) {
          const int i = (j + u) / Views, v = (j + u) % Views;
          real[u] = j + u < products && !ended;
          if (real[u] && v == 0) {
            if (stage_ready(i) != 0) {
              ended = true, ended_at = i, real[u] = false;
            } else {
              read_bounds(ts[slot(u)], i);
            }
          }
        }
        issue(acc0, j / Views, j % Views, real[0]);
        issue(acc1, (j + 1) / Views, (j + 1) % Views, real[1]);
        // While they run: the tiles' cuts.
#pragma unroll
        for (int u = 0; u < 2; ++u) {
          if (real[u] && (j + u) % Views == 0) find_cuts(ts[slot(u)]);
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
      // The stage that ended the item goes back too; then the query tile, every product done.
      if (ended) tile::mbar_arrive_at(empty_at(stage_of(base + ended_at)));
      fill = base + (ended ? ended_at + 1 : n_tiles);
      tile::mbar_arrive_at(q_empty_at(q));
      // The item listed for the fused forward by the first of its warps that marked a tile dense.
      if (marked && lane == 0 && atomicAdd(sp.item_marks + item, 1) == 0) sp.list_block(qt);
      if (listed > 0) {
        if (lane == 0) sp.candidate_counts[group] = listed;
      } else {
        store_zero_rows<T, D>(p, qt, row0, tig);
      }
    }
  }
#endif
}

// The candidates' part of the output, after the screen: the rows of every row group that listed
// candidates (the screen wrote every other row as zeros), to which the fused forward then adds
// the dense tiles' part. Persistent warps: warp w takes row groups w, w + W, ... (W warps in the
// launch, as many as fit on the device at once) and passes over those without candidates. In
// that order the warps running at once share a few heads' rows in L2; in the order the screen
// finished its groups (heads interleaved), TDA's pass was 20-35% slower (H200, session 83). The
// full grid, a warp a row group, took 0.050 ms at both 4K and 16K for TRA (session 82). Each
// candidate gets its exact score from the 16-bit rows and, where the weight is nonzero, its
// weighted value row, handled by the quad that holds its row's output: the warp reads its list 32
// entries at a time, and per pass every quad takes its next one, so up to eight candidates' rows
// are loaded at once.
template <class T, int D, int Views>
__global__ void __launch_bounds__(kCandidateWarps * 32)
    threshold_candidates_kernel(const AttentionParams p, const ThresholdScreenParams sp) {
  namespace mt = math::threshold;
  using Tile = QueryTile<Sm90ScreenShape::kBQ, Sm90ScreenShape::kBK>;
  const int lane = threadIdx.x % 32, g = lane / 4, tig = lane % 4;
  const int stride = static_cast<int>(gridDim.x) * kCandidateWarps;
  for (int group = static_cast<int>(blockIdx.x) * kCandidateWarps + static_cast<int>(threadIdx.x) / 32;
       group < sp.groups; group += stride) {
    const int count = min(sp.candidate_counts[group], kGroupCandidates);
    if (count == 0) continue;
    std::int64_t group0;
    const Tile qt = sp.tile_of_group<Tile>(p, group, &group0);
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
    const std::uint32_t* const list = sp.candidates + static_cast<std::int64_t>(group) * kGroupCandidates;
    // The candidates' cells with a score above tau go into the forward's support record (the
    // fused forward after this pass records the dense tiles').
    std::uint32_t* const support_row =
        sp.view.support.bits != nullptr && p.segment_len == 0
            ? sp.view.support.row(p, qt.b, qt.h, qt.s, group0 / kSupportRows * kSupportRows)
            : nullptr;

    float o[D / 8][4];
    tile::zero(o);
    for (int first = 0; first < count; first += 32) {
      // Entry first + lane in this lane; `mine`: the lanes holding entries of this quad's rows
      // (entry & 7 is its row's position in an eight-row half: quad g's rows are g and g + 8).
      const bool held = first + lane < count;
      const std::uint32_t x = held ? list[first + lane] : 0u;
      unsigned mine = 0;
#pragma unroll
      for (int quad = 0; quad < 8; ++quad) {
        const unsigned of_quad = __ballot_sync(0xffffffffu, held && static_cast<int>(x & 7u) == quad);
        if (quad == g) mine = of_quad;
      }
      while (__any_sync(0xffffffffu, mine != 0)) {
        const bool active = mine != 0;
        const std::uint32_t entry = __shfl_sync(0xffffffffu, x, active ? __ffs(mine) - 1 : 0);
        mine &= mine - 1;
        const int half = static_cast<int>((entry >> 3) & 1u);
        const std::int64_t key = static_cast<std::int64_t>(entry >> 4);
        float w = 0.f;
        bool above = false;
#pragma unroll
        for (int v = 0; v < Views; ++v) {
          const T* k = active ? sp.k_hat[v].at<const T>(qt.b, qt.s.k_start + key, qt.hk) : nullptr;
          const float score = screen::quad_score<T, D>(half == 0 ? q_rows[v][0] : q_rows[v][1], k, active, tig);
          const float wv = mt::weight(score - tau[half], sp.view.power);
          w += v == 0 ? wv : -lambda * wv;
          above = above || score > tau[half];
        }
        if (support_row != nullptr && active && above && tig == 0) {
          const std::int64_t cell = key / kCellKeys;
          atomicOr(support_row + (cell >> 5), 1u << (cell & 31));
        }
        if (active && w != 0.f) {
          const T* vrow = p.v.at<const T>(qt.b, qt.s.k_start + key, qt.hk);
          const float w_lo = half == 0 ? w : 0.f, w_hi = half == 0 ? 0.f : w;
#pragma unroll
          for (int n = 0; n < D / 8; ++n) {
            const float2 xv = screen::feature_pair(vrow, n, tig);
            o[n][0] += w_lo * xv.x;
            o[n][1] += w_lo * xv.y;
            o[n][2] += w_hi * xv.x;
            o[n][3] += w_hi * xv.y;
          }
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
}

}  // namespace winnow::cuda
