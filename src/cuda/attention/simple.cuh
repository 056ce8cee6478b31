// The simple CUDA path: every dtype (float32 included, computed in fp32), any head
// dimensions, any strides. Straightforward rather than fast: the forward gives each query
// row a warp that walks its keys in chunks of 32 (one per lane); the backward gives each
// (sequence, kv head) one block that walks the query rows in order, so its dk / dv updates
// need no atomics and are always deterministic. Both use the spec's natural-log formulas from
// src/math, so they double as a second GPU implementation to check the fused kernels with.
//
// Early halting is decided per row at key-tile boundaries of 64 keys, like the other paths.
//
// alpha-entmax and Sieve run here where the fused path does not apply: a warp per row first finds
// the row's threshold (thresholds_kernel: the row maximum, then the bracketed probe search of
// math/entmax.h, one sweep over the row's keys per step), then the forward applies it.
#pragma once

#include <cub/block/block_reduce.cuh>
#include <cub/block/block_scan.cuh>
#include <cstdint>

#include "core/params.h"
#include "math/elementwise.h"
#include "math/entmax.h"
#include "math/softmax.h"
#include "math/stick_breaking.h"

namespace winnow::cuda::simple {

using detail::AttentionParams;
using detail::GradientParams;
using detail::SequenceExtent;

inline constexpr int kHaltTile = 64;
inline constexpr int kRowsPerBlock = 4;  // forward: one warp per query row
inline constexpr int kBackwardThreads = 256;

enum class Mechanism { softmax, stick_breaking, entmax, sieve };

// What a mechanism needs beyond the attention operands.
struct Extras {
  float halt_cutoff = 0.f;     // stick-breaking
  detail::Operand kept_from;   // stick-breaking, int32 per row
  float alpha = 1.5f;          // entmax, Sieve
  float tolerance = 1e-5f;     // threshold search
  bool bound = false;          // Sieve's filter
  float eps = 2.f;             // Sieve's bound filter
  detail::Operand threshold;   // Sieve: float per row, score units
  detail::Operand count;       // Sieve: int32 per row, optional
};

template <Mechanism M>
inline constexpr bool kBreaksSticks = M == Mechanism::stick_breaking || M == Mechanism::sieve;

template <class T>
__device__ __forceinline__ float load(const T* p) {
  return static_cast<float>(*p);
}
template <>
__device__ __forceinline__ float load<__nv_bfloat16>(const __nv_bfloat16* p) {
  return __bfloat162float(*p);
}
template <>
__device__ __forceinline__ float load<__half>(const __half* p) {
  return __half2float(*p);
}
template <class T>
__device__ __forceinline__ T from_float(float x) {
  return static_cast<T>(x);
}
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) {
  return __float2bfloat16_rn(x);
}
template <>
__device__ __forceinline__ __half from_float<__half>(float x) {
  return __float2half_rn(x);
}

__device__ __forceinline__ std::int64_t row_limit(const AttentionParams& p, const SequenceExtent& s,
                                                  std::int64_t r) {
  const std::int64_t last = p.last_visible_key(r + s.q_offset());
  return last < s.k_len - 1 ? last : s.k_len - 1;
}

template <class T>
__device__ __forceinline__ float dot_row(const float* x, const T* y, std::int64_t stride, int n) {
  float acc = 0.f;
  for (int d = 0; d < n; ++d) acc += x[d] * load(y + d * stride);
  return acc;
}

// dot_row of x scaled by `scale` (x[d] * scale rounded first), without storing the scaled x: the
// backward's scores then carry the same float rounding as the forward's and the threshold
// search's, which keep q scaled. Past alpha 1.5 entmax's u = gap^((2 - alpha) / (alpha - 1)) is
// steep or unbounded at the support's edge, and a key near the edge took a different u in the
// backward than the threshold implied (float32 dq 4.0e-4 off the reference at alpha 2.5, H200,
// where the CPU's kernels, scaled alike in both passes, reach 3.1e-5); Sieve's filter could
// admit a key in one pass and not the other.
template <class T>
__device__ __forceinline__ float scaled_dot_row(const float* x, float scale, const T* y, std::int64_t stride, int n) {
  float acc = 0.f;
  for (int d = 0; d < n; ++d) acc += (x[d] * scale) * load(y + d * stride);
  return acc;
}

