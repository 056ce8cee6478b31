// GSA's indexer loss on CUDA (winnow/gsa.h, indexer_loss_*; 003 section 6): per query row t,
// KL(p_t || softmax(I_t)) over the row's set S_t, p_t the attention heads' mean distribution.
//
// One kernel, three passes (IndexerLossPass). A block holds kRows consecutive query rows of one
// sequence, a warp per row, and walks the keys its last row can see in tiles of 32, a key per
// lane; the tile's keys (the indexer's key head and the attention's kv heads, widened to fp32)
// sit in shared memory for every row of the block. A row's set enters as a 32-bit mask per
// tile: every visible key, or the keys of its sorted list (each tile takes the list's next
// entries, so a list is read once). Per lane: the indexer's score (H_I dot products of d_I)
// and each attention head's logit (D). The passes:
//   stats: the log-sum-exps of the heads' logits and of the scores over S_t (warp reductions
//          per tile merged into a running max and sum);
//   loss:  sum_s p log p - p log q from those;
//   grads: dI = dloss_t (q - p) carried through term_slopes to the head weights and biases
//          (warp sums), the indexer queries (each row's warp adds its tile's share to its own
//          float32 row) and the indexer keys (the block sums its rows' shares per key, then one
//          atomic add per key and feature).
// CUDA cores and fp32 throughout. O(L) memory: no L x L matrix, the lists read in place.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <string>

#include "cuda/cuda.h"
#include "cuda/element_types.cuh"
#include "cuda/launch.h"
#include "cuda/tile/fragment.cuh"
#include "cuda/tile/smem_tile.cuh"
#include "math/gsa.h"

namespace winnow::cuda {
namespace {

using detail::AttentionParams;
using detail::IndexerLossConfig;

constexpr int kRows = 8;   // query rows per block, a warp each
constexpr int kTile = 32;  // keys per tile, a lane each
constexpr int kThreads = kRows * 32;
constexpr unsigned kFull = 0xffffffffu;

enum class IndexerLossPass { stats, loss, grads };

__device__ __forceinline__ float warp_sum(float x) {
  for (int o = 16; o > 0; o /= 2) x += __shfl_xor_sync(kFull, x, o);
  return x;
}
__device__ __forceinline__ float warp_max(float x) {
  for (int o = 16; o > 0; o /= 2) x = fmaxf(x, __shfl_xor_sync(kFull, x, o));
  return x;
}

// An odd row stride in floats, so that 32 lanes reading 32 rows at one feature hit 32 banks.
__host__ __device__ inline int odd_stride(std::int64_t n) { return static_cast<int>(n % 2 == 1 ? n : n + 1); }

// Shared memory, in floats, as offsets from the dynamic buffer's start.
struct LossLayout {
  int heads, kv_heads, dim, index_heads, index_dim;
  int stage_heads;  // kv heads staged at once
  int key_stride, index_key_stride;
  int q, iq, k, ik, dz, gate, stat_m, stat_l, acc_w, acc_b, total;

