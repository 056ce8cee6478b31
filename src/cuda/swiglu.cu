// SwiGLU's gate on CUDA: memory-bound, one read of each input and one write of each output.
// The common case (unit column strides, rows a multiple of 16 bytes, aligned) moves 16 bytes a
// thread with 32-bit indexing: at (65536 x 704) bf16 the element-a-thread kernel below ran at
// under half the copy bandwidth on the H100. Otherwise blocks tile a row's columns and stride
// over rows, so no element needs a 64-bit division.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <cstdint>

#include "cuda/cuda.h"
#include "cuda/element_types.cuh"
#include "cuda/launch.h"
#include "math/swiglu.h"

namespace winnow::cuda {
namespace {

constexpr int kThreads = 256;

template <class T>
__global__ void forward_kernel(detail::SwiGLUParams p) {
  const std::int64_t c = static_cast<std::int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  if (c >= p.cols) return;
  const T* gate = static_cast<const T*>(p.gate);
  const T* up = static_cast<const T*>(p.up);
  T* y = static_cast<T*>(p.y);
  for (std::int64_t n = blockIdx.y; n < p.rows; n += gridDim.y) {
    y[n * p.y_stride[0] + c * p.y_stride[1]] = narrow_to<T>(math::swiglu::forward(
        widen(gate[n * p.gate_stride[0] + c * p.gate_stride[1]]), widen(up[n * p.up_stride[0] + c * p.up_stride[1]])));
  }
}

template <class T>
__global__ void backward_kernel(detail::SwiGLUParams p) {
  using C = typename Compute<T>::type;
  const std::int64_t c = static_cast<std::int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  if (c >= p.cols) return;
  const T* gate = static_cast<const T*>(p.gate);
  const T* up = static_cast<const T*>(p.up);
  const T* dy = static_cast<const T*>(p.dy);
  for (std::int64_t n = blockIdx.y; n < p.rows; n += gridDim.y) {
    C dgate, dup;
    math::swiglu::backward(widen(gate[n * p.gate_stride[0] + c * p.gate_stride[1]]),
                           widen(up[n * p.up_stride[0] + c * p.up_stride[1]]),
                           widen(dy[n * p.y_stride[0] + c * p.y_stride[1]]), dgate, dup);
    static_cast<T*>(p.dgate)[n * p.dgate_stride[0] + c * p.dgate_stride[1]] = narrow_to<T>(dgate);
    static_cast<T*>(p.dup)[n * p.dup_stride[0] + c * p.dup_stride[1]] = narrow_to<T>(dup);
  }
}

// Packs of V = 16 bytes / sizeof(T) consecutive columns; thread n takes pack n of the
// row-major (rows x cols / V) grid of packs.
template <class T>
__global__ void forward_packed_kernel(detail::SwiGLUParams p, std::uint32_t packs_per_row, std::uint32_t total) {
  constexpr int V = kPack16<T>;
  const std::uint32_t n = blockIdx.x * blockDim.x + threadIdx.x;
  if (n >= total) return;
  const std::int64_t row = n / packs_per_row, c = static_cast<std::int64_t>(n - row * packs_per_row) * V;
  const Pack<T, V> g = load_pack<T, V>(static_cast<const T*>(p.gate) + row * p.gate_stride[0] + c);
  const Pack<T, V> u = load_pack<T, V>(static_cast<const T*>(p.up) + row * p.up_stride[0] + c);
  Pack<T, V> y;
#pragma unroll
  for (int k = 0; k < V; ++k) y.v[k] = narrow_to<T>(math::swiglu::forward(widen(g.v[k]), widen(u.v[k])));
  store_pack(static_cast<T*>(p.y) + row * p.y_stride[0] + c, y);
}

template <class T>
__global__ void backward_packed_kernel(detail::SwiGLUParams p, std::uint32_t packs_per_row, std::uint32_t total) {
  using C = typename Compute<T>::type;
  constexpr int V = kPack16<T>;
  const std::uint32_t n = blockIdx.x * blockDim.x + threadIdx.x;
  if (n >= total) return;
  const std::int64_t row = n / packs_per_row, c = static_cast<std::int64_t>(n - row * packs_per_row) * V;
  const Pack<T, V> g = load_pack<T, V>(static_cast<const T*>(p.gate) + row * p.gate_stride[0] + c);
  const Pack<T, V> u = load_pack<T, V>(static_cast<const T*>(p.up) + row * p.up_stride[0] + c);
  const Pack<T, V> dy = load_pack<T, V>(static_cast<const T*>(p.dy) + row * p.y_stride[0] + c);
  Pack<T, V> dgate, dup;
#pragma unroll
  for (int k = 0; k < V; ++k) {
    C dg, du;
    math::swiglu::backward(widen(g.v[k]), widen(u.v[k]), widen(dy.v[k]), dg, du);
    dgate.v[k] = narrow_to<T>(dg);
    dup.v[k] = narrow_to<T>(du);
  }
  store_pack(static_cast<T*>(p.dgate) + row * p.dgate_stride[0] + c, dgate);
  store_pack(static_cast<T*>(p.dup) + row * p.dup_stride[0] + c, dup);
}

template <class T>
bool takes_packs(const detail::SwiGLUParams& p, bool backward) {
  constexpr int V = kPack16<T>;
  const auto fits = [&](const void* ptr, const std::int64_t* stride) {
    return ptr != nullptr && stride[1] == 1 && stride[0] % V == 0 && aligned_to(ptr, 16);
  };
  const bool tensors = backward ? fits(p.gate, p.gate_stride) && fits(p.up, p.up_stride) &&
                                      fits(p.dy, p.y_stride) && fits(p.dgate, p.dgate_stride) &&
                                      fits(p.dup, p.dup_stride)
                                : fits(p.gate, p.gate_stride) && fits(p.up, p.up_stride) &&
                                      fits(p.y, p.y_stride);
  return tensors && p.cols % V == 0 && p.rows * (p.cols / V) < (std::int64_t{1} << 31);
}

dim3 grid_of(const detail::SwiGLUParams& p) {
  return dim3(static_cast<unsigned>((p.cols + kThreads - 1) / kThreads),
              static_cast<unsigned>(std::min<std::int64_t>(p.rows, 65535)));
}

template <class T>
void run(const detail::SwiGLUParams& p, bool backward) {
  const auto stream = static_cast<cudaStream_t>(p.cuda_stream);
  if (takes_packs<T>(p, backward)) {
    const auto packs_per_row = static_cast<std::uint32_t>(p.cols / kPack16<T>);
    const auto total = static_cast<std::uint32_t>(p.rows * packs_per_row);
    const unsigned blocks = (total + kThreads - 1) / kThreads;
    if (backward) {
      backward_packed_kernel<T><<<blocks, kThreads, 0, stream>>>(p, packs_per_row, total);
      check_launch("swiglu backward_packed_kernel");
    } else {
      forward_packed_kernel<T><<<blocks, kThreads, 0, stream>>>(p, packs_per_row, total);
      check_launch("swiglu forward_packed_kernel");
    }
    return;
  }
  if (backward) {
    backward_kernel<T><<<grid_of(p), kThreads, 0, stream>>>(p);
    check_launch("swiglu backward_kernel");
  } else {
    forward_kernel<T><<<grid_of(p), kThreads, 0, stream>>>(p);
    check_launch("swiglu forward_kernel");
  }
}

void dispatch(const detail::SwiGLUParams& p, bool backward) {
  switch (p.dtype) {
    case DType::bfloat16: return run<__nv_bfloat16>(p, backward);
    case DType::float16: return run<__half>(p, backward);
    case DType::float32: return run<float>(p, backward);
    case DType::float64: return run<double>(p, backward);
    default: throw Error(ErrorKind::unsupported, "winnow::swiglu: dtype");
  }
}

}  // namespace

void swiglu_forward(const detail::SwiGLUParams& p) { dispatch(p, false); }
void swiglu_backward(const detail::SwiGLUParams& p) { dispatch(p, true); }

}  // namespace winnow::cuda
