// GSA's sparse softmax attention on CUDA (spec/gsa.md; winnow/gsa.h): every query row attends
// to its own list of keys, one list per token shared by all of its heads.
//
// Forward and the backward's query-side pass give one block to each (query row, kv head): the
// block gathers the listed K and V rows once, in chunks of kChunk, into shared memory and
// serves every query head of the group from them (003's shared gather), with an online softmax
// over the chunks. The backward's key gradients are either added by that pass with atomics
// into fp32 accumulators, or, deterministic, gathered per key: the (key, query) pairs of all
// lists are stably sorted by key, and a block per (key row, kv head) walks its queries in
// order. The kernels use CUDA cores and fp32 arithmetic throughout (every dtype, head
// dimensions up to kMaxDim); entries outside a row's visible keys are ignored, never read.
//
// A list that holds every visible key (count t + 1: early rows, or short sequences under a
// large budget) is plain causal softmax. Where the fused kernels apply, the forward runs each
// block of kCompleteBlockRows query rows whose lists are all complete through the dense softmax
// kernel instead (CompleteListRows), and the gather kernel skips those rows.
#include <cub/device/device_radix_sort.cuh>
#include <cub/device/device_scan.cuh>

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <type_traits>

#include "cuda/attention/row_blocks.cuh"
#include "cuda/attention/softmax_rows.cuh"
#include "cuda/cuda.h"
#include "cuda/element_types.cuh"
#include "cuda/launch.h"
#include "cuda/launch_attention.cuh"
#include "cuda/tile/fragment.cuh"
#include "cuda/tile/smem_tile.cuh"

namespace winnow::cuda {
namespace {

using detail::AttentionParams;
using detail::GradientParams;
using detail::KeyListConfig;

constexpr int kThreads = 128;
constexpr int kChunk = 32;  // keys gathered at a time: one per lane for the softmax steps
constexpr int kMaxDim = 256;
static_assert(kChunk == 32, "the softmax steps give each key of a chunk a lane");

// The query blocks of the dense forward kernels (both hold 128 rows, from row 0 of a sequence).
constexpr int kCompleteBlockRows = kForwardBQ;
static_assert(Sm90ForwardShape::kBQ == kCompleteBlockRows, "both dense kernels take the same blocks");

__device__ __forceinline__ bool list_is_complete(const KeyListConfig& c, std::int64_t b, std::int64_t operand_row,
                                                 std::int64_t t) {
  return *c.counts.at<const std::int32_t>(b, operand_row, 0) == t + 1;
}

// Softmax over every visible key, for blocks whose rows' lists are all complete.
struct CompleteListRows : SoftmaxRows {
  static constexpr bool kNeedsEveryRow = true;
  template <class Tile>
  __device__ __forceinline__ CompleteListRows(const AttentionParams& p, const KeyListConfig&, const Tile& qt,
                                              std::int64_t row0)
      : SoftmaxRows(p, SoftmaxConfig{}, qt, row0) {}
  template <class Tile>
  __device__ __forceinline__ static bool takes_part(const AttentionParams&, const KeyListConfig& c, const Tile& qt,
                                                    std::int64_t row) {
    return list_is_complete(c, qt.b, qt.s.q_start + row, row + qt.s.q_offset());
  }
  __device__ __forceinline__ void store_extra(const AttentionParams&, const KeyListConfig&, std::int64_t, std::int64_t,
                                              std::int64_t, std::int64_t, int) const {}
};

// Whether the dense kernel took this row's block (every thread of the block must call this).
__device__ __forceinline__ bool taken_by_dense_kernel(const KeyListConfig& c, const QueryRow& row) {
  const std::int64_t r = (row.r / kCompleteBlockRows) * kCompleteBlockRows + threadIdx.x;
  const bool complete =
      threadIdx.x >= kCompleteBlockRows || r >= row.s.q_len || list_is_complete(c, row.b, row.s.q_start + r, r + row.s.q_offset());
  return __syncthreads_and(complete) != 0;
}

// A row's list entry i as a key position, or -1 where the entry is outside [0, t].
__device__ __forceinline__ std::int64_t listed_key(const KeyListConfig& c, const QueryRow& row, std::int64_t i) {
  const std::int64_t key = c.indices.at<const std::int32_t>(row.b, row.operand_row(), 0)[i * c.indices.head];
  return key >= 0 && key <= row.position() ? key : -1;
}
__device__ __forceinline__ std::int64_t list_length(const KeyListConfig& c, const QueryRow& row) {
  const std::int64_t n = *c.counts.at<const std::int32_t>(row.b, row.operand_row(), 0);
  return n < 0 ? 0 : (n > c.k_max ? c.k_max : n);
}

// Shared memory of the query-side kernels, in floats: the group's rows (q, and dout in the
// backward), the running output (forward) or dq (backward), the chunk's K and V (K rows padded
// by one so that lanes reading one feature of consecutive keys hit distinct banks), the
// chunk's weights (and their gradients), and per-head statistics.
struct QuerySideLayout {
  int group, dk, dv, k_stride;
  int q, acc, dout, k, v, w, dw, stat;  // offsets
  int floats;
  __host__ __device__ QuerySideLayout(const AttentionParams& p, bool backward)
      : group(static_cast<int>(p.group_size())), dk(static_cast<int>(p.dim_qk)), dv(static_cast<int>(p.dim_v)),
        k_stride(dk + 1) {
    q = 0;
    acc = q + group * dk;
    const int acc_size = backward ? group * dk : group * dv;
    dout = acc + acc_size;
    k = dout + (backward ? group * dv : 0);
    v = k + kChunk * k_stride;
    w = v + kChunk * dv;
    dw = w + group * kChunk;
    stat = dw + (backward ? group * kChunk : 0);
    floats = stat + 3 * group + kChunk;  // m / l / rescale (forward) or lse / delta, and the keys
  }
  std::size_t bytes() const { return static_cast<std::size_t>(floats) * sizeof(float); }
};

// One operand's listed rows into a float tile, 16 bytes at a time (rows contiguous, aligned, and
// `dim` a multiple of the pack).
template <class T>
__device__ void gather_packed(const detail::Operand& op, const QueryRow& row, std::int64_t hk, const int* keys,
                              int dim, float* tile, int stride) {
  constexpr int N = kPack16<T>;
  const int packs = dim / N;
  for (int e = threadIdx.x; e < kChunk * packs; e += blockDim.x) {
    const int i = e / packs, d0 = (e - i * packs) * N;
    float* dst = tile + i * stride + d0;
    const int key = keys[i];
    if (key < 0) {
#pragma unroll
      for (int x = 0; x < N; ++x) dst[x] = 0.f;
      continue;
    }
    const Pack<T, N> pk = load_pack<T, N>(op.at<const T>(row.b, row.s.k_start + key, hk) + d0);
#pragma unroll
    for (int x = 0; x < N; ++x) dst[x] = widen(pk.v[x]);
  }
}

// Gathers the chunk's listed keys (positions in `keys`, -1 for none) into K and V tiles.
template <class T>
__device__ void gather_chunk(const AttentionParams& p, const QueryRow& row, std::int64_t hk, const int* keys,
                             float* k_tile, int k_stride, float* v_tile, bool packed) {
  const int dk = static_cast<int>(p.dim_qk), dv = static_cast<int>(p.dim_v);
  if (packed) {
    gather_packed<T>(p.k, row, hk, keys, dk, k_tile, k_stride);
    gather_packed<T>(p.v, row, hk, keys, dv, v_tile, dv);
    return;
  }
  for (int e = threadIdx.x; e < kChunk * dk; e += blockDim.x) {
    const int i = e / dk, d = e % dk;
    const int key = keys[i];
    k_tile[i * k_stride + d] = key < 0 ? 0.f : widen(p.k.at<const T>(row.b, row.s.k_start + key, hk)[d * p.k.dim]);
  }
  for (int e = threadIdx.x; e < kChunk * dv; e += blockDim.x) {
    const int i = e / dv, d = e % dv;
    const int key = keys[i];
    v_tile[i * dv + d] = key < 0 ? 0.f : widen(p.v.at<const T>(row.b, row.s.k_start + key, hk)[d * p.v.dim]);
  }
}

// Scaled scores of the group's queries against the chunk's keys; -inf for absent keys.
__device__ void chunk_scores(const float* q, const float* k_tile, int k_stride, const int* keys, int group, int dk,
                             float scale, float* w) {
  for (int e = threadIdx.x; e < group * kChunk; e += blockDim.x) {
    const int g = e / kChunk, i = e % kChunk;
    float dot = 0.f;
    for (int d = 0; d < dk; ++d) dot = fmaf(q[g * dk + d], k_tile[i * k_stride + d], dot);
    w[e] = keys[i] < 0 ? -INFINITY : dot * scale;
  }
}

__device__ __forceinline__ float warp_max(float x) {
  for (int o = 16; o > 0; o /= 2) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, o));
  return x;
}
__device__ __forceinline__ float warp_sum(float x) {
  for (int o = 16; o > 0; o /= 2) x += __shfl_xor_sync(0xffffffffu, x, o);
  return x;
}

