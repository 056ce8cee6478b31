// Launchers shared by the mechanisms: the fused forward and backward kernels and the simple
// path, instantiated for the short list of (dtype, head dimension) pairs each supports.
#pragma once

#include <algorithm>
#include <cstdlib>
#include <initializer_list>
#include <map>
#include <string>
#include <type_traits>
#include <utility>

#include "cuda/attention/backward.cuh"
#include "cuda/attention/backward_keys_sm90.cuh"
#include "cuda/attention/backward_sm90.cuh"
#include "cuda/attention/forward.cuh"
#include "cuda/attention/forward_sm90.cuh"
#include "cuda/attention/simple.cuh"
#include "cuda/launch.h"
#include "cuda/tensor_maps.h"

namespace winnow::cuda {

// Only when the kernel's limit on this device is not already `bytes` by this thread's last
// call: the call takes 1-4 us of host time (a trace of entmax-1.5's forward, 2026-11-30), and
// the first launches of a call are what the GPU waits for.
template <class Kernel>
void allow_shared_memory(Kernel kernel, int bytes) {
  int device = 0;
  check(cudaGetDevice(&device), "querying the device");
  thread_local std::map<std::pair<const void*, int>, int> allowed;
  const auto key = std::make_pair(reinterpret_cast<const void*>(kernel), device);
  const auto it = allowed.find(key);
  if (it != allowed.end() && it->second == bytes) return;
  check(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes),
        "raising a kernel's shared-memory limit");
  allowed[key] = bytes;
}

// Whether `kernel` has Hopper code for the current device: its binary was built for sm_90a
// (compute capability 9.0) and the device is one, and WINNOW_PORTABLE_KERNELS is not set (it
// forces the portable kernels, for comparison). The cached binary version is shared by all
// kernels of one signature; that is right because the library builds every kernel for the
// same list of architectures.
template <class Kernel>
bool hopper_kernel_runs(Kernel kernel) {
  static const int binary = [&] {
    cudaFuncAttributes attr{};
    if (cudaFuncGetAttributes(&attr, kernel) != cudaSuccess) {
      (void)cudaGetLastError();
      return 0;
    }
    return attr.binaryVersion;
  }();
  static const bool portable_forced = std::getenv("WINNOW_PORTABLE_KERNELS") != nullptr;
  if (binary != 90 || portable_forced) return false;
  int device = 0, major = 0;
  check(cudaGetDevice(&device), "querying the device");
  check(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device), "querying the device");
  return major == 9;
}

// p with the query heads whose tiles interleave in a grid of bq-row query tiles (QueryTile):
// heads_per_sweep's choice, but one in the deterministic mode, whose turn order ranks a key
// tile's contributors by grid x and waits on earlier ranks (an interleaved launch could hold
// every SM with blocks waiting for one not yet started).
inline detail::AttentionParams with_heads_per_sweep(const detail::AttentionParams& p, Pass pass, int bq) {
  detail::AttentionParams q = p;
  q.heads_per_sweep = p.deterministic ? 1 : heads_per_sweep(pass, (p.max_len_q + bq - 1) / bq, p.heads_q);
  return q;
}

template <class Rows, class Config, class = void>
inline constexpr bool kPacksShortSequences = false;
template <class Rows, class Config>
inline constexpr bool kPacksShortSequences<
    Rows, Config, std::void_t<decltype(Rows::packs_short_sequences(std::declval<const Config&>(), std::int64_t{}))>> =
    true;

// Whether this call's rows visit every key they see (no halting, no tile skipping), and may be
// packed when short (below). Rows::packs_short_sequences says so for its mechanism: its
// weights depend on positions through the causal mask alone, and it skips no visible key.
template <class Rows, class Config>
bool rows_pack(const detail::AttentionParams& p, const Config& cfg, const LiveKeyTiles& live) {
  if constexpr (kPacksShortSequences<Rows, Config>) {
    return live.bits == nullptr && Rows::packs_short_sequences(cfg, p.len_k);
  } else {
    return false;
  }
}