  LossLayout(const AttentionParams& p, const IndexerLossConfig& c, int stage)
      : heads(static_cast<int>(c.attention.heads_q)),
        kv_heads(static_cast<int>(c.attention.heads_kv)),
        dim(static_cast<int>(c.attention.dim_qk)),
        index_heads(static_cast<int>(p.heads_q)),
        index_dim(static_cast<int>(p.dim_qk)),
        stage_heads(stage),
        key_stride(odd_stride(c.attention.dim_qk)),
        index_key_stride(odd_stride(p.dim_qk)) {
    int at = 0;
    auto take = [&](int floats) {
      const int start = at;
      at += (floats + 3) / 4 * 4;  // 16-byte aligned regions
      return start;
    };
    q = take(kRows * heads * dim);
    iq = take(kRows * index_heads * index_dim);
    k = take(stage_heads * kTile * key_stride);
    ik = take(kTile * index_key_stride);
    dz = take(kRows * index_heads * kTile);
    gate = take(kRows * index_heads);
    stat_m = take(kRows * (heads + 1));
    stat_l = take(kRows * (heads + 1));
    acc_w = take(kRows * index_heads);
    acc_b = take(kRows * index_heads);
    total = at;
  }
  std::size_t bytes() const { return static_cast<std::size_t>(total) * sizeof(float); }
};

// <a, b> over n features, a a row of floats broadcast to the warp (16-byte aligned when n % 4
// == 0), b this lane's row.
__device__ __forceinline__ float dot_row(const float* a, const float* b, int n) {
  float acc = 0.f;
  if (n % 4 == 0) {
    for (int d = 0; d < n; d += 4) {
      const float4 x = *reinterpret_cast<const float4*>(a + d);
      acc = fmaf(x.x, b[d], acc);
      acc = fmaf(x.y, b[d + 1], acc);
      acc = fmaf(x.z, b[d + 2], acc);
      acc = fmaf(x.w, b[d + 3], acc);
    }
  } else {
    for (int d = 0; d < n; ++d) acc = fmaf(a[d], b[d], acc);
  }
  return acc;
}


// Merges a tile's values (lanes where `mine`) into a row's running max and sum of exp, held in
// shared memory and the same in every lane.
__device__ __forceinline__ void merge_tile(float* m_at, float* l_at, bool mine, float value, int lane) {
  const float x = mine ? value : -INFINITY;
  const float tile_max = warp_max(x);
  if (tile_max == -INFINITY) return;
  const float tile_sum = warp_sum(mine ? expf(x - tile_max) : 0.f);
  const float m = *m_at, m_new = fmaxf(m, tile_max);
  const float l = (m == -INFINITY ? 0.f : *l_at * expf(m - m_new)) + tile_sum * expf(tile_max - m_new);
  __syncwarp();
  if (lane == 0) {
    *m_at = m_new;
    *l_at = l;
  }
  __syncwarp();
}

template <class T, IndexerLossPass kPass>
__global__ void __launch_bounds__(kThreads, 2) indexer_loss_kernel(AttentionParams p, IndexerLossConfig c,
                                                                  LossLayout lay) {
  extern __shared__ __align__(16) float smem[];
  const AttentionParams& a = c.attention;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const std::int64_t b = blockIdx.y;
  const detail::SequenceExtent s = p.sequence(b);
  const std::int64_t blocks = (s.q_len + kRows - 1) / kRows;
  if (static_cast<std::int64_t>(blockIdx.x) >= blocks) return;
  // The last rows see the most keys: their blocks go first.
  const std::int64_t r0 = (blocks - 1 - blockIdx.x) * kRows;
  const std::int64_t r = r0 + warp;
  const bool active = r < s.q_len;
  const std::int64_t t = r + s.q_offset(), row = s.q_start + r;
  const std::int64_t last_key = (r0 + kRows < s.q_len ? r0 + kRows : s.q_len) - 1 + s.q_offset();
  const int H = lay.heads, HI = lay.index_heads, D = lay.dim, DI = lay.index_dim;
  const int group = H / lay.kv_heads;

  float* q_s = smem + lay.q;
  float* iq_s = smem + lay.iq;
  float* k_s = smem + lay.k;
  float* ik_s = smem + lay.ik;
  float* dz_s = smem + lay.dz + warp * HI * kTile;
  float* gate_s = smem + lay.gate + warp * HI;
  float* m_s = smem + lay.stat_m + warp * (H + 1);
  float* l_s = smem + lay.stat_l + warp * (H + 1);
  float* acc_w = smem + lay.acc_w + warp * HI;
  float* acc_b = smem + lay.acc_b + warp * HI;

  // The block's rows: attention queries, indexer queries, gates; zeros for rows past the end.
  // Each warp stages its own row: addresses once per head, lanes over features.
  for (int h = 0; h < H; ++h) {
    const T* src = active ? a.q.at<const T>(b, row, h) : nullptr;
    float* dst = q_s + (warp * H + h) * D;
    for (int d = lane; d < D; d += 32) dst[d] = src != nullptr ? widen(src[d * a.q.dim]) : 0.f;
  }
  for (int j = 0; j < HI; ++j) {
    const T* src = active ? p.q.at<const T>(b, row, j) : nullptr;
    float* dst = iq_s + (warp * HI + j) * DI;
    for (int d = lane; d < DI; d += 32) dst[d] = src != nullptr ? widen(src[d * p.q.dim]) : 0.f;
  }
  for (int j = lane; j < HI; j += 32) {
    gate_s[j] = active ? math::gsa::gate(c.form, widen(*c.weights.at<const T>(b, row, j))) : 0.f;
    acc_w[j] = 0.f;
    acc_b[j] = 0.f;
  }
  for (int h = lane; h <= H; h += 32) {
    if constexpr (kPass == IndexerLossPass::stats) {
      m_s[h] = -INFINITY;
      l_s[h] = 0.f;
    } else {
      m_s[h] = active ? static_cast<float>(c.lse.at<const float>(b, row, h)[0]) : -INFINITY;
    }
  }
  float grad_row = 0.f;  // dloss_t
  if constexpr (kPass == IndexerLossPass::grads) {
    if (active) {
      grad_row = *c.dloss.at<const float>(b, row, 0);
      for (int i = lane; i < HI * DI; i += 32) {
        c.dq.at<float>(b, row, i / DI)[(i % DI) * c.dq.dim] = 0.f;
      }
    }
  }
  // The row's list: `next` is its first entry not yet in a tile.
  const bool listed = c.has_lists();
  const std::int32_t* list = nullptr;
  std::int64_t list_slot = 0;
  int count = 0, next = 0;
  if (listed && active) {
    list = c.indices.at<const std::int32_t>(b, row, 0);
    list_slot = c.indices.head;
    count = *c.counts.at<const std::int32_t>(b, row, 0);
  }
  float loss_lane = 0.f;
  const float scale = static_cast<float>(p.scale), attention_scale = static_cast<float>(a.scale);
  const float inv_heads = 1.f / static_cast<float>(H);
  __syncthreads();

  for (std::int64_t k0 = 0; k0 <= last_key; k0 += kTile) {
    // This row's keys in the tile.
    unsigned mask = 0;
    if (active) {
      if (listed) {
        const int i = next + lane;
        const std::int32_t key = i < count ? list[i * list_slot] : -1;
        const bool here = key >= k0 && key < k0 + kTile;
        mask = __reduce_or_sync(kFull, here ? 1u << (key - k0) : 0u);
        next += __popc(mask);
      } else {
        mask = __ballot_sync(kFull, k0 + lane <= t);
      }
    }
    // Also the barrier after the previous tile's reads of the staged keys and of dz.
    if (!__syncthreads_or(mask != 0)) continue;
    const bool mine = (mask >> lane) & 1u;

    // A warp per staged key row, lanes over features: no index arithmetic per element.
    for (int key = warp; key < kTile; key += kRows) {
      const std::int64_t pos = k0 + key;
      const T* src = pos <= last_key ? p.k.at<const T>(b, s.k_start + pos, 0) : nullptr;
      float* dst = ik_s + key * lay.index_key_stride;
      for (int d = lane; d < DI; d += 32) dst[d] = src != nullptr ? widen(src[d * p.k.dim]) : 0.f;
    }

    float score = 0.f;  // I_ts of this lane's key
    float prob = 0.f;   // sum_h exp(logit_h - lse_h) (loss and grads)
    for (int g0 = 0; g0 < lay.kv_heads; g0 += lay.stage_heads) {
      const int staged = lay.kv_heads - g0 < lay.stage_heads ? lay.kv_heads - g0 : lay.stage_heads;
      if (g0 > 0) __syncthreads();
      for (int staged_row = warp; staged_row < staged * kTile; staged_row += kRows) {
        const int g = staged_row / kTile, key = staged_row % kTile;
        const std::int64_t pos = k0 + key;
        const T* src = pos <= last_key ? a.k.at<const T>(b, s.k_start + pos, g0 + g) : nullptr;
        float* dst = k_s + staged_row * lay.key_stride;
        for (int d = lane; d < D; d += 32) dst[d] = src != nullptr ? widen(src[d * a.k.dim]) : 0.f;
      }
      __syncthreads();
      if (mask == 0) continue;
      if (g0 == 0) {
        const float* ik = ik_s + lane * lay.index_key_stride;
        for (int j = 0; j < HI; ++j) {
          const float dot = dot_row(iq_s + (warp * HI + j) * DI, ik, DI) * scale;
          score += math::gsa::gated_term(c.form, gate_s[j], dot, c.bias_at<float>(j));
          if constexpr (kPass == IndexerLossPass::grads) dz_s[j * kTile + lane] = dot;
        }
      }
      for (int g = 0; g < staged; ++g) {
        const float* kr = k_s + (g * kTile + lane) * lay.key_stride;
        for (int h = (g0 + g) * group; h < (g0 + g + 1) * group; ++h) {
          const float logit = dot_row(q_s + (warp * H + h) * D, kr, D) * attention_scale;
          if constexpr (kPass == IndexerLossPass::stats) {
            merge_tile(m_s + h, l_s + h, mine, logit, lane);
          } else {
            prob += mine ? expf(logit - m_s[h]) : 0.f;
          }
        }
      }
    }

    if constexpr (kPass == IndexerLossPass::stats) {
      if (mask != 0) merge_tile(m_s + H, l_s + H, mine, score, lane);
    } else if constexpr (kPass == IndexerLossPass::loss) {
      if (mine) loss_lane += math::gsa::kl_term(prob * inv_heads, score - m_s[H]);
    } else {
      // dI, then each indexer head's share: dz (in place of its dot product) and the sums for
      // its weight and bias.
      const float dscore = mine ? grad_row * math::gsa::kl_score_slope(prob * inv_heads, score - m_s[H]) : 0.f;
      for (int j = 0; j < HI; ++j) {
        float dz = 0.f, dw = 0.f;
        if (mask != 0) {
          const math::gsa::TermSlopes<float> slope =
              math::gsa::term_slopes(c.form, gate_s[j], dz_s[j * kTile + lane], c.bias_at<float>(j));
          dz = dscore * slope.dot;
          dw = dscore * slope.weight;
          dw = warp_sum(dw);
          const float db = warp_sum(dz);
          if (lane == 0) {
            acc_w[j] += dw;
            acc_b[j] += db;
          }
        }
        dz_s[j * kTile + lane] = dz;
      }
      __syncthreads();
      // The row's indexer queries: lanes over (head, feature), the tile's keys summed.
      if (mask != 0) {
        for (int j = 0; j < HI; ++j) {
          const float* dzj = dz_s + j * kTile;
          float* dq = c.dq.at<float>(b, row, j);
          for (int d = lane; d < DI; d += 32) {
            float acc = 0.f;
            for (int key = 0; key < kTile; ++key) acc = fmaf(dzj[key], ik_s[key * lay.index_key_stride + d], acc);
            dq[d * c.dq.dim] += acc * scale;
          }
        }
      }
      // The tile's indexer keys: the block's rows and heads summed, one atomic per feature.
      const float* dz_all = smem + lay.dz;
      for (int key = warp; key < kTile && k0 + key <= last_key; key += kRows) {
        float* dk = c.dk.at<float>(b, s.k_start + k0 + key, 0);
        for (int d = lane; d < DI; d += 32) {
          float acc = 0.f;
          for (int w = 0; w < kRows; ++w) {
            for (int j = 0; j < HI; ++j) acc = fmaf(dz_all[(w * HI + j) * kTile + key], iq_s[(w * HI + j) * DI + d], acc);
          }
          if (acc != 0.f) atomicAdd(dk + d * c.dk.dim, acc * scale);
        }
      }
    }
  }

  // The row's results.
  if constexpr (kPass == IndexerLossPass::stats) {
    __syncwarp();
    if (active) {
      for (int h = lane; h <= H; h += 32) {
        c.lse.at<float>(b, row, h)[0] = l_s[h] > 0.f ? m_s[h] + logf(l_s[h]) : -INFINITY;
      }
    }
  } else if constexpr (kPass == IndexerLossPass::loss) {
    const float total = warp_sum(loss_lane);
    if (active && lane == 0) *p.stats.at<float>(b, row, 0) = total;
  } else {
    __syncwarp();
    if (active) {
      for (int j = lane; j < HI; j += 32) *c.dweights.at<float>(b, row, j) = acc_w[j];
    }
    if (c.dbias.data != nullptr) {
      __syncthreads();
      for (int j = threadIdx.x; j < HI; j += kThreads) {
        float sum = 0.f;
        for (int w = 0; w < kRows; ++w) sum += smem[lay.acc_b + w * HI + j];
        if (sum != 0.f) atomicAdd(static_cast<float*>(c.dbias.data) + j * c.dbias.head, sum);
      }
    }
  }
}

// ---- The same three passes on tensor cores, for bf16 inputs with head dimensions 64 or 128 and
// at most 8 heads of each kind (H D, H_I d_I and H_kv D at most 512). A block holds 64 query
// rows of one sequence, 16 per warp as an m16n8k16 A operand, and walks key tiles of 32 keys:
// the heads' logits and the indexer's dot products are tile products (fp32 sums of exact bf16
// products, as the CUDA-core kernel's), the element-wise terms are the shared math::gsa ones.
// The gradients' products take dz in two bf16 parts (hi + lo, ~16 bits of mantissa) so that
// dq and dk keep the CUDA-core kernel's accuracy; each warp adds its rows' dq into their rows
// (no other block writes them) and its dk share with atomics.
constexpr int kTcRows = 64, kTcKeys = 32, kTcWarps = 4, kTcMaxHeads = 8;
constexpr int kTcLossThreads = 32 * kTcWarps;

struct TcLossLayout {
  int heads, kv_heads, index_heads;
  std::size_t q, iq, k, ik, dz, rowstate, bytes;  // byte offsets
  template <int D, int DI>
  static TcLossLayout of(const AttentionParams& p, const IndexerLossConfig& c) {
    TcLossLayout l;
    l.heads = static_cast<int>(c.attention.heads_q);
    l.kv_heads = static_cast<int>(c.attention.heads_kv);
    l.index_heads = static_cast<int>(p.heads_q);
    std::size_t at = 0;
    auto take = [&](std::size_t elems) {
      const std::size_t start = at;
      at += elems * 2;
      return start;
    };
    l.q = take(static_cast<std::size_t>(l.heads) * kTcRows * D);
    l.iq = take(static_cast<std::size_t>(l.index_heads) * kTcRows * DI);
    l.k = take(static_cast<std::size_t>(l.kv_heads) * kTcKeys * D);
    l.ik = take(static_cast<std::size_t>(kTcKeys) * DI);
    l.dz = take(static_cast<std::size_t>(kTcWarps) * 2 * 16 * kTcKeys);
    // Per row, floats: the gates, the log-sum-exps (heads, then the indexer's), and the
    // gradients' row sums for the head weights and biases.
    l.rowstate = at;
    at += static_cast<std::size_t>(kTcRows) * (3 * l.index_heads + l.heads + 1) * sizeof(float);
    l.bytes = at;
    return l;
  }
};

// Whether the tensor-core passes take this call.
bool tc_loss_applies(const AttentionParams& p, const IndexerLossConfig& c) {
  const AttentionParams& a = c.attention;
  if (p.dtype != DType::bfloat16 || a.dtype != DType::bfloat16) return false;
  if ((a.dim_qk != 64 && a.dim_qk != 128) || (p.dim_qk != 64 && p.dim_qk != 128)) return false;
  if (a.heads_q > kTcMaxHeads || p.heads_q > kTcMaxHeads || a.heads_q % a.heads_kv != 0) return false;
  if (a.heads_q * a.dim_qk > 512 || p.heads_q * p.dim_qk > 512 || a.heads_kv * a.dim_qk > 512) return false;
  if (p.heads_kv != 1) return false;
  for (const detail::Operand* op : {&a.q, &a.k, &p.q, &p.k}) {
    if (!aligned_rows(*op, DType::bfloat16)) return false;
  }
  return std::getenv("WINNOW_GSA_LOSS_SCALAR") == nullptr;
}

// x as hi + lo, both bf16 (the products' A operands).
__device__ __forceinline__ void split_bf16(float x, float& hi, float& lo) {
  hi = __bfloat162float(__float2bfloat16_rn(x));
  lo = x - hi;
}

template <int D, int DI, IndexerLossPass kPass>
__global__ void __launch_bounds__(kTcLossThreads) indexer_loss_tc_kernel(AttentionParams p, IndexerLossConfig c,
                                                                          TcLossLayout lay) {
  using T = __nv_bfloat16;
  using QTile = tile::SmemTile<T, kTcRows, D>;
  using IQTile = tile::SmemTile<T, kTcRows, DI>;
  using KTile = tile::SmemTile<T, kTcKeys, D>;
  using IKTile = tile::SmemTile<T, kTcKeys, DI>;
  using DzTile = tile::SmemTile<T, 16, kTcKeys>;
  constexpr int NT = kTcKeys / 8;
  extern __shared__ __align__(128) unsigned char smem_raw[];
  const AttentionParams& a = c.attention;
  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32, g = lane / 4, tig = lane % 4;
  const std::int64_t b = blockIdx.y;
  const detail::SequenceExtent s = p.sequence(b);
  const std::int64_t blocks = (s.q_len + kTcRows - 1) / kTcRows;
  if (static_cast<std::int64_t>(blockIdx.x) >= blocks) return;
  const std::int64_t r0 = (blocks - 1 - blockIdx.x) * kTcRows;  // the last rows see the most keys: first
  const std::int64_t last_key = (r0 + kTcRows < s.q_len ? r0 + kTcRows : s.q_len) - 1 + s.q_offset();
  const int H = lay.heads, HI = lay.index_heads, group = lay.heads / lay.kv_heads;
  auto q_tile = [&](int h) { return QTile{reinterpret_cast<T*>(smem_raw + lay.q) + h * kTcRows * D}; };
  auto iq_tile = [&](int j) { return IQTile{reinterpret_cast<T*>(smem_raw + lay.iq) + j * kTcRows * DI}; };
  auto k_tile = [&](int hk) { return KTile{reinterpret_cast<T*>(smem_raw + lay.k) + hk * kTcKeys * D}; };
  const IKTile ik_tile{reinterpret_cast<T*>(smem_raw + lay.ik)};
  const DzTile dz_hi{reinterpret_cast<T*>(smem_raw + lay.dz) + warp * 2 * 16 * kTcKeys};
  const DzTile dz_lo{reinterpret_cast<T*>(smem_raw + lay.dz) + (warp * 2 + 1) * 16 * kTcKeys};

  // The block's query rows (zeros past the sequence).
  for (int h = 0; h < H; ++h) {
    q_tile(h).template load_async<kTcLossThreads>(tid, [&](int r) -> const T* {
      return r0 + r < s.q_len ? a.q.at<const T>(b, s.q_start + r0 + r, h) : nullptr;
    });
  }
  for (int j = 0; j < HI; ++j) {
    iq_tile(j).template load_async<kTcLossThreads>(tid, [&](int r) -> const T* {
      return r0 + r < s.q_len ? p.q.at<const T>(b, s.q_start + r0 + r, j) : nullptr;
    });
  }
  tile::cp_async_commit();

  // Per-row state in shared memory (block row i): gates, log-sum-exps, and the row sums of the
  // gradients for the head weights and biases (added by each row's quad, so never contended).
  float* const gate_s = reinterpret_cast<float*>(smem_raw + lay.rowstate);
  float* const lse_s = gate_s + kTcRows * HI;  // [row][H + 1]
  float* const dw_s = lse_s + kTcRows * (H + 1);
  float* const db_s = dw_s + kTcRows * HI;
  for (int e = tid; e < kTcRows * HI; e += kTcLossThreads) {
    const std::int64_t r = r0 + e / HI;
    gate_s[e] = r < s.q_len ? math::gsa::gate(c.form, widen(*c.weights.at<const T>(b, s.q_start + r, e % HI))) : 0.f;
    dw_s[e] = 0.f;
    db_s[e] = 0.f;
  }
  if constexpr (kPass != IndexerLossPass::stats) {
    for (int e = tid; e < kTcRows * (H + 1); e += kTcLossThreads) {
      const std::int64_t r = r0 + e / (H + 1);
      lse_s[e] = r < s.q_len ? static_cast<float>(c.lse.at<const float>(b, s.q_start + r, e % (H + 1))[0]) : 0.f;
    }
  }

  // This thread's rows: g and g + 8 of the warp's 16 (half 0 and 1); block rows brow[half].
  const std::int64_t wrow0 = r0 + 16 * warp;
  bool active[2];
  std::int64_t row[2];
  int brow[2];
  float m[kTcMaxHeads + 1][2], l[kTcMaxHeads + 1][2];  // the statistics pass's running max and sum
  float grad_row[2] = {0.f, 0.f}, loss_part[2] = {0.f, 0.f};
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const std::int64_t r = wrow0 + g + 8 * half;
    active[half] = r < s.q_len;
    row[half] = s.q_start + r;
    brow[half] = 16 * warp + g + 8 * half;
#pragma unroll
    for (int h = 0; h <= kTcMaxHeads; ++h) {
      m[h][half] = -INFINITY;
      l[h][half] = 0.f;
    }
    if constexpr (kPass == IndexerLossPass::grads) {
      if (active[half]) grad_row[half] = *c.dloss.at<const float>(b, row[half], 0);
    }
  }
  auto gate_of = [&](int j, int half) { return gate_s[brow[half] * HI + j]; };
  auto lse_of = [&](int h, int half) { return lse_s[brow[half] * (H + 1) + h]; };  // h = H: the indexer's
  if constexpr (kPass == IndexerLossPass::grads) {
    // This warp's rows' dq start from zero (only this warp adds into them).
    for (int i = 0; i < 16; ++i) {
      const std::int64_t r = wrow0 + i;
      if (r >= s.q_len) break;
      for (int e = lane; e < HI * DI; e += 32) c.dq.at<float>(b, s.q_start + r, e / DI)[(e % DI) * c.dq.dim] = 0.f;
    }
    __syncwarp();
  }
  // Row i of the warp's 16: lane i holds its list position (the first entry not yet in a tile).
  const bool listed = c.has_lists();
  int next = 0, count = 0;
  if (listed && lane < 16 && wrow0 + lane < s.q_len) count = *c.counts.at<const std::int32_t>(b, s.q_start + wrow0 + lane, 0);

