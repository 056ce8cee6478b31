// A slice of one row (a query, key, value or gradient row) held by one thread as floats: N
// consecutive 16-bit elements moved with the widest aligned vector loads and stores. The
// fused path's rows are 16-byte aligned with unit stride, so slices of 8 or more elements at
// multiples of 8 go as 16-byte vectors.
#pragma once

#include <cstdint>

#include "cuda/tile/ptx.cuh"

namespace winnow::cuda::tile {

template <class T, int N>
__device__ __forceinline__ void load_slice(const T* src, float (&dst)[N]) {
  static_assert(N % 2 == 0, "pairs of 16-bit elements");
  if constexpr (N % 8 == 0) {
#pragma unroll
    for (int v = 0; v < N / 8; ++v) {
      const uint4 w = reinterpret_cast<const uint4*>(src)[v];
      const std::uint32_t words[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
      for (int i = 0; i < 4; ++i) unpack2<T>(words[i], dst[8 * v + 2 * i], dst[8 * v + 2 * i + 1]);
    }
  } else {
#pragma unroll
    for (int i = 0; i < N / 2; ++i) {
      unpack2<T>(reinterpret_cast<const std::uint32_t*>(src)[i], dst[2 * i], dst[2 * i + 1]);
    }
  }
}

template <class T, int N>
__device__ __forceinline__ void store_slice(T* dst, const float (&src)[N]) {
  static_assert(N % 2 == 0, "pairs of 16-bit elements");
  if constexpr (N % 8 == 0) {
#pragma unroll
    for (int v = 0; v < N / 8; ++v) {
      reinterpret_cast<uint4*>(dst)[v] =
          make_uint4(pack2<T>(src[8 * v], src[8 * v + 1]), pack2<T>(src[8 * v + 2], src[8 * v + 3]),
                     pack2<T>(src[8 * v + 4], src[8 * v + 5]), pack2<T>(src[8 * v + 6], src[8 * v + 7]));
    }
  } else {
#pragma unroll
    for (int i = 0; i < N / 2; ++i) {
      reinterpret_cast<std::uint32_t*>(dst)[i] = pack2<T>(src[2 * i], src[2 * i + 1]);
    }
  }
}

}  // namespace winnow::cuda::tile
