// The fused forward kernel on Hopper (sm_90a), for the same row policies as the portable one
// (forward.cuh). A block owns 128 query rows of one head and has three warpgroups:
//   producer   copies Q once, then K and V tiles of 128 keys from the diagonal leftwards into
//              two rings of shared-memory stages (cp.async: any strides, zero rows past the
//              sequence, keys permuted so that each thread's scores are consecutive keys; see
//              geometry.cuh); each stage is handed over by an mbarrier that the copies
//              themselves complete, so the producer never waits for its own loads;
//   consumers  two warpgroups of 64 rows each. Per key tile i, one "round" of products,
//              S_i = Q K_i^T and O += P_{i-1} V_{i-1} (wgmma; Q, K, V from shared memory, P
//              from registers), then the row policy turns S_i into P_i while the products
//              run. The consumers take turns for their rounds (two named barriers, ping-pong):
//              one's exp/log work overlaps the other's products, which is what keeps the
//              matrix units busy when a mechanism's per-score work is as heavy as its products.
// Sweeps without values (Rows::kUsesValues false: entmax's threshold search) load no V and
// issue no P V; the rounds keep their turns so the schedule is the same.
// Early halting (stick-breaking): a consumer whose 64 rows have all halted stops computing and
// raises a flag; once both have, the producer stops loading and sends an end marker.
// Given live key tiles (key_tiles.cuh), producer and consumers walk the same live tiles.
// Zero tiles (Rows::kSkipsZeroTiles, threshold attention): a consumer whose P of a tile is all
// exact zeros, by a vote over its warpgroup, skips that tile's P V (its V is loaded anyway).
// A policy that can tell such a tile from its scores (Rows::kPrescreens) votes on them first in
// the rounds without a P V in flight, and skips the weights too (kPrescreens, below).
// Two views (Rows::kViews = 2, TDA): the block also holds the second view's queries, each stage
// both views' keys, and a round issues both views' scores before the one P V; the policy's
// weights2 combines them into P. Both views' score tiles and their keys fit only at 64 keys a
// tile (64 + 64 accumulator registers of scores, 2 x 32 KB of queries at D = 128), so such
// policies sweep tiles of 64 keys.
#pragma once

#include <cstdint>

#include "cuda/attention/forward.cuh"
#include "cuda/tile/hopper.cuh"
#include "cuda/tile/panel_tile.cuh"

