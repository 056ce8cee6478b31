// Rotary position embedding on CUDA: a thread per (x_i, x_{i+D/2}) pair, reading the 16-bit or
// 32-bit inputs once and writing once; arithmetic in float32 (float64 for float64 inputs).
// Memory-bound: it replaces about ten element-wise LibTorch operations per tensor.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "cuda/cuda.h"
#include "cuda/element_types.cuh"
#include "cuda/launch.h"
#include "math/rotary.h"

namespace winnow::cuda {
namespace {

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

// N consecutive pairs per thread (accesses of N elements, 16 bytes for 16-bit x when N = 8)
// and 32-bit index arithmetic: the common case (contiguous head vectors and tables, D/2 a
// multiple of N, aligned rows). The general kernel above spent most of its time on 64-bit
// divisions and 2-byte accesses; at N = 4 (8-byte accesses) a 16-bit x moved at about 40% of
// an H200's bandwidth.
template <class T, int N>
__global__ void rotary_packed_kernel(detail::RotaryParams p, std::uint32_t chunks_per_row, std::uint32_t total) {
  static_assert(N % 4 == 0, "the tables are read four floats at a time");
  const std::uint32_t n = blockIdx.x * blockDim.x + threadIdx.x;
  if (n >= total) return;
  const std::uint32_t chunk = n % chunks_per_row, row = n / chunks_per_row;
  const std::uint32_t heads = static_cast<std::uint32_t>(p.heads), length = static_cast<std::uint32_t>(p.length);
  const std::uint32_t h = row % heads, l = (row / heads) % length, b = row / (heads * length);
  const std::int64_t i = N * static_cast<std::int64_t>(chunk);
  const T* x = static_cast<const T*>(p.x) + b * p.x_stride[0] + l * p.x_stride[1] + h * p.x_stride[2] + i;
  T* out = static_cast<T*>(p.out) + b * p.out_stride[0] + l * p.out_stride[1] + h * p.out_stride[2] + i;
  const Pack<T, N> low = load_pack<T, N>(x);
  const Pack<T, N> high = load_pack<T, N>(x + p.half);
  const float* const cos = static_cast<const float*>(p.cos) + l * p.table_stride[0] + i;
  const float* const sin = static_cast<const float*>(p.sin) + l * p.table_stride[0] + i;
  Pack<T, N> out_low, out_high;
#pragma unroll
  for (int k0 = 0; k0 < N; k0 += 4) {
    const Pack<float, 4> c = load_pack<float, 4>(cos + k0);
    const Pack<float, 4> s = load_pack<float, 4>(sin + k0);
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      float y_low, y_high;
      math::rotary::rotate(widen(low.v[k0 + k]), widen(high.v[k0 + k]), c.v[k], s.v[k], p.transpose, y_low, y_high);
      out_low.v[k0 + k] = narrow_to<T>(y_low);
      out_high.v[k0 + k] = narrow_to<T>(y_high);
    }
  }
  store_pack(out, out_low);
  store_pack(out + p.half, out_high);
}

template <class T, int N>
bool takes_packs_of(const detail::RotaryParams& p) {
  if constexpr (std::is_same_v<T, double>) {
    return false;
  } else {
    const std::int64_t rows = p.batch * p.length * p.heads;
    return p.half % N == 0 && p.x_stride[3] == 1 && p.out_stride[3] == 1 && p.table_stride[1] == 1 &&
           p.x_stride[0] % N == 0 && p.x_stride[1] % N == 0 && p.x_stride[2] % N == 0 &&
           p.out_stride[0] % N == 0 && p.out_stride[1] % N == 0 && p.out_stride[2] % N == 0 &&
           p.table_stride[0] % 4 == 0 && aligned_to(p.x, N * sizeof(T)) && aligned_to(p.out, N * sizeof(T)) &&
           aligned_to(p.cos, 16) && aligned_to(p.sin, 16) && rows * (p.half / N) < (std::int64_t{1} << 31) &&
           p.heads * p.length < (std::int64_t{1} << 31);
  }
}

template <class T, int N>
bool launch_packs_of(const detail::RotaryParams& p, cudaStream_t stream) {
  if (!takes_packs_of<T, N>(p)) return false;
  constexpr int kThreads = 256;
  const auto chunks = static_cast<std::uint32_t>(p.half / N);
  const auto total = static_cast<std::uint32_t>(p.batch * p.length * p.heads * (p.half / N));
  rotary_packed_kernel<T, N><<<(total + kThreads - 1) / kThreads, kThreads, 0, stream>>>(p, chunks, total);
  check_launch("rotary_packed_kernel");
  return true;
}

template <class T>
void launch(const detail::RotaryParams& p) {
  constexpr int kThreads = 256;
  const cudaStream_t stream = static_cast<cudaStream_t>(p.cuda_stream);
  if constexpr (!std::is_same_v<T, double>) {
    // 16-byte accesses where the shape allows, else 8 (16-bit) or 16 (float32) bytes.
    if constexpr (kPack16<T> > 4) {
      if (launch_packs_of<T, kPack16<T>>(p, stream)) return;
    }
    if (launch_packs_of<T, 4>(p, stream)) return;
  }
  const std::int64_t pairs = p.batch * p.length * p.heads * p.half;
  // Enough blocks to fill the GPU several times over; the grid-stride loop covers the rest.
  const std::int64_t blocks = std::min<std::int64_t>((pairs + kThreads - 1) / kThreads, 65536);
  rotary_kernel<T><<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(p);
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
