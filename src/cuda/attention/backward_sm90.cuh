// The fused backward kernel on Hopper (sm_90a), for the same backward row policies as the
// portable one (backward.cuh). Like it, a block owns 128 query rows of one head and sweeps key
// tiles (of 64) left to right, the order in which stick-breaking's prefix sums of g accumulate;
// dq stays in registers and dk, dv are reduced over the block's rows and added into fp32
// accumulators in global memory. Three warpgroups:
//   producer   copies Q and dO once, then K and V tiles into two rings of stages (cp.async,
//              keys permuted as in geometry.cuh, every copy a fixed step from the one before);
//   consumers  two warpgroups of 64 rows. Per key tile i, in two rounds of products that the
//              consumers take turns to issue (c0, c1, c0, c1: one's element-wise work and
//              sums into global memory run while the other's products do):
//                round 1: S = Q K^T, dP = dO V^T          wgmma, operands in shared memory
//                P, dS                                    the row policy, in registers
//                P, dS -> shared memory                   (three buffers, for the transposed
//                                                          products)
//                round 2: dQ += dS K | dV_{i-1} or dK_{i-1}
//                         dQ with dS from registers; consumer 0 dV_{i-1} = P^T dO, consumer 1
//                         dK_{i-1} = dS^T Q (64 keys x D over the block's 128 rows, both
//                         consumers' P or dS of the tile before, in place since the turn)
//                then adds dV_{i-1} or dK_{i-1} into the fp32 accumulator (atomics, or in the
//                deterministic mode in a fixed block order, one counter per accumulator) while
//                the other consumer's products run.
// Given live key tiles (key_tiles.cuh), producer and consumers walk the same live tiles; in the
// deterministic mode the others still take their turn.
#pragma once

#include <cstdint>

#include "cuda/attention/backward.cuh"
#include "cuda/attention/rotary_epilogue.cuh"
#include "cuda/tile/fragment.cuh"
#include "cuda/tile/hopper.cuh"
#include "cuda/tile/panel_tile.cuh"

