// Threshold attention (TRA / TDA) on CUDA. Every call first writes each view's queries and keys
// L2-normalized (T, contiguous) with their inverse norms, so the kernels see cosines; the
// gradients come back through the normalization at the end (dq inside the fused backward's
// last step, dk from its fp32 accumulator). Forwards of a short suffix of queries against a
// long cache (decoding) instead take the split-KV decoding kernel, which normalizes as it reads
// (decoded_forward).
//
// Fused path (16-bit inputs, D 64 or 128): the shared forward and backward kernels with the
// threshold row policies. TDA's forward on Hopper is one launch over both views
// (ThresholdTwoViewRows: both score tiles of 64 keys, P = w1 - lambda w2, one P V); elsewhere, and
// in the backward, each view is a launch, the second's weights scaled by -lambda: the forward
// adds the first view's output (already in out) before storing, the backward adds into the same
// dV accumulator.
//
// Screened forward (Hopper, fused path, WINNOW_THRESHOLD_SCREEN set): the rows are
// also written as int8 with their quantization error, the screen (threshold_screen_sm90.cuh)
// rules out the pairs whose 8-bit products prove them exact zeros and handles the few others,
// and the fused forward then visits only the key tiles the screen left dense, per warp of rows.
//
// Simple path (float32, other head dimensions, unaligned rows, and every call that asks for
// the per-row survivor count): a warp per query row for the forward, with both views in one
// sweep (so a key kept in either view counts once), and a block per (sequence, kv head) for the
// backward.
//
// This header is the implementation that threshold_attention_forward.cu,
// threshold_attention_forward_bf16.cu, threshold_attention_forward_fp16.cu and
// threshold_attention_backward.cu include, each defining an entry point: a translation unit
// instantiates only the kernels its entry reaches, so they compile in parallel. As one file
// the forward and backward took 163 s (sm_90a, one core of the development machine), split by
// direction 105 s and 35 s; the forward was then the longest unit of the library and the end of
// every cold GPU build (2026-11-30: past 215 s on the GPU machine), hence its fused path split
// by element type too.
#pragma once

#include <cub/block/block_reduce.cuh>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <type_traits>
#include <vector>

#include "cuda/attention/simple.cuh"
#include "cuda/attention/threshold_rows.cuh"
#include "cuda/attention/threshold_screen_sm90.cuh"
#include "cuda/cuda.h"
#include "cuda/element_types.cuh"
#include "cuda/launch_attention.cuh"
#include "winnow/threshold.h"

