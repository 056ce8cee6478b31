// alpha-entmax's backward over each row's support only (spec/entmax.md):
//   dz_ij = u_ij (dp_ij - delta_j),  dp_ij = dout_j . v_i,
//   delta_j = sum_i u_ij dp_ij / sum_i u_ij,  u = p^(2 - alpha),
// and every term vanishes outside the support {i : x_ij > tau_j}. On scores without local
// structure (random ones, or heads that look far back) the support holds a few dozen keys
// scattered over every key tile, so the dense backward (a sweep for U = sum u v, then the
// fused kernel over all tiles with support) computes almost only zeros. Here:
//   1. each row's support keys are listed (at most kSupportCapacity per row) and, per key, the
//      rows that hold it counted: by the forward's output sweep (EntmaxListedRows) when the
//      caller keeps a support record (winnow/entmax.h), else by EntmaxSupportRows, a value-free
//      sweep of the fused forward kernel;
//   2. an exclusive scan of those counts (CUB) places each key's entries;
//   3. the row pass (a warp per query row) gathers k and v of its support: scores, u, dp,
//      delta, dz; dq = sum dz k; it files (query, dz, p) under each key;
//   4. the key pass (a warp per key) sums dk = sum dz q and dv = sum p dout over its entries.
// A row whose support overflows its list sends the whole call back to the dense backward
// (entmax.cu decides after the sweep). The entries of a key arrive in no fixed order, so the
// sums of the key pass are not bitwise repeatable: deterministic calls take the dense path.
#pragma once

#include <cstdint>

#include "cuda/attention/entmax_rows.cuh"
#include "cuda/tile/row_vector.cuh"
#include "winnow/entmax.h"

namespace winnow::cuda {

// Support entries a row may list (winnow/entmax.h): on random scores at 16K keys a row's
// support averages about 27 keys (simulated), and a wider one is rare there.
inline constexpr int kSupportCapacity = static_cast<int>(entmax::kSupportListLength);

// Query rows and keys as flat slots over the whole batch: (row over all sequences, head).
__host__ __device__ __forceinline__ std::int64_t query_slot(const AttentionParams& p, std::int64_t b,
                                                            std::int64_t q_row, std::int64_t h) {
  return p.batch_row_q(b, q_row) * p.heads_q + h;
}
__host__ __device__ __forceinline__ std::int64_t key_slot(const AttentionParams& p, std::int64_t b,
                                                          std::int64_t k_row, std::int64_t hk) {
  return p.batch_row_k(b, k_row) * p.heads_kv + hk;
}

struct SupportLists {
  int* keys = nullptr;        // [query slot][kSupportCapacity]: operand rows of k (k_start + key)
  int* counts = nullptr;      // [query slot]: the row's support size (past capacity: overflowed)
  int* key_counts = nullptr;  // [key slot]: rows whose support holds the key
  int* totals = nullptr;      // [0]: entries listed over all rows; [1]: nonzero if some row overflowed
};

// The support record of winnow/entmax.h over its int32 buffer.
struct SupportRecord {
  int* listed = nullptr;  // [0]: 1 once a forward has listed the supports
  SupportLists lists;
  std::size_t clear_ints = 0;  // the header and the key counts: what a listing starts from zero