__device__ __forceinline__ float warp_sum(float x) {
  for (int off = 16; off > 0; off /= 2) x += __shfl_xor_sync(0xffffffffu, x, off);
  return x;
}
__device__ __forceinline__ float warp_max(float x) {
  for (int off = 16; off > 0; off /= 2) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, off));
  return x;
}

// Per row, a warp: the entmax threshold tau (written to p.stats: entmax's statistic) or
// Sieve's admission threshold in score units (to x.threshold, with the candidate count).
template <class T, Mechanism M>
__global__ void thresholds_kernel(const AttentionParams p, const Extras x) {
  extern __shared__ float smem[];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  float* q = smem + warp * p.dim_qk;
  const std::int64_t b = blockIdx.z, h = blockIdx.y, hk = p.kv_head(h);
  const SequenceExtent s = p.sequence(b);
  const std::int64_t r = static_cast<std::int64_t>(blockIdx.x) * kRowsPerBlock + warp;
  if (r >= s.q_len) return;
  const std::int64_t row = s.q_start + r;
  const T* q_src = p.q.at<const T>(b, row, h);
  for (int d = lane; d < p.dim_qk; d += 32) q[d] = load(q_src + d * p.q.dim) * static_cast<float>(p.scale);
  __syncwarp();
  const std::int64_t limit = row_limit(p, s, r);
  auto score = [&](std::int64_t key) {
    return dot_row(q, p.k.at<const T>(b, s.k_start + key, hk), p.k.dim, p.dim_qk);
  };
  float z_max = -INFINITY;
  for (std::int64_t key = lane; key <= limit; key += 32) z_max = fmaxf(z_max, score(key));
  z_max = warp_max(z_max);

  float threshold = 0.f;  // score units
  float tau = 0.f;        // x = (alpha - 1) z units
  if (limit >= 0) {
    if (M == Mechanism::sieve && x.bound) {
      threshold = z_max - x.eps;
    } else {
      namespace em = math::entmax;
      const float a = x.alpha;
      constexpr int K = em::kCudaSearchProbes;
      em::ThresholdSearch<float, K> search(a, x.tolerance);
      search.start((a - 1.f) * z_max, static_cast<float>(limit + 1));
      for (int step = 0; step < em::kMaxSearchSteps && !search.done(); ++step) {
        float f[K] = {}, sum_u[K] = {}, probe[K];
        for (int k = 0; k < K; ++k) probe[k] = search.probe(k);
        for (std::int64_t key = lane; key <= limit; key += 32) {
          const float x_key = (a - 1.f) * score(key);
#pragma unroll
          for (int k = 0; k < K; ++k) {
            f[k] += em::weight(x_key - probe[k], a);
            sum_u[k] += em::grad_weight(x_key - probe[k], a);
          }
        }
#pragma unroll
        for (int k = 0; k < K; ++k) {
          f[k] = warp_sum(f[k]);
          sum_u[k] = warp_sum(sum_u[k]);
        }
        search.step(f, sum_u);
      }
      tau = search.tau();
      threshold = tau / (a - 1.f);
    }
  }
  if constexpr (M == Mechanism::sieve) {
    int count = 0;
    for (std::int64_t key = lane; key <= limit; key += 32) {
      count += math::sieve::admitted(score(key), threshold) ? 1 : 0;
    }
    for (int off = 16; off > 0; off /= 2) count += __shfl_xor_sync(0xffffffffu, count, off);
    if (lane == 0) {
      *x.threshold.at<float>(b, row, h) = threshold;
      if (x.count.data != nullptr) *x.count.at<std::int32_t>(b, row, h) = count;
    }
  } else {
    if (lane == 0) *p.stats.at<float>(b, row, h) = tau;
  }
}

