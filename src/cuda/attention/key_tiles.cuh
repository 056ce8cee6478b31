// Which key tiles a forward block visits. Mechanisms whose weights vanish below a per-row
// threshold (entmax, Sieve) can skip every key tile in which no row of the block has a score
// above its threshold: no K or V load, no products, no weights.
//
// The map is coarse on purpose, so that it costs next to nothing to build: per block of 128
// query rows and cell of 128 keys, the largest score any row of the block sees in the cell
// (TileMaxMap, recorded by the first threshold sweep, which computes every score anyway).
// Once the thresholds are known, a cell is live when its largest score clears the smallest
// threshold of the block's rows (select_live_key_tiles): a superset of the cells that hold a
// weight, since a row's kept keys score above its own threshold, hence above the smallest.
// The kernels then walk the live cells' tiles (KeyTileSweep), as bits: the forward right to
// left, the backward left to right. A sweep with values may also set the bits itself as it
// meets nonzero weights (SupportBits), exact per block, for a later kernel.
// Finer and without a map: a policy with kSkipsZeroTiles (threshold attention) lets a kernel
// skip the products of a tile it finds all exact zeros after computing its scores.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <type_traits>

#include "cuda/attention/geometry.cuh"

namespace winnow::cuda {

inline constexpr int kCellRows = 128, kCellKeys = 128;

// Floats as ints whose order is the floats' order, for atomicMax (NaN above +inf).
__device__ __forceinline__ int ordered_int(float x) {
  const int i = __float_as_int(x);
  return i >= 0 ? i : i ^ 0x7fffffff;
}
__device__ __forceinline__ float ordered_float(int i) { return __int_as_float(i >= 0 ? i : i ^ 0x7fffffff); }

// Which row of a map (of any per-block record) belongs to the block of query rows from r0, in
// sequence b, query head h.
__host__ __device__ __forceinline__ std::int64_t map_block(std::int64_t b, std::int64_t h, std::int64_t heads_q,
                                                           int q_blocks, std::int64_t r0) {
  return (b * heads_q + h) * q_blocks + r0 / kCellRows;
}

// Per (sequence, query head, block of kCellRows rows, cell of kCellKeys keys): the largest raw
// score q . k the block's rows see in the cell, as ordered_int. Cleared to bytes of 0x80 (an
// int below every score's). data == nullptr: not recorded.
struct TileMaxMap {
  int* data = nullptr;
  int q_blocks = 0, cells = 0;

  __device__ __forceinline__ int* block_row(std::int64_t b, std::int64_t h, std::int64_t heads_q,
                                            std::int64_t r0) const {
    return data + map_block(b, h, heads_q, q_blocks, r0) * cells;
  }
};

// One bit per cell, per block: live cells. bits == nullptr: every tile is live.
struct LiveKeyTiles {
  const std::uint32_t* bits = nullptr;
  int q_blocks = 0, words = 0;  // words per block
};

// The map's extent for a problem: query blocks per (sequence, head), cells, words of bits.
inline int map_query_blocks(const AttentionParams& p) {
  return static_cast<int>((p.max_len_q + kCellRows - 1) / kCellRows);
}
inline int map_cells(const AttentionParams& p) { return static_cast<int>((p.max_len_k + kCellKeys - 1) / kCellKeys); }
inline int map_words(const AttentionParams& p) { return (map_cells(p) + 31) / 32; }
inline std::size_t map_blocks(const AttentionParams& p) {
  return static_cast<std::size_t>(p.num_seqs * p.heads_q) * static_cast<std::size_t>(map_query_blocks(p));
}
// Skipping is on unless WINNOW_DENSE_KEY_TILES is set (for comparison: every tile visited).
inline bool key_tile_skipping_enabled(const AttentionParams& p) {
  return std::getenv("WINNOW_DENSE_KEY_TILES") == nullptr && p.max_len_q > 0 && p.max_len_k > 0;
}

// Bits a sweep with values sets as it goes: a cell's bit once some weight of the block in it is
// nonzero (entmax's grad-weight sweep, for the backward). Cleared to zero before the sweep.
struct SupportBits {
  std::uint32_t* bits = nullptr;  // null: not recorded
  int q_blocks = 0, words = 0;

  __device__ __forceinline__ std::uint32_t* block_row(std::int64_t b, std::int64_t h, std::int64_t heads_q,
                                                      std::int64_t r0) const {
    return bits == nullptr ? nullptr : bits + map_block(b, h, heads_q, q_blocks, r0) * words;
  }
  LiveKeyTiles live() const { return {bits, q_blocks, words}; }
};

// Where a forward found weights that can be nonzero, for its backward (threshold attention's
// saved rows, winnow/threshold.h: saved_support_words): per query head and row tile of
// kSupportRows rows of a sequence, a bit per cell of kCellKeys keys; `flag` nonzero once a forward
// recorded it whole. A bit is set where some score of the tile's rows in the cell is above its
// row's threshold (or wherever the forward did not test): a superset of the cells with a nonzero
// weight or slope, so that a backward may skip every other cell's tiles exactly. bits == nullptr:
// not recorded.
inline constexpr int kSupportRows = 64;
struct TileSupport {
  std::uint32_t* bits = nullptr;
  int* flag = nullptr;
  std::int64_t row_tiles = 0;  // per query head
  int words = 0;               // per row tile

