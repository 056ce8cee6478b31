// Split-KV decoding (flash-decoding): a few queries per sequence against a long key/value
// cache, where the work is reading the cache once at memory speed.
//
// Block (split s, kv head h, sequence b) reads keys [s * split_len, (s + 1) * split_len) of head
// h once, for every query head of h's group and every query of the sequence (up to ROWS rows;
// more come as further row groups). Inside the block the keys go to STREAMS streams of LANES
// threads; a stream owns a contiguous run of keys, visits it from the right (the order
// stick-breaking breaks its stick in), one key row at a time with kLaneElems features per lane:
// every lane keeps its features of every row's output, and the lanes that own a row's score
// (reduce_scatter) keep that row's running state. Streams merge in shared memory; splits merge
// in the combine kernel (or the block writes the result when there is one split). A merge is
// exact for both mechanisms (math::softmax::merge_factor, math::stick_breaking::left_chunk_factor),
// so the result does not depend on how the keys were split beyond float32 rounding.
// Sieve and alpha-entmax decode here too once the threshold search (threshold_search.cuh) has
// found each row's threshold over the whole cache: Sieve is then stick-breaking over the keys
// above it, entmax a plain sum of weights that already sum to one. Sieve's bound filter finds
// its thresholds here as well, in a pass without values (RowMaxDecode). Threshold attention
// (TRA, TDA as two passes) normalizes queries and keys as it reads them (kUnitRows).
//
// Scores are kept in log2 units (x = z log2 e) for the hardware's exp2 and log2, but for
// entmax's, which are in the threshold search's units.
#pragma once

#include <cmath>
#include <cstdint>
#include <type_traits>

#include "core/decode_params.h"
#include "cuda/element_types.cuh"
#include "cuda/tile/ptx.cuh"
#include "math/elementwise.h"
#include "math/entmax.h"
#include "math/softmax.h"
#include "math/stick_breaking.h"
#include "math/threshold.h"

