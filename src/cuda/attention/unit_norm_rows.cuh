// The gradient through an L2 normalization (x_hat = x / |x|) of fragment rows, for mechanisms
// whose kernels see unit-normalized queries or keys (threshold attention, screening) and take
// dq or dk back through the normalization as the last step of the backward.
#pragma once

#include "cuda/tile/fragment.cuh"
#include "cuda/tile/rows.cuh"
#include "math/elementwise.h"

namespace winnow::cuda {

// Row `half` of a thread's fragment of rows x D (rows r0 and r0 + 8, columns 8 n + 2 tig + e)
// through the L2 normalization's gradient, in place: (g - hat <hat, g>) / |x|, or g / eps where
// the norm was clipped (negative inverse). A row's D columns lie in the four lanes of a quad, so
// the dot product ends in a quad shuffle that every lane of the warp must reach: call it for
// every row, with hat == nullptr (and inv_norm unread) for a row past the sequence.
template <class T, int DT>
__device__ __forceinline__ void normalize_grad_row(float (&x)[DT][4], int half, const T* hat, const float* inv_norm,
                                                   int tig) {
  float partial = 0.f;
  if (hat != nullptr) {
#pragma unroll
    for (int n = 0; n < DT; ++n) {
      partial += tile::to_float(hat[8 * n + 2 * tig]) * x[n][2 * half] +
                 tile::to_float(hat[8 * n + 2 * tig + 1]) * x[n][2 * half + 1];
    }
  }
  const float dot = tile::quad_sum(partial);
  if (hat == nullptr) return;
  const float inv = *inv_norm;
#pragma unroll
  for (int n = 0; n < DT; ++n) {
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      float& g = x[n][2 * half + e];
      g = math::normalize_grad(g, tile::to_float(hat[8 * n + 2 * tig + e]), dot, fabsf(inv), inv < 0.f);
    }
  }
}

}  // namespace winnow::cuda
