// The few PTX instructions the tile vocabulary is built on: asynchronous global->shared copies,
// shared->register matrix loads, the m16n8k16 matrix-unit product, and fast exp2/log2.
// Everything above this file speaks in tiles and fragments, not in instructions.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>

namespace winnow::cuda::tile {

__device__ __forceinline__ std::uint32_t smem_address(const void* p) {
  return static_cast<std::uint32_t>(__cvta_generic_to_shared(p));
}

// A float in shared memory by its 32-bit shared address: a pointer handed through a function
// is generic to the compiler, whose generic loads cost more than ld.shared in a hot loop.
__device__ __forceinline__ void st_shared_f32(std::uint32_t address, float v) {
  asm volatile("st.shared.f32 [%0], %1;\n" ::"r"(address), "f"(v));
}
__device__ __forceinline__ void st_shared_b32(std::uint32_t address, std::uint32_t v) {
  asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(address), "r"(v));
}
__device__ __forceinline__ int ld_volatile_shared_s32(std::uint32_t address) {
  int v;
  asm volatile("ld.volatile.shared.s32 %0, [%1];\n" : "=r"(v) : "r"(address) : "memory");
  return v;
}
__device__ __forceinline__ void st_volatile_shared_s32(std::uint32_t address, int v) {
  asm volatile("st.volatile.shared.s32 [%0], %1;\n" ::"r"(address), "r"(v) : "memory");
}
__device__ __forceinline__ float ld_shared_f32(std::uint32_t address) {
  float v;
  asm volatile("ld.shared.f32 %0, [%1];\n" : "=f"(v) : "r"(address));
  return v;
}
__device__ __forceinline__ float2 ld_shared_v2_f32(std::uint32_t address) {
  float2 v;
  asm volatile("ld.shared.v2.f32 {%0, %1}, [%2];\n" : "=f"(v.x), "=f"(v.y) : "r"(address));
  return v;
}
__device__ __forceinline__ void st_shared_v2_b32(std::uint32_t address, std::uint32_t a, std::uint32_t b) {
  asm volatile("st.shared.v2.b32 [%0], {%1, %2};\n" ::"r"(address), "r"(a), "r"(b));
}
__device__ __forceinline__ void ld_shared_v2_b32(std::uint32_t address, std::uint32_t& a, std::uint32_t& b) {
  asm volatile("ld.shared.v2.b32 {%0, %1}, [%2];\n" : "=r"(a), "=r"(b) : "r"(address));
}

// Integer stores and reductions into global memory, named as global: ptxas cannot tell a
// generic address from a shared one, so while a warpgroup's products are in flight it waits for
// them before a generic store or atomic, and where that wait falls in a divergent path it
// serializes every product of the kernel (C7518).
__device__ __forceinline__ void red_or_global(std::uint32_t* p, std::uint32_t v) {
  asm volatile("red.global.or.b32 [%0], %1;\n" ::"l"(__cvta_generic_to_global(p)), "r"(v) : "memory");
}
__device__ __forceinline__ void st_global_b32(std::uint32_t* p, std::uint32_t v) {
  asm volatile("st.global.b32 [%0], %1;\n" ::"l"(__cvta_generic_to_global(p)), "r"(v) : "memory");
}
__device__ __forceinline__ void red_add_global(unsigned long long* p, unsigned long long v) {
  asm volatile("red.global.add.u64 [%0], %1;\n" ::"l"(__cvta_generic_to_global(p)), "l"(v) : "memory");
}

// x as one floating-point reduction into a zero would leave it: red/atom.add.f32 flush
// subnormal inputs and results to zero (PTX ISA), so a gradient written directly matches, bit
// for bit, one summed into a cleared accumulator.
__device__ __forceinline__ float as_reduced_into_zero(float x) {
  float y;
  asm("add.ftz.f32 %0, %1, 0f00000000;\n" : "=f"(y) : "f"(x));
  return y;
}

// 16-byte asynchronous copy; when `valid` is false the destination is zero-filled and the
// source is not read.
__device__ __forceinline__ void cp_async_16(void* smem, const void* gmem, bool valid) {
  const int src_bytes = valid ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_address(smem)),
               "l"(gmem), "r"(src_bytes));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int Pending>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(Pending));
}

// Four 8x8 matrices of 16-bit elements; lane l gives the address of row l % 8 of matrix l / 8.
__device__ __forceinline__ void ldmatrix_x4(std::uint32_t (&r)[4], const void* smem) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_address(smem)));
}
__device__ __forceinline__ void ldmatrix_x4_trans(std::uint32_t (&r)[4], const void* smem) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_address(smem)));
}

// c += a * b for one 16x8x16 tile: a 16x16 (row major), b 16x8 (column major), fp32 c.
template <class T>
__device__ __forceinline__ void mma_16816(float (&c)[4], const std::uint32_t (&a)[4],
                                          std::uint32_t b0, std::uint32_t b1) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, "
        "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  } else {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, "
        "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
}

// Two floats as one register of two 16-bit elements (lo in the low half).
template <class T>
__device__ __forceinline__ std::uint32_t pack2(float lo, float hi) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<std::uint32_t*>(&v);
  } else {
    __half2 v = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<std::uint32_t*>(&v);
  }
}

// The two 16-bit elements of a word as floats (inverse of pack2). A bf16 is the top half of
// its float, so each takes one shift or one mask; through to_float the upper one took a byte
// permute and a shift (SASS of the entmax sparse backward, where these conversions were the
// loops' largest share of ALU work).
template <class T>
__device__ __forceinline__ void unpack2(std::uint32_t word, float& lo, float& hi) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    lo = __uint_as_float(word << 16);
    hi = __uint_as_float(word & 0xffff0000u);
  } else {
    const float2 f = __half22float2(*reinterpret_cast<const __half2*>(&word));
    lo = f.x;
    hi = f.y;
  }
}

template <class T>
__device__ __forceinline__ float to_float(T x) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    return __bfloat162float(x);
  } else {
    return __half2float(x);
  }
}

// 2^x and log2(x) on the special-function unit (relative error about 2^-22).
__device__ __forceinline__ float exp2_fast(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}
__device__ __forceinline__ float log2_fast(float x) {
  float y;
  asm("lg2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// 1 / x on the special-function unit (relative error about 2^-23).
__device__ __forceinline__ float rcp_fast(float x) {
  float y;
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// fp32 reduction into global memory without a return value.
__device__ __forceinline__ void red_add(float* p, float v) { atomicAdd(p, v); }
__device__ __forceinline__ void red_add2(float* p, float a, float b) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("red.global.add.v2.f32 [%0], {%1, %2};\n" ::"l"(p), "f"(a), "f"(b) : "memory");
#else
  atomicAdd(p, a);
  atomicAdd(p + 1, b);
#endif
}

// Four consecutive floats added into global memory by one reduction (sm_90; two of two
// elsewhere).
__device__ __forceinline__ void red_add4(float* p, float a, float b, float c, float d) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("red.global.add.v4.f32 [%0], {%1, %2, %3, %4};\n" ::"l"(p), "f"(a), "f"(b), "f"(c), "f"(d) : "memory");
#else
  red_add2(p, a, b);
  red_add2(p + 2, c, d);
#endif
}

}  // namespace winnow::cuda::tile
