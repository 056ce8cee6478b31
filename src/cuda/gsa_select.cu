// GSA's indexer with exact top-k selection on CUDA (spec/gsa.md; winnow/gsa.h).
//   0. (16-bit inputs, d_I 64 or 128, rows as aligned_rows requires, k_max covering the longest
//      row) indexer_statistics_kernel scores 16 rows at a time on tensor cores and writes each
//      row's variance and count, and the indices of every row whose budget covers all its
//      visible keys, which then need no ranking; select_keys_kernel below skips those rows and
//      takes the others' counts as given.
// Otherwise the rows' scores are first stored, a group of rows at a time (as many as fit 256 MB):
// on tensor cores (indexer_scores_tc_kernel, 16 rows a block) where pass 0's conditions hold and
// the sequences have 64 rows or more, else by indexer_score with a block per (row, 2048 keys)
// (indexer_scores_kernel), so that decoding's few rows still fill the GPU. The passes below then
// read them. Without room for the scores the passes recompute them with indexer_score, three or
// more times a row on one block (at 128K keys and one row, 10 ms).
// Then one block per query row:
//   1. statistics: the row's mean and population variance (hence its budget k_t) and the
//      smallest and largest sort key;
//   2. refinement: a histogram of the keys in [lo, hi] over kBins bins finds the bin holding
//      the k_t-th largest key; every key above that bin is selected, and the bin's own keys
//      either fit the candidate buffer (the usual case: the next pass collects them, a sort in
//      shared memory picks the rest) or become the next, narrower [lo, hi];
//   3. the selected positions, gathered in shared memory, are sorted and written.
// The sort key of key s is (ordered bits of its score, s) as one 64-bit integer: larger means
// ranks first (math::gsa::ranks_before: higher score, then the more recent key), and no two
// keys are equal, so the refinement always ends (at the latest when a bin spans one key).
#include <cub/block/block_reduce.cuh>
#include <cub/block/block_scan.cuh>

#include <cstdint>
#include <algorithm>
#include <cstdlib>
#include <optional>
#include <string>

#include "cuda/attention/row_blocks.cuh"
#include "cuda/tile/fragment.cuh"
#include "cuda/tile/smem_tile.cuh"
#include "cuda/cuda.h"
#include "cuda/element_types.cuh"
#include "cuda/launch.h"
#include "math/gsa.h"

