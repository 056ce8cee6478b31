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
// A warpgroup whose warps are all dense on the first (diagonal) tile gives up on its
// rows: every tile becomes dense for them (a low beta costs one 8-bit tile per block, not a
// whole screen). A row group that listed candidates has its output rows written by the candidate
// pass, every other one by the screen, as zeros; the fused forward adds the dense tiles' part.
//
// Block: one work item (ScreenItems: 128 query rows of one head), two warpgroups of 64 rows
// that normalize and quantize the item's queries themselves (the only block to read them) and
// get its key tiles (natural key order, 128 keys x 128 bytes, quantized by a kernel before the
// screen, as every query tile of the head reads them) by bulk copies a few stages ahead of
// their products, and two blocks a multiprocessor. Views = 2
// (TDA) screens both views' products; a candidate of either view gets both exact scores and the
// weight w1 - lambda w2.
#pragma once

#include <climits>
#include <cstdint>
#include <type_traits>
#include <utility>

#include "cuda/attention/forward_sm90.cuh"
#include "cuda/attention/key_tiles.cuh"
#include "cuda/attention/threshold_rows.cuh"
#include "cuda/attention/threshold_screen_rows.cuh"
#include "cuda/tile/hopper.cuh"
#include "cuda/tile/panel_tile.cuh"

namespace winnow::cuda {

// A key tile of the screen as the normalization writes it and the screen's shared memory holds
// it (128 keys of 128 bytes, swizzled), so that one bulk copy moves it.
using ScreenKeyTile = tile::PanelTile<std::int8_t, kCellKeys, kScreenRowBytes>;
inline constexpr int kScreenTileBytes = ScreenKeyTile::kBytes;
inline constexpr int kSparseCandidates = 24;  // per warp and key tile, above which the tile is dense
inline constexpr int kGroupCandidates = 256;  // per row group, over its key tiles; past them, dense
inline constexpr int kCandidateWarps = 8;     // per block of the candidate pass

struct ThresholdScreenParams {
  ThresholdCudaConfig view;  // power, dim, beta; lambda set for TDA (the second view's factor)
  // Per view: the 16-bit normalized rows (the kernels' scores), the int8 key tiles ([sequence][kv
  // head][tile], ScreenKeyTile's layout) and per key tile the reciprocal of its keys' scale and
  // their largest error radius ([sequence][kv head][tile]), both from the keys' normalization.
  // The screen normalizes the queries itself: from the caller's rows (queries) into q_hat, their
  // signed inverse norms into q_inv ([batch row][head]) with eps, their int8 codes into its
  // shared memory only.
  detail::Operand q_hat[2], k_hat[2], queries[2];
  float* q_inv[2] = {nullptr, nullptr};
  float eps = 0.f;
  std::int8_t* k8[2] = {nullptr, nullptr};
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

