// RMSNorm on CUDA. Memory-bound: the forward reads x once and writes y (often bf16 from a float32
// x); the backward reads dy and x once for both gradients. Rows of up to 32 lanes x 8 packs
// (1024 float32 columns) stay in registers, moved in 8- or 16-byte packs: a warp per row, and
// in the backward each warp also sums its rows' share of the weight gradient, columns held by
// the same lanes for every row. Per-block partial sums are then added in a fixed order by a
// last small kernel: bitwise repeatable, no atomics. Other layouts take the general kernels (an
// element a lane, the weight gradient in a second, column-tiled read of x and dy). The residual
// form rides along: the forward adds the residual as it loads x and writes the sum; the
// backward adds the gradient arriving at the sum and writes dx twice (x's and the residual's
// dtype), so the residual add, the gradient accumulation and the cast need no kernels of their own.
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
    std::int64_t xs = p.x_stride[1];
    if (p.residual != nullptr) {
      // The residual form: sum = x + residual, written, then read back by the same lane.
      const Y* rr = static_cast<const Y*>(p.residual) + n * p.residual_stride[0];
      X* sr = static_cast<X*>(p.sum) + n * p.sum_stride[0];
      for (std::int64_t c = lane; c < p.cols; c += 32) {
        sr[c * p.sum_stride[1]] = narrow_to<X>(widen(xr[c * xs]) + widen(rr[c * p.residual_stride[1]]));
      }
      xr = sr;
      xs = p.sum_stride[1];
    }
    C sum = 0;
    for (std::int64_t c = lane; c < p.cols; c += 32) {
      const C v = widen(xr[c * xs]);
      sum += v * v;
    }
    const C r = math::rms_norm::inverse_rms(warp_sum(sum), static_cast<C>(p.cols), static_cast<C>(p.eps));
    if (lane == 0) static_cast<C*>(p.rstd)[n * p.rstd_stride] = r;
    Y* yr = static_cast<Y*>(p.y) + n * p.y_stride[0];
    for (std::int64_t c = lane; c < p.cols; c += 32) {
      yr[c * p.y_stride[1]] = narrow_to<Y>(widen(xr[c * xs]) * r * w[c * p.weight_stride]);
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
    const X* din = p.dsum_in ? static_cast<const X*>(p.dsum_in) + n * p.dsum_in_stride[0] : nullptr;
    Y* drr = p.dresidual ? static_cast<Y*>(p.dresidual) + n * p.dresidual_stride[0] : nullptr;
    for (std::int64_t c = lane; c < p.cols; c += 32) {
      const C g = widen(dyr[c * p.y_stride[1]]) * w[c * p.weight_stride];
      C d = math::rms_norm::input_grad(g, widen(xr[c * p.x_stride[1]]), r, mean_gx);
      if (din != nullptr) d += widen(din[c * p.dsum_in_stride[1]]);
      dxr[c * p.dx_stride[1]] = narrow_to<X>(d);
      if (drr != nullptr) drr[c * p.dresidual_stride[1]] = narrow_to<Y>(d);
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

// dweight[c] = sum over b of partial[b][c]: block (32 columns, kSumLanes lanes), lane y adding
// rows y, y + kSumLanes, ... and the lanes added in order. Up to a thousand partial rows: 32
// lanes keep each thread's chain of dependent adds short.
constexpr int kSumLanes = 32;

template <class C>
__global__ void weight_grad_sum_kernel(detail::RMSNormParams p, std::int64_t row_blocks,
                                       const C* partial) {
  __shared__ C lanes[kSumLanes][32];
  const std::int64_t c = static_cast<std::int64_t>(blockIdx.x) * 32 + threadIdx.x;
  C sum = 0;
  if (c < p.cols) {
    for (std::int64_t b = threadIdx.y; b < row_blocks; b += kSumLanes) sum += partial[b * p.cols + c];
  }
  lanes[threadIdx.y][threadIdx.x] = sum;
  __syncthreads();
  if (threadIdx.y == 0 && c < p.cols) {
    C total = 0;
#pragma unroll
    for (int k = 0; k < kSumLanes; ++k) total += lanes[k][threadIdx.x];
    static_cast<C*>(p.dweight)[c * p.dweight_stride] = total;
  }
}

// ---- packed rows: a lane holds packs lane, lane + 32, ... (at most kMaxPacksPerLane) of its row

constexpr int kMaxPacksPerLane = 8;

// Elements per pack: 16 bytes of the narrower of x and y.
template <class X, class Y>
constexpr int pack_width() {
  return kPack16<X> < kPack16<Y> ? kPack16<X> : kPack16<Y>;
}

template <class X, class Y>
__global__ void forward_packed_kernel(detail::RMSNormParams p) {
  using C = typename Compute<X>::type;
  constexpr int V = pack_width<X, Y>();
  const int lane = threadIdx.x % 32;
  const int packs = static_cast<int>(p.cols / V);
  const C* w = static_cast<const C*>(p.weight);
  for (std::int64_t n = static_cast<std::int64_t>(blockIdx.x) * kWarps + threadIdx.x / 32; n < p.rows;
       n += static_cast<std::int64_t>(gridDim.x) * kWarps) {
    const X* xr = static_cast<const X*>(p.x) + n * p.x_stride[0];
    Pack<X, V> xs[kMaxPacksPerLane];
    C sum = 0;
#pragma unroll
    for (int k = 0; k < kMaxPacksPerLane; ++k) {
      const int j = lane + 32 * k;
      if (j >= packs) continue;
      xs[k] = load_pack<X, V>(xr + j * V);
      if (p.residual != nullptr) {
        const Pack<Y, V> rk =
            load_pack<Y, V>(static_cast<const Y*>(p.residual) + n * p.residual_stride[0] + j * V);
#pragma unroll
        for (int e = 0; e < V; ++e) xs[k].v[e] = narrow_to<X>(widen(xs[k].v[e]) + widen(rk.v[e]));
        store_pack(static_cast<X*>(p.sum) + n * p.sum_stride[0] + j * V, xs[k]);
      }
#pragma unroll
      for (int e = 0; e < V; ++e) sum += widen(xs[k].v[e]) * widen(xs[k].v[e]);
    }
    const C r = math::rms_norm::inverse_rms(warp_sum(sum), static_cast<C>(p.cols), static_cast<C>(p.eps));
    if (lane == 0) static_cast<C*>(p.rstd)[n * p.rstd_stride] = r;
    Y* yr = static_cast<Y*>(p.y) + n * p.y_stride[0];
#pragma unroll
    for (int k = 0; k < kMaxPacksPerLane; ++k) {
      const int j = lane + 32 * k;
      if (j >= packs) continue;
      const Pack<C, V> wk = load_pack<C, V>(w + j * V);
      Pack<Y, V> y;
#pragma unroll
      for (int e = 0; e < V; ++e) y.v[e] = narrow_to<Y>(widen(xs[k].v[e]) * r * wk.v[e]);
      store_pack(yr + j * V, y);
    }
  }
}

// dx for the block's rows and partial[blockIdx.x][c] = sum over them of dy x rstd. Shared
// memory: kWarps x cols sums, one row per warp, added in warp order. A lane keeps x, dy, the
// weight and the sums of its packs in registers: kPacks = 2 (rows up to 256 float32 columns,
// about 60 registers) leaves room for several blocks a multiprocessor, 8 does not.
template <class X, class Y, int kPacks>
__global__ void backward_packed_kernel(detail::RMSNormParams p, typename Compute<X>::type* partial) {
  using C = typename Compute<X>::type;
  constexpr int V = pack_width<X, Y>();
  extern __shared__ unsigned char shared_bytes[];
  C* warp_sums = reinterpret_cast<C*>(shared_bytes);
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int packs = static_cast<int>(p.cols / V);
  Pack<C, V> ws[kPacks];
  C acc[kPacks][V];
#pragma unroll
  for (int k = 0; k < kPacks; ++k) {
    const int j = lane + 32 * k;
    if (j < packs) ws[k] = load_pack<C, V>(static_cast<const C*>(p.weight) + j * V);
#pragma unroll
    for (int e = 0; e < V; ++e) acc[k][e] = 0;
  }
  for (std::int64_t n = static_cast<std::int64_t>(blockIdx.x) * kWarps + warp; n < p.rows;
       n += static_cast<std::int64_t>(gridDim.x) * kWarps) {
    const X* xr = static_cast<const X*>(p.x) + n * p.x_stride[0];
    const Y* dyr = static_cast<const Y*>(p.dy) + n * p.y_stride[0];
    Pack<X, V> xs[kPacks];
    Pack<Y, V> dys[kPacks];
    C sum_gx = 0;
#pragma unroll
    for (int k = 0; k < kPacks; ++k) {
      const int j = lane + 32 * k;
      if (j >= packs) continue;
      xs[k] = load_pack<X, V>(xr + j * V);
      dys[k] = load_pack<Y, V>(dyr + j * V);
#pragma unroll
      for (int e = 0; e < V; ++e) sum_gx += widen(dys[k].v[e]) * ws[k].v[e] * widen(xs[k].v[e]);
    }
    const C mean_gx = warp_sum(sum_gx) / static_cast<C>(p.cols);
    const C r = static_cast<const C*>(p.rstd)[n * p.rstd_stride];
    X* dxr = static_cast<X*>(p.dx) + n * p.dx_stride[0];
#pragma unroll
    for (int k = 0; k < kPacks; ++k) {
      const int j = lane + 32 * k;
      if (j >= packs) continue;
      Pack<X, V> dx, din;
      if (p.dsum_in != nullptr) din = load_pack<X, V>(static_cast<const X*>(p.dsum_in) + n * p.dsum_in_stride[0] + j * V);
      Pack<Y, V> dres;
#pragma unroll
      for (int e = 0; e < V; ++e) {
        const C x = widen(xs[k].v[e]), dy = widen(dys[k].v[e]);
        C d = math::rms_norm::input_grad(dy * ws[k].v[e], x, r, mean_gx);
        if (p.dsum_in != nullptr) d += widen(din.v[e]);
        dx.v[e] = narrow_to<X>(d);
        dres.v[e] = narrow_to<Y>(d);
        acc[k][e] += dy * x * r;
      }
      store_pack(dxr + j * V, dx);
      if (p.dresidual != nullptr) store_pack(static_cast<Y*>(p.dresidual) + n * p.dresidual_stride[0] + j * V, dres);
    }
  }
#pragma unroll
  for (int k = 0; k < kPacks; ++k) {
    const int j = lane + 32 * k;
    if (j >= packs) continue;
#pragma unroll
    for (int e = 0; e < V; ++e) warp_sums[warp * p.cols + j * V + e] = acc[k][e];
  }
  __syncthreads();
  for (std::int64_t c = threadIdx.x; c < p.cols; c += blockDim.x) {
    C sum = 0;
#pragma unroll
    for (int k = 0; k < kWarps; ++k) sum += warp_sums[k * p.cols + c];
    partial[static_cast<std::int64_t>(blockIdx.x) * p.cols + c] = sum;
  }
}

// Whether the packed kernels take these tensors: unit column strides, rows a whole number of
// aligned packs that fit a warp's registers (and, backward, the block's sums shared memory).
template <class X, class Y>
bool takes_packs(const detail::RMSNormParams& p, bool backward) {
  using C = typename Compute<X>::type;
  constexpr int V = pack_width<X, Y>();
  const auto rows_fit = [&](const void* ptr, const std::int64_t* stride, std::size_t element) {
    return stride[1] == 1 && stride[0] % V == 0 && aligned_to(ptr, V * element);
  };
  if (p.cols % V != 0 || p.cols / V > 32 * kMaxPacksPerLane || p.weight_stride != 1 ||
      !aligned_to(p.weight, V * sizeof(C)) || !rows_fit(p.x, p.x_stride, sizeof(X))) {
    return false;
  }
  if (!backward) {
    return rows_fit(p.y, p.y_stride, sizeof(Y)) &&
           (p.residual == nullptr ||
            (rows_fit(p.residual, p.residual_stride, sizeof(Y)) && rows_fit(p.sum, p.sum_stride, sizeof(X))));
  }
  return rows_fit(p.dy, p.y_stride, sizeof(Y)) && rows_fit(p.dx, p.dx_stride, sizeof(X)) &&
         (p.dsum_in == nullptr || rows_fit(p.dsum_in, p.dsum_in_stride, sizeof(X))) &&
         (p.dresidual == nullptr || rows_fit(p.dresidual, p.dresidual_stride, sizeof(Y))) &&
         static_cast<std::size_t>(kWarps * p.cols) * sizeof(C) <= 48 * 1024;
}

std::int64_t row_grid(std::int64_t rows) {
  return std::max<std::int64_t>(1, std::min<std::int64_t>((rows + kWarps - 1) / kWarps, 65535));
}

template <class X, class Y>
void forward_launch(const detail::RMSNormParams& p) {
  if (takes_packs<X, Y>(p, false)) {
    forward_packed_kernel<X, Y><<<static_cast<unsigned>(row_grid(p.rows)), 32 * kWarps, 0,
                                  static_cast<cudaStream_t>(p.cuda_stream)>>>(p);
    check_launch("rms_norm forward_packed_kernel");
    return;
  }
  forward_kernel<X, Y><<<static_cast<unsigned>(row_grid(p.rows)), 32 * kWarps, 0,
                         static_cast<cudaStream_t>(p.cuda_stream)>>>(p);
  check_launch("rms_norm forward_kernel");
}

template <class X, class Y>
void backward_launch(const detail::RMSNormParams& p) {
  using C = typename Compute<X>::type;
  const auto stream = static_cast<cudaStream_t>(p.cuda_stream);
  const unsigned sum_blocks = static_cast<unsigned>((p.cols + 31) / 32);
  if (takes_packs<X, Y>(p, true)) {
    // At least 4 rows a warp and at most 1024 blocks, a grid that depends on the shape alone
    // (the sums' order with it). A warp's rows run one after another (load, reduce, store), so
    // the warps in flight set the bandwidth: at 16 rows a warp, 32K rows of 256 columns made
    // 256 blocks, a quarter of an H200's warp slots, and ran at 2.3 TB/s against 4 at 64K rows.
    const std::int64_t blocks =
        std::max<std::int64_t>(1, std::min<std::int64_t>((p.rows + 4 * kWarps - 1) / (4 * kWarps), 1024));
    DeviceBuffer partial(p.allocator, stream, static_cast<std::size_t>(blocks * p.cols) * sizeof(C));
    const std::size_t shared = static_cast<std::size_t>(kWarps * p.cols) * sizeof(C);
    if (p.cols <= 2 * 32 * pack_width<X, Y>()) {
      backward_packed_kernel<X, Y, 2><<<static_cast<unsigned>(blocks), 32 * kWarps, shared, stream>>>(p, partial.as<C>());
    } else {
      backward_packed_kernel<X, Y, kMaxPacksPerLane><<<static_cast<unsigned>(blocks), 32 * kWarps, shared, stream>>>(
          p, partial.as<C>());
    }
    check_launch("rms_norm backward_packed_kernel");
    weight_grad_sum_kernel<C><<<sum_blocks, dim3(32, kSumLanes), 0, stream>>>(p, blocks, partial.as<C>());
    check_launch("rms_norm weight_grad_sum_kernel");
    return;
  }
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
  weight_grad_sum_kernel<C><<<sum_blocks, dim3(32, kSumLanes), 0, stream>>>(p, row_blocks, partial.as<C>());
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
