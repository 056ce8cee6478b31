// Hopper (sm_90a) vocabulary: shared-memory operand descriptors and the warpgroup product that
// reads them, transaction barriers (mbarrier) that hand tiles from producer warps to consumer
// warps, named barriers, register reallocation between warpgroups, and the proxy fence that
// makes ordinary shared-memory writes visible to the matrix units.
//
// Everything here compiles for any architecture; only kernels built for sm_90a may call it.
#pragma once

#include <cstdint>

#include "cuda/tile/ptx.cuh"
#include "cuda/tile/wgmma_instructions.cuh"

namespace winnow::cuda::tile {

// ------------------------------------------------------------------ operand descriptors
// A wgmma operand in shared memory with the 128-byte swizzle: 8-row groups of 128-byte rows
// (1024 bytes, 1024-aligned), the 16-byte chunk index of each row XOR-ed with row % 8.
//   K-major (k index contiguous, as Q and K in Q K^T): rows are the M / N index; SBO is the
//   distance between 8-row groups, LBO is unused.
//   MN-major (as V in P V, whose rows are the k index): LBO is the distance between 64-wide
//   column panels, SBO between 8-row groups.
//
// Built in two halves. The low half holds the start address field (bits 4-17 of the address:
// a CTA's shared memory lies within 2^18 bytes; the address's upper bits, which name the CTA
// in its cluster, are masked off as before) and the LBO; adding (bytes >> 4) to it moves the
// start by `bytes` without a carry out of the field. So a kernel builds a tile's low half once
// and each k-step's descriptor with one add, where building it again took an add, two masks, a
// shift and a move (about 120 of the D = 64 stick-breaking forward's 743 instructions a tile,
// ncu, 2026-11-29). The high half (SBO and the swizzle) is a constant.
__device__ __forceinline__ std::uint32_t descriptor_low(std::uint32_t smem_addr, std::uint32_t lbo_bytes) {
  return ((smem_addr & 0x3FFFF) >> 4) | (((lbo_bytes >> 4) & 0x3FFF) << 16);
}
__device__ __forceinline__ std::uint64_t descriptor_of(std::uint32_t low, std::uint32_t sbo_bytes) {
  const std::uint32_t high = ((sbo_bytes >> 4) & 0x3FFF) | (1u << 30);  // 128-byte swizzle
  return (static_cast<std::uint64_t>(high) << 32) | low;
}
__device__ __forceinline__ std::uint64_t smem_descriptor(std::uint32_t smem_addr, std::uint32_t lbo_bytes,
                                                         std::uint32_t sbo_bytes) {
  return descriptor_of(descriptor_low(smem_addr, lbo_bytes), sbo_bytes);
}

// ------------------------------------------------------------------ warpgroup products
__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int Pending>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(Pending) : "memory");
}

// The same pointer, but one the compiler cannot see through: what is computed from it inside a
// loop stays in the loop. Operand descriptors and swizzled addresses of tiles that do not move
// are loop-invariant, and the compiler hoists them all out of a kernel's main loop into
// registers that a 240-register consumer then spills; recomputed each pass they cost a few
// integer instructions next to the products.
template <class P>
__device__ __forceinline__ P* opaque(P* p) {
  asm volatile("" : "+l"(p));
  return p;
}
// The same for a 32-bit value, and the other way round: a value the compiler cannot rebuild
// stays in its register, where a loop would otherwise recompute it at each use (the int8
// screen's shared base, which ptxas rebuilt from the CTA id in its consumers' loop).
__device__ __forceinline__ std::uint32_t opaque(std::uint32_t x) {
  asm volatile("" : "+r"(x));
  return x;
}

// A value that every lane of the warp holds alike (a warpgroup's index, a ring's stage), passed
// through the warp's reduction so that ptxas knows it is: REDUX writes a uniform register, and
// the products' operand descriptors computed from it stay on the uniform datapath. Computed
// from a value ptxas takes to differ by lane (anything from threadIdx, a loop counter in an
// ordinary register), each descriptor is built in ordinary registers and moved over by two R2UR
// a product: TDA's forward issued 363 instructions around its 36 products a round, 244 with its
// warpgroup and stage indices passed through here (SASS, sm_90a, 2026-11-29). On an H200 the
// TRA forward ran 5-8% faster, TDA 0-3% (2026-11-30, docs/performance.md).
__device__ __forceinline__ int warp_uniform(int x) {
  return static_cast<int>(__reduce_or_sync(0xffffffffu, static_cast<unsigned>(x)));
}