namespace winnow::cuda {
namespace {

constexpr int kSelectThreads = 256;
constexpr int kBins = 2048;
constexpr int kBinsPerThread = kBins / kSelectThreads;
constexpr int kCandidates = 2048;

// Float bits as an unsigned integer of the same order (-0 just below +0; NaN at the ends).
__device__ __forceinline__ std::uint32_t ordered_bits(float x) {
  const std::uint32_t u = __float_as_uint(x);
  return (u & 0x80000000u) != 0 ? ~u : u | 0x80000000u;
}
__device__ __forceinline__ std::uint64_t sort_key(float score, std::int64_t key) {
  return (static_cast<std::uint64_t>(ordered_bits(score)) << 32) | static_cast<std::uint32_t>(key);
}

// What one row's block keeps in shared memory (dynamic, laid out by SelectLayout).
struct SelectLayout {
  int q_floats, out_slots;  // q: H_I * d_I (scaled), out: k_max rounded up to a power of two
  __host__ __device__ static int pow2_at_least(std::int64_t n) {
    int p = 1;
    while (p < n) p *= 2;
    return p;
  }
  __host__ __device__ SelectLayout(const detail::AttentionParams& p, const detail::IndexerConfig& c)
      : q_floats(static_cast<int>(p.heads_q * p.dim_qk)), out_slots(pow2_at_least(c.budget.k_max)) {}
  std::size_t bytes() const {
    return kCandidates * sizeof(std::uint64_t) + kBins * sizeof(std::uint32_t) +
           static_cast<std::size_t>(out_slots) * sizeof(std::int32_t) +
           static_cast<std::size_t>(q_floats) * sizeof(float) + 32 * 2 * sizeof(float);
  }
};

// The score of key `key` for the row whose scaled queries, head gates and biases are in
// shared memory. Not inlined, so that every pass computes it with the same instructions and
// gets the same bits. `packed`: the key row is contiguous and 16-byte aligned with dim a
// multiple of the pack, so it is read 16 bytes at a time (the same products in the same order).
template <class T>
__device__ __noinline__ float indexer_score(const float* q, const float* gate, const float* bias, int heads,
                                            int dim, math::gsa::ScoreForm form, const T* k, std::int64_t k_dim,
                                            bool packed) {
  constexpr int N = kPack16<T>;
  float score = 0.f;
  for (int j = 0; j < heads; ++j) {
    const float* qj = q + j * dim;
    float dot = 0.f;
    if (packed) {
      for (int d0 = 0; d0 < dim; d0 += N) {
        const Pack<T, N> kp = load_pack<T, N>(k + d0);
#pragma unroll
        for (int e = 0; e < N; ++e) dot = fmaf(qj[d0 + e], widen(kp.v[e]), dot);
      }
    } else {
      for (int d = 0; d < dim; ++d) dot = fmaf(qj[d], widen(k[d * k_dim]), dot);
    }
    score += math::gsa::gated_term(form, gate[j], dot, bias[j]);
  }
  return score;
}

// Sorts a[0, n) (n a power of two) in shared memory; descending when `descending`.
template <class K>
__device__ void block_bitonic_sort(K* a, int n, bool descending) {
  for (int size = 2; size <= n; size *= 2) {
    for (int stride = size / 2; stride > 0; stride /= 2) {
      for (int i = threadIdx.x; i < n; i += blockDim.x) {
        const int j = i ^ stride;
        if (j > i) {
          const bool up = ((i & size) == 0) != descending;
          if ((a[i] > a[j]) == up) {
            const K x = a[i];
            a[i] = a[j];
            a[j] = x;
          }
        }
      }
      __syncthreads();
    }
  }
}

// Pass 0 (see the top): a block owns kStatRows query rows of one sequence; its warps take the key
// tiles in turn, each with its own two stages of shared memory, and score a tile for the rows head
// by head (Q_j K^T on m16n8k16 products, the block's queries in one shared tile per head), adding
// math::gsa::gated_term in float32 as indexer_score does but with a fast logistic (__expf and
// __fdividef: this pass feeds only the variance, never a rank). The scores' moments go per thread
// into (count, mean, M2) and are combined over the quad and the warps (Chan et al.), so no row
// needs a shift known in advance. Only the variance and the count cross over to
// select_keys_kernel; a row's ranks are decided by that kernel alone.
// The blocks run heaviest first (the last rows see the most keys), eight warps each: one block per
// multiprocessor, so a block's tiles spread over as many warps as the occupancy allows and the
// light blocks fill in behind the heavy ones. A key tile holds 4096 / d_I keys (8 KB in 16 bits).
constexpr int kStatRows = 16, kStatWarps = 8, kStatMaxHeads = 16;

struct FastLogistic {
  __device__ __forceinline__ float operator()(float x) const { return __fdividef(1.f, 1.f + __expf(-x)); }
};

struct Moments {
  double n = 0, mean = 0, m2 = 0;
  __device__ __forceinline__ void add(const Moments& o) {
    if (o.n == 0) return;
    if (n == 0) {
      *this = o;
      return;
    }
    const double total = n + o.n, delta = o.mean - mean;
    mean += delta * o.n / total;
    m2 += o.m2 + delta * delta * n * o.n / total;
    n = total;
  }
  __device__ __forceinline__ Moments shuffled(int lane_mask) const {
    return {__shfl_xor_sync(0xffffffffu, n, lane_mask), __shfl_xor_sync(0xffffffffu, mean, lane_mask),
            __shfl_xor_sync(0xffffffffu, m2, lane_mask)};
  }
};

template <class T, int DI>
struct StatisticsLayout {
  static constexpr int kKeys = 4096 / DI;
  using QTile = tile::SmemTile<T, kStatRows, DI>;
  using KTile = tile::SmemTile<T, kKeys, DI>;
  static constexpr int kQTileBytes = kStatRows * DI * sizeof(T), kKTileBytes = kKeys * DI * sizeof(T);
  int heads;
  __host__ __device__ explicit StatisticsLayout(int heads_) : heads(heads_) {}
  __host__ __device__ int k_offset() const { return heads * kQTileBytes; }  // multiples of 512 bytes
  __host__ __device__ int gate_offset() const { return k_offset() + kStatWarps * 2 * kKTileBytes; }
  __host__ __device__ int bias_offset() const { return gate_offset() + kStatRows * kStatMaxHeads * 4; }
  __host__ __device__ int partial_offset() const { return bias_offset() + kStatMaxHeads * 4; }
  __host__ __device__ int count_offset() const {
    return partial_offset() + kStatWarps * kStatRows * static_cast<int>(sizeof(Moments));
  }
  __host__ __device__ int bytes() const { return count_offset() + kStatRows * 8; }
};

// The kStatRows query rows r0 .. of sequence b scored on tensor cores, key tile by key tile (pass
// 0 and indexer_scores_tc_kernel share it): each warp takes the tiles warp, warp + kStatWarps, ...
// with two stages of shared memory of its own, scores a tile head by head (Q_j K^T on m16n8k16
// products, the block's queries in one shared tile per head), adds math::gsa::gated_term in
// float32 with the given logistic, and hands the tile to `epilogue(score, tile)`: score[n][e] is
// row g + 8 (e / 2) (g = lane / 4) and key tile * kKeys + 8 n + 2 (lane % 4) + e % 2.
template <class T, int DI>
struct TileScorer {
  using Layout = StatisticsLayout<T, DI>;
  using QTile = typename Layout::QTile;
  using KTile = typename Layout::KTile;
  static constexpr int kKeys = Layout::kKeys, KS = DI / 16, NT = kKeys / 8, kThreads = 32 * kStatWarps;

  const detail::AttentionParams& p;
  const detail::IndexerConfig& c;
  unsigned char* smem;
  Layout layout;
  detail::SequenceExtent s;
  std::int64_t b, r0, t0, t_last;
  int heads, tid, warp, lane, g, tig, rows, tiles;

  __device__ TileScorer(const detail::AttentionParams& p_, const detail::IndexerConfig& c_, unsigned char* smem_,
                        std::int64_t b_, std::int64_t r0_)
      : p(p_), c(c_), smem(smem_), layout(static_cast<int>(p_.heads_q)), s(p_.sequence(b_)), b(b_), r0(r0_) {
    heads = static_cast<int>(p.heads_q);
    tid = threadIdx.x;
    warp = tid / 32;
    lane = tid % 32;
    g = lane / 4;
    tig = lane % 4;
    rows = static_cast<int>(s.q_len - r0 < kStatRows ? s.q_len - r0 : kStatRows);
    t0 = r0 + s.q_offset();  // position of the block's first row
    t_last = t0 + rows - 1;
    tiles = static_cast<int>(t_last / kKeys + 1);
  }
  __device__ QTile q_tile(int j) const { return QTile{reinterpret_cast<T*>(smem + j * Layout::kQTileBytes)}; }
  __device__ KTile k_tile(int stage) const {
    return KTile{reinterpret_cast<T*>(smem + layout.k_offset() + (warp * 2 + stage) * Layout::kKTileBytes)};
  }
  __device__ float* gate() const { return reinterpret_cast<float*>(smem + layout.gate_offset()); }  // [row][head]
  __device__ float* bias() const { return reinterpret_cast<float*>(smem + layout.bias_offset()); }