  const float scale = static_cast<float>(p.scale), attention_scale = static_cast<float>(a.scale);
  const float inv_heads = 1.f / static_cast<float>(H);
  tile::cp_async_wait<0>();
  __syncthreads();

  for (std::int64_t k0 = 0; k0 <= last_key; k0 += kTcKeys) {
    // The warp's rows' sets in this tile, as 32-bit masks; this thread keeps rows g and g + 8.
    unsigned mask[2] = {0u, 0u};
    for (int i = 0; i < 16; ++i) {
      const std::int64_t r = wrow0 + i;
      unsigned mi = 0u;
      if (r < s.q_len) {
        if (listed) {
          const int at = __shfl_sync(0xffffffffu, next, i) + lane;
          const int n_i = __shfl_sync(0xffffffffu, count, i);
          const std::int32_t key = at < n_i ? c.indices.at<const std::int32_t>(b, s.q_start + r, 0)[at * c.indices.head] : -1;
          const bool here = key >= k0 && key < k0 + kTcKeys;
          mi = __reduce_or_sync(0xffffffffu, here ? 1u << (key - k0) : 0u);
          if (lane == i) next += __popc(mi);
        } else {
          const std::int64_t t = r + s.q_offset();
          mi = t >= k0 + kTcKeys - 1 ? 0xffffffffu : (t < k0 ? 0u : (2u << (t - k0)) - 1u);
        }
      }
      if ((i & 7) == g) mask[i >> 3] = mi;
    }
    const bool any = (mask[0] | mask[1]) != 0u;
    // Also the barrier after the previous tile's reads of the staged keys.
    if (!__syncthreads_or(any)) continue;
    for (int hk = 0; hk < lay.kv_heads; ++hk) {
      k_tile(hk).template load_async<kTcLossThreads>(tid, [&](int r) -> const T* {
        return k0 + r <= last_key ? a.k.at<const T>(b, s.k_start + k0 + r, hk) : nullptr;
      });
    }
    ik_tile.template load_async<kTcLossThreads>(tid, [&](int r) -> const T* {
      return k0 + r <= last_key ? p.k.at<const T>(b, s.k_start + k0 + r, 0) : nullptr;
    });
    tile::cp_async_commit();
    tile::cp_async_wait<0>();
    __syncthreads();
    if (!__any_sync(0xffffffffu, any)) continue;
    auto mine = [&](int n, int e) { return ((mask[e / 2] >> (8 * n + 2 * tig + (e % 2))) & 1u) != 0u; };
    // The statistics pass's online log-sum-exp of a row half's listed values (value(n, e)),
    // into its running max and sum; the quad holds the row's 32 keys.
    auto add_to_lse = [&](float& m_row, float& l_row, int half, auto value) {
      float top = -INFINITY;
#pragma unroll
      for (int n = 0; n < NT; ++n) {
#pragma unroll
        for (int e = 2 * half; e < 2 * half + 2; ++e) {
          if (mine(n, e)) top = fmaxf(top, value(n, e));
        }
      }
      top = fmaxf(top, __shfl_xor_sync(0xffffffffu, top, 1));
      top = fmaxf(top, __shfl_xor_sync(0xffffffffu, top, 2));
      if (top == -INFINITY) return;
      const float m_new = fmaxf(m_row, top);
      float sum = 0.f;
#pragma unroll
      for (int n = 0; n < NT; ++n) {
#pragma unroll
        for (int e = 2 * half; e < 2 * half + 2; ++e) {
          if (mine(n, e)) sum += expf(value(n, e) - m_new);
        }
      }
      l_row = (m_row == -INFINITY ? 0.f : l_row * expf(m_row - m_new)) + sum;
      m_row = m_new;
    };

    // The heads' logits: statistics, or the heads' mean probability of each key.
    float prob[NT][4] = {};
    for (int h = 0; h < H; ++h) {
      float x[NT][4];
      tile::zero(x);
      tile::mma_smem_a_b_rows<T, D / 16, NT>(x, q_tile(h), 16 * warp, k_tile(h / group), 0, lane);
#pragma unroll
      for (int hh = 0; hh < kTcMaxHeads; ++hh) {  // registers indexed by compile-time heads
        if (hh != h) continue;
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          if constexpr (kPass == IndexerLossPass::stats) {
            add_to_lse(m[hh][half], l[hh][half], half, [&](int n, int e) { return x[n][e] * attention_scale; });
          } else {
#pragma unroll
            for (int n = 0; n < NT; ++n) {
#pragma unroll
              for (int e = 2 * half; e < 2 * half + 2; ++e) {
                if (mine(n, e)) prob[n][e] += expf(x[n][e] * attention_scale - lse_of(h, half));
              }
            }
          }
        }
      }
    }