// Forward. M selects the mechanism; stats gets lse, log_rem, or (entmax, already written by
// thresholds_kernel) tau.
template <class T, Mechanism M>
__global__ void forward_kernel(const AttentionParams p, const Extras x) {
  constexpr bool StickBreaking = kBreaksSticks<M>;
  const float halt_cutoff = x.halt_cutoff;
  extern __shared__ float smem[];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  float* q = smem + warp * (p.dim_qk + p.dim_v);
  float* o = q + p.dim_qk;
  const std::int64_t b = blockIdx.z, h = blockIdx.y, hk = p.kv_head(h);
  const SequenceExtent s = p.sequence(b);
  const std::int64_t r = static_cast<std::int64_t>(blockIdx.x) * kRowsPerBlock + warp;
  if (r >= s.q_len) return;
  const std::int64_t row = s.q_start + r;
  const T* q_src = p.q.at<const T>(b, row, h);
  for (int d = lane; d < p.dim_qk; d += 32) q[d] = load(q_src + d * p.q.dim) * static_cast<float>(p.scale);
  for (int d = lane; d < p.dim_v; d += 32) o[d] = 0.f;
  __syncwarp();

  const std::int64_t limit = row_limit(p, s, r);
  // Entmax's tau (x units), Sieve's admission threshold (score units).
  const float row_threshold = M == Mechanism::entmax  ? *p.stats.at<const float>(b, row, h)
                              : M == Mechanism::sieve ? *x.threshold.at<const float>(b, row, h)
                                                      : 0.f;
  float carry = 0.f;                            // stick-breaking: log stick right of the keys seen
  float run_max = -INFINITY, run_sum = 0.f;     // softmax
  std::int64_t kept = 0;
  for (std::int64_t tile_hi = limit; tile_hi >= 0;) {
    const std::int64_t tile_lo = tile_hi / kHaltTile * kHaltTile;
    for (std::int64_t hi = tile_hi; hi >= tile_lo; hi -= 32) {
      const std::int64_t key = hi - lane;  // lane 0 holds the most recent key of the chunk
      bool visible = key >= tile_lo;
      float z = visible ? dot_row(q, p.k.at<const T>(b, s.k_start + key, hk), p.k.dim, p.dim_qk) : 0.f;
      if constexpr (M == Mechanism::sieve) visible = visible && math::sieve::admitted(z, row_threshold);
      float w;
      if constexpr (M == Mechanism::entmax) {
        w = visible ? math::entmax::weight((x.alpha - 1.f) * z - row_threshold, x.alpha) : 0.f;
      } else if constexpr (StickBreaking) {
        namespace sb = math::stick_breaking;
        float suffix = visible ? sb::stick_cost(z) : 0.f;
        for (int off = 1; off < 32; off *= 2) {
          const float t = __shfl_up_sync(0xffffffffu, suffix, off);
          if (lane >= off) suffix += t;
        }
        w = visible ? expf(sb::log_weight(z, suffix, carry)) : 0.f;
        carry -= __shfl_sync(0xffffffffu, suffix, 31);
      } else {
        float chunk_max = visible ? z : -INFINITY;
        for (int off = 16; off > 0; off /= 2) chunk_max = fmaxf(chunk_max, __shfl_xor_sync(0xffffffffu, chunk_max, off));
        const float new_max = fmaxf(run_max, chunk_max);
        const float rescale = run_max == -INFINITY ? 0.f : expf(run_max - new_max);
        w = visible ? math::softmax::probability(z, new_max) : 0.f;
        float chunk_sum = w;
        for (int off = 16; off > 0; off /= 2) chunk_sum += __shfl_xor_sync(0xffffffffu, chunk_sum, off);
        run_sum = run_sum * rescale + chunk_sum;
        for (int d = lane; d < p.dim_v; d += 32) o[d] *= rescale;
        run_max = new_max;
      }
      __syncwarp();
      for (int j = 0; j < 32; ++j) {
        const float wj = __shfl_sync(0xffffffffu, w, j);
        const std::int64_t kj = hi - j;
        if (kj < tile_lo || wj == 0.f) continue;
        const T* v = p.v.at<const T>(b, s.k_start + kj, hk);
        for (int d = lane; d < p.dim_v; d += 32) o[d] += wj * load(v + d * p.v.dim);
      }
      __syncwarp();
    }
    tile_hi = tile_lo - 1;
    if (StickBreaking && halt_cutoff > 0.f && carry < -halt_cutoff) {
      kept = tile_lo;
      break;
    }
  }
  float scale_out = 1.f, stat = carry;
  if constexpr (M == Mechanism::entmax) {
    stat = row_threshold;
  } else if constexpr (M == Mechanism::softmax) {
    scale_out = run_sum > 0.f ? 1.f / run_sum : 0.f;
    stat = run_sum > 0.f ? run_max + logf(run_sum) : -INFINITY;
  }
  T* out = p.out.at<T>(b, row, h);
  for (int d = lane; d < p.dim_v; d += 32) out[d * p.out.dim] = from_float<T>(o[d] * scale_out);
  if (lane == 0) {
    *p.stats.at<float>(b, row, h) = stat;
    if (M == Mechanism::stick_breaking && x.kept_from.data != nullptr) {
      *x.kept_from.at<std::int32_t>(b, row, h) = static_cast<std::int32_t>(kept);
    }
  }
}