  __device__ void load_keys(int tile_index, int stage) const {
    const std::int64_t key0 = static_cast<std::int64_t>(tile_index) * kKeys;
    k_tile(stage).template load_async<32>(lane, [&](int r) -> const T* {
      return key0 + r <= t_last ? p.k.at<const T>(b, s.k_start + key0 + r, 0) : nullptr;
    });
    tile::cp_async_commit();
  }

  template <class Logistic, class Epilogue>
  __device__ void for_each_tile(Logistic logistic, Epilogue&& epilogue) const {
    const math::gsa::ScoreForm form = c.form;
    for (int j = 0; j < heads; ++j) {
      q_tile(j).template load_async<kThreads>(tid, [&](int r) -> const T* {
        return r < rows ? p.q.at<const T>(b, s.q_start + r0 + r, j) : nullptr;
      });
    }
    tile::cp_async_commit();
    float* gates = gate();
    for (int i = tid; i < kStatRows * heads; i += kThreads) {
      const int r = i / heads, j = i % heads;
      gates[r * kStatMaxHeads + j] =
          r < rows ? math::gsa::gate(form, widen(*c.weights.at<const T>(b, s.q_start + r0 + r, j))) : 0.f;
    }
    if (tid < heads) bias()[tid] = c.bias_at<float>(tid);
    if (warp < tiles) load_keys(warp, 0);
    tile::cp_async_wait<0>();
    __syncthreads();

    const float scale = static_cast<float>(p.scale);
    int stage = 0;
    for (int tile_index = warp; tile_index < tiles; tile_index += kStatWarps) {
      if (tile_index + kStatWarps < tiles) {
        load_keys(tile_index + kStatWarps, stage ^ 1);
        tile::cp_async_wait<1>();
      } else {
        tile::cp_async_wait<0>();
      }
      __syncwarp();
      const KTile keys = k_tile(stage);
      float score[NT][4];
      tile::zero(score);
      for (int j = 0; j < heads; ++j) {
        float dot[NT][4];
        tile::zero(dot);
        tile::mma_smem_a_b_rows<T, KS, NT>(dot, q_tile(j), 0, keys, 0, lane);
        const float gate_j[2] = {gates[g * kStatMaxHeads + j], gates[(g + 8) * kStatMaxHeads + j]};
        const float bias_j = bias()[j];
#pragma unroll
        for (int n = 0; n < NT; ++n) {
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            score[n][e] += math::gsa::gated_term(form, gate_j[e / 2], dot[n][e] * scale, bias_j, logistic);
          }
        }
      }
      epilogue(score, tile_index);
      __syncwarp();  // every lane has read this stage before the next load into it
      stage ^= 1;
    }
  }
};

template <class T, int DI>
__global__ void __launch_bounds__(32 * kStatWarps, 1) indexer_statistics_kernel(const detail::AttentionParams p,
                                                                                 const detail::IndexerConfig c) {
  using Scorer = TileScorer<T, DI>;
  constexpr int kKeys = Scorer::kKeys, NT = Scorer::NT;
  extern __shared__ __align__(16) unsigned char smem_raw[];  // 16 is what cp.async and ldmatrix need
  const std::int64_t b = blockIdx.y;
  const std::int64_t r0 = static_cast<std::int64_t>(gridDim.x - 1 - blockIdx.x) * kStatRows;  // heaviest first
  if (r0 >= p.sequence(b).q_len) return;
  const Scorer scorer(p, c, smem_raw, b, r0);
  const int tid = scorer.tid, warp = scorer.warp, g = scorer.g, tig = scorer.tig, rows = scorer.rows;
  const std::int64_t t0 = scorer.t0;
  Moments* partial = reinterpret_cast<Moments*>(smem_raw + scorer.layout.partial_offset());  // [warp][row]
  std::int64_t* row_count = reinterpret_cast<std::int64_t*>(smem_raw + scorer.layout.count_offset());

  int seen[2] = {0, 0};
  float first[2] = {0.f, 0.f};
  double sum[2] = {0, 0}, sum_sq[2] = {0, 0};  // of (score - first)
  scorer.for_each_tile(FastLogistic{}, [&](const float (&score)[NT][4], int tile_index) {
    const std::int64_t key0 = static_cast<std::int64_t>(tile_index) * kKeys + 2 * tig;
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int r = g + 8 * half;
      const std::int64_t last_key = r < rows ? t0 + r : -1;
#pragma unroll
      for (int n = 0; n < NT; ++n) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          if (key0 + 8 * n + e > last_key) continue;
          const float x = score[n][2 * half + e];
          if (seen[half] == 0) first[half] = x;
          const double d = static_cast<double>(x) - static_cast<double>(first[half]);
          sum[half] += d;
          sum_sq[half] += d * d;
          ++seen[half];
        }
      }
    }
  });

