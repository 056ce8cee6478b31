// Device discovery, the host copy the argument checks need, and what every launcher shares:
// the fused-path test and the kernel that stores dk / dv from their fp32 accumulators.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdlib>

#include "core/device_copy.h"
#include "cuda/launch.h"
#include "cuda/tile/ptx.cuh"
#include "winnow/attention.h"

namespace winnow {

bool built_with_cuda() { return true; }

int cuda_device_count() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    (void)cudaGetLastError();  // no driver or no device: report none, leave no sticky error
    return 0;
  }
  return count;
}

namespace detail {
void copy_to_host(void* dst, const void* src, std::size_t bytes, Device, void* stream) {
  const auto s = static_cast<cudaStream_t>(stream);
  cuda::check(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToHost, s), "reading cu_seqlens");
  cuda::check(cudaStreamSynchronize(s), "reading cu_seqlens");
}
}  // namespace detail

namespace cuda {

int multiprocessors() {
  int device = 0, count = 0;
  check(cudaGetDevice(&device), "querying the device");
  check(cudaDeviceGetAttribute(&count, cudaDevAttrMultiProcessorCount, device), "querying the device");
  return count;
}

int heads_per_sweep(Pass pass, std::int64_t blocks_per_head, std::int64_t heads) {
  auto forced_by = [](const char* name) {
    const char* v = std::getenv(name);
    return v != nullptr ? std::max(1, std::atoi(v)) : 0;
  };
  static const int forced = forced_by("WINNOW_HEADS_PER_SWEEP");
  static const int forced_forward = forced_by("WINNOW_FORWARD_HEADS_PER_SWEEP");
  const int chosen_by_user = pass == Pass::forward && forced_forward > 0 ? forced_forward : forced;
  const std::int64_t chosen = chosen_by_user > 0 ? chosen_by_user : (2 * blocks_per_head <= multiprocessors() ? 2 : 1);
  return static_cast<int>(std::max<std::int64_t>(1, std::min(chosen, heads)));
}

namespace {


template <class T>
__global__ void store_key_grads_kernel(const detail::AttentionParams p, const detail::GradientParams g,
                                       const float* dk, const float* dv) {
  const std::int64_t width = p.heads_kv * (p.dim_qk + p.dim_v);
  const std::int64_t total = p.rows_k * width;
  for (std::int64_t i = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; i < total;
       i += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    const std::int64_t row = i / width, rest = i % width;
    // Packed inputs address rows directly; batched ones split the row into (sequence, key).
    const std::int64_t b = p.cu_seqlens_k != nullptr ? 0 : row / p.len_k;
    const std::int64_t key = p.cu_seqlens_k != nullptr ? row : row % p.len_k;
    if (rest < p.heads_kv * p.dim_qk) {
      const std::int64_t h = rest / p.dim_qk, d = rest % p.dim_qk;
      g.dk.at<T>(b, key, h)[d * g.dk.dim] = static_cast<T>(dk[(row * p.heads_kv + h) * p.dim_qk + d]);
    } else {
      const std::int64_t r = rest - p.heads_kv * p.dim_qk;
      const std::int64_t h = r / p.dim_v, d = r % p.dim_v;
      g.dv.at<T>(b, key, h)[d * g.dv.dim] = static_cast<T>(dv[(row * p.heads_kv + h) * p.dim_v + d]);
    }
  }
}

// The same when both gradients have unit stride along the head dimension and the head
// dimensions are multiples of 4: one block per key row, four elements per thread per step,
// 32-bit index arithmetic (the general kernel's 64-bit divisions per element made this
// conversion a sizeable part of a short-sequence backward).
template <class T>
__global__ void store_key_grads_rows_kernel(const detail::AttentionParams p, const detail::GradientParams g,
                                            const float* dk, const float* dv) {
  const std::int64_t row = blockIdx.x;
  const std::int64_t b = p.cu_seqlens_k != nullptr ? 0 : row / p.len_k;
  const std::int64_t key = p.cu_seqlens_k != nullptr ? row : row % p.len_k;
  const int heads = static_cast<int>(p.heads_kv), dk_dim = static_cast<int>(p.dim_qk),
            dv_dim = static_cast<int>(p.dim_v);
  const int k_quads = heads * dk_dim / 4, quads = k_quads + heads * dv_dim / 4;
  for (int q = threadIdx.x; q < quads; q += blockDim.x) {
    const bool is_k = q < k_quads;
    const int dim = is_k ? dk_dim : dv_dim;
    const int e = 4 * (is_k ? q : q - k_quads);
    const int h = e / dim, d = e % dim;
    const float4 x = *reinterpret_cast<const float4*>((is_k ? dk : dv) + row * heads * dim + e);
    T* out = (is_k ? g.dk : g.dv).at<T>(b, key, h) + d;
    out[0] = static_cast<T>(x.x);
    out[1] = static_cast<T>(x.y);
    out[2] = static_cast<T>(x.z);
    out[3] = static_cast<T>(x.w);
  }
}

// Zeros into dk and dv of 16-bit elements whose rows are 16-byte aligned: one block per key
// row, 16 bytes (eight elements) per thread and step.
__global__ void clear_key_grads_kernel(const detail::AttentionParams p, const detail::GradientParams g) {
  const std::int64_t row = blockIdx.x;
  const std::int64_t b = p.cu_seqlens_k != nullptr ? 0 : row / p.len_k;
  const std::int64_t key = p.cu_seqlens_k != nullptr ? row : row % p.len_k;
  const int per_head_k = static_cast<int>(p.dim_qk) / 8, per_head_v = static_cast<int>(p.dim_v) / 8;
  const int k_chunks = static_cast<int>(p.heads_kv) * per_head_k;
  const int chunks = k_chunks + static_cast<int>(p.heads_kv) * per_head_v;
  for (int c = threadIdx.x; c < chunks; c += blockDim.x) {
    const bool is_k = c < k_chunks;
    const int per_head = is_k ? per_head_k : per_head_v;
    const int i = is_k ? c : c - k_chunks;
    std::uint16_t* head = (is_k ? g.dk : g.dv).at<std::uint16_t>(b, key, i / per_head);
    reinterpret_cast<uint4*>(head)[i % per_head] = make_uint4(0, 0, 0, 0);
  }
}

}  // namespace

bool aligned_rows(const detail::Operand& op, DType dtype) {
  const std::size_t bytes = element_size(dtype);
  return op.dim == 1 && reinterpret_cast<std::uintptr_t>(op.data) % 16 == 0 &&
         (op.row * bytes) % 16 == 0 && (op.head * bytes) % 16 == 0 && (op.batch * bytes) % 16 == 0;
}

bool fused_path_applies(const detail::AttentionParams& p, const detail::GradientParams* g, bool small_dims) {
  if (p.dtype != DType::bfloat16 && p.dtype != DType::float16) return false;
  const bool small = small_dims && (p.dim_qk == 16 || p.dim_qk == 32);
  if (p.dim_qk != p.dim_v || (p.dim_qk != 64 && p.dim_qk != 128 && !small)) return false;
  if (p.num_seqs > 65535 || p.heads_q > 65535) return false;
  for (const detail::Operand* op : {&p.q, &p.k, &p.v, &p.out}) {
    if (!aligned_rows(*op, p.dtype)) return false;
  }
  if (g != nullptr && (!aligned_rows(g->dout, p.dtype) || !aligned_rows(g->dq, p.dtype))) return false;
  return true;
}

void clear_key_grads(const detail::AttentionParams& p, const detail::GradientParams& g) {
  if (p.rows_k == 0 || p.heads_kv == 0) return;
  if (p.rows_k >= (std::int64_t{1} << 31)) throw Error(ErrorKind::unsupported, "winnow: too many key rows for one launch");
  clear_key_grads_kernel<<<static_cast<unsigned>(p.rows_k), 128, 0, stream_of(p)>>>(p, g);
  check_launch("clear_key_grads");
}

void store_key_grads(const detail::AttentionParams& p, const detail::GradientParams& g,
                     const float* dk, const float* dv) {
  const std::int64_t total = p.rows_k * p.heads_kv * (p.dim_qk + p.dim_v);
  if (total == 0) return;
  if (g.dk.dim == 1 && g.dv.dim == 1 && p.dim_qk % 4 == 0 && p.dim_v % 4 == 0 && p.rows_k < (1LL << 31) &&
      p.heads_kv * (p.dim_qk + p.dim_v) < (1LL << 30)) {
    const unsigned rows = static_cast<unsigned>(p.rows_k);
    switch (p.dtype) {
      case DType::float32:
        store_key_grads_rows_kernel<float><<<rows, 128, 0, stream_of(p)>>>(p, g, dk, dv);
        break;
      case DType::float16:
        store_key_grads_rows_kernel<__half><<<rows, 128, 0, stream_of(p)>>>(p, g, dk, dv);
        break;
      case DType::bfloat16:
        store_key_grads_rows_kernel<__nv_bfloat16><<<rows, 128, 0, stream_of(p)>>>(p, g, dk, dv);
        break;
      default: throw Error(ErrorKind::unsupported, "winnow: no CUDA kernels for this dtype");
    }
    check_launch("store_key_grads_rows");
    return;
  }
  const int threads = 256;
  const int blocks = static_cast<int>(std::min<std::int64_t>((total + threads - 1) / threads, 65536));
  switch (p.dtype) {
    case DType::float32:
      store_key_grads_kernel<float><<<blocks, threads, 0, stream_of(p)>>>(p, g, dk, dv);
      break;
    case DType::float16:
      store_key_grads_kernel<__half><<<blocks, threads, 0, stream_of(p)>>>(p, g, dk, dv);
      break;
    case DType::bfloat16:
      store_key_grads_kernel<__nv_bfloat16><<<blocks, threads, 0, stream_of(p)>>>(p, g, dk, dv);
      break;
    default: throw Error(ErrorKind::unsupported, "winnow: no CUDA kernels for this dtype");
  }
  check_launch("store_key_grads");
}

}  // namespace cuda
}  // namespace winnow
