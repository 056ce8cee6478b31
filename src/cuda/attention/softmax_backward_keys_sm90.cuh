// Softmax's backward on Hopper (sm_90a) with the key tile held in place: a block owns 128
// keys of one kv head and sweeps the query tiles (of 64) that see them, for every query head
// of the group. dK and dV stay in registers for the whole sweep and are written once, in the
// operand's dtype; dQ is the only sum that crosses blocks, added into an fp32 accumulator.
//
// Why a second backward for softmax: the row-sweeping kernel (backward_sm90.cuh) keeps dQ in
// place because stick-breaking's prefix sums run along the keys of a row, and pays for it by
// adding 2 x 64 x D floats of dK and dV per 128 x 64 tile into global memory, with both
// consumers in lockstep around those sums. Softmax's weights need only the row's log-sum-exp
// and delta = <dO, O>, so the keys can stay put (FlashAttention-2's order): per 64 x 128 tile
// 64 x D floats of dQ go out, and dK, dV come from register operands without a round trip
// through shared memory.
//
// Three warpgroups:
//   producer   copies the block's K and V once, then per query tile Q, dO and the rows'
//              log2-sum-exp and delta (precomputed, padded to whole tiles) into a ring of
//              stages (cp.async, each copy a fixed step from the one before);
//   consumers  two warpgroups of 64 keys each. Per query tile:
//                S^T = K Q^T, dP^T = V dO^T        wgmma, operands in shared memory
//                P^T, dS^T                         in registers (scale folded into dS)
//                dV += P^T dO, dK += dS^T Q        wgmma, P^T and dS^T from registers
//                dS^T -> shared memory
//                D = 128: both consumers' dS^T in place, consumer c adds dQ's columns
//                  64c .. 64c + 63 over all 128 keys (dQ_c = dS K_c);
//                D = 64: each consumer adds dQ over its own 64 keys
//                then reduces its dQ tile into the accumulator (16-byte atomics).
// The deterministic mode, a gradient of the log-sum-exp, and short sequences (one block of
// rows; the row kernel writes their dK and dV directly) stay with the row kernel.
// Measured and not kept (docs/performance.md, 2026-11-26): issuing the next tile's S^T and
// dP^T before this tile's dQ reductions (spills, slower); three stages (no faster); dQ handed
// to two producer warps through shared memory for bulk reductions (no faster at D = 64);
// waiting for S^T alone, computing P^T while dP^T runs and issuing dV's product before dS^T is
// computed (1-2% slower at D = 128, 4-6% at D = 64).
#pragma once

#include <cmath>
#include <cstdint>

#include "cuda/attention/geometry.cuh"
#include "cuda/attention/rotary_epilogue.cuh"
#include "cuda/tile/fragment.cuh"
#include "cuda/tile/hopper.cuh"
#include "cuda/tile/panel_tile.cuh"
#include "cuda/tile/rows.cuh"
#include "math/softmax.h"

namespace winnow::cuda {

// Per (query head, sequence, padded row) buffers of the key-stationary backward: rows of a
// sequence are padded to whole query tiles, so the producer copies a tile's statistics without
// bounds, and padding rows carry lse = +inf (weight 0) and delta = 0.
struct SoftmaxKeysBackwardBuffers {
  float* lse_log2 = nullptr;  // the forward's log-sum-exp, in log2 units
  float* delta = nullptr;     // <dO_j, O_j>
  float* dq = nullptr;        // fp32 dQ, [query head][sequence][padded row][D]
  std::int64_t padded_len = 0;
  // kv heads whose key blocks interleave in the grid's order (x = key block * this + head in
  // the group), as cuda::heads_per_sweep (launch.h) chooses: with one, each head's heaviest
  // block (its first keys) starts less than a block's run before the end of the launch for
  // the last head (at L = 8192, B 4, 16 heads a schedule simulation puts that tail at 2.9% of
  // the sweep; 0.1% with two), while the blocks running at once still share the Q, dO and dQ
  // of about three (head, sequence) pairs in L2.
  int heads_per_sweep = 1;

