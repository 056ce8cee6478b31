// What the element-wise kernels (rotary, RMSNorm, SwiGLU) share: 16-bit values are widened to
// float32 for arithmetic, float64 stays float64, and results are rounded back once; packs of
// consecutive elements moved with one 8- or 16-byte access.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstddef>
#include <cstdint>
#include <type_traits>

#include "cuda/tile/ptx.cuh"

namespace winnow::cuda {

// The arithmetic type for storage type T.
template <class T>
struct Compute {
  using type = float;
};
template <>
struct Compute<double> {
  using type = double;
};

template <class T>
__device__ __forceinline__ typename Compute<T>::type widen(T x) {
  if constexpr (std::is_same_v<T, __nv_bfloat16> || std::is_same_v<T, __half>) {
    return tile::to_float(x);
  } else {
    return static_cast<typename Compute<T>::type>(x);
  }
}

template <class T, class C>
__device__ __forceinline__ T narrow_to(C x) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    return __float2bfloat16_rn(x);
  } else if constexpr (std::is_same_v<T, __half>) {
    return __float2half_rn(x);
  } else {
    return static_cast<T>(x);
  }
}

// N consecutive elements loaded or stored with one access (N * sizeof(T) of 4, 8 or 16 bytes).
template <class T, int N>
struct alignas(N * sizeof(T)) Pack {
  T v[N];
};

// Elements of T in a 16-byte access.
template <class T>
inline constexpr int kPack16 = static_cast<int>(16 / sizeof(T));

template <class T, int N>
__device__ __forceinline__ Pack<T, N> load_pack(const T* at) {
  return *reinterpret_cast<const Pack<T, N>*>(at);
}

template <class T, int N>
__device__ __forceinline__ void store_pack(T* at, const Pack<T, N>& pack) {
  *reinterpret_cast<Pack<T, N>*>(at) = pack;
}

// Host side: whether `ptr` may be accessed in packs of `bytes`.
inline bool aligned_to(const void* ptr, std::size_t bytes) {
  return reinterpret_cast<std::uintptr_t>(ptr) % bytes == 0;
}

}  // namespace winnow::cuda