  // A key tile's {1 / scale, largest error radius}.
  template <class Tile>
  __device__ __forceinline__ const float2* tile_bounds(int v, const AttentionParams& p, const Tile& qt) const {
    return tile_meta[v] + (qt.b * p.heads_kv + qt.hk) * key_tiles;
  }
  template <class Tile>
  __device__ __forceinline__ float2 tile_bound(int v, const AttentionParams& p, const Tile& qt, int kt) const {
    return tile_bounds(v, p, qt)[kt];
  }
  // Key tile 0 of the query tile's (sequence, kv head); tile kt follows at kt * kScreenTileBytes.
  template <class Tile>
  __device__ __forceinline__ const std::int8_t* key_tiles_of(int v, const AttentionParams& p, const Tile& qt) const {
    return k8[v] + (qt.b * p.heads_kv + qt.hk) * key_tiles * kScreenTileBytes;
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

namespace screen {

// A thread's slice of a 16-bit row in the candidate pass: features (D / 4) tig .. (D / 4) (tig +
// 1) - 1, contiguous, as D / 32 words of 16 bytes, so that a quad moves a row with 16-byte
// accesses (rows are 16-byte aligned on the fused path, the normalized ones contiguous).
template <int D>
inline constexpr int kSliceWords = D / 32;

template <int D>
__device__ __forceinline__ void load_slice(const void* row, int tig, uint4 (&x)[kSliceWords<D>]) {
  const uint4* at = reinterpret_cast<const uint4*>(row) + tig * kSliceWords<D>;
#pragma unroll
  for (int j = 0; j < kSliceWords<D>; ++j) x[j] = at[j];
}

__device__ __forceinline__ std::uint32_t word_of(const uint4& x, int i) {
  return i == 0 ? x.x : i == 1 ? x.y : i == 2 ? x.z : x.w;
}

// The slice's part of a score, features in order.
template <class T, int D>
__device__ __forceinline__ float slice_dot(const uint4 (&a)[kSliceWords<D>], const uint4 (&b)[kSliceWords<D>]) {
  float part = 0.f;
#pragma unroll
  for (int j = 0; j < kSliceWords<D>; ++j) {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      float a0, a1, b0, b1;
      tile::unpack2<T>(word_of(a[j], i), a0, a1);
      tile::unpack2<T>(word_of(b[j], i), b0, b1);
      part += a0 * b0 + a1 * b1;
    }
  }
  return part;
}

// f(std::integral_constant<int, s>{}) for s = 0, 1, ... while it returns true: a loop over a
// ring's stages unrolled, so that each stage's shared addresses are constants. Returns whether
// every call returned true.
template <class F, int... s>
__device__ __forceinline__ bool each_stage_while(F&& f, std::integer_sequence<int, s...>) {
  return (f(std::integral_constant<int, s>{}) && ...);
}

}  // namespace screen

// The screen's work items, one per query tile of a (sequence, query head), a block each: item i
// is the (i / pairs)-th query tile from the right (the heaviest first) of pair i % pairs, so
// that the causal triangle's long rows do not run last.
struct ScreenItems {
  int count, pairs, heads_q, group;
  __device__ __forceinline__ explicit ScreenItems(const AttentionParams& p, int bq) {
    heads_q = static_cast<int>(p.heads_q);
    group = p.heads_per_sweep;
    pairs = static_cast<int>(p.num_seqs) * heads_q;
    count = static_cast<int>((p.max_len_q + bq - 1) / bq) * pairs;
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

// Whether a row of the item cannot be screened on its diagonal tile (tau within the bound, as
// for beta near 0). Where no row can, the block leaves every tile to the fused forward (each row
// group's tiles dense, the block's live, no candidates: the counts start at zero). Called by
// one thread a row, with the row's {scale, error radius} per view in `cut`, which then gets the
// row's part of its cut per view (math::threshold::screen_row_cut), which the warps screening
// the row read from shared memory: offset +infinity for a row past the sequence, whose cut is
// then above every product and which never makes a tile dense.
template <int Views, class Tile>
__device__ __forceinline__ bool row_unscreenable(const AttentionParams& p, const ThresholdScreenParams& sp,
                                                 const Tile& qt, int ptid, float2 (&cut)[Views]) {
  float2 bound[Views];
#pragma unroll
  for (int v = 0; v < Views; ++v) bound[v] = cut[v];
  static_assert(Tile::kRows == 128, "a thread per row");
  bool unscreenable = true;
  const std::int64_t row = qt.r0 + ptid, limit = qt.limit(p, row);
#pragma unroll
  for (int v = 0; v < Views; ++v) cut[v] = make_float2(INFINITY, 1.f);
  if (limit >= 0) {
    const float tau = sp.view.beta[qt.h * sp.view.beta_head] * sp.view.unit(limit);
#pragma unroll
    for (int v = 0; v < Views; ++v) {
      const float2 q = bound[v], k = sp.tile_bound(v, p, qt, qt.key_tiles - 1);
      const math::threshold::ScreenRowCut<float> c = math::threshold::screen_row_cut(tau, q.y, q.x);
      if (math::threshold::screen_tile_cut(c, k.y, k.x) >= 1.f) unscreenable = false;
      cut[v] = make_float2(c.offset, c.factor);
    }
  }
  return unscreenable;
}
// The kernel's form: no producer warps and no resident blocks (session 89). A block of two
// warpgroups screens one item, two blocks a multiprocessor (128 registers a thread, one
// accumulator), so each scheduler has four warps whose products and screening interleave across
// blocks. The form before it, one resident block a multiprocessor with a producer warpgroup and
// two consumer warpgroups of two accumulators each, left each scheduler two warps waiting on
// their own chains of about 210 instructions a tile (Nsight Compute, session 82): this one is
// 10-20% faster at 2K to 16K (docs/performance.md, 2026-12-01). The smallest screen written the
// same way in Triton (bench/screen_ceiling.py: a row's maximum against a per-row cut, nothing
// listed) runs at 58% of the H200's int8 peak at L = 16384.
// Key tiles come as one bulk copy each (the normalization writes them in the shared-memory
// layout), S tiles ahead, into a ring of stages with a full barrier each; the last warp done with
// a stage's products issues the copy of the tile after them into it, so no warp waits on another
// tile by tile (with each thread copying its share by cp.async behind a block barrier a tile, the
// copies' addresses were about 40 of the loop's 180 instructions a thread, and the barrier the
// largest stall, 31% of Nsight Compute's samples, session 89). The loop is unrolled over the
// stages, so that each stage's descriptors and barrier are constants.
struct Sm90ScreenShape {
  static constexpr int kBQ = 128, kBK = 128, kThreads = 256, kWarps = kThreads / 32;
};

template <int Views>
struct Sm90ScreenSmem {
  using QTile = tile::PanelTile<std::int8_t, Sm90ScreenShape::kBQ, kScreenRowBytes>;
  using KTile = ScreenKeyTile;
  static_assert(KTile::kBytes == Sm90ScreenShape::kBK * kScreenRowBytes, "a key tile a stage");
  // Two blocks a multiprocessor: TRA 16 + 48 KB, TDA 32 + 64 KB.
  static constexpr int kStages = Views == 1 ? 3 : 2;
  static constexpr int kQ = 0;                                    // view v at kQ + v * QTile::kBytes
  static constexpr int kK = Views * QTile::kBytes;                // stage s, view v at kK + (s * Views + v) * KTile::kBytes
  static constexpr int kRowCuts = kK + kStages * Views * KTile::kBytes;  // [v][row], float2
  static constexpr int kFull = kRowCuts + Views * Sm90ScreenShape::kBQ * 8;  // [stage] mbarriers
  static constexpr int kDone = kFull + kStages * 8;                          // [stage] warps done, unsigned
  static constexpr int kBytes = kDone + kStages * 4 + 1024;
  static_assert(2 * kBytes <= 227 * 1024, "two blocks a multiprocessor");
};

template <class T, int D, int Views>
__global__ void __launch_bounds__(Sm90ScreenShape::kThreads, 2)
    threshold_screen_sm90_kernel(const AttentionParams p, const ThresholdScreenParams sp) {
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  namespace mt = math::threshold;
  using Shape = Sm90ScreenShape;
  using Smem = Sm90ScreenSmem<Views>;
  using KTile = typename Smem::KTile;
  constexpr int BQ = Shape::kBQ, BK = Shape::kBK, S = Smem::kStages, NT = Shape::kThreads;
  extern __shared__ unsigned char smem_raw[];
  const std::uint32_t smem_pad = (1024 - (tile::smem_address(smem_raw) & 1023)) & 1023;
  unsigned char* const smem = smem_raw + smem_pad;
  const std::uint32_t smem_at = tile::smem_address(smem_raw) + smem_pad;
  auto q_off = [](int v) { return Smem::kQ + v * Smem::QTile::kBytes; };
  auto k_off = [](int s, int v) { return Smem::kK + (s * Views + v) * KTile::kBytes; };
  auto q_at = [&](int v) { return smem_at + static_cast<std::uint32_t>(q_off(v)); };
  float2* const row_cuts = reinterpret_cast<float2*>(smem + Smem::kRowCuts);
  std::uint64_t* const full = reinterpret_cast<std::uint64_t*>(smem + Smem::kFull);
  unsigned* const warps_done = reinterpret_cast<unsigned*>(smem + Smem::kDone);

  // Item blockIdx.x, heaviest first (ScreenItems' order, one item a block).
  const ScreenItems items(p, BQ);
  const QueryTile<BQ, BK> qt(p, items.block(static_cast<int>(blockIdx.x)));
  if (qt.empty()) return;
  const int tid = threadIdx.x, wg = tid / 128, wtid = tid % 128;
  const int warp = wtid / 32, lane = tid % 32, g = lane / 4, tig = lane % 4;
  const std::int64_t group0 = qt.r0 + 64 * wg + 16 * warp;  // this warp's 16 rows
  const std::int64_t row0 = group0 + g;                      // this thread's rows: row0, row0 + 8
  // The item's queries, normalized here rather than by a kernel of their own before the screen
  // (which wrote int8 rows that this block then copied in, 0.037 ms per view at 16K tokens and
  // 12 heads on the H200, 2026-12-02): four lanes a row (rows tid / 4 and 64 + tid / 4), each
  // view's rows into q_hat and q_inv for the kernels after the screen, their codes into the
  // block's query tile, their {scale, error radius} into row_cuts for row_unscreenable. Both
  // rows' loads are issued before either's stores (load_wide_row says why).
  auto normalize_queries = [&] {
    constexpr int kPacks = D / 32, kPassRows = NT / kWideLanes;
    static_assert(2 * kPassRows == BQ, "two rows a lane");
    using QTile = typename Smem::QTile;
    const int sub = tid % kWideLanes;
#pragma unroll
    for (int v = 0; v < Views; ++v) {
      Pack<T, 8> in[2][kPacks];
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const int tile_row = tid / kWideLanes + kPassRows * r;
        load_wide_row<T, kPacks>(sp.queries[v].at<const T>(qt.b, qt.s.q_start + qt.r0 + tile_row, qt.h), sub,
                                 qt.r0 + tile_row < qt.s.q_len, in[r]);
      }
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const int tile_row = tid / kWideLanes + kPassRows * r;
        const std::int64_t at = qt.s.q_start + qt.r0 + tile_row;
        const bool valid = qt.r0 + tile_row < qt.s.q_len;
        unsigned char* const codes = smem + q_off(v);
        const float3 m = normalize_quantize_wide_row<T, kPacks>(
            in[r], sp.q_hat[v].at<T>(qt.b, at, qt.h), sub, valid, sp.eps, [&](int j, uint2 words) {
              const int pack = sub + kWideLanes * j;
              *reinterpret_cast<uint2*>(codes + QTile::offset_of(tile_row, pack / 2) + 8 * (pack % 2)) = words;
            });
        if (sub == 0) {
          if (valid) sp.q_inv[v][p.batch_row_q(qt.b, at) * p.heads_q + qt.h] = m.x;
          row_cuts[v * BQ + tile_row] = make_float2(m.y, m.z);
        }
      }
    }
  };
  if (qt.key_tiles == 0) {  // rows without keys (an empty key sequence): zero
    normalize_queries();
    store_zero_rows<T, D>(p, qt, row0, tig);
    return;
  }
  const int n_tiles = qt.key_tiles;
  const bool counting = sp.stats != nullptr;
  const int wg_uniform = tile::warp_uniform(wg);  // the query tile's descriptors in uniform registers