    // The indexer's scores.
    float score[NT][4] = {};
    for (int j = 0; j < HI; ++j) {
      float z[NT][4];
      tile::zero(z);
      tile::mma_smem_a_b_rows<T, DI / 16, NT>(z, iq_tile(j), 16 * warp, ik_tile, 0, lane);
      const float bias = c.bias_at<float>(j);
#pragma unroll
      for (int n = 0; n < NT; ++n) {
#pragma unroll
        for (int e = 0; e < 4; ++e) score[n][e] += math::gsa::gated_term(c.form, gate_of(j, e / 2), z[n][e] * scale, bias);
      }
    }
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      if constexpr (kPass == IndexerLossPass::stats) {
        add_to_lse(m[kTcMaxHeads][half], l[kTcMaxHeads][half], half, [&](int n, int e) { return score[n][e]; });
      }
    }
    if constexpr (kPass == IndexerLossPass::loss) {
#pragma unroll
      for (int n = 0; n < NT; ++n) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          if (mine(n, e)) loss_part[e / 2] += math::gsa::kl_term(prob[n][e] * inv_heads, score[n][e] - lse_of(H, e / 2));
        }
      }
    }
    if constexpr (kPass == IndexerLossPass::grads) {
      float dscore[NT][4];
#pragma unroll
      for (int n = 0; n < NT; ++n) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          dscore[n][e] = mine(n, e) ? grad_row[e / 2] * math::gsa::kl_score_slope(prob[n][e] * inv_heads,
                                                                                  score[n][e] - lse_of(H, e / 2))
                                    : 0.f;
        }
      }
      for (int j = 0; j < HI; ++j) {
        float z[NT][4];
        tile::zero(z);
        tile::mma_smem_a_b_rows<T, DI / 16, NT>(z, iq_tile(j), 16 * warp, ik_tile, 0, lane);
        const float bias = c.bias_at<float>(j);
        float hi[NT][4], lo[NT][4], dw_part[2] = {0.f, 0.f}, db_part[2] = {0.f, 0.f};
#pragma unroll
        for (int n = 0; n < NT; ++n) {
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const math::gsa::TermSlopes<float> slope =
                math::gsa::term_slopes(c.form, gate_of(j, e / 2), z[n][e] * scale, bias);
            const float dz = dscore[n][e] * slope.dot;
            dw_part[e / 2] += dscore[n][e] * slope.weight;
            db_part[e / 2] += dz;
            split_bf16(dz * scale, hi[n][e], lo[n][e]);
          }
        }
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          float w = dw_part[half], d = db_part[half];
          w += __shfl_xor_sync(0xffffffffu, w, 1);
          w += __shfl_xor_sync(0xffffffffu, w, 2);
          d += __shfl_xor_sync(0xffffffffu, d, 1);
          d += __shfl_xor_sync(0xffffffffu, d, 2);
          if (tig == 0) {
            dw_s[brow[half] * HI + j] += w;
            db_s[brow[half] * HI + j] += d;
          }
        }
        // dq of the warp's rows: (dz scale) K_I, both parts.
        std::uint32_t a_hi[NT / 2][4], a_lo[NT / 2][4];
        tile::to_operand<T, NT / 2>(hi, a_hi);
        tile::to_operand<T, NT / 2>(lo, a_lo);
        float dq[DI / 8][4];
        tile::zero(dq);
        tile::mma_b_cols<T, DI / 8, NT / 2>(dq, a_hi, ik_tile, 0, lane);
        tile::mma_b_cols<T, DI / 8, NT / 2>(dq, a_lo, ik_tile, 0, lane);
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          if (!active[half]) continue;
          float* out = c.dq.at<float>(b, row[half], j);
