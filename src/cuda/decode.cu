// Split-KV decoding on CUDA (attention/decode.cuh): how many splits, the workspace, the short
// list of instantiations, and which forward calls take these kernels instead of the fused ones.
#include <algorithm>
#include <atomic>
#include <cstdlib>

#include "cuda/attention/decode.cuh"
#include "cuda/cuda.h"
#include "cuda/launch.h"

namespace winnow::cuda {
namespace {

using detail::DecodeParams;

// Splits long enough to leave most of their time to loading.
constexpr std::int64_t kMinSplitKeys = 256;
constexpr std::int64_t kMaxSplits = 64;
// Forward calls with at most this many queries per sequence, and rows per kv head, decode.
constexpr std::int64_t kMaxDecodeQueries = 8;
constexpr std::int64_t kMaxDecodeGroupRows = 32;

using SplitKernel = void (*)(DecodeParams);

template <class T, int LANES, class Policy>
SplitKernel split_kernel_rows(int rows) {
  if (rows == 1) return decode::decode_split_kernel<T, LANES, 1, Policy>;
  if (rows == 4) return decode::decode_split_kernel<T, LANES, 4, Policy>;
  return decode::decode_split_kernel<T, LANES, 8, Policy>;
}

template <class T, class Policy>
SplitKernel split_kernel(const DecodeParams& p, int rows) {
  const std::int64_t width = std::max(p.dim_qk, p.dim_v);
  if (width <= 8 * 8) return split_kernel_rows<T, 8, Policy>(rows);
  if (width <= 16 * 8) return split_kernel_rows<T, 16, Policy>(rows);
  return split_kernel_rows<T, 32, Policy>(rows);
}

template <class T, class Policy>
void run(DecodeParams p) {
  if (p.num_seqs == 0 || p.heads_q == 0 || p.len_q == 0) return;
  const std::int64_t group_rows = p.group_rows();
  const int rows = group_rows == 1 ? 1 : group_rows <= 4 ? 4 : 8;
  p.row_groups = static_cast<int>((group_rows + rows - 1) / rows);
  const SplitKernel kernel = split_kernel<T, Policy>(p, rows);
  // Splits fill one wave of resident blocks: a second, partial wave would leave most of the
  // device idle while it runs.
  int resident = 0;
  check(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&resident, kernel, decode::kThreads, 0),
        "querying the decoding kernel's occupancy");
  const std::int64_t blocks_per_split = p.num_seqs * p.heads_kv * p.row_groups;
  const std::int64_t wave = static_cast<std::int64_t>(std::max(resident, 1)) * multiprocessors();
  const std::int64_t most =
      std::max<std::int64_t>(1, std::min(kMaxSplits, (p.capacity + kMinSplitKeys - 1) / kMinSplitKeys));
  p.splits = static_cast<int>(std::clamp<std::int64_t>(wave / blocks_per_split, 1, most));
  p.split_len = (p.capacity + p.splits - 1) / p.splits;
  if (p.heads_kv * p.row_groups > 65535 || p.num_seqs > 65535 || p.capacity >= (1LL << 31)) {
    throw Error(ErrorKind::unsupported,
                "winnow: decode: more sequences, heads or keys (2^31) than one launch holds");
  }
  const cudaStream_t stream = static_cast<cudaStream_t>(p.cuda_stream);
  const std::size_t slots =
      p.splits > 1 ? static_cast<std::size_t>(p.num_seqs * p.heads_kv * group_rows * p.splits) : 0;
  DeviceBuffer partial_out(p.allocator, stream, slots * p.dim_v * sizeof(float));
  DeviceBuffer partial_stats(p.allocator, stream, slots * sizeof(typename decode::state_of<Policy>::type));
  p.partial_out = partial_out.as<float>();
  p.partial_stats = partial_stats.as<float>();
  const dim3 grid(static_cast<unsigned>(p.splits), static_cast<unsigned>(p.heads_kv * p.row_groups),
                  static_cast<unsigned>(p.num_seqs));
  kernel<<<grid, decode::kThreads, 0, stream>>>(p);
  check_launch("decode_split_kernel");
  if (p.splits > 1) {
    const dim3 combine_grid(static_cast<unsigned>(group_rows), static_cast<unsigned>(p.heads_kv),
                            static_cast<unsigned>(p.num_seqs));
    decode::decode_combine_kernel<T, Policy><<<combine_grid, decode::kThreads, 0, stream>>>(p);
    check_launch("decode_combine_kernel");
  }
}

// Calls of the decoding kernels, and the threshold searches that found every row's threshold
// on them (for tests: decode_calls, decode_searches).
std::atomic<std::int64_t> calls{0}, searches{0};

// kSixteenBit: the mechanisms that decode only behind the fused path's threshold search, which
// takes bf16 and fp16 alone; their float32 kernels would never run.
template <class Policy, bool kSixteenBit = false>
void dispatch(const DecodeParams& p) {
  calls.fetch_add(1, std::memory_order_relaxed);
  switch (p.dtype) {
    case DType::bfloat16: return run<__nv_bfloat16, Policy>(p);
    case DType::float16: return run<__half, Policy>(p);
    case DType::float32:
      if constexpr (!kSixteenBit) return run<float, Policy>(p);
      [[fallthrough]];
    default:
      throw Error(ErrorKind::unsupported, std::string("winnow: decode: no CUDA kernel for ") + to_string(p.dtype));
  }
}

bool aligned_cache(const detail::CacheOperand& c, DType dtype) {
  const std::size_t bytes = element_size(dtype);
  return reinterpret_cast<std::uintptr_t>(c.data) % 16 == 0 && (c.page * bytes) % 16 == 0 &&
         (c.slot * bytes) % 16 == 0 && (c.head * bytes) % 16 == 0;
}

}  // namespace