  static std::size_t ints(const AttentionParams& p) {
    return static_cast<std::size_t>(entmax::support_record_size(p.rows_q * p.heads_q, p.rows_k * p.heads_kv));
  }
  static SupportRecord over(int* base, const AttentionParams& p) {
    const std::size_t keys = static_cast<std::size_t>(p.rows_k * p.heads_kv);
    const std::size_t rows = static_cast<std::size_t>(p.rows_q * p.heads_q);
    SupportRecord r;
    r.listed = base;
    r.lists.totals = base + 1;
    r.lists.key_counts = base + entmax::kSupportRecordHeader;
    r.lists.counts = r.lists.key_counts + keys;
    r.lists.keys = r.lists.counts + rows;
    r.clear_ints = entmax::kSupportRecordHeader + keys;
    return r;
  }
};

// A thread's support bits of one tile: per row (half) a word with bit 2 n + e set for score
// s[n][2 half + e] in the support, which is key key_of(tig, n, e) = tig BK / 4 + that bit. Each
// score's bit is the sign bit of tau - x (for_each_gap_below), shifted in by one funnel shift:
// push is called for each row in increasing n and e, so the first score ends up highest, and
// row() reverses the word. Two partial words per row, the first and the second half of the
// tile's scores, so that the shifts are not one chain of 2 NT. A compare and a predicated add a
// score before: the listing sweep's per-score work is now the plain sweep's, four instructions.
// Its time did not move with that (0.531 -> 0.529 ms at 4K keys, H200, 2026-11-30): per-score
// issue is not what it waits on.
template <int NT>
struct SupportBitsOfTile {
  static_assert(NT % 2 == 0 && 2 * NT <= 32, "a bit per score of a row, two partial words");
  std::uint32_t part[2][2] = {{0u, 0u}, {0u, 0u}};
  __device__ __forceinline__ void push(int n, int half, float below) {
    std::uint32_t& word = part[half][n < NT / 2 ? 0 : 1];
    word = __funnelshift_l(__float_as_uint(below), word, 1);
  }
  // Score (n, e) is at bit NT - 1 - (2 n + e) of the first word (n < NT / 2) or of the second
  // (n - NT / 2 for n), so at 2 NT - 1 - (2 n + e) of first x 2^NT + second.
  __device__ __forceinline__ std::uint32_t row(int half) const {
    const std::uint32_t high_first = (part[half][0] << NT) | part[half][1];
    return __brev(high_first << (32 - 2 * NT));
  }
};

// Files a thread's support keys of each key tile into its two rows' lists: the quad scans its
// four threads' counts so that they write disjoint stretches of a row's list, and each key's
// count goes up by one per row that holds it. Shared by the backward's listing sweep and the
// forward's listing output sweep.
struct SupportListing {
  int count[2] = {0, 0};
  int* list[2];
  int* totals;
  int* key_counts;  // at key 0 of the sequence, kv head hk
  int key_stride;   // between consecutive keys' slots: heads_kv (slots fit an int: entmax.cu)
  int key_row0;     // operand row of key 0: k_start