#pragma unroll
  for (int half = 0; half < 2; ++half) {
    Moments m;
    if (seen[half] > 0) {
      m.n = seen[half];
      m.mean = static_cast<double>(first[half]) + sum[half] / m.n;
      m.m2 = sum_sq[half] - sum[half] * sum[half] / m.n;
    }
    m.add(m.shuffled(1));
    m.add(m.shuffled(2));
    if (tig == 0) partial[warp * kStatRows + g + 8 * half] = m;
  }
  __syncthreads();
  const detail::SequenceExtent& s = scorer.s;
  if (tid < rows) {
    Moments m;
    for (int w = 0; w < kStatWarps; ++w) m.add(partial[w * kStatRows + tid]);
    const std::int64_t q_row = s.q_start + r0 + tid, visible = t0 + tid + 1;
    const double variance = m.m2 / m.n;
    // The count follows from the variance as written, as the tests and select_keys_kernel read it.
    const float var = static_cast<float>(variance > 0 ? variance : 0.0);
    *p.stats.at<float>(b, q_row, 0) = var;
    const std::int64_t budget = math::gsa::budget(c.budget, static_cast<double>(var));
    const std::int64_t count = budget < visible ? budget : visible;
    *c.counts.at<std::int32_t>(b, q_row, 0) = static_cast<std::int32_t>(count);
    row_count[tid] = count;
  }
  __syncthreads();
  // Rows that keep every visible key: 0 .. t, then the padding.
  const std::int64_t k_max = c.budget.k_max;
  for (int r = 0; r < rows; ++r) {
    const std::int64_t visible = t0 + r + 1;
    if (row_count[r] != visible) continue;
    std::int32_t* indices = c.indices.at<std::int32_t>(b, s.q_start + r0 + r, 0);
    for (std::int64_t i = tid; i < k_max; i += Scorer::kThreads) {
      indices[i * c.indices.head] = i < visible ? static_cast<std::int32_t>(i) : -1;
    }
  }
}

// A row's scaled queries, head gates and biases into shared memory, as indexer_score reads them.
template <class T>
__device__ void load_row_query(const detail::AttentionParams& p, const detail::IndexerConfig& c, const QueryRow& row,
                               float* q, float* gate, float* bias) {
  const int heads = static_cast<int>(p.heads_q), dim = static_cast<int>(p.dim_qk);
  const std::int64_t q_row = row.operand_row();
  for (int i = threadIdx.x; i < heads * dim; i += blockDim.x) {
    const int j = i / dim, d = i % dim;
    q[i] = widen(p.q.at<const T>(row.b, q_row, j)[d * p.q.dim]) * static_cast<float>(p.scale);
  }
  if (static_cast<int>(threadIdx.x) < heads) {
    gate[threadIdx.x] = math::gsa::gate(c.form, widen(*c.weights.at<const T>(row.b, q_row, threadIdx.x)));
    bias[threadIdx.x] = c.bias_at<float>(threadIdx.x);
  }
}

// A group of rows whose scores are stored: rows row0 .. row0 + span - 1 of every sequence (those
// a sequence has), row r of sequence b at scores + (b span + r - row0) ld. Without scores
// (nullptr) the group is every row and the selection recomputes them.
struct StoredScores {
  float* scores = nullptr;
  std::int64_t ld = 0, row0 = 0, span = 0;
  __device__ float* row(std::int64_t b, std::int64_t r) const { return scores + (b * span + r - row0) * ld; }
};

// The query row a block of the group (blockIdx.x, blockIdx.y = sequence) or, without stored
// scores, of all rows (blockIdx.x) selects for; r >= the sequence's q_len: none.
__device__ __forceinline__ QueryRow group_row(const detail::AttentionParams& p, const StoredScores& stored) {
  if (stored.scores == nullptr) return locate_query_row(p, blockIdx.x);
  QueryRow row;
  row.b = blockIdx.y;
  row.r = stored.row0 + blockIdx.x;
  row.s = p.sequence(row.b);
  return row;
}

constexpr int kScoreThreads = 256, kScoreKeys = 2048;  // keys a scoring block covers

// The group's row blockIdx.y of sequence blockIdx.z: its visible keys' scores, kScoreKeys keys a
// block, with indexer_score (the bits the recomputing selection would get). For rows too few
// for indexer_scores_tc_kernel, as in decoding.
template <class T>
__global__ void __launch_bounds__(kScoreThreads) indexer_scores_kernel(const detail::AttentionParams p,
                                                                        const detail::IndexerConfig c, bool packed,
                                                                        StoredScores stored) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  float* q = reinterpret_cast<float*>(smem_raw);
  float* gate = q + p.heads_q * p.dim_qk;
  float* bias = gate + 32;
  QueryRow row;
  row.b = blockIdx.z;
  row.r = stored.row0 + blockIdx.y;
  row.s = p.sequence(row.b);
  if (row.r >= row.s.q_len) return;
  const std::int64_t visible = row.position() + 1, first = static_cast<std::int64_t>(blockIdx.x) * kScoreKeys;
  if (first >= visible) return;
  load_row_query<T>(p, c, row, q, gate, bias);
  __syncthreads();
  const std::int64_t end = first + kScoreKeys < visible ? first + kScoreKeys : visible;
  float* out = stored.row(row.b, row.r);
  for (std::int64_t key = first + threadIdx.x; key < end; key += kScoreThreads) {
    out[key] = indexer_score<T>(q, gate, bias, static_cast<int>(p.heads_q), static_cast<int>(p.dim_qk), c.form,
                                p.k.at<const T>(row.b, row.s.k_start + key, 0), p.k.dim, packed);
  }
}

