// The key-stationary backward on Hopper (sm_90a): a block owns 128 keys of one kv head and
// sweeps the query tiles (of 64) that see them, for every query head of the group. dK and dV
// stay in registers for the whole sweep and are written once, in the operand's dtype; dQ is the
// only sum that crosses blocks, added into an fp32 accumulator.
//
// Which mechanisms take it: those whose weight and score gradient at (row, key) need only the
// score, dP and two per-row numbers (Keys, the mechanism's policy below): softmax (the row's
// log-sum-exp and delta = <dO, O>) and threshold attention (the row's tau and tau / beta; TDA's
// two views are two launches).
// Stick-breaking's prefix sums run along the keys of a row, so it keeps the row-sweeping kernel
// (backward_sm90.cuh), which keeps dQ in place and pays for it by adding 2 x 64 x D floats of dK
// and dV per 128 x 64 tile into global memory. Here per 64 x 128 tile 64 x D floats of dQ go out, and dK, dV come from register
// operands without a round trip through shared memory (FlashAttention-2's order).
//
// Three warpgroups:
//   producer   copies the block's K and V once, then per query tile Q, dO and the rows' two
//              statistics (precomputed, padded to whole tiles) into a ring of stages: by
//              tensor copies that one thread issues where the host could map the operands
//              (KeysBackwardLoads), else by cp.async from all 128 threads, each copy a fixed
//              step from the one before;
//   consumers  two warpgroups of 64 keys each. Per query tile i, in two rounds of products
//              that the consumers take turns to issue (c0, c1, c0, c1: one's element-wise
//              work runs while the other's products do):
//                round 1: S^T = K Q^T, dP^T = V dO^T       wgmma, operands in shared memory
//                P^T, dS^T in registers (Keys::grad; scale folded into dS), dS^T -> shared
//                round 2: dV += P^T dO | dQ_{i-1} | dK += dS^T Q
//                         dV and dK from register operands; dQ of the tile before, from its
//                         dS^T in shared memory: at D = 128 consumer c adds dQ's columns
//                         64c .. 64c + 63 over all 128 keys (both consumers' dS^T, in place
//                         since the turn), at D = 64 its own keys' share
//                dQ_{i-1} reduced into the accumulator (16-byte atomics) while dK's product runs.
// The deterministic mode, softmax's gradient of the log-sum-exp, and short sequences (one block
// of rows; the row kernel writes their dK and dV directly) stay with the row kernel.
// Measured (docs/performance.md): the turns against consumers in step (meeting at dS^T each
// tile, dQ of the same tile): 3-5% faster backward (2026-11-28); in step, dQ before dK against
// dQ after it: 6-7% at D = 128.
// Measured and not kept (2026-11-26, softmax): issuing the next tile's S^T and dP^T before this
// tile's dQ reductions (spills, slower); three stages (no faster); dQ handed to two producer
// warps through shared memory for bulk reductions (no faster at D = 64); waiting for S^T alone,
// computing P^T while dP^T runs and issuing dV's product before dS^T is computed (1-2% slower
// at D = 128, 4-6% at D = 64).
#pragma once

#include <cmath>
#include <cstdint>

#include "cuda/attention/geometry.cuh"
#include "cuda/attention/key_tiles.cuh"
#include "cuda/tile/fragment.cuh"
#include "cuda/tile/hopper.cuh"
#include "cuda/tile/panel_tile.cuh"
#include "cuda/tile/rows.cuh"

