// Shared-memory tiles of 16-bit elements, Rows x Cols, stored with a 16-byte-chunk XOR swizzle
// so that the eight row addresses of every ldmatrix land in distinct banks, and the fragment
// loads the m16n8k16 products need from them. Four ways to read a tile, named after the role
// it plays in a product:
//   a_rows   A operand whose rows are the tile's rows (Q or dO in Q K^T / dO V^T)
//   b_rows   B operand whose n index runs along the tile's rows (K in Q K^T, V in dO V^T)
//   b_cols   B operand whose k index runs along the tile's rows (V in P V, K in dS K)
//   a_cols   A operand whose k index runs along the tile's rows (P^T, dS^T from [row][key])
#pragma once

#include <cstdint>

#include "cuda/tile/ptx.cuh"

namespace winnow::cuda::tile {

template <class T, int Rows, int Cols>
struct SmemTile {
  static_assert(Cols % 64 == 0 || Cols == 16 || Cols == 32,
                "rows span whole 128-byte lines, or a line holds 4 (Cols 16) or 2 (Cols 32) rows");
  static constexpr int kRows = Rows, kCols = Cols, kChunks = Cols / 8;
  // Rows narrower than a 128-byte line share one: a line holds kRowsPerLine rows, and the
  // chunk index is XORed with the line's index within each group of eight chunks, so that the
  // eight consecutive rows of an ldmatrix still land in eight distinct 16-byte bank groups.
  static constexpr int kRowsPerLine = kChunks >= 8 ? 1 : 8 / kChunks;
  T* data;

  __device__ __forceinline__ int offset(int row, int chunk) const {
    if constexpr (kRowsPerLine == 1) {
      return row * Cols + ((chunk ^ (row & 7)) << 3);
    } else {
      return row * Cols + ((chunk ^ ((row / kRowsPerLine) & (kChunks - 1))) << 3);
    }
  }
  __device__ __forceinline__ T* chunk_ptr(int row, int chunk) const {
    return data + offset(row, chunk);
  }

  // Cooperative asynchronous load. row_src(r) returns the global address of tile row r, or
  // nullptr for a row outside the operand (zero-filled). Columns are contiguous in global
  // memory and 16-byte aligned.
  template <int NThreads, class RowSrc>
  __device__ __forceinline__ void load_async(int tid, RowSrc&& row_src) const {
    constexpr int kTotal = Rows * kChunks;
    static_assert(kTotal % NThreads == 0 || NThreads % kTotal == 0,
                  "tile chunks must divide among threads (or threads among chunks)");
    if (kTotal < NThreads && tid >= kTotal) return;  // a narrow tile: one chunk per thread
#pragma unroll
    for (int i = 0; i < (kTotal + NThreads - 1) / NThreads; ++i) {
      const int idx = tid + i * NThreads;
      const int row = idx / kChunks, chunk = idx % kChunks;
      const T* src = row_src(row);
      cp_async_16(chunk_ptr(row, chunk), src ? src + chunk * 8 : nullptr, src != nullptr);
    }
  }

  __device__ __forceinline__ void a_rows(std::uint32_t (&a)[4], int m0, int k0, int lane) const {
    ldmatrix_x4(a, chunk_ptr(m0 + (lane & 15), (k0 >> 3) + (lane >> 4)));
  }
  // B fragments of two n-tiles (n0 .. n0 + 15) at k-step k0: {b[0][0], b[0][1], b[1][0], b[1][1]}.
  __device__ __forceinline__ void b_rows(std::uint32_t (&b)[4], int n0, int k0, int lane) const {
    ldmatrix_x4(b, chunk_ptr(n0 + (lane & 7) + ((lane >> 4) << 3), (k0 >> 3) + ((lane >> 3) & 1)));
  }
  __device__ __forceinline__ void b_cols(std::uint32_t (&b)[4], int k0, int n0, int lane) const {
    ldmatrix_x4_trans(b, chunk_ptr(k0 + (lane & 7) + (((lane >> 3) & 1) << 3), (n0 >> 3) + (lane >> 4)));
  }
  __device__ __forceinline__ void a_cols(std::uint32_t (&a)[4], int m0, int k0, int lane) const {
    ldmatrix_x4_trans(a, chunk_ptr(k0 + (lane & 7) + ((lane >> 4) << 3), (m0 >> 3) + ((lane >> 3) & 1)));
  }

  // Stores one 16x8 accumulator fragment (rows m0 + g, m0 + g + 8; columns n0 + 2 tig, +1) as
  // 16-bit elements.
  __device__ __forceinline__ void store_c(const float (&c)[4], int m0, int n0, int lane) const {
    const int g = lane >> 2, tig = lane & 3;
    const int col = n0 + 2 * tig;
    *reinterpret_cast<std::uint32_t*>(data + offset(m0 + g, col >> 3) + (col & 7)) =
        pack2<T>(c[0], c[1]);
    *reinterpret_cast<std::uint32_t*>(data + offset(m0 + g + 8, col >> 3) + (col & 7)) =
        pack2<T>(c[2], c[3]);
  }
};

}  // namespace winnow::cuda::tile
