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

// 16-bit elements go out through 32-bit words of their bits in one vector store, written as
// PTX: stored as a Pack, or as a uint4 of those words, the normalization kernels' 16-byte
// stores came out of NVVM as four 4-byte stores (sm_90a, CUDA 13; a small kernel of the same
// shape kept its v4 store, so the split depends on the surrounding code, not on this one).
// One instruction where four did; the plain normalization kept its time (0.029 ms per view at
// 16K tokens, 12 heads, H200), its stores not being what it waits on.
// `at` is in global memory, as for every caller (kernels' outputs).
template <class T>
__device__ __forceinline__ unsigned bits_of_16(T x) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    return __bfloat16_as_ushort(x);
  } else {
    static_assert(std::is_same_v<T, __half>, "16-bit elements are bf16 or fp16");
    return __half_as_ushort(x);
  }
}

template <class T, int N>
__device__ __forceinline__ void store_pack(T* at, const Pack<T, N>& pack) {
  if constexpr (sizeof(T) == 2 && (N == 2 || N == 4 || N == 8)) {
    unsigned w[N / 2];
#pragma unroll
    for (int k = 0; k < N / 2; ++k) w[k] = bits_of_16(pack.v[2 * k]) | (bits_of_16(pack.v[2 * k + 1]) << 16);
    if constexpr (N == 8) {
      asm volatile("st.global.v4.b32 [%0], {%1, %2, %3, %4};\n" ::"l"(__cvta_generic_to_global(at)), "r"(w[0]),
                   "r"(w[1]), "r"(w[2]), "r"(w[3])
                   : "memory");
    } else if constexpr (N == 4) {
      asm volatile("st.global.v2.b32 [%0], {%1, %2};\n" ::"l"(__cvta_generic_to_global(at)), "r"(w[0]), "r"(w[1])
                   : "memory");
    } else {
      *reinterpret_cast<unsigned*>(at) = w[0];
    }
  } else {
    *reinterpret_cast<Pack<T, N>*>(at) = pack;
  }
}

// Host side: whether `ptr` may be accessed in packs of `bytes`.
inline bool aligned_to(const void* ptr, std::size_t bytes) {
  return reinterpret_cast<std::uintptr_t>(ptr) % bytes == 0;
}

}  // namespace winnow::cuda