  __device__ __forceinline__ std::int64_t row_index(const AttentionParams& p, std::int64_t h, std::int64_t b,
                                                    std::int64_t r) const {
    return (h * p.num_seqs + b) * padded_len + r;
  }
};

struct Sm90KeysBackwardShape {
  static constexpr int kBK = 128;  // keys per block: two consumer warpgroups of 64
  static constexpr int kBQ = 64;   // query rows per tile
  static constexpr int kStages = 2;
  static constexpr int kThreads = 384;
  static constexpr int kProducerRegisters = 24;
  static constexpr int kConsumerRegisters = 240;
};

template <class T, int D>
struct Sm90KeysBackwardSmem {
  using Shape = Sm90KeysBackwardShape;
  using KeyTile = tile::PanelTile<T, Shape::kBK, D>;             // K, V
  using RowTile = tile::PanelTile<T, Shape::kBQ, D>;             // Q, dO stages
  using GradTile = tile::PanelTile<T, Shape::kBK, Shape::kBQ>;  // dS^T [key][query]
  static constexpr int kStatsBytes = 2 * Shape::kBQ * 4;         // lse_log2, delta
  static constexpr int kK = 0;
  static constexpr int kV = kK + KeyTile::kBytes;
  static constexpr int kQ = kV + KeyTile::kBytes;
  static constexpr int kDO = kQ + Shape::kStages * RowTile::kBytes;
  static constexpr int kDS = kDO + Shape::kStages * RowTile::kBytes;
  static constexpr int kStats = kDS + 2 * GradTile::kBytes;
  static constexpr int kSync = kStats + Shape::kStages * kStatsBytes;
  static constexpr int kSyncBytes = 8 * (1 + 2 * Shape::kStages);
  static constexpr int kBytes = kSync + kSyncBytes + 1024;
};

// Named barriers: 1 both consumers; 2, 3 each consumer's own.
inline constexpr int kKeysBwdConsumersBarrier = 1, kKeysBwdConsumerBarrier = 2;

template <class T, int D>
__global__ void __launch_bounds__(Sm90KeysBackwardShape::kThreads, 1)
    softmax_backward_keys_sm90_kernel(const AttentionParams p, const detail::GradientParams g,
                                      const SoftmaxKeysBackwardBuffers buf) {
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using Shape = Sm90KeysBackwardShape;
  using Smem = Sm90KeysBackwardSmem<T, D>;
  constexpr int BK = Shape::kBK, BQ = Shape::kBQ, S = Shape::kStages, NT = BQ / 8;
  // dQ goes out a 64-wide panel of columns per consumer and tile. At D = 128 the consumers
  // split the columns (one panel each) over both consumers' dS^T; at D = 64 (one panel) each
  // adds its own keys' share, with no wait for the other consumer. (Each consumer adding its
  // own keys' share of both panels at D = 128 measured 25% slower: twice the reductions.)
  constexpr bool kShareDs = D == 128;
  static_assert(D == 64 || D == 128, "one 64-wide panel of dQ per consumer");
  extern __shared__ unsigned char smem_raw[];
  unsigned char* const smem = smem_raw + ((1024 - (tile::smem_address(smem_raw) & 1023)) & 1023);
  // The tiles' views: the consumers rebuild them each query tile from tile::opaque(smem).
  // Built once, their descriptors and the dS^T store addresses (some 35 registers at D = 128)
  // were hoisted out of the loop and spilled (100 bytes at D = 128, reloaded every tile).
  unsigned char* tiles_at = smem;
  auto k_tile = [&] { return typename Smem::KeyTile{tiles_at + Smem::kK}; };
  auto v_tile = [&] { return typename Smem::KeyTile{tiles_at + Smem::kV}; };
  auto q_tile = [&](int s) { return typename Smem::RowTile{tiles_at + Smem::kQ + s * Smem::RowTile::kBytes}; };
  auto do_tile = [&](int s) { return typename Smem::RowTile{tiles_at + Smem::kDO + s * Smem::RowTile::kBytes}; };
  auto ds_tile = [&](int b) { return typename Smem::GradTile{tiles_at + Smem::kDS + b * Smem::GradTile::kBytes}; };
  auto stats = [&](int s) { return reinterpret_cast<float*>(smem + Smem::kStats + s * Smem::kStatsBytes); };
  std::uint64_t* const kv_full = reinterpret_cast<std::uint64_t*>(smem + Smem::kSync);
  std::uint64_t* const full = kv_full + 1;
  std::uint64_t* const empty = full + S;
  constexpr int L = 128;  // producer threads

  const std::int64_t b = blockIdx.z;
  const std::int64_t hk = static_cast<std::int64_t>(blockIdx.y) * buf.heads_per_sweep + blockIdx.x % buf.heads_per_sweep;
  const SequenceExtent seq = p.sequence(b);
  const std::int64_t k0 = static_cast<std::int64_t>(blockIdx.x / buf.heads_per_sweep) * BK;
  if (k0 >= seq.k_len || hk >= p.heads_kv) return;
  // Key k is visible to query row r when k <= r + shift.
  const std::int64_t shift = seq.q_offset() - (p.attend_current ? 0 : 1);
  const std::int64_t first_row = k0 - shift > 0 ? k0 - shift : 0;
  const int first_tile = static_cast<int>(first_row / BQ);
  const int row_tiles = static_cast<int>((seq.q_len + BQ - 1) / BQ);
  const int tiles_per_head = first_row < seq.q_len ? row_tiles - first_tile : 0;
  const int group = static_cast<int>(p.group_size());
  const int tiles = group * tiles_per_head;

  const int tid = threadIdx.x;
  if (tid == 0) {
    tile::mbar_init(kv_full, L);
    for (int s = 0; s < S; ++s) {
      tile::mbar_init(&full[s], L);
      tile::mbar_init(&empty[s], 256);
    }
    tile::mbar_init_fence();
  }
  __syncthreads();

  if (tid < 128) {
    // ---------------------------------------------------------------- producer
    tile::registers_release<Shape::kProducerRegisters>();
    using KT = typename Smem::KeyTile;
    using RT = typename Smem::RowTile;
    {
      constexpr int P = KT::template row_stride_of<L>();
      const int r = KT::template first_row_of<L>(tid);
      const std::int64_t left = seq.k_len - k0 - r;
      const int valid = left <= 0 ? 0 : static_cast<int>((left + P - 1) / P);
      const std::int64_t key = k0 + r < seq.k_len ? k0 + r : 0;
      k_tile().template load_rows_async<L>(tid, p.k.at<const T>(b, seq.k_start + key, hk), P * p.k.row, valid);
      v_tile().template load_rows_async<L>(tid, p.v.at<const T>(b, seq.k_start + key, hk), P * p.v.row, valid);
      tile::mbar_arrive_on_copies(kv_full);
    }
    constexpr int P = RT::template row_stride_of<L>();
    const int r = RT::template first_row_of<L>(tid);
    for (int i = 0; i < tiles; ++i) {
      const int s = i % S;
      const std::int64_t h = hk * group + i / tiles_per_head;
      const std::int64_t r0 = static_cast<std::int64_t>(first_tile + i % tiles_per_head) * BQ;
      if (i >= S) tile::mbar_wait_sleepy(&empty[s], ((i / S) - 1) & 1);
      const std::int64_t left = seq.q_len - r0 - r;
      const int valid = left <= 0 ? 0 : static_cast<int>((left + P - 1) / P);
      const std::int64_t row = r0 + r < seq.q_len ? r0 + r : 0;
      q_tile(s).template load_rows_async<L>(tid, p.q.at<const T>(b, seq.q_start + row, h), P * p.q.row, valid);
      do_tile(s).template load_rows_async<L>(tid, g.dout.at<const T>(b, seq.q_start + row, h), P * g.dout.row, valid);
      if (tid < 2 * BQ / 4) {  // 16-byte chunks: lse_log2 then delta
        const int chunk = tid % (BQ / 4);
        const float* src = (tid < BQ / 4 ? buf.lse_log2 : buf.delta) + buf.row_index(p, h, b, r0) + 4 * chunk;
        tile::cp_async_16(stats(s) + (tid < BQ / 4 ? 0 : BQ) + 4 * chunk, src, true);
      }
      tile::mbar_arrive_on_copies(&full[s]);
    }
  } else {
    // ---------------------------------------------------------------- consumers
    tile::registers_claim<Shape::kConsumerRegisters>();
    const int ctid = tid - 128, wg = ctid / 128, wtid = ctid % 128;
    const int warp = wtid / 32, lane = tid % 32, gq = lane / 4, tig = lane % 4;
    const std::int64_t kc = k0 + 64 * wg;                // this consumer's first key
    const std::int64_t my_key = kc + 16 * warp + gq;      // this thread's keys: my_key, my_key + 8
    const float scale_log2 = static_cast<float>(p.scale * M_LOG2E), scale = static_cast<float>(p.scale);

    float dv[D / 8][4], dk[D / 8][4];
    tile::zero(dv);
    tile::zero(dk);
    tile::mbar_wait(kv_full, 0);

    // S^T and dP^T of tile i (stage i % S), one commit group.
    float sc[NT][4], dp[NT][4];
    auto issue_scores = [&](int i) {
      const int s = i % S;
      tile::mbar_wait(&full[s], (i / S) & 1);
      tile::fence_to_async_proxy();  // the copies were ordinary writes; wgmma reads asynchronously
      tile::fresh(sc);
      tile::fresh(dp);
      tile::wgmma_fence();
#pragma unroll
      for (int ks = 0; ks < D / 16; ++ks) {
        tile::wgmma_ss<T, BQ, 0, 0>(sc, k_tile().k_major(64 * wg, 16 * ks), q_tile(s).k_major(0, 16 * ks), ks > 0);
      }
#pragma unroll
      for (int ks = 0; ks < D / 16; ++ks) {
        tile::wgmma_ss<T, BQ, 0, 0>(dp, v_tile().k_major(64 * wg, 16 * ks), do_tile(s).k_major(0, 16 * ks), ks > 0);
      }
      tile::wgmma_commit();
    };
    // Each tile's products wait for the one before to finish. Issuing the next tile's S^T and
    // dP^T before this tile's dQ reductions (as the row kernel does) keeps 224 accumulator
    // registers live at D = 128: ptxas spilled 356 bytes, and it measured 8-15% slower.
    for (int i = 0; i < tiles; ++i) {
      const int s = i % S, ds_buf = i & 1;
      const std::int64_t h = hk * group + i / tiles_per_head;
      const std::int64_t r0 = static_cast<std::int64_t>(first_tile + i % tiles_per_head) * BQ;
      tiles_at = tile::opaque(smem);
      issue_scores(i);
      tile::wgmma_wait<0>();
      tile::pin(sc);
      tile::pin(dp);

      // P^T and dS^T: columns are query rows r0 + 8 n + 2 tig + e, rows this thread's keys.
      const float* const lse_s = stats(s);
      const float* const delta_s = lse_s + BQ;
      const bool masked = kc + 63 > r0 + shift;
      // Key my_key + 8 half sees row r0 + c when 8 half - c <= r0 + shift - my_key (clamped:
      // only masked tiles compare, and there the difference is within a tile or two).
      const std::int64_t reach64 = r0 + shift - my_key;
      const int reach = static_cast<int>(reach64 < -1024 ? -1024 : reach64 > 1024 ? 1024 : reach64);
#pragma unroll
      for (int n = 0; n < NT; ++n) {
        const float2 lse = *reinterpret_cast<const float2*>(lse_s + 8 * n + 2 * tig);
        const float2 del = *reinterpret_cast<const float2*>(delta_s + 8 * n + 2 * tig);
#pragma unroll
        for (int half = 0; half < 2; ++half) {
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const bool visible = !masked || 8 * half - (8 * n + 2 * tig + e) <= reach;
            float& z = sc[n][2 * half + e];
            const float pr = visible ? math::softmax::probability(z * scale_log2, e ? lse.y : lse.x, tile::exp2_fast)
                                     : 0.f;
            z = pr;
            dp[n][2 * half + e] = scale * math::softmax::grad_logit(pr, dp[n][2 * half + e], e ? del.y : del.x);
          }
        }
      }
      std::uint32_t pa[BQ / 16][4], dsa[BQ / 16][4];
      tile::to_operand<T>(sc, pa);
      tile::to_operand<T>(dp, dsa);

      // dS^T of this consumer's keys into rows 64 wg .. of the [key][query] tile.
      // Key rows 64 wg + 16 warp + gq and 8 rows (1024 bytes) further are gq mod 8.
      const typename Smem::GradTile dst = ds_tile(ds_buf);
      const std::uint32_t row = dst.row_address(64 * wg + 16 * warp + gq, gq) + 4 * tig;
#pragma unroll
      for (int half = 0; half < 2; ++half) {
#pragma unroll
        for (int n = 0; n < NT; ++n) {
          tile::st_shared_b32(Smem::GradTile::chunk_address(row, n) + 1024 * half, dsa[n / 2][2 * (n % 2) + half]);
        }
      }
      tile::fence_to_async_proxy();

      tile::wgmma_fence();
#pragma unroll
      for (int ks = 0; ks < BQ / 16; ++ks) {
        tile::wgmma_rs<T, D, 1>(dv, pa[ks], do_tile(s).mn_major(16 * ks), true);
      }
#pragma unroll
      for (int ks = 0; ks < BQ / 16; ++ks) {
        tile::wgmma_rs<T, D, 1>(dk, dsa[ks], q_tile(s).mn_major(16 * ks), true);
      }
      tile::wgmma_commit();

      if constexpr (kShareDs) {
        tile::named_sync(kKeysBwdConsumersBarrier, 256);  // both halves of dS^T are in place
      } else {
        tile::named_sync(kKeysBwdConsumerBarrier + wg, 128);  // this consumer's dS^T is in place
      }
      {
        const bool odd = (tig & 1) != 0;
        const std::int64_t row = r0 + 16 * warp + gq + (odd ? 8 : 0);
        float* const out =
            row < seq.q_len ? buf.dq + buf.row_index(p, h, b, row) * D + (kShareDs ? 64 * wg : 0) + 2 * (tig & ~1) : nullptr;
        float dq[8][4];
        tile::fresh(dq);
        tile::wgmma_fence();
        if constexpr (kShareDs) {
#pragma unroll
          for (int ks = 0; ks < BK / 16; ++ks) {
            tile::wgmma_ss<T, 64, 1, 1>(dq, dst.mn_major(16 * ks), k_tile().mn_major(16 * ks, wg), ks > 0);
          }
        } else {
#pragma unroll
          for (int ks = 0; ks < 4; ++ks) {
            tile::wgmma_ss<T, 64, 1, 1>(dq, dst.mn_major(64 * wg + 16 * ks), k_tile().mn_major(64 * wg + 16 * ks), ks > 0);
          }
        }
        tile::wgmma_commit();
        tile::wgmma_wait<0>();
        tile::pin(dq);
        tile::pin(dv);
        tile::pin(dk);
        tile::pin(pa);
        tile::pin(dsa);
        tile::mbar_arrive(&empty[s]);
        // Lanes tig and tig ^ 1 swap halves so each holds four consecutive columns of one row
        // (even lanes row gq, odd lanes row gq + 8): one 16-byte reduction instead of two.
#pragma unroll
        for (int n = 0; n < 8; ++n) {
          const float x0 = __shfl_xor_sync(0xffffffffu, odd ? dq[n][0] : dq[n][2], 1);
          const float x1 = __shfl_xor_sync(0xffffffffu, odd ? dq[n][1] : dq[n][3], 1);
          if (out == nullptr) continue;
          if (odd) {
            tile::red_add4(out + 8 * n, x0, x1, dq[n][2], dq[n][3]);
          } else {
            tile::red_add4(out + 8 * n, dq[n][0], dq[n][1], x0, x1);
          }
        }
      }
    }

    // The block's keys' whole gradients, in T (dK rotated back first where the operator rotated k).
    if (g.rotary_cos != nullptr) {
      const std::int64_t pos[2] = {my_key < seq.k_len ? my_key : -1, my_key + 8 < seq.k_len ? my_key + 8 : -1};
      rotate_back_fragment<D>(g, dk, pos, tig);
    }
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const std::int64_t key = my_key + 8 * half;
      if (key >= seq.k_len) continue;
      T* const out_k = g.dk.at<T>(b, seq.k_start + key, hk);
      T* const out_v = g.dv.at<T>(b, seq.k_start + key, hk);
#pragma unroll
      for (int n = 0; n < D / 8; ++n) {
        *reinterpret_cast<std::uint32_t*>(out_k + 8 * n + 2 * tig) = tile::pack2<T>(dk[n][2 * half], dk[n][2 * half + 1]);
        *reinterpret_cast<std::uint32_t*>(out_v + 8 * n + 2 * tig) = tile::pack2<T>(dv[n][2 * half], dv[n][2 * half + 1]);
      }
    }
  }