template <class T>
__global__ void __launch_bounds__(kThreads) sparse_forward_kernel(const AttentionParams p, const KeyListConfig c,
                                                                  bool dense_took_complete_blocks, bool packed) {
  static_assert(kThreads >= kCompleteBlockRows, "a thread per row of a dense block");
  extern __shared__ __align__(16) float smem[];
  const QuerySideLayout L(p, /*backward=*/false);
  float *q = smem + L.q, *o = smem + L.acc, *k_tile = smem + L.k, *v_tile = smem + L.v, *w = smem + L.w;
  float *m = smem + L.stat, *l = m + L.group, *rescale = l + L.group;
  int* keys = reinterpret_cast<int*>(rescale + L.group);
  const QueryRow row = locate_query_row(p, blockIdx.x);
  if (dense_took_complete_blocks && taken_by_dense_kernel(c, row)) return;
  const std::int64_t hk = blockIdx.y, h0 = hk * L.group, q_row = row.operand_row();
  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32, warps = kThreads / 32;

  for (int e = tid; e < L.group * L.dk; e += kThreads) {
    q[e] = widen(p.q.at<const T>(row.b, q_row, h0 + e / L.dk)[(e % L.dk) * p.q.dim]);
  }
  for (int e = tid; e < L.group * L.dv; e += kThreads) o[e] = 0.f;
  for (int g = tid; g < L.group; g += kThreads) {
    m[g] = -INFINITY;
    l[g] = 0.f;
  }
  __syncthreads();
  const std::int64_t n = list_length(c, row);
  for (std::int64_t i0 = 0; i0 < n; i0 += kChunk) {
    if (tid < kChunk) keys[tid] = i0 + tid < n ? static_cast<int>(listed_key(c, row, i0 + tid)) : -1;
    __syncthreads();
    gather_chunk<T>(p, row, hk, keys, k_tile, L.k_stride, v_tile, packed);
    __syncthreads();
    chunk_scores(q, k_tile, L.k_stride, keys, L.group, L.dk, static_cast<float>(p.scale), w);
    __syncthreads();
    for (int g = warp; g < L.group; g += warps) {
      const float x = w[g * kChunk + lane];
      const float m_new = fmaxf(m[g], warp_max(x));
      const float e = m_new == -INFINITY ? 0.f : expf(x - m_new);
      const float sum = warp_sum(e);
      w[g * kChunk + lane] = e;
      __syncwarp();
      if (lane == 0) {
        const float r = m[g] == -INFINITY ? 0.f : expf(m[g] - m_new);
        rescale[g] = r;
        l[g] = l[g] * r + sum;
        m[g] = m_new;
      }
    }
    __syncthreads();
    for (int e = tid; e < L.group * L.dv; e += kThreads) {
      const int g = e / L.dv, d = e % L.dv;
      float acc = o[e] * rescale[g];
      for (int i = 0; i < kChunk; ++i) acc = fmaf(w[g * kChunk + i], v_tile[i * L.dv + d], acc);
      o[e] = acc;
    }
    __syncthreads();
  }
  for (int e = tid; e < L.group * L.dv; e += kThreads) {
    const int g = e / L.dv, d = e % L.dv;
    p.out.at<T>(row.b, q_row, h0 + g)[d * p.out.dim] = narrow_to<T>(l[g] > 0.f ? o[e] / l[g] : 0.f);
  }
  for (int g = tid; g < L.group; g += kThreads) {
    *p.stats.at<float>(row.b, q_row, h0 + g) = l[g] > 0.f ? m[g] + logf(l[g]) : -INFINITY;
  }
}

// ---- The forward on tensor cores: 16-bit inputs, D = Dv = 64 or 128, at most 16 query heads per
// kv head, rows 16-byte aligned (fused_path_applies). The group's query rows are the 16 rows of
// an m16n8k16 A operand (rows past the group are zero and their results dropped), so a
// gathered key serves every head of its group as in the scalar kernel. Each warp walks its own
// chunks of kTcChunk listed keys (walk_listed_chunks) with a private online softmax and output;
// the warps' partial outputs are merged at the end. The kernel is bound by the gathers, not the
// products: ~0.5 KB of K and V per listed key for 2 x 2 x group x D multiply-adds.
constexpr int kTcChunk = 16;
constexpr int kTcWarps = 4;
constexpr int kTcThreads = 32 * kTcWarps;
static_assert(kTcThreads >= kCompleteBlockRows, "a thread per row of a dense block");