  template <class Tile>
  __device__ __forceinline__ SupportListing(const AttentionParams& p, const SupportLists& lists, const Tile& qt,
                                            std::int64_t row0)
      : totals(lists.totals),
        key_counts(lists.key_counts + key_slot(p, qt.b, qt.s.k_start, qt.hk)),
        key_stride(static_cast<int>(p.heads_kv)),
        key_row0(static_cast<int>(qt.s.k_start)) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const std::int64_t row = row0 + 8 * half;
      list[half] = row < qt.s.q_len ? lists.keys + query_slot(p, qt.b, qt.s.q_start + row, qt.h) * kSupportCapacity
                                    : nullptr;
    }
  }

  // Rows past the sequence set no bits. The list is written from the bits, so that this costs
  // per support key, not per score; a row at a time, so that the loop over its bits knows its
  // list and count, and a key is the thread's first key of the tile plus the bit (an H100
  // profile of the sweep with one loop over both rows' bits as 64: 58 instructions per key,
  // 12% of the sweep's, most of them 64-bit arithmetic and selects between the rows; this form
  // has no 64-bit bit scans or row selects and spills less, and the sweep's time did not change).
  template <int NT>
  __device__ __forceinline__ void file(const SupportBitsOfTile<NT>& in, const RowMask& mask) {
    const std::uint32_t bits[2] = {in.row(0), in.row(1)};
    if (!__any_sync(0xffffffffu, (bits[0] | bits[1]) != 0)) return;
    const int first_key = static_cast<int>(mask.key0) + key_of<8 * NT>(mask.tig, 0, 0);
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      int at = claim(half, __popc(bits[half]), mask.tig);
      file_keys(half, at, first_key, bits[half]);
    }
  }

  // The place of the thread's first of n keys in the row's list: the quad's four threads write
  // disjoint stretches, in tig order. Every lane of the warp calls it.
  __device__ __forceinline__ int claim(int half, int n, int tig) {
    const tile::QuadScan scan = tile::quad_scan(static_cast<float>(n), tig);
    const int at = count[half] + static_cast<int>(scan.before);
    count[half] += static_cast<int>(scan.total);
    return at;
  }

  // Keys first_key + b for the set bits b of `bits` into the row's list from place `at`
  // (advanced past them; those past the list's end are counted, not written), each key's count
  // up by one.
  __device__ __forceinline__ void file_keys(int half, int& at, int first_key, std::uint32_t bits) {
    int* const out = list[half];
    int* const counts_at = key_counts + static_cast<std::int64_t>(first_key) * key_stride;
    for (std::uint32_t w = bits; w != 0; w &= w - 1) {
      const int bit = __ffs(static_cast<int>(w)) - 1;
      if (at < kSupportCapacity) out[at] = key_row0 + first_key + bit;
      ++at;
      atomicAdd(counts_at + bit * key_stride, 1);
    }
  }

  // Staged filing (Hopper's listing output sweep, which has shared memory to spare beside V):
  // a tile's nonzero bits go to the thread's records, one 8-byte store a row, and are filed at
  // the block's end, or when some thread of the warp has no room left. The per-tile filing
  // above costs a vote, two quad scans and the list's address a tile, about 130 instructions
  // a thread (SASS, sm_90a), shuffles among them, between a tile's scores and its P V.
  std::uint32_t staged[2] = {0u, 0u};       // each row's first record (shared address)
  std::uint32_t staged_next[2] = {0u, 0u};  // its next free one
  int staged_keys[2] = {0, 0};              // keys in each row's staged records
  std::uint32_t staging_stride = 0u, staging_room = 0u;  // bytes between records; capacity x stride

  __device__ __forceinline__ void borrow_staging(std::uint32_t slot, int stride, int capacity) {
    staging_stride = static_cast<std::uint32_t>(stride);
    staging_room = static_cast<std::uint32_t>(capacity * stride);
    staged[0] = staged_next[0] = slot;
    staged[1] = staged_next[1] = slot + 8u * 4u * 8u;  // row + 8
  }
  __device__ __forceinline__ bool staging() const { return staging_room != 0u; }

  template <int NT>
  __device__ __forceinline__ void stage(const SupportBitsOfTile<NT>& in, const RowMask& mask) {
    const std::uint32_t bits[2] = {in.row(0), in.row(1)};
    const bool full = staged_next[0] == staged[0] + staging_room || staged_next[1] == staged[1] + staging_room;
    if (__any_sync(0xffffffffu, full)) file_staged();
    const int first_key = static_cast<int>(mask.key0) + key_of<8 * NT>(mask.tig, 0, 0);
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      if (bits[half] != 0u) {
        tile::st_shared_v2_b32(staged_next[half], static_cast<std::uint32_t>(first_key), bits[half]);
        staged_next[half] += staging_stride;
        staged_keys[half] += __popc(bits[half]);
      }
    }
  }

  // Files every staged record, as file() files a tile's bits: the quad scans each row's keys
  // once (counted as they were staged, so that the records are read once, not twice), and each
  // thread writes its stretch of the row's list. One loop over a row's keys, which loads the
  // next record once the last one's bits are spent, not a loop over records around one over
  // each record's bits: a warp runs a loop for as long as its busiest lane, and nested, for
  // the most records and, in each, for the most bits of any lane. Every lane calls it.
  __device__ __forceinline__ void file_staged() {
    const int tig = static_cast<int>(threadIdx.x & 3u);
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      int at = claim(half, staged_keys[half], tig);
      staged_keys[half] = 0;
      int* const out = list[half];
      // The next record is loaded as the current one is taken, so that its load's latency
      // passes under the current record's keys.
      std::uint32_t a = staged[half], first_key = 0u, bits = 0u, next_first_key = 0u, next_bits = 0u;
      if (a < staged_next[half]) {
        tile::ld_shared_v2_b32(a, next_first_key, next_bits);
        a += staging_stride;
      }
      // Records hold nonzero bits (stage() skips the others), so a record taken has a key.
      while ((bits | next_bits) != 0u) {
        if (bits == 0u) {
          first_key = next_first_key;
          bits = next_bits;
          next_bits = 0u;
          if (a < staged_next[half]) {
            tile::ld_shared_v2_b32(a, next_first_key, next_bits);
            a += staging_stride;
          }
        }
        const int key = static_cast<int>(first_key) + __ffs(static_cast<int>(bits)) - 1;
        bits &= bits - 1u;
        if (at < kSupportCapacity) out[at] = key_row0 + key;
        ++at;
        atomicAdd(key_counts + key * key_stride, 1);
      }
      staged_next[half] = staged[half];
    }
  }

  // The totals once per warp (counts are the same on the four threads of a quad).
  __device__ __forceinline__ void finish() const {
    const int listed = (threadIdx.x & 3) == 0 ? min(count[0], kSupportCapacity) + min(count[1], kSupportCapacity) : 0;
    const int warp_listed = __reduce_add_sync(0xffffffffu, listed);
    const bool overflow = __any_sync(0xffffffffu, count[0] > kSupportCapacity || count[1] > kSupportCapacity);
    if ((threadIdx.x & 31) == 0) {
      if (warp_listed > 0) atomicAdd(totals, warp_listed);
      if (overflow) atomicOr(totals + 1, 1);
    }
  }

  __device__ __forceinline__ void store_count(const AttentionParams& p, const SupportLists& lists, std::int64_t b,
                                              std::int64_t row, std::int64_t h, int half) const {
    lists.counts[query_slot(p, b, row, h)] = count[half];
  }
};

