// RoPE's transpose where the softmax backward's Hopper kernels store dq and dk
// (GradientParams::rotary_cos): the operator rotated q and k before the kernels, and the
// gradients are wanted with respect to the unrotated ones. Columns c and c + D/2 form a pair,
// and in a wgmma accumulator (n-tile n: columns 8 n + 2 tig + e) the pair of n-tile n < D/16 is
// n-tile n + D/16 of the same thread, so the rotation needs no data from another thread.
#pragma once

#include <cstdint>

#include "core/params.h"
#include "math/rotary.h"

namespace winnow::cuda {

// A row's (or key's) position in its sequence: segments (AttentionParams::segment_len) restart.
__device__ __forceinline__ std::int64_t rotary_position(const detail::AttentionParams& p, std::int64_t position) {
  return position - p.first_visible_key(position);
}

// Columns c and c + D/2 (lo, hi) of a gradient row at sequence position pos, rotated back.
__device__ __forceinline__ void rotate_back(const detail::GradientParams& g, std::int64_t pos, int c, float& lo,
                                            float& hi) {
  const std::int64_t t = pos * g.rotary_row + c;
  float y_lo, y_hi;
  math::rotary::rotate(lo, hi, g.rotary_cos[t], g.rotary_sin[t], /*transpose=*/true, y_lo, y_hi);
  lo = y_lo;
  hi = y_hi;
}

// An accumulator of D / 8 n-tiles whose elements 0, 1 are a row at position pos[0] and 2, 3 a
// row at pos[1] (a negative position: a row past the sequence, left alone).
template <int D>
__device__ __forceinline__ void rotate_back_fragment(const detail::GradientParams& g, float (&acc)[D / 8][4],
                                                     const std::int64_t (&pos)[2], int tig) {
#pragma unroll
  for (int n = 0; n < D / 16; ++n) {
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const std::int64_t at = pos[j / 2];
      if (at >= 0) rotate_back(g, at, 8 * n + 2 * tig + (j & 1), acc[n][j], acc[n + D / 16][j]);
    }
  }
}

}  // namespace winnow::cuda