// Short sequences packed end to end. A block of the fused kernels owns 128 query rows of one
// sequence, so sequences of L <= 64 leave 128 - L rows of every block idle: at L = 64, one of
// the Hopper forward's two consumer warpgroups and half of the backward's rows, and twice the
// blocks, each paying its loads' latency alone. Where a batch's sequences lie end to end in
// every operand (`more`: the pass's others), they run as one sequence of B L rows in
// segments of L (AttentionParams::segment_len), 128 / L of them to a block, and the kernels'
// masks keep each segment to its own keys. Only for rows_pack mechanisms, batched with
// Lq = Lk; WINNOW_PACK_SHORT_SEQUENCES=0 turns it off, for comparison.
template <class Rows, class Config>
detail::AttentionParams packed_short_sequences(const detail::AttentionParams& p, const Config& cfg,
                                               const LiveKeyTiles& live,
                                               std::initializer_list<const detail::Operand*> more = {}) {
  // Read per call (a microsecond beside the launch), so that tests can switch it.
  const char* e = std::getenv("WINNOW_PACK_SHORT_SEQUENCES");
  const bool off = e != nullptr && std::string(e) == "0";
  // L divides 128, so it is a power of two, as RowMask::segment_bits needs.
  const std::int64_t L = p.len_k;
  if (off || p.cu_seqlens_q != nullptr || p.cu_seqlens_k != nullptr || p.num_seqs < 2 || p.len_q != L || L < 1 ||
      L > 64 || 128 % L != 0 || !rows_pack<Rows>(p, cfg, live)) {
    return p;
  }
  for (const detail::Operand* op : {&p.q, &p.k, &p.v, &p.out, &p.stats}) {
    if (!op->sequences_end_to_end(L)) return p;
  }
  for (const detail::Operand* op : more) {
    if (!op->sequences_end_to_end(L)) return p;
  }
  detail::AttentionParams packed = p;
  packed.len_q = packed.len_k = packed.max_len_q = packed.max_len_k = p.num_seqs * L;
  packed.num_seqs = 1;
  packed.segment_len = L;
  return packed;
}

// Head dimensions the Hopper kernels are built for; the fused path's smaller ones (16 and 32,
// dispatch_fused<true>) run the portable kernels on every GPU.
template <int D>
inline constexpr bool kHopperDim = D == 64 || D == 128;

template <class T, int D, class Rows, class Config, bool Segments = false>
bool launch_sm90_forward(const detail::AttentionParams& p, const Config& cfg, const LiveKeyTiles& live) {
  auto kernel = attention_forward_sm90_kernel<T, D, Rows, Config, Segments>;
  if (!hopper_kernel_runs(kernel)) return false;
  using Shape = Sm90ForwardShape;
  const detail::AttentionParams pq = with_heads_per_sweep(p, Pass::forward, Shape::kBQ);
  const dim3 grid = query_tile_grid(pq, Shape::kBQ);
  if (grid.x == 0 || grid.z == 0) return true;
  const int smem = Sm90ForwardSmemOf<T, D, Rows>::kBytes;
  allow_shared_memory(kernel, smem);
  kernel<<<grid, Shape::kThreads, smem, stream_of(p)>>>(pq, cfg, live);
  check_launch("attention_forward_sm90_kernel");
  return true;
}

// The portable (mma.sync, sm_80 and later) forward kernel, with its own head dimensions for
// queries and keys (DK) and values (DV).
template <class T, int DK, int DV, class Rows, class Config>
void launch_portable_forward(const detail::AttentionParams& p, const Config& cfg, const LiveKeyTiles& live = {}) {
  const detail::AttentionParams pq = with_heads_per_sweep(p, Pass::forward, kForwardBQ);
  const dim3 grid = query_tile_grid(pq, kForwardBQ);
  if (grid.x == 0 || grid.z == 0) return;
  auto kernel = attention_forward_kernel<T, DK, DV, Rows, Config>;
  const int smem = ForwardSmem<T, DK, DV>::kBytes;
  allow_shared_memory(kernel, smem);
  kernel<<<grid, 32 * kForwardWarps, smem, stream_of(p)>>>(pq, cfg, live);
  check_launch("attention_forward_kernel");
}

