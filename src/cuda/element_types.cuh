// Per-element conversions the element-wise kernels (rotary, RMSNorm) share: 16-bit values are
// widened to float32 for arithmetic, float64 stays float64, and results are rounded back once.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

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

}  // namespace winnow::cuda
