// The screen's rows (threshold_screen_sm90.cuh): 16-bit queries and keys normalized as the
// kernels score them and quantized to int8 with their error radius, four lanes a row. Shared by
// the key tiles' normalization (threshold_attention.cuh) and the screen, which normalizes its
// own query tile (normalize_quantize_wide_row), so that both write the rows the unscreened
// forward would score.
#pragma once

#include <cstdint>

#include "cuda/element_types.cuh"
#include "cuda/tile/ptx.cuh"
#include "cuda/tile/rows.cuh"
#include "math/elementwise.h"
#include "math/threshold.h"

namespace winnow::cuda {

inline constexpr int kScreenRowBytes = 128;  // int8 rows, zero past the head dimension

// A lane's eight features of a row, loaded apart from the arithmetic below so that a kernel
// taking several rows a lane issues all their loads before its first store: the compiler may
// not move a load past a store to `hat`, which could alias it. The key-tile kernel normalized
// eight rows a lane with load, sums, store in turn, eight memory round trips in series, and took
// 0.088 ms per view at 16K tokens, 12 heads (H200, 2026-11-30); with its loads ahead, 0.071.
// Not read where not valid.
template <class T>
__device__ __forceinline__ Pack<T, 8> load_packed_row(const T* x, bool valid) {
  Pack<T, 8> in;
  if (valid) in = load_pack<T, 8>(x);
  return in;
}

// The screen's rows (dim 64 or 128, rows as aligned_rows requires). A warp a row with 8-byte
// accesses, as these kernels were first written, took 0.08 ms per view and tensor at 16K tokens
// and 12 heads (H200, 2026-11-30), 19% of the screened TRA forward at 16K.

__device__ __forceinline__ float largest_magnitude(const float (&a)[8]) {
  float m = 0.f;
#pragma unroll
  for (int j = 0; j < 8; ++j) m = fmaxf(m, fabsf(a[j]));
  return m;
}

// Eight features as int8 with `scale` (math::threshold::screen_scale and screen_inverse_scale of the largest
// |a| of the row or tile), as two words in feature order; returns their part of the row's squared
// error radius.
__device__ __forceinline__ float quantize_lane(const float (&a)[8], float scale, float inverse_scale, uint2* words) {
  std::uint32_t word[2] = {0u, 0u};
  float err = 0.f;
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    const int c = math::threshold::screen_quantize(a[j], inverse_scale);
    word[j / 4] |= (static_cast<std::uint32_t>(c) & 0xffu) << (8 * (j % 4));
    const float e = a[j] - scale * static_cast<float>(c);
    err += e * e;
  }
  *words = make_uint2(word[0], word[1]);
  return err;
}

// The screen's normalization takes rows four lanes a row, lane `sub` holding the row's packs of
// eight features sub, sub + 4, ... (kPacks = dim / 32 of them, one 16-byte access each), so that
// a lane's fixed work (its row's indices and addresses, the norm's reciprocal square root, the
// scales' reciprocals, the reductions' shuffles) is spread over four packs. With a pack a lane
// (dim / 8 lanes a row, as the plain normalization), the queries' kernel executed about 420
// instructions a lane and was bound by issuing them: 79% of issue slots busy, 33% of the memory
// bandwidth, 0.052 ms per view at 16K tokens and 12 heads (Nsight Compute, H200, 2026-12-02).
inline constexpr int kWideLanes = 4;

// A row's packs as `sub` holds them, loaded before any store (load_packed_row says why).
template <class T, int kPacks>
__device__ __forceinline__ void load_wide_row(const T* row, int sub, bool valid, Pack<T, 8> (&in)[kPacks]) {
#pragma unroll
  for (int j = 0; j < kPacks; ++j) in[j] = load_packed_row(row + 8 * (sub + kWideLanes * j), valid);
}

// The sum over a row of per-pack partial sums, added in the order in which lanes_sum<dim / 8>
// adds them in the one-pack-a-lane layout (pairs 4 kPacks / 2 packs apart first, then ever
// closer), so that the result is that layout's to the bit: the screened forward then scores the
// rows the unscreened one normalizes (normalize_rows_packed_kernel). Each lane of a butterfly
// adds its own value and its partner's, and a + b == b + a in IEEE arithmetic.
template <int kPacks>
__device__ __forceinline__ float wide_row_sum(float (&part)[kPacks]) {
#pragma unroll
  for (int m = kPacks / 2; m > 0; m /= 2) {
#pragma unroll
    for (int j = 0; j < m; ++j) part[j] += part[j + m];
  }
  return tile::lanes_sum<kWideLanes>(part[0]);
}