  // Tile i (key tile n_tiles - 1 - i, the diagonal first) into stage s = i % S, by one thread.
  auto load_keys = [&](int i, int s) {
    tile::mbar_arrive_expecting(full + s, Views * kScreenTileBytes);
#pragma unroll
    for (int v = 0; v < Views; ++v) {
      tile::bulk_load(smem + k_off(s, v), sp.key_tiles_of(v, p, qt) + static_cast<std::int64_t>(n_tiles - 1 - i) * kScreenTileBytes,
                      kScreenTileBytes, full + s);
    }
  };
  if (tid == 0) {
#pragma unroll
    for (int s = 0; s < S; ++s) {
      tile::mbar_init(full + s, 1);
      warps_done[s] = 0;
    }
    tile::mbar_init_fence();
    for (int i = 0; i < S && i < n_tiles; ++i) load_keys(i, i);
  }
  normalize_queries();
  __syncthreads();  // row_cuts holds every row's bound

  // While the first tiles come: each row's part of its cut, and whether the item can be screened
  // at all.
  bool unscreenable = true;
  if (tid < BQ) {
    float2 cut[Views];
#pragma unroll
    for (int v = 0; v < Views; ++v) cut[v] = row_cuts[v * BQ + tid];
    unscreenable = row_unscreenable<Views>(p, sp, qt, tid, cut);
#pragma unroll
    for (int v = 0; v < Views; ++v) row_cuts[v * BQ + tid] = cut[v];
  }
  tile::fence_to_async_proxy();  // the query tile's codes were ordinary stores; wgmma reads them asynchronously
  // Waits on the bulk copies still in flight (tiles first .. last - 1): none may outlive the block.
  auto drain = [&](int first, int last) {
    for (int i = first; i < last && i < n_tiles; ++i) tile::mbar_wait(full + i % S, (i / S) & 1);
  };
  if (__syncthreads_and(unscreenable)) {
    if (tid < BQ / kScreenGroupRows) {
      mark_tiles_dense(sp.dense.group(p, qt, qt.r0 + kScreenGroupRows * tid), sp.live_row(p, qt), n_tiles);
    }
    if (tid == 0) sp.list_block(qt);
    store_zero_rows<T, D>(p, qt, row0, tig);  // every tile dense: the fused forward adds them all
    drain(0, S);
    return;
  }

