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
#include <string>

#include "cuda/cuda.h"
#include "cuda/element_types.cuh"
#include "cuda/launch.h"
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

template <IndexerLossPass kPass>
void launch_pass(const AttentionParams& p, const IndexerLossConfig& c, const LossLayout& lay) {
  if (p.num_seqs > 65535) {
    throw Error(ErrorKind::unsupported, "winnow::gsa::indexer_loss: the CUDA kernels take at most 65535 sequences, got " +
                                            std::to_string(p.num_seqs));
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