// The group's query rows of `op` (heads h0 .. h0 + group - 1 at the row) into a 16-row tile,
// rows past the group zero: the m16n8k16 A operand (or B, for dk and dv) of the tensor-core kernels.
template <class Tile>
__device__ __forceinline__ void load_group_rows(const Tile& tile, const detail::Operand& op, const QueryRow& row,
                                                std::int64_t h0, int group, int tid) {
  using T = std::remove_cv_t<std::remove_pointer_t<decltype(tile.data)>>;
  tile.template load_async<kTcThreads>(tid, [&](int r) -> const T* {
    return r < group ? op.at<const T>(row.b, row.operand_row(), h0 + r) : nullptr;
  });
}

// A warp's walk over its chunks of a row's list (chunk warp, warp + kTcWarps, ...) through two
// stages of K and V tiles at `stages`: while `body` uses a chunk, the next chunk's K and V rows
// are in flight (cp.async) and the list entries of the chunk after that are being read.
// body(k_tile, v_tile, live, key_of_lane): live has bit i set where entry i is a key, and lane
// i < kTcChunk holds that key (-1: none, or outside [0, t]).
template <class T, int D, class Body>
__device__ __forceinline__ void walk_listed_chunks(const AttentionParams& p, const KeyListConfig& c, const QueryRow& row,
                                                   std::int64_t hk, T* stages, int stage_elems, int lane, int warp,
                                                   Body&& body) {
  using Tile = tile::SmemTile<T, kTcChunk, D>;
  auto k_tile = [&](int stage) { return Tile{stages + stage * stage_elems}; };
  auto v_tile = [&](int stage) { return Tile{stages + stage * stage_elems + kTcChunk * D}; };
  const std::int64_t n = list_length(c, row);
  const int chunks = static_cast<int>((n + kTcChunk - 1) / kTcChunk);
  auto chunk_key = [&](int chunk) -> int {
    const std::int64_t i = static_cast<std::int64_t>(chunk) * kTcChunk + lane;
    return lane < kTcChunk && chunk < chunks && i < n ? static_cast<int>(listed_key(c, row, i)) : -1;
  };
  auto issue = [&](int stage, int key_of_lane) {
    auto rows_of = [&](const detail::Operand& op) {
      return [&, key_of_lane](int r) -> const T* {
        const int key = __shfl_sync(0xffffffffu, key_of_lane, r);
        return key < 0 ? nullptr : op.at<const T>(row.b, row.s.k_start + key, hk);
      };
    };
    k_tile(stage).template load_async<32>(lane, rows_of(p.k));
    v_tile(stage).template load_async<32>(lane, rows_of(p.v));
    tile::cp_async_commit();
  };
  int key_now = chunk_key(warp);
  if (warp < chunks) issue(0, key_now);
  int key_next = chunk_key(warp + kTcWarps);
  int stage = 0;
  for (int chunk = warp; chunk < chunks; chunk += kTcWarps) {
    const bool more = chunk + kTcWarps < chunks;
    if (more) issue(stage ^ 1, key_next);
    const int key_later = chunk_key(chunk + 2 * kTcWarps);
    const unsigned live = __ballot_sync(0xffffffffu, key_now >= 0);
    if (more) {
      tile::cp_async_wait<1>();
    } else {
      tile::cp_async_wait<0>();
    }
    __syncwarp();
    body(k_tile(stage), v_tile(stage), live, key_now);
    __syncwarp();
    key_now = key_next;
    key_next = key_later;
    stage ^= 1;
  }
}

template <int D>
struct TcForwardLayout {
  static constexpr int kTileElems = kTcChunk * D;  // one K or V chunk
  static constexpr int kQElems = 16 * D;
  // 16-bit elements: the query tile, then per warp two stages of (K, V). After the chunks, a
  // warp's stages hold its 16 x D float partial output; the merge's statistics follow.
  static constexpr int kStageElems = 2 * kTileElems;
  static constexpr int kWarpElems = 2 * kStageElems;
  static_assert(kWarpElems * 2 >= 16 * D * 4, "a warp's stages hold its float output");
  static constexpr std::size_t kStatsOffset = 2 * (kQElems + kTcWarps * kWarpElems);  // bytes
  static constexpr std::size_t kBytes = kStatsOffset + 2 * kTcWarps * 16 * sizeof(float);
};

template <class T, int D>
__global__ void __launch_bounds__(kTcThreads, 3) sparse_forward_tc_kernel(const AttentionParams p, const KeyListConfig c,
                                                                       bool dense_took_complete_blocks) {
  using Layout = TcForwardLayout<D>;
  using Tile = tile::SmemTile<T, kTcChunk, D>;
  constexpr int KS = D / 16, NT_O = D / 8;
  extern __shared__ __align__(128) unsigned char tc_smem[];
  T* const base = reinterpret_cast<T*>(tc_smem);
  const QueryRow row = locate_query_row(p, blockIdx.x);
  if (dense_took_complete_blocks && taken_by_dense_kernel(c, row)) return;
  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32, g = lane / 4, tig = lane % 4;
  const int group = static_cast<int>(p.group_size());
  const std::int64_t hk = blockIdx.y, h0 = hk * group, q_row = row.operand_row();

  const tile::SmemTile<T, 16, D> q_tile{base};
  load_group_rows(q_tile, p.q, row, h0, group, tid);
  tile::cp_async_commit();
  tile::cp_async_wait<0>();
  __syncthreads();
  std::uint32_t qa[KS][4];
  tile::load_rows_operand<KS>(qa, q_tile, 0, lane);

  T* const warp_base = base + Layout::kQElems + warp * Layout::kWarpElems;
  const float scale_log2 = static_cast<float>(p.scale) * static_cast<float>(M_LOG2E);
  float o[NT_O][4];
  tile::zero(o);
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f};  // rows g and g + 8 (l: this thread's part)
  walk_listed_chunks<T, D>(p, c, row, hk, warp_base, Layout::kStageElems, lane, warp,
                           [&](const Tile& k_tile, const Tile& v_tile, unsigned live, int) {
    float s[2][4];
    tile::zero(s);
    tile::mma_b_rows<T, 2, KS>(s, qa, k_tile, 0, lane);
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      float x[4];
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const int key = 8 * (j / 2) + 2 * tig + (j % 2);
        x[j] = (live >> key) & 1u ? s[j / 2][2 * half + j % 2] * scale_log2 : -INFINITY;
      }
      float top = fmaxf(fmaxf(x[0], x[1]), fmaxf(x[2], x[3]));
      top = fmaxf(top, __shfl_xor_sync(0xffffffffu, top, 1));
      top = fmaxf(top, __shfl_xor_sync(0xffffffffu, top, 2));
      const float m_new = fmaxf(m[half], top);
      const float rescale = m_new == -INFINITY ? 1.f : exp2f(m[half] - m_new);
      float sum = 0.f;
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const float e = m_new == -INFINITY ? 0.f : exp2f(x[j] - m_new);
        s[j / 2][2 * half + j % 2] = e;
        sum += e;
      }
      l[half] = l[half] * rescale + sum;
      m[half] = m_new;