#pragma unroll
          for (int n = 0; n < DI / 8; ++n) {
            out[(8 * n + 2 * tig) * c.dq.dim] += dq[n][2 * half];
            out[(8 * n + 2 * tig + 1) * c.dq.dim] += dq[n][2 * half + 1];
          }
        }
        // dk of the tile's keys: (dz scale)^T of the warp's rows times their indexer queries.
#pragma unroll
        for (int n = 0; n < NT; ++n) {
          dz_hi.store_c(hi[n], 0, 8 * n, lane);
          dz_lo.store_c(lo[n], 0, 8 * n, lane);
        }
        __syncwarp();
#pragma unroll
        for (int mk = 0; mk < kTcKeys / 16; ++mk) {
          std::uint32_t th[4], tl[4];
          dz_hi.a_cols(th, 16 * mk, 0, lane);
          dz_lo.a_cols(tl, 16 * mk, 0, lane);
          float dk[DI / 8][4];
          tile::zero(dk);
#pragma unroll
          for (int np = 0; np < DI / 16; ++np) {
            std::uint32_t bq[4];
            iq_tile(j).b_cols(bq, 16 * warp, 16 * np, lane);
            tile::mma_16816<T>(dk[2 * np], th, bq[0], bq[1]);
            tile::mma_16816<T>(dk[2 * np + 1], th, bq[2], bq[3]);
            tile::mma_16816<T>(dk[2 * np], tl, bq[0], bq[1]);
            tile::mma_16816<T>(dk[2 * np + 1], tl, bq[2], bq[3]);
          }
#pragma unroll
          for (int half = 0; half < 2; ++half) {
            const std::int64_t key = k0 + 16 * mk + g + 8 * half;
            if (key > last_key) continue;
            float* out = c.dk.at<float>(b, s.k_start + key, 0);
#pragma unroll
            for (int n = 0; n < DI / 8; ++n) {
              const float x0 = dk[n][2 * half], x1 = dk[n][2 * half + 1];
              if (x0 != 0.f) atomicAdd(out + (8 * n + 2 * tig) * c.dk.dim, x0);
              if (x1 != 0.f) atomicAdd(out + (8 * n + 2 * tig + 1) * c.dk.dim, x1);
            }
          }
        }
        __syncwarp();
      }
    }
  }

  // The rows' results.
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    if constexpr (kPass == IndexerLossPass::stats) {
#pragma unroll
      for (int h = 0; h <= kTcMaxHeads; ++h) {
        float sum = l[h][half];
        sum += __shfl_xor_sync(0xffffffffu, sum, 1);
        sum += __shfl_xor_sync(0xffffffffu, sum, 2);
        const int column = h < kTcMaxHeads ? h : H;
        if (active[half] && tig == 0 && (h < H || h == kTcMaxHeads)) {
          c.lse.at<float>(b, row[half], column)[0] = sum > 0.f ? m[h][half] + logf(sum) : -INFINITY;
        }
      }
    } else if constexpr (kPass == IndexerLossPass::loss) {
      float sum = loss_part[half];
      sum += __shfl_xor_sync(0xffffffffu, sum, 1);
      sum += __shfl_xor_sync(0xffffffffu, sum, 2);
      if (active[half] && tig == 0) *p.stats.at<float>(b, row[half], 0) = sum;
    }
  }
  if constexpr (kPass == IndexerLossPass::grads) {
    __syncthreads();
    for (int e = tid; e < kTcRows * HI; e += kTcLossThreads) {
      const std::int64_t r = r0 + e / HI;
      if (r < s.q_len) *c.dweights.at<float>(b, s.q_start + r, e % HI) = dw_s[e];
    }
    if (c.dbias.data != nullptr) {
      for (int j = tid; j < HI; j += kTcLossThreads) {
        float sum = 0.f;
        for (int r = 0; r < kTcRows; ++r) sum += db_s[r * HI + j];
        if (sum != 0.f) atomicAdd(static_cast<float*>(c.dbias.data) + j * c.dbias.head, sum);
      }
    }
  }
}