namespace winnow::cuda {
namespace {

namespace mt = math::threshold;
using detail::Operand;
using detail::ThresholdConfig;

constexpr int kWarpsPerBlock = 8;

// Rows of a per-row buffer laid out [batch row][head][dim]: which (sequence, row) a batch row is.
struct RowGeometry {
  std::int64_t rows = 0, heads = 0, len = 0;  // len: rows per sequence (batched); 0 when packed
  int dim = 0;
  __device__ __forceinline__ std::int64_t sequence(std::int64_t row) const { return len > 0 ? row / len : 0; }
  __device__ __forceinline__ std::int64_t row_in(std::int64_t row) const { return len > 0 ? row % len : row; }
};

RowGeometry query_rows(const detail::AttentionParams& p) {
  return {p.rows_q, p.heads_q, p.cu_seqlens_q != nullptr ? 0 : p.len_q, static_cast<int>(p.dim_qk)};
}
RowGeometry key_rows(const detail::AttentionParams& p, int dim) {
  return {p.rows_k, p.heads_kv, p.cu_seqlens_k != nullptr ? 0 : p.len_k, dim};
}

// An operand over a contiguous [batch row][head][dim] buffer, addressed like the caller's.
Operand contiguous(void* data, const RowGeometry& r) {
  Operand o;
  o.data = data;
  o.dim = 1;
  o.head = r.dim;
  o.row = r.heads * r.dim;
  o.batch = r.len * o.row;
  return o;
}

// A warp per (batch row, head): x / max(|x|, eps) into dst, and the inverse norm (negated
// where the norm was clipped at eps).
template <class T>
__global__ void normalize_rows_kernel(const Operand src, const Operand dst, float* inv_norm,
                                      const RowGeometry r, float eps) {
  const std::int64_t idx = static_cast<std::int64_t>(blockIdx.x) * kWarpsPerBlock + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (idx >= r.rows * r.heads) return;
  const std::int64_t row = idx / r.heads, h = idx % r.heads, b = r.sequence(row), at = r.row_in(row);
  const T* x = src.at<const T>(b, at, h);
  float sum = 0.f;
  for (int d = lane; d < r.dim; d += 32) {
    const float v = simple::load(x + d * src.dim);
    sum += v * v;
  }
  sum = simple::warp_sum(sum);
  const float inv = math::inverse_norm(sum, eps);
  T* y = dst.at<T>(b, at, h);
  for (int d = lane; d < r.dim; d += 32) y[d] = simple::from_float<T>(simple::load(x + d * src.dim) * inv);
  if (lane == 0) inv_norm[idx] = math::norm_clipped(sum, eps) ? -inv : inv;
}

// The same for 16-bit rows of 64 or 128 features with unit stride, 16-byte aligned (what the
// fused kernels take): kLanes = dim / 8 lanes per row, each moving its eight features with one
// 16-byte access, so a warp normalizes 32 / kLanes rows with one load and one store per lane.
// The scalar kernel above moved two bytes per access and reached about a third of the memory
// bandwidth, 0.14 ms per view at 16K tokens, 12 heads (H200), in every forward and backward.
// The row a lane of the packed kernels takes (kLanes lanes a row, 32 / kLanes rows a warp) and
// its eight features (sub); a lane past the last row is not valid but still takes part in the
// row sums, which run over every lane of the warp.
template <int kLanes>
struct PackedRowLane {
  int sub;
  std::int64_t idx, b, at, h;
  bool valid;
  __device__ __forceinline__ explicit PackedRowLane(const RowGeometry& r) {
    const int lane = threadIdx.x % 32;
    sub = lane % kLanes;
    idx = (static_cast<std::int64_t>(blockIdx.x) * kWarpsPerBlock + threadIdx.x / 32) * (32 / kLanes) + lane / kLanes;
    valid = idx < r.rows * r.heads;
    const std::int64_t row = valid ? idx / r.heads : 0;
    h = valid ? idx % r.heads : 0;
    b = r.sequence(row);
    at = r.row_in(row);
  }
};

// A lane's eight features `in` normalized, rounded to T and stored into hat when valid, and
// returned as read back (what the kernels score): the one normalization of the packed kernels,
// the screen's included, so the screened forward scores the rows the unscreened one would.
// Every lane of the warp takes part; an invalid lane holds zeros. *inv_norm: the signed
// inverse norm.
template <class T, int kLanes>
__device__ __forceinline__ void normalize_packed_row(const Pack<T, 8>& in, T* hat, bool valid, float eps,
                                                     float (&a)[8], float* inv_norm) {
#pragma unroll
  for (int j = 0; j < 8; ++j) a[j] = valid ? widen(in.v[j]) : 0.f;
  float sum = 0.f;
#pragma unroll
  for (int j = 0; j < 8; ++j) sum += a[j] * a[j];
  sum = tile::lanes_sum<kLanes>(sum);
  const float inv = math::inverse_norm(sum, eps);
  *inv_norm = math::norm_clipped(sum, eps) ? -inv : inv;
  Pack<T, 8> out;
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    out.v[j] = narrow_to<T>(a[j] * inv);
    a[j] = valid ? widen(out.v[j]) : 0.f;
  }
  if (valid) store_pack<T, 8>(hat, out);
}

template <class T, int kLanes>
__global__ void normalize_rows_packed_kernel(const Operand src, const Operand dst, float* inv_norm,
                                             const RowGeometry r, float eps) {
  const PackedRowLane<kLanes> l(r);
  float x[8], inv;
  normalize_packed_row<T, kLanes>(load_packed_row(src.at<const T>(l.b, l.at, l.h) + 8 * l.sub, l.valid),
                                  dst.at<T>(l.b, l.at, l.h) + 8 * l.sub, l.valid, eps, x, &inv);
  if (l.valid && l.sub == 0) inv_norm[l.idx] = inv;
}

// Whether the packed kernels take rows of this geometry: 16-bit T, 64 or 128 features.
template <class T>
bool packed_rows_apply(const RowGeometry& r) {
  return sizeof(T) == 2 && (r.dim == 64 || r.dim == 128);
}

// f(std::integral_constant<int, dim / 8>{}): the packed kernels' lanes a row, for the dims they take.
template <class F>
void with_packed_lanes(int dim, F&& f) {
  if (dim == 128) {
    f(std::integral_constant<int, 16>{});
  } else {
    f(std::integral_constant<int, 8>{});
  }
}

unsigned packed_blocks(const RowGeometry& r) {
  const std::int64_t rows_per_block = kWarpsPerBlock * (32 / (r.dim / 8));
  return static_cast<unsigned>((r.rows * r.heads + rows_per_block - 1) / rows_per_block);
}

// Eight bytes of a key row at byte 8 pack of row `row` of a key tile in the screen's layout
// (ScreenKeyTile: the shared-memory tile's, so that the screen copies a tile as one block).
__device__ __forceinline__ void store_key_tile_pack(std::int8_t* tile, int row, int pack, uint2 words) {
  *reinterpret_cast<uint2*>(tile + ScreenKeyTile::offset_of(row, pack / 2) + 8 * (pack % 2)) = words;
}

// A block per (key tile, kv head, sequence): the tile's keys normalized, then quantized with one
// scale, the tile's (so that the screen's cut is exact in the keys' scale), into k8_tiles' tile
// in the screen's shared-memory layout, rows past the sequence zero; tile_meta = {1 / scale,
// largest error radius} (the screen's cut takes the reciprocal: one division a tile here, none
// a tile in the screen's loop). Four lanes a key as the queries' kernel, so a block of
// kKeyTileWarps warps a tile, each key's normalized features kept in registers between the two
// steps. With a pack a lane and eight keys a lane (a block of eight warps), the kernel held 102
// registers a thread, ran at 23% occupancy and took 0.059 ms per view at 16K tokens, 12 heads
// (Nsight Compute, H200, 2026-12-02).
inline constexpr int kKeyTileWarps = kCellKeys / (32 / kWideLanes);
template <class T, int kPacks>
__global__ void __launch_bounds__(32 * kKeyTileWarps) normalize_quantize_key_tiles_kernel(
    const detail::AttentionParams p, const Operand src, const Operand hat, float* inv_norm, std::int8_t* k8_tiles,
    float2* tile_meta, int key_tiles, float eps) {
  __shared__ float largest_of[kKeyTileWarps];
  const int t = blockIdx.x, warp = threadIdx.x / 32, lane = threadIdx.x % 32, sub = lane % kWideLanes;
  const std::int64_t hk = blockIdx.y, b = blockIdx.z;
  const detail::SequenceExtent s = p.sequence(b);
  const int tile_row = static_cast<int>(threadIdx.x) / kWideLanes;
  const std::int64_t key = static_cast<std::int64_t>(t) * kCellKeys + tile_row;
  const bool valid = key < s.k_len;
  const std::int64_t row = s.k_start + (valid ? key : 0);
  Pack<T, 8> in[kPacks];
  load_wide_row<T, kPacks>(src.at<const T>(b, row, hk), sub, valid, in);
  Pack<T, 8> out[kPacks];
  float a[kPacks][8], inv;
  normalize_wide_row<T, kPacks>(in, hat.at<T>(b, row, hk), sub, valid, eps, out, &inv);
  widen_row<T, kPacks>(out, valid, a);
  if (valid && sub == 0) inv_norm[p.batch_row_k(b, row) * p.heads_kv + hk] = inv;
  float largest = tile::lanes_max<32>(largest_magnitude<kPacks>(a));
  if (lane == 0) largest_of[warp] = largest;
  __syncthreads();
#pragma unroll
  for (int w = 0; w < kKeyTileWarps; ++w) largest = fmaxf(largest, largest_of[w]);
  std::int8_t* const tile_dst = k8_tiles + ((b * p.heads_kv + hk) * key_tiles + t) * kScreenTileBytes;
  float err = quantize_wide_row<kPacks>(a, largest, valid, [&](int j, uint2 words) {
    store_key_tile_pack(tile_dst, tile_row, sub + kWideLanes * j, words);
  });
  err = tile::lanes_max<32>(err);
  __syncthreads();  // every warp has read largest_of
  if (lane == 0) largest_of[warp] = err;
  __syncthreads();
  if (threadIdx.x == 0) {
    for (int w = 0; w < kKeyTileWarps; ++w) err = fmaxf(err, largest_of[w]);
    tile_meta[(b * p.heads_kv + hk) * key_tiles + t] = make_float2(1.f / mt::screen_scale(largest), err);
  }
}

// A warp per (batch row, head): out = the gradient through the normalization from dL/dx_hat
// (fp32 [batch row][head][dim]); with hat.data == nullptr, a plain store of the fp32 rows.
template <class T>
__global__ void store_grad_rows_kernel(const float* g_hat, const Operand hat, const float* inv_norm,
                                       const Operand out, const RowGeometry r) {
  const std::int64_t idx = static_cast<std::int64_t>(blockIdx.x) * kWarpsPerBlock + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (idx >= r.rows * r.heads) return;
  const std::int64_t row = idx / r.heads, h = idx % r.heads, b = r.sequence(row), at = r.row_in(row);
  const float* g = g_hat + idx * r.dim;
  T* y = out.at<T>(b, at, h);
  if (hat.data == nullptr) {
    for (int d = lane; d < r.dim; d += 32) y[d * out.dim] = simple::from_float<T>(g[d]);
    return;
  }
  const T* x = hat.at<const T>(b, at, h);
  float dot = 0.f;
  for (int d = lane; d < r.dim; d += 32) dot += simple::load(x + d) * g[d];
  dot = simple::warp_sum(dot);
  const float inv = inv_norm[idx];
  for (int d = lane; d < r.dim; d += 32) {
    y[d * out.dim] = simple::from_float<T>(math::normalize_grad(g[d], simple::load(x + d), dot, fabsf(inv), inv < 0.f));
  }
}

// store_grad_rows_kernel for the rows normalize_rows_packed_kernel takes, with `out` 16-byte
// aligned with unit stride: eight features a lane, kLanes = dim / 8 lanes a row.
template <class T, int kLanes>
__global__ void store_grad_rows_packed_kernel(const float* g_hat, const Operand hat, const float* inv_norm,
                                              const Operand out, const RowGeometry r) {
  const PackedRowLane<kLanes> l(r);
  float g[8] = {}, x[8] = {};
  if (l.valid) {
    const float4* gp = reinterpret_cast<const float4*>(g_hat + l.idx * r.dim + 8 * l.sub);
    const float4 g0 = gp[0], g1 = gp[1];
    g[0] = g0.x, g[1] = g0.y, g[2] = g0.z, g[3] = g0.w, g[4] = g1.x, g[5] = g1.y, g[6] = g1.z, g[7] = g1.w;
    if (hat.data != nullptr) {
      const Pack<T, 8> in = load_pack<T, 8>(hat.at<const T>(l.b, l.at, l.h) + 8 * l.sub);
#pragma unroll
      for (int j = 0; j < 8; ++j) x[j] = widen(in.v[j]);
    }
  }
  Pack<T, 8> y;
  if (hat.data == nullptr) {  // the same for the whole grid
    if (!l.valid) return;
#pragma unroll
    for (int j = 0; j < 8; ++j) y.v[j] = narrow_to<T>(g[j]);
  } else {
    float dot = 0.f;
#pragma unroll
    for (int j = 0; j < 8; ++j) dot += x[j] * g[j];
    dot = tile::lanes_sum<kLanes>(dot);
    if (!l.valid) return;
    const float inv = inv_norm[l.idx];
#pragma unroll
    for (int j = 0; j < 8; ++j) y.v[j] = narrow_to<T>(math::normalize_grad(g[j], x[j], dot, fabsf(inv), inv < 0.f));
  }
  store_pack<T, 8>(out.at<T>(l.b, l.at, l.h) + 8 * l.sub, y);
}

// dbeta and dlambda from their per-head fp32 sums, into the caller's per-head (or shared) tensors.
// A block per query head: its parts of dbeta and of sum dP w2 summed in a fixed order (each
// thread a fixed stride, then a fixed tree), into the per-head sums store_head_grads_kernel reads.
__global__ void sum_head_parts_kernel(const float* beta_parts, const float* lambda_parts, std::int64_t per_head,
                                      float* dbeta_sum, float* lambda_dot) {
  constexpr int kThreads = 256;
  using Reduce = cub::BlockReduce<float, kThreads>;
  __shared__ typename Reduce::TempStorage storage;
  const std::int64_t h = blockIdx.x;
  float beta = 0.f, lambda = 0.f;
  for (std::int64_t i = threadIdx.x; i < per_head; i += kThreads) {
    beta += beta_parts[h * per_head + i];
    if (lambda_parts != nullptr) lambda += lambda_parts[h * per_head + i];
  }
  const float beta_total = Reduce(storage).Sum(beta);
  __syncthreads();
  const float lambda_total = Reduce(storage).Sum(lambda);
  if (threadIdx.x == 0) {
    dbeta_sum[h] = beta_total;
    if (lambda_parts != nullptr) lambda_dot[h] = lambda_total;
  }
}

__global__ void store_head_grads_kernel(const float* dbeta_sum, const float* lambda_dot, const ThresholdConfig cfg,
                                        std::int64_t heads) {
  if (threadIdx.x != 0 || blockIdx.x != 0) return;
  float beta_total = 0.f, lambda_total = 0.f;
  for (std::int64_t h = 0; h < heads; ++h) {
    const float db = dbeta_sum[h];
    if (cfg.dbeta.head != 0) static_cast<float*>(cfg.dbeta.data)[h * cfg.dbeta.head] = db;
    beta_total += db;
    if (lambda_dot != nullptr) {
      const float dl = -lambda_dot[h] * mt::lambda_slope(cfg.lambda_at<float>(h), cfg.clamp_lambda);
      if (cfg.dlambda.head != 0) static_cast<float*>(cfg.dlambda.data)[h * cfg.dlambda.head] = dl;
      lambda_total += dl;
    }
  }
  if (cfg.dbeta.head == 0) *static_cast<float*>(cfg.dbeta.data) = beta_total;
  if (lambda_dot != nullptr && cfg.dlambda.head == 0) *static_cast<float*>(cfg.dlambda.data) = lambda_total;
}

unsigned warp_blocks(const RowGeometry& r) {
  return static_cast<unsigned>((r.rows * r.heads + kWarpsPerBlock - 1) / kWarpsPerBlock);
}

// packed(lanes) where the packed kernels take rows r of `rows` (packed_rows_apply, aligned_rows),
// else plain(). The packed kernels are instantiated for the 16-bit types only, the only ones
// they take.
template <class T, class Packed, class Plain>
void launch_rows(const RowGeometry& r, const Operand& rows, DType dtype, Packed&& packed, Plain&& plain) {
  if constexpr (sizeof(T) == 2) {
    if (packed_rows_apply<T>(r) && aligned_rows(rows, dtype)) {
      with_packed_lanes(r.dim, packed);
      return;
    }
  }
  plain();
}

// x / max(|x|, eps) of every row of src into dst (contiguous), the signed inverse norms into inv.
template <class T>
void normalize_rows(const Operand& src, const Operand& dst, float* inv, const RowGeometry& r, float eps,
                    DType dtype, cudaStream_t stream) {
  if (r.rows * r.heads == 0) return;
  launch_rows<T>(
      r, src, dtype,
      [&](auto lanes) {
        normalize_rows_packed_kernel<T, decltype(lanes)::value>
            <<<packed_blocks(r), 32 * kWarpsPerBlock, 0, stream>>>(src, dst, inv, r, eps);
      },
      [&] { normalize_rows_kernel<T><<<warp_blocks(r), 32 * kWarpsPerBlock, 0, stream>>>(src, dst, inv, r, eps); });
  check_launch("threshold normalize_rows_kernel");
}

// out from the fp32 rows g_hat: through the normalization of hat (inv: its signed inverse
// norms), or stored as they are when hat.data is null.
template <class T>
void store_grad_rows(const float* g_hat, const Operand& hat, const float* inv, const Operand& out,
                     const RowGeometry& r, DType dtype, cudaStream_t stream) {
  if (r.rows * r.heads == 0) return;
  launch_rows<T>(
      r, out, dtype,
      [&](auto lanes) {
        store_grad_rows_packed_kernel<T, decltype(lanes)::value>
            <<<packed_blocks(r), 32 * kWarpsPerBlock, 0, stream>>>(g_hat, hat, inv, out, r);
      },
      [&] {
        store_grad_rows_kernel<T><<<warp_blocks(r), 32 * kWarpsPerBlock, 0, stream>>>(g_hat, hat, inv, out, r);
      });
  check_launch("threshold store_grad_rows_kernel");
}

// What the simple kernels need beyond the attention operands (p.q, p.k: the first view's
// normalized rows).
struct SimpleThreshold {
  ThresholdCudaConfig view;  // power, dim, beta, lambda (TDA)
  Operand q2_hat, k2_hat;    // TDA
  Operand nonzero;           // int32 per query row; data == nullptr: not counted
  // Backward: fp32 [batch row][head][dim] accumulators of dL/dq_hat, dL/dk_hat per view and
  // of dv, and the parts of dbeta and of sum dP w2, one slot per (query head, sequence) at
  // [head][parts_per_head] (ThresholdCudaConfig's layout, summed in the same fixed order).
  float* dq_hat[2] = {nullptr, nullptr};
  float* dk_hat[2] = {nullptr, nullptr};
  float* dv = nullptr;
  float* beta_parts = nullptr;
  float* lambda_parts = nullptr;
  std::int64_t parts_per_head = 0;
};

// Forward: a warp per query row; each lane takes keys base + lane, scores both views, then the
// warp adds the weighted values one key at a time (skipping exact zeros).
template <class T>
__global__ void simple_forward_kernel(const detail::AttentionParams p, const SimpleThreshold x) {
  extern __shared__ float smem[];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int D = static_cast<int>(p.dim_qk), DV = static_cast<int>(p.dim_v);
  float* q1 = smem + warp * (2 * D + DV);
  float* q2 = q1 + D;
  float* o = q2 + D;
  const std::int64_t b = blockIdx.z, h = blockIdx.y, hk = p.kv_head(h);
  const detail::SequenceExtent s = p.sequence(b);
  const std::int64_t r = static_cast<std::int64_t>(blockIdx.x) * simple::kRowsPerBlock + warp;
  if (r >= s.q_len) return;
  const bool tda = x.view.lambda != nullptr;
  const std::int64_t row = s.q_start + r;
  for (int d = lane; d < D; d += 32) {
    q1[d] = simple::load(p.q.at<const T>(b, row, h) + d);
    q2[d] = tda ? simple::load(x.q2_hat.at<const T>(b, row, h) + d) : 0.f;
  }
  for (int d = lane; d < DV; d += 32) o[d] = 0.f;
  __syncwarp();
  const std::int64_t limit = simple::row_limit(p, s, r);
  const float tau = x.view.beta[h * x.view.beta_head] * x.view.unit(limit);
  const float lambda = tda ? -x.view.factor(h) : 0.f;
  const float power = x.view.power;
  int kept = 0;
  for (std::int64_t base = 0; base <= limit; base += 32) {
    const std::int64_t key = base + lane;
    float w = 0.f;
    if (key <= limit) {
      const float w1 = mt::weight(simple::dot_row(q1, p.k.at<const T>(b, s.k_start + key, hk), 1, D) - tau, power);
      float w2 = 0.f;
      if (tda) w2 = mt::weight(simple::dot_row(q2, x.k2_hat.at<const T>(b, s.k_start + key, hk), 1, D) - tau, power);
      kept += (w1 != 0.f || w2 != 0.f) ? 1 : 0;
      w = w1 - lambda * w2;
    }
    for (int j = 0; j < 32; ++j) {
      const float wj = __shfl_sync(0xffffffffu, w, j);
      if (wj == 0.f) continue;
      const T* v = p.v.at<const T>(b, s.k_start + base + j, hk);
      for (int d = lane; d < DV; d += 32) o[d] += wj * simple::load(v + d * p.v.dim);
    }
  }
  for (int off = 16; off > 0; off /= 2) kept += __shfl_xor_sync(0xffffffffu, kept, off);
  T* out = p.out.at<T>(b, row, h);
  for (int d = lane; d < DV; d += 32) out[d * p.out.dim] = simple::from_float<T>(o[d]);
  if (lane == 0 && x.nonzero.data != nullptr) *x.nonzero.at<std::int32_t>(b, row, h) = kept;
}

// Backward: a block per (sequence, kv head) walks the group's query rows in order, a thread per
// key, so the fp32 key accumulators need no atomics.
template <class T>
__global__ void __launch_bounds__(simple::kBackwardThreads)
    simple_backward_kernel(const detail::AttentionParams p, const detail::GradientParams g, const SimpleThreshold x) {
  constexpr int kThreads = simple::kBackwardThreads;
  using Reduce = cub::BlockReduce<float, kThreads>;
  __shared__ typename Reduce::TempStorage reduce_storage;
  extern __shared__ float smem[];
  const int D = static_cast<int>(p.dim_qk), DV = static_cast<int>(p.dim_v);
  float* q1 = smem;
  float* q2 = q1 + D;
  float* dout = q2 + D;
  float* ds1_of = dout + DV;
  float* ds2_of = ds1_of + kThreads;
  const int t = threadIdx.x;
  const std::int64_t b = blockIdx.y, hk = blockIdx.x;
  const detail::SequenceExtent s = p.sequence(b);
  const bool tda = x.view.lambda != nullptr;
  const float power = x.view.power;

  for (std::int64_t h = hk * p.group_size(); h < (hk + 1) * p.group_size(); ++h) {
    const float beta = x.view.beta[h * x.view.beta_head];
    const float factor2 = tda ? x.view.factor(h) : 0.f;  // -lambda
    float beta_part = 0.f, lambda_part = 0.f;
    for (std::int64_t r = 0; r < s.q_len; ++r) {
      const std::int64_t row = s.q_start + r;
      for (int d = t; d < D; d += kThreads) {
        q1[d] = simple::load(p.q.at<const T>(b, row, h) + d);
        q2[d] = tda ? simple::load(x.q2_hat.at<const T>(b, row, h) + d) : 0.f;
      }
      for (int d = t; d < DV; d += kThreads) dout[d] = simple::load(g.dout.at<const T>(b, row, h) + d * g.dout.dim);
      __syncthreads();
      const std::int64_t limit = simple::row_limit(p, s, r);
      const float unit = x.view.unit(limit), tau = beta * unit;
      float* dq1 = x.dq_hat[0] + (p.batch_row_q(b, row) * p.heads_q + h) * D;
      float* dq2 = tda ? x.dq_hat[1] + (p.batch_row_q(b, row) * p.heads_q + h) * D : nullptr;
      for (int d = t; d < D; d += kThreads) {
        dq1[d] = 0.f;
        if (tda) dq2[d] = 0.f;
      }
      for (std::int64_t base = 0; base <= limit; base += kThreads) {
        const std::int64_t key = base + t;
        float ds1 = 0.f, ds2 = 0.f;
        if (key <= limit) {
          const T* k1 = p.k.at<const T>(b, s.k_start + key, hk);
          const float dp = simple::dot_row(dout, p.v.at<const T>(b, s.k_start + key, hk), p.v.dim, DV);
          const float x1 = simple::dot_row(q1, k1, 1, D) - tau;
          const float w1 = mt::weight(x1, power);
          ds1 = dp * mt::weight_slope(x1, power);
          float w2 = 0.f;
          if (tda) {
            const float x2 = simple::dot_row(q2, x.k2_hat.at<const T>(b, s.k_start + key, hk), 1, D) - tau;
            w2 = mt::weight(x2, power);
            ds2 = factor2 * dp * mt::weight_slope(x2, power);
            lambda_part += dp * w2;
          }
          beta_part -= (ds1 + ds2) * unit;
          const std::int64_t key_row = (p.batch_row_k(b, s.k_start + key) * p.heads_kv + hk);
          float* dk1 = x.dk_hat[0] + key_row * D;
          for (int d = 0; d < D; ++d) dk1[d] += ds1 * q1[d];
          if (tda) {
            float* dk2 = x.dk_hat[1] + key_row * D;
            for (int d = 0; d < D; ++d) dk2[d] += ds2 * q2[d];
          }
          const float w = w1 + factor2 * w2;
          float* dv = x.dv + key_row * DV;
          if (w != 0.f) {
            for (int d = 0; d < DV; ++d) dv[d] += w * dout[d];
          }
        }
        ds1_of[t] = ds1;
        ds2_of[t] = ds2;
        __syncthreads();
        // dq_hat += sum over the chunk's keys of ds k_hat, a feature per thread, keys in order.
        for (int d = t; d < D; d += kThreads) {
          float a1 = dq1[d], a2 = tda ? dq2[d] : 0.f;
          for (int j = 0; j < kThreads && base + j <= limit; ++j) {
            const std::int64_t kj = s.k_start + base + j;
            a1 += ds1_of[j] * simple::load(p.k.at<const T>(b, kj, hk) + d);
            if (tda) a2 += ds2_of[j] * simple::load(x.k2_hat.at<const T>(b, kj, hk) + d);
          }
          dq1[d] = a1;
          if (tda) dq2[d] = a2;
        }
        __syncthreads();
      }
    }
    const float beta_total = Reduce(reduce_storage).Sum(beta_part);
    __syncthreads();
    const float lambda_total = Reduce(reduce_storage).Sum(lambda_part);
    __syncthreads();
    // One block per (kv head, sequence) owns this slot.
    if (t == 0) {
      x.beta_parts[h * x.parts_per_head + b] = beta_total;
      if (tda) x.lambda_parts[h * x.parts_per_head + b] = lambda_total;
    }
  }
}

// The key-stationary backward's row statistics: tau_j and tau_j / beta per (query head,
// sequence, padded row), a thread per row.
__global__ void threshold_keys_row_stats_kernel(const AttentionParams p, const KeysBackwardBuffers buf,
                                                const ThresholdCudaConfig cfg) {
  const std::int64_t r = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const std::int64_t h = blockIdx.y, b = blockIdx.z;
  if (r >= buf.padded_len) return;
  const SequenceExtent seq = p.sequence(b);
  float tau = INFINITY, unit = 0.f;
  if (r < seq.q_len) {
    const std::int64_t last = p.last_visible_key(r + seq.q_offset());
    unit = cfg.unit(last < seq.k_len - 1 ? last : seq.k_len - 1);
    tau = cfg.beta[h * cfg.beta_head] * unit;
  }
  buf.row_stats[0][buf.row_index(p, h, b, r)] = tau;
  buf.row_stats[1][buf.row_index(p, h, b, r)] = unit;
}

// One view's normalized queries and keys.
struct ViewRows {
  Operand q_hat, k_hat;
  float* q_inv = nullptr;
  float* k_inv = nullptr;
};

// Every view's normalized rows, laid out as the saved rows (winnow/threshold.h): in the
// caller's record where the config has one (the forward fills it; a backward reads it and
// normalizes nothing), else in scratch from the caller's allocator. With a record, also its
// support map (TileSupport), which the Hopper forward marks and the key-stationary backward reads.
class NormalizedViews {
 public:
  NormalizedViews(const detail::AttentionParams& p, const ThresholdConfig& cfg)
      : views_(cfg.differential() ? 2 : 1),
        q_(query_rows(p)),
        k_(key_rows(p, static_cast<int>(p.dim_qk))),
        buffer_(p, cfg.saved_rows != nullptr
                       ? 0
                       : 4 * static_cast<std::size_t>(threshold::saved_rows_size<std::int64_t>(
                                 q_.rows * q_.heads, k_.rows * k_.heads, q_.dim,
                                 static_cast<std::int64_t>(element_size(p.dtype)), views_, 0))) {
    auto* base = static_cast<unsigned char*>(cfg.saved_rows != nullptr ? cfg.saved_rows : buffer_.as<void>());
    const auto segment = [&](std::int64_t bytes) {
      unsigned char* at = base;
      const std::int64_t padded = threshold::saved_rows_segment_bytes<std::int64_t>(bytes);
      if (padded > bytes) padding_.push_back({at + bytes, static_cast<std::size_t>(padded - bytes)});
      base += padded;
      return at;
    };
    const std::int64_t element = static_cast<std::int64_t>(element_size(p.dtype));
    for (int v = 0; v < views_; ++v) {
      ViewRows& vr = rows_[v];
      vr.q_hat = contiguous(segment(q_.rows * q_.heads * q_.dim * element), q_);
      vr.k_hat = contiguous(segment(k_.rows * k_.heads * k_.dim * element), k_);
      vr.q_inv = reinterpret_cast<float*>(segment(q_.rows * q_.heads * 4));
      vr.k_inv = reinterpret_cast<float*>(segment(k_.rows * k_.heads * 4));
    }
    if (cfg.saved_rows != nullptr) {
      const std::int64_t key_len = p.key_len_bound();
      support_bytes_ = 4 * static_cast<std::size_t>(
                               threshold::saved_support_words<std::int64_t>(p.num_seqs, p.heads_q, p.rows_q, key_len));
      support_.flag = reinterpret_cast<int*>(base);
      support_.bits = reinterpret_cast<std::uint32_t*>(base) + 64;
      support_.row_tiles = threshold::saved_support_row_tiles<std::int64_t>(p.num_seqs, p.rows_q);
      support_.words = static_cast<int>(threshold::saved_support_row_words<std::int64_t>(key_len));
    }
  }