#pragma unroll
      for (int nt = 0; nt < NT_O; ++nt) {
        o[nt][2 * half] *= rescale;
        o[nt][2 * half + 1] *= rescale;
      }
    }
    std::uint32_t pa[1][4];
    tile::to_operand<T, 1>(s, pa);
    tile::mma_b_cols<T, NT_O, 1>(o, pa, v_tile, 0, lane);
  });

  // Merge the warps: each row's largest running max, every warp's output and sum rescaled to it.
  float* const stat_m = reinterpret_cast<float*>(tc_smem + Layout::kStatsOffset);
  float* const stat_l = stat_m + kTcWarps * 16;
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    l[half] += __shfl_xor_sync(0xffffffffu, l[half], 1);
    l[half] += __shfl_xor_sync(0xffffffffu, l[half], 2);
    if (tig == 0) {
      stat_m[warp * 16 + g + 8 * half] = m[half];
      stat_l[warp * 16 + g + 8 * half] = l[half];
    }
  }
  __syncthreads();
  float* const partial = reinterpret_cast<float*>(warp_base);  // this warp's [16][D] floats
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int r = g + 8 * half;
    float top = -INFINITY;
#pragma unroll
    for (int w = 0; w < kTcWarps; ++w) top = fmaxf(top, stat_m[w * 16 + r]);
    const float mine = m[half] == -INFINITY ? 0.f : exp2f(m[half] - top);
#pragma unroll
    for (int nt = 0; nt < NT_O; ++nt) {
      partial[r * D + 8 * nt + 2 * tig] = o[nt][2 * half] * mine;
      partial[r * D + 8 * nt + 2 * tig + 1] = o[nt][2 * half + 1] * mine;
    }
  }
  __syncthreads();
  for (int e = tid; e < group * D; e += kTcThreads) {
    const int r = e / D, d = e % D;
    float top = -INFINITY;
#pragma unroll
    for (int w = 0; w < kTcWarps; ++w) top = fmaxf(top, stat_m[w * 16 + r]);
    float sum = 0.f, acc = 0.f;
#pragma unroll
    for (int w = 0; w < kTcWarps; ++w) {
      const float mw = stat_m[w * 16 + r];
      if (mw != -INFINITY) sum += stat_l[w * 16 + r] * exp2f(mw - top);
      acc += reinterpret_cast<const float*>(base + Layout::kQElems + w * Layout::kWarpElems)[r * D + d];
    }
    p.out.at<T>(row.b, q_row, h0 + r)[d] = narrow_to<T>(sum > 0.f ? acc / sum : 0.f);
    if (d == 0) {
      *p.stats.at<float>(row.b, q_row, h0 + r) = sum > 0.f ? (top + log2f(sum)) * static_cast<float>(M_LN2) : -INFINITY;
    }
  }
}

// The backward's query side on tensor cores, under the forward's conditions (and 16-byte dout
// and dq rows): per chunk of 16 listed keys and warp, S = Q K^T and dP = dO V^T again, P from
// the forward's log-sum-exps, dS = P (dP - delta) scale, dq += dS K; with dk_acc / dv_acc the
// chunk's dk = dS^T Q and dv = P^T dO (dS and P through a small shared tile for the transpose)
// are added into the fp32 accumulators with atomics, as the scalar kernel does. Padding rows of
// the group get P = 0, so they add nothing.
template <int D>
struct TcBackwardLayout {
  static constexpr int kTileElems = kTcChunk * D;
  static constexpr int kRowsElems = 16 * D;                // Q or dO
  static constexpr int kStageElems = 2 * kTileElems;       // K and V
  static constexpr int kSmallElems = 16 * 16;              // dS or P, [row][key]
  static constexpr int kWarpElems = 2 * kStageElems + 2 * kSmallElems;
  static_assert(2 * kStageElems * 2 >= 16 * D * 4, "a warp's stages hold its float dq");
  static constexpr std::size_t kStatsOffset = 2 * (2 * kRowsElems + kTcWarps * kWarpElems);  // bytes
  static constexpr std::size_t kBytes = kStatsOffset + 2 * 16 * sizeof(float);
};