struct EntmaxSupportConfig {
  float alpha = 1.5f;
  detail::Operand tau;  // float per row, x units
  SupportLists lists;
};

// The backward's listing sweep (when the forward kept no record): value-free, one bit per
// score with a positive gap.
struct EntmaxSupportRows : ThresholdSweepRows {
  float x_scale;
  float tau[2];
  SupportListing listing;

  template <class Tile>
  __device__ __forceinline__ EntmaxSupportRows(const AttentionParams& p, const EntmaxSupportConfig& cfg,
                                               const Tile& qt, std::int64_t row0)
      : x_scale(static_cast<float>(p.scale) * (cfg.alpha - 1.f)), listing(p, cfg.lists, qt, row0) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const std::int64_t row = row0 + 8 * half;
      // +infinity: no gap of a row past the sequence is positive.
      tau[half] = row < qt.s.q_len ? never_negative_zero(*cfg.tau.at<const float>(qt.b, qt.s.q_start + row, qt.h))
                                   : INFINITY;
    }
  }

  template <bool Masked, int NT>
  __device__ __forceinline__ void weights(float (&s)[NT][4], const RowMask& mask) {
    SupportBitsOfTile<NT> in;
#pragma unroll
    for (int n = 0; n < NT; ++n) {
#pragma unroll
      for (int i = 0; i < 4; ++i) in.push(n, i / 2, gap_below<Masked>(s, mask, x_scale, tau, n, i));
    }
    listing.file<NT>(in, mask);
  }

  template <int DT>
  __device__ __forceinline__ void finish(float (&)[DT][4], float (&)[2]) const {
    listing.finish();
  }

  __device__ __forceinline__ void store_extra(const AttentionParams& p, const EntmaxSupportConfig& cfg,
                                              std::int64_t b, std::int64_t row, std::int64_t h,
                                              std::int64_t, int half) const {
    listing.store_count(p, cfg.lists, b, row, h, half);
  }
};

// Records a thread stages per row before its warp files them, on Hopper (EntmaxListedRows).
inline constexpr int kStagedSupportRecords = 16;

// The forward's output sweep when the caller keeps a support record: entmax's weights, and
// each positive gap filed as it goes (the bits come from the gaps the weights need anyway).
struct EntmaxListedConfig : EntmaxCudaConfig {
  SupportLists lists;
  int staged_records = kStagedSupportRecords;  // 1 to kStagedSupportRecords (tests take 1)
};

struct EntmaxListedRows : EntmaxRows {
  SupportListing listing;
  // Staged support bits on Hopper (forward.cuh, kStagingBytes): 16 records a thread and row
  // (fewer when cfg.staged_records says so), 64 KB beside V's ring. On random scores a row's
  // support is a few dozen keys over every key tile, so a thread stages about one record in
  // four to eight tiles.
  static constexpr int kStagingBytes = kForwardBQ * 4 * kStagedSupportRecords * 8;
  int staged_records;
  __device__ __forceinline__ void borrow_staging(std::uint32_t slot, int stride, int capacity) {
    listing.borrow_staging(slot, stride, min(capacity, staged_records));
  }

