// Per-row operations on accumulator fragments. A row's values are spread over the four
// threads of a quad (lanes 4g .. 4g + 3), so row reductions end with two butterfly shuffles
// and scans combine a thread-local pass with a quad-level pass.
#pragma once

namespace winnow::cuda::tile {

// The sum over each group of Lanes consecutive lanes (a power of two up to 32), in every lane
// of the group: a row spread over Lanes lanes. Every lane of the warp must take part.
template <int Lanes>
__device__ __forceinline__ float lanes_sum(float x) {
  static_assert(Lanes > 0 && Lanes <= 32 && (Lanes & (Lanes - 1)) == 0, "a power of two up to 32");
#pragma unroll
  for (int m = Lanes / 2; m > 0; m >>= 1) x += __shfl_xor_sync(0xffffffffu, x, m);
  return x;
}

// The largest over each group of Lanes consecutive lanes, as lanes_sum.
template <int Lanes>
__device__ __forceinline__ float lanes_max(float x) {
  static_assert(Lanes > 0 && Lanes <= 32 && (Lanes & (Lanes - 1)) == 0, "a power of two up to 32");
#pragma unroll
  for (int m = Lanes / 2; m > 0; m >>= 1) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, m));
  return x;
}

__device__ __forceinline__ float quad_sum(float x) {
  x += __shfl_xor_sync(0xffffffffu, x, 1);
  x += __shfl_xor_sync(0xffffffffu, x, 2);
  return x;
}
__device__ __forceinline__ float quad_max(float x) {
  x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 1));
  x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 2));
  return x;
}
__device__ __forceinline__ float quad_min(float x) {
  x = fminf(x, __shfl_xor_sync(0xffffffffu, x, 1));
  x = fminf(x, __shfl_xor_sync(0xffffffffu, x, 2));
  return x;
}

// The sum of x over the warp's lanes before this one (an exclusive scan in lane order): where
// each lane's items go in a list the warp fills together. Every lane of the warp must take part.
__device__ __forceinline__ int warp_exclusive_sum(int x) {
  const int lane = static_cast<int>(threadIdx.x & 31);
  int inclusive = x;
#pragma unroll
  for (int off = 1; off < 32; off *= 2) {
    const int up = __shfl_up_sync(0xffffffffu, inclusive, off);
    if (lane >= off) inclusive += up;
  }
  return inclusive - x;
}

// Quad-level scans of one value per thread, in thread order tig = 0 .. 3.
struct QuadScan {
  float total;      // sum over the quad
  float before;     // sum over threads tig' < tig
  float after;      // sum over threads tig' > tig
};
__device__ __forceinline__ QuadScan quad_scan(float x, int tig) {
  // Inclusive suffix over tig' >= tig.
  float suffix = x;
  float t = __shfl_down_sync(0xffffffffu, suffix, 1);
  if (tig < 3) suffix += t;
  t = __shfl_down_sync(0xffffffffu, suffix, 2);
  if (tig < 2) suffix += t;
  const float total = __shfl_sync(0xffffffffu, suffix, (threadIdx.x & 31) & ~3);
  return {total, total - suffix, suffix - x};
}

}  // namespace winnow::cuda::tile