namespace winnow::cuda {

struct Sm90BackwardShape {
  static constexpr int kBQ = 128;  // two consumer warpgroups of 64 rows
  static constexpr int kBK = 64;   // = kBackwardBK: the deterministic mode's counters per tile
  static constexpr int kStages = 2;
  static constexpr int kThreads = 384;
  static constexpr int kProducerRegisters = 24;
  static constexpr int kConsumerRegisters = 240;
};
static_assert(Sm90BackwardShape::kBK == kBackwardBK, "key tiles of the accumulators' counters");

template <class T, int D>
struct Sm90BackwardSmem {
  using Shape = Sm90BackwardShape;
  using RowTile = tile::PanelTile<T, Shape::kBQ, D>;            // Q, dO
  using KVTile = tile::PanelTile<T, Shape::kBK, D>;             // K, V stages
  using WeightTile = tile::PanelTile<T, Shape::kBQ, Shape::kBK>;  // P, dS [row][key]
  static constexpr int kQ = 0;
  static constexpr int kDO = kQ + RowTile::kBytes;
  static constexpr int kK = kDO + RowTile::kBytes;
  static constexpr int kV = kK + Shape::kStages * KVTile::kBytes;
  static constexpr int kWeightBuffers = 3;  // P and dS of tiles i, i - 1 and i - 2 (the turns)
  static constexpr int kP = kV + Shape::kStages * KVTile::kBytes;  // buffer b at kP + b * 2 * tile
  static constexpr int kSync = kP + 2 * kWeightBuffers * WeightTile::kBytes;
  static constexpr int kSyncBytes = 32 * Shape::kStages;
  static constexpr int kBytes = kSync + kSyncBytes + 1024;
  static_assert(kBytes <= 227 * 1024, "a block's shared memory on Hopper");
};

// Named barriers: 2, 3 each consumer's own; 4 the whole block, once the consumers have found
// the first key tile; 5, 6 the consumers' turns (5 + c: consumer c may issue).
inline constexpr int kBwdConsumerBarrier = 2, kBwdStartBarrier = 4, kBwdTurnBarrier = 5;

template <class T, int D, class Rows, class Config>
__global__ void __launch_bounds__(Sm90BackwardShape::kThreads, 1)
    attention_backward_sm90_kernel(const AttentionParams p, const detail::GradientParams g,
                                   const Config cfg, const KeyGradAccumulators acc,
                                   const LiveKeyTiles live) {
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using Shape = Sm90BackwardShape;
  using Smem = Sm90BackwardSmem<T, D>;
  constexpr int BQ = Shape::kBQ, BK = Shape::kBK, S = Shape::kStages, NT = BK / 8;
  extern __shared__ unsigned char smem_raw[];
  unsigned char* const smem = smem_raw + ((1024 - (tile::smem_address(smem_raw) & 1023)) & 1023);
  // The tiles' views: the consumers rebuild them each key tile from tile::opaque(smem), so that
  // their operand descriptors and the P / dS store addresses are not hoisted out of the loop
  // into registers that then spill.
  unsigned char* tiles_at = smem;
  auto q_tile = [&] { return typename Smem::RowTile{tiles_at + Smem::kQ}; };
  auto do_tile = [&] { return typename Smem::RowTile{tiles_at + Smem::kDO}; };
  auto k_tile = [&](int s) { return typename Smem::KVTile{tiles_at + Smem::kK + s * Smem::KVTile::kBytes}; };
  auto v_tile = [&](int s) { return typename Smem::KVTile{tiles_at + Smem::kV + s * Smem::KVTile::kBytes}; };
  auto p_tile = [&](int b) { return typename Smem::WeightTile{tiles_at + Smem::kP + (2 * b) * Smem::WeightTile::kBytes}; };
  auto ds_tile = [&](int b) {
    return typename Smem::WeightTile{tiles_at + Smem::kP + (2 * b + 1) * Smem::WeightTile::kBytes};
  };
  std::uint64_t* const k_full = reinterpret_cast<std::uint64_t*>(smem + Smem::kSync);
  std::uint64_t* const k_empty = k_full + S;
  std::uint64_t* const v_full = k_empty + S;
  std::uint64_t* const v_empty = v_full + S;
  __shared__ int block_first_tile;

  const QueryTile<BQ, BK> qt(p);
  if (qt.empty()) return;
  const KeyTileSweep<BK> sweep(p, live, qt);
  const int tid = threadIdx.x;
  if (tid == 0) {
    for (int s = 0; s < S; ++s) {
      tile::mbar_init(&k_full[s], 128);
      tile::mbar_init(&v_full[s], 128);
      tile::mbar_init(&k_empty[s], 256);
      tile::mbar_init(&v_empty[s], 256);
    }
    block_first_tile = qt.key_tiles;
    tile::mbar_init_fence();
  }
  __syncthreads();

  if (tid < 128) {
    // ---------------------------------------------------------------- producer
    tile::registers_release<Shape::kProducerRegisters>();
    tile::named_sync(kBwdStartBarrier, Shape::kThreads);
    const int first_tile = sweep.at_or_after(block_first_tile);
    const int ptid = tid;
    using KV = typename Smem::KVTile;
    using RT = typename Smem::RowTile;
    constexpr int P = KV::template row_stride_of<128>();
    const std::int64_t key0 = key_of_column<BK>(KV::template first_row_of<128>(ptid));
    const T* const k_base = p.k.at<const T>(qt.b, qt.s.k_start, qt.hk);
    const T* const v_base = p.v.at<const T>(qt.b, qt.s.k_start, qt.hk);
    for (int i = 0, kt = first_tile; kt < qt.key_tiles; ++i, kt = sweep.after(kt)) {
      const int s = i % S;
      if (i == 0) {
        const int q0 = RT::template first_row_of<128>(ptid);
        constexpr int QP = RT::template row_stride_of<128>();
        const std::int64_t left = qt.s.q_len - qt.r0 - q0;
        const int valid = left <= 0 ? 0 : static_cast<int>(left < BQ ? (left + QP - 1) / QP : BQ);
        const std::int64_t abs_row = qt.s.q_start + qt.r0 + q0;
        q_tile().template load_rows_async<128>(ptid, p.q.at<const T>(qt.b, abs_row, qt.h), QP * p.q.row, valid);
        do_tile().template load_rows_async<128>(ptid, g.dout.at<const T>(qt.b, abs_row, qt.h), QP * g.dout.row, valid);
      }
      const std::int64_t row = static_cast<std::int64_t>(kt) * BK + key0;
      const std::int64_t left = qt.s.k_len - row;
      const int valid = left <= 0 ? 0 : static_cast<int>(left < BK ? (left + P / 4 - 1) / (P / 4) : BK);
      if (i >= S) tile::mbar_wait_sleepy(&k_empty[s], ((i / S) - 1) & 1);
      k_tile(s).template load_rows_async<128>(ptid, k_base + row * p.k.row, (P / 4) * p.k.row, valid);
      tile::mbar_arrive_on_copies(&k_full[s]);
      if (i >= S) tile::mbar_wait_sleepy(&v_empty[s], ((i / S) - 1) & 1);
      v_tile(s).template load_rows_async<128>(ptid, v_base + row * p.v.row, (P / 4) * p.v.row, valid);
      tile::mbar_arrive_on_copies(&v_full[s]);
    }
  } else {
    // ---------------------------------------------------------------- consumers
    tile::registers_claim<Shape::kConsumerRegisters>();
    const int ctid = tid - 128, wg = tile::warp_uniform(ctid / 128), wtid = ctid % 128;
    const int warp = wtid / 32, lane = tid % 32, gq = lane / 4, tig = lane % 4;
    const std::int64_t row0 = qt.r0 + 64 * wg + 16 * warp + gq;  // this thread's rows: row0, row0 + 8
    RowMask mask;
    mask.limit[0] = qt.limit(p, row0);
    mask.limit[1] = qt.limit(p, row0 + 8);
    mask.tig = tig;
    Rows rows(p, g, cfg, qt, row0, tig);
    // A row's first key: where early halting stopped, and at least its segment's first.
    mask.first[0] = later_key(rows.first_key(0, mask), qt.first_key(p, row0));
    mask.first[1] = later_key(rows.first_key(1, mask), qt.first_key(p, row0 + 8));
    // The sweep starts at the key tile of the smallest first key of the block's rows (keys
    // left of a row's first key were dropped by early halting).
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      if (mask.limit[half] >= 0) atomicMin(&block_first_tile, static_cast<int>(mask.first[half] / BK));
    }
    tile::named_sync(kBwdStartBarrier, Shape::kThreads);
    const int first_tile = sweep.at_or_after(block_first_tile);
    const int own_barrier = kBwdConsumerBarrier + wg;
    // Consumer 0 accumulates dV, consumer 1 dK; each has its own order in the deterministic mode.
    float* const dst_base = wg == 0 ? acc.dv : acc.dk;
    const detail::Operand& direct_base = wg == 0 ? g.dv : g.dk;
    int* const order_base =
        wg == 0 || acc.order == nullptr ? acc.order : acc.order + p.num_seqs * p.heads_kv * acc.key_tiles;

    // Deterministic mode: this block's rank among those adding into key tile kt (launch order:
    // query heads of the group ascending, then grid x ascending), as in backward.cuh.
    const int group_index = static_cast<int>(qt.h - qt.hk * p.group_size());
    auto rank_and_counter = [&](int kt, int** counter) {
      const std::int64_t q_tiles = (qt.s.q_len + BQ - 1) / BQ;
      const std::int64_t need_row =
          static_cast<std::int64_t>(kt) * BK - qt.s.q_offset() + (p.attend_current ? 0 : 1);
      const std::int64_t first_q = need_row <= 0 ? 0 : (need_row + BQ) / BQ - 1;
      const int contributors = static_cast<int>(q_tiles - first_q);
      *counter = order_base + (qt.b * p.heads_kv + qt.hk) * acc.key_tiles + kt;
      return group_index * contributors + static_cast<int>(blockIdx.x);
    };
    auto wait_turn = [&](const int* counter, int rank) {
      if (wtid == 0) {
        int seen;
        do {
          asm volatile("ld.acquire.gpu.global.s32 %0, [%1];\n" : "=r"(seen) : "l"(counter) : "memory");
        } while (seen != rank);
      }
      tile::named_sync(own_barrier, 128);
    };
    auto pass_turn = [&](int* counter) {
      __threadfence();
      tile::named_sync(own_barrier, 128);
      if (wtid == 0) atomicAdd(counter, 1);
    };
    auto skip_turns = [&](int from, int to) {  // skipped tiles still take their turn
      if (!acc.deterministic) return;
      for (int kt = from; kt < to; ++kt) {
        int* counter;
        const int rank = rank_and_counter(kt, &counter);
        wait_turn(counter, rank);
        pass_turn(counter);
      }
    };
    skip_turns(0, first_tile);

    float dq[D / 8][4];
    tile::zero(dq);
    // S = Q K^T and dP = dO V^T of tile i (stage i % S), one commit group.
    float sc[NT][4], dp[NT][4];
    auto issue_scores = [&](int i) {
      const int s = tile::warp_uniform(i % S);
      tile::mbar_wait(&k_full[s], (i / S) & 1);
      tile::mbar_wait(&v_full[s], (i / S) & 1);
      tile::fence_to_async_proxy();  // the copies were ordinary writes; wgmma reads asynchronously
      tile::fresh(sc);
      tile::fresh(dp);
      tile::wgmma_fence();
#pragma unroll
      for (int ks = 0; ks < D / 16; ++ks) {
        tile::wgmma_ss<T, BK, 0, 0>(sc, q_tile().k_major(64 * wg, 16 * ks), k_tile(s).k_major(0, 16 * ks), ks > 0);
      }
#pragma unroll
      for (int ks = 0; ks < D / 16; ++ks) {
        tile::wgmma_ss<T, BK, 0, 0>(dp, do_tile().k_major(64 * wg, 16 * ks), v_tile(s).k_major(0, 16 * ks), ks > 0);
      }
      tile::wgmma_commit();
    };
    // P and dS of this warp's 16 rows into buffer b's [row][key] tiles. Rows 64 wg + 16 warp +
    // gq and 8 rows (1024 bytes) further are gq mod 8; the keys are one panel.
    static_assert(Smem::WeightTile::kPanels == 1, "one panel of keys");
    using WT = typename Smem::WeightTile;
    auto store_weights = [&](int b) {
      const WT pt = p_tile(b), dst = ds_tile(b);
      const int r = 64 * wg + 16 * warp + gq;
      const std::uint32_t p_row = pt.row_address(r, gq) + 4 * tig, ds_row = dst.row_address(r, gq) + 4 * tig;
#pragma unroll
      for (int half = 0; half < 2; ++half) {
#pragma unroll
        for (int n = 0; n < NT; ++n) {
          tile::st_shared_b32(WT::chunk_address(p_row, n) + 1024 * half, tile::pack2<T>(sc[n][2 * half], sc[n][2 * half + 1]));
          tile::st_shared_b32(WT::chunk_address(ds_row, n) + 1024 * half, tile::pack2<T>(dp[n][2 * half], dp[n][2 * half + 1]));
        }
      }
      tile::fence_to_async_proxy();
    };
    // dQ += dS K of the tile at stage s, dS from registers.
    std::uint32_t dsa[BK / 16][4];
    auto issue_dq = [&](int s) {
#pragma unroll
      for (int ks = 0; ks < BK / 16; ++ks) {
        tile::wgmma_rs<T, D, 1>(dq, dsa[ks], k_tile(s).mn_major(16 * ks), true);
      }
    };
    // The key tile's dV = P^T dO (consumer 0) or dK = dS^T Q (1) over the block's 128 rows, from
    // buffer b, where both consumers' P and dS are.
    float kg[D / 8][4];
    auto issue_key_grads = [&](int b) {
      const WT weights = wg == 0 ? p_tile(b) : ds_tile(b);
      const typename Smem::RowTile rows_tile = wg == 0 ? do_tile() : q_tile();
      tile::fresh(kg);
#pragma unroll
      for (int ks = 0; ks < BQ / 16; ++ks) {
        tile::wgmma_ss<T, D, 1, 1>(kg, weights.mn_major(16 * ks), rows_tile.mn_major(16 * ks), ks > 0);
      }
    };
    // kg of key tile kt into the accumulator: atomics, in the deterministic mode this block's
    // turn, or for short sequences the keys' whole gradients.
    auto add_key_grads = [&](int kt) {
      int* counter = nullptr;
      if (acc.deterministic) {
        const int rank = rank_and_counter(kt, &counter);
        wait_turn(counter, rank);
      }
      // Lanes tig and tig ^ 1 swap halves so each holds four consecutive columns of one row
      // (even lanes row gq, odd lanes row gq + 8): one 16-byte reduction instead of two. Each
      // branch below swaps on its own: one helper returning the four columns in order (four
      // selects) raised ptxas's spills at D = 128 from 72 / 88 to 80 / 96 bytes.
      const bool odd = (tig & 1) != 0;
      const std::int64_t key = static_cast<std::int64_t>(kt) * BK + key_of_column<BK>(16 * warp + gq + (odd ? 8 : 0));
      float* const row = key < qt.s.k_len && !acc.direct
                             ? dst_base + (p.batch_row_k(qt.b, qt.s.k_start + key) * p.heads_kv + qt.hk) * D + 2 * (tig & ~1)
                             : nullptr;
      if (acc.direct) {
        // The block's sums are the keys' whole gradients: four consecutive columns, in T.
        T* const out = key < qt.s.k_len ? direct_base.at<T>(qt.b, qt.s.k_start + key, qt.hk) + 2 * (tig & ~1) : nullptr;
#pragma unroll
        for (int n = 0; n < D / 8; ++n) {
          const float r0 = __shfl_xor_sync(0xffffffffu, odd ? kg[n][0] : kg[n][2], 1);
          const float r1 = __shfl_xor_sync(0xffffffffu, odd ? kg[n][1] : kg[n][3], 1);
          if (out == nullptr) continue;
          auto flushed = [](float a, float b) {
            return tile::pack2<T>(tile::as_reduced_into_zero(a), tile::as_reduced_into_zero(b));
          };
          const uint2 packed = odd ? make_uint2(flushed(r0, r1), flushed(kg[n][2], kg[n][3]))
                                   : make_uint2(flushed(kg[n][0], kg[n][1]), flushed(r0, r1));
          *reinterpret_cast<uint2*>(out + 8 * n) = packed;
        }
      } else if (acc.deterministic) {
#pragma unroll
        for (int n = 0; n < D / 8; ++n) {
          const float r0 = __shfl_xor_sync(0xffffffffu, odd ? kg[n][0] : kg[n][2], 1);
          const float r1 = __shfl_xor_sync(0xffffffffu, odd ? kg[n][1] : kg[n][3], 1);
          if (row == nullptr) continue;
          float4* const v = reinterpret_cast<float4*>(row + 8 * n);
          float4 x = *v;
          x.x += odd ? r0 : kg[n][0];
          x.y += odd ? r1 : kg[n][1];
          x.z += odd ? kg[n][2] : r0;
          x.w += odd ? kg[n][3] : r1;
          *v = x;
        }
      } else {
        tile::red_add_row_quads(row, kg, odd);
      }
      if (acc.deterministic) pass_turn(counter);
    };

    // The consumers take turns issuing (two named barriers, as the forward's and the
    // key-stationary backward's): per tile i a consumer issues S and dP (round 1), and after its
    // element-wise work dQ += dS K of tile i with dV or dK of tile i - 1 (round 2). The products
    // reach the matrix units in the order c0 round 1, c1 round 1, c0 round 2, c1 round 2, so one
    // consumer's weights and sums into global memory run while the other's products do. dV and
    // dK lag a tile so that the other consumer's P and dS of that tile are in place without a
    // wait: it stored them before giving the turn that this round took. Three P / dS buffers:
    // tile i's is written while tile i - 1's is read, and the one before may still be read by
    // the other consumer's last round. Consumer 1 gives no turn back after its last round, so
    // every turn given is taken; a block with no key tile takes none.
    const int my_turn = kBwdTurnBarrier + wg, other_turn = kBwdTurnBarrier + 1 - wg;
    int prev_kt = 0;
    for (int i = 0, kt = first_tile; kt < qt.key_tiles || i > 0; ++i) {
      const bool has_tile = kt < qt.key_tiles;
      const int s = tile::warp_uniform(i % S), b = i % Smem::kWeightBuffers;
      tiles_at = tile::opaque(smem);
      if (has_tile) {
        if (i > 0 || wg == 1) tile::named_sync(my_turn, 256);
        issue_scores(i);
        tile::named_arrive(other_turn, 256);
        tile::wgmma_wait<0>();
        tile::pin(sc);
        tile::pin(dp);
        tile::mbar_arrive(&v_empty[s]);

        mask.key0 = static_cast<std::int64_t>(kt) * BK;
        mask.active = qt.needs_mask(kt) || mask.key0 < mask.first[0] || mask.key0 < mask.first[1];
        // Tiles off the diagonal and right of every row's first kept key need no mask arithmetic.
        if (mask.active) {
          rows.template grads<true>(sc, dp, mask);  // sc <- P, dp <- dS (scaled)
        } else {
          rows.template grads<false>(sc, dp, mask);
        }
        store_weights(b);
        tile::to_operand<T>(dp, dsa);
      }
      tile::named_sync(my_turn, 256);
      // Each branch issues its products whole and waits for them: ptxas serializes every
      // product of the kernel for a branch around some of a sequence's products (C7520). And each
      // adds the key gradients it computed itself: with one add after the branches, ptxas kept
      // kg's registers through the next tile's element-wise work (640-708 / 756-812 bytes of
      // spills at D = 128, against 16 / 16 this way and 72 / 112 with the consumers in step).
      const int prev_b = (i + Smem::kWeightBuffers - 1) % Smem::kWeightBuffers;
      auto give_turn = [&] {
        if (wg == 0 || has_tile) tile::named_arrive(other_turn, 256);
      };
      if (has_tile && i > 0) {
        tile::wgmma_fence();
        issue_dq(s);
        issue_key_grads(prev_b);
        tile::wgmma_commit();
        give_turn();
        tile::wgmma_wait<0>();
        tile::pin(dq);
        tile::pin(kg);
        tile::pin(dsa);
        tile::mbar_arrive(&k_empty[s]);  // dQ's product read the stage's K
        add_key_grads(prev_kt);
      } else if (has_tile) {
        tile::wgmma_fence();
        issue_dq(s);
        tile::wgmma_commit();
        give_turn();
        tile::wgmma_wait<0>();
        tile::pin(dq);
        tile::pin(dsa);
        tile::mbar_arrive(&k_empty[s]);
      } else {
        tile::wgmma_fence();
        issue_key_grads(prev_b);
        tile::wgmma_commit();
        give_turn();
        tile::wgmma_wait<0>();
        tile::pin(kg);
        add_key_grads(prev_kt);
      }
      if (i > 0) skip_turns(prev_kt + 1, kt);
      if (!has_tile) break;
      prev_kt = kt;
      kt = sweep.after(kt);
    }

    if constexpr (kFinishesDq<Rows>) rows.finish_dq(dq, p, cfg, qt, row0, tig);
    if (g.rotary_cos != nullptr) {
      std::int64_t pos[2];
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const std::int64_t row = row0 + 8 * half;
        pos[half] = row < qt.s.q_len ? rotary_position(p, row + qt.s.q_offset()) : -1;
      }
      rotate_back_fragment<D>(g, dq, pos, tig);
    }
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const std::int64_t row = row0 + 8 * half;
      if (row >= qt.s.q_len) continue;
      tile::store_fragment_row<T>(g.dq.at<T>(qt.b, qt.s.q_start + row, qt.h), dq, half, tig);
    }
  }
#endif
}

}  // namespace winnow::cuda