  template <class Tile>
  __device__ __forceinline__ EntmaxListedRows(const AttentionParams& p, const EntmaxListedConfig& cfg,
                                              const Tile& qt, std::int64_t row0)
      : EntmaxRows(p, cfg, qt, row0), listing(p, cfg.lists, qt, row0), staged_records(cfg.staged_records) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      // +infinity: a row past the sequence has no weights and files nothing.
      tau[half] = row0 + 8 * half < qt.s.q_len ? never_negative_zero(tau[half]) : INFINITY;
    }
  }

  template <bool Masked, int NT>
  __device__ __forceinline__ void weights(float (&s)[NT][4], const RowMask& mask) {
    namespace em = math::entmax;
    SupportBitsOfTile<NT> in;
    for_each_gap_below<Masked>(s, mask, x_scale, tau, alpha, [&](auto family, int n, int i, int half, float below) {
      s[n][i] = em::weight(family, -below);
      in.push(n, half, below);
    });
    if (listing.staging()) {
      listing.stage<NT>(in, mask);
    } else {
      listing.file<NT>(in, mask);
    }
  }

  template <int DT>
  __device__ __forceinline__ void finish(float (&o)[DT][4], float (&stat)[2]) {
    EntmaxRows::finish(o, stat);
    if (listing.staging()) listing.file_staged();
    listing.finish();
  }

  __device__ __forceinline__ void store_extra(const AttentionParams& p, const EntmaxListedConfig& cfg,
                                              std::int64_t b, std::int64_t row, std::int64_t h,
                                              std::int64_t, int half) const {
    listing.store_count(p, cfg.lists, b, row, h, half);
  }
};

// What the row and key passes share.
struct SparseBackwardParams {
  float alpha = 1.5f;
  const int* keys = nullptr;    // SupportLists::keys
  const int* counts = nullptr;  // SupportLists::counts
  const int* key_counts = nullptr;
  const int* key_offsets = nullptr;  // exclusive scan of key_counts: each key's first entry
  int* key_fill = nullptr;           // entries filed so far per key (zeroed before the row pass)
  // Entries the buffers below hold: the record's total, or the forward's count of it, which
  // equals it (the same test of the same scores); entries past it are dropped, not written.
  int entry_capacity = 0;
  // Per entry, in key order: the query as (operand row << group_bits) | its head's place in the
  // kv head's group (under 2^32, query slots fitting an int), dz (times the scale: the
  // gradient of the raw score q . k) and p. A shift and a mask decode it: the key pass's
  // division by heads_q was about a fifth of its instructions per entry (SASS, H100).
  int group_bits = 0;  // ceil(log2(heads_q / heads_kv))
  std::uint32_t* entry_query = nullptr;
  float* entry_dz = nullptr;
  float* entry_p = nullptr;
};

inline constexpr int kSparseWarps = 8;

