// The fused backward kernel shared by the row-wise mechanisms. One block of 8 warps owns 128
// query rows of one head (16 per warp) and sweeps key tiles of 64 from the left (or from the
// first key the forward kept) to the diagonal: left to right is the order in which
// stick-breaking's prefix sums of g accumulate. Per tile:
//   S = Q K^T, dP = dO V^T                        matrix units, per warp
//   P, dS = the mechanism's weights and logit gradients (scale folded into dS)
//   dQ += dS K                                    registers, written once at the end
//   dV_tile = P^T dO, dK_tile = dS^T Q            the block's 128 rows reduced through
//                                                 shared memory, then added into fp32
//                                                 accumulators: atomics, or in the
//                                                 deterministic mode in a fixed block order
// A mechanism is a backward Rows policy: constructed from the saved per-row statistics,
// first_key(half, mask), grads(s, dp, mask), and optionally (kFinishesDq) finish_dq(dq, p, cfg,
// qt, row0, tig) on the finished dq before it is stored (threshold attention's normalization
// and its per-head gradients). Given live key tiles (key_tiles.cuh), the sweep
// visits only those; in the deterministic mode the others still take their turn.
#pragma once

#include <cstdint>

#include "cuda/attention/forward.cuh"
#include "cuda/attention/key_tiles.cuh"

namespace winnow::cuda {

inline constexpr int kBackwardWarps = 8;
inline constexpr int kBackwardBQ = 16 * kBackwardWarps;
inline constexpr int kBackwardBK = 64;

// fp32 accumulators of dk and dv, [key row over the batch][kv head][dim]; semaphores for the
// deterministic order.
struct KeyGradAccumulators {
  float* dk = nullptr;
  float* dv = nullptr;
  // Each key's gradient comes from one block alone (every sequence's queries fit one block and
  // each kv head serves one query head): the blocks write dk and dv in T straight into the
  // gradient operands, which the caller cleared; dk, dv and order are unused. It spares the
  // fp32 accumulators, their clearing and the conversion pass, most of a short-sequence
  // backward's time beside the products. Subnormal sums are flushed as the accumulators'
  // reductions flush them (tile::as_reduced_into_zero): stick-breaking's far keys have some.
  bool direct = false;
  int* order = nullptr;  // per (sequence, kv head, key tile): contributions so far
  int key_tiles = 0;     // key tiles per sequence (of the longest)
  bool deterministic = false;
};

// DK: the head dimension of queries and keys, DV: of values and dO.
template <class T, int DK, int DV = DK>
struct BackwardSmem {
  static constexpr int kBQ = kBackwardBQ, kBK = kBackwardBK;
  // Q (BQ x DK), dO (BQ x DV); K, V double-buffered (BK x DK, BK x DV); P and dS (BQ x BK).
  static constexpr int kBytes = (kBQ * (DK + DV) + 2 * kBK * (DK + DV) + 2 * kBQ * kBK) * sizeof(T);
};

// Waits until it is this block's turn on a key tile's accumulators (deterministic mode).
__device__ __forceinline__ void wait_turn(const int* counter, int rank) {
  if (threadIdx.x == 0) {
    int seen;
    do {
      asm volatile("ld.acquire.gpu.global.s32 %0, [%1];\n" : "=r"(seen) : "l"(counter) : "memory");
    } while (seen != rank);
  }
  __syncthreads();
}
__device__ __forceinline__ void pass_turn(int* counter) {
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) atomicAdd(counter, 1);
}