  template <class T>
  void compute(const detail::AttentionParams& p, const ThresholdConfig& cfg) {
    const float eps = static_cast<float>(cfg.norm_eps);
    for (int v = 0; v < views_; ++v) {
      ViewRows& vr = rows_[v];
      const Operand& q_src = v == 0 ? p.q : cfg.q2;
      const Operand& k_src = v == 0 ? p.k : cfg.k2;
      normalize_rows<T>(q_src, vr.q_hat, vr.q_inv, q_, eps, p.dtype, stream_of(p));
      normalize_rows<T>(k_src, vr.k_hat, vr.k_inv, k_, eps, p.dtype, stream_of(p));
    }
  }
  // A forward keeping the saved rows writes every byte of the record: the normalization passes
  // its rows, this the padding between segments (none where each segment's size is a multiple of
  // 256 bytes) and the support map, which a Hopper forward then marks (its flag stays 0 on every
  // other path: the backward visits every tile), so that the record is a function of the inputs.
  void clear_padding_and_support(const detail::AttentionParams& p) const {
    for (const Padding& pad : padding_) {
      check(cudaMemsetAsync(pad.at, 0, pad.bytes, stream_of(p)), "clearing the saved rows' padding");
    }
    if (support_bytes_ > 0) {
      check(cudaMemsetAsync(support_.flag, 0, support_bytes_, stream_of(p)), "clearing the saved support map");
    }
  }
  // The record's support map; bits == nullptr without a record.
  const TileSupport& support() const { return support_; }
  // The map for a forward to record: none where tile skipping is off (WINNOW_DENSE_KEY_TILES; the
  // flag then stays 0 and the backward sweeps every tile).
  TileSupport support_to_record(const detail::AttentionParams& p) const {
    return key_tile_skipping_enabled(p) ? support_ : TileSupport{};
  }
  // The backward's rows: the saved ones where the call has them, else computed.
  template <class T>
  void compute_unless_saved(const detail::AttentionParams& p, const ThresholdConfig& cfg) {
    if (cfg.saved_rows == nullptr) compute<T>(p, cfg);
  }
  // The forward's rows for the screen: the keys normalized (as compute writes them) and quantized
  // into `screen`'s int8 tiles and bounds; the queries, which the screen normalizes itself, named.
  template <class T>
  void compute_screened(const detail::AttentionParams& p, const ThresholdConfig& cfg, ThresholdScreenParams& screen) {
    const float eps = static_cast<float>(cfg.norm_eps);
    screen.eps = eps;
    for (int v = 0; v < views_; ++v) {
      const Operand& q_src = v == 0 ? p.q : cfg.q2;
      const Operand& k_src = v == 0 ? p.k : cfg.k2;
      screen.q_hat[v] = rows_[v].q_hat;
      screen.k_hat[v] = rows_[v].k_hat;
      screen.queries[v] = q_src;
      screen.q_inv[v] = rows_[v].q_inv;
      const dim3 grid(static_cast<unsigned>(screen.key_tiles), static_cast<unsigned>(p.heads_kv),
                      static_cast<unsigned>(p.num_seqs));
      if (grid.x > 0 && grid.y > 0 && grid.z > 0) {
        with_packed_lanes(k_.dim, [&](auto lanes) {
          normalize_quantize_key_tiles_kernel<T, decltype(lanes)::value / kWideLanes>
              <<<grid, 32 * kKeyTileWarps, 0, stream_of(p)>>>(
              p, k_src, rows_[v].k_hat, rows_[v].k_inv, screen.k8[v], screen.tile_meta[v], screen.key_tiles, eps);
        });
        check_launch("threshold normalize_quantize_key_tiles_kernel");
      }
    }
  }
  const ViewRows& view(int v) const { return rows_[v]; }
  int count() const { return views_; }
  const RowGeometry& queries() const { return q_; }
  const RowGeometry& keys() const { return k_; }

