// Rotary position embedding on CUDA: a thread per (x_i, x_{i+D/2}) pair, reading the 16-bit or
// 32-bit inputs once and writing once; arithmetic in float32 (float64 for float64 inputs).
// Memory-bound: it replaces about ten element-wise LibTorch operations per tensor.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "cuda/cuda.h"
#include "cuda/launch.h"
#include "math/rotary.h"

namespace winnow::cuda {
namespace {

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
  return static_cast<typename Compute<T>::type>(x);
}
template <>
__device__ __forceinline__ float widen(__nv_bfloat16 x) {
  return __bfloat162float(x);
}
template <>
__device__ __forceinline__ float widen(__half x) {
  return __half2float(x);
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

template <class T>
__global__ void rotary_kernel(detail::RotaryParams p) {
  using C = typename Compute<T>::type;
  const std::int64_t pairs = p.batch * p.length * p.heads * p.half;
  for (std::int64_t n = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; n < pairs;
       n += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    const std::int64_t i = n % p.half;
    const std::int64_t row = n / p.half;
    const std::int64_t h = row % p.heads, l = (row / p.heads) % p.length, b = row / (p.heads * p.length);
    const T* x = static_cast<const T*>(p.x) + b * p.x_stride[0] + l * p.x_stride[1] + h * p.x_stride[2];
    T* out = static_cast<T*>(p.out) + b * p.out_stride[0] + l * p.out_stride[1] + h * p.out_stride[2];
    const std::int64_t t = l * p.table_stride[0] + i * p.table_stride[1];
    const C c = static_cast<const C*>(p.cos)[t], s = static_cast<const C*>(p.sin)[t];
    C low, high;
    math::rotary::rotate(widen(x[i * p.x_stride[3]]), widen(x[(i + p.half) * p.x_stride[3]]), c, s,
                         p.transpose, low, high);
    out[i * p.out_stride[3]] = narrow_to<T>(low);
    out[(i + p.half) * p.out_stride[3]] = narrow_to<T>(high);
  }
}

template <class T>
void launch(const detail::RotaryParams& p) {
  const std::int64_t pairs = p.batch * p.length * p.heads * p.half;
  constexpr int kThreads = 256;
  // Enough blocks to fill the GPU several times over; the grid-stride loop covers the rest.
  const std::int64_t blocks = std::min<std::int64_t>((pairs + kThreads - 1) / kThreads, 65536);
  rotary_kernel<T><<<static_cast<unsigned>(blocks), kThreads, 0, static_cast<cudaStream_t>(p.cuda_stream)>>>(p);
  check_launch("rotary_kernel");
}

}  // namespace

void rotary(const detail::RotaryParams& p) {
  switch (p.dtype) {
    case DType::bfloat16: return launch<__nv_bfloat16>(p);
    case DType::float16: return launch<__half>(p);
    case DType::float32: return launch<float>(p);
    case DType::float64: return launch<double>(p);
    default: throw Error(ErrorKind::unsupported, "winnow::rotary::apply: argument 'x': a floating-point dtype");
  }
}

}  // namespace winnow::cuda