bool decode_kernels_take(const DecodeParams& p) {
  if (p.dtype != DType::bfloat16 && p.dtype != DType::float16 && p.dtype != DType::float32) return false;
  if (p.dim_qk % 8 != 0 || p.dim_v % 8 != 0 || p.dim_qk > 256 || p.dim_v > 256) return false;
  return aligned_cache(p.k, p.dtype) && aligned_cache(p.v, p.dtype);
}

DecodeParams decode_params_of(const detail::AttentionParams& p) {
  DecodeParams d;
  d.dtype = p.dtype;
  d.num_seqs = p.num_seqs;
  d.heads_q = p.heads_q;
  d.heads_kv = p.heads_kv;
  d.dim_qk = p.dim_qk;
  d.dim_v = p.dim_v;
  d.len_q = p.len_q;
  d.q = p.q;
  d.out = p.out;
  d.stats = p.stats;
  d.k = {p.k.data, p.k.batch, p.k.row, p.k.head};
  d.v = {p.v.data, p.v.batch, p.v.row, p.v.head};
  d.len_k = p.len_k;
  d.capacity = p.len_k;
  d.scale = p.scale;
  d.attend_current = p.attend_current;
  d.cuda_stream = p.cuda_stream;
  d.allocator = p.allocator;
  return d;
}

bool decode_path_applies(const detail::AttentionParams& p) {
  static const bool disabled = std::getenv("WINNOW_NO_DECODE_KERNELS") != nullptr;
  if (disabled || p.cu_seqlens_q != nullptr || p.len_q < 1 || p.len_q > kMaxDecodeQueries) return false;
  if (p.len_q * p.group_size() > kMaxDecodeGroupRows || p.num_seqs > 65535) return false;
  if (p.k.dim != 1 || p.v.dim != 1) return false;
  return decode_kernels_take(decode_params_of(p));
}

void softmax_decode(const DecodeParams& p) { dispatch<decode::SoftmaxDecode>(p); }
void stick_breaking_decode(const DecodeParams& p) { dispatch<decode::StickBreakingDecode>(p); }
void sieve_decode(const DecodeParams& p) { dispatch<decode::SieveDecode, true>(p); }
void entmax_decode(const DecodeParams& p) { dispatch<decode::EntmaxDecode, true>(p); }
void sieve_bound_thresholds(const DecodeParams& p) { dispatch<decode::RowMaxDecode, true>(p); }
void threshold_decode(const DecodeParams& p) { dispatch<decode::ThresholdDecode, true>(p); }

bool decode_thresholds(DecodeParams p, float tolerance, const detail::Operand& result, float result_scale) {
  const std::int64_t rows = p.num_seqs * p.len_q * p.heads_q;
  if (rows == 0) return true;
  const cudaStream_t stream = static_cast<cudaStream_t>(p.cuda_stream);
  DeviceBuffer scratch(p.allocator, stream,
                       static_cast<std::size_t>(rows * (2 + decode::kSearchCapacity)) * sizeof(float) +
                           static_cast<std::size_t>(rows + 1) * sizeof(int));
  p.search_rows = scratch.as<float>();
  p.search_lists = p.search_rows + 2 * rows;
  p.search_counts = reinterpret_cast<int*>(p.search_lists + rows * decode::kSearchCapacity);
  p.search_overflow = p.search_counts + rows;
  check(cudaMemsetAsync(p.search_counts, 0, static_cast<std::size_t>(rows + 1) * sizeof(int), stream),
        "clearing the search's counts");
  dispatch<decode::TopScoresDecode, true>(p);
  dispatch<decode::CollectDecode, true>(p);
  constexpr int kWarps = decode::kSearchWarps;
  decode::decode_search_kernel<<<static_cast<unsigned>((rows + kWarps - 1) / kWarps), 32 * kWarps, 0, stream>>>(
      p, tolerance, result, result_scale);
  check_launch("decode_search_kernel");
  int overflow = 0;
  check(cudaMemcpyAsync(&overflow, p.search_overflow, sizeof(int), cudaMemcpyDeviceToHost, stream),
        "reading the search's overflow flag");
  check(cudaStreamSynchronize(stream), "the threshold search over the cache");
  if (overflow != 0) return false;
  searches.fetch_add(1, std::memory_order_relaxed);
  return true;
}

std::int64_t decode_searches() { return searches.load(); }
std::int64_t decode_calls() { return calls.load(); }

std::int64_t first_bad_paged_sequence(const DecodeParams& p, std::int64_t num_pages) {
  if (p.num_seqs == 0) return -1;
  const cudaStream_t stream = static_cast<cudaStream_t>(p.cuda_stream);
  DeviceBuffer flag(p.allocator, stream, sizeof(unsigned long long));
  check(cudaMemsetAsync(flag.as<void>(), 0xff, sizeof(unsigned long long), stream), "clearing a flag");
  decode::check_paged_cache_kernel<<<static_cast<unsigned>(p.num_seqs), 128, 0, stream>>>(
      p, num_pages, flag.as<unsigned long long>());
  check_launch("check_paged_cache_kernel");
  unsigned long long first = 0;
  check(cudaMemcpyAsync(&first, flag.as<void>(), sizeof(first), cudaMemcpyDeviceToHost, stream), "reading a flag");
  check(cudaStreamSynchronize(stream), "checking the paged cache");
  return first == ~0ULL ? -1 : static_cast<std::int64_t>(first);
}

}  // namespace winnow::cuda