 private:
  int views_;
  RowGeometry q_, k_;
  struct Padding {
    unsigned char* at;
    std::size_t bytes;
  };
  DeviceBuffer buffer_;
  ViewRows rows_[2];
  std::vector<Padding> padding_;
  TileSupport support_;
  std::size_t support_bytes_ = 0;
};

ThresholdCudaConfig view_config(const detail::AttentionParams& p, const ThresholdConfig& cfg, int view) {
  ThresholdCudaConfig c;
  c.power = static_cast<float>(cfg.power);
  c.dim = static_cast<float>(p.dim_qk);
  c.beta = static_cast<const float*>(cfg.beta.data);
  c.beta_head = cfg.beta.head;
  c.clamp_lambda = cfg.clamp_lambda;
  if (view == 1) {
    c.lambda = static_cast<const float*>(cfg.lambda.data);
    c.lambda_head = cfg.lambda.head;
    c.add_to_output = true;
  }
  return c;
}

// The attention operands of one view: its normalized queries and keys, unit scale.
detail::AttentionParams view_params(const detail::AttentionParams& p, const ViewRows& v) {
  detail::AttentionParams pv = p;
  pv.q = v.q_hat;
  pv.k = v.k_hat;
  pv.scale = 1.0;
  return pv;
}

bool fused_applies(const detail::AttentionParams& p, const ThresholdConfig& cfg, const detail::GradientParams* g) {
  if (g == nullptr && cfg.nonzero.data != nullptr) return false;  // counts come from the simple path
  detail::AttentionParams check = p;
  if (g != nullptr) check.out = check.q;  // the backward writes no output
  if (!fused_path_applies(check, g)) return false;
  if (g != nullptr && cfg.differential()) {
    detail::GradientParams g2 = *g;
    g2.dq = cfg.dq2;
    return fused_path_applies(check, &g2);
  }
  return true;
}

// TDA on Hopper: both views in one launch (ThresholdTwoViewRows), the output written once;
// WINNOW_THRESHOLD_VIEW_LAUNCHES=1 runs a launch per view instead, for comparison. Elsewhere,
// and for TRA, a launch per view.
template <class T, int D>
void fused_forward(const detail::AttentionParams& p, const ThresholdConfig& cfg, const NormalizedViews& views) {
  static const bool view_launches = std::getenv("WINNOW_THRESHOLD_VIEW_LAUNCHES") != nullptr;
  if (views.count() == 2 && !view_launches) {
    ThresholdCudaConfig c = view_config(p, cfg, 1);
    c.add_to_output = false;
    c.q2_hat = views.view(1).q_hat;
    c.k2_hat = views.view(1).k_hat;
    c.support = views.support_to_record(p);
    if (launch_sm90_forward<T, D, ThresholdTwoViewRows>(view_params(p, views.view(0)), c, LiveKeyTiles{})) return;
  }
  for (int v = 0; v < views.count(); ++v) {
    ThresholdCudaConfig c = view_config(p, cfg, v);
    c.support = views.support_to_record(p);
    launch_fused_forward<T, D, ThresholdRows>(view_params(p, views.view(v)), c);
  }
}

// The screen's scratch: per view the int8 query rows and key tiles and their bounds, the dense /
// live tile bits (cleared), and per row group its candidates and their count (cleared), carved
// from one buffer of the caller's allocator.
class ScreenBuffer {
 public:
  ScreenBuffer(const detail::AttentionParams& p, int views)
      : tiles_(static_cast<std::size_t>(p.num_seqs * p.heads_kv) * static_cast<std::size_t>(map_cells(p))),
        dense_words_(static_cast<std::size_t>(p.num_seqs * p.heads_q) * static_cast<std::size_t>(row_groups(p)) *
                     static_cast<std::size_t>(map_words(p))),
        live_words_(map_blocks(p) * static_cast<std::size_t>(map_words(p))),
        per_view_(aligned(tiles_ * kScreenTileBytes) + aligned(tiles_ * sizeof(float2))),
        bits_(aligned((dense_words_ + live_words_) * sizeof(std::uint32_t))),
        groups_(static_cast<std::size_t>(p.num_seqs * p.heads_q) * static_cast<std::size_t>(row_groups(p))),
        items_(map_blocks(p)),
        counts_(aligned((groups_ + 1 + items_) * sizeof(int))),
        lists_(aligned(items_ * sizeof(int4))),
        buffer_(p, views * per_view_ + bits_ + counts_ + lists_ + groups_ * kGroupCandidates * sizeof(std::uint32_t)) {
    auto* base = buffer_.as<unsigned char>();
    for (int v = 0; v < views; ++v) {
      params_.k8[v] = reinterpret_cast<std::int8_t*>(base);
      base += aligned(tiles_ * kScreenTileBytes);
      params_.tile_meta[v] = reinterpret_cast<float2*>(base);
      base += aligned(tiles_ * sizeof(float2));
    }
    params_.key_tiles = map_cells(p);
    params_.dense.words = map_words(p);
    params_.dense.row_groups = row_groups(p);
    params_.q_blocks = map_query_blocks(p);
    params_.dense.bits = reinterpret_cast<std::uint32_t*>(base);
    params_.live_bits = params_.dense.bits + dense_words_;
    // Cleared: the candidate counts, the listed blocks' count, the items' marks. Then the listed
    // blocks and the candidates' lists.
    params_.candidate_counts = reinterpret_cast<int*>(base + bits_);
    params_.groups = static_cast<int>(groups_);
    params_.listed_block_count = params_.candidate_counts + groups_;
    params_.item_marks = params_.listed_block_count + 1;
    params_.listed_blocks = reinterpret_cast<int4*>(base + bits_ + counts_);
    params_.candidates = reinterpret_cast<std::uint32_t*>(base + bits_ + counts_ + lists_);
    if (bits_ + counts_ > 0) {
      check(cudaMemsetAsync(base, 0, bits_ + counts_, stream_of(p)), "clearing the screen's tile bits and counts");
    }
  }
  ThresholdScreenParams& params() { return params_; }
  LiveKeyTiles live() const { return {params_.live_bits, params_.q_blocks, params_.dense.words}; }