// live: the key tiles each block visits (key_tiles.cuh); by default every one.
// On Hopper, short sequences packed (packed_short_sequences) take the forward's instantiation
// for segments; the portable kernel runs them one to a block.
template <class T, int D, class Rows, class Config>
void launch_fused_forward(const detail::AttentionParams& p, const Config& cfg, const LiveKeyTiles& live = {}) {
  if constexpr (kHopperDim<D>) {
    if constexpr (kPacksShortSequences<Rows, Config>) {
      const detail::AttentionParams pk = packed_short_sequences<Rows>(p, cfg, live);
      if (pk.segment_len > 0 && launch_sm90_forward<T, D, Rows, Config, true>(pk, cfg, live)) return;
    }
    if (launch_sm90_forward<T, D, Rows>(p, cfg, live)) return;
  }
  launch_portable_forward<T, D, D, Rows>(p, cfg, live);
}

// Whether the fused backward of this instantiation runs the Hopper kernel.
template <class T, int D, class Rows, class Config>
bool fused_backward_on_hopper() {
  if constexpr (kHopperDim<D>) {
    return hopper_kernel_runs(attention_backward_sm90_kernel<T, D, Rows, Config>);
  } else {
    return false;
  }
}

// Key tiles per sequence of the backward, and the deterministic mode's counters one backward
// launch needs: one per (sequence, kv head, key tile), and per accumulator on Hopper, where dk
// and dv are added by different warpgroups.
inline int backward_key_tiles(const detail::AttentionParams& p) {
  return static_cast<int>((p.max_len_k + kBackwardBK - 1) / kBackwardBK);
}
inline std::size_t backward_order_counters(const detail::AttentionParams& p, bool sm90) {
  return p.deterministic ? static_cast<std::size_t>(p.num_seqs * p.heads_kv * backward_key_tiles(p)) * (sm90 ? 2 : 1)
                         : 0;
}

// The portable (mma.sync) backward kernel alone, with its own head dimensions for queries and
// keys (DK) and values (DV): adds dk and dv into acc's fp32 accumulators ([key row][kv head][DK]
// and [..][DV]), cleared by the caller; dq is written.
template <class T, int DK, int DV, class Rows, class Config>
void run_portable_backward(const detail::AttentionParams& p, const detail::GradientParams& g, const Config& cfg,
                           const KeyGradAccumulators& acc, const LiveKeyTiles& live = {}) {
  const detail::AttentionParams pq = with_heads_per_sweep(p, Pass::backward, kBackwardBQ);
  const dim3 grid = query_tile_grid(pq, kBackwardBQ);
  if (grid.x == 0 || grid.z == 0) return;
  auto kernel = attention_backward_kernel<T, DK, DV, Rows, Config>;
  const int smem = BackwardSmem<T, DK, DV>::kBytes;
  allow_shared_memory(kernel, smem);
  kernel<<<grid, 32 * kBackwardWarps, smem, stream_of(p)>>>(pq, g, cfg, acc, live);
  check_launch("attention_backward_kernel");
}

// The fused backward kernel alone: adds dk and dv into acc's fp32 accumulators (and advances
// its counters), cleared by the caller; dq is written.
template <class T, int D, class Rows, class Config>
void run_fused_backward(const detail::AttentionParams& p, const detail::GradientParams& g, const Config& cfg,
                        const KeyGradAccumulators& acc, const LiveKeyTiles& live = {}) {
  if constexpr (kHopperDim<D>) {
    if (fused_backward_on_hopper<T, D, Rows, Config>()) {
      using Shape = Sm90BackwardShape;
      const detail::AttentionParams pq = with_heads_per_sweep(p, Pass::backward, Shape::kBQ);
      const dim3 grid = query_tile_grid(pq, Shape::kBQ);
      if (grid.x == 0 || grid.z == 0) return;
      auto kernel = attention_backward_sm90_kernel<T, D, Rows, Config>;
      const int smem = Sm90BackwardSmem<T, D>::kBytes;
      allow_shared_memory(kernel, smem);
      kernel<<<grid, Shape::kThreads, smem, stream_of(p)>>>(pq, g, cfg, acc, live);
      check_launch("attention_backward_sm90_kernel");
      return;
    }
  }
  run_portable_backward<T, D, D, Rows>(p, g, cfg, acc, live);
}

