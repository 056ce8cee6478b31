// The fused forward kernel shared by every mechanism that weighs keys row by row: one block
// of 8 warps owns 128 query rows (16 per warp) of one head; it sweeps key tiles of 64 from
// the diagonal leftwards, double-buffering K and V through shared memory with cp.async, and
// per tile computes S = Q K^T on the matrix units, lets the mechanism turn S into weights P
// (rescaling the running output where it must), and adds P V. Given live key tiles
// (key_tiles.cuh), it visits only those.
//
// A mechanism is a Rows policy holding its per-row running state in registers, constructed
// from (params, config, query tile, the thread's first row):
//   kUsesValues                false for sweeps that only gather row statistics (entmax's
//                              threshold search): no V is loaded and no P V is computed, and
//                              the policy stores its own results (store_extra)
//   weights<Masked>(s, mask)   scores -> weights in place
//   kRescores                  optional: weights takes a third argument, rescore(half, key),
//                              the row's score against a key recomputed from memory
//                              (ScoresFromMemory), for a fast form that recomputes what it
//                              cannot give exactly on rare rows
//                              (stick-breaking's odds); both kernels call weigh_scores
//   rescale(o)                 what the last weights() asks of the output so far (softmax's
//                              moved maximum), applied once no product is adding into o
//   halted(mask), finish(o, stat[2]), store_extra(...)
//   kSkipsSettledBlocks,       optional: a block whose rows are all settled(...) returns before
//   settled(p, cfg, qt, row)   loading anything (the threshold search's later sweeps)
//   kListsBlocks,              optional: the launch's blocks take the tiles a list names, in
//   listed_block<BQ>(p, cfg,   turn; listed_block (a static member) sets the block's grid
//     &block)                  coordinates, or returns false for a block past the list's end
//                              (the fused forward after threshold attention's screen)
//   kWritesStats               optional (default true): false for mechanisms without a per-row
//                              statistic (threshold attention); stats is then not touched
//   kFinishesOutput,           optional: the policy may change the finished output before it
//   finish_output<T>(o, p,     is stored (TDA's second view adds the first's)
//     cfg, qt, row0, tig)
//   kLimitsFirstKey,           optional: keys left of first_visible_key(p, cfg, qt, row) (a
//   first_visible_key(...)     static member) carry no weight for that row, and the sweep stops
//                              at the block's smallest (Multiscreen's windows)
//   kNeedsEveryRow,            optional: a block runs only when takes_part(p, cfg, qt, row) (a
//   takes_part(...)            static member) holds for every one of its rows, and returns at
//                              once otherwise (GSA's lists that hold every visible key run as
//                              dense softmax, whole blocks at a time)
//   kSkipsZeroTiles            optional: a tile whose weights are all exact zeros for a warp's
//                              rows (portable kernel) or a consumer's (Hopper) skips its P V
//                              (threshold attention: weights are zeros below tau); the vote
//                              costs a few instructions and a barrier a tile
//   kPrescreens,               optional, with kSkipsZeroTiles (Hopper): the consumer votes on
//   any_above(s, s2, key0)     the scores before weighing them, in rounds without a P V in
//                              flight, and a zero tile skips its weights too
//   kStages                    optional (Hopper): key and value stages, 2 by default
//   kScratchBytes,             optional, sweeps without values only: shared memory the policy
//   borrow_scratch(slot,       keeps per-thread lists in (entmax's candidate keys). It lies
//     stride, capacity)        where V would; thread (local row r, tig) owns floats
//                              slot[j * stride], j < capacity, with slot = base + 4 r + tig
//                              (consecutive lanes in consecutive banks). The Hopper kernel
//                              grants kScratchBytes, the portable one V's space only.
//   kStagingBytes,             optional, sweeps with values: shared memory beside V's ring in
//   borrow_staging(slot,       which the policy stages 8-byte records per thread and row (the
//     stride, capacity)        listing output sweep's support bits, filed at the block's end).
//                              Row r (local), tig own records at slot + j * stride bytes, j <
//                              capacity, slot = base + 8 (4 r + tig). The Hopper kernel grants
//                              it; the portable one grants none (capacity 0), and the policy
//                              does without.
#pragma once

#include <cstdint>
#include <type_traits>

