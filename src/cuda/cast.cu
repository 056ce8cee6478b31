// The casting concatenation on CUDA: one launch for up to kSegmentsPerLaunch sources (a row of
// blocks each, striding over the source), elements moved one per thread and step: coalesced,
// and the step's whole set of weights is a few megabytes.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "cuda/cuda.h"
#include "cuda/launch.h"

namespace winnow::cuda {
namespace {

constexpr int kSegmentsPerLaunch = 64;
constexpr int kThreads = 256;

struct SegmentBatch {
  detail::CastSegment segments[kSegmentsPerLaunch];
};

// Rounded to nearest even once, from the source's own precision (no float32 step for float64).
template <class To, class From>
__device__ __forceinline__ To convert(From x) {
  if constexpr (std::is_same_v<To, From>) {
    return x;
  } else if constexpr (std::is_same_v<To, __nv_bfloat16>) {
    if constexpr (std::is_same_v<From, double>) return __double2bfloat16(x);
    else return __float2bfloat16_rn(static_cast<float>(x));
  } else if constexpr (std::is_same_v<To, __half>) {
    if constexpr (std::is_same_v<From, double>) return __double2half(x);
    else return __float2half_rn(static_cast<float>(x));
  } else if constexpr (std::is_same_v<From, __nv_bfloat16>) {
    return static_cast<To>(__bfloat162float(x));
  } else if constexpr (std::is_same_v<From, __half>) {
    return static_cast<To>(__half2float(x));
  } else {
    return static_cast<To>(x);
  }
}

template <class From, class To>
__global__ void __launch_bounds__(kThreads) cast_kernel(const SegmentBatch batch, To* out) {
  const detail::CastSegment s = batch.segments[blockIdx.y];
  const From* in = static_cast<const From*>(s.source);
  To* dst = out + s.offset;
  for (std::int64_t i = static_cast<std::int64_t>(blockIdx.x) * kThreads + threadIdx.x; i < s.count;
       i += static_cast<std::int64_t>(gridDim.x) * kThreads) {
    dst[i] = convert<To>(in[i]);
  }
}

template <class From, class To>
void launch(const detail::CastParams& p) {
  const auto stream = static_cast<cudaStream_t>(p.cuda_stream);
  for (std::size_t first = 0; first < p.segments.size(); first += kSegmentsPerLaunch) {
    const std::size_t count = std::min<std::size_t>(kSegmentsPerLaunch, p.segments.size() - first);
    SegmentBatch batch{};
    std::int64_t longest = 0;
    for (std::size_t k = 0; k < count; ++k) {
      batch.segments[k] = p.segments[first + k];
      longest = std::max(longest, batch.segments[k].count);
    }
    // Four elements a thread for the longest source; shorter ones' extra blocks exit at once.
    const auto blocks = static_cast<unsigned>(
        std::clamp<std::int64_t>((longest + 4 * kThreads - 1) / (4 * kThreads), 1, 1024));
    cast_kernel<From, To><<<dim3(blocks, static_cast<unsigned>(count)), kThreads, 0, stream>>>(
        batch, static_cast<To*>(p.destination));
    check_launch("cast_kernel");
  }
}

template <class From>
void to_destination(const detail::CastParams& p) {
  switch (p.destination_dtype) {
    case DType::bfloat16: return launch<From, __nv_bfloat16>(p);
    case DType::float16: return launch<From, __half>(p);
    case DType::float32: return launch<From, float>(p);
    default: return launch<From, double>(p);
  }
}

}  // namespace

void cast_concatenate(const detail::CastParams& p) {
  switch (p.source_dtype) {
    case DType::bfloat16: return to_destination<__nv_bfloat16>(p);
    case DType::float16: return to_destination<__half>(p);
    case DType::float32: return to_destination<float>(p);
    default: return to_destination<double>(p);
  }
}

}  // namespace winnow::cuda