__global__ void zero_key_grads_kernel(AttentionParams p, IndexerLossConfig c) {
  const std::int64_t total = p.rows_k * p.dim_qk;
  for (std::int64_t i = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; i < total;
       i += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    const std::int64_t rk = i / p.dim_qk, d = i % p.dim_qk;
    // Batched keys are (B, Lk): row rk of the flattened rows is (rk / Lk, rk % Lk).
    const std::int64_t bb = p.cu_seqlens_k != nullptr ? 0 : rk / p.len_k;
    const std::int64_t kr = p.cu_seqlens_k != nullptr ? rk : rk % p.len_k;
    c.dk.at<float>(bb, kr, 0)[d * c.dk.dim] = 0.f;
  }
  if (blockIdx.x == 0 && c.dbias.data != nullptr) {
    for (std::int64_t j = threadIdx.x; j < p.heads_q; j += blockDim.x) {
      static_cast<float*>(c.dbias.data)[j * c.dbias.head] = 0.f;
    }
  }
}

// The smallest stage of kv heads fits everything but the staged keys; stage as many as fit.
LossLayout layout_for(const AttentionParams& p, const IndexerLossConfig& c, const char* op) {
  int device = 0, limit = 0;
  check(cudaGetDevice(&device), "reading the current device");
  check(cudaDeviceGetAttribute(&limit, cudaDevAttrMaxSharedMemoryPerBlockOptin, device),
        "reading the shared memory limit");
  // Up to half the multiprocessor's shared memory, so that two blocks share one.
  const std::size_t budget = static_cast<std::size_t>(limit) / 2;
  const int kv = static_cast<int>(c.attention.heads_kv);
  LossLayout lay(p, c, 1);
  if (lay.bytes() > static_cast<std::size_t>(limit)) {
    throw Error(ErrorKind::unsupported,
                std::string(op) + ": the CUDA kernel holds 8 query rows' queries (attention " +
                    std::to_string(c.attention.heads_q) + " x " + std::to_string(c.attention.dim_qk) +
                    ", indexer " + std::to_string(p.heads_q) + " x " + std::to_string(p.dim_qk) +
                    ") in shared memory: " + std::to_string(lay.bytes()) + " bytes, more than the device's " +
                    std::to_string(limit));
  }
  for (int stage = kv; stage > 1; --stage) {
    const LossLayout wide(p, c, stage);
    if (wide.bytes() <= budget) return wide;
  }
  return lay;
}

