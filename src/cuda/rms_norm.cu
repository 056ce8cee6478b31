// RMSNorm on CUDA. Memory-bound: the forward reads x once and writes y (often bf16 from a float32
// x); the backward reads dy and x for the input gradient (a warp per row, the row's second pass
// served from cache) and again, column-tiled, for the weight gradient, whose per-block partial
// sums are added in a fixed order by a last small kernel: bitwise repeatable, no atomics.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <cstdint>

#include "cuda/cuda.h"
#include "cuda/element_types.cuh"
#include "cuda/launch.h"
#include "math/rms_norm.h"

namespace winnow::cuda {
namespace {

constexpr int kWarps = 8;  // rows per block in the row kernels

template <class C>
__device__ __forceinline__ C warp_sum(C v) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
  return v;
}

template <class X, class Y>
__global__ void forward_kernel(detail::RMSNormParams p) {
  using C = typename Compute<X>::type;
  const int lane = threadIdx.x % 32;
  const X* x = static_cast<const X*>(p.x);
  const C* w = static_cast<const C*>(p.weight);
  for (std::int64_t n = static_cast<std::int64_t>(blockIdx.x) * kWarps + threadIdx.x / 32; n < p.rows;
       n += static_cast<std::int64_t>(gridDim.x) * kWarps) {
    const X* xr = x + n * p.x_stride[0];
    C sum = 0;
    for (std::int64_t c = lane; c < p.cols; c += 32) {
      const C v = widen(xr[c * p.x_stride[1]]);
      sum += v * v;
    }
    const C r = math::rms_norm::inverse_rms(warp_sum(sum), static_cast<C>(p.cols), static_cast<C>(p.eps));
    if (lane == 0) static_cast<C*>(p.rstd)[n * p.rstd_stride] = r;
    Y* yr = static_cast<Y*>(p.y) + n * p.y_stride[0];
    for (std::int64_t c = lane; c < p.cols; c += 32) {
      yr[c * p.y_stride[1]] = narrow_to<Y>(widen(xr[c * p.x_stride[1]]) * r * w[c * p.weight_stride]);
    }
  }
}

template <class X, class Y>
__global__ void input_grad_kernel(detail::RMSNormParams p) {
  using C = typename Compute<X>::type;
  const int lane = threadIdx.x % 32;
  const X* x = static_cast<const X*>(p.x);
  const Y* dy = static_cast<const Y*>(p.dy);
  const C* w = static_cast<const C*>(p.weight);
  for (std::int64_t n = static_cast<std::int64_t>(blockIdx.x) * kWarps + threadIdx.x / 32; n < p.rows;
       n += static_cast<std::int64_t>(gridDim.x) * kWarps) {
    const X* xr = x + n * p.x_stride[0];
    const Y* dyr = dy + n * p.y_stride[0];
    C sum_gx = 0;
    for (std::int64_t c = lane; c < p.cols; c += 32) {
      sum_gx += widen(dyr[c * p.y_stride[1]]) * w[c * p.weight_stride] * widen(xr[c * p.x_stride[1]]);
    }
    const C mean_gx = warp_sum(sum_gx) / static_cast<C>(p.cols);
    const C r = static_cast<const C*>(p.rstd)[n * p.rstd_stride];
    X* dxr = static_cast<X*>(p.dx) + n * p.dx_stride[0];
    for (std::int64_t c = lane; c < p.cols; c += 32) {
      const C g = widen(dyr[c * p.y_stride[1]]) * w[c * p.weight_stride];
      dxr[c * p.dx_stride[1]] = narrow_to<X>(math::rms_norm::input_grad(g, widen(xr[c * p.x_stride[1]]), r, mean_gx));
    }
  }
}

// Block (32 columns, 8 row lanes) over rows [blockIdx.y * rows_per_block, ...): partial[block
// row][column] = sum dy x rstd, each thread's rows then the 8 lanes added in order.
template <class X, class Y>
__global__ void weight_grad_partial_kernel(detail::RMSNormParams p, std::int64_t rows_per_block,
                                           typename Compute<X>::type* partial) {
  using C = typename Compute<X>::type;
  __shared__ C lanes[kWarps][32];
  const std::int64_t c = static_cast<std::int64_t>(blockIdx.x) * 32 + threadIdx.x;
  const std::int64_t begin = static_cast<std::int64_t>(blockIdx.y) * rows_per_block;
  const std::int64_t end = std::min(p.rows, begin + rows_per_block);
  C acc = 0;
  if (c < p.cols) {
    const X* x = static_cast<const X*>(p.x) + c * p.x_stride[1];
    const Y* dy = static_cast<const Y*>(p.dy) + c * p.y_stride[1];
    const C* rstd = static_cast<const C*>(p.rstd);
    for (std::int64_t n = begin + threadIdx.y; n < end; n += kWarps) {
      acc += widen(dy[n * p.y_stride[0]]) * widen(x[n * p.x_stride[0]]) * rstd[n * p.rstd_stride];
    }
  }
  lanes[threadIdx.y][threadIdx.x] = acc;
  __syncthreads();
  if (threadIdx.y == 0 && c < p.cols) {
    C sum = 0;
#pragma unroll
    for (int k = 0; k < kWarps; ++k) sum += lanes[k][threadIdx.x];
    partial[static_cast<std::int64_t>(blockIdx.y) * p.cols + c] = sum;
  }
}

template <class C>
__global__ void weight_grad_sum_kernel(detail::RMSNormParams p, std::int64_t row_blocks,
                                       const C* partial) {
  const std::int64_t c = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (c >= p.cols) return;
  C sum = 0;
  for (std::int64_t b = 0; b < row_blocks; ++b) sum += partial[b * p.cols + c];
  static_cast<C*>(p.dweight)[c * p.dweight_stride] = sum;
}

std::int64_t row_grid(std::int64_t rows) {
  return std::max<std::int64_t>(1, std::min<std::int64_t>((rows + kWarps - 1) / kWarps, 65535));
}

template <class X, class Y>
void forward_launch(const detail::RMSNormParams& p) {
  forward_kernel<X, Y><<<static_cast<unsigned>(row_grid(p.rows)), 32 * kWarps, 0,
                         static_cast<cudaStream_t>(p.cuda_stream)>>>(p);
  check_launch("rms_norm forward_kernel");
}

template <class X, class Y>
void backward_launch(const detail::RMSNormParams& p) {
  using C = typename Compute<X>::type;
  const auto stream = static_cast<cudaStream_t>(p.cuda_stream);
  if (p.rows > 0) {
    input_grad_kernel<X, Y><<<static_cast<unsigned>(row_grid(p.rows)), 32 * kWarps, 0, stream>>>(p);
    check_launch("rms_norm input_grad_kernel");
  }
  // About 128 rows a block, at most 1024 blocks of rows: enough blocks to fill the GPU at
  // every width, and a partial buffer of at most 1024 rows of the weight.
  const std::int64_t row_blocks =
      std::max<std::int64_t>(1, std::min<std::int64_t>((p.rows + 127) / 128, 1024));
  const std::int64_t rows_per_block = std::max<std::int64_t>(1, (p.rows + row_blocks - 1) / row_blocks);
  const std::int64_t col_blocks = (p.cols + 31) / 32;
  DeviceBuffer partial(p.allocator, stream, static_cast<std::size_t>(row_blocks * p.cols) * sizeof(C));
  weight_grad_partial_kernel<X, Y><<<dim3(static_cast<unsigned>(col_blocks), static_cast<unsigned>(row_blocks)),
                                     dim3(32, kWarps), 0, stream>>>(p, rows_per_block, partial.as<C>());
  check_launch("rms_norm weight_grad_partial_kernel");
  weight_grad_sum_kernel<C><<<static_cast<unsigned>((p.cols + 255) / 256), 256, 0, stream>>>(
      p, row_blocks, partial.as<C>());
  check_launch("rms_norm weight_grad_sum_kernel");
}

// x's storage type picked, then y's (or dy's): float64 pairs only with float64 (the API checks).
template <template <class, class> class Launch, class X>
void with_y(const detail::RMSNormParams& p) {
  switch (p.y_dtype) {
    case DType::bfloat16: return Launch<X, __nv_bfloat16>::run(p);
    case DType::float16: return Launch<X, __half>::run(p);
    case DType::float32: return Launch<X, float>::run(p);
    default: throw Error(ErrorKind::unsupported, "winnow::rms_norm: y / dy dtype");
  }
}

template <template <class, class> class Launch>
void dispatch(const detail::RMSNormParams& p) {
  switch (p.x_dtype) {
    case DType::bfloat16: return with_y<Launch, __nv_bfloat16>(p);
    case DType::float16: return with_y<Launch, __half>(p);
    case DType::float32: return with_y<Launch, float>(p);
    case DType::float64: return Launch<double, double>::run(p);
    default: throw Error(ErrorKind::unsupported, "winnow::rms_norm: x dtype");
  }
}

template <class X, class Y>
struct Forward {
  static void run(const detail::RMSNormParams& p) { forward_launch<X, Y>(p); }
};
template <class X, class Y>
struct Backward {
  static void run(const detail::RMSNormParams& p) { backward_launch<X, Y>(p); }
};

}  // namespace

void rms_norm_forward(const detail::RMSNormParams& p) { dispatch<Forward>(p); }
void rms_norm_backward(const detail::RMSNormParams& p) { dispatch<Backward>(p); }

}  // namespace winnow::cuda