// Backward: one block per (sequence, kv head); query heads of the group and their rows in
// order. Stick-breaking sweeps each row's keys right to left twice: first for the row total
// G = sum_i g_ij, then for the gradients with prefix sums taken as G minus the suffix so far.
//
// Entmax sweeps each row twice as well: first for sum_i u_i and sum_i u_i dp_i (delta), then
// for the gradients. Sieve is stick-breaking with keys below the row's threshold left out.
template <class T, Mechanism M>
__global__ void __launch_bounds__(kBackwardThreads)
    backward_kernel(const AttentionParams p, const GradientParams g, const Extras x,
                    float* dk_acc, float* dv_acc) {
  constexpr bool StickBreaking = kBreaksSticks<M>;
  const float halt_cutoff = x.halt_cutoff;
  const detail::Operand& kept_from = x.kept_from;
  using Scan = cub::BlockScan<float, kBackwardThreads>;
  using Reduce = cub::BlockReduce<float, kBackwardThreads>;
  __shared__ typename Scan::TempStorage scan_storage;
  __shared__ typename Reduce::TempStorage reduce_storage;
  __shared__ float broadcast;
  extern __shared__ float smem[];
  float* q = smem;                 // dim_qk, unscaled
  float* dout = q + p.dim_qk;      // dim_v
  float* dz_of = dout + p.dim_v;   // kBackwardThreads: scaled dz of each thread's key
  float* dq = dz_of + kBackwardThreads;  // dim_qk accumulator of the current row
  const int t = threadIdx.x;
  const std::int64_t b = blockIdx.y, hk = blockIdx.x;
  const SequenceExtent s = p.sequence(b);
  const float scale = static_cast<float>(p.scale);
  auto block_sum = [&](float x) {
    const float total = Reduce(reduce_storage).Sum(x);
    if (t == 0) broadcast = total;
    __syncthreads();
    const float result = broadcast;
    __syncthreads();
    return result;
  };

  for (std::int64_t h = hk * p.group_size(); h < (hk + 1) * p.group_size(); ++h) {
    for (std::int64_t r = 0; r < s.q_len; ++r) {
      const std::int64_t row = s.q_start + r;
      for (int d = t; d < p.dim_qk; d += kBackwardThreads) {
        q[d] = load(p.q.at<const T>(b, row, h) + d * p.q.dim);
        dq[d] = 0.f;
      }
      for (int d = t; d < p.dim_v; d += kBackwardThreads) dout[d] = load(g.dout.at<const T>(b, row, h) + d * g.dout.dim);
      __syncthreads();
      const float stat = *p.stats.at<const float>(b, row, h);
      const float dlog_rem = g.dstats.data != nullptr ? *g.dstats.at<const float>(b, row, h) : 0.f;
      const std::int64_t first = M == Mechanism::stick_breaking && halt_cutoff > 0.f && kept_from.data != nullptr
                                     ? *kept_from.at<const std::int32_t>(b, row, h)
                                     : 0;
      const std::int64_t limit = row_limit(p, s, r);
      const float row_threshold = M == Mechanism::sieve ? *x.threshold.at<const float>(b, row, h) : 0.f;
      float delta = 0.f;  // softmax: <do, o>; entmax: sum u dp / sum u
      if constexpr (M == Mechanism::softmax) {
        float part = 0.f;
        for (int d = t; d < p.dim_v; d += kBackwardThreads) part += dout[d] * load(p.out.at<const T>(b, row, h) + d * p.out.dim);
        delta = block_sum(part);
      }
      float total_g = 0.f, sum_u = 0.f, sum_udp = 0.f;
      for (int pass = M == Mechanism::softmax ? 1 : 0; pass < 2; ++pass) {
        if (M == Mechanism::entmax && pass == 1) delta = sum_u > 0.f ? sum_udp / sum_u : 0.f;
        float carry = 0.f, suffix_g = 0.f;
        for (std::int64_t hi = limit; hi >= first; hi -= kBackwardThreads) {
          const std::int64_t key = hi - t;  // thread 0 holds the most recent key of the chunk
          bool visible = key >= first;
          const T* k = visible ? p.k.at<const T>(b, s.k_start + key, hk) : nullptr;
          const T* v = visible ? p.v.at<const T>(b, s.k_start + key, hk) : nullptr;
          const float z = visible ? scaled_dot_row(q, scale, k, p.k.dim, p.dim_qk) : 0.f;
          if constexpr (M == Mechanism::sieve) visible = visible && math::sieve::admitted(z, row_threshold);
          const float dp = visible ? dot_row(dout, v, p.v.dim, p.dim_v) : 0.f;
          float w = 0.f, dz = 0.f;
          if constexpr (M == Mechanism::entmax) {
            namespace em = math::entmax;
            const float gap = visible ? (x.alpha - 1.f) * z - stat : -1.f;
            const float u = em::grad_weight(gap, x.alpha);
            if (pass == 0) {
              sum_u += block_sum(u);
              sum_udp += block_sum(u * dp);
              continue;
            }
            w = em::weight(gap, x.alpha);
            dz = em::grad_logit(u, dp, delta);
          } else if constexpr (StickBreaking) {
            namespace sb = math::stick_breaking;
            float suffix, cost_total;
            Scan(scan_storage).InclusiveSum(visible ? sb::stick_cost(z) : 0.f, suffix, cost_total);
            __syncthreads();
            w = visible ? expf(sb::log_weight(z, suffix, carry)) : 0.f;
            carry -= cost_total;
            const float gk = w * dp;
            if (pass == 0) {
              total_g += block_sum(gk);
              continue;
            }
            float g_incl, g_chunk;
            Scan(scan_storage).InclusiveSum(gk, g_incl, g_chunk);
            __syncthreads();
            // sum_{i' <= i} g = G - sum_{i' > i} g
            const float prefix = total_g - (suffix_g + g_incl - gk);
            dz = visible ? sb::grad_logit(gk, z, prefix + dlog_rem) : 0.f;
            suffix_g += g_chunk;
          } else {
            w = visible ? math::softmax::probability(z, stat) : 0.f;
            dz = visible ? math::softmax::grad_logit(w, dp, delta) : 0.f;
          }
          dz_of[t] = scale * dz;
          if (visible) {
            float* dk_row = dk_acc + (p.batch_row_k(b, s.k_start + key) * p.heads_kv + hk) * p.dim_qk;
            float* dv_row = dv_acc + (p.batch_row_k(b, s.k_start + key) * p.heads_kv + hk) * p.dim_v;
            for (int d = 0; d < p.dim_qk; ++d) dk_row[d] += scale * dz * q[d];
            for (int d = 0; d < p.dim_v; ++d) dv_row[d] += w * dout[d];
          }
          __syncthreads();
          // dq += sum over the chunk's keys of dz k, one feature per thread, keys in order.
          for (int d = t; d < p.dim_qk; d += kBackwardThreads) {
            float acc = dq[d];
            for (int j = 0; j < kBackwardThreads && hi - j >= first; ++j) {
              acc += dz_of[j] * load(p.k.at<const T>(b, s.k_start + hi - j, hk) + d * p.k.dim);
            }
            dq[d] = acc;
          }
          __syncthreads();
        }
      }
      for (int d = t; d < p.dim_qk; d += kBackwardThreads) {
        *(g.dq.at<T>(b, row, h) + d * g.dq.dim) = from_float<T>(dq[d]);
      }
      __syncthreads();
    }
  }
}

}  // namespace winnow::cuda::simple