namespace winnow::cuda {

// Per (query head, sequence, padded row) buffers of the key-stationary backward: rows of a
// sequence are padded to whole query tiles, so the producer copies a tile's statistics without
// bounds; padding rows carry statistics that give them weight 0 and dS 0 (the mechanism's).
struct KeysBackwardBuffers {
  float* row_stats[2] = {nullptr, nullptr};  // the mechanism's two per-row numbers (Keys)
  std::int64_t padded_len = 0;
  // kv heads whose key blocks interleave in the grid's order (x = key block * this + head in
  // the group), as cuda::heads_per_sweep (launch.h) chooses: with one, each head's heaviest
  // block (its first keys) starts less than a block's run before the end of the launch for
  // the last head (at L = 8192, B 4, 16 heads a schedule simulation puts that tail at 2.9% of
  // the sweep; 0.1% with two), while the blocks running at once still share the Q, dO and dQ
  // of about three (head, sequence) pairs in L2.
  int heads_per_sweep = 1;
  // Where the forward found weights that can be nonzero (TileSupport: a bit per 64 query rows
  // and 128 keys, the kernel's tiles and blocks), recorded when its flag is set: a block then
  // sweeps only the query tiles whose bit is, loads and products alike (threshold attention at
  // a high beta, where most are exact zeros). bits == nullptr, or the flag 0: every tile.
  TileSupport support;

  __device__ __forceinline__ std::int64_t row_index(const AttentionParams& p, std::int64_t h, std::int64_t b,
                                                    std::int64_t r) const {
    return (h * p.num_seqs + b) * padded_len + r;
  }
};

// How the producer copies K, V and each query tile's Q and dO: through the host's tensor maps when
// `tensor` (batched operands whose base and strides are multiples of 16 bytes: tensor_maps.h),
// else with cp.async. A kernel parameter (__grid_constant__), where the copy engine reads maps.
struct KeysBackwardLoads {
  tile::RowTileMap q, dout, k, v;  // boxes of a query tile's rows (q, dout), a key block's (k, v)
  bool tensor = false;
};

struct Sm90KeysBackwardShape {
  static constexpr int kBK = 128;  // keys per block: two consumer warpgroups of 64
  static constexpr int kBQ = 64;   // query rows per tile
  static constexpr int kStages = 2;
  static constexpr int kThreads = 384;
  static constexpr int kProducerRegisters = 24;
  static constexpr int kConsumerRegisters = 240;
};

// What the kernel asks of a mechanism (Keys, passed by value):
//   queries(p), keys(p)           the queries and keys the scores take (p.q, p.k, or a
//                                 mechanism's own: threshold attention's normalized rows)
//   begin(p, h)                   a query tile of head h follows (per-head constants)
//   grad(z, dp, a, b, visible)    score z -> P (the weight dV takes), dP -> dS (as dK and dQ take
//                                 it, scale included); a, b: the row's two statistics
//   after_grads(ds, b, tig)       dS of the tile (P packed already); b: the columns' second
//                                 statistics (column 8 n + 2 tig + e at b[8 n + 2 tig + e])
//   dq_scale()                    a factor on the tile's dQ (1 but for TDA's second view)
//   end(p, h)                     the tiles of head h are done (per-head sums out)
//   dq_row(p, buf, seq, h, b, row)
//                                 the fp32 dQ accumulator of row `row` of the sequence
//   store_keys<T, D>(p, g, dk, dv, b, seq, hk, my_key, tig)
//                                 dK and dV of this thread's keys
//   kSkipsZeroTiles               optional (default false): where a consumer's P^T and dS^T are
//                                 all exact zeros its dV and dK products are not issued, and
//                                 where both consumers' are (each's at D = 64) the dQ product
//                                 and its reductions are not either (threshold attention)
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
  static constexpr int kDsBuffers = 3;  // dS^T of tiles i - 1 (dQ's, staggered) and i, and one in reuse
  static constexpr int kStats = kDS + kDsBuffers * GradTile::kBytes;
  static constexpr int kFlags = kStats + Shape::kStages * kStatsBytes;  // int per (dS buffer, consumer)
  // The block's live query tiles (KeysBackwardBuffers::support), a bit each: a sweep of more
  // tiles than this holds visits them all.
  static constexpr int kLiveWords = 256;
  static constexpr int kLive = kFlags + 4 * 2 * kDsBuffers;
  static constexpr int kSync = kLive + 4 * kLiveWords;
  static constexpr int kSyncBytes = 8 * (1 + 2 * Shape::kStages);
  static constexpr int kBytes = kSync + kSyncBytes + 1024;
};