  std::int64_t limit[2];
#pragma unroll
  for (int half = 0; half < 2; ++half) limit[half] = qt.limit(p, row0 + 8 * half);
  mt::ScreenRowCut<float> row_cut[Views][2];
#pragma unroll
  for (int v = 0; v < Views; ++v) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const float2* const c = row_cuts + v * BQ + static_cast<int>(row0 + 8 * half - qt.r0);
      row_cut[v][half].offset = c->x;
      row_cut[v][half].factor = c->y;
    }
  }
  std::uint32_t* const dense_row = sp.dense.group(p, qt, group0);
  std::uint32_t* const live_row = sp.live_row(p, qt);
  const std::int64_t group = sp.group_index(p, qt, group0);
  std::uint32_t* const listed_candidates = sp.candidates + group * kGroupCandidates;
  int listed = 0;        // the same in every lane
  bool marked = false;   // whether this warp left a tile of the item dense (the same in every lane)
  bool done = false;     // this warpgroup gave its rows up to the fused forward

  // The key tiles' bounds, loaded a tile ahead.
  float2 bounds_next[Views];
#pragma unroll
  for (int v = 0; v < Views; ++v) bounds_next[v] = sp.tile_bound(v, p, qt, n_tiles - 1);

  // This warp is done reading stage s (tile i): the last of the block's warps to be so copies
  // tile i + S into it. A relaxed count is enough: each warp counts only after waiting for its
  // products to complete, so no read of the stage is left when the copy is issued (an acq_rel
  // one put a MEMBAR before each count, which also waits for the bounds' load in flight).
  auto release = [&](int i, int s) {
    if (lane == 0 && atomicAdd(warps_done + s, 1u) % Shape::kWarps == Shape::kWarps - 1 && i + S < n_tiles) {
      load_keys(i + S, s);
    }
  };

