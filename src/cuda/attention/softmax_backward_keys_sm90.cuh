// Softmax's mechanism for the key-stationary Hopper backward (backward_keys_sm90.cuh), and the
// two helper kernels around it: the rows' statistics before (the forward's log-sum-exp in log2
// units, delta = <dO, O>), the fp32 dQ accumulator into dq after.
#pragma once

#include <cmath>
#include <cstdint>

#include "cuda/attention/backward_keys_sm90.cuh"
#include "cuda/attention/rotary_epilogue.cuh"
#include "math/softmax.h"

namespace winnow::cuda {

// row_stats[0]: lse in log2 units (padding rows +inf: weight 0), row_stats[1]: delta (padding 0).
// dq: fp32, [query head][sequence][padded row][D].
struct SoftmaxKeys {
  float scale_log2, scale;
  float* dq;

  explicit SoftmaxKeys(double scale_, float* dq_)
      : scale_log2(static_cast<float>(scale_ * M_LOG2E)), scale(static_cast<float>(scale_)), dq(dq_) {}

  // Host and device: the host maps them for tensor copies.
  WINNOW_HD const detail::Operand& queries(const AttentionParams& p) const { return p.q; }
  WINNOW_HD const detail::Operand& keys(const AttentionParams& p) const { return p.k; }
  __device__ __forceinline__ void begin(const AttentionParams&, std::int64_t) {}
  __device__ __forceinline__ void end(const AttentionParams&, std::int64_t) {}
  __device__ __forceinline__ float dq_scale() const { return 1.f; }
  template <int NT>
  __device__ __forceinline__ void after_grads(const float (&)[NT][4], const float*, int) const {}

  __device__ __forceinline__ void grad(float& z, float& dp, float lse_log2, float delta, bool visible) const {
    const float pr = visible ? math::softmax::probability(z * scale_log2, lse_log2, tile::exp2_fast) : 0.f;
    z = pr;
    dp = scale * math::softmax::grad_logit(pr, dp, delta);
  }

  __device__ __forceinline__ float* dq_row(const AttentionParams& p, const KeysBackwardBuffers& buf,
                                           const SequenceExtent&, std::int64_t h, std::int64_t b,
                                           std::int64_t row) const {
    return dq + buf.row_index(p, h, b, row) * p.dim_qk;
  }

  // dK rotated back first where the operator rotated k.
  template <class T, int D, int DT>
  __device__ __forceinline__ void store_keys(const AttentionParams&, const detail::GradientParams& g,
                                             float (&dk)[DT][4], float (&dv)[DT][4], std::int64_t b,
                                             const SequenceExtent& seq, std::int64_t hk, std::int64_t my_key,
                                             int tig) const {
    if (g.rotary_cos != nullptr) {
      const std::int64_t pos[2] = {my_key < seq.k_len ? my_key : -1, my_key + 8 < seq.k_len ? my_key + 8 : -1};
      rotate_back_fragment<D>(g, dk, pos, tig);
    }
    store_key_rows<T, DT>(g.dk.at<T>(b, seq.k_start, hk), g.dk.row, dk, seq.k_len, my_key, tig);
    store_key_rows<T, DT>(g.dv.at<T>(b, seq.k_start, hk), g.dv.row, dv, seq.k_len, my_key, tig);
  }
};

// The two helper kernels below give each lane eight elements of a row (16 bytes of T), so a
// warp takes 256 / D rows: with a warp per row, a lane moved 4 bytes (2 of its 32 at D = 64)
// and too little was in flight for memory's latency; at D = 64, L = 1024 they ran at 1.3 and
// 2.7 TB/s on an H200.
template <int D>
inline constexpr int kHelperLanesPerRow = D / 8;
inline constexpr int kHelperThreads = 256;
template <int D>
inline constexpr int kHelperRowsPerBlock = kHelperThreads / kHelperLanesPerRow<D>;

// lse in log2 units and delta = <dO, O> per (query head, sequence, padded row).
template <class T, int D>
__global__ void softmax_backward_row_stats_kernel(const AttentionParams p, const detail::GradientParams g,
                                                  const KeysBackwardBuffers buf) {
  constexpr int kLanes = kHelperLanesPerRow<D>;
  static_assert(32 % kLanes == 0, "whole rows per warp");
  const int part = threadIdx.x % kLanes;
  const std::int64_t r = static_cast<std::int64_t>(blockIdx.x) * kHelperRowsPerBlock<D> + threadIdx.x / kLanes;
  const std::int64_t h = blockIdx.y, b = blockIdx.z;
  // padded_len is a whole number of query tiles, so a warp's rows are all in or all out.
  if (r >= buf.padded_len) return;
  const SequenceExtent seq = p.sequence(b);
  const bool in_sequence = r < seq.q_len;
  float delta = 0.f;
  if (in_sequence) {
    const uint4 o = *reinterpret_cast<const uint4*>(p.out.at<const T>(b, seq.q_start + r, h) + 8 * part);
    const uint4 d = *reinterpret_cast<const uint4*>(g.dout.at<const T>(b, seq.q_start + r, h) + 8 * part);
    const std::uint32_t os[4] = {o.x, o.y, o.z, o.w}, ds[4] = {d.x, d.y, d.z, d.w};
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      float o0, o1, d0, d1;
      tile::unpack2<T>(os[k], o0, o1);
      tile::unpack2<T>(ds[k], d0, d1);
      delta += o0 * d0 + o1 * d1;
    }
  }
  // Every lane of the warp takes part: its rows may lie on both sides of the sequence's end.
  delta = tile::lanes_sum<kLanes>(delta);
  if (part == 0) {
    buf.row_stats[0][buf.row_index(p, h, b, r)] =
        in_sequence ? *p.stats.at<const float>(b, seq.q_start + r, h) * static_cast<float>(M_LOG2E) : INFINITY;
    buf.row_stats[1][buf.row_index(p, h, b, r)] = delta;
  }
}