// A thread's two key rows of a [key][D] fragment (rows my_key and my_key + 8, columns
// 8 n + 2 tig + e) into rows of T at base + key * row_stride, those inside the sequence.
template <class T, int DT>
__device__ __forceinline__ void store_key_rows(T* base, std::int64_t row_stride, const float (&x)[DT][4],
                                               std::int64_t k_len, std::int64_t my_key, int tig) {
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const std::int64_t key = my_key + 8 * half;
    if (key >= k_len) continue;
    tile::store_fragment_row<T>(base + key * row_stride, x, half, tig);
  }
}

// Named barriers: 2, 3 each consumer's own; 4, 5 the consumers' turns.
inline constexpr int kKeysBwdConsumerBarrier = 2, kKeysBwdTurnBarrier = 4;

template <class T, int D, class Keys>
__global__ void __launch_bounds__(Sm90KeysBackwardShape::kThreads, 1)
    attention_backward_keys_sm90_kernel(const AttentionParams p, const detail::GradientParams g,
                                        const KeysBackwardBuffers buf, Keys keys,
                                        const __grid_constant__ KeysBackwardLoads loads) {
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
  // The tiles this block visits: all, or those the forward's support map marks for its keys
  // (tile i: query head hk group + i / tiles_per_head, rows from (first_tile + i % tiles_per_head) BQ).
  static_assert(BQ == kSupportRows && BK == kCellKeys, "a tile is a row tile of the support map, a block its cell");
  std::uint32_t* const live_mask = reinterpret_cast<std::uint32_t*>(smem + Smem::kLive);
  const bool sparse = buf.support.bits != nullptr && p.segment_len == 0 && tiles <= 32 * Smem::kLiveWords &&
                      *buf.support.flag != 0;
  if (sparse) {
    const std::int64_t cell = k0 / kCellKeys;
    for (int w = tid / 32; 32 * w < tiles; w += Shape::kThreads / 32) {
      const int i = 32 * w + tid % 32;
      bool live = false;
      if (i < tiles) {
        const std::uint32_t* row = buf.support.row(p, b, hk * group + i / tiles_per_head, seq,
                                                   static_cast<std::int64_t>(first_tile + i % tiles_per_head) * BQ);
        live = ((row[cell >> 5] >> (cell & 31)) & 1u) != 0;
      }
      const std::uint32_t word = __ballot_sync(0xffffffffu, live);
      if (tid % 32 == 0) live_mask[w] = word;
    }
  }
  auto is_live = [&](int i) { return !sparse || ((live_mask[i >> 5] >> (i & 31)) & 1u) != 0; };
  // The first visited tile at or after i, or tiles.
  auto next_live = [&](int i) {
    if (!sparse) return i < tiles ? i : tiles;
    while (i < tiles) {
      const std::uint32_t word = live_mask[i >> 5] >> (i & 31);
      if (word != 0) return min(i + __ffs(word) - 1, tiles);
      i = (i | 31) + 1;
    }
    return tiles;
  };
  if (tid == 0) {
    // With tensor copies one thread arrives (and the copies' bytes complete the phase); with
    // cp.async each of the L producer threads arrives when its own copies land.
    const int arrivals = loads.tensor ? 1 : L;
    tile::mbar_init(kv_full, arrivals);
    for (int s = 0; s < S; ++s) {
      tile::mbar_init(&full[s], arrivals);
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
    if (loads.tensor) {
      // One thread asks for everything: K and V, then per tile Q and dO (a copy a 64-column
      // panel) and the statistics (two bulk copies), counted in bytes on the stages' barriers.
      if (tid == 0) {
        const int bi = static_cast<int>(b);
        tile::prefetch_tensor_map(loads.q);
        tile::prefetch_tensor_map(loads.dout);
        tile::mbar_arrive_expecting(kv_full, 2 * KT::kBytes);
        k_tile().load_tensor(loads.k, static_cast<int>(hk), static_cast<int>(k0), bi, kv_full);
        v_tile().load_tensor(loads.v, static_cast<int>(hk), static_cast<int>(k0), bi, kv_full);
        constexpr std::uint32_t kTileBytes = 2 * RT::kBytes + Smem::kStatsBytes;
        // The statistics of the first tile, and the step to the next query head's (no 64-bit
        // index arithmetic a tile: the producer has 24 registers).
        const std::int64_t head_step = p.num_seqs * buf.padded_len;
        const float* stat_a = buf.row_stats[0] + buf.row_index(p, hk * group, b, first_tile * BQ);
        const float* stat_b = buf.row_stats[1] + (stat_a - buf.row_stats[0]);
        int i = 0, n = 0;  // tile i, the n-th visited
        for (int j = 0; j < group; ++j, stat_a += head_step, stat_b += head_step) {
          const int h = static_cast<int>(hk * group + j);
          for (int t = 0; t < tiles_per_head; ++t, ++i) {
            if (!is_live(i)) continue;
            const int s = n % S;
            const int r0 = (first_tile + t) * BQ;
            if (n >= S) tile::mbar_wait_sleepy(&empty[s], ((n / S) - 1) & 1);
            ++n;
            // Recomputed each tile, as the consumers do: hoisted, the maps' axes and the
            // stages' addresses held more registers than the producer has, and spilled.
            tiles_at = tile::opaque(smem);
            const KeysBackwardLoads& m = *tile::opaque(&loads);
            tile::mbar_arrive_expecting(&full[s], kTileBytes);
            q_tile(s).load_tensor(m.q, h, r0, bi, &full[s]);
            do_tile(s).load_tensor(m.dout, h, r0, bi, &full[s]);
            tile::bulk_load(stats(s), stat_a + t * BQ, BQ * sizeof(float), &full[s]);
            tile::bulk_load(stats(s) + BQ, stat_b + t * BQ, BQ * sizeof(float), &full[s]);
          }
        }
      }
      return;
    }
    constexpr int KP = KT::template row_stride_of<L>();
    const int kr = KT::template first_row_of<L>(tid);
    const std::int64_t k_left = seq.k_len - k0 - kr;
    const int k_valid = k_left <= 0 ? 0 : static_cast<int>((k_left + KP - 1) / KP);
    const std::int64_t key = k0 + kr < seq.k_len ? k0 + kr : 0;
    constexpr int P = RT::template row_stride_of<L>();
    const int r = RT::template first_row_of<L>(tid);
    {
      const detail::Operand& k = keys.keys(p);
      k_tile().template load_rows_async<L>(tid, k.at<const T>(b, seq.k_start + key, hk), KP * k.row, k_valid);
      v_tile().template load_rows_async<L>(tid, p.v.at<const T>(b, seq.k_start + key, hk), KP * p.v.row, k_valid);
      tile::mbar_arrive_on_copies(kv_full);
    }
    const detail::Operand& q = keys.queries(p);
    for (int i = next_live(0), n = 0; i < tiles; i = next_live(i + 1), ++n) {
      const int s = n % S;
      const std::int64_t h = hk * group + i / tiles_per_head;
      const std::int64_t r0 = static_cast<std::int64_t>(first_tile + i % tiles_per_head) * BQ;
      if (n >= S) tile::mbar_wait_sleepy(&empty[s], ((n / S) - 1) & 1);
      const std::int64_t left = seq.q_len - r0 - r;
      const int valid = left <= 0 ? 0 : static_cast<int>((left + P - 1) / P);
      const std::int64_t row = r0 + r < seq.q_len ? r0 + r : 0;
      q_tile(s).template load_rows_async<L>(tid, q.at<const T>(b, seq.q_start + row, h), P * q.row, valid);
      do_tile(s).template load_rows_async<L>(tid, g.dout.at<const T>(b, seq.q_start + row, h), P * g.dout.row, valid);
      if (tid < 2 * BQ / 4) {  // 16-byte chunks: the first statistic, then the second
        // Selected, not indexed: an indexed array of the parameters is copied to the stack.
        const int chunk = tid % (BQ / 4);
        const bool second = tid >= BQ / 4;
        const float* src = (second ? buf.row_stats[1] : buf.row_stats[0]) + buf.row_index(p, h, b, r0) + 4 * chunk;
        tile::cp_async_16(stats(s) + (second ? BQ : 0) + 4 * chunk, src, true);
      }
      tile::mbar_arrive_on_copies(&full[s]);
    }
  } else {
    // ---------------------------------------------------------------- consumers
    tile::registers_claim<Shape::kConsumerRegisters>();
    const int ctid = tid - 128, wg = tile::warp_uniform(ctid / 128), wtid = ctid % 128;
    const int warp = wtid / 32, lane = tid % 32, gq = lane / 4, tig = lane % 4;
    const std::int64_t kc = k0 + 64 * wg;                // this consumer's first key
    const std::int64_t my_key = kc + 16 * warp + gq;      // this thread's keys: my_key, my_key + 8

    float dv[D / 8][4], dk[D / 8][4];
    tile::zero(dv);
    tile::zero(dk);

    // S^T and dP^T of the n-th visited tile (stage n % S), one commit group.
    float sc[NT][4], dp[NT][4];
    auto issue_scores = [&](int n) {
      const int s = tile::warp_uniform(n % S);
      tile::mbar_wait(&full[s], (n / S) & 1);
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
    // P^T and dS^T of the tile at rows r0 (stage s) from S^T and dP^T, packed as operands, and
    // dS^T of this consumer's keys into rows 64 wg .. of the [key][query] tile dst.
    std::uint32_t pa[BQ / 16][4], dsa[BQ / 16][4];
    auto weigh = [&](int s, std::int64_t r0, const typename Smem::GradTile& dst) {
      // Columns are query rows r0 + 8 n + 2 tig + e, rows this thread's keys.
      const float* const stat_a = stats(s);
      const float* const stat_b = stat_a + BQ;
      const bool masked = kc + 63 > r0 + shift;
      // Key my_key + 8 half sees row r0 + c when 8 half - c <= r0 + shift - my_key (clamped:
      // only masked tiles compare, and there the difference is within a tile or two).
      const std::int64_t reach64 = r0 + shift - my_key;
      const int reach = static_cast<int>(reach64 < -1024 ? -1024 : reach64 > 1024 ? 1024 : reach64);
#pragma unroll
      for (int n = 0; n < NT; ++n) {
        const float2 a = *reinterpret_cast<const float2*>(stat_a + 8 * n + 2 * tig);
        const float2 c = *reinterpret_cast<const float2*>(stat_b + 8 * n + 2 * tig);
#pragma unroll
        for (int half = 0; half < 2; ++half) {
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const bool visible = !masked || 8 * half - (8 * n + 2 * tig + e) <= reach;
            keys.grad(sc[n][2 * half + e], dp[n][2 * half + e], e ? a.y : a.x, e ? c.y : c.x, visible);
          }
        }
      }
      tile::to_operand<T>(sc, pa);
      // With P packed, the mechanism's sums over dS that need the second statistic (a
      // threshold's dbeta: taken per score beside P, they held 22 more registers and spilled).
      keys.after_grads(dp, stat_b, tig);
      tile::to_operand<T>(dp, dsa);
      // Key rows 64 wg + 16 warp + gq and 8 rows (1024 bytes) further are gq mod 8.
      const std::uint32_t row = dst.row_address(64 * wg + 16 * warp + gq, gq) + 4 * tig;
#pragma unroll
      for (int half = 0; half < 2; ++half) {
#pragma unroll
        for (int n = 0; n < NT; ++n) {
          tile::st_shared_b32(Smem::GradTile::chunk_address(row, n) + 1024 * half, dsa[n / 2][2 * (n % 2) + half]);
        }
      }
      tile::fence_to_async_proxy();
    };
    // live: whether this consumer's P^T or dS^T has a nonzero entry (always true without the
    // policy), by a vote over the warpgroup so that the branches below are uniform over it.
    // The vote is taken where the tile's first row (its smallest threshold) makes zero tiles
    // likely, a test both consumers make alike, so they agree on the barriers below.
    auto votes_on = [&](int s) {
      if constexpr (kSkipsZeroTiles<Keys>) return Keys::zero_tiles_likely(stats(s)[0], p);
      return false;
    };
    auto vote_live = [&](bool votes) {
      if constexpr (kSkipsZeroTiles<Keys>) {
        if (votes) return tile::named_sync_or(kKeysBwdConsumerBarrier + wg, 128, tile::any_nonzero(pa) || tile::any_nonzero(dsa));
      }
      return true;
    };
    auto issue_dv = [&](int s) {
#pragma unroll
      for (int ks = 0; ks < BQ / 16; ++ks) {
        tile::wgmma_rs<T, D, 1>(dv, pa[ks], do_tile(s).mn_major(16 * ks), true);
      }
    };
    auto issue_dk = [&](int s) {
#pragma unroll
      for (int ks = 0; ks < BQ / 16; ++ks) {
        tile::wgmma_rs<T, D, 1>(dk, dsa[ks], q_tile(s).mn_major(16 * ks), true);
      }
    };
    // dQ's panel of a query tile from its dS^T (at D = 128 both consumers' halves, consumer c
    // taking dQ's columns 64c ..; at D = 64 this consumer's keys alone), one commit group.
    float dq[8][4];
    auto issue_dq = [&](const typename Smem::GradTile& src) {
      tile::fresh(dq);
      if constexpr (kShareDs) {
#pragma unroll
        for (int ks = 0; ks < BK / 16; ++ks) {
          tile::wgmma_ss<T, 64, 1, 1>(dq, src.mn_major(16 * ks), k_tile().mn_major(16 * ks, wg), ks > 0);
        }
      } else {
#pragma unroll
        for (int ks = 0; ks < 4; ++ks) {
          tile::wgmma_ss<T, 64, 1, 1>(dq, src.mn_major(64 * wg + 16 * ks), k_tile().mn_major(64 * wg + 16 * ks), ks > 0);
        }
      }
      tile::wgmma_commit();
    };
    // dQ (times factor f) into the accumulator rows r0 .. of head h.
    auto reduce_dq = [&](std::int64_t r0, std::int64_t h, float f) {
      const bool odd = (tig & 1) != 0;
      const std::int64_t row = r0 + 16 * warp + gq + (odd ? 8 : 0);
      float* const dq_row = row < seq.q_len ? keys.dq_row(p, buf, seq, h, b, row) : nullptr;
      float* const out = dq_row != nullptr ? dq_row + (kShareDs ? 64 * wg : 0) + 2 * (tig & ~1) : nullptr;
      // A factor only TDA's second view has: skipped (uniformly) at 1.
      if (f != 1.f) {
#pragma unroll
        for (int n = 0; n < 8; ++n) {
#pragma unroll
          for (int c = 0; c < 4; ++c) dq[n][c] *= f;
        }
      }
      tile::red_add_row_quads(out, dq, odd);
    };
    auto tile_head = [&](int i) { return hk * group + i / tiles_per_head; };
    auto tile_row = [&](int i) { return static_cast<std::int64_t>(first_tile + i % tiles_per_head) * BQ; };
    // Whether visited tile i is its head's last visited one (`next` the next visited).
    auto head_ends = [&](int i, int next) { return next == tiles || next / tiles_per_head != i / tiles_per_head; };

    tile::mbar_wait(kv_full, 0);
    // The consumers take turns issuing (two named barriers, as the forward's): per tile i a
    // consumer issues S^T, dP^T (round 1), and after its element-wise work dV, dK of tile i
    // with dQ of tile i - 1 (round 2). The products reach the matrix units in the order
    // c0 round 1, c1 round 1, c0 round 2, c1 round 2, so one consumer's weights and dQ
    // reductions run while the other's products do. dQ lags a tile so that at D = 128 both
    // halves of its dS^T are in place without a wait: the other consumer stored its half
    // before giving the turn that this round took. Three dS^T buffers: tile i's is written
    // while tiles i - 1's is read, and the one before may still be read by the other
    // consumer's last round. Consumer 1 gives no turn back after its last round, so every
    // turn given is taken.
    const int my_turn = kKeysBwdTurnBarrier + wg, other_turn = kKeysBwdTurnBarrier + 1 - wg;
    int* const flags = reinterpret_cast<int*>(smem + Smem::kFlags);  // [dS buffer][consumer] live
    float prev_f = 1.f;
    bool prev_votes = false, prev_live = true;
    // Visited tiles: n counts them (stages, dS^T buffers, turns), i is the n-th, prev the one before.
    int visits = 0;
    if (sparse) {
      for (int w = 0; 32 * w < tiles; ++w) visits += __popc(live_mask[w]);
    } else {
      visits = tiles;
    }
    int i = next_live(0), prev = 0;
    for (int n = 0; visits > 0 && n <= visits; ++n) {
      const bool has_tile = n < visits;
      const int s = tile::warp_uniform(n % S);
      const std::int64_t h = tile_head(has_tile ? i : 0), r0 = tile_row(has_tile ? i : 0);
      const int next = has_tile ? next_live(i + 1) : tiles;
      tiles_at = tile::opaque(smem);
      bool votes = false, live = true;
      if (has_tile) {
        keys.begin(p, h);
        if (n > 0 || wg == 1) tile::named_sync(my_turn, 256);
        issue_scores(n);
        tile::named_arrive(other_turn, 256);
        tile::wgmma_wait<0>();
        tile::pin(sc);
        tile::pin(dp);
        weigh(s, r0, ds_tile(n % Smem::kDsBuffers));
        votes = votes_on(s);
        live = vote_live(votes);
        if constexpr (kSkipsZeroTiles<Keys>) {
          if (wtid == 0) flags[2 * (n % Smem::kDsBuffers) + wg] = live;
        }
      }
      // dQ of the tile before: at D = 128 live where either consumer's dS^T was (their flags
      // are in place, as their dS^T halves are).
      tile::named_sync(my_turn, 256);
      bool dq_live = n > 0;
      if (n > 0 && prev_votes) {
        const int* const f = flags + 2 * ((n - 1) % Smem::kDsBuffers);
        dq_live = kShareDs ? (f[0] | f[1]) != 0 : prev_live;
      }
      const bool kv_live = has_tile && live;
      const typename Smem::GradTile prev_ds = ds_tile((n + Smem::kDsBuffers - 1) % Smem::kDsBuffers);
      // Each branch issues its products whole and waits for the ones it reads: ptxas
      // serializes every product of the kernel for a branch around some of a sequence's
      // products (C7520), and for a read of an accumulator on a path where it could still
      // be in flight (C7514), which it finds across branches on related conditions.
      auto pass_turn = [&] {
        if (wg == 0 || has_tile) tile::named_arrive(other_turn, 256);
      };
      if (kv_live && dq_live) {
        tile::wgmma_fence();
        issue_dv(s);
        tile::wgmma_commit();
        issue_dq(prev_ds);
        issue_dk(s);
        tile::wgmma_commit();
        pass_turn();
        tile::wgmma_wait<1>();  // dV and dQ done, dK's product running
        tile::pin(dq);
        reduce_dq(tile_row(prev), tile_head(prev), prev_f);  // recomputed: registers are short
      } else if (kv_live) {
        tile::wgmma_fence();
        issue_dv(s);
        issue_dk(s);
        tile::wgmma_commit();
        pass_turn();
      } else if (dq_live) {
        tile::wgmma_fence();
        issue_dq(prev_ds);
        pass_turn();
        tile::wgmma_wait<0>();
        tile::pin(dq);
        reduce_dq(tile_row(prev), tile_head(prev), prev_f);
      } else {
        pass_turn();
      }
      // dK's product read the stage's Q; pa and dsa stay live until it has.
      tile::wgmma_wait<0>();
      tile::pin(dv);
      tile::pin(dk);
      tile::pin(pa);
      tile::pin(dsa);
      if (has_tile) {
        tile::mbar_arrive(&empty[s]);
        if (head_ends(i, next)) keys.end(p, h);
      }
      prev_f = keys.dq_scale();
      prev_votes = votes;
      prev_live = live;
      prev = i;
      i = next;
    }
    // The block's keys' whole gradients, in T.
    keys.template store_keys<T, D>(p, g, dk, dv, b, seq, hk, my_key, tig);
  }
#endif
}

}  // namespace winnow::cuda