template <class T, int D>
__global__ void __launch_bounds__(kTcThreads, 2)
    sparse_backward_query_tc_kernel(const AttentionParams p, const GradientParams gr, const KeyListConfig c,
                                    float* delta_out, float* dk_acc, float* dv_acc) {
  using Layout = TcBackwardLayout<D>;
  using Tile = tile::SmemTile<T, kTcChunk, D>;
  using RowsTile = tile::SmemTile<T, 16, D>;
  using SmallTile = tile::SmemTile<T, 16, 16>;
  constexpr int KS = D / 16, NT = D / 8;
  extern __shared__ __align__(128) unsigned char tc_smem[];
  T* const base = reinterpret_cast<T*>(tc_smem);
  const QueryRow row = locate_query_row(p, blockIdx.x);
  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32, g = lane / 4, tig = lane % 4;
  const int group = static_cast<int>(p.group_size());
  const std::int64_t hk = blockIdx.y, h0 = hk * group, q_row = row.operand_row();

  const RowsTile q_tile{base}, do_tile{base + Layout::kRowsElems};
  load_group_rows(q_tile, p.q, row, h0, group, tid);
  load_group_rows(do_tile, gr.dout, row, h0, group, tid);
  tile::cp_async_commit();
  // Per row: the log-sum-exp in base 2 (+inf for padding and empty rows: P = 0) and delta.
  float* const lse2 = reinterpret_cast<float*>(tc_smem + Layout::kStatsOffset);
  float* const delta = lse2 + 16;
  for (int r = warp; r < 16; r += kTcWarps) {
    float x = 0.f, lse = INFINITY;
    if (r < group) {
      const T* out = p.out.at<const T>(row.b, q_row, h0 + r);
      const T* dout = gr.dout.at<const T>(row.b, q_row, h0 + r);
      for (int d = lane; d < D; d += 32) x = fmaf(widen(dout[d]), widen(out[d]), x);
      x = warp_sum(x);
      const float l = *p.stats.at<const float>(row.b, q_row, h0 + r);
      lse = l == -INFINITY ? INFINITY : l * static_cast<float>(M_LOG2E);
      if (lane == 0 && delta_out != nullptr) delta_out[p.batch_row_q(row.b, q_row) * p.heads_q + h0 + r] = x;
    }
    if (lane == 0) {
      lse2[r] = lse;
      delta[r] = x;
    }
  }
  tile::cp_async_wait<0>();
  __syncthreads();
  std::uint32_t qa[KS][4];
  tile::load_rows_operand<KS>(qa, q_tile, 0, lane);
  const float row_lse[2] = {lse2[g], lse2[g + 8]}, row_delta[2] = {delta[g], delta[g + 8]};

  T* const warp_base = base + 2 * Layout::kRowsElems + warp * Layout::kWarpElems;
  const SmallTile ds_tile{warp_base + 2 * Layout::kStageElems};
  const SmallTile p_tile{warp_base + 2 * Layout::kStageElems + Layout::kSmallElems};
  const float scale = static_cast<float>(p.scale), scale_log2 = scale * static_cast<float>(M_LOG2E);
  float dq[NT][4];
  tile::zero(dq);
  walk_listed_chunks<T, D>(p, c, row, hk, warp_base, Layout::kStageElems, lane, warp,
                           [&](const Tile& k_tile, const Tile& v_tile, unsigned live, int key_of_lane) {
    float s[2][4], dp[2][4];
    tile::zero(s);
    tile::zero(dp);
    tile::mma_b_rows<T, 2, KS>(s, qa, k_tile, 0, lane);
    tile::mma_smem_a_b_rows<T, KS, 2>(dp, do_tile, 0, v_tile, 0, lane);
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      const int nt = j / 4, e = j % 4, half = e / 2;
      const int key = 8 * nt + 2 * tig + (e % 2);
      const float prob = (live >> key) & 1u ? exp2f(s[nt][e] * scale_log2 - row_lse[half]) : 0.f;
      s[nt][e] = prob;
      dp[nt][e] = prob * (dp[nt][e] - row_delta[half]) * scale;
    }
    std::uint32_t dsa[1][4];
    tile::to_operand<T, 1>(dp, dsa);
    tile::mma_b_cols<T, NT, 1>(dq, dsa, k_tile, 0, lane);
    if (dk_acc == nullptr) return;
    ds_tile.store_c(dp[0], 0, 0, lane);
    ds_tile.store_c(dp[1], 0, 8, lane);
    p_tile.store_c(s[0], 0, 0, lane);
    p_tile.store_c(s[1], 0, 8, lane);
    __syncwarp();
    const int keys[2] = {__shfl_sync(0xffffffffu, key_of_lane, g), __shfl_sync(0xffffffffu, key_of_lane, g + 8)};
    // dk then dv: the chunk's keys (rows g, g + 8 of the accumulator) times the group's rows.
#pragma unroll
    for (int which = 0; which < 2; ++which) {
      std::uint32_t ta[1][4];
      (which == 0 ? ds_tile : p_tile).a_cols(ta[0], 0, 0, lane);
      float acc[NT][4];
      tile::zero(acc);
      tile::mma_b_cols<T, NT, 1>(acc, ta, which == 0 ? q_tile : do_tile, 0, lane);
      float* const into = which == 0 ? dk_acc : dv_acc;
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        if (keys[half] < 0) continue;
        float* const at = into + (p.batch_row_k(row.b, row.s.k_start + keys[half]) * p.heads_kv + hk) * D + 2 * tig;
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
          atomicAdd(reinterpret_cast<float2*>(at + 8 * nt), make_float2(acc[nt][2 * half], acc[nt][2 * half + 1]));
#else
          atomicAdd(at + 8 * nt, acc[nt][2 * half]);
          atomicAdd(at + 8 * nt + 1, acc[nt][2 * half + 1]);
#endif
        }
      }
    }
  });

  // Sum the warps' dq.
  __syncthreads();
  float* const partial = reinterpret_cast<float*>(warp_base);
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int r = g + 8 * half;
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
      partial[r * D + 8 * nt + 2 * tig] = dq[nt][2 * half];
      partial[r * D + 8 * nt + 2 * tig + 1] = dq[nt][2 * half + 1];
    }
  }
  __syncthreads();
  for (int e = tid; e < group * D; e += kTcThreads) {
    const int r = e / D, d = e % D;
    float acc = 0.f;
#pragma unroll
    for (int w = 0; w < kTcWarps; ++w) {
      acc += reinterpret_cast<const float*>(base + 2 * Layout::kRowsElems + w * Layout::kWarpElems)[r * D + d];
    }
    gr.dq.at<T>(row.b, q_row, h0 + r)[d] = narrow_to<T>(acc);
  }
}

// The backward's query side: dq of the group's heads, and delta = <dout, out> per head (kept
// for the key side). With dk_acc / dv_acc (fp32, [key row][kv head][dim], zeroed) it also adds
// the key gradients there with atomics.
template <class T>
__global__ void __launch_bounds__(kThreads) sparse_backward_query_kernel(const AttentionParams p, const GradientParams g,
                                                                       const KeyListConfig c, float* delta_out,
                                                                       float* dk_acc, float* dv_acc, bool packed) {
  extern __shared__ __align__(16) float smem[];
  const QuerySideLayout L(p, /*backward=*/true);
  float *q = smem + L.q, *dq = smem + L.acc, *dout = smem + L.dout, *k_tile = smem + L.k, *v_tile = smem + L.v;
  float *w = smem + L.w, *dw = smem + L.dw, *lse = smem + L.stat, *delta = lse + L.group;
  int* keys = reinterpret_cast<int*>(delta + L.group);
  const QueryRow row = locate_query_row(p, blockIdx.x);
  const std::int64_t hk = blockIdx.y, h0 = hk * L.group, q_row = row.operand_row();
  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32, warps = kThreads / 32;
  const float scale = static_cast<float>(p.scale);

  for (int e = tid; e < L.group * L.dk; e += kThreads) {
    q[e] = widen(p.q.at<const T>(row.b, q_row, h0 + e / L.dk)[(e % L.dk) * p.q.dim]);
    dq[e] = 0.f;
  }
  for (int e = tid; e < L.group * L.dv; e += kThreads) {
    dout[e] = widen(g.dout.at<const T>(row.b, q_row, h0 + e / L.dv)[(e % L.dv) * g.dout.dim]);
  }
  __syncthreads();
  for (int h = warp; h < L.group; h += warps) {
    const T* out = p.out.at<const T>(row.b, q_row, h0 + h);
    float x = 0.f;
    for (int d = lane; d < L.dv; d += 32) x = fmaf(dout[h * L.dv + d], widen(out[d * p.out.dim]), x);
    x = warp_sum(x);
    if (lane == 0) {
      delta[h] = x;
      lse[h] = *p.stats.at<const float>(row.b, q_row, h0 + h);
      if (delta_out != nullptr) delta_out[p.batch_row_q(row.b, q_row) * p.heads_q + h0 + h] = x;
    }
  }
  const std::int64_t n = list_length(c, row);
  for (std::int64_t i0 = 0; i0 < n; i0 += kChunk) {
    if (tid < kChunk) keys[tid] = i0 + tid < n ? static_cast<int>(listed_key(c, row, i0 + tid)) : -1;
    __syncthreads();
    gather_chunk<T>(p, row, hk, keys, k_tile, L.k_stride, v_tile, packed);
    __syncthreads();
    chunk_scores(q, k_tile, L.k_stride, keys, L.group, L.dk, scale, w);
    // dp = <dout, v> per (head, key).
    for (int e = tid; e < L.group * kChunk; e += kThreads) {
      const int h = e / kChunk, i = e % kChunk;
      float x = 0.f;
      for (int d = 0; d < L.dv; ++d) x = fmaf(dout[h * L.dv + d], v_tile[i * L.dv + d], x);
      dw[e] = x;
    }
    __syncthreads();
    // w -> probabilities, dw -> d(score) (with the scale: the gradient of the raw dot product).
    for (int e = tid; e < L.group * kChunk; e += kThreads) {
      const int h = e / kChunk;
      const float prob = w[e] == -INFINITY || lse[h] == -INFINITY ? 0.f : expf(w[e] - lse[h]);
      w[e] = prob;
      dw[e] = prob * (dw[e] - delta[h]) * scale;
    }
    __syncthreads();
    for (int e = tid; e < L.group * L.dk; e += kThreads) {
      const int h = e / L.dk, d = e % L.dk;
      float x = dq[e];
      for (int i = 0; i < kChunk; ++i) x = fmaf(dw[h * kChunk + i], k_tile[i * L.k_stride + d], x);
      dq[e] = x;
    }
    if (dk_acc != nullptr) {
      for (int e = tid; e < kChunk * L.dk; e += kThreads) {
        const int i = e / L.dk, d = e % L.dk;
        if (keys[i] < 0) continue;
        float x = 0.f;
        for (int h = 0; h < L.group; ++h) x = fmaf(dw[h * kChunk + i], q[h * L.dk + d], x);
        const std::int64_t key_row = p.batch_row_k(row.b, row.s.k_start + keys[i]);
        atomicAdd(dk_acc + (key_row * p.heads_kv + hk) * L.dk + d, x);
      }
      for (int e = tid; e < kChunk * L.dv; e += kThreads) {
        const int i = e / L.dv, d = e % L.dv;
        if (keys[i] < 0) continue;
        float x = 0.f;
        for (int h = 0; h < L.group; ++h) x = fmaf(w[h * kChunk + i], dout[h * L.dv + d], x);
        const std::int64_t key_row = p.batch_row_k(row.b, row.s.k_start + keys[i]);
        atomicAdd(dv_acc + (key_row * p.heads_kv + hk) * L.dv + d, x);
      }
    }
    __syncthreads();
  }
  for (int e = tid; e < L.group * L.dk; e += kThreads) {
    g.dq.at<T>(row.b, q_row, h0 + e / L.dk)[(e % L.dk) * g.dq.dim] = narrow_to<T>(dq[e]);
  }
}