// The same scores on tensor cores (TileScorer with the exact logistic), kStatRows rows a block,
// heaviest first: for groups of many rows (prefill, training), where indexer_scores_kernel would
// do the indexer's products on CUDA cores. Their rounding differs from indexer_score's (the
// products' order), as any two float32 evaluations of the same score may; the selection stays
// exact for the scores it is given.
template <class T, int DI>
__global__ void __launch_bounds__(32 * kStatWarps, 1) indexer_scores_tc_kernel(const detail::AttentionParams p,
                                                                                const detail::IndexerConfig c,
                                                                                StoredScores stored) {
  using Scorer = TileScorer<T, DI>;
  constexpr int kKeys = Scorer::kKeys, NT = Scorer::NT;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  const std::int64_t b = blockIdx.y;
  const std::int64_t r0 = stored.row0 + static_cast<std::int64_t>(gridDim.x - 1 - blockIdx.x) * kStatRows;
  if (r0 >= p.sequence(b).q_len) return;
  const Scorer scorer(p, c, smem_raw, b, r0);
  const int g = scorer.g, tig = scorer.tig;
  // The group's span is a multiple of kStatRows (the launcher's), so a block's rows are all in it.
  const int rows = scorer.rows;
  const std::int64_t t0 = scorer.t0;
  scorer.for_each_tile(math::gsa::Sigmoid{}, [&](const float (&score)[NT][4], int tile_index) {
    const std::int64_t key0 = static_cast<std::int64_t>(tile_index) * kKeys + 2 * tig;
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int r = g + 8 * half;
      if (r >= rows) continue;
      const std::int64_t last_key = t0 + r;
      float* out = stored.row(b, r0 + r);
#pragma unroll
      for (int n = 0; n < NT; ++n) {
        const std::int64_t key = key0 + 8 * n;
        if (key + 1 <= last_key) {
          *reinterpret_cast<float2*>(out + key) = make_float2(score[n][2 * half], score[n][2 * half + 1]);
        } else if (key <= last_key) {
          out[key] = score[n][2 * half];
        }
      }
    }
  });
}

