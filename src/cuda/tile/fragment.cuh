// Warp-level products on register fragments of the m16n8k16 instruction. A warp owns 16 rows;
// an accumulator `float acc[NT][4]` covers 16 x (8 NT) fp32 values where thread (g, tig) =
// (lane / 4, lane % 4) holds, for n-tile n, row g columns 8n + 2tig, +1 in acc[n][0..1] and
// row g + 8 in acc[n][2..3]. An A operand `uint32_t a[KS][4]` covers 16 x (16 KS).
#pragma once

#include <cstdint>

#include "cuda/tile/ptx.cuh"

namespace winnow::cuda::tile {

template <int NT>
__device__ __forceinline__ void zero(float (&acc)[NT][4]) {
#pragma unroll
  for (int n = 0; n < NT; ++n) acc[n][0] = acc[n][1] = acc[n][2] = acc[n][3] = 0.f;
}

// acc (16 x 8NT) += A (16 x 16KS, registers) * B, B's n index along the rows of `tile`
// starting at n0 and its k index along the columns starting at 0.
template <class T, int NT, int KS, class Tile>
__device__ __forceinline__ void mma_b_rows(float (&acc)[NT][4], const std::uint32_t (&a)[KS][4],
                                           const Tile& tile, int n0, int lane) {
  static_assert(NT % 2 == 0, "n-tiles come in pairs");
#pragma unroll
  for (int ks = 0; ks < KS; ++ks) {
#pragma unroll
    for (int np = 0; np < NT / 2; ++np) {
      std::uint32_t b[4];
      tile.b_rows(b, n0 + 16 * np, 16 * ks, lane);
      mma_16816<T>(acc[2 * np], a[ks], b[0], b[1]);
      mma_16816<T>(acc[2 * np + 1], a[ks], b[2], b[3]);
    }
  }
}

// The same with A read from a row-major shared tile (rows m0 .. m0 + 15) one k-step at a time.
template <class T, int KS, int NT, class ATile, class BTile>
__device__ __forceinline__ void mma_smem_a_b_rows(float (&acc)[NT][4], const ATile& a_tile, int m0,
                                                  const BTile& tile, int n0, int lane) {
  static_assert(NT % 2 == 0, "n-tiles come in pairs");
#pragma unroll
  for (int ks = 0; ks < KS; ++ks) {
    std::uint32_t a[4];
    a_tile.a_rows(a, m0, 16 * ks, lane);
#pragma unroll
    for (int np = 0; np < NT / 2; ++np) {
      std::uint32_t b[4];
      tile.b_rows(b, n0 + 16 * np, 16 * ks, lane);
      mma_16816<T>(acc[2 * np], a, b[0], b[1]);
      mma_16816<T>(acc[2 * np + 1], a, b[2], b[3]);
    }
  }
}

// acc (16 x 8NT) += A (16 x 16KS, registers) * B, B's k index along the rows of `tile`
// starting at 0 and its n index along the columns starting at n0.
template <class T, int NT, int KS, class Tile>
__device__ __forceinline__ void mma_b_cols(float (&acc)[NT][4], const std::uint32_t (&a)[KS][4],
                                           const Tile& tile, int n0, int lane) {
  static_assert(NT % 2 == 0, "n-tiles come in pairs");
#pragma unroll
  for (int ks = 0; ks < KS; ++ks) {
#pragma unroll
    for (int np = 0; np < NT / 2; ++np) {
      std::uint32_t b[4];
      tile.b_cols(b, 16 * ks, n0 + 16 * np, lane);
      mma_16816<T>(acc[2 * np], a[ks], b[0], b[1]);
      mma_16816<T>(acc[2 * np + 1], a[ks], b[2], b[3]);
    }
  }
}

// An accumulator (16 x 16KS) re-used as the A operand of the next product (P in P V).
template <class T, int KS>
__device__ __forceinline__ void to_operand(const float (&acc)[2 * KS][4], std::uint32_t (&a)[KS][4]) {
#pragma unroll
  for (int s = 0; s < KS; ++s) {
    a[s][0] = pack2<T>(acc[2 * s][0], acc[2 * s][1]);
    a[s][1] = pack2<T>(acc[2 * s][2], acc[2 * s][3]);
    a[s][2] = pack2<T>(acc[2 * s + 1][0], acc[2 * s + 1][1]);
    a[s][3] = pack2<T>(acc[2 * s + 1][2], acc[2 * s + 1][3]);
  }
}

// A thread's share of one of its two fragment rows (half 0: row g, half 1: row g + 8; columns
// 8 n + 2 tig + 0..1) stored as T from `row`, the row's first column: a 32-bit store a pair.
template <class T, int N>
__device__ __forceinline__ void store_fragment_row(T* row, const float (&x)[N][4], int half, int tig) {
#pragma unroll
  for (int n = 0; n < N; ++n) {
    *reinterpret_cast<std::uint32_t*>(row + 8 * n + 2 * tig) = pack2<T>(x[n][2 * half], x[n][2 * half + 1]);
  }
}

// Whether any element of packed 16-bit operands is nonzero (a signed zero counts as zero), in
// this thread's share; a caller votes over the lanes that hold the tile.
template <int KS>
__device__ __forceinline__ bool any_nonzero(const std::uint32_t (&a)[KS][4]) {
  std::uint32_t bits = 0;
#pragma unroll
  for (int s = 0; s < KS; ++s) bits |= a[s][0] | a[s][1] | a[s][2] | a[s][3];
  return (bits & 0x7fff7fffu) != 0;
}

// A thread's share of an accumulator fragment (rows gq and gq + 8, columns 8 n + 2 tig + e)
// added into global memory: lanes tig and tig ^ 1 swap halves so that each holds four
// consecutive columns of one row (even lanes row gq, odd lanes row gq + 8), one 16-byte
// reduction instead of two. `row`: this lane's row at its first column 2 (tig & ~1), or null
// (the lane still takes part in the swaps).
template <int N>
__device__ __forceinline__ void red_add_row_quads(float* row, const float (&x)[N][4], bool odd) {
#pragma unroll
  for (int n = 0; n < N; ++n) {
    const float r0 = __shfl_xor_sync(0xffffffffu, odd ? x[n][0] : x[n][2], 1);
    const float r1 = __shfl_xor_sync(0xffffffffu, odd ? x[n][1] : x[n][3], 1);
    if (row == nullptr) continue;
    if (odd) {
      red_add4(row + 8 * n, r0, r1, x[n][2], x[n][3]);
    } else {
      red_add4(row + 8 * n, x[n][0], x[n][1], r0, r1);
    }
  }
}

// A fragments of a warp's 16 rows of a row-major shared tile, all k-steps.
template <int KS, class Tile>
__device__ __forceinline__ void load_rows_operand(std::uint32_t (&a)[KS][4], const Tile& tile,
                                                  int m0, int lane) {
#pragma unroll
  for (int ks = 0; ks < KS; ++ks) tile.a_rows(a[ks], m0, 16 * ks, lane);
}

}  // namespace winnow::cuda::tile