template <class T, int D, class Rows, class Config>
void launch_fused_backward(const detail::AttentionParams& p, const detail::GradientParams& g,
                           const Config& cfg, const LiveKeyTiles& live = {}) {
  const bool sm90 = fused_backward_on_hopper<T, D, Rows, Config>();
  KeyGradAccumulators acc;
  // Both kernels own 128 query rows a block: with every sequence's queries in one block and a
  // kv head per query head, each key's gradient comes from one block (and is deterministic).
  static_assert(Sm90BackwardShape::kBQ == kBackwardBQ, "one test for both kernels");
  static_assert(sizeof(T) == 2, "clear_key_grads clears 16-bit elements");
  if (p.group_size() == 1 && aligned_rows(g.dk, p.dtype) && aligned_rows(g.dv, p.dtype) &&
      std::getenv("WINNOW_ACCUMULATED_KEY_GRADS") == nullptr) {
    // Packed segments of 128 / L sequences also leave each key to one block.
    const detail::AttentionParams pk =
        packed_short_sequences<Rows>(p, cfg, live, {&g.dout, &g.dstats, &g.dq, &g.dk, &g.dv});
    if (pk.max_len_q <= kBackwardBQ || pk.segment_len > 0) {
      acc.direct = true;
      // The kernels write the gradient of every key of every tile they visit. Keys in no such
      // tile keep whatever was there, so they are cleared first, unless there are none:
      // batched sequences, rows that visit every key they see, and a last key that is seen
      // or shares its tile with one that is (each block sees every key of its rows' sequences
      // up to its last row's).
      const bool every_key_visited = pk.cu_seqlens_k == nullptr && pk.len_q > 0 && rows_pack<Rows>(p, cfg, live) &&
                                     (pk.attend_current || (pk.len_k - 1) % kBackwardBK != 0);
      if (!every_key_visited) clear_key_grads(pk, g);
      run_fused_backward<T, D, Rows>(pk, g, cfg, acc, live);
      return;
    }
  }
  acc.deterministic = p.deterministic;
  acc.key_tiles = backward_key_tiles(p);
  const std::size_t grads = static_cast<std::size_t>(p.rows_k * p.heads_kv * D);
  const std::size_t bytes = (2 * grads + backward_order_counters(p, sm90)) * sizeof(float);
  DeviceBuffer buffer(p, bytes);
  if (bytes > 0) check(cudaMemsetAsync(buffer.as<void>(), 0, bytes, stream_of(p)), "clearing accumulators");
  acc.dk = buffer.as<float>();
  acc.dv = acc.dk + grads;
  acc.order = reinterpret_cast<int*>(acc.dv + grads);
  run_fused_backward<T, D, Rows>(p, g, cfg, acc, live);
  store_key_grads(p, g, acc.dk, acc.dv);
}

template <class T, simple::Mechanism M>
void launch_simple_forward(const detail::AttentionParams& p, const simple::Extras& x) {
  const dim3 grid(static_cast<unsigned>((p.max_len_q + simple::kRowsPerBlock - 1) / simple::kRowsPerBlock),
                  static_cast<unsigned>(p.heads_q), static_cast<unsigned>(p.num_seqs));
  if (grid.x == 0 || grid.z == 0) return;
  if constexpr (M == simple::Mechanism::entmax || M == simple::Mechanism::sieve) {
    const int smem = static_cast<int>(simple::kRowsPerBlock * p.dim_qk * sizeof(float));
    auto kernel = simple::thresholds_kernel<T, M>;
    allow_shared_memory(kernel, smem);
    kernel<<<grid, 32 * simple::kRowsPerBlock, smem, stream_of(p)>>>(p, x);
    check_launch("simple::thresholds_kernel");
  }
  const int smem = static_cast<int>(simple::kRowsPerBlock * (p.dim_qk + p.dim_v) * sizeof(float));
  auto kernel = simple::forward_kernel<T, M>;
  allow_shared_memory(kernel, smem);
  kernel<<<grid, 32 * simple::kRowsPerBlock, smem, stream_of(p)>>>(p, x);
  check_launch("simple::forward_kernel");
}