#include "cuda/attention/geometry.cuh"
#include "cuda/element_types.cuh"
#include "cuda/attention/key_tiles.cuh"
#include "cuda/tile/fragment.cuh"
#include "cuda/tile/rows.cuh"
#include "cuda/tile/smem_tile.cuh"

namespace winnow::cuda {

inline constexpr int kForwardWarps = 8;
// Blocks per multiprocessor the forward kernel is compiled for. Two cap registers at 128, so
// two blocks share a multiprocessor and hide each other's latency: measured on an H100 that
// pays at D = 64 (softmax 0.69x -> 0.85x of FlashAttention-2) and costs at D = 128, where
// 128 registers spill.
template <int D>
inline constexpr int kForwardMinBlocks = D <= 64 ? 2 : 1;
inline constexpr int kForwardBQ = 16 * kForwardWarps;
inline constexpr int kForwardBK = 64;

// Visibility of one thread's two rows (g and g + 8 of its warp's 16) in the current key tile.
struct RowMask {
  std::int64_t limit[2];          // last visible key of each row (-1: none)
  std::int64_t first[2] = {0, 0};  // first visible key (> 0 where early halting dropped keys)
  std::int64_t key0;               // first key of the tile
  bool active;                     // false: every key of the tile is visible to every row
  int tig;
  // Segments (AttentionParams::segment_len) as the Hopper forward's instantiation for them sees
  // them (forward_sm90.cuh, Segments): rather than two more 64-bit registers live through the
  // sweep, a row's first key is worked out from its limit where a masked tile needs it. A
  // row's position is its limit + segment_shift (1 where the current key is not attended), and
  // segments are a power of two long (they divide 128): a position's segment is its bits under
  // segment_bits = ~(segment_len - 1). Elsewhere both are 0, constants that fold away.
  int segment_bits = 0, segment_shift = 0;

