// Hopper's tensor memory accelerator (TMA): one thread asks for a whole tile of rows and the
// copy engine writes it into shared memory, swizzled, counting its bytes on an mbarrier. Where
// cp.async spends an instruction or three of every producer thread on each 16-byte chunk (a
// D = 128 tile of Q and dO: 16 copies a thread of a 128-thread producer), a tensor copy is one
// instruction a 64-column panel, issued by one thread, and its bytes bypass the registers and
// the load/store unit the consumers' shared-memory traffic uses.
//
// A RowTileMap describes an operand's rows ([batch][row][head][dim] in any stride order) for
// PanelTile's layout: boxes of Rows rows x 128 bytes of one head and sequence, written with the
// 128-byte swizzle, so that a PanelTile filled by tensor copies reads exactly as one filled by
// cp.async. Rows past the operand's last (in the row and batch dimensions) arrive as zeros, as
// cp.async's zero-fill writes them; packed sequences (which would read the next sequence's
// rows) are not mapped (host side: tensor_maps.h).
//
// Everything here compiles for any architecture; only kernels built for sm_90a may call it.
#pragma once

#include <cstdint>

#include "cuda/tile/ptx.cuh"
#include "cuda/tile/row_tile_map.h"

namespace winnow::cuda::tile {

// The mbarrier's current phase expects `bytes` more of copies, and this thread arrives on it.
__device__ __forceinline__ void mbar_arrive_expecting(std::uint64_t* bar, std::uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(smem_address(bar)), "r"(bytes)
               : "memory");
}

// The map lives in kernel parameters (__grid_constant__); fetching it ahead of the first copy
// takes its latency off the first tile.
__device__ __forceinline__ void prefetch_tensor_map(const RowTileMap& m) {
  asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<std::uint64_t>(&m.map)) : "memory");
}

// Rows row .. row + box of head h and sequence b, columns col .. col + 63 (16-bit elements),
// into the 1024-byte aligned panel at dst; its bytes complete on bar.
__device__ __forceinline__ void tensor_load_rows(void* dst, const RowTileMap& m, int col, int h, int row, int b,
                                                 std::uint64_t* bar) {
  const int c1 = m.head_axis == 1 ? h : m.row_axis == 1 ? row : b;
  const int c2 = m.head_axis == 2 ? h : m.row_axis == 2 ? row : b;
  const int c3 = m.head_axis == 3 ? h : m.row_axis == 3 ? row : b;
  asm volatile(
      "cp.async.bulk.tensor.4d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4, %5}], "
      "[%6];\n" ::"r"(smem_address(dst)),
      "l"(reinterpret_cast<std::uint64_t>(&m.map)), "r"(col), "r"(c1), "r"(c2), "r"(c3), "r"(smem_address(bar))
      : "memory");
}

// `bytes` (a multiple of 16) contiguous bytes from global src (16-byte aligned) to shared dst
// (16-byte aligned); they complete on bar.
__device__ __forceinline__ void bulk_load(void* dst, const void* src, std::uint32_t bytes, std::uint64_t* bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::"r"(
                   smem_address(dst)),
               "l"(reinterpret_cast<std::uint64_t>(src)), "r"(bytes), "r"(smem_address(bar))
               : "memory");
}

}  // namespace winnow::cuda::tile