  // Row groups per (sequence, head): whole blocks' worth, as the kernels address them.
  static int row_groups(const detail::AttentionParams& p) {
    return map_query_blocks(p) * (kCellRows / kScreenGroupRows);
  }

 private:
  static std::size_t aligned(std::size_t bytes) { return (bytes + 255) / 256 * 256; }
  std::size_t tiles_, dense_words_, live_words_, per_view_, bits_, groups_, items_, counts_, lists_;
  DeviceBuffer buffer_;
  ThresholdScreenParams params_;
};

// A launch's block count: `blocks`, or the environment variable `name` where set (at least 1;
// read per call, so that tests can give each of the candidate pass's persistent blocks many
// row groups).
inline std::int64_t blocks_or_env(const char* name, std::int64_t blocks) {
  if (const char* v = std::getenv(name)) return std::max<std::int64_t>(1, std::atoll(v));
  return blocks;
}

template <class T, int D, int Views>
void launch_screen(const detail::AttentionParams& p, const ThresholdScreenParams& sp) {
  using Shape = Sm90ScreenShape;
  const dim3 grid(static_cast<unsigned>((p.max_len_q + Shape::kBQ - 1) / Shape::kBQ),
                  static_cast<unsigned>(p.heads_q), static_cast<unsigned>(p.num_seqs));
  if (grid.x == 0 || grid.z == 0) return;
  // A block an item (the query tiles of the grid above, ScreenItems), two a multiprocessor.
  const std::int64_t items = static_cast<std::int64_t>(grid.x) * grid.y * grid.z;
  auto kernel = threshold_screen_sm90_kernel<T, D, Views>;
  const int smem = Sm90ScreenSmem<Views>::kBytes;
  allow_shared_memory(kernel, smem);
  kernel<<<static_cast<unsigned>(items), Shape::kThreads, smem, stream_of(p)>>>(p, sp);
  check_launch("threshold_screen_sm90_kernel");
  // The candidate pass: as many blocks as fit on the device at once, or as the row groups need.
  auto candidates = threshold_candidates_kernel<T, D, Views>;
  static const int per_multiprocessor = [&] {
    int n = 0;
    check(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, candidates, 32 * kCandidateWarps, 0),
          "sizing the candidate pass");
    return std::max(n, 1);
  }();
  const std::int64_t candidate_blocks = blocks_or_env(
      "WINNOW_CANDIDATE_BLOCKS", std::min<std::int64_t>((sp.groups + kCandidateWarps - 1) / kCandidateWarps,
                                                        multiprocessors() * per_multiprocessor));
  candidates<<<static_cast<unsigned>(candidate_blocks), 32 * kCandidateWarps, 0, stream_of(p)>>>(p, sp);
  check_launch("threshold_candidates_kernel");
}