// A warp per query row. Its support's key indices come in with one coalesced load; then each
// group of kLanes lanes takes one key at a time, two in flight (eight per warp), so that a
// score or dp costs three shuffle steps, not five, and the loads of k and v overlap. Once
// delta is known, dz and p are per entry and a lane each: the lanes file their entries (one
// atomic round trip per 32 entries, not one per entry), and the groups gather dq = sum dz k.
template <class T, int D>
__global__ void __launch_bounds__(32 * kSparseWarps)
    entmax_sparse_rows_kernel(const AttentionParams p, const detail::GradientParams g, const SparseBackwardParams sp) {
  constexpr int kLanes = 8, kGroups = 32 / kLanes, E = D / kLanes;
  __shared__ int key_of_entry[kSparseWarps][kSupportCapacity];
  __shared__ float gap_of[kSparseWarps][kSupportCapacity], dp_of[kSparseWarps][kSupportCapacity];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, group = lane / kLanes, sub = lane % kLanes;
  const std::int64_t b = blockIdx.z, h = blockIdx.y;
  const SequenceExtent s = p.sequence(b);
  const std::int64_t row = static_cast<std::int64_t>(blockIdx.x) * kSparseWarps + warp;
  if (row >= s.q_len) return;
  const std::int64_t q_row = s.q_start + row, hk = p.kv_head(h);
  const std::int64_t slot = query_slot(p, b, q_row, h);
  const int n = min(sp.counts[slot], kSupportCapacity);  // the caller made sure none overflowed
  int* const keys = key_of_entry[warp];
  float* const gaps = gap_of[warp];
  float* const dps = dp_of[warp];  // dp, then dz
  for (int j = lane; j < n; j += 32) keys[j] = sp.keys[slot * kSupportCapacity + j];
  const float tau = *p.stats.at<const float>(b, q_row, h);
  const float scale = static_cast<float>(p.scale), x_scale = scale * (sp.alpha - 1.f);
  // A key's slice of k and v: these plus its operand row times the row strides (Operand::at's
  // full index per gather cost about twenty integer instructions).
  const T* const k_head = p.k.at<const T>(b, 0, hk) + sub * E;
  const T* const v_head = p.v.at<const T>(b, 0, hk) + sub * E;
  const std::int64_t k_stride = p.k.row, v_stride = p.v.row;

  float q[E], dout[E], dq[E];
  tile::load_slice<T>(p.q.at<const T>(b, q_row, h) + sub * E, q);
  tile::load_slice<T>(g.dout.at<const T>(b, q_row, h) + sub * E, dout);
#pragma unroll
  for (int e = 0; e < E; ++e) dq[e] = 0.f;
  __syncwarp();

  math::entmax::with_family(sp.alpha, [&](auto family) {
    namespace em = math::entmax;
    constexpr int kInFlight = 2;
    float sum_u = 0.f, sum_u_dp = 0.f;
    for (int j0 = 0; j0 < n; j0 += kInFlight * kGroups) {
      float qk[kInFlight], dp[kInFlight];
#pragma unroll
      for (int f = 0; f < kInFlight; ++f) {
        const int j = j0 + f * kGroups + group;
        qk[f] = dp[f] = 0.f;
        if (j < n) {
          float k[E], v[E];
          tile::load_slice<T>(k_head + keys[j] * k_stride, k);
          tile::load_slice<T>(v_head + keys[j] * v_stride, v);
#pragma unroll
          for (int e = 0; e < E; ++e) {
            qk[f] = fmaf(q[e], k[e], qk[f]);
            dp[f] = fmaf(dout[e], v[e], dp[f]);
          }
        }
      }
#pragma unroll
      for (int o = 1; o < kLanes; o *= 2) {
#pragma unroll
        for (int f = 0; f < kInFlight; ++f) {
          qk[f] += __shfl_xor_sync(0xffffffffu, qk[f], o);
          dp[f] += __shfl_xor_sync(0xffffffffu, dp[f], o);
        }
      }
#pragma unroll
      for (int f = 0; f < kInFlight; ++f) {
        const int j = j0 + f * kGroups + group;
        if (j < n && sub == 0) {
          const float gap = fmaf(qk[f], x_scale, -tau);
          const float u = em::grad_weight(family, gap);
          sum_u += u;
          sum_u_dp = fmaf(u, dp[f], sum_u_dp);
          gaps[j] = gap;
          dps[j] = dp[f];
        }
      }
    }
#pragma unroll
    for (int o = 1; o < 32; o *= 2) {
      sum_u += __shfl_xor_sync(0xffffffffu, sum_u, o);
      sum_u_dp += __shfl_xor_sync(0xffffffffu, sum_u_dp, o);
    }
    const float delta = sum_u > 0.f ? sum_u_dp / sum_u : 0.f;
    __syncwarp();
    const std::uint32_t query = static_cast<std::uint32_t>(q_row) << sp.group_bits |
                                static_cast<std::uint32_t>(h - hk * p.group_size());
    for (int j = lane; j < n; j += 32) {
      const float gap = gaps[j];
      const float dz = scale * em::grad_logit(em::grad_weight(family, gap), dps[j], delta);
      const std::int64_t kslot = key_slot(p, b, keys[j], hk);
      const int at = sp.key_offsets[kslot] + atomicAdd(sp.key_fill + kslot, 1);
      if (at < sp.entry_capacity) {
        sp.entry_query[at] = query;
        sp.entry_dz[at] = dz;
        sp.entry_p[at] = em::weight(family, gap);
      }
      dps[j] = dz;
    }
  });
  __syncwarp();
  // dq = sum dz k: k once more, from L2. Neither keeping the first 16 keys' k in shared memory
  // (0.582 against 0.578 ms at 4K, H100) nor accumulating sum u dp k and sum u k in the first
  // loop, to subtract delta sum u k at the end (1-2% at three blocks a multiprocessor, slower
  // at two), made this pass faster: its bound is not these bytes (docs/performance.md).
#pragma unroll 2
  for (int j = group; j < n; j += kGroups) {
    float k[E];
    tile::load_slice<T>(k_head + keys[j] * k_stride, k);
    const float dz = dps[j];
#pragma unroll
    for (int e = 0; e < E; ++e) dq[e] = fmaf(dz, k[e], dq[e]);
  }
#pragma unroll
  for (int e = 0; e < E; ++e) {
#pragma unroll
    for (int o = kLanes; o < 32; o *= 2) dq[e] += __shfl_xor_sync(0xffffffffu, dq[e], o);
  }
  if (group == 0) tile::store_slice<T>(g.dq.at<T>(b, q_row, h) + sub * E, dq);
}