  int acc[64];
  // Tile i in stage s (s == i % S, a constant in each copy of the unrolled loop below), the
  // stage's phase `parity` ((i / S) % 2); false where the whole block gave its rows up on the
  // diagonal tile.
  auto screen_tile = [&](int i, auto stage, int parity) -> bool {
    const int s = stage;
    const int kt = n_tiles - 1 - i;
    const std::int64_t key0 = static_cast<std::int64_t>(kt) * BK;
    tile::mbar_wait_at(smem_at + static_cast<std::uint32_t>(Smem::kFull + 8 * s), parity);
    float2 bounds[Views];
#pragma unroll
    for (int v = 0; v < Views; ++v) {
      bounds[v] = bounds_next[v];
      if (kt > 0) bounds_next[v] = sp.tile_bound(v, p, qt, kt - 1);
    }
    bool tile_dense = false;
    if (done) {
      release(i, s);
    } else {
      // Each row's cut for this tile; a row whose tau lies within the bound (a cut below 1, or
      // NaN) makes the tile dense. The conversion saturates: an infinite cut is INT_MAX.
      int cut[Views][2];
      bool dense = false, over = false;
      std::uint64_t cand = 0;
#pragma unroll
      for (int v = 0; v < Views; ++v) {
#pragma unroll
        for (int j = 0; j < 64; ++j) asm volatile("" : "=r"(acc[j]));
        tile::wgmma_fence();
#pragma unroll
        for (int ks = 0; ks < kScreenRowBytes / 32; ++ks) {
          tile::wgmma_ss_s8_n128(acc, KTile::k_major_at(q_at(v), 64 * wg_uniform, 32 * ks),
                                 KTile::k_major_at(smem_at + static_cast<std::uint32_t>(k_off(s, v)), 0, 32 * ks),
                                 ks > 0);
        }
        tile::wgmma_commit();
        if (v == 0) {
#pragma unroll
          for (int u = 0; u < Views; ++u) {
#pragma unroll
            for (int half = 0; half < 2; ++half) {
              const float c = mt::screen_tile_cut(row_cut[u][half], bounds[u].y, bounds[u].x);
              dense = dense || !(c >= 1.f);
              cut[u][half] = __float2int_rz(c);
            }
          }
          dense = __any_sync(0xffffffffu, dense);
        }
        tile::wgmma_wait<0>();
        tile::pin(acc);
        if (v == Views - 1) release(i, s);  // the stage is read
        // continue, not break: `dense` is a warp's, and every warp of the warpgroup must issue
        // each view's product.
        if (dense) continue;
        // The products against the rows' cuts: where some row of the warp is over, the
        // candidates among the visible keys.
        int m[2][2] = {{INT_MIN, INT_MIN}, {INT_MIN, INT_MIN}};
#pragma unroll
        for (int e = 0; e < 16; ++e) {
          m[0][e % 2] = max(m[0][e % 2], max(acc[4 * e], acc[4 * e + 1]));
          m[1][e % 2] = max(m[1][e % 2], max(acc[4 * e + 2], acc[4 * e + 3]));
        }
        if (__any_sync(0xffffffffu, max(m[0][0], m[0][1]) > cut[v][0] || max(m[1][0], m[1][1]) > cut[v][1])) {
          over = true;
          // Entry (e, c) is key key0 + 2 tig + 8 e + (c & 1): visible to its row when 8 e + (c & 1)
          // is at most visible[c / 2], a 32-bit offset against compile-time columns.
          int visible[2];
#pragma unroll
          for (int half = 0; half < 2; ++half) {
            const std::int64_t d = limit[half] - key0 - 2 * tig;
            visible[half] = d < 0 ? -1 : (d > BK ? BK : static_cast<int>(d));
          }
#pragma unroll
          for (int e = 0; e < 16; ++e) {
#pragma unroll
            for (int c = 0; c < 4; ++c) {
              if (acc[4 * e + c] > cut[v][c / 2] && 8 * e + (c & 1) <= visible[c / 2]) cand |= 1ull << (4 * e + c);
            }
          }
        }
      }
      // The tile's candidates listed for the candidate pass, or the tile left dense (too many
      // for one tile, or for the group's list). Products above the cut may all lie past the
      // causal limit: then count is 0.
      if (!dense && over) {
        const int count = static_cast<int>(__reduce_add_sync(0xffffffffu, static_cast<unsigned>(__popcll(cand))));
        dense = count > kSparseCandidates || listed + count > kGroupCandidates;
        if (!dense && count > 0) {
          if (counting && lane == 0) {
            tile::red_add_global(sp.stats + 2, 1ull);
            tile::red_add_global(sp.stats + 3, static_cast<unsigned long long>(count));
          }
          int slot = listed + tile::warp_exclusive_sum(__popcll(cand));
          for (std::uint64_t left = cand; left != 0; left &= left - 1) {
            const int idx = __ffsll(left) - 1;
            const int row = g + 8 * ((idx & 3) >> 1);
            const std::int64_t key = key0 + 8 * (idx >> 2) + 2 * tig + (idx & 1);
            tile::st_global_b32(listed_candidates + slot++,
                                static_cast<std::uint32_t>(key) << 4 | static_cast<std::uint32_t>(row));
          }
          listed += count;
        }
      }
      if (dense && lane == 0) {
        tile::red_or_global(dense_row + (kt >> 5), 1u << (kt & 31));
        tile::red_or_global(live_row + (kt >> 5), 1u << (kt & 31));
      }
      marked = marked || dense;
      if (counting && lane == 0) {
        tile::red_add_global(sp.stats, 1ull);
        if (dense) tile::red_add_global(sp.stats + 1, 1ull);
      }
      tile_dense = dense;
    }
    if (i == 0) {
      // A warpgroup whose warps are all dense on the diagonal tile leaves every tile of its rows
      // to the fused forward; where both do, the block ends here.
      done = tile::named_sync_and(kConsumerBarrier + wg, 128, tile_dense);
      if (done && lane == 0) mark_tiles_dense(dense_row, live_row, n_tiles);
      marked = marked || done;
      if (__syncthreads_and(done)) {
        drain(1, S + 1);  // tile S was copied at tile 0's release, where there is one
        return false;
      }
    }
    return true;
  };
  // TRA's loop unrolled over its stages (spills 8 / 8 bytes; rolled, 36 / 68 before the stored
  // reciprocal); TDA's not (its two views' descriptors: spills 48 / 80 bytes, unrolled 128 / 236).
  if constexpr (Views == 1) {
    bool going = true;
    for (int i0 = 0, parity = 0; going && i0 < n_tiles; i0 += S, parity ^= 1) {
      going = screen::each_stage_while(
          [&](auto stage) { return i0 + stage() < n_tiles && screen_tile(i0 + stage(), stage, parity); },
          std::make_integer_sequence<int, S>{});
    }
  } else {
    for (int i = 0, s = 0, parity = 0; i < n_tiles; ++i) {
      if (!screen_tile(i, s, parity)) break;
      if (++s == S) s = 0, parity ^= 1;
    }
  }
  // The item listed for the fused forward by the first of its warps that marked a tile dense.
  if (marked && lane == 0 && atomicAdd(sp.item_marks + blockIdx.x, 1) == 0) sp.list_block(qt);
  if (listed > 0) {
    if (lane == 0) sp.candidate_counts[group] = listed;
  } else {
    store_zero_rows<T, D>(p, qt, row0, tig);
  }
#endif
}