template <class T, simple::Mechanism M>
void launch_simple_backward(const detail::AttentionParams& p, const detail::GradientParams& g,
                            const simple::Extras& x) {
  const std::size_t dk = static_cast<std::size_t>(p.rows_k * p.heads_kv * p.dim_qk);
  const std::size_t dv = static_cast<std::size_t>(p.rows_k * p.heads_kv * p.dim_v);
  DeviceBuffer buffer(p, (dk + dv) * sizeof(float));
  if (dk + dv > 0) check(cudaMemsetAsync(buffer.as<void>(), 0, (dk + dv) * sizeof(float), stream_of(p)), "clearing accumulators");
  const dim3 grid(static_cast<unsigned>(p.heads_kv), static_cast<unsigned>(p.num_seqs));
  if (grid.x > 0 && grid.y > 0) {
    const int smem = static_cast<int>((2 * p.dim_qk + p.dim_v + simple::kBackwardThreads) * sizeof(float));
    auto kernel = simple::backward_kernel<T, M>;
    allow_shared_memory(kernel, smem);
    kernel<<<grid, simple::kBackwardThreads, smem, stream_of(p)>>>(p, g, x, buffer.as<float>(),
                                                                   buffer.as<float>() + dk);
    check_launch("simple::backward_kernel");
  }
  store_key_grads(p, g, buffer.as<float>(), buffer.as<float>() + dk);
}

// Calls fn.template operator()<T, D>() for the fused path's head dimension, D 64 or 128, of one
// element type (a file that compiles one type's kernels).
template <class T, class Fn>
void dispatch_fused_dims(const detail::AttentionParams& p, Fn&& fn) {
  p.dim_qk == 64 ? fn.template operator()<T, 64>() : fn.template operator()<T, 128>();
}

// Calls fn.template operator()<T, D>() for the fused path's (dtype, head dimension): D 64 or
// 128, and with SmallDims (a mechanism whose calls fused_path_applies admitted with
// small_dims) also 16 and 32.
template <bool SmallDims = false, class Fn>
void dispatch_fused(const detail::AttentionParams& p, Fn&& fn) {
  const bool bf16 = p.dtype == DType::bfloat16;
  if constexpr (SmallDims) {
    if (p.dim_qk == 16) {
      bf16 ? fn.template operator()<__nv_bfloat16, 16>() : fn.template operator()<__half, 16>();
      return;
    }
    if (p.dim_qk == 32) {
      bf16 ? fn.template operator()<__nv_bfloat16, 32>() : fn.template operator()<__half, 32>();
      return;
    }
  }
  bf16 ? dispatch_fused_dims<__nv_bfloat16>(p, fn) : dispatch_fused_dims<__half>(p, fn);
}

template <class Fn>
void dispatch_simple(const detail::AttentionParams& p, Fn&& fn) {
  switch (p.dtype) {
    case DType::float32: return fn.template operator()<float>();
    case DType::float16: return fn.template operator()<__half>();
    case DType::bfloat16: return fn.template operator()<__nv_bfloat16>();
    default: throw Error(ErrorKind::unsupported, "winnow: no CUDA kernels for this dtype");
  }
}

// ---------------------------------------------------------------- key-stationary backward
// (backward_keys_sm90.cuh), for mechanisms whose gradients need only per-row statistics.