namespace winnow::cuda::decode {

constexpr int kThreads = 128;
constexpr int kLaneElems = 8;  // features per lane: one 16-byte load of 16-bit values, two of float32
// Key rows a lane computes on per step (float32 rows take twice the registers), and the steps'
// worth of rows in its shared-memory ring: two are in flight (cp.async) while it computes on a
// third. A register ring of one step ahead (16 KB a block in flight) read 0.94 of an H100's copy
// bandwidth at 32K keys but 0.71 of an H200's (2026-11-29), whose higher bandwidth at a similar
// latency needs more bytes in flight; the shared ring holds 32 KB in flight a block and no
// registers.
constexpr int kAhead16 = 4;
constexpr int kAhead32 = 2;
constexpr int kRingSteps = 3;
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

// A row's summary of a chunk of keys, two floats so partial results share one layout.
struct ChunkState {
  float a, b;
};

// A policy's state type (Policy::State where it has one, else ChunkState), and whether only one
// lane of each row's group builds it live (kLeaderOnly: a policy with side effects per key).
template <class P, class = void>
struct state_of {
  using type = ChunkState;
};
template <class P>
struct state_of<P, std::void_t<typename P::State>> {
  using type = typename P::State;
};
template <class P, class = void>
struct leader_only : std::false_type {};
template <class P>
struct leader_only<P, std::void_t<decltype(P::kLeaderOnly)>> : std::bool_constant<P::kLeaderOnly> {};

// The sequence's query and head of row r of kv head hk's group (rows run query-major).
struct GroupRow {
  std::int64_t query, head;
};
__device__ __forceinline__ GroupRow group_row(const detail::DecodeParams& p, std::int64_t hk, std::int64_t r) {
  const std::int64_t g = p.group_size();
  return {r / g, hk * g + r % g};
}

// A row's state lives in the lanes that own the row's score (see reduce_scatter). Each of
// them builds the mechanism's policy for its row (`live` false for a row past the block's,
// which sees no key); per key the policy turns the score x (the query's dot product with the
// key, the queries pre-scaled by query_scale) into the weight p of its value row and the factor
// c that rescales the row's output so far (1 when unchanged), which every lane then applies to
// its features. merge combines two chunks' states, left then right; store writes a row's
// per-row outputs beside out (output(s, o) per feature).

// Softmax: a = the chunk's largest logit m (log2 units), b = l = sum exp2(x - m);
// o = sum exp2(x - m) v. The output is rescaled only when the maximum grows, which after the
// first keys is rare.
struct SoftmaxDecode {
  static constexpr bool kRescales = true;
  static constexpr bool kUsesValues = true;
  static constexpr bool kUnitRows = false;
  __device__ static float query_scale(const detail::DecodeParams& p) { return static_cast<float>(p.scale) * kLog2e; }
  __device__ SoftmaxDecode(const detail::DecodeParams&, std::int64_t, const GroupRow&, bool) {}
  __device__ static ChunkState empty() { return {-INFINITY, 0.f}; }
  __device__ void step(ChunkState& s, float x, float& p, float& c) const {
    c = 1.f;
    if (x > s.a) {
      c = math::softmax::merge_factor(s.a, x, tile::exp2_fast);
      s.b *= c;
      s.a = x;
    }
    p = tile::exp2_fast(x - s.a);
    s.b += p;
  }
  // The factors of the left (accumulated) and right chunks' outputs, and the merged state.
  __device__ static void merge(ChunkState& left, const ChunkState& right, float& f_left, float& f_right) {
    const float m = fmaxf(left.a, right.a);
    f_left = math::softmax::merge_factor(left.a, m, tile::exp2_fast);
    f_right = math::softmax::merge_factor(right.a, m, tile::exp2_fast);
    left.b = left.b * f_left + right.b * f_right;
    left.a = m;
  }
  __device__ static float output(const ChunkState& s, float o) { return s.b > 0.f ? o / s.b : 0.f; }
  // lse in natural units; -inf for a row without keys.
  __device__ static void store(const detail::DecodeParams& p, std::int64_t b, const GroupRow& row,
                               const ChunkState& s) {
    *p.stats.at<float>(b, row.query, row.head) = s.b > 0.f ? (s.a + tile::log2_fast(s.b)) * kLn2 : -INFINITY;
  }
};

// Stick-breaking: a = the chunk's cost (sum of stick costs, log2 units), b unused; o over the
// chunk's own keys. Keys are visited right to left, so a key's weight is its own share times
// what the keys to its right (already visited) left of the stick; nothing is ever rescaled.
struct StickBreakingDecode {
  static constexpr bool kRescales = false;
  static constexpr bool kUsesValues = true;
  static constexpr bool kUnitRows = false;
  __device__ static float query_scale(const detail::DecodeParams& p) { return static_cast<float>(p.scale) * kLog2e; }
  __device__ StickBreakingDecode(const detail::DecodeParams&, std::int64_t, const GroupRow&, bool) {}
  __device__ static ChunkState empty() { return {0.f, 0.f}; }
  __device__ static void step_of(ChunkState& s, float x, float& p) {
    const float cost = math::stick_breaking::stick_cost_log2(x, tile::exp2_fast, tile::log2_fast);
    p = tile::exp2_fast(x - cost - s.a);
    s.a += cost;
  }
  __device__ void step(ChunkState& s, float x, float& p, float& c) const {
    step_of(s, x, p);
    c = 1.f;
  }
  __device__ static void merge(ChunkState& left, const ChunkState& right, float& f_left, float& f_right) {
    f_left = math::stick_breaking::left_chunk_factor(right.a, tile::exp2_fast);
    f_right = 1.f;
    left.a += right.a;
  }
  __device__ static float output(const ChunkState&, float o) { return o; }
  // log_rem in natural units.
  __device__ static void store(const detail::DecodeParams& p, std::int64_t b, const GroupRow& row,
                               const ChunkState& s) {
    *p.stats.at<float>(b, row.query, row.head) = -s.a * kLn2;
    if (p.kept_from.data != nullptr) *p.kept_from.at<std::int32_t>(b, row.query, row.head) = 0;
  }
};

// Sieve (spec/sieve.md): stick-breaking over the keys whose score clears the row's threshold
// (math::sieve::admitted, compared in log2 units as the forward compares them); the others
// neither weigh nor break the stick. b counts the admitted keys, as an integer in the float's
// bits, so that counts past 2^24 stay exact.
struct SieveDecode {
  static constexpr bool kRescales = false;
  static constexpr bool kUsesValues = true;
  static constexpr bool kUnitRows = false;
  float threshold_log2;
  __device__ static float query_scale(const detail::DecodeParams& p) { return static_cast<float>(p.scale) * kLog2e; }
  __device__ SieveDecode(const detail::DecodeParams& p, std::int64_t b, const GroupRow& row, bool live)
      : threshold_log2(live ? *p.threshold.at<const float>(b, row.query, row.head) * kLog2e : INFINITY) {}
  __device__ static ChunkState empty() { return {0.f, __int_as_float(0)}; }
  __device__ void step(ChunkState& s, float x, float& p, float& c) const {
    c = 1.f;
    p = 0.f;
    if (!math::sieve::admitted(x, threshold_log2)) return;
    StickBreakingDecode::step_of(s, x, p);
    s.b = __int_as_float(__float_as_int(s.b) + 1);
  }
  __device__ static void merge(ChunkState& left, const ChunkState& right, float& f_left, float& f_right) {
    const float counted = __int_as_float(__float_as_int(left.b) + __float_as_int(right.b));
    StickBreakingDecode::merge(left, right, f_left, f_right);
    left.b = counted;
  }
  __device__ static float output(const ChunkState&, float o) { return o; }
  __device__ static void store(const detail::DecodeParams& p, std::int64_t b, const GroupRow& row,
                               const ChunkState& s) {
    *p.stats.at<float>(b, row.query, row.head) = -s.a * kLn2;
    if (p.count.data != nullptr) *p.count.at<std::int32_t>(b, row.query, row.head) = __float_as_int(s.b);
  }
};

// Sieve's bound filter's threshold, the row's largest score less eps (score units, as the
// forward's first threshold sweep writes it; 0 for a row without keys): a pass without values
// whose chunks merge by their maximum.
struct RowMaxDecode {
  static constexpr bool kRescales = false;
  static constexpr bool kUsesValues = false;
  static constexpr bool kUnitRows = false;
  __device__ static float query_scale(const detail::DecodeParams& p) { return static_cast<float>(p.scale); }
  __device__ RowMaxDecode(const detail::DecodeParams&, std::int64_t, const GroupRow&, bool) {}
  __device__ static ChunkState empty() { return {-INFINITY, 0.f}; }
  __device__ void step(ChunkState& s, float x, float& p, float& c) const {
    s.a = fmaxf(s.a, x);
    p = 0.f;
    c = 1.f;
  }
  __device__ static void merge(ChunkState& left, const ChunkState& right, float& f_left, float& f_right) {
    left.a = fmaxf(left.a, right.a);
    f_left = 1.f;
    f_right = 1.f;
  }
  __device__ static float output(const ChunkState&, float) { return 0.f; }
  __device__ static void store(const detail::DecodeParams& p, std::int64_t b, const GroupRow& row,
                               const ChunkState& s) {
    *p.threshold.at<float>(b, row.query, row.head) = s.a > -INFINITY ? s.a - p.bound_eps : 0.f;
  }
};

// alpha-entmax: the weight of a key is (x - tau)_+^(1 / (alpha - 1)) with x = (alpha - 1) z,
// the units the threshold search and the forward use; the row's weights already sum to one,
// so a chunk's output is its plain sum and chunks add. The row's statistic is tau, which the
// search wrote.
struct EntmaxDecode {
  static constexpr bool kRescales = false;
  static constexpr bool kUsesValues = true;
  static constexpr bool kUnitRows = false;
  float tau, alpha;
  __device__ static float query_scale(const detail::DecodeParams& p) {
    return static_cast<float>(p.scale) * (p.alpha - 1.f);
  }
  __device__ EntmaxDecode(const detail::DecodeParams& p, std::int64_t b, const GroupRow& row, bool live)
      : tau(live ? *p.threshold.at<const float>(b, row.query, row.head) : INFINITY), alpha(p.alpha) {}
  __device__ static ChunkState empty() { return {0.f, 0.f}; }
  __device__ void step(ChunkState&, float x, float& p, float& c) const {
    p = math::entmax::weight(x - tau, alpha);
    c = 1.f;
  }
  __device__ static void merge(ChunkState&, const ChunkState&, float& f_left, float& f_right) {
    f_left = 1.f;
    f_right = 1.f;
  }
  __device__ static float output(const ChunkState&, float o) { return o; }
  __device__ static void store(const detail::DecodeParams&, std::int64_t, const GroupRow&, const ChunkState&) {}
};

// Sums each of ROWS per-lane partial dot products over the LANES lanes of a stream, leaving row
// r's total in the lanes r * (LANES / ROWS) .. (r + 1) * (LANES / ROWS) - 1: every halving step
// sends half of the rows still held to the partner lane and keeps the other half, so the
// stream spends log2(LANES) + ROWS - 1 shuffles instead of ROWS log2(LANES). Returns that sum.
template <int LANES, int ROWS>
__device__ __forceinline__ float reduce_scatter(float (&v)[ROWS], int lane) {
  static_assert(ROWS <= LANES, "a row per lane group");
  int held = ROWS;
#pragma unroll
  for (int offset = LANES / 2; offset >= 1; offset /= 2) {
    if (held > 1) {
      const int half = held / 2;
      const bool upper = (lane & offset) != 0;
#pragma unroll
      for (int j = 0; j < ROWS / 2; ++j) {
        if (j < half) {
          const float send = upper ? v[j] : v[j + half];
          const float keep = upper ? v[j + half] : v[j];
          v[j] = keep + __shfl_xor_sync(0xffffffffu, send, offset);
        }
      }
      held = half;
    } else {
      v[0] += __shfl_xor_sync(0xffffffffu, v[0], offset);
    }
  }
  return v[0];
}

// kLaneElems consecutive features of a row as raw 16-byte words.
template <class T>
struct LaneFeatures {
  static constexpr int kWords = kLaneElems * static_cast<int>(sizeof(T)) / 16;
  uint4 w[kWords];