// The candidates' part of the output, after the screen: the rows of every row group that listed
// candidates (the screen wrote every other row as zeros), to which the fused forward then adds
// the dense tiles' part. Persistent warps: warp w takes row groups w, w + W, ... (W warps in the
// launch, as many as fit on the device at once) and passes over those without candidates. In
// that order the warps running at once share a few heads' rows in L2; in the order the screen
// finished its groups (heads interleaved), TDA's pass was 20-35% slower (H200, session 83).
//
// A group in two steps. First its candidates' weights: each quad takes kTake entries of the list
// at a time, whichever rows they are of, loads their query and key rows (a thread a quarter of
// each, 16 bytes an access) before any arithmetic, and sums the exact scores over the quad; the
// entries with a nonzero weight go, in a fixed order, into the warp's list of survivors in shared
// memory. Then the survivors' value rows, each added by the quad that holds its row's output, and
// the group's rows stored. Most candidates score at or below tau (the screen's cut leaves room
// for its bound), so most groups need one round trip for their key rows and one for a few value
// rows. The form before it handled a candidate at a time in the quad of its row, its key row and
// then its value row loaded four bytes an access: 42 / 112 us of TRA's / TDA's forward at 16K
// tokens, 12 heads, latency-bound (42% of stall samples on global loads, 20% occupancy;
// Nsight Compute, H200, 2026-12-02).
template <int Views>
inline constexpr int kCandidatesTaken = Views == 1 ? 2 : 1;  // entries per quad and step (registers)