// The fp32 dQ accumulator into dq (T), rotated back where the operator rotated q: the lanes
// holding columns c and c + D/2 are kLanes / 2 apart in the warp.
template <class T, int D>
__global__ void softmax_backward_store_dq_kernel(const AttentionParams p, const detail::GradientParams g,
                                                 const KeysBackwardBuffers buf, const float* dq) {
  constexpr int kLanes = kHelperLanesPerRow<D>;
  const int part = static_cast<int>(threadIdx.x % kLanes), c = 8 * part;
  const std::int64_t r = static_cast<std::int64_t>(blockIdx.x) * kHelperRowsPerBlock<D> + threadIdx.x / kLanes;
  const std::int64_t h = blockIdx.y, b = blockIdx.z;
  const SequenceExtent seq = p.sequence(b);
  // A warp's rows may lie on both sides of the sequence's end: no lane returns before the shuffles.
  const bool in_sequence = r < seq.q_len;
  float v[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
  if (in_sequence) {
    const float* src = dq + buf.row_index(p, h, b, r) * D + c;
    const float4 x = *reinterpret_cast<const float4*>(src);
    const float4 y = *reinterpret_cast<const float4*>(src + 4);
    v[0] = x.x, v[1] = x.y, v[2] = x.z, v[3] = x.w, v[4] = y.x, v[5] = y.y, v[6] = y.z, v[7] = y.w;
  }
  if (g.rotary_cos != nullptr) {
    const bool low = part < kLanes / 2;
    const int c_low = low ? c : c - D / 2;
#pragma unroll
    for (int k = 0; k < 8; ++k) {
      const float other = __shfl_xor_sync(0xffffffffu, v[k], kLanes / 2);
      if (!in_sequence) continue;
      float lo = low ? v[k] : other, hi = low ? other : v[k];
      rotate_back(g, r + seq.q_offset(), c_low + k, lo, hi);
      v[k] = low ? lo : hi;
    }
  }
  if (!in_sequence) return;
  *reinterpret_cast<uint4*>(g.dq.at<T>(b, seq.q_start + r, h) + c) =
      make_uint4(tile::pack2<T>(v[0], v[1]), tile::pack2<T>(v[2], v[3]), tile::pack2<T>(v[4], v[5]),
                 tile::pack2<T>(v[6], v[7]));
}

}  // namespace winnow::cuda