  __device__ void widen(float (&out)[kLaneElems]) const {
    const T* e = reinterpret_cast<const T*>(w);
#pragma unroll
    for (int i = 0; i < kLaneElems; ++i) out[i] = cuda::widen(e[i]);
  }
};

// Walks one stream's keys from the right, one at a time, giving each key row's element offset
// in a cache operand (head hk). Paged caches look a page up only when the walk crosses into it;
// contiguous ones are the page b with slot = key index.
struct KeyCursor {
  std::int64_t page;
  int page_index, slot;

  __device__ KeyCursor(const detail::DecodeParams& p, std::int64_t b, int first) {
    if (p.block_table == nullptr) {
      page = b;
      page_index = 0;
      slot = first;
    } else {
      const int page_size = static_cast<int>(p.page_size);
      page_index = first / page_size;
      slot = first % page_size;
      page = first >= 0 ? p.block_table[b * p.table_stride + page_index] : 0;
    }
  }
  __device__ std::int64_t offset(const detail::CacheOperand& c, std::int64_t hk) const {
    return page * c.page + slot * c.slot + hk * c.head;
  }
  // To the key on the left; call only while that key is in the stream's run.
  __device__ void advance(const detail::DecodeParams& p, std::int64_t b) {
    if (--slot >= 0 || p.block_table == nullptr) return;
    slot = static_cast<int>(p.page_size) - 1;
    --page_index;
    page = p.block_table[b * p.table_stride + page_index];
  }
};

// Key counts and indices fit 32 bits (the launcher checks the capacity).
__device__ __forceinline__ int sequence_keys(const detail::DecodeParams& p, std::int64_t b) {
  return p.seq_lens != nullptr ? p.seq_lens[b] : static_cast<int>(p.len_k);
}

// Keys visible to a query: the sequence's queries are its last len_q positions.
__device__ __forceinline__ int visible_keys(const detail::DecodeParams& p, int n, std::int64_t query) {
  const int limit = n - static_cast<int>(p.len_q - query) + (p.attend_current ? 1 : 0);
  return limit < 0 ? 0 : (limit > n ? n : limit);
}

// A per-head parameter, float32 as the statistics of 16-bit and float32 inputs are.
__device__ __forceinline__ float head_value(const detail::Operand& o, std::int64_t h) {
  return static_cast<const float*>(o.data)[h * o.head];
}

// Threshold attention (TRA, spec/threshold.md): the cosine of the query and the key, which the
// kernel normalizes as it reads them (kUnitRows), weighs relu(s - tau)^p with tau = beta
// sqrt(2 log(n) / D) over the row's n visible keys. The weights are not normalized, so chunks
// add. TDA is two passes: the second over the second view's queries and keys, its weights times
// -lambda, adding into the first's output (DecodeParams::add_to_out).
struct ThresholdDecode {
  static constexpr bool kRescales = false;
  static constexpr bool kUsesValues = true;
  static constexpr bool kUnitRows = true;
  float tau = 0.f, power, factor = 1.f;
  __device__ static float query_scale(const detail::DecodeParams&) { return 1.f; }
  __device__ ThresholdDecode(const detail::DecodeParams& p, std::int64_t b, const GroupRow& row, bool live)
      : power(p.power) {
    if (!live) return;
    const float n = static_cast<float>(visible_keys(p, sequence_keys(p, b), row.query));
    tau = head_value(p.beta, row.head) * math::threshold::threshold_unit(n, static_cast<float>(p.dim_qk));
    if (p.lambda.data != nullptr) {
      factor = -math::threshold::lambda_used(head_value(p.lambda, row.head), p.clamp_lambda);
    }
  }
  __device__ static ChunkState empty() { return {0.f, 0.f}; }
  __device__ void step(ChunkState&, float x, float& p, float& c) const {
    p = math::threshold::weight(x - tau, power) * factor;
    c = 1.f;
  }
  __device__ static void merge(ChunkState&, const ChunkState&, float& f_left, float& f_right) {
    f_left = 1.f;
    f_right = 1.f;
  }
  __device__ static float output(const ChunkState&, float o) { return o; }
  // The forward's statistic, 0, where the call has one.
  __device__ static void store(const detail::DecodeParams& p, std::int64_t b, const GroupRow& row,
                               const ChunkState&) {
    if (p.stats.data != nullptr) *p.stats.at<float>(b, row.query, row.head) = 0.f;
  }
};

// alpha-entmax's threshold search over the cache (entmax, and Sieve's exact filter), in the
// units x = (alpha - 1) z it solves in: two passes without values, then a warp per row
// (decode_search_kernel). The first keeps each row's kTopScores largest x and writes the largest
// and a floor under tau (math::entmax::threshold_floor over them: the few keys' own root); the
// second lists the keys above the floor, as the forward's collect sweep does; the warp solves
// on the list exactly (sparsemax, 1.5-entmax) or by the bracketed search.
constexpr int kTopScores = 8;
// Keys above a row's floor that its list holds: on random scores a few dozen at 16K keys (the
// forward's collect sweep, whose lists hold 64 a thread); flat rows hold hundreds and more.
constexpr int kSearchCapacity = 256;
constexpr int kSearchWarps = 4;  // rows a block of decode_search_kernel solves

__device__ __forceinline__ std::int64_t search_row(const detail::DecodeParams& p, std::int64_t b, const GroupRow& row) {
  return (b * p.len_q + row.query) * p.heads_q + row.head;
}

struct TopScores {
  float x[kTopScores];  // descending; -inf past the keys seen
};

struct TopScoresDecode {
  using State = TopScores;
  static constexpr bool kRescales = false;
  static constexpr bool kUsesValues = false;
  static constexpr bool kUnitRows = false;
  float alpha;
  __device__ static float query_scale(const detail::DecodeParams& p) {
    return static_cast<float>(p.scale) * (p.alpha - 1.f);
  }
  __device__ TopScoresDecode(const detail::DecodeParams& p, std::int64_t, const GroupRow&, bool) : alpha(p.alpha) {}
  __device__ static State empty() {
    State s;
#pragma unroll
    for (int i = 0; i < kTopScores; ++i) s.x[i] = -INFINITY;
    return s;
  }
  // x into the sorted list: each entry becomes max(itself, min(the one above it, x)), from the
  // bottom up so that the one above is still the old one.
  __device__ static void insert(State& s, float x) {
#pragma unroll
    for (int i = kTopScores - 1; i > 0; --i) s.x[i] = fmaxf(s.x[i], fminf(s.x[i - 1], x));
    s.x[0] = fmaxf(s.x[0], x);
  }
  __device__ void step(State& s, float x, float& p, float& c) const {
    p = 0.f;
    c = 1.f;
    if (x > s.x[kTopScores - 1]) insert(s, x);
  }
  __device__ static void merge(State& left, const State& right, float& f_left, float& f_right) {
#pragma unroll
    for (int i = 0; i < kTopScores; ++i) {
      if (right.x[i] > left.x[kTopScores - 1]) insert(left, right.x[i]);
    }
    f_left = 1.f;
    f_right = 1.f;
  }
  __device__ static float output(const State&, float) { return 0.f; }
  __device__ static void store(const detail::DecodeParams& p, std::int64_t b, const GroupRow& row, const State& s) {
    float floor = -INFINITY;
    if (s.x[0] > -INFINITY) {
      math::entmax::with_family(p.alpha, [&](auto family) {
        floor = math::entmax::threshold_floor(family, s.x);
      });
    }
    float* const out = p.search_rows + 2 * search_row(p, b, row);
    out[0] = s.x[0];
    out[1] = floor;
  }
};

// The second pass: every visible key above its row's floor into the row's list (one lane of the
// row's group appends: kLeaderOnly).
struct CollectDecode {
  static constexpr bool kRescales = false;
  static constexpr bool kUsesValues = false;
  static constexpr bool kUnitRows = false;
  static constexpr bool kLeaderOnly = true;
  float floor = INFINITY;
  int* count = nullptr;
  float* list = nullptr;
  __device__ static float query_scale(const detail::DecodeParams& p) {
    return static_cast<float>(p.scale) * (p.alpha - 1.f);
  }
  __device__ CollectDecode(const detail::DecodeParams& p, std::int64_t b, const GroupRow& row, bool live) {
    if (!live) return;
    const std::int64_t r = search_row(p, b, row);
    floor = p.search_rows[2 * r + 1];
    count = p.search_counts + r;
    list = p.search_lists + r * kSearchCapacity;
  }
  __device__ static ChunkState empty() { return {0.f, 0.f}; }
  __device__ void step(ChunkState&, float x, float& p, float& c) const {
    p = 0.f;
    c = 1.f;
    if (x > floor) {
      const int slot = atomicAdd(count, 1);
      if (slot < kSearchCapacity) list[slot] = x;
    }
  }
  __device__ static void merge(ChunkState&, const ChunkState&, float& f_left, float& f_right) {
    f_left = 1.f;
    f_right = 1.f;
  }
  __device__ static float output(const ChunkState&, float) { return 0.f; }
  __device__ static void store(const detail::DecodeParams&, std::int64_t, const GroupRow&, const ChunkState&) {}
};

// Sums v over the LANES lanes of a stream (a whole warp: 32); every lane gets the sum.
template <int LANES>
__device__ __forceinline__ float stream_sum(float v) {
#pragma unroll
  for (int offset = LANES / 2; offset >= 1; offset /= 2) v += __shfl_xor_sync(0xffffffffu, v, offset);
  return v;
}

// 1 / |x| of a row whose E features a lane holds, over the LANES lanes of its stream (kUnitRows).
template <int LANES, int E>
__device__ __forceinline__ float stream_inverse_norm(const float (&x)[E], float eps) {
  float sum_sq = 0.f;
#pragma unroll
  for (int e = 0; e < E; ++e) sum_sq = fmaf(x[e], x[e], sum_sq);
  return math::inverse_norm(stream_sum<LANES>(sum_sq), eps);
}

// A warp per row of the problem ([b][query][head] order): tau from the row's list, written as
// tau * result_scale into `result` (entmax: tau itself; Sieve: tau / (alpha - 1), score units).
// The list is sorted first (each entry placed by its rank): the atomics filed it in arrival
// order, and sums in that order would make tau differ in its last bits from run to run. A row
// whose keys overflowed its list raises the flag and writes nothing: the caller searches on the
// forward kernel instead.
__global__ void __launch_bounds__(32 * kSearchWarps) decode_search_kernel(const detail::DecodeParams p,
                                                                          float tolerance, detail::Operand result,
                                                                          float result_scale) {
  namespace em = math::entmax;
  __shared__ float s_sorted[kSearchWarps][kSearchCapacity];
  const std::int64_t r = static_cast<std::int64_t>(blockIdx.x) * kSearchWarps + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  const std::int64_t rows = p.num_seqs * p.len_q * p.heads_q;
  if (r >= rows) return;
  const std::int64_t head = r % p.heads_q, query = (r / p.heads_q) % p.len_q, b = r / (p.heads_q * p.len_q);
  const int listed = p.search_counts[r];
  if (listed > kSearchCapacity) {
    if (lane == 0) atomicOr(p.search_overflow, 1);
    return;
  }
  const int n = visible_keys(p, sequence_keys(p, b), query);
  float* const out = result.at<float>(b, query, head);
  if (n == 0) {
    if (lane == 0) *out = 0.f;  // as the forward's first sweep leaves a row without keys
    return;
  }
  const float* const filed = p.search_lists + r * kSearchCapacity;
  float* const list = s_sorted[threadIdx.x / 32];
  for (int i = lane; i < listed; i += 32) {
    const float x = filed[i];
    int rank = 0;
    for (int j = 0; j < listed; ++j) {
      const float y = filed[j];
      rank += y > x || (y == x && j < i) ? 1 : 0;
    }
    list[rank] = x;
  }
  __syncwarp();
  em::ThresholdSearch<float, em::kCudaSearchProbes> search(p.alpha, tolerance);
  search.start(p.search_rows[2 * r], static_cast<float>(n), p.search_rows[2 * r + 1]);
  em::with_family(p.alpha, [&](auto family) {
    constexpr em::Family F = decltype(family)::value;
    if constexpr (F == em::Family::sparsemax || F == em::Family::entmax15) {
      em::ListThreshold<F, float> list_search(search.tau());
      for (int step = 0; step < em::kMaxSearchSteps && !search.done() && !list_search.done; ++step) {
        em::GapMoments<float> m;
        for (int i = lane; i < listed; i += 32) m.add(list[i] - list_search.tau);
        m.count = stream_sum<32>(m.count);
        m.sum = stream_sum<32>(m.sum);
        m.sum_sq = stream_sum<32>(m.sum_sq);
#pragma unroll
        for (int offset = 16; offset >= 1; offset /= 2) m.min = fminf(m.min, __shfl_xor_sync(0xffffffffu, m.min, offset));
        list_search.step(m, tolerance);
      }
      if (!search.done()) search.settle(list_search.tau);
    } else {
      constexpr int K = em::kCudaSearchProbes;
      for (int step = 0; step < em::kMaxSearchSteps && !search.done(); ++step) {
        float f[K] = {}, u[K] = {};
        for (int i = lane; i < listed; i += 32) {
#pragma unroll
          for (int k = 0; k < K; ++k) {
            const auto w = em::weight_and_grad(family, list[i] - search.probe(k));
            f[k] += w.p;
            u[k] += w.u;
          }
        }
#pragma unroll
        for (int k = 0; k < K; ++k) {
          f[k] = stream_sum<32>(f[k]);
          u[k] = stream_sum<32>(u[k]);
        }
        search.step(f, u);
      }
    }
  });
  if (lane == 0) *out = search.tau() * result_scale;
}

template <class T, class Policy, class State>
__device__ __forceinline__ void store_result(const detail::DecodeParams& p, std::int64_t b, const GroupRow& row,
                                             std::int64_t d, const State& s, float o) {
  if constexpr (Policy::kUsesValues) {
    T* const out = p.out.at<T>(b, row.query, row.head) + d * p.out.dim;
    *out = narrow_to<T>(Policy::output(s, o) + (p.add_to_out ? widen(*out) : 0.f));
  }
  if (d == 0) Policy::store(p, b, row, s);
}

template <class T, int LANES, int ROWS, class Policy>
__global__ void __launch_bounds__(kThreads) decode_split_kernel(const detail::DecodeParams p) {
  constexpr int E = kLaneElems;
  constexpr int kStreams = kThreads / LANES;
  constexpr int kWidth = LANES * E;           // features a stream's lanes cover, >= dim_qk and dim_v
  constexpr int kRowLanes = LANES / ROWS;     // lanes that own each row's score and state
  constexpr int kAhead = sizeof(T) == 2 ? kAhead16 : kAhead32;
  static_assert(kThreads % LANES == 0 && LANES <= 32, "a stream lies inside one warp");
  using Features = LaneFeatures<T>;
  using State = typename state_of<Policy>::type;
  constexpr int kWords = Features::kWords;
  // The ring while the streams walk (ring[step][u][k or v][word][thread]: a warp's 16-byte words
  // side by side), then the streams' outputs and states for their merge. 48 KB: static shared
  // memory's limit, with no launch attribute.
  struct Merge {
    float out[kStreams][ROWS][kWidth];
    State state[kStreams][ROWS];
  };
  constexpr int kRingWords = kRingSteps * kAhead * 2 * kWords * kThreads;
  constexpr int kSharedBytes = static_cast<int>(sizeof(Merge)) > 16 * kRingWords ? static_cast<int>(sizeof(Merge))
                                                                                  : 16 * kRingWords;
  static_assert(kSharedBytes <= 48 * 1024, "static shared memory");
  __shared__ alignas(16) unsigned char s_raw[kSharedBytes];
  uint4* const ring = reinterpret_cast<uint4*>(s_raw);
  auto& s_out = reinterpret_cast<Merge*>(s_raw)->out;
  auto& s_state = reinterpret_cast<Merge*>(s_raw)->state;

  const int lane = threadIdx.x % LANES, stream = threadIdx.x / LANES;
  const int stream_lane0 = (threadIdx.x % 32) - lane;  // the stream's first lane within its warp
  const std::int64_t b = blockIdx.z;
  const std::int64_t hk = blockIdx.y / p.row_groups;
  const int row0 = static_cast<int>(blockIdx.y % p.row_groups) * ROWS;
  const int split = blockIdx.x;
  const int group_rows = static_cast<int>(p.group_rows());
  const int rows = min(ROWS, group_rows - row0);
  const int n = sequence_keys(p, b);
  const int d0 = lane * E;
  const bool lane_has_k = d0 < p.dim_qk, lane_has_v = d0 < p.dim_v;
  const int my_row = lane / kRowLanes;  // the row whose score and state this lane keeps

  // Queries, pre-scaled into the policy's units (rows past `rows` stay zero and see no key); the visible
  // keys [0, limit) of this lane's own row; the block's keys end at the last row's limit.
  const float x_scale = Policy::query_scale(p);
  float q[ROWS][E];
  int my_limit = 0, block_limit = 0;
#pragma unroll
  for (int j = 0; j < ROWS; ++j) {
#pragma unroll
    for (int e = 0; e < E; ++e) q[j][e] = 0.f;
    if (j < rows) {
      const GroupRow row = group_row(p, hk, row0 + j);
      const int limit = visible_keys(p, n, row.query);
      block_limit = max(block_limit, limit);
      if (j == my_row) my_limit = limit;
      if (lane_has_k) {
        const T* qr = p.q.at<const T>(b, row.query, row.head) + d0 * p.q.dim;
#pragma unroll
        for (int e = 0; e < E; ++e) q[j][e] = widen(qr[e * p.q.dim]) * x_scale;
      }
    }
    if constexpr (Policy::kUnitRows) {
      const float inv = stream_inverse_norm<LANES>(q[j], p.norm_eps);
#pragma unroll
      for (int e = 0; e < E; ++e) q[j][e] *= inv;
    }
  }

  // This split's keys, cut into one contiguous run per stream. Every stream steps `per` times,
  // so the lanes of a warp always shuffle together.
  const int lo = split * static_cast<int>(p.split_len);
  const int hi = min(block_limit, lo + static_cast<int>(p.split_len));
  const int len = hi > lo ? hi - lo : 0;
  const int per = (len + kStreams - 1) / kStreams;
  const int s_lo = lo + stream * per;
  const int s_hi = min(hi, s_lo + per);

  const bool live_row = my_row < rows && (!leader_only<Policy>::value || lane % kRowLanes == 0);
  const Policy policy(p, b, my_row < rows ? group_row(p, hk, row0 + my_row) : GroupRow{0, 0}, live_row);
  State state = Policy::empty();
  float o[ROWS][E];
#pragma unroll
  for (int j = 0; j < ROWS; ++j) {
#pragma unroll
    for (int e = 0; e < E; ++e) o[j][e] = 0.f;
  }

  const T* k_base = static_cast<const T*>(p.k.data) + d0;
  const T* v_base = static_cast<const T*>(p.v.data) + d0;
  KeyCursor cursor(p, b, s_hi - 1);
  auto word_at = [&](int ring_step, int u, int kv, int word) {
    return ring + (((ring_step * kAhead + u) * 2 + kv) * kWords + word) * kThreads + threadIdx.x;
  };
  // Step g's rows into ring step g % kRingSteps, zeros for rows outside the run (so that a row
  // without weight adds 0, never 0 * garbage) and for features past the head's width; one
  // commit per step, issued or not, so that a wait counts steps.
  const int steps = (per + kAhead - 1) / kAhead;
  auto issue = [&](int g) {
    if (g < steps) {
#pragma unroll
      for (int u = 0; u < kAhead; ++u) {
        const int i = s_hi - 1 - g * kAhead - u;
        const bool in_run = i >= s_lo;
        if (in_run && i < s_hi - 1) cursor.advance(p, b);
        const T* k_at = k_base + (in_run && lane_has_k ? cursor.offset(p.k, hk) : 0);
        const T* v_at = v_base + (in_run && lane_has_v ? cursor.offset(p.v, hk) : 0);
#pragma unroll
        for (int w = 0; w < kWords; ++w) {
          tile::cp_async_16(word_at(g % kRingSteps, u, 0, w), reinterpret_cast<const uint4*>(k_at) + w,
                            in_run && lane_has_k);
          if constexpr (Policy::kUsesValues) {
            tile::cp_async_16(word_at(g % kRingSteps, u, 1, w), reinterpret_cast<const uint4*>(v_at) + w,
                              in_run && lane_has_v);
          }
        }
      }
    }
    tile::cp_async_commit();
  };
#pragma unroll
  for (int g = 0; g < kRingSteps - 1; ++g) issue(g);
  for (int g = 0; g < steps; ++g) {
    // Into the ring step read at g - 1, whose words are in registers and used already. The
    // copies and the wait are asm without a memory clobber: the empty asm statements keep the
    // compiler from moving the ring's reads across them.
    asm volatile("" ::: "memory");
    issue(g + kRingSteps - 1);
    tile::cp_async_wait<kRingSteps - 1>();  // this lane's copies of step g have landed
    asm volatile("" ::: "memory");
    Features k_now[kAhead], v_now[kAhead];
#pragma unroll
    for (int u = 0; u < kAhead; ++u) {
#pragma unroll
      for (int w = 0; w < kWords; ++w) {
        k_now[u].w[w] = *word_at(g % kRingSteps, u, 0, w);
        if constexpr (Policy::kUsesValues) v_now[u].w[w] = *word_at(g % kRingSteps, u, 1, w);
      }
    }
    const int step = g * kAhead;
#pragma unroll
    for (int u = 0; u < kAhead; ++u) {
      const int i = s_hi - 1 - step - u;
      float kf[E];
      k_now[u].widen(kf);
      float dots[ROWS];
#pragma unroll
      for (int j = 0; j < ROWS; ++j) {
        float x = 0.f;
#pragma unroll
        for (int e = 0; e < E; ++e) x = fmaf(q[j][e], kf[e], x);
        dots[j] = x;
      }
      float x = reduce_scatter<LANES, ROWS>(dots, lane);
      if constexpr (Policy::kUnitRows) x *= stream_inverse_norm<LANES>(kf, p.norm_eps);
      float weight = 0.f, factor = 1.f;
      if (i >= s_lo && i < my_limit) policy.step(state, x, weight, factor);
      if constexpr (!Policy::kUsesValues) continue;
      float vf[E];
      v_now[u].widen(vf);
      if constexpr (Policy::kRescales) {
        if (__any_sync(0xffffffffu, factor != 1.f)) {
#pragma unroll
          for (int j = 0; j < ROWS; ++j) {
            const float c = __shfl_sync(0xffffffffu, factor, stream_lane0 + j * kRowLanes);
#pragma unroll
            for (int e = 0; e < E; ++e) o[j][e] *= c;
          }
        }
      }
#pragma unroll
      for (int j = 0; j < ROWS; ++j) {
        const float w = __shfl_sync(0xffffffffu, weight, stream_lane0 + j * kRowLanes);
#pragma unroll
        for (int e = 0; e < E; ++e) o[j][e] = fmaf(w, vf[e], o[j][e]);
      }
    }
  }
  // The merge's arrays share the ring's memory: every copy (the empty steps' zeros too) lands first.
  tile::cp_async_wait<0>();
  __syncthreads();

  // Streams hold runs left to right in stream order; merge them in that order.
  if constexpr (Policy::kUsesValues) {
#pragma unroll
    for (int j = 0; j < ROWS; ++j) {
#pragma unroll
      for (int e = 0; e < E; ++e) s_out[stream][j][d0 + e] = o[j][e];
    }
  }
  if (lane % kRowLanes == 0) s_state[stream][my_row] = state;
  __syncthreads();

  const int splits = p.splits;
  const int out_width = Policy::kUsesValues ? static_cast<int>(p.dim_v) : 1;  // a pass without values: states only
  for (int idx = threadIdx.x; idx < rows * kWidth; idx += kThreads) {
    const int j = idx / kWidth, d = idx % kWidth;
    if (d >= out_width) continue;
    State acc = s_state[0][j];
    float acc_o = Policy::kUsesValues ? s_out[0][j][d] : 0.f;
    for (int t = 1; t < kStreams; ++t) {
      float f_left, f_right;
      Policy::merge(acc, s_state[t][j], f_left, f_right);
      if constexpr (Policy::kUsesValues) acc_o = acc_o * f_left + s_out[t][j][d] * f_right;
    }
    if (splits == 1) {
      store_result<T, Policy>(p, b, group_row(p, hk, row0 + j), d, acc, acc_o);
    } else {
      const std::int64_t slot = ((b * p.heads_kv + hk) * group_rows + row0 + j) * splits + split;
      if constexpr (Policy::kUsesValues) p.partial_out[slot * p.dim_v + d] = acc_o;
      if (d == 0) reinterpret_cast<State*>(p.partial_stats)[slot] = acc;
    }
  }
}

// Merges the splits of one row: block (row of the group, kv head, sequence), a thread per feature.
template <class T, class Policy>
__global__ void __launch_bounds__(kThreads) decode_combine_kernel(const detail::DecodeParams p) {
  const std::int64_t r = blockIdx.x, hk = blockIdx.y, b = blockIdx.z;
  const int splits = p.splits;
  const std::int64_t first = ((b * p.heads_kv + hk) * p.group_rows() + r) * splits;
  using State = typename state_of<Policy>::type;
  const State* stats = reinterpret_cast<const State*>(p.partial_stats) + first;
  const GroupRow row = group_row(p, hk, r);
  const std::int64_t out_width = Policy::kUsesValues ? p.dim_v : 1;
  for (std::int64_t d = threadIdx.x; d < out_width; d += blockDim.x) {
    State acc = stats[0];
    float acc_o = Policy::kUsesValues ? p.partial_out[first * p.dim_v + d] : 0.f;
    for (int s = 1; s < splits; ++s) {
      float f_left, f_right;
      Policy::merge(acc, stats[s], f_left, f_right);
      if constexpr (Policy::kUsesValues) acc_o = acc_o * f_left + p.partial_out[(first + s) * p.dim_v + d] * f_right;
    }
    store_result<T, Policy>(p, b, row, d, acc, acc_o);
  }
}

// Paged caches from outside: the first sequence whose length or pages are out of range, as
// b * 4 + reason (1: seq_len < len_q, 2: seq_len > capacity, 3: a page index outside
// [0, num_pages)), kept as the minimum in *first_bad (which starts at INT64_MAX).
__global__ void check_paged_cache_kernel(const detail::DecodeParams p, std::int64_t num_pages,
                                         unsigned long long* first_bad) {
  const std::int64_t b = blockIdx.x;
  const std::int64_t n = p.seq_lens[b];
  unsigned long long reason = 0;
  if (n < p.len_q) {
    reason = 1;
  } else if (n > p.capacity) {
    reason = 2;
  } else {
    const std::int64_t pages = (n + p.page_size - 1) / p.page_size;
    for (std::int64_t i = threadIdx.x; i < pages; i += blockDim.x) {
      const std::int32_t page = p.block_table[b * p.table_stride + i];
      if (page < 0 || page >= num_pages) reason = 3;
    }
  }
  if (reason != 0) atomicMin(first_bad, static_cast<unsigned long long>(b) * 4 + reason);
}

}  // namespace winnow::cuda::decode