// ---- The deterministic key side.

// Every list slot as a (key row, query row) pair over the whole batch; slots past a list's
// count or outside its row's visible keys get key row rows_k, sorted past every real one.
__global__ void list_pairs_kernel(const AttentionParams p, const KeyListConfig c, std::uint32_t* key_rows,
                                  std::uint32_t* query_rows) {
  const std::int64_t total = p.rows_q * c.k_max;
  for (std::int64_t e = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; e < total;
       e += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    const std::int64_t i = e / c.k_max, slot = e % c.k_max;
    const QueryRow row = locate_query_row(p, i);
    const std::int64_t key = slot < list_length(c, row) ? listed_key(c, row, slot) : -1;
    key_rows[e] = static_cast<std::uint32_t>(key < 0 ? p.rows_k : p.batch_row_k(row.b, row.s.k_start + key));
    query_rows[e] = static_cast<std::uint32_t>(p.batch_row_q(row.b, row.operand_row()));
  }
}

// Where each key row's pairs start in the sorted order (starts[rows_k] = the real pairs' end).
__global__ void pair_starts_kernel(const std::uint32_t* sorted_keys, std::int64_t total, std::int64_t rows_k,
                                   std::int64_t* starts) {
  for (std::int64_t e = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; e <= total;
       e += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    const std::int64_t here = e < total ? static_cast<std::int64_t>(sorted_keys[e]) : rows_k;
    const std::int64_t before = e > 0 ? static_cast<std::int64_t>(sorted_keys[e - 1]) : -1;
    for (std::int64_t k = before + 1; k <= here && k <= rows_k; ++k) starts[k] = e;
  }
}

// One block per (key row, kv head), a warp per query (in sorted order, round robin over the
// warps); each lane holds features d = lane + 32 j. The warps' sums are added in a fixed order.
template <class T>
__global__ void __launch_bounds__(kThreads) sparse_backward_key_kernel(const AttentionParams p, const GradientParams g,
                                                                     const std::uint32_t* query_rows,
                                                                     const std::int64_t* starts, const float* delta) {
  constexpr int J = kMaxDim / 32;
  __shared__ float partial[kThreads / 32][2 * kMaxDim];
  const std::int64_t key_row = blockIdx.x, hk = blockIdx.y;
  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32, warps = kThreads / 32;
  const int dk = static_cast<int>(p.dim_qk), dv = static_cast<int>(p.dim_v), group = static_cast<int>(p.group_size());
  const std::int64_t b = p.cu_seqlens_k != nullptr ? 0 : key_row / p.len_k;
  const std::int64_t k_operand_row = p.cu_seqlens_k != nullptr ? key_row : key_row % p.len_k;
  const T* k = p.k.at<const T>(b, k_operand_row, hk);
  const T* v = p.v.at<const T>(b, k_operand_row, hk);
  float k_reg[J], v_reg[J], dk_acc[J], dv_acc[J];
#pragma unroll
  for (int j = 0; j < J; ++j) {
    const int d = lane + 32 * j;
    k_reg[j] = d < dk ? widen(k[d * p.k.dim]) : 0.f;
    v_reg[j] = d < dv ? widen(v[d * p.v.dim]) : 0.f;
    dk_acc[j] = dv_acc[j] = 0.f;
  }
  const float scale = static_cast<float>(p.scale);
  for (std::int64_t e = starts[key_row] + warp; e < starts[key_row + 1]; e += warps) {
    const std::int64_t qi = query_rows[e];
    // Batched query rows are b * len_q + row; packed ones are the operand rows themselves.
    const std::int64_t q_operand_row = p.cu_seqlens_q != nullptr ? qi : qi - b * p.len_q;
    for (int h = static_cast<int>(hk) * group; h < (static_cast<int>(hk) + 1) * group; ++h) {
      const T* q = p.q.at<const T>(b, q_operand_row, h);
      const T* dout = g.dout.at<const T>(b, q_operand_row, h);
      float q_reg[J], dout_reg[J], dot = 0.f, dp = 0.f;
#pragma unroll
      for (int j = 0; j < J; ++j) {
        const int d = lane + 32 * j;
        q_reg[j] = d < dk ? widen(q[d * p.q.dim]) : 0.f;
        dout_reg[j] = d < dv ? widen(dout[d * g.dout.dim]) : 0.f;
        dot = fmaf(q_reg[j], k_reg[j], dot);
        dp = fmaf(dout_reg[j], v_reg[j], dp);
      }
      dot = warp_sum(dot);
      dp = warp_sum(dp);
      const float lse = *p.stats.at<const float>(b, q_operand_row, h);
      const float prob = lse == -INFINITY ? 0.f : expf(dot * scale - lse);
      const float dz = prob * (dp - delta[qi * p.heads_q + h]) * scale;
#pragma unroll
      for (int j = 0; j < J; ++j) {
        dk_acc[j] = fmaf(dz, q_reg[j], dk_acc[j]);
        dv_acc[j] = fmaf(prob, dout_reg[j], dv_acc[j]);
      }
    }
  }
#pragma unroll
  for (int j = 0; j < J; ++j) {
    partial[warp][lane + 32 * j] = dk_acc[j];
    partial[warp][kMaxDim + lane + 32 * j] = dv_acc[j];
  }
  __syncthreads();
  T* dk_out = g.dk.at<T>(b, k_operand_row, hk);
  T* dv_out = g.dv.at<T>(b, k_operand_row, hk);
  for (int d = tid; d < dk; d += kThreads) {
    float x = 0.f;
    for (int w = 0; w < warps; ++w) x += partial[w][d];
    dk_out[d * g.dk.dim] = narrow_to<T>(x);
  }
  for (int d = tid; d < dv; d += kThreads) {
    float x = 0.f;
    for (int w = 0; w < warps; ++w) x += partial[w][kMaxDim + d];
    dv_out[d * g.dv.dim] = narrow_to<T>(x);
  }
}