// Whether it may take a call: not in the deterministic mode (its dQ sums arrive in any order),
// not for short sequences whose rows fit one block (the row kernel writes their dK and dV
// directly, with no accumulator at all), and with dK, dV rows it can store 4 bytes at a time.
inline bool keys_backward_fits(const detail::AttentionParams& p, const detail::GradientParams& g) {
  if (p.deterministic) return false;
  if (!aligned_rows(g.dk, p.dtype) || !aligned_rows(g.dv, p.dtype)) return false;
  if (p.max_len_q <= kBackwardBQ && p.group_size() == 1) return false;
  // Its row buffers (and the fp32 dQ accumulator) pad every sequence to the longest one's whole
  // query tiles. A packed batch of skewed lengths would make that many times the rows there are
  // (1000 sequences of 100 tokens beside one of 8192: 76x); such batches take the row kernel,
  // whose accumulators follow the key rows.
  constexpr int BQ = Sm90KeysBackwardShape::kBQ;
  const std::int64_t padded = (p.max_len_q + BQ - 1) / BQ * BQ;
  if (p.num_seqs * padded > 2 * p.rows_q + BQ * p.num_seqs) return false;
  // Grid and helper-grid dimensions y and z (kv heads, query heads, sequences) stay within 65535.
  return p.max_len_k / Sm90KeysBackwardShape::kBK < 65535 && p.heads_q <= 65535 && p.num_seqs <= 65535;
}

// Its buffers' geometry: rows padded to whole query tiles; `padded_rows` per statistic.
inline KeysBackwardBuffers keys_backward_buffers(const detail::AttentionParams& p) {
  constexpr int BQ = Sm90KeysBackwardShape::kBQ;
  KeysBackwardBuffers buf;
  buf.padded_len = (p.max_len_q + BQ - 1) / BQ * BQ;
  return buf;
}
inline std::size_t keys_backward_padded_rows(const detail::AttentionParams& p, const KeysBackwardBuffers& buf) {
  return static_cast<std::size_t>(p.heads_q * p.num_seqs * buf.padded_len);
}

template <class T, int D, class Keys>
bool keys_backward_runs() {
  return hopper_kernel_runs(attention_backward_keys_sm90_kernel<T, D, Keys>);
}

// The kernel over every key block; buf's statistics and the mechanism's dQ accumulators ready.
template <class T, int D, class Keys>
void launch_keys_backward_kernel(const detail::AttentionParams& p, const detail::GradientParams& g,
                                 KeysBackwardBuffers buf, const Keys& keys, const char* name) {
  using Shape = Sm90KeysBackwardShape;
  const std::int64_t key_blocks = (p.max_len_k + Shape::kBK - 1) / Shape::kBK;
  buf.heads_per_sweep = heads_per_sweep(Pass::backward, key_blocks, p.heads_kv);
  const dim3 grid(static_cast<unsigned>(key_blocks * buf.heads_per_sweep),
                  static_cast<unsigned>((p.heads_kv + buf.heads_per_sweep - 1) / buf.heads_per_sweep),
                  static_cast<unsigned>(p.num_seqs));
  if (grid.x == 0 || grid.y == 0 || grid.z == 0) return;
  auto kernel = attention_backward_keys_sm90_kernel<T, D, Keys>;
  const int smem = Sm90KeysBackwardSmem<T, D>::kBytes;
  allow_shared_memory(kernel, smem);
  // The operands by tensor copies where all four can be mapped; the statistics' bulk copies
  // need 16-byte aligned rows (whole padded tiles of floats from an aligned base).
  KeysBackwardLoads loads;
  loads.tensor = p.cu_seqlens_q == nullptr && aligned_to(buf.row_stats[0], 16) && aligned_to(buf.row_stats[1], 16) &&
                 row_tile_map(loads.q, keys.queries(p), p.dtype, p.num_seqs, p.len_q, p.heads_q, D, Shape::kBQ) &&
                 row_tile_map(loads.dout, g.dout, p.dtype, p.num_seqs, p.len_q, p.heads_q, D, Shape::kBQ) &&
                 row_tile_map(loads.k, keys.keys(p), p.dtype, p.num_seqs, p.len_k, p.heads_kv, D, Shape::kBK) &&
                 row_tile_map(loads.v, p.v, p.dtype, p.num_seqs, p.len_k, p.heads_kv, D, Shape::kBK);
  if (loads.tensor) count_tensor_map_launch();
  kernel<<<grid, Shape::kThreads, smem, stream_of(p)>>>(p, g, buf, keys, loads);
  check_launch(name);
}

}  // namespace winnow::cuda