template <class T, int D, int Views>
__global__ void __launch_bounds__(kCandidateWarps * 32)
    threshold_candidates_kernel(const AttentionParams p, const ThresholdScreenParams sp) {
  namespace mt = math::threshold;
  using Tile = QueryTile<Sm90ScreenShape::kBQ, Sm90ScreenShape::kBK>;
  constexpr int kTake = kCandidatesTaken<Views>, kWords = screen::kSliceWords<D>;
  struct Survivor {
    std::uint32_t entry;
    float weight;
  };
  __shared__ Survivor survivors_of[kCandidateWarps][kGroupCandidates];
  const int warp = static_cast<int>(threadIdx.x) / 32, lane = threadIdx.x % 32, g = lane / 4, tig = lane % 4;
  Survivor* const survivors = survivors_of[warp];
  const int stride = static_cast<int>(gridDim.x) * kCandidateWarps;
  for (int group = static_cast<int>(blockIdx.x) * kCandidateWarps + warp; group < sp.groups; group += stride) {
    const int count = min(sp.candidate_counts[group], kGroupCandidates);
    if (count == 0) continue;
    std::int64_t group0;
    const Tile qt = sp.tile_of_group<Tile>(p, group, &group0);
    const float lambda = Views == 2 ? -sp.view.factor(qt.h) : 0.f;
    // Lane r < 16 holds tau of the group's row r, for the quads to fetch by shuffles.
    const float tau_of_lane =
        sp.view.beta[qt.h * sp.view.beta_head] * sp.view.unit(qt.limit(p, group0 + (lane % kScreenGroupRows)));
    const std::uint32_t* const list = sp.candidates + static_cast<std::int64_t>(group) * kGroupCandidates;
    // The candidates' cells with a score above tau go into the forward's support record (the
    // fused forward after this pass records the dense tiles').
    std::uint32_t* const support_row =
        sp.view.support.bits != nullptr && p.segment_len == 0
            ? sp.view.support.row(p, qt.b, qt.h, qt.s, group0 / kSupportRows * kSupportRows)
            : nullptr;

    // Step 1: the weights; entry e = key << 4 | row within the group.
    int survivor_count = 0;
    for (int first = 0; first < count; first += 8 * kTake) {
      std::uint32_t entry[kTake];
      bool active[kTake];
      uint4 q_slice[kTake][Views][kWords], k_slice[kTake][Views][kWords];
#pragma unroll
      for (int u = 0; u < kTake; ++u) {
        const int at = first + g * kTake + u;
        active[u] = at < count;
        // An inactive entry reads the group's first row and key 0, which exist (the group listed
        // a candidate), and its weight is not kept.
        entry[u] = active[u] ? list[at] : 0u;
        const std::int64_t row = group0 + (entry[u] & 15u), key = entry[u] >> 4;
#pragma unroll
        for (int v = 0; v < Views; ++v) {
          screen::load_slice<D>(sp.q_hat[v].at<const T>(qt.b, qt.s.q_start + row, qt.h), tig, q_slice[u][v]);
          screen::load_slice<D>(sp.k_hat[v].at<const T>(qt.b, qt.s.k_start + key, qt.hk), tig, k_slice[u][v]);
        }
      }
#pragma unroll
      for (int u = 0; u < kTake; ++u) {
        const float tau = __shfl_sync(0xffffffffu, tau_of_lane, static_cast<int>(entry[u] & 15u));
        float w = 0.f;
        bool above = false;
#pragma unroll
        for (int v = 0; v < Views; ++v) {
          const float score = tile::quad_sum(screen::slice_dot<T, D>(q_slice[u][v], k_slice[u][v]));
          const float wv = mt::weight(score - tau, sp.view.power);
          w += v == 0 ? wv : -lambda * wv;
          above = above || score > tau;
        }
        if (support_row != nullptr && active[u] && above && tig == 0) {
          const std::int64_t cell = static_cast<std::int64_t>(entry[u] >> 4) / kCellKeys;
          atomicOr(support_row + (cell >> 5), 1u << (cell & 31));
        }
        // Quads in turn within step u (entries first + g kTake + u, ascending in g for each u: list
        // order for kTake = 1): a fixed order, so each row's sum is the same from call to call.
        const bool keep = active[u] && w != 0.f;
        const unsigned kept = __ballot_sync(0xffffffffu, keep && tig == 0);
        if (keep && tig == 0) survivors[survivor_count + __popc(kept & ((1u << lane) - 1u))] = {entry[u], w};
        survivor_count += __popc(kept);
      }
    }
    __syncwarp();

    // Step 2: the survivors' value rows into their rows' outputs (quad g: rows g and g + 8).
    float o[2][8 * kWords];
#pragma unroll
    for (int half = 0; half < 2; ++half) {
#pragma unroll
      for (int f = 0; f < 8 * kWords; ++f) o[half][f] = 0.f;
    }
    for (int first = 0; first < survivor_count; first += 32) {
      const bool held = first + lane < survivor_count;
      const Survivor mine_entry = held ? survivors[first + lane] : Survivor{0u, 0.f};
      unsigned mine = 0;
#pragma unroll
      for (int quad = 0; quad < 8; ++quad) {
        const unsigned of_quad = __ballot_sync(0xffffffffu, held && static_cast<int>(mine_entry.entry & 7u) == quad);
        if (quad == g) mine = of_quad;
      }
      while (__any_sync(0xffffffffu, mine != 0)) {
        const bool active = mine != 0;
        const int from = active ? __ffs(mine) - 1 : 0;
        const std::uint32_t entry = __shfl_sync(0xffffffffu, mine_entry.entry, from);
        const float w = __shfl_sync(0xffffffffu, mine_entry.weight, from);
        mine &= mine - 1;
        if (active) {
          uint4 v_slice[kWords];
          screen::load_slice<D>(p.v.at<const T>(qt.b, qt.s.k_start + (entry >> 4), qt.hk), tig, v_slice);
          const int half = static_cast<int>((entry >> 3) & 1u);
#pragma unroll
          for (int j = 0; j < kWords; ++j) {
#pragma unroll
            for (int i = 0; i < 4; ++i) {
              float x0, x1;
              tile::unpack2<T>(screen::word_of(v_slice[j], i), x0, x1);
              // Both halves' registers touched, one by zero: no dynamic register index.
              const float w_lo = half == 0 ? w : 0.f, w_hi = half == 0 ? 0.f : w;
              o[0][8 * j + 2 * i] += w_lo * x0;
              o[0][8 * j + 2 * i + 1] += w_lo * x1;
              o[1][8 * j + 2 * i] += w_hi * x0;
              o[1][8 * j + 2 * i + 1] += w_hi * x1;
            }
          }
        }
      }
    }
    __syncwarp();  // the survivors' list is read before the next group writes it
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const std::int64_t row = group0 + g + 8 * half;
      if (row >= qt.s.q_len) continue;
      uint4* const out = reinterpret_cast<uint4*>(p.out.at<T>(qt.b, qt.s.q_start + row, qt.h)) + tig * kWords;
#pragma unroll
      for (int j = 0; j < kWords; ++j) {
        const float* x = o[half] + 8 * j;
        out[j] = make_uint4(tile::pack2<T>(x[0], x[1]), tile::pack2<T>(x[2], x[3]), tile::pack2<T>(x[4], x[5]),
                            tile::pack2<T>(x[6], x[7]));
      }
    }
  }
}

}  // namespace winnow::cuda