// ---- List checks.

// The first malformed list as (sequence << 32 | row), or all ones when every list is sound.
__global__ void first_bad_list_kernel(const AttentionParams p, const KeyListConfig c,
                                      unsigned long long* first_bad) {
  for (std::int64_t i = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; i < p.rows_q;
       i += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    const QueryRow row = locate_query_row(p, i);
    const std::int64_t n = *c.counts.at<const std::int32_t>(row.b, row.operand_row(), 0);
    bool bad = n < 0 || n > c.k_max;
    const std::int32_t* keys = c.indices.at<const std::int32_t>(row.b, row.operand_row(), 0);
    std::int64_t previous = -1;
    for (std::int64_t s = 0; !bad && s < n; ++s) {
      const std::int64_t key = keys[s * c.indices.head];
      bad = key <= previous || key > row.position();
      previous = key;
    }
    if (bad) atomicMin(first_bad, (static_cast<unsigned long long>(row.b) << 32) | static_cast<unsigned long long>(row.r));
  }
}

// Whether the query-side kernels fit: head dimensions and the group's shared memory.
void check_sizes(const AttentionParams& p, std::size_t bytes, const char* what) {
  int device = 0, limit = 0;
  check(cudaGetDevice(&device), "reading the current device");
  check(cudaDeviceGetAttribute(&limit, cudaDevAttrMaxSharedMemoryPerBlockOptin, device), "reading the shared memory limit");
  if (p.dim_qk > kMaxDim || p.dim_v > kMaxDim || bytes > static_cast<std::size_t>(limit)) {
    throw Error(ErrorKind::unsupported,
                std::string("winnow::gsa::") + what + ": the CUDA kernels take head dimensions up to " +
                    std::to_string(kMaxDim) + " and hold a group of " + std::to_string(p.group_size()) +
                    " query heads per kv head in shared memory (" + std::to_string(bytes) + " bytes, the device has " +
                    std::to_string(limit) + "); got D = " + std::to_string(p.dim_qk) + ", Dv = " + std::to_string(p.dim_v));
  }
}

template <class Fn>
void by_dtype(const AttentionParams& p, Fn&& fn) {
  switch (p.dtype) {
    case DType::bfloat16: return fn(__nv_bfloat16{});
    case DType::float16: return fn(__half{});
    default: return fn(float{});
  }
}

template <class Kernel>
void allow_shared(Kernel kernel, std::size_t bytes) {
  check(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes)),
        "raising a GSA kernel's shared memory");
}

// Whether K and V rows can be gathered 16 bytes at a time.
bool packed_rows(const AttentionParams& p) {
  const std::int64_t pack = static_cast<std::int64_t>(16 / element_size(p.dtype));
  return aligned_rows(p.k, p.dtype) && aligned_rows(p.v, p.dtype) && p.dim_qk % pack == 0 && p.dim_v % pack == 0;
}

unsigned grid_for(std::int64_t items) {
  const std::int64_t blocks = (items + 255) / 256;
  return static_cast<unsigned>(blocks < 65536 ? (blocks > 0 ? blocks : 1) : 65536);
}

struct DenseCompleteBlocks {
  const AttentionParams& p;
  const KeyListConfig& c;
  template <class T, int D>
  void operator()() const {
    launch_fused_forward<T, D, CompleteListRows>(p, c);
  }
};

struct TcSparseBackwardQuery {
  const AttentionParams& p;
  const GradientParams& g;
  const KeyListConfig& c;
  float *delta_out, *dk_acc, *dv_acc;
  template <class T, int D>
  void operator()() const {
    const std::size_t bytes = TcBackwardLayout<D>::kBytes;
    allow_shared(sparse_backward_query_tc_kernel<T, D>, bytes);
    sparse_backward_query_tc_kernel<T, D>
        <<<dim3(static_cast<unsigned>(p.rows_q), static_cast<unsigned>(p.heads_kv)), kTcThreads, bytes, stream_of(p)>>>(
            p, g, c, delta_out, dk_acc, dv_acc);
    check_launch("gsa sparse_backward_query_tc_kernel");
  }
};

// Whether an environment switch forces the CUDA-core kernel (A/B runs): NAME=scalar.
bool forced_scalar(const char* name) {
  const char* v = std::getenv(name);
  return v != nullptr && std::string(v) == "scalar";
}

struct TcSparseForward {
  const AttentionParams& p;
  const KeyListConfig& c;
  bool dense_took_complete_blocks;
  template <class T, int D>
  void operator()() const {
    const std::size_t bytes = TcForwardLayout<D>::kBytes;
    allow_shared(sparse_forward_tc_kernel<T, D>, bytes);
    sparse_forward_tc_kernel<T, D><<<dim3(static_cast<unsigned>(p.rows_q), static_cast<unsigned>(p.heads_kv)),
                                     kTcThreads, bytes, stream_of(p)>>>(p, c, dense_took_complete_blocks);
    check_launch("gsa sparse_forward_tc_kernel");
  }
};

}  // namespace