// The screen is opt-in (WINNOW_THRESHOLD_SCREEN set, WINNOW_DENSE_KEY_TILES not): on the H200
// (bench/gpu_threshold_bench.py, docs/performance.md) it makes the forward at beta = 1 on random
// inputs 1.5x (TRA) and 1.55x (TDA) faster at L = 16384 than the unscreened forward with its vote
// on the scores, and 1.05x at 4K (session 89), but the one at beta = 0 28-38% slower (TRA, 16K
// and 4K, session 85), and which one a model meets is known only from its data (beta is a device
// tensor: choosing per call would cost a synchronization).
// The candidates' list entries hold a key in 28 bits (key << 4 | row, threshold_screen_sm90.cuh):
// longer key sequences take the unscreened forward.
constexpr std::int64_t kScreenMaxKeys = std::int64_t{1} << 28;
bool screen_requested(const detail::AttentionParams& p) {
  return std::getenv("WINNOW_THRESHOLD_SCREEN") != nullptr && key_tile_skipping_enabled(p) &&
         p.max_len_k < kScreenMaxKeys;
}

// The screened forward where it runs (Hopper, requested): the screen lists the candidates and
// the dense tiles, the candidate pass writes the output's sparse part, then each view's fused
// forward adds the dense tiles'.
template <class T, int D>
bool screened_forward(const detail::AttentionParams& p, const ThresholdConfig& cfg, NormalizedViews& views) {
  if (!screen_requested(p) || !hopper_kernel_runs(threshold_screen_sm90_kernel<T, D, 1>)) return false;
  // The normalization reads eight features (16 bytes) at once from the raw rows (the first
  // view's are aligned on the fused path).
  if (cfg.differential() && (!aligned_rows(cfg.q2, p.dtype) || !aligned_rows(cfg.k2, p.dtype))) return false;
  ScreenBuffer screen(p, views.count());
  ThresholdScreenParams& sp = screen.params();
  views.compute_screened<T>(p, cfg, sp);
  sp.view = view_config(p, cfg, views.count() - 1);
  sp.view.support = views.support_to_record(p);
  const detail::AttentionParams first = view_params(p, views.view(0));
  const bool stats = std::getenv("WINNOW_SCREEN_STATS") != nullptr;
  DeviceBuffer counters(p, stats ? 4 * sizeof(unsigned long long) : 0);
  if (stats) {
    sp.stats = counters.as<unsigned long long>();
    check(cudaMemsetAsync(sp.stats, 0, 4 * sizeof(unsigned long long), stream_of(p)), "clearing the screen's counters");
  }
  if (views.count() == 2) {
    launch_screen<T, D, 2>(first, sp);
  } else {
    launch_screen<T, D, 1>(first, sp);
  }
  if (stats) {
    unsigned long long c[4];
    check(cudaMemcpyAsync(c, sp.stats, sizeof(c), cudaMemcpyDeviceToHost, stream_of(p)), "reading the screen's counters");
    check(cudaStreamSynchronize(stream_of(p)), "reading the screen's counters");
    std::fprintf(stderr, "winnow screen: %llu warp tiles, %llu dense, %llu with candidates handled, %llu candidates\n",
                 c[0], c[1], c[2], c[3]);
  }
  for (int v = 0; v < views.count(); ++v) {
    ThresholdCudaConfig c = view_config(p, cfg, v);
    c.add_to_output = true;
    c.dense = sp.dense;
    c.listed_blocks = sp.listed_blocks;
    c.listed_block_count = sp.listed_block_count;
    c.support = views.support_to_record(p);
    launch_fused_forward<T, D, ScreenedThresholdRows>(view_params(p, views.view(v)), c, screen.live());
  }
  return true;
}