template <class T, int DK, int DV, class Rows, class Config>
__global__ void __launch_bounds__(32 * kBackwardWarps, 1)
    attention_backward_kernel(const AttentionParams p, const detail::GradientParams g,
                              const Config cfg, const KeyGradAccumulators acc, const LiveKeyTiles live) {
  constexpr int BQ = kBackwardBQ, BK = kBackwardBK, NT = BK / 8, DT = DK / 8, KS = DK / 16, KSV = DV / 16;
  constexpr int kThreads = 32 * kBackwardWarps;
  extern __shared__ __align__(128) unsigned char smem_raw[];
  T* smem = reinterpret_cast<T*>(smem_raw);
  const tile::SmemTile<T, BQ, DK> q_tile{smem};
  const tile::SmemTile<T, BQ, DV> do_tile{smem + BQ * DK};
  T* const k_base = smem + BQ * (DK + DV);
  T* const v_base = k_base + 2 * BK * DK;
  auto k_tile = [&](int buf) { return tile::SmemTile<T, BK, DK>{k_base + buf * BK * DK}; };
  auto v_tile = [&](int buf) { return tile::SmemTile<T, BK, DV>{v_base + buf * BK * DV}; };
  T* const pds_base = v_base + 2 * BK * DV;
  const tile::SmemTile<T, BQ, BK> p_tile{pds_base}, ds_tile{pds_base + BQ * BK};
  __shared__ int block_first_tile;

  const QueryTile<BQ, BK> qt(p);
  if (qt.empty()) return;
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32, gq = lane / 4, tig = lane % 4;
  const std::int64_t row0 = qt.r0 + 16 * warp + gq;

  RowMask mask;
  mask.limit[0] = qt.limit(p, row0);
  mask.limit[1] = qt.limit(p, row0 + 8);
  mask.tig = tig;
  Rows rows(p, g, cfg, qt, row0, tig);
  // A row's first key: where early halting stopped, and at least its segment's first.
  mask.first[0] = later_key(rows.first_key(0, mask), qt.first_key(p, row0));
  mask.first[1] = later_key(rows.first_key(1, mask), qt.first_key(p, row0 + 8));

  // The sweep starts at the key tile of the smallest first key of the block's rows.
  if (tid == 0) block_first_tile = qt.key_tiles;
  __syncthreads();
  for (int half = 0; half < 2; ++half) {
    if (mask.limit[half] >= 0) atomicMin(&block_first_tile, static_cast<int>(mask.first[half] / BK));
  }
  __syncthreads();
  const KeyTileSweep<BK> sweep(p, live, qt);
  const int first_tile = sweep.at_or_after(block_first_tile);

  auto load_kv = [&](int kt, int buf) {
    const std::int64_t key0 = static_cast<std::int64_t>(kt) * BK;
    k_tile(buf).template load_async<kThreads>(tid, [&](int c) -> const T* {
      const std::int64_t key = key0 + key_of_column<BK>(c);
      return key < qt.s.k_len ? p.k.at<const T>(qt.b, qt.s.k_start + key, qt.hk) : nullptr;
    });
    v_tile(buf).template load_async<kThreads>(tid, [&](int c) -> const T* {
      const std::int64_t key = key0 + key_of_column<BK>(c);
      return key < qt.s.k_len ? p.v.at<const T>(qt.b, qt.s.k_start + key, qt.hk) : nullptr;
    });
  };
  auto row_src = [&](const detail::Operand& op) {
    return [&, op](int r) -> const T* {
      const std::int64_t row = qt.r0 + r;
      return row < qt.s.q_len ? op.at<const T>(qt.b, qt.s.q_start + row, qt.h) : nullptr;
    };
  };
  q_tile.template load_async<kThreads>(tid, row_src(p.q));
  do_tile.template load_async<kThreads>(tid, row_src(g.dout));
  if (first_tile < qt.key_tiles) load_kv(first_tile, 0);
  tile::cp_async_commit();

  // Deterministic mode: this block's rank among the blocks adding into a key tile, in launch
  // order (query heads of the group ascending, then grid x ascending).
  const int group_index = static_cast<int>(qt.h - qt.hk * p.group_size());
  auto rank_and_counter = [&](int kt, int** counter) {
    // Contributors to key tile kt: query tiles whose last row sees key kt * BK.
    const std::int64_t q_tiles = (qt.s.q_len + BQ - 1) / BQ;
    const std::int64_t need_row =
        static_cast<std::int64_t>(kt) * BK - qt.s.q_offset() + (p.attend_current ? 0 : 1);
    const std::int64_t first_q = need_row <= 0 ? 0 : (need_row + BQ) / BQ - 1;
    const int contributors = static_cast<int>(q_tiles - first_q);
    *counter = acc.order + (qt.b * p.heads_kv + qt.hk) * acc.key_tiles + kt;
    return group_index * contributors + static_cast<int>(blockIdx.x);
  };
  // Tiles this block skips (left of its first kept key, or without support) still take their
  // turn in the deterministic mode.
  auto skip_turns = [&](int from, int to) {
    if (!acc.deterministic) return;
    for (int kt = from; kt < to; ++kt) {
      int* counter;
      const int rank = rank_and_counter(kt, &counter);
      wait_turn(counter, rank);
      pass_turn(counter);
    }
  };
  skip_turns(0, first_tile);

  float dq[DT][4];
  tile::zero(dq);

  for (int kt = first_tile, i = 0; kt < qt.key_tiles; ++i) {
    const int buf = i & 1, next = sweep.after(kt);
    if (next < qt.key_tiles) {
      load_kv(next, buf ^ 1);
      tile::cp_async_commit();
      tile::cp_async_wait<1>();
    } else {
      tile::cp_async_wait<0>();
    }
    __syncthreads();

    float s[NT][4], dp[NT][4];
    tile::zero(s);
    tile::zero(dp);
    // Q and dO fragments come from shared memory at every tile: holding them in registers
    // would spill.
    tile::mma_smem_a_b_rows<T, KS>(s, q_tile, 16 * warp, k_tile(buf), 0, lane);
    tile::mma_smem_a_b_rows<T, KSV>(dp, do_tile, 16 * warp, v_tile(buf), 0, lane);
    mask.key0 = static_cast<std::int64_t>(kt) * BK;
    mask.active = qt.needs_mask(kt) || mask.key0 < mask.first[0] || mask.key0 < mask.first[1];
    // Tiles off the diagonal and right of every row's first kept key need no mask arithmetic.
    if (mask.active) {
      rows.template grads<true>(s, dp, mask);  // s <- P, dp <- dS (scaled)
    } else {
      rows.template grads<false>(s, dp, mask);
    }

#pragma unroll
    for (int n = 0; n < NT; ++n) {
      p_tile.store_c(s[n], 16 * warp, 8 * n, lane);
      ds_tile.store_c(dp[n], 16 * warp, 8 * n, lane);
    }
    std::uint32_t dsa[BK / 16][4];
    tile::to_operand<T>(dp, dsa);
    tile::mma_b_cols<T>(dq, dsa, k_tile(buf), 0, lane);
    __syncthreads();

    // dV and dK of this key tile: warp w owns keys 16 (w % 4) .. +15 and half the columns (all
    // of them for a 16-wide dK, which warps 4 .. 7 then leave alone). One product at a time, so
    // only one 16 x D/2 accumulator is live next to dq.
    const int m0 = 16 * (warp % 4);
    int* counter = nullptr;
    if (acc.deterministic) {
      const int rank = rank_and_counter(kt, &counter);
      wait_turn(counter, rank);
    }
    auto reduce_into = [&](const tile::SmemTile<T, BQ, BK>& weights, const auto& rows_tile, float* dst,
                           const detail::Operand& grad) {
      constexpr int D = std::decay_t<decltype(rows_tile)>::kCols;
      constexpr int SPLIT = D >= 32 ? 2 : 1, HALF = D / SPLIT, HT = HALF / 8;
      if (warp / 4 >= SPLIT) return;
      const int c0 = HALF * (warp / 4);
      float part[HT][4];
      tile::zero(part);
#pragma unroll
      for (int ks = 0; ks < BQ / 16; ++ks) {
        std::uint32_t a[4];
        weights.a_cols(a, m0, 16 * ks, lane);
#pragma unroll
        for (int np = 0; np < HT / 2; ++np) {
          std::uint32_t b[4];
          rows_tile.b_cols(b, 16 * ks, c0 + 16 * np, lane);
          tile::mma_16816<T>(part[2 * np], a, b[0], b[1]);
          tile::mma_16816<T>(part[2 * np + 1], a, b[2], b[3]);
        }
      }
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const std::int64_t key = mask.key0 + key_of_column<BK>(m0 + gq + 8 * half);
        if (key >= qt.s.k_len) continue;
        if (acc.direct) {
          T* out = grad.at<T>(qt.b, qt.s.k_start + key, qt.hk) + c0 + 2 * tig;
#pragma unroll
          for (int n = 0; n < HT; ++n) {
            *reinterpret_cast<std::uint32_t*>(out + 8 * n) = tile::pack2<T>(
                tile::as_reduced_into_zero(part[n][2 * half]), tile::as_reduced_into_zero(part[n][2 * half + 1]));
          }
          continue;
        }
        float* row = dst + (p.batch_row_k(qt.b, qt.s.k_start + key) * p.heads_kv + qt.hk) * D + c0 + 2 * tig;
#pragma unroll
        for (int n = 0; n < HT; ++n) {
          if (acc.deterministic) {
            row[8 * n] += part[n][2 * half];
            row[8 * n + 1] += part[n][2 * half + 1];
          } else {
            tile::red_add2(row + 8 * n, part[n][2 * half], part[n][2 * half + 1]);
          }
        }
      }
    };
    reduce_into(p_tile, do_tile, acc.dv, g.dv);
    reduce_into(ds_tile, q_tile, acc.dk, g.dk);
    if (acc.deterministic) pass_turn(counter);
    __syncthreads();
    skip_turns(kt + 1, next);
    kt = next;
  }
  tile::cp_async_wait<0>();

  if constexpr (kFinishesDq<Rows>) rows.finish_dq(dq, p, cfg, qt, row0, tig);
  for (int half = 0; half < 2; ++half) {
    const std::int64_t row = row0 + 8 * half;
    if (row >= qt.s.q_len) continue;
    tile::store_fragment_row<T>(g.dq.at<T>(qt.b, qt.s.q_start + row, qt.h), dq, half, tig);
  }
}

}  // namespace winnow::cuda