// normalize_packed_row for a row in the wide layout: the features normalized and rounded to T
// into `out`, stored into hat_row where valid; *inv_norm the signed inverse norm.
template <class T, int kPacks>
__device__ __forceinline__ void normalize_wide_row(const Pack<T, 8> (&in)[kPacks], T* hat_row, int sub, bool valid,
                                                   float eps, Pack<T, 8> (&out)[kPacks], float* inv_norm) {
  float part[kPacks];
#pragma unroll
  for (int j = 0; j < kPacks; ++j) {
    float sum = 0.f;
#pragma unroll
    for (int e = 0; e < 8; ++e) {
      const float x = valid ? widen(in[j].v[e]) : 0.f;
      sum += x * x;
    }
    part[j] = sum;
  }
  const float sum = wide_row_sum<kPacks>(part);
  const float inv = math::inverse_norm(sum, eps);
  *inv_norm = math::norm_clipped(sum, eps) ? -inv : inv;
#pragma unroll
  for (int j = 0; j < kPacks; ++j) {
#pragma unroll
    for (int e = 0; e < 8; ++e) out[j].v[e] = narrow_to<T>((valid ? widen(in[j].v[e]) : 0.f) * inv);
    if (valid) store_pack<T, 8>(hat_row + 8 * (sub + kWideLanes * j), out[j]);
  }
}

// The normalized row as the kernels score it: `out` widened, zeros where not valid.
template <class T, int kPacks>
__device__ __forceinline__ void widen_row(const Pack<T, 8> (&out)[kPacks], bool valid, float (&a)[kPacks][8]) {
#pragma unroll
  for (int j = 0; j < kPacks; ++j) {
#pragma unroll
    for (int e = 0; e < 8; ++e) a[j][e] = valid ? widen(out[j].v[e]) : 0.f;
  }
}

template <int kPacks>
__device__ __forceinline__ float largest_magnitude(const float (&a)[kPacks][8]) {
  float m = 0.f;
#pragma unroll
  for (int j = 0; j < kPacks; ++j) m = fmaxf(m, largest_magnitude(a[j]));
  return m;
}

// The screen's rows are kScreenRowBytes long, zero past dim: a lane's packs of codes (eight
// bytes each) are the row's packs sub + 4 j, j < kPacks; the padding's (dim 64) those with
// kPacks <= j < kScreenRowBytes / 32.
inline constexpr int kScreenPacksPerLane = kScreenRowBytes / 8 / kWideLanes;

// The row's codes with the scale of `largest` into the lane's packs: store(j, words) stores the
// eight codes of the lane's pack j, zeros for the padding's (j >= kPacks). Returns the row's
// error radius, its squares summed in wide_row_sum's order.
template <int kPacks, class Store>
__device__ __forceinline__ float quantize_wide_row(const float (&a)[kPacks][8], float largest, bool valid, Store&& store) {
  static_assert(kPacks <= kScreenPacksPerLane, "a screen row holds the head dimension");
  const float scale = math::threshold::screen_scale(largest), inverse_scale = math::threshold::screen_inverse_scale(largest);
  float part[kPacks];
#pragma unroll
  for (int j = 0; j < kPacks; ++j) {
    uint2 words = make_uint2(0u, 0u);
    part[j] = valid ? quantize_lane(a[j], scale, inverse_scale, &words) : 0.f;
    store(j, words);
  }
#pragma unroll
  for (int j = kPacks; j < kScreenPacksPerLane; ++j) store(j, make_uint2(0u, 0u));
  return sqrtf(wide_row_sum<kPacks>(part));
}

// A row of the wide layout whole: loaded (`in`, from load_wide_row), normalized into hat_row
// where valid, quantized with the row's own scale through store (quantize_wide_row's). Returns
// {the signed inverse norm, the screen's scale, the error radius}, the same in the row's lanes.
template <class T, int kPacks, class Store>
__device__ __forceinline__ float3 normalize_quantize_wide_row(const Pack<T, 8> (&in)[kPacks], T* hat_row, int sub,
                                                               bool valid, float eps, Store&& store) {
  Pack<T, 8> out[kPacks];
  float a[kPacks][8], inv;
  normalize_wide_row<T, kPacks>(in, hat_row, sub, valid, eps, out, &inv);
  widen_row<T, kPacks>(out, valid, a);
  const float largest = tile::lanes_max<kWideLanes>(largest_magnitude<kPacks>(a));
  const float err = quantize_wide_row<kPacks>(a, largest, valid, static_cast<Store&&>(store));
  return make_float3(inv, math::threshold::screen_scale(largest), err);
}

}  // namespace winnow::cuda