template <class T>
void simple_forward(const detail::AttentionParams& p, const ThresholdConfig& cfg, const NormalizedViews& views) {
  SimpleThreshold x;
  x.view = view_config(p, cfg, cfg.differential() ? 1 : 0);
  x.nonzero = cfg.nonzero;
  if (cfg.differential()) {
    x.q2_hat = views.view(1).q_hat;
    x.k2_hat = views.view(1).k_hat;
  }
  const dim3 grid(static_cast<unsigned>((p.max_len_q + simple::kRowsPerBlock - 1) / simple::kRowsPerBlock),
                  static_cast<unsigned>(p.heads_q), static_cast<unsigned>(p.num_seqs));
  if (grid.x == 0 || grid.z == 0) return;
  const int smem = static_cast<int>(simple::kRowsPerBlock * (2 * p.dim_qk + p.dim_v) * sizeof(float));
  auto kernel = simple_forward_kernel<T>;
  allow_shared_memory(kernel, smem);
  kernel<<<grid, 32 * simple::kRowsPerBlock, smem, stream_of(p)>>>(view_params(p, views.view(0)), x);
  check_launch("threshold simple_forward_kernel");
}

// fp32 scratch of a backward: dk_hat per view, dv, the fused kernels' order counters and the
// per-head sums; cleared.
struct BackwardScratch {
  float* dk_hat[2] = {nullptr, nullptr};
  float* dv = nullptr;
  float* dq_hat[2] = {nullptr, nullptr};  // simple path only
  int* order[2] = {nullptr, nullptr};
  float* dbeta = nullptr;
  float* lambda_dot = nullptr;
  // The row and simple paths' parts of those two, [head][parts_per_head] (ThresholdCudaConfig).
  float* beta_parts = nullptr;
  float* lambda_parts = nullptr;
  std::int64_t parts_per_head = 0;
};

class BackwardBuffer {
 public:
  // Every segment a multiple of four floats: the fused kernels add into dk and dv 16 bytes at a time.
  static std::size_t aligned(std::size_t n) { return (n + 3) / 4 * 4; }
  // with_key_sums: the fp32 dk_hat and dv accumulators and the per-head parts (the row and
  // simple paths; not for the key-stationary backward, which stores dk and dv itself and adds
  // its per-head sums by atomics, in the atomic mode only).
  BackwardBuffer(const detail::AttentionParams& p, int views, bool with_dq, bool with_key_sums,
                 std::size_t order_per_view)
      : dk_(with_key_sums ? aligned(static_cast<std::size_t>(p.rows_k * p.heads_kv * p.dim_qk)) : 0),
        dv_(with_key_sums ? aligned(static_cast<std::size_t>(p.rows_k * p.heads_kv * p.dim_v)) : 0),
        dq_(with_dq ? aligned(static_cast<std::size_t>(p.rows_q * p.heads_q * p.dim_qk)) : 0),
        order_(aligned(order_per_view)),
        heads_(aligned(static_cast<std::size_t>(p.heads_q))),
        per_head_(with_key_sums ? std::max<std::int64_t>(p.rows_q, p.num_seqs) : 0),
        parts_(aligned(static_cast<std::size_t>(p.heads_q * per_head_))),
        floats_(views * (dk_ + dq_ + order_) + dv_ + 2 * heads_ + 2 * parts_),
        buffer_(p, floats_ * sizeof(float)) {
    float* at = buffer_.as<float>();
    if (floats_ > 0) check(cudaMemsetAsync(at, 0, floats_ * sizeof(float), stream_of(p)), "clearing accumulators");
    for (int v = 0; v < views; ++v) {
      s_.dk_hat[v] = with_key_sums ? at : nullptr;
      at += dk_;
      s_.dq_hat[v] = with_dq ? at : nullptr;
      at += dq_;
      s_.order[v] = reinterpret_cast<int*>(at);
      at += order_;
    }
    s_.dv = with_key_sums ? at : nullptr;
    at += dv_;
    s_.dbeta = at;
    s_.lambda_dot = at + heads_;
    at += 2 * heads_;
    if (with_key_sums) {
      s_.beta_parts = at;
      s_.lambda_parts = at + parts_;
      s_.parts_per_head = per_head_;
    }
  }
  const BackwardScratch& scratch() const { return s_; }

 private:
  std::size_t dk_, dv_, dq_, order_, heads_;
  std::int64_t per_head_;
  std::size_t parts_, floats_;
  DeviceBuffer buffer_;
  BackwardScratch s_;
};

void store_head_grads(const detail::AttentionParams& p, const ThresholdConfig& cfg, const BackwardScratch& s) {
  store_head_grads_kernel<<<1, 32, 0, stream_of(p)>>>(s.dbeta, cfg.differential() ? s.lambda_dot : nullptr, cfg,
                                                     p.heads_q);
  check_launch("threshold store_head_grads_kernel");
}

// dq (per view) from its fp32 accumulator through the normalization.
template <class T>
void store_query_grads(const detail::AttentionParams& p, const detail::GradientParams& g, const ThresholdConfig& cfg,
                       const NormalizedViews& views, const BackwardScratch& s) {
  const RowGeometry qr = views.queries();
  if (qr.rows * qr.heads == 0) return;
  for (int v = 0; v < views.count(); ++v) {
    store_grad_rows<T>(s.dq_hat[v], views.view(v).q_hat, views.view(v).q_inv, v == 0 ? g.dq : cfg.dq2, qr, p.dtype,
                       stream_of(p));
  }
}

// dk (per view) through the normalization, dv, and the per-head gradients.
template <class T>
void store_backward(const detail::AttentionParams& p, const detail::GradientParams& g, const ThresholdConfig& cfg,
                    const NormalizedViews& views, const BackwardScratch& s) {
  const RowGeometry kr = views.keys(), vr = key_rows(p, static_cast<int>(p.dim_v));
  if (kr.rows * kr.heads > 0) {
    for (int v = 0; v < views.count(); ++v) {
      store_grad_rows<T>(s.dk_hat[v], views.view(v).k_hat, views.view(v).k_inv, v == 0 ? g.dk : cfg.dk2, kr, p.dtype,
                         stream_of(p));
    }
    store_grad_rows<T>(s.dv, Operand{}, nullptr, g.dv, vr, p.dtype, stream_of(p));
  }
  if (p.heads_q > 0) {
    sum_head_parts_kernel<<<static_cast<unsigned>(p.heads_q), 256, 0, stream_of(p)>>>(
        s.beta_parts, cfg.differential() ? s.lambda_parts : nullptr, s.parts_per_head, s.dbeta, s.lambda_dot);
    check_launch("threshold sum_head_parts_kernel");
  }
  store_head_grads(p, cfg, s);
}

// The key-stationary Hopper backward (backward_keys_sm90.cuh, ThresholdKeys): a launch per view,
// dK and dV stored by it (TDA's dV through an fp32 partial), dQ through fp32 accumulators. For
// the calls softmax's would take (keys_backward_fits) with p = 2 or 1;
// WINNOW_THRESHOLD_ROW_BACKWARD forces the row kernel, for comparison.
template <class T, int D, ThresholdPower P>
bool keys_backward(const detail::AttentionParams& p, const detail::GradientParams& g, const ThresholdConfig& cfg,
                   const NormalizedViews& views) {
  using Keys = ThresholdKeys<P>;
  if (!keys_backward_runs<T, D, Keys>()) return false;
  BackwardBuffer buffer(p, views.count(), true, false, 0);
  const BackwardScratch& s = buffer.scratch();
  KeysBackwardBuffers buf = keys_backward_buffers(p);
  buf.support = views.support();  // the forward's, with its saved rows
  const std::size_t rows = keys_backward_padded_rows(p, buf);
  // The rows' statistics, then TDA's first view's fp32 dV ([batch row][kv head][dim]).
  const std::size_t dv_floats = views.count() == 2 ? static_cast<std::size_t>(p.rows_k * p.heads_kv * p.dim_v) : 0;
  DeviceBuffer scratch(p, (2 * rows + dv_floats) * sizeof(float));
  buf.row_stats[0] = scratch.as<float>();
  buf.row_stats[1] = buf.row_stats[0] + rows;
  float* const dv_partial = buf.row_stats[1] + rows;
  const ThresholdCudaConfig c = view_config(p, cfg, 0);
  if (rows > 0) {
    constexpr int kThreads = 256;
    const dim3 grid(static_cast<unsigned>((buf.padded_len + kThreads - 1) / kThreads), static_cast<unsigned>(p.heads_q),
                    static_cast<unsigned>(p.num_seqs));
    threshold_keys_row_stats_kernel<<<grid, kThreads, 0, stream_of(p)>>>(p, buf, c);
    check_launch("threshold_keys_row_stats_kernel");
  }
  for (int v = 0; v < views.count(); ++v) {
    Keys keys;
    keys.q_hat = views.view(v).q_hat;
    keys.k_hat = views.view(v).k_hat;
    keys.k_inv = views.view(v).k_inv;
    keys.dq_hat = s.dq_hat[v];
    keys.dk = v == 0 ? g.dk : cfg.dk2;
    keys.dv_partial = dv_partial;
    keys.dv_mode = views.count() == 1 ? KeysDv::store : v == 0 ? KeysDv::write_partial : KeysDv::add_partial;
    keys.power = c.power;
    if (v == 1) {
      keys.lambda = static_cast<const float*>(cfg.lambda.data);
      keys.lambda_head = cfg.lambda.head;
      keys.clamp_lambda = cfg.clamp_lambda;
    }
    keys.dbeta = s.dbeta;
    keys.lambda_dot = s.lambda_dot;
    launch_keys_backward_kernel<T, D>(view_params(p, views.view(v)), g, buf, keys,
                                      "threshold attention_backward_keys_sm90_kernel");
  }
  store_query_grads<T>(p, g, cfg, views, s);
  store_head_grads(p, cfg, s);
  return true;
}