#endif
}

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
                                                  const SoftmaxKeysBackwardBuffers buf) {
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
#pragma unroll
  for (int m = kLanes / 2; m > 0; m >>= 1) delta += __shfl_xor_sync(0xffffffffu, delta, m);
  if (part == 0) {
    buf.lse_log2[buf.row_index(p, h, b, r)] =
        in_sequence ? *p.stats.at<const float>(b, seq.q_start + r, h) * static_cast<float>(M_LOG2E) : INFINITY;
    buf.delta[buf.row_index(p, h, b, r)] = delta;
  }
}

// The fp32 dQ accumulator into dq (T), rotated back where the operator rotated q: the lanes
// holding columns c and c + D/2 are kLanes / 2 apart in the warp.
template <class T, int D>
__global__ void softmax_backward_store_dq_kernel(const AttentionParams p, const detail::GradientParams g,
                                                 const SoftmaxKeysBackwardBuffers buf) {
  constexpr int kLanes = kHelperLanesPerRow<D>;
  const int part = static_cast<int>(threadIdx.x % kLanes), c = 8 * part;
  const std::int64_t r = static_cast<std::int64_t>(blockIdx.x) * kHelperRowsPerBlock<D> + threadIdx.x / kLanes;
  const std::int64_t h = blockIdx.y, b = blockIdx.z;
  const SequenceExtent seq = p.sequence(b);
  // A warp's rows may lie on both sides of the sequence's end: no lane returns before the shuffles.
  const bool in_sequence = r < seq.q_len;
  float v[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
  if (in_sequence) {
    const float* src = buf.dq + buf.row_index(p, h, b, r) * D + c;
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