  __device__ __forceinline__ std::int64_t first_key(int half) const {
    return first[half] + ((limit[half] + segment_shift) & static_cast<std::int64_t>(segment_bits));
  }
  template <int BK>
  __device__ __forceinline__ bool visible(int half, int n, int e) const {
    const std::int64_t key = key0 + key_of<BK>(tig, n, e);
    return !active || (key >= first_key(half) && key <= limit[half]);
  }
};

// RowMask::segment_bits for p's segments.
__device__ __forceinline__ int segment_bits_of(const AttentionParams& p) {
  return p.segment_len > 0 ? ~static_cast<int>(p.segment_len - 1) : 0;
}

// The first key a row's sweep kept (the first key of the last tile it visited), as a position
// in the row's own sequence: segments (AttentionParams::segment_len) start at `first`.
__device__ __forceinline__ std::int64_t kept_from_key(std::int64_t tile_key0, std::int64_t first) {
  return (tile_key0 > first ? tile_key0 : first) - first;
}

template <class Rows, class = void>
inline constexpr int kScratchBytes = 0;
template <class Rows>
inline constexpr int kScratchBytes<Rows, std::void_t<decltype(Rows::kScratchBytes)>> = Rows::kScratchBytes;

// Hands a value-free sweep's policy its share of the scratch (see above); bytes is what the
// kernel has for it, BQ rows of four threads.
template <int BQ, class Rows, class Tile>
__device__ __forceinline__ void lend_scratch(Rows& rows, void* base, int bytes, const Tile& qt,
                                             std::int64_t row0, int tig) {
  if constexpr (kScratchBytes<Rows> > 0) {
    static_assert(!Rows::kUsesValues, "scratch lies where V would");
    float* const slot = static_cast<float*>(base) + 4 * static_cast<int>(row0 - qt.r0) + tig;
    rows.borrow_scratch(slot, 4 * BQ, bytes / static_cast<int>(4 * BQ * sizeof(float)));
  }
}

template <class Rows, class = void>
inline constexpr int kStagingBytes = 0;
template <class Rows>
inline constexpr int kStagingBytes<Rows, std::void_t<decltype(Rows::kStagingBytes)>> = Rows::kStagingBytes;

// kStagingBytes of shared memory at base (1024-aligned), records of 8 bytes (forward.cuh, top).
template <int BQ, class Rows, class Tile>
__device__ __forceinline__ void lend_staging(Rows& rows, void* base, const Tile& qt, std::int64_t row0, int tig) {
  if constexpr (kStagingBytes<Rows> > 0) {
    static_assert(Rows::kUsesValues, "the value-free sweeps have their scratch");
    const std::uint32_t slot = tile::smem_address(base) + 8u * static_cast<std::uint32_t>(4 * (row0 - qt.r0) + tig);
    rows.borrow_staging(slot, 8 * 4 * BQ, kStagingBytes<Rows> / (8 * 4 * BQ));
  }
}

template <class Rows, class = void>
inline constexpr bool kWritesStats = true;
template <class Rows>
inline constexpr bool kWritesStats<Rows, std::void_t<decltype(Rows::kWritesStats)>> = Rows::kWritesStats;

template <class Rows, class = void>
inline constexpr bool kFinishesOutput = false;
template <class Rows>
inline constexpr bool kFinishesOutput<Rows, std::void_t<decltype(Rows::kFinishesOutput)>> = Rows::kFinishesOutput;

template <class Rows, class = void>
inline constexpr bool kFinishesDq = false;
template <class Rows>
inline constexpr bool kFinishesDq<Rows, std::void_t<decltype(Rows::kFinishesDq)>> = Rows::kFinishesDq;

template <class Rows, class = void>
inline constexpr bool kLimitsFirstKey = false;
template <class Rows>
inline constexpr bool kLimitsFirstKey<Rows, std::void_t<decltype(Rows::kLimitsFirstKey)>> = Rows::kLimitsFirstKey;

// The first key tile any row of the block needs (0 unless the policy limits first keys). Every
// thread of the block must call this.
template <class Rows, int BQ, int BK, class Config, class Tile>
__device__ __forceinline__ int block_first_key_tile(const AttentionParams& p, const Config& cfg, const Tile& qt) {
  if constexpr (kLimitsFirstKey<Rows>) {
    __shared__ int first;
    if (threadIdx.x == 0) first = qt.key_tiles;
    __syncthreads();
    const std::int64_t row = qt.r0 + threadIdx.x;
    if (threadIdx.x < BQ && qt.limit(p, row) >= 0) {
      atomicMin(&first, static_cast<int>(Rows::first_visible_key(p, cfg, qt, row) / BK));
    }
    __syncthreads();
    return first;
  } else {
    return 0;
  }
}

template <class Rows, class = void>
inline constexpr bool kSkipsSettledBlocks = false;
template <class Rows>
inline constexpr bool kSkipsSettledBlocks<Rows, std::void_t<decltype(Rows::kSkipsSettledBlocks)>> =
    Rows::kSkipsSettledBlocks;

template <class Rows, class = void>
inline constexpr bool kListsBlocks = false;
template <class Rows>
inline constexpr bool kListsBlocks<Rows, std::void_t<decltype(Rows::kListsBlocks)>> = Rows::kListsBlocks;

// The grid coordinates of the block's query tile: its own, or the one its policy's list names;
// false when the list has none for it (the block returns at once).
template <class Rows, int BQ, class Config>
__device__ __forceinline__ bool block_tile(const AttentionParams& p, const Config& cfg, uint3* block) {
  *block = blockIdx;
  if constexpr (kListsBlocks<Rows>) return Rows::template listed_block<BQ>(p, cfg, block);
  return true;
}

template <class Rows, class = void>
inline constexpr bool kNeedsEveryRow = false;
template <class Rows>
inline constexpr bool kNeedsEveryRow<Rows, std::void_t<decltype(Rows::kNeedsEveryRow)>> = Rows::kNeedsEveryRow;

// Whether the whole block may return: every thread of it must call this.
template <class Rows, int BQ, class Config, class Tile>
__device__ __forceinline__ bool block_settled(const AttentionParams& p, const Config& cfg, const Tile& qt) {
  const int tid = threadIdx.x;
  if constexpr (kSkipsSettledBlocks<Rows>) {
    return !__syncthreads_or(tid < BQ && !Rows::settled(p, cfg, qt, qt.r0 + tid));
  } else if constexpr (kNeedsEveryRow<Rows>) {
    const std::int64_t row = qt.r0 + tid;
    return __syncthreads_or(tid < BQ && row < qt.s.q_len && !Rows::takes_part(p, cfg, qt, row)) != 0;
  } else {
    return false;
  }
}

template <class Rows, class = void>
inline constexpr bool kRescores = false;
template <class Rows>
inline constexpr bool kRescores<Rows, std::void_t<decltype(Rows::kRescores)>> = Rows::kRescores;

// A thread's row against one key of its sequence, q . k in float from global memory: the
// products the tensor cores summed, summed in another order. For the row policies that go back
// to a rare thread's logits (kRescores); slow, and never on the common path. The fused kernels run on
// 16-byte aligned rows, so both are read 16 bytes at a time.
template <class T, int D, class Tile>
struct ScoresFromMemory {
  const AttentionParams& p;
  const Tile& qt;
  std::int64_t row0;  // the thread's first row in the tile's sequence; the second is row0 + 8
  __device__ __forceinline__ float operator()(int half, std::int64_t key) const {
    constexpr int N = kPack16<T>;
    const T* const q = p.q.at<const T>(qt.b, qt.s.q_start + row0 + 8 * half, qt.h);
    const T* const k = p.k.at<const T>(qt.b, qt.s.k_start + key, qt.hk);
    float acc = 0.f;
#pragma unroll 1
    for (int c = 0; c < D; c += N) {
      const Pack<T, N> a = load_pack<T, N>(q + c), b = load_pack<T, N>(k + c);
#pragma unroll
      for (int j = 0; j < N; ++j) acc += widen(a.v[j]) * widen(b.v[j]);
    }
    return acc;
  }
};

// Scores -> weights for either kind of policy (kRescores or not).
template <bool Masked, class Rows, int NT, class Rescore>
__device__ __forceinline__ void weigh_scores(Rows& rows, float (&s)[NT][4], const RowMask& mask,
                                             const Rescore& rescore) {
  if constexpr (kRescores<Rows>) {
    rows.template weights<Masked>(s, mask, rescore);
  } else {
    rows.template weights<Masked>(s, mask);
  }
}

// DK: the head dimension of queries and keys, DV: of values (Multiscreen's 16 and 64).
template <class T, int DK, int DV = DK>
struct ForwardSmem {
  static constexpr int kBytes = (kForwardBQ * DK + 2 * kForwardBK * (DK + DV)) * sizeof(T);
};

template <class T, int DK, int DV, class Rows, class Config>
__global__ void __launch_bounds__(32 * kForwardWarps, kForwardMinBlocks<(DK > DV ? DK : DV)>)
    attention_forward_kernel(const AttentionParams p, const Config cfg, const LiveKeyTiles live) {
  constexpr int BQ = kForwardBQ, BK = kForwardBK, NT = BK / 8, DT = DV / 8, KS = DK / 16;
  constexpr int kThreads = 32 * kForwardWarps;
  extern __shared__ __align__(128) unsigned char smem_raw[];
  T* smem = reinterpret_cast<T*>(smem_raw);
  const tile::SmemTile<T, BQ, DK> q_tile{smem};
  // Buffer b of K is at k_base + b * BK * DK, of V at v_base + b * BK * DV (pointer arithmetic
  // rather than an array of tiles, which would be indexed at run time from local memory).
  T* const k_base = smem + BQ * DK;
  T* const v_base = k_base + 2 * BK * DK;
  auto k_tile = [&](int buf) { return tile::SmemTile<T, BK, DK>{k_base + buf * BK * DK}; };
  auto v_tile = [&](int buf) { return tile::SmemTile<T, BK, DV>{v_base + buf * BK * DV}; };

  uint3 block;
  if (!block_tile<Rows, BQ>(p, cfg, &block)) return;
  const QueryTile<BQ, BK> qt(p, block);
  if (qt.empty() || block_settled<Rows, BQ>(p, cfg, qt)) return;
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32, g = lane / 4, tig = lane % 4;
  const std::int64_t row0 = qt.r0 + 16 * warp + g;  // this thread's rows: row0, row0 + 8

  auto load_kv = [&](int kt, int buf) {
    const std::int64_t key0 = static_cast<std::int64_t>(kt) * BK;
    k_tile(buf).template load_async<kThreads>(tid, [&](int c) -> const T* {
      const std::int64_t key = key0 + key_of_column<BK>(c);
      return key < qt.s.k_len ? p.k.at<const T>(qt.b, qt.s.k_start + key, qt.hk) : nullptr;
    });
    if constexpr (Rows::kUsesValues) {
      v_tile(buf).template load_async<kThreads>(tid, [&](int c) -> const T* {
        const std::int64_t key = key0 + key_of_column<BK>(c);
        return key < qt.s.k_len ? p.v.at<const T>(qt.b, qt.s.k_start + key, qt.hk) : nullptr;
      });
    }
  };

  q_tile.template load_async<kThreads>(tid, [&](int r) -> const T* {
    const std::int64_t row = qt.r0 + r;
    return row < qt.s.q_len ? p.q.at<const T>(qt.b, qt.s.q_start + row, qt.h) : nullptr;
  });
  const KeyTileSweep<BK> sweep(p, live, qt);
  const int first_tile = block_first_key_tile<Rows, BQ, BK>(p, cfg, qt);
  int kt = sweep.last();
  if (kt < first_tile) kt = -1;
  if (kt >= 0) load_kv(kt, 0);
  tile::cp_async_commit();

  RowMask mask;
  mask.limit[0] = qt.limit(p, row0);
  mask.limit[1] = qt.limit(p, row0 + 8);
  mask.tig = tig;

  Rows rows(p, cfg, qt, row0);
  const ScoresFromMemory<T, DK, QueryTile<BQ, BK>> rescore{p, qt, row0};
  lend_scratch<BQ>(rows, v_base, 2 * BK * DV * static_cast<int>(sizeof(T)), qt, row0, tig);
  float o[DT][4];
  tile::zero(o);
  int kept_from_tile = 0;

  for (int i = 0; kt >= 0; ++i) {
    const int buf = i & 1, before = sweep.before(kt), next = before >= first_tile ? before : -1;
    if (next >= 0) {
      load_kv(next, buf ^ 1);
      tile::cp_async_commit();
      tile::cp_async_wait<1>();
    } else {
      tile::cp_async_wait<0>();
    }
    __syncthreads();

    float s[NT][4];
    tile::zero(s);
    // Q fragments are re-read from shared memory every tile: keeping them in registers would
    // cost the 32 registers that let two blocks share a multiprocessor.
    tile::mma_smem_a_b_rows<T, KS>(s, q_tile, 16 * warp, k_tile(buf), 0, lane);
    mask.key0 = static_cast<std::int64_t>(kt) * BK;
    mask.active = qt.needs_mask(kt);
    // Tiles off the diagonal (most of them at long context) run without any mask arithmetic.
    if (mask.active) {
      weigh_scores<true>(rows, s, mask, rescore);
    } else {
      weigh_scores<false>(rows, s, mask, rescore);
    }
    if constexpr (Rows::kUsesValues) {
      rows.rescale(o);
      std::uint32_t pa[BK / 16][4];
      tile::to_operand<T>(s, pa);
      if (!kSkipsZeroTiles<Rows> || __any_sync(0xffffffffu, tile::any_nonzero(pa))) {
        tile::mma_b_cols<T>(o, pa, v_tile(buf), 0, lane);
      }
    }
    kept_from_tile = kt;
    if (Rows::kCanHalt && rows.can_halt() && __syncthreads_and(rows.halted(mask))) break;
    __syncthreads();
    kt = next;
  }
  tile::cp_async_wait<0>();  // a halted sweep may leave a prefetch in flight

  float stat[2];
  rows.finish(o, stat);
  if constexpr (kFinishesOutput<Rows>) rows.template finish_output<T>(o, p, cfg, qt, row0, tig);
  for (int half = 0; half < 2; ++half) {
    const std::int64_t row = row0 + 8 * half;
    if (row >= qt.s.q_len) continue;
    if constexpr (Rows::kUsesValues) {
      tile::store_fragment_row<T>(p.out.at<T>(qt.b, qt.s.q_start + row, qt.h), o, half, tig);
    }
    if (tig == 0) {
      if constexpr (Rows::kUsesValues && kWritesStats<Rows>) {
        *p.stats.at<float>(qt.b, qt.s.q_start + row, qt.h) = stat[half];
      }
      rows.store_extra(p, cfg, qt.b, qt.s.q_start + row, qt.h,
                       static_cast<std::int64_t>(kept_from_tile) * BK, half);
    }
  }
}

}  // namespace winnow::cuda