bool keys_backward_applies(const detail::AttentionParams& p, const detail::GradientParams& g,
                           const ThresholdConfig& cfg) {
  static const bool rows_forced = std::getenv("WINNOW_THRESHOLD_ROW_BACKWARD") != nullptr;
  if (rows_forced || !keys_backward_fits(p, g)) return false;
  if (!cfg.differential()) return true;
  // The second view applies -lambda to a block's sums over its kv head's query heads
  // (ThresholdKeys), so it needs one lambda for all of them: one query head per kv head, or a
  // shared lambda with a shared gradient (a per-head dlambda needs each head's own sum).
  const bool one_lambda = cfg.lambda.head == 0 && cfg.dlambda.head == 0;
  return (p.group_size() == 1 || one_lambda) && aligned_rows(cfg.dk2, p.dtype);
}

template <class T, int D>
void fused_backward(const detail::AttentionParams& p, const detail::GradientParams& g, const ThresholdConfig& cfg,
                    const NormalizedViews& views) {
  if (keys_backward_applies(p, g, cfg)) {
    if (cfg.power == 2.0 && keys_backward<T, D, ThresholdPower::two>(p, g, cfg, views)) return;
    if (cfg.power == 1.0 && keys_backward<T, D, ThresholdPower::one>(p, g, cfg, views)) return;
  }
  const bool sm90 = fused_backward_on_hopper<T, D, ThresholdBackwardRows<T>, ThresholdCudaConfig>();
  BackwardBuffer buffer(p, views.count(), false, true, backward_order_counters(p, sm90));
  const BackwardScratch& s = buffer.scratch();
  for (int v = 0; v < views.count(); ++v) {
    const ViewRows& rows = views.view(v);
    ThresholdCudaConfig c = view_config(p, cfg, v);
    c.q_hat = rows.q_hat;
    c.q_inv_norm = rows.q_inv;
    c.beta_parts = s.beta_parts;
    c.lambda_parts = s.lambda_parts;
    c.parts_per_head = s.parts_per_head;
    detail::GradientParams gv = g;
    if (v == 1) gv.dq = cfg.dq2;
    KeyGradAccumulators acc;
    acc.deterministic = p.deterministic;
    acc.key_tiles = backward_key_tiles(p);
    acc.dk = s.dk_hat[v];
    acc.dv = s.dv;
    acc.order = s.order[v];
    run_fused_backward<T, D, ThresholdBackwardRows<T>>(view_params(p, rows), gv, c, acc);
  }
  store_backward<T>(p, g, cfg, views, s);
}

template <class T>
void simple_backward(const detail::AttentionParams& p, const detail::GradientParams& g, const ThresholdConfig& cfg,
                     const NormalizedViews& views) {
  BackwardBuffer buffer(p, views.count(), true, true, 0);
  const BackwardScratch& s = buffer.scratch();
  SimpleThreshold x;
  x.view = view_config(p, cfg, cfg.differential() ? 1 : 0);
  if (cfg.differential()) {
    x.q2_hat = views.view(1).q_hat;
    x.k2_hat = views.view(1).k_hat;
  }
  for (int v = 0; v < 2; ++v) {
    x.dq_hat[v] = s.dq_hat[v];
    x.dk_hat[v] = s.dk_hat[v];
  }
  x.dv = s.dv;
  x.beta_parts = s.beta_parts;
  x.lambda_parts = s.lambda_parts;
  x.parts_per_head = s.parts_per_head;
  const dim3 grid(static_cast<unsigned>(p.heads_kv), static_cast<unsigned>(p.num_seqs));
  if (grid.x > 0 && grid.y > 0) {
    const int smem = static_cast<int>((2 * p.dim_qk + p.dim_v + 2 * simple::kBackwardThreads) * sizeof(float));
    auto kernel = simple_backward_kernel<T>;
    allow_shared_memory(kernel, smem);
    kernel<<<grid, simple::kBackwardThreads, smem, stream_of(p)>>>(view_params(p, views.view(0)), g, x);
    check_launch("threshold simple_backward_kernel");
  }
  store_query_grads<T>(p, g, cfg, views, s);
  store_backward<T>(p, g, cfg, views, s);
}

struct FusedForward {
  const detail::AttentionParams& p;
  const ThresholdConfig& cfg;
  NormalizedViews& views;
  template <class T, int D>
  void operator()() const {
    if (screened_forward<T, D>(p, cfg, views)) return;
    views.compute<T>(p, cfg);
    fused_forward<T, D>(p, cfg, views);
  }
};
// The rows alone: the saved rows of a forward that decoded.
struct RowsOnly {
  const detail::AttentionParams& p;
  const ThresholdConfig& cfg;
  NormalizedViews& views;
  template <class T>
  void operator()() const {
    views.compute<T>(p, cfg);
  }
};
struct SimpleForward {
  const detail::AttentionParams& p;
  const ThresholdConfig& cfg;
  NormalizedViews& views;
  template <class T>
  void operator()() const {
    views.compute<T>(p, cfg);
    simple_forward<T>(p, cfg, views);
  }
};
struct FusedBackward {
  const detail::AttentionParams& p;
  const detail::GradientParams& g;
  const ThresholdConfig& cfg;
  NormalizedViews& views;
  template <class T, int D>
  void operator()() const {
    views.compute_unless_saved<T>(p, cfg);
    fused_backward<T, D>(p, g, cfg, views);
  }
};
struct SimpleBackward {
  const detail::AttentionParams& p;
  const detail::GradientParams& g;
  const ThresholdConfig& cfg;
  NormalizedViews& views;
  template <class T>
  void operator()() const {
    views.compute_unless_saved<T>(p, cfg);
    simple_backward<T>(p, g, cfg, views);
  }
};

// A short suffix of queries (decoding) on the split-KV kernels (decode.cuh's ThresholdDecode),
// which normalize queries and keys as they read them, rather than normalizing the whole cache
// into new rows first; TDA's second view is a second pass adding into the first's output.
bool decoded_forward(const detail::AttentionParams& p, const detail::ThresholdConfig& cfg) {
  if (!fused_applies(p, cfg, nullptr) || !decode_path_applies(p)) return false;
  detail::DecodeParams d = decode_params_of(p);
  d.beta = cfg.beta;
  d.power = static_cast<float>(cfg.power);
  d.norm_eps = static_cast<float>(cfg.norm_eps);
  detail::DecodeParams second = d;
  if (cfg.differential()) {
    second.q = cfg.q2;
    second.k = {cfg.k2.data, cfg.k2.batch, cfg.k2.row, cfg.k2.head};
    if (cfg.k2.dim != 1 || !decode_kernels_take(second)) return false;
    second.lambda = cfg.lambda;
    second.clamp_lambda = cfg.clamp_lambda;
    second.add_to_out = true;
  }
  threshold_decode(d);
  if (cfg.differential()) threshold_decode(second);
  return true;
}

// The fused path's forward of one element type: the rows normalized (into the saved-rows
// record when the call keeps one), then the screen or the fused kernels.
template <class T>
void fused_forward_of_type(const detail::AttentionParams& p, const ThresholdConfig& cfg) {
  NormalizedViews views(p, cfg);
  if (cfg.saved_rows != nullptr) views.clear_padding_and_support(p);
  dispatch_fused_dims<T>(p, FusedForward{p, cfg, views});
}

}  // namespace

// fused_forward_of_type for bf16 and fp16, each in a file of its own.
void threshold_fused_forward_bf16(const detail::AttentionParams& p, const detail::ThresholdConfig& cfg);
void threshold_fused_forward_fp16(const detail::AttentionParams& p, const detail::ThresholdConfig& cfg);

}  // namespace winnow::cuda