// Keeps the compiler from moving reads or writes of accumulator registers across the
// asynchronous product that owns them (between issue and wait the hardware writes them).
template <int N>
__device__ __forceinline__ void pin(float (&r)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+f"(r[i])::"memory");
}
template <int N>
__device__ __forceinline__ void pin(int (&r)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+r"(r[i])::"memory");
}
template <int N, int M>
__device__ __forceinline__ void pin(float (&r)[N][M]) {
#pragma unroll
  for (int i = 0; i < N; ++i) pin(r[i]);
}
template <int N>
__device__ __forceinline__ void pin(std::uint32_t (&r)[N][4]) {
#pragma unroll
  for (int i = 0; i < N; ++i) {
#pragma unroll
    for (int j = 0; j < 4; ++j) asm volatile("" : "+r"(r[i][j])::"memory");
  }
}

// Marks registers as defined without writing them: the accumulator of a product that starts
// with accumulate = false. (Zeroing it instead lets the compiler share one zero register
// among the accumulator's elements, and then wait for each product that writes it.)
template <int N, int M>
__device__ __forceinline__ void fresh(float (&r)[N][M]) {
#pragma unroll
  for (int i = 0; i < N; ++i) {
#pragma unroll
    for (int j = 0; j < M; ++j) asm volatile("" : "=f"(r[i][j]));
  }
}

// The accumulator of a 64 x N product in the kernels' fragment shape float[N / 8][4].
template <int N>
__device__ __forceinline__ float (&flat(float (&acc)[N / 8][4]))[N / 2] {
  return reinterpret_cast<float(&)[N / 2]>(acc);
}

// acc (64 x N) (+)= A (shared, descriptor) * B (shared, descriptor).
template <class T, int N, int TransA, int TransB>
__device__ __forceinline__ void wgmma_ss(float (&acc)[N / 8][4], std::uint64_t a, std::uint64_t b,
                                         bool accumulate) {
  if constexpr (N == 64) {
    wgmma_ss_n64<T, TransA, TransB>(flat<N>(acc), a, b, accumulate);
  } else {
    static_assert(N == 128, "key tiles and head dimensions of 64 or 128");
    wgmma_ss_n128<T, TransA, TransB>(flat<N>(acc), a, b, accumulate);
  }
}
// acc (64 x N) (+)= A (registers, m16n8k16 fragment per warp) * B (shared, descriptor).
template <class T, int N, int TransB>
__device__ __forceinline__ void wgmma_rs(float (&acc)[N / 8][4], const std::uint32_t (&a)[4],
                                         std::uint64_t b, bool accumulate) {
  if constexpr (N == 64) {
    wgmma_rs_n64<T, TransB>(flat<N>(acc), a, b, accumulate);
  } else {
    static_assert(N == 128, "key tiles and head dimensions of 64 or 128");
    wgmma_rs_n128<T, TransB>(flat<N>(acc), a, b, accumulate);
  }
}

// ------------------------------------------------------------------ barriers
// mbarrier: a phase completes when `count` arrivals have happened; waiters name the parity of
// the phase they wait for (0, 1, 0, ...).
__device__ __forceinline__ void mbar_init(std::uint64_t* bar, int count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(smem_address(bar)), "r"(count));
}
__device__ __forceinline__ void mbar_init_fence() {
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}
// By the barrier's shared address (the _at forms): for a hot loop that keeps its barriers'
// addresses as integers, where converting a generic pointer makes ptxas rebuild the shared
// window's base (S2UR of the CTA id) at each use.
__device__ __forceinline__ void mbar_arrive_at(std::uint32_t bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}
__device__ __forceinline__ void mbar_arrive(std::uint64_t* bar) { mbar_arrive_at(smem_address(bar)); }
// A waiter that may sleep up to `hint_ns` before checking again (the hardware wakes it when
// the phase completes): for producer warps, which otherwise spin on the issue slots the
// computing warps need.
__device__ __forceinline__ void mbar_wait_sleepy(std::uint64_t* bar, int parity, std::uint32_t hint_ns = 1000000) {
  asm volatile(
      "{\n"
      ".reg .pred done;\n"
      "wait_%=:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1, %2;\n"
      "@!done bra wait_%=;\n"
      "}\n" ::"r"(smem_address(bar)),
      "r"(parity), "r"(hint_ns)
      : "memory");
}
__device__ __forceinline__ void mbar_wait_at(std::uint32_t bar, int parity) {
  asm volatile(
      "{\n"
      ".reg .pred done;\n"
      "wait_%=:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra wait_%=;\n"
      "}\n" ::"r"(bar),
      "r"(parity)
      : "memory");
}
__device__ __forceinline__ void mbar_wait(std::uint64_t* bar, int parity) { mbar_wait_at(smem_address(bar), parity); }