void gsa_sparse_forward(const AttentionParams& p, const KeyListConfig& c) {
  if (p.rows_q == 0) return;
  const QuerySideLayout L(p, /*backward=*/false);
  check_sizes(p, L.bytes(), "sparse_forward");
  const bool fused = fused_path_applies(p, nullptr);
  const bool dense = fused && std::getenv("WINNOW_GSA_GATHER_ONLY") == nullptr;
  if (dense) dispatch_fused(p, DenseCompleteBlocks{p, c});
  // WINNOW_GSA_SPARSE_FORWARD=scalar keeps the CUDA-core kernel where the tensor cores apply (A/B).
  if (fused && p.group_size() <= 16 && !forced_scalar("WINNOW_GSA_SPARSE_FORWARD")) {
    dispatch_fused(p, TcSparseForward{p, c, dense});
    return;
  }
  by_dtype(p, [&](auto tag) {
    using T = decltype(tag);
    allow_shared(sparse_forward_kernel<T>, L.bytes());
    sparse_forward_kernel<T><<<dim3(static_cast<unsigned>(p.rows_q), static_cast<unsigned>(p.heads_kv)), kThreads,
                               L.bytes(), stream_of(p)>>>(p, c, dense, packed_rows(p));
    check_launch("gsa sparse_forward_kernel");
  });
}

void gsa_sparse_backward(const AttentionParams& p, const GradientParams& g, const KeyListConfig& c) {
  const QuerySideLayout L(p, /*backward=*/true);
  check_sizes(p, L.bytes(), "sparse_backward");
  const cudaStream_t stream = stream_of(p);
  const std::size_t key_floats = static_cast<std::size_t>(p.rows_k * p.heads_kv);
  const std::int64_t total = p.rows_q * c.k_max;
  if (p.deterministic && (total >= (std::int64_t{1} << 31) || p.rows_k >= (std::int64_t{1} << 31) - 1)) {
    throw Error(ErrorKind::unsupported,
                "winnow::gsa::sparse_backward: the deterministic CUDA backward sorts every list slot (rows x k_max = " +
                    std::to_string(total) + "), at most 2^31 - 1");
  }
  // The query side on tensor cores where the forward's conditions hold (WINNOW_GSA_SPARSE_BACKWARD=scalar: not).
  const bool tc = fused_path_applies(p, &g) && p.group_size() <= 16 && !forced_scalar("WINNOW_GSA_SPARSE_BACKWARD");
  by_dtype(p, [&](auto tag) {
    using T = decltype(tag);
    allow_shared(sparse_backward_query_kernel<T>, L.bytes());
    const dim3 grid(static_cast<unsigned>(p.rows_q), static_cast<unsigned>(p.heads_kv));
    if (!p.deterministic) {
      DeviceBuffer acc(p, key_floats * (p.dim_qk + p.dim_v) * sizeof(float));
      float* dk_acc = acc.as<float>();
      float* dv_acc = dk_acc + key_floats * p.dim_qk;
      check(cudaMemsetAsync(dk_acc, 0, key_floats * (p.dim_qk + p.dim_v) * sizeof(float), stream),
            "clearing the key gradient accumulators");
      if (p.rows_q > 0 && tc) {
        dispatch_fused(p, TcSparseBackwardQuery{p, g, c, nullptr, dk_acc, dv_acc});
      } else if (p.rows_q > 0) {
        sparse_backward_query_kernel<T><<<grid, kThreads, L.bytes(), stream>>>(p, g, c, nullptr, dk_acc, dv_acc,
                                                                              packed_rows(p));
        check_launch("gsa sparse_backward_query_kernel");
      }
      store_key_grads(p, g, dk_acc, dv_acc);
      return;
    }
    DeviceBuffer delta(p, static_cast<std::size_t>(p.rows_q * p.heads_q) * sizeof(float));
    if (p.rows_q > 0 && tc) {
      dispatch_fused(p, TcSparseBackwardQuery{p, g, c, delta.as<float>(), nullptr, nullptr});
    } else if (p.rows_q > 0) {
      sparse_backward_query_kernel<T><<<grid, kThreads, L.bytes(), stream>>>(p, g, c, delta.as<float>(), nullptr, nullptr,
                                                                              packed_rows(p));
      check_launch("gsa sparse_backward_query_kernel");
    }
    // The (key row, query row) pairs sorted by key row, stably: each key's queries in order.
    const std::size_t n = static_cast<std::size_t>(total);
    DeviceBuffer pairs(p, 4 * n * sizeof(std::uint32_t));
    std::uint32_t* keys_in = pairs.as<std::uint32_t>();
    std::uint32_t *queries_in = keys_in + n, *keys_out = queries_in + n, *queries_out = keys_out + n;
    DeviceBuffer starts(p, static_cast<std::size_t>(p.rows_k + 1) * sizeof(std::int64_t));
    if (n > 0) {
      list_pairs_kernel<<<grid_for(total), 256, 0, stream>>>(p, c, keys_in, queries_in);
      check_launch("gsa list_pairs_kernel");
      int end_bit = 1;
      while ((std::uint64_t{1} << end_bit) <= static_cast<std::uint64_t>(p.rows_k)) ++end_bit;
      std::size_t temp_bytes = 0;
      check(cub::DeviceRadixSort::SortPairs(nullptr, temp_bytes, keys_in, keys_out, queries_in, queries_out,
                                            static_cast<int>(n), 0, end_bit, stream),
            "sizing the list sort");
      DeviceBuffer temp(p, temp_bytes);
      check(cub::DeviceRadixSort::SortPairs(temp.as<void>(), temp_bytes, keys_in, keys_out, queries_in, queries_out,
                                            static_cast<int>(n), 0, end_bit, stream),
            "sorting the lists by key");
    }
    pair_starts_kernel<<<grid_for(total + 1), 256, 0, stream>>>(keys_out, static_cast<std::int64_t>(n), p.rows_k,
                                                               starts.as<std::int64_t>());
    check_launch("gsa pair_starts_kernel");
    if (p.rows_k > 0) {
      sparse_backward_key_kernel<T><<<dim3(static_cast<unsigned>(p.rows_k), static_cast<unsigned>(p.heads_kv)), kThreads,
                                      0, stream>>>(p, g, queries_out, starts.as<std::int64_t>(), delta.as<float>());
      check_launch("gsa sparse_backward_key_kernel");
    }
  });
}

std::int64_t gsa_first_bad_list(const AttentionParams& p, const KeyListConfig& c) {
  if (p.rows_q == 0) return -1;
  const cudaStream_t stream = stream_of(p);
  DeviceBuffer flag(p, sizeof(unsigned long long));
  check(cudaMemsetAsync(flag.as<void>(), 0xff, sizeof(unsigned long long), stream), "clearing the list check");
  first_bad_list_kernel<<<grid_for(p.rows_q), 256, 0, stream>>>(p, c, flag.as<unsigned long long>());
  check_launch("gsa first_bad_list_kernel");
  unsigned long long first = 0;
  check(cudaMemcpyAsync(&first, flag.as<void>(), sizeof first, cudaMemcpyDeviceToHost, stream), "reading the list check");
  check(cudaStreamSynchronize(stream), "checking the key lists");
  return first == ~0ull ? -1 : static_cast<std::int64_t>(first);
}

}  // namespace winnow::cuda