namespace winnow::cuda {

struct Sm90ForwardShape {
  static constexpr int kBQ = 128;  // two consumer warpgroups of 64 rows
  static constexpr int kBK = 128;
  static constexpr int kStages = 2;
  static constexpr int kThreads = 384;
  // Registers per thread after reallocation: 128 x (24 + 2 x 240) = 64512 of the 65536.
  static constexpr int kProducerRegisters = 24;
  static constexpr int kConsumerRegisters = 240;
};

// Query and key views a row policy scores (TDA's two; one for every other mechanism), and the
// key tile that many views fit.
template <class Rows, class = void>
inline constexpr int kViews = 1;
template <class Rows>
inline constexpr int kViews<Rows, std::void_t<decltype(Rows::kViews)>> = Rows::kViews;
template <int Views>
inline constexpr int kSm90ForwardBK = Views == 2 ? 64 : Sm90ForwardShape::kBK;

// V's ring comes last (none for a sweep without values): sweeps without values lend that space,
// ScratchBytes of it, to their row policy (forward.cuh, kScratchBytes). With two views, the
// second view's queries follow the first's and each key stage holds both views' tiles.
template <class T, int D, int ScratchBytes = 0, int Views = 1, int Stages = Sm90ForwardShape::kStages,
          bool UsesValues = true, int StagingBytes = 0>
struct Sm90ForwardSmem {
  using Shape = Sm90ForwardShape;
  static constexpr int kStages = Stages;
  static constexpr int kBK = kSm90ForwardBK<Views>;
  using QTile = tile::PanelTile<T, Shape::kBQ, D>;
  using KVTile = tile::PanelTile<T, kBK, D>;
  static constexpr int kQ = 0;                         // view v at kQ + v * QTile::kBytes
  static constexpr int kK = kQ + Views * QTile::kBytes;  // stage s, view v at kK + (s * Views + v) * KVTile::kBytes
  static constexpr int kSync = kK + Stages * Views * KVTile::kBytes;
  // mbarriers k_full, k_empty, v_full, v_empty [stages]; end[stages] (-1: the producer
  // stopped before this stage's K); the consumers' halt flags.
  static constexpr int kSyncBytes = 32 * Stages + 4 * Stages + tile::StageHaltFlags::bytes(Stages);
  static constexpr int kV = (kSync + kSyncBytes + 1023) / 1024 * 1024;
  static constexpr int kVBytes = UsesValues ? Stages * KVTile::kBytes : 0;
  static constexpr int kLastBytes = kVBytes > ScratchBytes ? kVBytes : ScratchBytes;
  static constexpr int kStaging = kV + kLastBytes;  // StagingBytes (forward.cuh, kStagingBytes)
  // Dynamic shared memory is only 16-byte aligned; the swizzle needs 1024.
  static constexpr int kBytes = kStaging + StagingBytes + 1024;
  static_assert(kBytes <= 227 * 1024, "a Hopper block's shared memory");
};

// Named barriers: 1 producer; 2, 3 each consumer's own; 4, 5 the consumers' turns.
inline constexpr int kProducerBarrier = 1, kConsumerBarrier = 2, kTurnBarrier = 4;

// Segments: p.segment_len may be set (short sequences packed, launch_attention.cuh). A
// separate instantiation, so that the mask of every other call keeps its registers.
// A value-free sweep (no P V, no halting, no zero-tile votes) whose policy sets kPairsTiles
// (the threshold search's start sweep, entmax's and Sieve's) takes two key tiles a round, the
// second tile's product running while the first is weighed; the others keep one round a tile,
// their P V the product that runs while they weigh. (The step sweep, paired, held ptxas for
// minutes; the collect sweep's lists fill V's space, which four stages would need.)
template <class Rows, class = void>
inline constexpr bool kPairsTiles = false;
template <class Rows>
inline constexpr bool kPairsTiles<Rows, std::void_t<decltype(Rows::kPairsTiles)>> =
    Rows::kPairsTiles && !Rows::kUsesValues && !Rows::kCanHalt && !kSkipsZeroTiles<Rows>;

// A policy that skips zero tiles may also tell them from the scores, before its weights
// (Rows::kPrescreens, rows.any_above(scores, second_scores, key0): whether some score of this
// thread's can have a nonzero weight). In a round without P V in flight (the tile before was a
// zero tile) the consumer votes on that first and skips the weights, their packing and the
// vote on P where no thread's can: at a high threshold most rounds are such rounds (TRA at
// beta = 1, 16K: the forward kernel 7-8% faster, H200, session 86). Only there: with a P V in
// flight a vote would wait for it, and a barrier on a path the products are in flight across
// may make ptxas serialize them (this one compiles without a C75xx warning).
template <class Rows, class = void>
inline constexpr bool kPrescreens = false;
template <class Rows>
inline constexpr bool kPrescreens<Rows, std::void_t<decltype(Rows::kPrescreens)>> =
    Rows::kPrescreens && kSkipsZeroTiles<Rows> && !Rows::kCanHalt;

// A policy whose forward tells a tile's support from its scores (Rows::kRecordsSupport, with
// kPrescreens' any_above) records it for the backward where cfg.support has bits: per consumer
// (64 rows) and cell, a bit for every tile but those its prescreen vote found without a score
// above tau (TileSupport): the rounds with a P V in flight (after a tile with weights) and masked
// tiles are marked untested, and rows that do not vote mark every cell they visit.
template <class Rows, class = void>
inline constexpr bool kRecordsSupport = false;
template <class Rows>
inline constexpr bool kRecordsSupport<Rows, std::void_t<decltype(Rows::kRecordsSupport)>> =
    Rows::kRecordsSupport && kPrescreens<Rows>;

// A pairing sweep consumes two stages a round: with four, the next round's tiles load while
// this round's are weighed (with two, the second's load would start only as the round ends).
// A policy may ask for more (Rows::kStages): threshold attention takes three, whose forward
// at D = 128 they made 3-6% faster at beta = 0 and 1-3% at beta = 1 (H200, session 86;
// docs/performance.md). Three stages at D = 128 are 226 of a block's 227 KB.
template <class Rows, class = void>
inline constexpr int kPolicyStages = Sm90ForwardShape::kStages;
template <class Rows>
inline constexpr int kPolicyStages<Rows, std::void_t<decltype(Rows::kStages)>> = Rows::kStages;
template <class Rows>
inline constexpr int kSm90ForwardStages = kPairsTiles<Rows> ? 4 : kPolicyStages<Rows>;

// The shared memory of a row policy's forward.
template <class T, int D, class Rows>
using Sm90ForwardSmemOf = Sm90ForwardSmem<T, D, kScratchBytes<Rows>, kViews<Rows>, kSm90ForwardStages<Rows>,
                                          Rows::kUsesValues, kStagingBytes<Rows>>;

template <class T, int D, class Rows, class Config, bool Segments = false>
__global__ void __launch_bounds__(Sm90ForwardShape::kThreads, 1)
    attention_forward_sm90_kernel(const AttentionParams p, const Config cfg, const LiveKeyTiles live) {
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using Shape = Sm90ForwardShape;
  constexpr int NV = kViews<Rows>;
  using Smem = Sm90ForwardSmemOf<T, D, Rows>;
  constexpr int BQ = Shape::kBQ, BK = Smem::kBK, S = Smem::kStages;
  extern __shared__ unsigned char smem_raw[];
  unsigned char* const smem = smem_raw + ((1024 - (tile::smem_address(smem_raw) & 1023)) & 1023);
  // The tiles' views: the consumers rebuild them each round from tile::opaque(smem), so that
  // their operand descriptors are not hoisted out of the loop into registers that then spill.
  unsigned char* tiles_at = smem;
  auto q_tile = [&](int v = 0) { return typename Smem::QTile{tiles_at + Smem::kQ + v * Smem::QTile::kBytes}; };
  auto k_tile = [&](int s, int v = 0) {
    return typename Smem::KVTile{tiles_at + Smem::kK + (s * NV + v) * Smem::KVTile::kBytes};
  };
  auto v_tile = [&](int s) { return typename Smem::KVTile{tiles_at + Smem::kV + s * Smem::KVTile::kBytes}; };
  std::uint64_t* const k_full = reinterpret_cast<std::uint64_t*>(smem + Smem::kSync);
  std::uint64_t* const k_empty = k_full + S;
  std::uint64_t* const v_full = k_empty + S;
  std::uint64_t* const v_empty = v_full + S;
  volatile int* const end = reinterpret_cast<volatile int*>(v_empty + S);
  const tile::StageHaltFlags halted{end + S};

  if constexpr (kRecordsSupport<Rows>) {
    // The map is whole once this launch ends: the backward, after it on the stream, reads the flag.
    if (cfg.support.bits != nullptr && p.segment_len == 0 && blockIdx.x + blockIdx.y + blockIdx.z + threadIdx.x == 0) {
      *cfg.support.flag = 1;
    }
  }
  uint3 block;
  if (!block_tile<Rows, BQ>(p, cfg, &block)) return;
  const QueryTile<BQ, BK> qt(p, block);
  if (qt.empty() || block_settled<Rows, BQ>(p, cfg, qt)) return;
  const int tid = threadIdx.x;
  if (tid == 0) {
    for (int s = 0; s < S; ++s) {
      tile::mbar_init(&k_full[s], 128);   // every producer thread, when its copies land
      tile::mbar_init(&v_full[s], 128);
      tile::mbar_init(&k_empty[s], 256);  // every consumer thread
      tile::mbar_init(&v_empty[s], 256);
      end[s] = 0;
    }
    halted.clear(S);
    tile::mbar_init_fence();
  }
  __syncthreads();

  bool may_halt = false;
  if constexpr (Rows::kCanHalt) may_halt = cfg.halt_cutoff > 0.f;
  const KeyTileSweep<BK> sweep(p, live, qt);
  const int n_tiles = sweep.count;

  if (tid < 128) {
    // ---------------------------------------------------------------- producer
    tile::registers_release<Shape::kProducerRegisters>();
    const int ptid = tid;
    using KV = typename Smem::KVTile;
    // This thread's tile rows r0, r0 + P, ... hold keys key0, key0 + P / 4, ... of each tile
    // (the permutation of geometry.cuh is affine along such a sequence), so every copy is a
    // fixed step from the one before.
    constexpr int P = KV::template row_stride_of<128>();
    const int r0 = KV::template first_row_of<128>(ptid);
    const std::int64_t key0 = key_of_column<BK>(r0);
    const T* const k_base = p.k.at<const T>(qt.b, qt.s.k_start, qt.hk);
    const T* const v_base = p.v.at<const T>(qt.b, qt.s.k_start, qt.hk);
    auto keys_valid = [&](int kt) {  // how many of this thread's keys of tile kt exist
      const std::int64_t left = qt.s.k_len - static_cast<std::int64_t>(kt) * BK - key0;
      return left <= 0 ? 0 : static_cast<int>(left < BK ? (left + P / 4 - 1) / (P / 4) : BK);
    };
    int kt = sweep.last();
    for (int i = 0; i < n_tiles; ++i, kt = sweep.before(kt)) {
      const int s = i % S;
      if (i >= S) {
        tile::mbar_wait_sleepy(&k_empty[s], ((i / S) - 1) & 1);
        // Both consumers halted: one thread reads the flags so every producer thread agrees.
        if (may_halt &&
            tile::named_sync_or(kProducerBarrier, 128, ptid == 0 && halted.both(s))) {
          if (ptid == 0) end[s] = -1;
          tile::mbar_arrive(&k_full[s]);
          return;
        }
      }
      if (i == 0) {
        using Q = typename Smem::QTile;
        const int q0 = Q::template first_row_of<128>(ptid);
        constexpr int QP = Q::template row_stride_of<128>();
        const std::int64_t left = qt.s.q_len - qt.r0 - q0;
        const int q_valid = left <= 0 ? 0 : static_cast<int>(left < BQ ? (left + QP - 1) / QP : BQ);
        q_tile().template load_rows_async<128>(ptid, p.q.at<const T>(qt.b, qt.s.q_start + qt.r0 + q0, qt.h),
                                               QP * p.q.row, q_valid);
        if constexpr (NV == 2) {
          const detail::Operand& q2 = Rows::second_queries(cfg);
          q_tile(1).template load_rows_async<128>(ptid, q2.at<const T>(qt.b, qt.s.q_start + qt.r0 + q0, qt.h),
                                                  QP * q2.row, q_valid);
        }
      }
      const std::int64_t row = static_cast<std::int64_t>(kt) * BK + key0;
      const int valid = keys_valid(kt);
      k_tile(s).template load_rows_async<128>(ptid, k_base + row * p.k.row, (P / 4) * p.k.row, valid);
      if constexpr (NV == 2) {
        const detail::Operand& k2 = Rows::second_keys(cfg);
        k_tile(s, 1).template load_rows_async<128>(ptid, k2.at<const T>(qt.b, qt.s.k_start + row, qt.hk),
                                                   (P / 4) * k2.row, valid);
      }
      tile::mbar_arrive_on_copies(&k_full[s]);
      if constexpr (Rows::kUsesValues) {
        if (i >= S) tile::mbar_wait_sleepy(&v_empty[s], ((i / S) - 1) & 1);
        v_tile(s).template load_rows_async<128>(ptid, v_base + row * p.v.row, (P / 4) * p.v.row, valid);
        tile::mbar_arrive_on_copies(&v_full[s]);
      }
    }
  } else {
    // ---------------------------------------------------------------- consumers
    tile::registers_claim<Shape::kConsumerRegisters>();
    const int ctid = tid - 128, wg = tile::warp_uniform(ctid / 128), wtid = ctid % 128;
    const int warp = wtid / 32, lane = tid % 32, g = lane / 4, tig = lane % 4;
    const std::int64_t row0 = qt.r0 + 64 * wg + 16 * warp + g;  // this thread's rows: row0, row0 + 8
    const int my_turn = kTurnBarrier + wg, other_turn = kTurnBarrier + 1 - wg;

    RowMask mask;
    mask.limit[0] = qt.limit(p, row0);
    mask.limit[1] = qt.limit(p, row0 + 8);
    if constexpr (Segments) {
      mask.segment_bits = segment_bits_of(p);
      mask.segment_shift = p.attend_current ? 0 : 1;
    }
    mask.tig = tig;
    Rows rows(p, cfg, qt, row0);
    const ScoresFromMemory<T, D, QueryTile<BQ, BK>> rescore{p, qt, row0};
    lend_scratch<BQ>(rows, smem + Smem::kV, Smem::kLastBytes, qt, row0, tig);
    lend_staging<BQ>(rows, smem + Smem::kStaging, qt, row0, tig);
    float o[D / 8][4];
    tile::zero(o);
    std::uint32_t pa[BK / 16][4];  // P of the previous tile, waiting for its product with V
    using SecondScores = float[NV == 2 ? BK / 8 : 1][4];  // the second view's (NV = 2)
    int kept_from_tile = 0;
    bool done = false;  // every row of this consumer has halted: its weights are zero from now
    // kSkipsZeroTiles: whether the P in pa has a nonzero weight in this consumer's rows; when
    // not, its P V is not issued. Decided by a vote over the warpgroup (so the branch is uniform
    // over it), taken only where the policy finds zero tiles likely for these rows.
    bool pv_live = true;
    bool votes = false;
    if constexpr (kSkipsZeroTiles<Rows>) votes = Rows::zero_tiles_likely(p, cfg, qt, qt.r0 + 64 * wg);
    // kRecordsSupport: whether this consumer records its rows' support tile by tile (its row of
    // the map found again at each mark: held across the loop, the pointer cost spills).
    bool records_support = false;
    auto support_row = [&](const auto& support) { return support.row(p, qt.b, qt.h, qt.s, qt.r0 + 64 * wg); };
    if constexpr (kRecordsSupport<Rows>) {
      static_assert(!kPairsTiles<Rows>, "the paired rounds record no support");
      if (cfg.support.bits != nullptr && p.segment_len == 0 && qt.r0 + 64 * wg < qt.s.q_len) {
        records_support = votes;
        if (!votes && wtid == 0) {
          const int keys = n_tiles > 0 ? (sweep.last() + 1) * BK : 0;
          mark_support_cells(support_row(cfg.support), (keys + kCellKeys - 1) / kCellKeys);
        }
      }
    }
    // The tile's cell marked (one thread: the warpgroup's 64 rows are a row tile of the map).
    auto record_support = [&](int kt) {
      if constexpr (kRecordsSupport<Rows>) {
        if (records_support && wtid == 0) {
          const int cell = kt * BK / kCellKeys;
          atomicOr(support_row(cfg.support) + (cell >> 5), 1u << (cell & 31));
        }
      }
    };

    // Products are issued on paths that every thread of the warpgroup takes, decided by the
    // loop alone: a product under a data-dependent branch makes the compiler serialise all of
    // them. So the first and last rounds are peeled off the loop, and a halted consumer keeps
    // multiplying (zero weights) until the producer ends the sweep for both.
    auto issue_s = [&](float (&sc)[BK / 8][4], SecondScores& sc2, int s) {
#pragma unroll
      for (int ks = 0; ks < D / 16; ++ks) {
        tile::wgmma_ss<T, BK, 0, 0>(sc, q_tile().k_major(64 * wg, 16 * ks), k_tile(s).k_major(0, 16 * ks), ks > 0);
      }
      if constexpr (NV == 2) {
#pragma unroll
        for (int ks = 0; ks < D / 16; ++ks) {
          tile::wgmma_ss<T, BK, 0, 0>(sc2, q_tile(1).k_major(64 * wg, 16 * ks), k_tile(s, 1).k_major(0, 16 * ks),
                                      ks > 0);
        }
      }
      tile::wgmma_commit();
    };
    auto issue_pv = [&](int s) {
#pragma unroll
      for (int ks = 0; ks < BK / 16; ++ks) {
        tile::wgmma_rs<T, D, 1>(o, pa[ks], v_tile(s).mn_major(16 * ks), true);
      }
      tile::wgmma_commit();
    };
    // A round's products: S_i, and P_{i-1} V_{i-1} when with_pv (a constant at each call);
    // returns once S_i is done. A policy that skips zero tiles chooses the round by a branch
    // around the whole of it: a branch around the P V products alone, with or without a fence
    // in it, or a guard predicate on them (even one uniform over the grid) made ptxas insert
    // warpgroup arrives on one path and serialize every product of the kernel (C7520).
    auto issue_round = [&](float (&sc)[BK / 8][4], SecondScores& sc2, int s, int prev, bool with_pv) {
      tile::wgmma_fence();
      issue_s(sc, sc2, s);
      if (with_pv) issue_pv(prev);
      tile::named_arrive(other_turn, 256);
      if (with_pv) {
        tile::wgmma_wait<1>();
      } else {
        tile::wgmma_wait<0>();
      }
    };
    // S_i -> P_i (in pa), and what the policy asks of the output; kt: tile i's index.
    auto weigh = [&](float (&sc)[BK / 8][4], SecondScores& sc2, int kt) {
      if (!done) {
        mask.key0 = static_cast<std::int64_t>(kt) * BK;
        mask.active = qt.needs_mask(kt);
        if constexpr (NV == 2) {
          if (mask.active) {
            rows.template weights2<true>(sc, sc2, mask);
          } else {
            rows.template weights2<false>(sc, sc2, mask);
          }
        } else if (mask.active) {
          weigh_scores<true>(rows, sc, mask, rescore);
        } else {
          weigh_scores<false>(rows, sc, mask, rescore);
        }
      }
      // A halted consumer's tiles have no weight: rather than zeroing P (which ptxas hoisted
      // above the loop's products as 30 register-pair clears a tile, taken or not), its P V is
      // not issued at all (after_weights).
    };
    auto after_weights = [&](float (&sc)[BK / 8][4], int kt) {
      const bool weighed = !done;
      if (weighed) {
        if constexpr (Rows::kUsesValues) rows.rescale(o);
        kept_from_tile = kt;
        if (may_halt) {
          done = tile::named_sync_and(kConsumerBarrier + wg, 128, rows.halted(mask));
        }
        if constexpr (Rows::kUsesValues) tile::to_operand<T>(sc, pa);
      }
      if constexpr (kSkipsZeroTiles<Rows>) {
        if (votes) pv_live = tile::named_sync_or(kConsumerBarrier + wg, 128, tile::any_nonzero(pa));
      }
      // The tile that halted a consumer is weighed, and its P V issued; the tiles after it are
      // not. (Uniform over the warpgroup: done comes from its vote.)
      if constexpr (Rows::kCanHalt) pv_live = weighed && (!kSkipsZeroTiles<Rows> || pv_live);
    };

    if (wg == 1) tile::named_arrive(kTurnBarrier, 256);  // consumer 0 takes the first turn
    int i = 0, kt = sweep.last();
    if (n_tiles > 0) {
      // First round: S_0 alone.
      tile::mbar_wait(&k_full[0], 0);
      tile::fence_to_async_proxy();  // the copies were ordinary writes; wgmma reads asynchronously
      float sc[BK / 8][4];
      SecondScores sc2;
      tile::fresh(sc);
      if constexpr (NV == 2) tile::fresh(sc2);
      tile::named_sync(my_turn, 256);
      tile::wgmma_fence();
      issue_s(sc, sc2, 0);
      tile::named_arrive(other_turn, 256);
      tile::wgmma_wait<0>();
      tile::pin(sc);
      if constexpr (NV == 2) tile::pin(sc2);
      tile::mbar_arrive(&k_empty[0]);
      weigh(sc, sc2, kt);
      after_weights(sc, kt);
      record_support(kt);

      i = 1;
      if constexpr (kPairsTiles<Rows>) {
        // Two tiles a round: both S products issued in one turn, tile i weighed while S_{i+1}
        // runs, then S_{i+1}. Both are waited for within the round: with a product in flight
        // across the loop's back edge ptxas serializes every product of the kernel (C7514).
        for (; i + 1 < n_tiles; i += 2) {
          const int kt0 = sweep.before(kt), kt1 = sweep.before(kt0);
          tiles_at = tile::opaque(smem);
          const int s0 = tile::warp_uniform(i % S), s1 = tile::warp_uniform((i + 1) % S);
          tile::mbar_wait(&k_full[s0], (i / S) & 1);
          tile::mbar_wait(&k_full[s1], ((i + 1) / S) & 1);
          tile::fence_to_async_proxy();
          float sc1[BK / 8][4];
          SecondScores sc2b;
          tile::fresh(sc);
          tile::fresh(sc1);
          tile::named_sync(my_turn, 256);
          tile::wgmma_fence();
          issue_s(sc, sc2, s0);
          issue_s(sc1, sc2b, s1);
          tile::named_arrive(other_turn, 256);
          tile::wgmma_wait<1>();
          tile::pin(sc);
          tile::mbar_arrive(&k_empty[s0]);
          weigh(sc, sc2, kt0);
          after_weights(sc, kt0);
          tile::wgmma_wait<0>();
          tile::pin(sc1);
          tile::mbar_arrive(&k_empty[s1]);
          weigh(sc1, sc2b, kt1);
          after_weights(sc1, kt1);
          kt = kt1;
        }
      }
      for (; i < n_tiles; ++i) {
        kt = sweep.before(kt);
        tiles_at = tile::opaque(smem);
        const int s = tile::warp_uniform(i % S), prev = (s + S - 1) % S;
        tile::mbar_wait(&k_full[s], (i / S) & 1);
        if (end[s] < 0) break;
        if constexpr (Rows::kUsesValues) tile::mbar_wait(&v_full[prev], ((i - 1) / S) & 1);
        tile::fence_to_async_proxy();
        tile::fresh(sc);
        if constexpr (NV == 2) tile::fresh(sc2);
        tile::named_sync(my_turn, 256);
        const bool with_pv = pv_live;
        if (pv_live) {
          issue_round(sc, sc2, s, prev, Rows::kUsesValues);
        } else {
          issue_round(sc, sc2, s, prev, false);
        }
        tile::pin(sc);
        if constexpr (NV == 2) tile::pin(sc2);
        if (may_halt && wtid == 0) halted.publish(s, wg, done);
        tile::mbar_arrive(&k_empty[s]);
        // kPrescreens: nothing is in flight in a round without P V (issue_round waited for S).
        bool zero_tile = false;
        if constexpr (kPrescreens<Rows>) {
          if (votes && !with_pv && !qt.needs_mask(kt)) {
            const bool above = rows.any_above(sc, sc2, static_cast<std::int64_t>(kt) * BK);
            zero_tile = !tile::named_sync_or(kConsumerBarrier + wg, 128, above);
          }
        }
        if (!zero_tile) weigh(sc, sc2, kt);
        if constexpr (Rows::kUsesValues) {
          tile::wgmma_wait<0>();
          tile::pin(o);
          tile::mbar_arrive(&v_empty[prev]);
        }
        // kRecordsSupport: every tile but the prescreen's zero tiles marked (rounds with a P V in
        // flight untested: their own test, a warp vote on the scores, cost the beta = 1 forward
        // kernel 5-9% and the beta = 0 one 1-4%, H200, session 87).
        if (zero_tile) {
          pv_live = false;
        } else {
          record_support(kt);
          after_weights(sc, kt);
        }
      }

      // Last round: the last P with its V. Consumer 1 gives no turn back after it, so every
      // turn given is taken.
      const int prev = (i - 1) % S;
      if constexpr (Rows::kUsesValues) {
        tile::mbar_wait(&v_full[prev], ((i - 1) / S) & 1);
        tile::fence_to_async_proxy();
      }
      tile::named_sync(my_turn, 256);
      if constexpr (Rows::kUsesValues) {
        if (pv_live) {
          tile::wgmma_fence();
          issue_pv(prev);
        }
      }
      if (wg == 0) tile::named_arrive(other_turn, 256);
      if constexpr (Rows::kUsesValues) {
        tile::wgmma_wait<0>();
        tile::pin(o);
      }
    } else if (wg == 0) {
      // No tile at all: take the turn consumer 1 gave, so the barrier is left clean.
      tile::named_sync(my_turn, 256);
    }

    float stat[2];
    rows.finish(o, stat);
    if constexpr (kFinishesOutput<Rows>) rows.template finish_output<T>(o, p, cfg, qt, row0, tig);
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const std::int64_t row = row0 + 8 * half;
      if (row >= qt.s.q_len) continue;
      if constexpr (Rows::kUsesValues) {
        tile::store_fragment_row<T>(p.out.at<T>(qt.b, qt.s.q_start + row, qt.h), o, half, tig);
      }
      if (tig == 0) {
        if constexpr (Rows::kUsesValues && kWritesStats<Rows>) {
          *p.stats.at<float>(qt.b, qt.s.q_start + row, qt.h) = stat[half];
        }
        rows.store_extra(p, cfg, qt.b, qt.s.q_start + row, qt.h,
                         kept_from_key(static_cast<std::int64_t>(kept_from_tile) * BK, mask.first_key(half)), half);
      }
    }
  }
#endif
}

}  // namespace winnow::cuda
