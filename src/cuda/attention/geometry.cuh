// Where a thread block's tiles sit in a sequence, and which (row, key) pairs are visible.
//
// Key tiles are stored in shared memory in a permuted row order: score column c (accumulator
// order: n-tile n = c / 8, thread tig = (c / 2) % 4, element e = c % 2) holds key
// tig * (BK / 4) + 2n + e of the tile. Each thread then owns BK / 4 consecutive keys of each
// of its rows, so scans along the keys (stick-breaking's suffix sums) run inside a thread and
// finish with one quad-level scan. The value tile uses the same order, so P V is unchanged.
#pragma once

#include <cstdint>

#include "core/params.h"

namespace winnow::cuda {

using detail::AttentionParams;
using detail::SequenceExtent;

template <int BK>
__device__ __forceinline__ int key_of_column(int c) {
  return ((c >> 1) & 3) * (BK / 4) + 2 * (c >> 3) + (c & 1);
}
// The key a thread holds for n-tile n, element e.
template <int BK>
__device__ __forceinline__ int key_of(int tig, int n, int e) {
  return tig * (BK / 4) + 2 * n + e;
}

__device__ __forceinline__ std::int64_t later_key(std::int64_t a, std::int64_t b) { return a > b ? a : b; }

// One block's query tile: rows [r0, r0 + BQ) of sequence b, query head h.
template <int BQ, int BK>
struct QueryTile {
  static constexpr int kRows = BQ;
  std::int64_t b, h, hk, r0;
  SequenceExtent s;
  std::int64_t first_limit;  // last key visible to row r0 (clamped to the sequence)
  int key_tiles;             // key tiles 0 .. key_tiles - 1 hold every visible key
  // Segments (AttentionParams::segment_len): the tiles below first_tile hold no key any row of
  // the block sees. 0 otherwise.
  int first_tile;
  bool head_in_range;

  // Grid (query_tile_grid): x = query tile, heaviest (rightmost) first, interleaved over
  // p.heads_per_sweep query heads (x = tile * heads_per_sweep + head in the group); y = group
  // of query heads; z = sequence. With one head per sweep, each (head, sequence)'s heaviest
  // tile of the last heads starts within a tile's run of the launch's end (an idle tail of
  // about 3% at L = 8192, B 4, 16 heads: tools/block_schedule.py); interleaved, the blocks
  // running at once still share a few heads' keys and values in L2.
  __device__ __forceinline__ QueryTile(const AttentionParams& p) : QueryTile(p, blockIdx) {}
  // The tile a block at grid coordinates `block` has (a persistent kernel's work item).
  __device__ __forceinline__ QueryTile(const AttentionParams& p, uint3 block) {
    const int group = p.heads_per_sweep;
    b = block.z;
    h = static_cast<std::int64_t>(block.y) * group + static_cast<int>(block.x) % group;
    head_in_range = h < p.heads_q;
    hk = p.kv_head(h);
    s = p.sequence(b);
    const std::int64_t tiles = (s.q_len + BQ - 1) / BQ;
    r0 = (tiles - 1 - static_cast<std::int64_t>(block.x) / group) * BQ;
    first_limit = limit(p, r0);
    const std::int64_t last_row = (r0 + BQ < s.q_len ? r0 + BQ : s.q_len) - 1;
    const std::int64_t last_key = limit(p, last_row);
    key_tiles = last_key < 0 ? 0 : static_cast<int>(last_key / BK + 1);
    first_tile = static_cast<int>(p.first_visible_key(r0 + s.q_offset()) / BK);
  }
  // The grid coordinates of sequence b's query tile `tile` (counted from the left) of head h.
  static __device__ __forceinline__ uint3 block_of(const AttentionParams& p, std::int64_t b, std::int64_t h,
                                                   std::int64_t tile) {
    const int group = p.heads_per_sweep;
    const std::int64_t from_right = (p.sequence(b).q_len + BQ - 1) / BQ - 1 - tile;
    return make_uint3(static_cast<unsigned>(from_right * group + h % group), static_cast<unsigned>(h / group),
                      static_cast<unsigned>(b));
  }
  // Blocks past the sequence's last query tile, or past the last head, have nothing to do.
  __device__ __forceinline__ bool empty() const { return !head_in_range || r0 < 0 || r0 >= s.q_len; }

  // Last key visible to local row r (-1: none, or r is past the sequence).
  __device__ __forceinline__ std::int64_t limit(const AttentionParams& p, std::int64_t r) const {
    if (r < 0 || r >= s.q_len) return -1;
    const std::int64_t last = p.last_visible_key(r + s.q_offset());
    return last < s.k_len - 1 ? last : s.k_len - 1;
  }
  // Whether some row of the tile misses some key of key tile kt (rows past the sequence see
  // none). Segments are not considered: the forward's only tile with them is the diagonal one,
  // and the backward masks keys left of a row's first key itself.
  __device__ __forceinline__ bool needs_mask(int kt) const {
    return static_cast<std::int64_t>(kt + 1) * BK - 1 > first_limit || r0 + BQ > s.q_len;
  }
  // First key visible to local row r (its segment's first; 0 without segments).
  __device__ __forceinline__ std::int64_t first_key(const AttentionParams& p, std::int64_t r) const {
    return p.first_visible_key(r + s.q_offset());
  }
};

// The grid of QueryTile<BQ, ...> blocks for p (p.heads_per_sweep heads interleaved).
inline dim3 query_tile_grid(const AttentionParams& p, int bq) {
  const std::int64_t group = p.heads_per_sweep;
  return dim3(static_cast<unsigned>((p.max_len_q + bq - 1) / bq * group),
              static_cast<unsigned>((p.heads_q + group - 1) / group), static_cast<unsigned>(p.num_seqs));
}

}  // namespace winnow::cuda
