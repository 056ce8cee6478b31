// SwiGLU's gate on CUDA: memory-bound, one read of each input and one write of each output.
// Blocks tile a row's columns and stride over rows, so no element needs a 64-bit division.
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

dim3 grid_of(const detail::SwiGLUParams& p) {
  return dim3(static_cast<unsigned>((p.cols + kThreads - 1) / kThreads),
              static_cast<unsigned>(std::min<std::int64_t>(p.rows, 65535)));
}

template <class T>
void run(const detail::SwiGLUParams& p, bool backward) {
  const auto stream = static_cast<cudaStream_t>(p.cuda_stream);
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