template <class T>
__global__ void __launch_bounds__(kSelectThreads) select_keys_kernel(const detail::AttentionParams p,
                                                                      const detail::IndexerConfig c, bool packed,
                                                                      bool counted, StoredScores stored) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  const SelectLayout layout(p, c);
  auto* candidates = reinterpret_cast<std::uint64_t*>(smem_raw);
  auto* hist = reinterpret_cast<std::uint32_t*>(candidates + kCandidates);
  auto* out = reinterpret_cast<std::int32_t*>(hist + kBins);
  float* q = reinterpret_cast<float*>(out + layout.out_slots);
  float* gate = q + layout.q_floats;  // 32 heads at most (checked by the launcher)
  float* bias = gate + 32;

  using Reduce = cub::BlockReduce<double, kSelectThreads>;
  using ReduceKey = cub::BlockReduce<std::uint64_t, kSelectThreads>;
  using Scan = cub::BlockScan<std::uint32_t, kSelectThreads>;
  __shared__ union {
    typename Reduce::TempStorage reduce;
    typename ReduceKey::TempStorage reduce_key;
    typename Scan::TempStorage scan;
  } temp;
  __shared__ double shared_sum;
  __shared__ std::uint64_t shared_lo, shared_hi, shared_bin_lo, shared_bin_hi;
  __shared__ std::uint32_t shared_above, shared_in_bin;
  __shared__ int emitted, collected;
  __shared__ std::int64_t shared_count;

  const QueryRow row = group_row(p, stored);
  if (row.r >= row.s.q_len) return;
  const int tid = threadIdx.x, heads = static_cast<int>(p.heads_q), dim = static_cast<int>(p.dim_qk);
  const std::int64_t t = row.position(), visible = t + 1, q_row = row.operand_row();
  const math::gsa::ScoreForm form = c.form;
  // Counted by indexer_statistics_kernel: a row that keeps every visible key is done.
  if (counted && *c.counts.at<const std::int32_t>(row.b, q_row, 0) == visible) return;

  const float* row_scores = stored.scores != nullptr ? stored.row(row.b, row.r) : nullptr;
  if (row_scores == nullptr) load_row_query<T>(p, c, row, q, gate, bias);
  if (tid == 0) emitted = 0;
  __syncthreads();

  auto score_of = [&](std::int64_t key) {
    if (row_scores != nullptr) return row_scores[key];
    return indexer_score<T>(q, gate, bias, heads, dim, form, p.k.at<const T>(row.b, row.s.k_start + key, 0),
                            p.k.dim, packed);
  };
  // Every visible key's (key, score) to f, a thread's keys in quads 4 i .. 4 i + 3 for i = tid,
  // tid + kSelectThreads, ... in that order either way, so that stored and recomputed scores give
  // the same sums bit for bit. Stored rows (16-byte aligned: ld is a multiple of 4) are read a
  // quad a load with kQuadsInFlight loads issued before the first is used: one load at a time
  // left the passes waiting on L1TEX for over half their cycles (ncu, 2026-11-27).
  constexpr int kQuadsInFlight = 4;
  auto for_each_key = [&](auto&& f) {
    const std::int64_t quads = (visible + 3) / 4;
    if (row_scores != nullptr) {
      const float4* rows4 = reinterpret_cast<const float4*>(row_scores);
      std::int64_t i = tid;
      for (; i + (kQuadsInFlight - 1) * kSelectThreads < quads - 1; i += kQuadsInFlight * kSelectThreads) {
        float4 x[kQuadsInFlight];
#pragma unroll
        for (int u = 0; u < kQuadsInFlight; ++u) x[u] = rows4[i + u * kSelectThreads];
#pragma unroll
        for (int u = 0; u < kQuadsInFlight; ++u) {
          const std::int64_t key = 4 * (i + u * kSelectThreads);
          f(key, x[u].x);
          f(key + 1, x[u].y);
          f(key + 2, x[u].z);
          f(key + 3, x[u].w);
        }
      }
      for (; i < quads; i += kSelectThreads) {  // the rest, the last (possibly partial) quad among them
        for (std::int64_t key = 4 * i; key < 4 * i + 4 && key < visible; ++key) f(key, row_scores[key]);
      }
    } else {
      for (std::int64_t i = tid; i < quads; i += kSelectThreads) {
        for (std::int64_t key = 4 * i; key < 4 * i + 4 && key < visible; ++key) f(key, score_of(key));
      }
    }
  };

  // 1. Statistics. Sums of (x - x_0), x_0 the first key's score: close rows (small variance
  // next to a large mean) would otherwise cancel away in E[x^2] - E[x]^2.
  const float shift = score_of(0);
  double sum = 0, sum_sq = 0;
  std::uint64_t lo = ~std::uint64_t{0}, hi = 0;
  for_each_key([&](std::int64_t key, float x) {
    const double centered = static_cast<double>(x) - static_cast<double>(shift);
    sum += centered;
    sum_sq += centered * centered;
    const std::uint64_t sk = sort_key(x, key);
    lo = sk < lo ? sk : lo;
    hi = sk > hi ? sk : hi;
  });
  sum = Reduce(temp.reduce).Sum(sum);
  if (tid == 0) shared_sum = sum;
  __syncthreads();
  sum_sq = Reduce(temp.reduce).Sum(sum_sq);
  __syncthreads();
  lo = ReduceKey(temp.reduce_key).Reduce(lo, [](std::uint64_t a, std::uint64_t b) { return a < b ? a : b; });
  __syncthreads();
  hi = ReduceKey(temp.reduce_key).Reduce(hi, [](std::uint64_t a, std::uint64_t b) { return a > b ? a : b; });
  if (tid == 0) {
    const double n = static_cast<double>(visible), mean = shared_sum / n;
    const double variance = sum_sq / n - mean * mean;
    const double var = variance > 0 ? variance : 0.0;
    if (counted) {
      shared_count = *c.counts.at<const std::int32_t>(row.b, q_row, 0);
    } else {
      *p.stats.at<float>(row.b, q_row, 0) = static_cast<float>(var);
      const std::int64_t budget = math::gsa::budget(c.budget, var);
      shared_count = budget < visible ? budget : visible;
    }
    shared_lo = lo;
    shared_hi = hi;
  }
  __syncthreads();
  const std::int64_t count = shared_count;
  std::int32_t* indices = c.indices.at<std::int32_t>(row.b, q_row, 0);
  const std::int64_t slot_stride = c.indices.head;
  if (tid == 0 && !counted) *c.counts.at<std::int32_t>(row.b, q_row, 0) = static_cast<std::int32_t>(count);
  const std::int64_t k_max = c.budget.k_max;

  if (count == visible) {  // every visible key, already in order
    for (std::int64_t i = tid; i < k_max; i += kSelectThreads) {
      indices[i * slot_stride] = i < visible ? static_cast<std::int32_t>(i) : -1;
    }
    return;
  }

  // 2. Refinement. Keys in (emit_lo, emit_hi] are selected by an earlier level and written out
  // by the next pass; [lo, hi] is the range still undecided, of which `need` are selected.
  lo = shared_lo;
  hi = shared_hi;
  std::uint64_t emit_lo = 0, emit_hi = 0;
  std::int64_t need = count;
  for (;;) {
    int shift_bits = 0;
    while (((hi - lo) >> shift_bits) >= static_cast<std::uint64_t>(kBins)) ++shift_bits;
    for (int b = tid; b < kBins; b += kSelectThreads) hist[b] = 0;
    __syncthreads();
    for_each_key([&](std::int64_t key, float x) {
      const std::uint64_t sk = sort_key(x, key);
      if (sk > emit_lo && sk <= emit_hi) out[atomicAdd(&emitted, 1)] = static_cast<std::int32_t>(key);
      if (sk >= lo && sk <= hi) atomicAdd(&hist[(sk - lo) >> shift_bits], 1u);
    });
    __syncthreads();
    // Thread i owns the bins kBins - 8 (i + 1) .. kBins - 8 i - 1: thread 0 the highest, so an
    // exclusive scan in thread order counts the keys above each thread's bins.
    std::uint32_t own = 0;
    const int top = kBins - kBinsPerThread * tid - 1;
    for (int b = 0; b < kBinsPerThread; ++b) own += hist[top - b];
    std::uint32_t higher = 0;
    Scan(temp.scan).ExclusiveSum(own, higher);
    for (int b = 0; b < kBinsPerThread; ++b) {
      const std::uint32_t here = hist[top - b];
      if (higher < need && higher + here >= need) {
        shared_above = higher;
        shared_in_bin = here;
        shared_bin_lo = lo + (static_cast<std::uint64_t>(top - b) << shift_bits);
        const std::uint64_t last = shared_bin_lo + ((std::uint64_t{1} << shift_bits) - 1);
        shared_bin_hi = last < hi && last >= shared_bin_lo ? last : hi;
      }
      higher += here;
    }
    __syncthreads();
    const std::uint64_t bin_lo = shared_bin_lo, bin_hi = shared_bin_hi;
    const std::uint32_t above = shared_above, in_bin = shared_in_bin;
    // Everything of [lo, hi] above the bin is selected; the bin's keys decide the rest.
    emit_lo = bin_hi;
    emit_hi = hi;
    need -= above;
    if (in_bin <= static_cast<std::uint32_t>(kCandidates)) {
      if (tid == 0) collected = 0;
      __syncthreads();
      for_each_key([&](std::int64_t key, float x) {
        const std::uint64_t sk = sort_key(x, key);
        if (sk > emit_lo && sk <= emit_hi) out[atomicAdd(&emitted, 1)] = static_cast<std::int32_t>(key);
        if (sk >= bin_lo && sk <= bin_hi) candidates[atomicAdd(&collected, 1)] = sk;
      });
      __syncthreads();
      const int n = SelectLayout::pow2_at_least(in_bin);
      for (int i = static_cast<int>(in_bin) + tid; i < n; i += kSelectThreads) candidates[i] = 0;
      __syncthreads();
      block_bitonic_sort(candidates, n, /*descending=*/true);
      const int base = emitted;
      for (std::int64_t i = tid; i < need; i += kSelectThreads) {
        out[base + i] = static_cast<std::int32_t>(candidates[i] & 0xffffffffu);
      }
      break;
    }
    lo = bin_lo;
    hi = bin_hi;
  }
  __syncthreads();

  // 3. The selected positions in increasing order, then the padding.
  const int n = SelectLayout::pow2_at_least(count);
  for (std::int64_t i = count + tid; i < n; i += kSelectThreads) out[i] = 0x7fffffff;
  __syncthreads();
  block_bitonic_sort(out, n, /*descending=*/false);
  for (std::int64_t i = tid; i < k_max; i += kSelectThreads) indices[i * slot_stride] = i < count ? out[i] : -1;
}

}  // namespace