template <int D, int DI, IndexerLossPass kPass>
void launch_tc_pass(const AttentionParams& p, const IndexerLossConfig& c) {
  const TcLossLayout lay = TcLossLayout::of<D, DI>(p, c);
  const dim3 grid(static_cast<unsigned>((p.max_len_q + kTcRows - 1) / kTcRows), static_cast<unsigned>(p.num_seqs));
  if (grid.x == 0 || grid.y == 0) return;
  const auto kernel = indexer_loss_tc_kernel<D, DI, kPass>;
  check(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(lay.bytes)),
        "raising the indexer loss kernel's shared memory");
  kernel<<<grid, kTcLossThreads, lay.bytes, stream_of(p)>>>(p, c, lay);
  check_launch("gsa indexer_loss_tc_kernel");
}

template <IndexerLossPass kPass>
void launch_pass(const AttentionParams& p, const IndexerLossConfig& c, const LossLayout& lay) {
  if (p.num_seqs > 65535) {
    throw Error(ErrorKind::unsupported, "winnow::gsa::indexer_loss: the CUDA kernels take at most 65535 sequences, got " +
                                            std::to_string(p.num_seqs));
  }
  if (tc_loss_applies(p, c)) {
    const bool d64 = c.attention.dim_qk == 64, di64 = p.dim_qk == 64;
    if (d64 && di64) return launch_tc_pass<64, 64, kPass>(p, c);
    if (d64) return launch_tc_pass<64, 128, kPass>(p, c);
    if (di64) return launch_tc_pass<128, 64, kPass>(p, c);
    return launch_tc_pass<128, 128, kPass>(p, c);
  }
  const dim3 grid(static_cast<unsigned>((p.max_len_q + kRows - 1) / kRows), static_cast<unsigned>(p.num_seqs));
  if (grid.x == 0 || grid.y == 0) return;
  const int bytes = static_cast<int>(lay.bytes());
  auto run = [&](auto kernel) {
    check(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes),
          "raising the indexer loss kernel's shared memory");
    kernel<<<grid, kThreads, bytes, stream_of(p)>>>(p, c, lay);
    check_launch("gsa indexer_loss_kernel");
  };
  switch (p.dtype) {
    case DType::bfloat16: return run(indexer_loss_kernel<__nv_bfloat16, kPass>);
    case DType::float16: return run(indexer_loss_kernel<__half, kPass>);
    default: return run(indexer_loss_kernel<float, kPass>);
  }
}

}  // namespace

void gsa_indexer_loss_forward(const AttentionParams& p, const IndexerLossConfig& c) {
  if (p.rows_q == 0) return;
  const LossLayout lay = layout_for(p, c, "winnow::gsa::indexer_loss_forward");
  launch_pass<IndexerLossPass::stats>(p, c, lay);
  launch_pass<IndexerLossPass::loss>(p, c, lay);
}

void gsa_indexer_loss_backward(const AttentionParams& p, const IndexerLossConfig& c) {
  const LossLayout lay = layout_for(p, c, "winnow::gsa::indexer_loss_backward");
  if (p.rows_k > 0) {
    const std::int64_t total = p.rows_k * p.dim_qk;
    const unsigned blocks = static_cast<unsigned>(std::min<std::int64_t>((total + 255) / 256, 4096));
    zero_key_grads_kernel<<<blocks, 256, 0, stream_of(p)>>>(p, c);
    check_launch("gsa zero_key_grads_kernel");
  }
  if (p.rows_q == 0) return;
  launch_pass<IndexerLossPass::grads>(p, c, lay);
}

}  // namespace winnow::cuda