// A warp per key (and kv head): dk = sum dz q, dv = sum p dout over the entries the row pass
// filed under it, every query head of the group included. Keys no row supports get zeros.
// The lanes fetch 32 entries' (query, dz, p) at once; groups of kLanes lanes then take one
// entry each, two in flight, and the groups' sums meet at the end.
// Four blocks a multiprocessor (64 registers, no spills at D = 128): with the shift-decoded
// queries and the cheaper conversions and addresses this pass fell from 0.443 to 0.350 ms at
// 4K keys (H100), where ptxas's own choice (65 registers) left three.
template <class T, int D>
__global__ void __launch_bounds__(32 * kSparseWarps, 4)
    entmax_sparse_keys_kernel(const AttentionParams p, const detail::GradientParams g, const SparseBackwardParams sp) {
  constexpr int kLanes = 8, kGroups = 32 / kLanes, E = D / kLanes, kInFlight = 2;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, group = lane / kLanes, sub = lane % kLanes;
  const std::int64_t b = blockIdx.z, hk = blockIdx.y;
  const SequenceExtent s = p.sequence(b);
  const std::int64_t key = static_cast<std::int64_t>(blockIdx.x) * kSparseWarps + warp;
  if (key >= s.k_len) return;
  const std::int64_t k_row = s.k_start + key, kslot = key_slot(p, b, k_row, hk);
  const int first = sp.key_offsets[kslot], end = min(first + sp.key_counts[kslot], sp.entry_capacity);
  // A query's slices of q and dout: these plus its operand row and its head's place in the
  // group times the strides.
  const std::int64_t head0 = hk * p.group_size();
  const T* const q_group = p.q.at<const T>(b, 0, head0) + sub * E;
  const T* const dout_group = g.dout.at<const T>(b, 0, head0) + sub * E;
  const std::uint32_t in_group = (1u << sp.group_bits) - 1u;
  float dk[E], dv[E];
#pragma unroll
  for (int e = 0; e < E; ++e) dk[e] = dv[e] = 0.f;
  for (int c0 = first; c0 < end; c0 += 32) {
    std::uint32_t query = 0;
    float dz = 0.f, weight = 0.f;
    if (c0 + lane < end) {
      query = sp.entry_query[c0 + lane];
      dz = sp.entry_dz[c0 + lane];
      weight = sp.entry_p[c0 + lane];
    }
    const int m = min(32, end - c0);
    for (int t0 = 0; t0 < m; t0 += kInFlight * kGroups) {
#pragma unroll
      for (int f = 0; f < kInFlight; ++f) {
        const int t = t0 + f * kGroups + group;
        const int src = t < 32 ? t : 31;
        const std::uint32_t qid = __shfl_sync(0xffffffffu, query, src);
        const float dz_t = __shfl_sync(0xffffffffu, dz, src), p_t = __shfl_sync(0xffffffffu, weight, src);
        if (t < m) {
          const std::int64_t q_row = qid >> sp.group_bits, hg = qid & in_group;
          float q[E], dout[E];
          tile::load_slice<T>(q_group + q_row * p.q.row + hg * p.q.head, q);
          tile::load_slice<T>(dout_group + q_row * g.dout.row + hg * g.dout.head, dout);
#pragma unroll
          for (int e = 0; e < E; ++e) {
            dk[e] = fmaf(dz_t, q[e], dk[e]);
            dv[e] = fmaf(p_t, dout[e], dv[e]);
          }
        }
      }
    }
  }
#pragma unroll
  for (int e = 0; e < E; ++e) {
#pragma unroll
    for (int o = kLanes; o < 32; o *= 2) {
      dk[e] += __shfl_xor_sync(0xffffffffu, dk[e], o);
      dv[e] += __shfl_xor_sync(0xffffffffu, dv[e], o);
    }
  }
  if (group == 0) {
    tile::store_slice<T>(g.dk.at<T>(b, k_row, hk) + sub * E, dk);
    tile::store_slice<T>(g.dv.at<T>(b, k_row, hk) + sub * E, dv);
  }
}

}  // namespace winnow::cuda