// The mbarrier receives this thread's arrival once all its earlier cp.async copies have
// landed; the thread itself goes on at once. (`noinc`: the arrival is one of the `count`.)
__device__ __forceinline__ void mbar_arrive_on_copies(std::uint64_t* bar) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(smem_address(bar)) : "memory");
}

// Early halting in a producer / consumer pipeline: each of two consumer warpgroups tells the
// producer, stage by stage, whether it has stopped needing tiles. A consumer's flag for stage s
// is written (by one of its threads) just before that thread's arrival on the stage's "empty"
// mbarrier, and the producer reads it just after waiting on that barrier, so the barrier orders
// every write before the read that sees it; the consumer writes the stage's flag again only
// after waiting on its "full" barrier, which the producer arrives on after reading. One flag per
// consumer for all stages, raised whenever the consumer halted, raced with those reads
// (compute-sanitizer racecheck).
struct StageHaltFlags {
  volatile int* flags;  // [stages][2], in shared memory
  static constexpr int bytes(int stages) { return 8 * stages; }
  __device__ void clear(int stages) const {
    for (int i = 0; i < 2 * stages; ++i) flags[i] = 0;
  }
  __device__ void publish(int stage, int consumer, bool halted) const { flags[2 * stage + consumer] = halted; }
  __device__ bool both(int stage) const { return flags[2 * stage] != 0 && flags[2 * stage + 1] != 0; }
};

// Named barriers (id 1 .. 15; 0 is __syncthreads) over `threads` threads, whole warps.
// named_sync waits for the barrier; named_arrive counts towards it without waiting.
__device__ __forceinline__ void named_sync(int id, int threads) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}
__device__ __forceinline__ void named_arrive(int id, int threads) {
  asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}
// A named barrier that also returns whether `pred` holds in every participating thread.
__device__ __forceinline__ bool named_sync_and(int id, int threads, bool pred) {
  std::uint32_t out;
  asm volatile(
      "{\n"
      ".reg .pred p, q;\n"
      "setp.ne.u32 p, %1, 0;\n"
      "barrier.red.and.pred q, %2, %3, p;\n"
      "selp.u32 %0, 1, 0, q;\n"
      "}\n"
      : "=r"(out)
      : "r"(static_cast<std::uint32_t>(pred)), "r"(id), "r"(threads)
      : "memory");
  return out != 0;
}
__device__ __forceinline__ bool named_sync_or(int id, int threads, bool pred) {
  std::uint32_t out;
  asm volatile(
      "{\n"
      ".reg .pred p, q;\n"
      "setp.ne.u32 p, %1, 0;\n"
      "barrier.red.or.pred q, %2, %3, p;\n"
      "selp.u32 %0, 1, 0, q;\n"
      "}\n"
      : "=r"(out)
      : "r"(static_cast<std::uint32_t>(pred)), "r"(id), "r"(threads)
      : "memory");
  return out != 0;
}

// Ordinary (generic-proxy) shared-memory writes of this thread, cp.async included, become
// visible to the matrix units (async proxy) once a barrier follows this fence.
__device__ __forceinline__ void fence_to_async_proxy() {
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}

// Register reallocation between warpgroups: producers give registers back, consumers take them.
template <int Registers>
__device__ __forceinline__ void registers_release() {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(Registers));
}
template <int Registers>
__device__ __forceinline__ void registers_claim() {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(Registers));
}

}  // namespace winnow::cuda::tile
