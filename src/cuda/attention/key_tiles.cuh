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
// The kernels then walk the live cells' tiles (KeyTileSweep), right to left, as bits.
#pragma once

#include <cstdint>

#include "cuda/attention/geometry.cuh"

namespace winnow::cuda {

inline constexpr int kCellRows = 128, kCellKeys = 128;

// Floats as ints whose order is the floats' order, for atomicMax (NaN above +inf).
__device__ __forceinline__ int ordered_int(float x) {
  const int i = __float_as_int(x);
  return i >= 0 ? i : i ^ 0x7fffffff;
}
__device__ __forceinline__ float ordered_float(int i) { return __int_as_float(i >= 0 ? i : i ^ 0x7fffffff); }

// Per (sequence, query head, block of kCellRows rows, cell of kCellKeys keys): the largest raw
// score q . k the block's rows see in the cell, as ordered_int. Cleared to bytes of 0x80 (an
// int below every score's). data == nullptr: not recorded.
struct TileMaxMap {
  int* data = nullptr;
  int q_blocks = 0, cells = 0;

  __device__ __forceinline__ int* block_row(std::int64_t b, std::int64_t h, std::int64_t heads_q,
                                            std::int64_t r0) const {
    return data + ((b * heads_q + h) * q_blocks + r0 / kCellRows) * cells;
  }
};

// One bit per cell, per block: live cells. bits == nullptr: every tile is live.
struct LiveKeyTiles {
  const std::uint32_t* bits = nullptr;
  int q_blocks = 0, words = 0;  // words per block
};

// The key tiles of BK keys a block visits: those of its live cells, below key_tiles.
template <int BK>
struct KeyTileSweep {
  static_assert(kCellKeys % BK == 0, "a tile lies in one cell");
  static constexpr int kTilesPerCell = kCellKeys / BK;
  const std::uint32_t* bits;  // this block's; null: every tile
  int key_tiles;
  int count;  // tiles visited

  template <int BQ>
  __device__ __forceinline__ KeyTileSweep(const AttentionParams& p, const LiveKeyTiles& live,
                                          const QueryTile<BQ, BK>& qt)
      : bits(nullptr), key_tiles(qt.key_tiles), count(qt.key_tiles) {
    static_assert(BQ == kCellRows, "a block's rows are one row of the map");
    if (live.bits == nullptr) return;
    bits = live.bits + ((qt.b * p.heads_q + qt.h) * live.q_blocks + qt.r0 / kCellRows) * live.words;
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

}  // namespace winnow::cuda
