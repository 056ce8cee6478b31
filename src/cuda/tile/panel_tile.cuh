// Shared-memory tiles in the layout the Hopper matrix units read directly: a Rows x Cols tile
// of 16-bit (or 8-bit) elements is column panels of 128 bytes (64 or 128 elements) one after
// another, each panel Rows rows of 128 bytes with the 16-byte chunks of row r XOR-swizzled by
// r % 8 (the 128-byte swizzle).
// A tile is filled with cp.async (any row order, any strides, zero rows past the operand) or by
// tensor copies (one thread, rows of one head and sequence, tensor_copies.cuh) and read through
// descriptors, as a K-major operand (its rows are the product's M or N index) or
// an MN-major one (its rows are the product's k index).
#pragma once

#include <cstdint>

#include "cuda/tile/hopper.cuh"
#include "cuda/tile/tensor_copies.cuh"

namespace winnow::cuda::tile {

template <class T, int Rows, int Cols>
struct PanelTile {
  static_assert(sizeof(T) == 2 || sizeof(T) == 1, "16-bit or 8-bit elements");
  static constexpr int kPanelCols = 128 / static_cast<int>(sizeof(T));
  static constexpr int kChunkElems = 16 / static_cast<int>(sizeof(T));
  static_assert(Cols % kPanelCols == 0 && Rows % 8 == 0, "whole panels of whole 8-row groups");
  static constexpr int kPanels = Cols / kPanelCols;
  static constexpr int kPanelBytes = Rows * 128;
  static constexpr int kBytes = Rows * Cols * static_cast<int>(sizeof(T));
  static constexpr int kChunks = Cols / kChunkElems;  // 16-byte chunks per row
  unsigned char* data;                      // 1024-byte aligned

  static __device__ __forceinline__ int offset_of(int row, int chunk) {
    return (chunk >> 3) * kPanelBytes + row * 128 + (((chunk & 7) ^ (row & 7)) << 4);
  }
  __device__ __forceinline__ int offset(int row, int chunk) const { return offset_of(row, chunk); }
  // For stores in a hot loop: the shared address of row `row` of the first panel with its
  // swizzle in bits 4-6 (row % 8, which `swizzle` must equal), so that its chunk c < 8 is at
  // chunk_address(row_address(..), c): one XOR where offset() costs a computation per chunk.
  __device__ __forceinline__ std::uint32_t row_address(int row, int swizzle) const {
    return smem_address(data) + row * 128 + (swizzle << 4);
  }
  static __device__ __forceinline__ std::uint32_t chunk_address(std::uint32_t row_address, int chunk) {
    return row_address ^ (chunk << 4);
  }

  // Cooperative asynchronous load. row_src(r) gives the global address of tile row r's first
  // element, or nullptr for a row outside the operand (zero-filled). Each row's Cols elements
  // are contiguous in global memory and 16-byte aligned.
  template <int NThreads, class RowSrc>
  __device__ __forceinline__ void load_async(int tid, RowSrc&& row_src) const {
    static_assert((Rows * kChunks) % NThreads == 0, "tile chunks must divide among threads");
#pragma unroll 4
    for (int i = 0; i < Rows * kChunks / NThreads; ++i) {
      const int idx = tid + i * NThreads;
      const int row = idx / kChunks, chunk = idx % kChunks;
      const T* src = row_src(row);
      cp_async_16(data + offset(row, chunk), src ? src + chunk * kChunkElems : nullptr, src != nullptr);
    }
  }

  // The cheap cooperative load for rows whose global addresses advance by a fixed step: thread
  // tid copies chunk tid % kChunks of tile rows r0, r0 + P, r0 + 2 P, ... (r0 = tid / kChunks,
  // P = NThreads / kChunks). `first` is the global address of row r0's first element, `step`
  // the distance in elements between its consecutive rows, and rows from `valid` on (counted
  // in the thread's own sequence) are zero-filled. Three instructions a copy: the producer
  // warps must leave the issue slots to the warps that compute.
  template <int NThreads>
  __device__ __forceinline__ void load_rows_async(int tid, const T* first, std::int64_t step, int valid) const {
    static_assert(NThreads % kChunks == 0 && Rows % (NThreads / kChunks) == 0, "whole rows per pass");
    // dst advances by whole rows, which keeps each row's swizzle (r % 8) only in steps of 8 rows.
    static_assert((NThreads / kChunks) % 8 == 0, "a pass of at least 8 rows, in multiples of 8");
    constexpr int P = NThreads / kChunks, J = Rows / P;
    const int chunk = tid % kChunks;
    unsigned char* dst = data + offset(tid / kChunks, chunk);
    const T* src = first + chunk * kChunkElems;
#pragma unroll
    for (int j = 0; j < J; ++j) cp_async_16(dst + j * P * 128, src + j * step, j < valid);
  }
  // The first tile row of thread tid's sequence in load_rows_async, and the sequence's stride.
  template <int NThreads>
  static __device__ __forceinline__ int first_row_of(int tid) { return tid / kChunks; }
  template <int NThreads>
  static constexpr int row_stride_of() { return NThreads / kChunks; }

  // The whole tile by tensor copies, one a panel, from one thread: rows row .. row + Rows - 1 of
  // head h and sequence b of the map's operand (a map whose boxes are Rows rows of one panel).
  __device__ __forceinline__ void load_tensor(const RowTileMap& m, int h, int row, int b, std::uint64_t* bar) const {
#pragma unroll
    for (int panel = 0; panel < kPanels; ++panel) {
      tensor_load_rows(data + panel * kPanelBytes, m, panel * kPanelCols, h, row, b, bar);
    }
  }

  // Rows row0 .. (a multiple of 8) as a K-major operand, at k-step k0 (a multiple of 32 bytes:
  // 16 16-bit or 32 8-bit elements). The offsets go into the descriptor's low half (see
  // descriptor_low), so the tile's base is computed once for every k-step of a pass.
  __device__ __forceinline__ std::uint64_t k_major(int row0, int k0) const {
    return k_major_at(smem_address(data), row0, k0);
  }
  // The same for a tile of this type at shared address `at`: for a loop that keeps its tiles'
  // addresses as integers (see tile::mbar_wait_at).
  static __device__ __forceinline__ std::uint64_t k_major_at(std::uint32_t at, int row0, int k0) {
    const int bytes = (k0 / kPanelCols) * kPanelBytes + row0 * 128 + (k0 % kPanelCols) * static_cast<int>(sizeof(T));
    return descriptor_of(descriptor_low(at, 16) + (bytes >> 4), 1024);
  }
  // The tile as an MN-major operand whose k index runs along the rows, from row k0.
  __device__ __forceinline__ std::uint64_t mn_major(int k0) const {
    static_assert(sizeof(T) == 2, "MN-major operands are 16-bit");
    return descriptor_of(descriptor_low(smem_address(data), kPanelBytes) + ((k0 * 128) >> 4), 1024);
  }
  // The same from column panel `panel` on (an operand narrower than the tile: N = 64 of 128).
  __device__ __forceinline__ std::uint64_t mn_major(int k0, int panel) const {
    static_assert(sizeof(T) == 2, "MN-major operands are 16-bit");
    return descriptor_of(descriptor_low(smem_address(data), kPanelBytes) + ((panel * kPanelBytes + k0 * 128) >> 4),
                         1024);
  }
};

}  // namespace winnow::cuda::tile
