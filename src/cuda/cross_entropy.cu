// The masked cross-entropy on CUDA: a warp per row (two passes over the row's logits, the second
// from cache), eight rows a block. The forward's block sums are added by one block in a fixed
// order (then divided by the divisor, if any); the backward writes each row's gradient in the
// logits' dtype.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <limits>

#include "cuda/cuda.h"
#include "cuda/element_types.cuh"
#include "cuda/launch.h"
#include "math/cross_entropy.h"

namespace winnow::cuda {
namespace {

constexpr int kRowsPerBlock = 8;
constexpr int kThreads = 32 * kRowsPerBlock;
constexpr int kSumThreads = 1024;

template <class C>
__device__ C warp_max(C v) {
  for (int o = 16; o > 0; o /= 2) v = max(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

template <class C>
__device__ C warp_sum(C v) {
  for (int o = 16; o > 0; o /= 2) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

template <class T>
__global__ void __launch_bounds__(kThreads) forward_kernel(detail::CrossEntropyParams p, typename Compute<T>::type* sums) {
  using C = typename Compute<T>::type;
  const int warp = static_cast<int>(threadIdx.x) / 32, lane = static_cast<int>(threadIdx.x) % 32;
  const std::int64_t n = static_cast<std::int64_t>(blockIdx.x) * kRowsPerBlock + warp;
  __shared__ C terms[kRowsPerBlock];
  C term = 0;
  if (n < p.rows) {
    const T* x = static_cast<const T*>(p.logits) + n * p.logits_row_stride;
    C m = -std::numeric_limits<C>::infinity();
    for (std::int64_t v = lane; v < p.cols; v += 32) m = max(m, widen(x[v]));
    m = warp_max(m);
    C s = 0;
    for (std::int64_t v = lane; v < p.cols; v += 32) s += exp(widen(x[v]) - m);
    s = warp_sum(s);
    const C lse = math::cross_entropy::log_sum_exp(m, s);
    if (lane == 0) {
      static_cast<C*>(p.lse)[n] = lse;
      const C w = static_cast<const C*>(p.mask)[n * p.mask_stride];
      if (w != C(0)) {
        const std::int64_t t = p.targets[n * p.targets_stride];
        const C xt = t >= 0 && t < p.cols ? widen(x[t]) : std::numeric_limits<C>::quiet_NaN();
        term = math::cross_entropy::row_loss(lse, xt, w);
      }
    }
  }
  if (lane == 0) terms[warp] = term;
  __syncthreads();
  if (threadIdx.x == 0) {
    C total = 0;
    for (int w = 0; w < kRowsPerBlock; ++w) total += terms[w];
    sums[blockIdx.x] = total;
  }
}

// One block: the blocks' sums in a fixed order (threads stride over them, then a fixed tree).
template <class C>
__global__ void __launch_bounds__(kSumThreads) total_kernel(const C* sums, int count, const C* divisor, C* loss) {
  __shared__ double partial[kSumThreads];
  double s = 0;
  for (int i = static_cast<int>(threadIdx.x); i < count; i += kSumThreads) s += sums[i];
  partial[threadIdx.x] = s;
  __syncthreads();
  for (int half = kSumThreads / 2; half > 0; half /= 2) {
    if (static_cast<int>(threadIdx.x) < half) partial[threadIdx.x] += partial[threadIdx.x + half];
    __syncthreads();
  }
  if (threadIdx.x == 0) *loss = math::cross_entropy::divided(static_cast<C>(partial[0]), divisor);
}

template <class T>
__global__ void __launch_bounds__(kThreads) backward_kernel(detail::CrossEntropyParams p) {
  using C = typename Compute<T>::type;
  const int warp = static_cast<int>(threadIdx.x) / 32, lane = static_cast<int>(threadIdx.x) % 32;
  const std::int64_t n = static_cast<std::int64_t>(blockIdx.x) * kRowsPerBlock + warp;
  if (n >= p.rows) return;
  const T* x = static_cast<const T*>(p.logits) + n * p.logits_row_stride;
  T* dx = static_cast<T*>(p.dlogits) + n * p.dlogits_row_stride;
  const C w = static_cast<const C*>(p.mask)[n * p.mask_stride];
  if (w == C(0)) {
    for (std::int64_t v = lane; v < p.cols; v += 32) dx[v] = narrow_to<T>(C(0));
    return;
  }
  const C scale = math::cross_entropy::divided(*static_cast<const C*>(p.dloss), static_cast<const C*>(p.divisor)) * w;
  const C lse = static_cast<const C*>(p.lse)[n];
  const std::int64_t t = p.targets[n * p.targets_stride];
  for (std::int64_t v = lane; v < p.cols; v += 32) {
    dx[v] = narrow_to<T>(math::cross_entropy::logit_grad(widen(x[v]), lse, v == t, scale));
  }
}

// A block per kRowsPerBlock rows, well inside a grid's x extent (below 2^31); checked before
// anything is allocated or launched.
unsigned blocks_of(const detail::CrossEntropyParams& p) {
  if (p.rows >= (std::int64_t{1} << 31) * kRowsPerBlock / 2) {
    throw Error(ErrorKind::unsupported, "winnow::cross_entropy: more than 2^33 rows");
  }
  return static_cast<unsigned>((p.rows + kRowsPerBlock - 1) / kRowsPerBlock);
}

template <class T>
void forward(const detail::CrossEntropyParams& p) {
  using C = typename Compute<T>::type;
  const auto stream = static_cast<cudaStream_t>(p.cuda_stream);
  const unsigned blocks = blocks_of(p);
  DeviceBuffer sums(p.allocator, stream, static_cast<std::size_t>(blocks) * sizeof(C));
  if (blocks > 0) {
    forward_kernel<T><<<blocks, kThreads, 0, stream>>>(p, sums.as<C>());
    check_launch("cross_entropy forward_kernel");
  }
  total_kernel<C><<<1, kSumThreads, 0, stream>>>(sums.as<C>(), static_cast<int>(blocks),
                                                  static_cast<const C*>(p.divisor), static_cast<C*>(p.loss));
  check_launch("cross_entropy total_kernel");
}

template <class T>
void backward(const detail::CrossEntropyParams& p) {
  const auto stream = static_cast<cudaStream_t>(p.cuda_stream);
  backward_kernel<T><<<blocks_of(p), kThreads, 0, stream>>>(p);
  check_launch("cross_entropy backward_kernel");
}

}  // namespace

void cross_entropy_forward(const detail::CrossEntropyParams& p) {
  switch (p.logits_dtype) {
    case DType::bfloat16: return forward<__nv_bfloat16>(p);
    case DType::float16: return forward<__half>(p);
    case DType::float32: return forward<float>(p);
    default: return forward<double>(p);
  }
}

void cross_entropy_backward(const detail::CrossEntropyParams& p) {
  switch (p.logits_dtype) {
    case DType::bfloat16: return backward<__nv_bfloat16>(p);
    case DType::float16: return backward<__half>(p);
    case DType::float32: return backward<float>(p);
    default: return backward<double>(p);
  }
}

}  // namespace winnow::cuda