  // Row tile of rows r .. of sequence b (r a multiple of kSupportRows): numbered b + first / 64 +
  // r / 64, `first` the sequence's first row among all query rows, so that every layout's tiles
  // fit in num_seqs + ceil(rows / 64).
  __device__ __forceinline__ std::uint32_t* row(const AttentionParams& p, std::int64_t b, std::int64_t h,
                                                const SequenceExtent& s, std::int64_t r) const {
    const std::int64_t t = b + p.batch_row_q(b, s.q_start) / kSupportRows + r / kSupportRows;
    return bits + (h * row_tiles + t) * words;
  }
};

// Marks cells 0 .. cells - 1 of a support row (one thread), as when a forward does not test its
// tiles.
__device__ __forceinline__ void mark_support_cells(std::uint32_t* row, int cells) {
  for (int w = 0; 32 * w < cells; ++w) {
    const int left = cells - 32 * w;
    atomicOr(row + w, left >= 32 ? 0xffffffffu : (1u << left) - 1u);
  }
}

// Called by every thread of a warp per tile (key0: the tile's first key): sets the tile's
// cell bit when some thread of the warp has a nonzero weight in it.
__device__ __forceinline__ void mark_support(std::uint32_t* block_row, std::int64_t key0, bool any) {
  if (block_row == nullptr) return;
  if (__any_sync(0xffffffffu, any) && (threadIdx.x & 31) == 0) {
    const std::int64_t cell = key0 / kCellKeys;
    atomicOr(block_row + (cell >> 5), 1u << (cell & 31));
  }
}

// The key tiles of BK keys a block visits: those of its live cells, below key_tiles.
template <int BK>
struct KeyTileSweep {
  static_assert(kCellKeys % BK == 0, "a tile lies in one cell");
  static constexpr int kTilesPerCell = kCellKeys / BK;
  const std::uint32_t* bits;  // this block's; null: every tile
  int key_tiles;
  // Tiles visited. With segments (no live map then: launch_attention.cuh packs no mechanism
  // that skips tiles), those from the block's first tile on: the forward's sweep, right to
  // left, stops after `count`; the backward's starts at its rows' first key.
  int count;

  template <int BQ>
  __device__ __forceinline__ KeyTileSweep(const AttentionParams& p, const LiveKeyTiles& live,
                                          const QueryTile<BQ, BK>& qt)
      : bits(nullptr), key_tiles(qt.key_tiles), count(qt.key_tiles) {
    static_assert(BQ == kCellRows, "a block's rows are one row of the map");
    if (live.bits == nullptr) {
      count = qt.first_tile < key_tiles ? key_tiles - qt.first_tile : 0;
      return;
    }
    bits = live.bits + map_block(qt.b, qt.h, p.heads_q, live.q_blocks, qt.r0) * live.words;
    const int cells = (key_tiles + kTilesPerCell - 1) / kTilesPerCell;
    count = 0;
    for (int w = 0; 32 * w < cells; ++w) {
      const int left = cells - 32 * w;
      const std::uint32_t word = bits[w] & (left >= 32 ? 0xffffffffu : (1u << left) - 1u);
      count += kTilesPerCell * __popc(word);
    }
    // The last cell may reach past the last tile.
    if (live_cell(cells - 1)) count -= cells * kTilesPerCell - key_tiles;
  }

  __device__ __forceinline__ bool live_cell(int c) const {
    return c >= 0 && (bits == nullptr || ((bits[c >> 5] >> (c & 31)) & 1u) != 0);
  }

  // The first visited tile at or after kt, or key_tiles (the backward walks left to right).
  __device__ __forceinline__ int at_or_after(int kt) const {
    if (kt >= key_tiles) return key_tiles;
    if (bits == nullptr) return kt;
    const int cells = (key_tiles + kTilesPerCell - 1) / kTilesPerCell;
    for (int c = kt / kTilesPerCell; c < cells; c = (c & ~31) + 32) {
      const std::uint32_t word = bits[c >> 5] & (0xffffffffu << (c & 31));
      if (word != 0) {
        const int start = ((c & ~31) + __ffs(word) - 1) * kTilesPerCell;
        return start < kt ? kt : (start < key_tiles ? start : key_tiles);
      }
    }
    return key_tiles;
  }
  __device__ __forceinline__ int after(int kt) const { return at_or_after(kt + 1); }

  // The last tile visited: before(key_tiles).
  __device__ __forceinline__ int last() const { return before(key_tiles); }

  // The largest visited tile below kt, or -1.
  __device__ __forceinline__ int before(int kt) const {
    int t = kt - 1;
    if (bits == nullptr || t < 0) return t;
    int c = t / kTilesPerCell;
    while (c >= 0) {
      const std::uint32_t word = bits[c >> 5] & (0xffffffffu >> (31 - (c & 31)));
      if (word != 0) {
        const int cell = (c & ~31) + 31 - __clz(word);
        const int end = (cell + 1) * kTilesPerCell - 1;
        return end < t ? end : t;
      }
      c = (c & ~31) - 1;
    }
    return -1;
  }
};

// Whether a policy (a forward Rows or a key-stationary backward's Keys) has tiles of exact-zero
// weights skip their products (kSkipsZeroTiles, default false).
template <class Policy, class = void>
inline constexpr bool kSkipsZeroTiles = false;
template <class Policy>
inline constexpr bool kSkipsZeroTiles<Policy, std::void_t<decltype(Policy::kSkipsZeroTiles)>> = Policy::kSkipsZeroTiles;

}  // namespace winnow::cuda