void gsa_select_keys(const detail::AttentionParams& p, const detail::IndexerConfig& c) {
  if (p.rows_q == 0) return;
  const SelectLayout layout(p, c);
  const std::size_t bytes = layout.bytes();
  int device = 0, limit = 0;
  check(cudaGetDevice(&device), "reading the current device");
  check(cudaDeviceGetAttribute(&limit, cudaDevAttrMaxSharedMemoryPerBlockOptin, device), "reading the shared memory limit");
  const std::size_t fixed_bytes = 4096;  // the kernel's static shared memory, roughly
  if (p.heads_q > 32 || bytes + fixed_bytes > static_cast<std::size_t>(limit)) {
    throw Error(ErrorKind::unsupported,
                "winnow::gsa::select_keys: CUDA selection holds a row's queries (heads x d_I = " +
                    std::to_string(p.heads_q) + " x " + std::to_string(p.dim_qk) + ", at most 32 heads) and k_max = " +
                    std::to_string(c.budget.k_max) + " selected slots in shared memory: " + std::to_string(bytes) +
                    " bytes, more than the device's " + std::to_string(limit - static_cast<int>(fixed_bytes)));
  }
  const int pack = static_cast<int>(16 / element_size(p.dtype));
  const bool packed = aligned_rows(p.k, p.dtype) && p.dim_qk % pack == 0;
  // Pass 0 on tensor cores where it applies and can settle rows: only where k_max covers the
  // longest row can a row keep all its keys. Elsewhere it would only add a pass, since
  // select_keys_kernel scans every row it ranks for the score range anyway (at L = 16384,
  // k = 2048 it cost 4%). WINNOW_GSA_SCALAR_STATISTICS=1 leaves every pass to select_keys_kernel
  // (for A/B runs).
  static const bool scalar_forced = std::getenv("WINNOW_GSA_SCALAR_STATISTICS") != nullptr;
  const int heads = static_cast<int>(p.heads_q);
  const int stat_bytes = p.dim_qk == 64 ? StatisticsLayout<__half, 64>(heads).bytes()
                                        : StatisticsLayout<__half, 128>(heads).bytes();
  const bool tensor_cores = (p.dtype == DType::bfloat16 || p.dtype == DType::float16) &&
                            (p.dim_qk == 64 || p.dim_qk == 128) && p.heads_q <= kStatMaxHeads &&
                            stat_bytes <= limit && aligned_rows(p.q, p.dtype) && aligned_rows(p.k, p.dtype) &&
                            p.num_seqs <= 65535;
  const bool counted = !scalar_forced && tensor_cores && c.budget.k_max >= p.max_len_k;
  auto count_rows = [&](auto kernel) {
    check(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, stat_bytes),
          "raising the indexer statistics kernel's shared memory");
    const dim3 grid(static_cast<unsigned>((p.max_len_q + kStatRows - 1) / kStatRows),
                    static_cast<unsigned>(p.num_seqs));
    if (grid.x == 0 || grid.y == 0) return;
    kernel<<<grid, 32 * kStatWarps, stat_bytes, stream_of(p)>>>(p, c);
    check_launch("gsa indexer_statistics_kernel");
  };

  // Stored scores unless pass 0 settles the rows (its rows need no scores at all). Groups of the
  // same rows of every sequence, as many as fit kStoredScoreBytes. Scored on tensor cores where
  // pass 0 could run and the sequences have rows enough to fill its 16-row blocks; else a block
  // per (row, 2048 keys), the way decoding's few rows fill the GPU.
  // WINNOW_GSA_SELECT_SCORES = recompute | stored | stored-scalar forces a path, and
  // WINNOW_GSA_SELECT_GROUP_ROWS=n caps a group at n rows of each sequence (tests and A/B runs;
  // read on every call so that a test can switch them).
  constexpr std::int64_t kStoredScoreBytes = std::int64_t{256} << 20;
  constexpr std::int64_t kTensorCoreRows = 64;  // fewer rows a sequence: the scalar scoring
  const char* forced = std::getenv("WINNOW_GSA_SELECT_SCORES");
  const std::string forced_path = forced != nullptr ? forced : "";
  bool stored_path = p.num_seqs <= 65535 &&
                     (forced_path == "stored" || forced_path == "stored-scalar" ||
                      (forced_path != "recompute" && !counted));
  const bool tc_scores = stored_path && tensor_cores && forced_path != "stored-scalar" &&
                         (p.max_len_q >= kTensorCoreRows || forced_path == "stored");
  const std::int64_t ld = (std::max<std::int64_t>(p.max_len_k, 1) + 3) / 4 * 4;  // float2 stores
  const char* group_cap = std::getenv("WINNOW_GSA_SELECT_GROUP_ROWS");
  std::int64_t span = std::min<std::int64_t>({std::max<std::int64_t>(p.max_len_q, 1),
                                              kStoredScoreBytes / (p.num_seqs * ld * 4), 65535});
  if (group_cap != nullptr) span = std::min<std::int64_t>(span, std::atoll(group_cap));
  span = std::max<std::int64_t>(span, 1);
  // A tensor-core block's 16 rows stay inside one group.
  if (tc_scores && span < p.max_len_q) span = std::max<std::int64_t>(span / kStatRows, 1) * kStatRows;
  std::optional<DeviceBuffer> scratch;
  if (stored_path) {
    try {
      scratch.emplace(p, static_cast<std::size_t>(p.num_seqs * span * ld) * sizeof(float));
    } catch (const Error&) {
      if (!forced_path.empty() && forced_path != "recompute") throw;
      stored_path = false;  // no room for the scores: recompute them, as slowly as that is
    }
  }
  const std::size_t score_bytes = (static_cast<std::size_t>(p.heads_q * p.dim_qk) + 64) * sizeof(float);
  // tc_launch(stored, rows): the tensor-core scoring of a group (16-bit inputs only).
  auto launch = [&](auto scalar_scores, auto tc_launch, auto select_kernel) {
    check(cudaFuncSetAttribute(select_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes)),
          "raising the selection kernel's shared memory");
    if (!stored_path) {
      select_kernel<<<static_cast<unsigned>(p.rows_q), kSelectThreads, bytes, stream_of(p)>>>(p, c, packed, counted,
                                                                                            StoredScores{});
      check_launch("gsa select_keys_kernel");
      return;
    }
    if (!tc_scores) {
      check(cudaFuncSetAttribute(scalar_scores, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                 static_cast<int>(score_bytes)),
            "raising the scoring kernel's shared memory");
    }
    const unsigned seqs = static_cast<unsigned>(p.num_seqs);
    for (std::int64_t row0 = 0; row0 < p.max_len_q; row0 += span) {
      const std::int64_t rows = std::min(span, p.max_len_q - row0);
      const StoredScores stored{scratch->as<float>(), ld, row0, span};
      if (tc_scores) {
        tc_launch(stored, rows);
      } else {
        const dim3 grid(static_cast<unsigned>((ld + kScoreKeys - 1) / kScoreKeys), static_cast<unsigned>(rows), seqs);
        scalar_scores<<<grid, kScoreThreads, score_bytes, stream_of(p)>>>(p, c, packed, stored);
        check_launch("gsa indexer_scores_kernel");
      }
      select_kernel<<<dim3(static_cast<unsigned>(rows), seqs), kSelectThreads, bytes, stream_of(p)>>>(p, c, packed,
                                                                                                    counted, stored);
      check_launch("gsa select_keys_kernel");
    }
  };
  auto select = [&](auto element) {
    using T = decltype(element);
    if constexpr (!std::is_same_v<T, float>) {
      if (counted) p.dim_qk == 64 ? count_rows(indexer_statistics_kernel<T, 64>)
                                  : count_rows(indexer_statistics_kernel<T, 128>);
      auto tc_launch = [&](const StoredScores& stored, std::int64_t rows) {
        auto kernel = p.dim_qk == 64 ? indexer_scores_tc_kernel<T, 64> : indexer_scores_tc_kernel<T, 128>;
        check(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, stat_bytes),
              "raising the tensor-core scoring kernel's shared memory");
        const dim3 grid(static_cast<unsigned>((rows + kStatRows - 1) / kStatRows), static_cast<unsigned>(p.num_seqs));
        kernel<<<grid, 32 * kStatWarps, stat_bytes, stream_of(p)>>>(p, c, stored);
        check_launch("gsa indexer_scores_tc_kernel");
      };
      launch(indexer_scores_kernel<T>, tc_launch, select_keys_kernel<T>);
    } else {
      auto no_tensor_cores = [](const StoredScores&, std::int64_t) {};  // tc_scores is false for float32
      launch(indexer_scores_kernel<T>, no_tensor_cores, select_keys_kernel<T>);
    }
  };
  switch (p.dtype) {
    case DType::bfloat16: return select(__nv_bfloat16{});
    case DType::float16: return select(__half{});
    default: return select(float{});
  }
}

}  // namespace winnow::cuda
