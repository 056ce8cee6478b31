// Multiscreen's screening on CUDA. A call first writes each query and key unit-normalized and
// rotated by MiPE (keys once per query head, as the rotation is the head's), and each value
// unit-normalized, with the inverse norms the backward needs.
//
// Fused path (16-bit inputs, one kv head per query head, d_K 16 / 32 / 64, d_V 64 / 128): those
// rows in the input dtype, then the portable fused kernels (mma.sync) with the screening row
// policies (attention/screening_rows.cuh), which visit only the key tiles that meet the
// block's windows. The backward's dO is dL/dh (TanhNorm's Jacobian applied by a warp per row);
// its key gradients come back through MiPE and the normalization from the fp32 accumulators,
// adding the keys' share of d/d rate.
//
// Simple path (everything else: float32, grouped heads, other head dimensions up to
// kMaxScreeningDim, unaligned outputs): the rows in fp32; a thread per (query row, head) walks
// only the keys of its window: the forward sums R_ij vn_j and applies TanhNorm; the backward's
// query side recomputes R and gives dq with each row's share of ds_w and ds_r; its key side, a
// thread per (key row, query head), walks the queries whose window holds the key and gives dk
// and dv. Deterministic: per-head sums and the group's sum of key gradients are reduced in a
// fixed order (the fused backward's accumulators follow ExecContext::deterministic).
#include <cub/block/block_reduce.cuh>

#include <cstdlib>
#include <type_traits>

#include "cuda/attention/screening_rows.cuh"
#include "cuda/attention/simple.cuh"
#include "cuda/cuda.h"
#include "cuda/launch_attention.cuh"
#include "math/elementwise.h"
#include "math/screening.h"

namespace winnow::cuda {
namespace {

using detail::AttentionParams;
using detail::GradientParams;
using detail::Operand;
using detail::ScreeningConfig;

constexpr int kThreads = 128;
constexpr int kMaxScreeningDim = static_cast<int>(detail::kMaxScreeningCudaDim);
constexpr int kWarpsPerBlock = kThreads / 32;

// (sequence, row within it) of a row over the whole batch.
struct RowAt {
  std::int64_t b, r;
};
__device__ RowAt locate(const AttentionParams& p, std::int64_t batch_row, bool query) {
  const std::int32_t* cu = query ? p.cu_seqlens_q : p.cu_seqlens_k;
  if (cu == nullptr) {
    const std::int64_t len = query ? p.len_q : p.len_k;
    return {batch_row / len, batch_row % len};
  }
  // The last sequence starting at or before the row (empty sequences start where the next does).
  std::int64_t lo = 0, hi = p.num_seqs;
  while (hi - lo > 1) {
    const std::int64_t mid = (lo + hi) / 2;
    if (cu[mid] <= batch_row) {
      lo = mid;
    } else {
      hi = mid;
    }
  }
  return {lo, batch_row - cu[lo]};
}

// Head constants in double: angles are formed from positions that reach 10^5 and more.
__device__ ms::Head<double> head_of(const ScreeningConfig& cfg, std::int64_t h) {
  return {static_cast<double>(cfg.s_w_at<float>(h)), static_cast<double>(cfg.s_r_at<float>(h)),
          cfg.mipe_threshold, cfg.expand_above};
}

// The rows a call works on, [batch row][head][dim], carved from one buffer: stored as S (fp32 for
// the simple path, the input dtype for the fused kernels), inverse norms in fp32.
template <class S>
struct UnitRows {
  S *qn, *qm;   // queries: normalized, rotated (per query head)
  S *kn, *km;   // keys: normalized (per kv head), rotated per query head
  S *vn;        // values (per kv head)
  float *q_inv, *k_inv, *v_inv;  // negated where the norm was clipped at eps

  static std::size_t rows(const AttentionParams& p) {
    const std::size_t q = static_cast<std::size_t>(p.rows_q * p.heads_q);
    const std::size_t kq = static_cast<std::size_t>(p.rows_k * p.heads_q);
    const std::size_t kv = static_cast<std::size_t>(p.rows_k * p.heads_kv);
    return q * 2 * p.dim_qk + kq * p.dim_qk + kv * (p.dim_qk + p.dim_v);
  }
  static std::size_t norms(const AttentionParams& p) {
    return static_cast<std::size_t>(p.rows_q * p.heads_q + 2 * p.rows_k * p.heads_kv);
  }
  // Bytes of a buffer holding both, the rows first (16-byte aligned sizes keep every part so).
  static std::size_t bytes(const AttentionParams& p) { return rows(p) * sizeof(S) + norms(p) * sizeof(float); }
  UnitRows(const AttentionParams& p, void* base) {
    const std::size_t q = static_cast<std::size_t>(p.rows_q * p.heads_q);
    const std::size_t kq = static_cast<std::size_t>(p.rows_k * p.heads_q);
    const std::size_t kv = static_cast<std::size_t>(p.rows_k * p.heads_kv);
    qn = static_cast<S*>(base);
    qm = qn + q * p.dim_qk;
    km = qm + q * p.dim_qk;
    kn = km + kq * p.dim_qk;
    vn = kn + kv * p.dim_qk;
    q_inv = reinterpret_cast<float*>(vn + kv * p.dim_v);
    k_inv = q_inv + q;
    v_inv = k_inv + kv;
  }
};

// One thread's row x / max(|x|, eps) into unit (when not null) and, rotated by MiPE's (sn, cs)
// in coordinates 0 and 1, into rotated (when not null); returns the inverse norm, negated where
// the norm was clipped at eps.
template <class T, class S>
__device__ float unit_row(const T* x, std::int64_t stride, int dim, float eps, S* unit, S* rotated, float sn,
                          float cs) {
  float sum = 0.f;
  for (int d = 0; d < dim; ++d) {
    const float v = simple::load(x + d * stride);
    sum += v * v;
  }
  const float inv = math::inverse_norm(sum, eps);
  for (int d = 0; d < dim; ++d) {
    const float v = simple::load(x + d * stride) * inv;
    if (unit != nullptr) unit[d] = simple::from_float<S>(v);
    if (rotated != nullptr && d >= 2) rotated[d] = simple::from_float<S>(v);
  }
  if (rotated != nullptr) {
    const float x0 = simple::load(x) * inv, x1 = simple::load(x + stride) * inv;
    rotated[0] = simple::from_float<S>(x0 * cs - x1 * sn);
    rotated[1] = simple::from_float<S>(x0 * sn + x1 * cs);
  }
  return math::norm_clipped(sum, eps) ? -inv : inv;
}

// A thread per (query row, query head): qm, q_inv and (for the backward) qn.
template <class T, class S>
__global__ void prepare_queries_kernel(const AttentionParams p, const ScreeningConfig cfg,
                                       const ms::Head<double>* heads, const UnitRows<S> u, bool backward) {
  const std::int64_t idx = static_cast<std::int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  if (idx >= p.rows_q * p.heads_q) return;
  const int dk = static_cast<int>(p.dim_qk);
  const std::int64_t row = idx / p.heads_q, h = idx % p.heads_q;
  const RowAt at = locate(p, row, true);
  const detail::SequenceExtent s = p.sequence(at.b);
  float sn, cs;
  mipe_sincos(at.r + s.q_offset(), heads[h].rate, &sn, &cs);
  u.q_inv[idx] = unit_row(p.q.at<const T>(at.b, s.q_start + at.r, h), p.q.dim, dk, static_cast<float>(cfg.norm_eps),
                          backward ? u.qn + idx * dk : nullptr, u.qm + idx * dk, sn, cs);
}

// A thread per (key row, query head): km for the head; the group's first head also writes vn,
// v_inv, k_inv and (for the backward) kn of the kv head.
template <class T, class S>
__global__ void prepare_keys_kernel(const AttentionParams p, const ScreeningConfig cfg,
                                    const ms::Head<double>* heads, const UnitRows<S> u, bool backward) {
  const std::int64_t idx = static_cast<std::int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  if (idx >= p.rows_k * p.heads_q) return;
  const int dk = static_cast<int>(p.dim_qk), dv = static_cast<int>(p.dim_v);
  const std::int64_t row = idx / p.heads_q, h = idx % p.heads_q, hk = p.kv_head(h);
  const RowAt at = locate(p, row, false);
  const detail::SequenceExtent s = p.sequence(at.b);
  const std::int64_t kv_idx = row * p.heads_kv + hk;
  const bool first = h % p.group_size() == 0;
  const float eps = static_cast<float>(cfg.norm_eps);
  float sn, cs;
  mipe_sincos(at.r, heads[h].rate, &sn, &cs);
  const float k_inv = unit_row(p.k.at<const T>(at.b, s.k_start + at.r, hk), p.k.dim, dk, eps,
                               first && backward ? u.kn + kv_idx * dk : nullptr, u.km + idx * dk, sn, cs);
  if (!first) return;
  u.k_inv[kv_idx] = k_inv;
  u.v_inv[kv_idx] = unit_row(p.v.at<const T>(at.b, s.k_start + at.r, hk), p.v.dim, dv, eps, u.vn + kv_idx * dv,
                             static_cast<S*>(nullptr), 0.f, 1.f);
}

// One query row's view of its head: position, window and the key range it visits.
struct QueryRow {
  std::int64_t b, h, hk, i, q_row;  // q_row: batch row of the query
  detail::SequenceExtent s;
  ms::Head<double> hd;
  float w, r;
  std::int64_t first, last;  // keys visited (positions)

  __device__ QueryRow(const AttentionParams& p, const ms::Head<double>* heads, std::int64_t idx)
      : h(idx % p.heads_q), hk(p.kv_head(idx % p.heads_q)), q_row(idx / p.heads_q), hd(heads[idx % p.heads_q]) {
    const RowAt at = locate(p, q_row, true);
    b = at.b;
    s = p.sequence(b);
    i = at.r + s.q_offset();
    w = static_cast<float>(hd.w);
    r = static_cast<float>(hd.r);
    first = ms::first_key(i, hd.w, hd.infinite);
    last = i < s.k_len - 1 ? i : s.k_len - 1;
  }
  __device__ std::int64_t key_row(const AttentionParams& p, std::int64_t j) const {
    return p.batch_row_k(b, s.k_start + j);
  }
};

__device__ __forceinline__ float dot(const float* a, const float* b, int n) {
  float s = 0.f;
  for (int d = 0; d < n; ++d) s += a[d] * b[d];
  return s;
}

// A thread per (query row, query head): h = sum_j R_ij vn_j over the window, then TanhNorm.
template <class T>
__global__ void __launch_bounds__(kThreads) forward_kernel(const AttentionParams p, const ms::Head<double>* heads, const UnitRows<float> u) {
  const std::int64_t idx = static_cast<std::int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  if (idx >= p.rows_q * p.heads_q) return;
  const int dk = static_cast<int>(p.dim_qk), dv = static_cast<int>(p.dim_v);
  const QueryRow q(p, heads, idx);
  const float* qm = u.qm + idx * dk;
  float acc[kMaxScreeningDim];
  for (int d = 0; d < dv; ++d) acc[d] = 0.f;
  for (std::int64_t j = q.first; j <= q.last; ++j) {
    const std::int64_t kr = q.key_row(p, j);
    const float rel = ms::trim(dot(qm, u.km + (kr * p.heads_q + q.h) * dk, dk), q.r) *
                      ms::softmask(static_cast<float>(j - q.i), q.w, q.hd.infinite);
    if (rel == 0.f) continue;
    const float* vn = u.vn + (kr * p.heads_kv + q.hk) * dv;
    for (int d = 0; d < dv; ++d) acc[d] += rel * vn[d];
  }
  const float n = sqrtf(dot(acc, acc, dv));
  const float f = ms::tanh_norm_factor(n);
  T* out = p.out.at<T>(q.b, q.s.q_start + (q.i - q.s.q_offset()), q.h);
  for (int d = 0; d < dv; ++d) out[d * p.out.dim] = simple::from_float<T>(acc[d] * f);
  *p.stats.at<float>(q.b, q.s.q_start + (q.i - q.s.q_offset()), q.h) = n;
}

// A warp per (query row, query head): dL/dh = f du + phi <u, du> u from the saved output and
// norm, into gh ([batch row][head][d_V], as S).
template <class T, class S>
__global__ void tanh_norm_grad_kernel(const AttentionParams p, const GradientParams g, S* gh) {
  const std::int64_t idx = static_cast<std::int64_t>(blockIdx.x) * kWarpsPerBlock + threadIdx.x / 32;
  if (idx >= p.rows_q * p.heads_q) return;
  const int lane = threadIdx.x % 32, dv = static_cast<int>(p.dim_v);
  const std::int64_t row = idx / p.heads_q, h = idx % p.heads_q;
  const RowAt at = locate(p, row, true);
  const std::int64_t abs_row = p.sequence(at.b).q_start + at.r;
  const T* u = p.out.at<const T>(at.b, abs_row, h);
  const T* du = g.dout.at<const T>(at.b, abs_row, h);
  float dot_u = 0.f;
  for (int d = lane; d < dv; d += 32) dot_u += simple::load(u + d * p.out.dim) * simple::load(du + d * g.dout.dim);
  dot_u = simple::warp_sum(dot_u);
  const float n = *p.stats.at<const float>(at.b, abs_row, h);
  const float f = ms::tanh_norm_factor(n);
  const float phi_dot = ms::tanh_norm_phi(n) * dot_u;
  for (int d = lane; d < dv; d += 32) {
    gh[idx * dv + d] = simple::from_float<S>(f * simple::load(du + d * g.dout.dim) + phi_dot * simple::load(u + d * p.out.dim));
  }
}

// A thread per (query row, query head): dq through MiPE and the normalization, and the row's
// shares of ds_w and ds_r (double, [row][head][2]).
template <class T>
__global__ void __launch_bounds__(kThreads) query_grads_kernel(const AttentionParams p, const GradientParams g,
                                                               const ms::Head<double>* heads, const UnitRows<float> u,
                                                               const float* gh, double* scalar_parts) {
  const std::int64_t idx = static_cast<std::int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  if (idx >= p.rows_q * p.heads_q) return;
  const int dk = static_cast<int>(p.dim_qk), dv = static_cast<int>(p.dim_v);
  const QueryRow q(p, heads, idx);
  const float* qm = u.qm + idx * dk;
  const float* g_row = gh + idx * dv;
  float dqm[kMaxScreeningDim];
  for (int d = 0; d < dk; ++d) dqm[d] = 0.f;
  double dw = 0, drate = 0, dr_total = 0;
  for (std::int64_t j = q.first; j <= q.last; ++j) {
    const std::int64_t kr = q.key_row(p, j);
    const float* km = u.km + (kr * p.heads_q + q.h) * dk;
    const float s = dot(qm, km, dk), dist = static_cast<float>(j - q.i);
    const float a = ms::trim(s, q.r), m = ms::softmask(dist, q.w, q.hd.infinite);
    if (a == 0.f || m == 0.f) continue;  // every slope vanishes with R
    const float dr = dot(g_row, u.vn + (kr * p.heads_kv + q.hk) * dv, dv);
    const float ds = dr * m * ms::trim_slope_s(s, q.r);
    dr_total += dr * m * ms::trim_slope_r(s, q.r);
    dw += dr * a * ms::softmask_slope(dist, q.w, q.hd.infinite);
    drate += ds * dist * (qm[1] * km[0] - qm[0] * km[1]);
    for (int d = 0; d < dk; ++d) dqm[d] += ds * km[d];
  }
  unrotate(dqm, q.i, q.hd.rate);
  const float* qn = u.qn + idx * dk;
  const float inv = u.q_inv[idx], dot_n = dot(qn, dqm, dk);
  T* dq = g.dq.at<T>(q.b, q.s.q_start + (q.i - q.s.q_offset()), q.h);
  for (int d = 0; d < dk; ++d) {
    dq[d * g.dq.dim] = simple::from_float<T>(math::normalize_grad(dqm[d], qn[d], dot_n, fabsf(inv), inv < 0.f));
  }
  const ScalarParts parts{p, scalar_parts};
  parts.query(0, q.h, q.q_row) = (dw + drate * q.hd.rate_slope) * q.hd.dw_ds();
  parts.query(1, q.h, q.q_row) = dr_total * q.hd.dr_ds();
}

// A thread per (key row, query head): the queries whose window holds the key; dL/dkn (back
// through this head's MiPE) and dL/dvn of this head, fp32 [key row][query head][dim].
__global__ void __launch_bounds__(kThreads) key_grads_kernel(const AttentionParams p, const ms::Head<double>* heads,
                                                             const UnitRows<float> u, const float* gh, float* dkn_h,
                                                             float* dvn_h) {
  const std::int64_t idx = static_cast<std::int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  if (idx >= p.rows_k * p.heads_q) return;
  const int dk = static_cast<int>(p.dim_qk), dv = static_cast<int>(p.dim_v);
  const std::int64_t row = idx / p.heads_q, h = idx % p.heads_q, hk = p.kv_head(h);
  const RowAt at = locate(p, row, false);
  const detail::SequenceExtent s = p.sequence(at.b);
  const ms::Head<double>& hd = heads[h];
  const float w = static_cast<float>(hd.w), r = static_cast<float>(hd.r);
  const std::int64_t j = at.r;
  const float* km = u.km + idx * dk;
  const float* vn = u.vn + (row * p.heads_kv + hk) * dv;
  float dkm[kMaxScreeningDim], dvn[kMaxScreeningDim];
  for (int d = 0; d < dk; ++d) dkm[d] = 0.f;
  for (int d = 0; d < dv; ++d) dvn[d] = 0.f;
  // Queries i >= j inside the window (i < j + w), among the sequence's query positions.
  std::int64_t first = j > s.q_offset() ? j : s.q_offset();
  std::int64_t last = s.k_len - 1;
  if (!hd.infinite) {
    const std::int64_t edge = j + static_cast<std::int64_t>(ceil(hd.w)) - 1;
    last = edge < last ? edge : last;
  }
  for (std::int64_t i = first; i <= last; ++i) {
    const std::int64_t q_idx = p.batch_row_q(at.b, s.q_start + i - s.q_offset()) * p.heads_q + h;
    const float* qm = u.qm + q_idx * dk;
    const float sc = dot(qm, km, dk), dist = static_cast<float>(j - i);
    const float a = ms::trim(sc, r), m = ms::softmask(dist, w, hd.infinite);
    if (a == 0.f || m == 0.f) continue;
    const float* g_row = gh + q_idx * dv;
    const float dr = dot(g_row, vn, dv);
    const float ds = dr * m * ms::trim_slope_s(sc, r), rel = a * m;
    for (int d = 0; d < dk; ++d) dkm[d] += ds * qm[d];
    for (int d = 0; d < dv; ++d) dvn[d] += rel * g_row[d];
  }
  unrotate(dkm, j, hd.rate);
  for (int d = 0; d < dk; ++d) dkn_h[idx * dk + d] = dkm[d];
  for (int d = 0; d < dv; ++d) dvn_h[idx * dv + d] = dvn[d];
}

// A warp per (key row, kv head): the group's heads summed in order, then back through the
// normalization into dk and dv.
template <class T>
__global__ void store_key_grads_kernel(const AttentionParams p, const GradientParams g, const UnitRows<float> u,
                                       const float* dkn_h, const float* dvn_h) {
  const std::int64_t idx = static_cast<std::int64_t>(blockIdx.x) * kWarpsPerBlock + threadIdx.x / 32;
  if (idx >= p.rows_k * p.heads_kv) return;
  const int lane = threadIdx.x % 32;
  const std::int64_t row = idx / p.heads_kv, hk = idx % p.heads_kv;
  const RowAt at = locate(p, row, false);
  const std::int64_t abs_row = p.sequence(at.b).k_start + at.r;
  auto store = [&](const float* grads, int dim, const float* hat, float inv, const Operand& out) {
    const std::int64_t h0 = hk * p.group_size();
    float dot_n = 0.f;
    for (int d = lane; d < dim; d += 32) {
      float sum = 0.f;
      for (std::int64_t h = h0; h < h0 + p.group_size(); ++h) sum += grads[(row * p.heads_q + h) * dim + d];
      dot_n += sum * hat[d];
    }
    dot_n = simple::warp_sum(dot_n);
    T* y = out.at<T>(at.b, abs_row, hk);
    for (int d = lane; d < dim; d += 32) {
      float sum = 0.f;
      for (std::int64_t h = h0; h < h0 + p.group_size(); ++h) sum += grads[(row * p.heads_q + h) * dim + d];
      y[d * out.dim] = simple::from_float<T>(math::normalize_grad(sum, hat[d], dot_n, fabsf(inv), inv < 0.f));
    }
  };
  const int dk = static_cast<int>(p.dim_qk), dv = static_cast<int>(p.dim_v);
  store(dkn_h, dk, u.kn + idx * dk, u.k_inv[idx], g.dk);
  store(dvn_h, dv, u.vn + idx * dv, u.v_inv[idx], g.dv);
}

// A block per query head: its query rows' shares of ds_w and ds_r and, when given, its key
// rows' shares of ds_w, summed in a fixed order.
constexpr int kSumThreads = 1024;
__global__ void __launch_bounds__(kSumThreads) head_sums_kernel(const AttentionParams p, const ScalarParts parts,
                                                                bool key_parts, double* sums) {
  using Reduce = cub::BlockReduce<double, kSumThreads>;
  __shared__ typename Reduce::TempStorage storage;
  const std::int64_t h = blockIdx.x;
  for (int k = 0; k < 2; ++k) {
    double x = 0;
    for (std::int64_t row = threadIdx.x; row < p.rows_q; row += kSumThreads) x += parts.query(k, h, row);
    if (k == 0 && key_parts) {
      for (std::int64_t row = threadIdx.x; row < p.rows_k; row += kSumThreads) x += parts.key(h, row);
    }
    const double total = Reduce(storage).Sum(x);
    if (threadIdx.x == 0) sums[2 * h + k] = total;
    __syncthreads();
  }
}

// The per-head sums into the caller's ds_w and ds_r (one per head, or their total).
__global__ void store_scalar_grads_kernel(const AttentionParams p, const ScreeningConfig cfg, const double* sums) {
  if (threadIdx.x != 0 || blockIdx.x != 0) return;
  const Operand* outs[2] = {&cfg.ds_w, &cfg.ds_r};
  for (int k = 0; k < 2; ++k) {
    float* data = static_cast<float*>(outs[k]->data);
    double total = 0;
    for (std::int64_t h = 0; h < p.heads_q; ++h) {
      total += sums[2 * h + k];
      if (outs[k]->head != 0) data[h * outs[k]->head] = static_cast<float>(sums[2 * h + k]);
    }
    if (outs[k]->head == 0) *data = static_cast<float>(total);
  }
}

unsigned blocks_for(std::int64_t items, int per_block) {
  return static_cast<unsigned>((items + per_block - 1) / per_block);
}

// Every head's constants, once per call.
__global__ void head_constants_kernel(const AttentionParams p, const ScreeningConfig cfg, ms::Head<double>* heads) {
  const std::int64_t h = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (h < p.heads_q) heads[h] = head_of(cfg, h);
}

// The heads' constants and the prepared rows (stored as S), carved from one buffer.
template <class T, class S>
struct PreparedRows {
  DeviceBuffer buffer;
  ms::Head<double>* heads;
  UnitRows<S> u;
  static std::size_t head_bytes(const AttentionParams& p) {
    return (static_cast<std::size_t>(p.heads_q) * sizeof(ms::Head<double>) + 15) / 16 * 16;
  }
  // backward: also the plain normalized queries and keys the gradients go back through.
  PreparedRows(const AttentionParams& p, const ScreeningConfig& cfg, bool backward)
      : buffer(p, head_bytes(p) + UnitRows<S>::bytes(p)),
        heads(buffer.as<ms::Head<double>>()),
        u(p, buffer.as<unsigned char>() + head_bytes(p)) {
    const cudaStream_t stream = stream_of(p);
    if (p.heads_q == 0) return;
    head_constants_kernel<<<blocks_for(p.heads_q, kThreads), kThreads, 0, stream>>>(p, cfg, heads);
    check_launch("screening head_constants_kernel");
    if (p.rows_q * p.heads_q > 0) {
      prepare_queries_kernel<T, S><<<blocks_for(p.rows_q * p.heads_q, kThreads), kThreads, 0, stream>>>(
          p, cfg, heads, u, backward);
      check_launch("screening prepare_queries_kernel");
    }
    if (p.rows_k * p.heads_q > 0) {
      prepare_keys_kernel<T, S><<<blocks_for(p.rows_k * p.heads_q, kThreads), kThreads, 0, stream>>>(
          p, cfg, heads, u, backward);
      check_launch("screening prepare_keys_kernel");
    }
  }
};

void sum_scalar_grads(const AttentionParams& p, const ScreeningConfig& cfg, const ScalarParts& parts, bool key_parts,
                      double* sums) {
  if (p.heads_q == 0) return;
  head_sums_kernel<<<static_cast<unsigned>(p.heads_q), kSumThreads, 0, stream_of(p)>>>(p, parts, key_parts, sums);
  check_launch("screening head_sums_kernel");
  store_scalar_grads_kernel<<<1, 1, 0, stream_of(p)>>>(p, cfg, sums);
  check_launch("screening store_scalar_grads_kernel");
}

struct SimpleForward {
  const AttentionParams& p;
  const ScreeningConfig& cfg;
  template <class T>
  void operator()() const {
    const PreparedRows<T, float> rows(p, cfg, false);
    if (p.rows_q * p.heads_q == 0) return;
    forward_kernel<T><<<blocks_for(p.rows_q * p.heads_q, kThreads), kThreads, 0, stream_of(p)>>>(p, rows.heads, rows.u);
    check_launch("screening forward_kernel");
  }
};

struct SimpleBackward {
  const AttentionParams& p;
  const GradientParams& g;
  const ScreeningConfig& cfg;
  template <class T>
  void operator()() const {
    const cudaStream_t stream = stream_of(p);
    const std::size_t q_items = static_cast<std::size_t>(p.rows_q * p.heads_q);
    const std::size_t k_items = static_cast<std::size_t>(p.rows_k * p.heads_q);
    const std::size_t gh = q_items * p.dim_v, dkn = k_items * p.dim_qk, dvn = k_items * p.dim_v;
    const std::size_t parts = 2 * q_items, sums = 2 * static_cast<std::size_t>(p.heads_q);
    // doubles first, so that they are aligned.
    DeviceBuffer buffer(p, (parts + sums) * sizeof(double) + (gh + dkn + dvn) * sizeof(float));
    double* scalar_parts = buffer.as<double>();
    double* head_sums = scalar_parts + parts;
    float* g_h = reinterpret_cast<float*>(head_sums + sums);
    float* dkn_h = g_h + gh;
    float* dvn_h = dkn_h + dkn;
    const PreparedRows<T, float> rows(p, cfg, true);
    const UnitRows<float>& u = rows.u;
    if (q_items > 0) {
      tanh_norm_grad_kernel<T, float><<<blocks_for(q_items, kWarpsPerBlock), kThreads, 0, stream>>>(p, g, g_h);
      check_launch("screening tanh_norm_grad_kernel");
      query_grads_kernel<T><<<blocks_for(q_items, kThreads), kThreads, 0, stream>>>(p, g, rows.heads, u, g_h, scalar_parts);
      check_launch("screening query_grads_kernel");
    }
    if (k_items > 0) {
      key_grads_kernel<<<blocks_for(k_items, kThreads), kThreads, 0, stream>>>(p, rows.heads, u, g_h, dkn_h, dvn_h);
      check_launch("screening key_grads_kernel");
      store_key_grads_kernel<T><<<blocks_for(p.rows_k * p.heads_kv, kWarpsPerBlock), kThreads, 0, stream>>>(p, g, u, dkn_h, dvn_h);
      check_launch("screening store_key_grads_kernel");
    }
    sum_scalar_grads(p, cfg, ScalarParts{p, scalar_parts}, false, head_sums);
  }
};

// ---------------------------------------------------------------- fused path

// An operand over a contiguous [batch row][head][dim] buffer, addressed like the caller's.
Operand contiguous(void* data, const AttentionParams& p, bool query, std::int64_t heads, std::int64_t dim) {
  Operand o;
  o.data = data;
  o.dim = 1;
  o.head = dim;
  o.row = heads * dim;
  const bool packed = (query ? p.cu_seqlens_q : p.cu_seqlens_k) != nullptr;
  o.batch = packed ? 0 : (query ? p.len_q : p.len_k) * o.row;
  return o;
}

// What the fused kernels see: the prepared rows as q, k and v (one kv head per query head).
AttentionParams kernel_params(const AttentionParams& p, const void* qm, const void* km, const void* vn) {
  AttentionParams k = p;
  k.q = contiguous(const_cast<void*>(qm), p, true, p.heads_q, p.dim_qk);
  k.k = contiguous(const_cast<void*>(km), p, false, p.heads_q, p.dim_qk);
  k.v = contiguous(const_cast<void*>(vn), p, false, p.heads_q, p.dim_v);
  return k;
}

bool fused_applies(const AttentionParams& p, const GradientParams* g) {
  if (p.dtype != DType::bfloat16 && p.dtype != DType::float16) return false;
  if (p.heads_q != p.heads_kv || p.num_seqs > 65535 || p.heads_q > 65535) return false;
  if (p.dim_qk != 16 && p.dim_qk != 32 && p.dim_qk != 64) return false;
  if (p.dim_v != 64 && p.dim_v != 128) return false;
  for (const Operand* op : {&p.q, &p.k, &p.v, &p.out}) {
    if (!aligned_rows(*op, p.dtype)) return false;
  }
  return g == nullptr || (aligned_rows(g->dq, p.dtype) && aligned_rows(g->dout, p.dtype));
}

// Calls fn.template operator()<T, DK, DV>() for the fused path's instantiations.
template <class Fn>
void dispatch_screening_fused(const AttentionParams& p, Fn&& fn) {
  auto dims = [&](auto t) {
    using T = decltype(t);
    auto dv = [&](auto dk_tag) {
      constexpr int DK = decltype(dk_tag)::value;
      if (p.dim_v == 64) {
        fn.template operator()<T, DK, 64>();
      } else {
        fn.template operator()<T, DK, 128>();
      }
    };
    if (p.dim_qk == 16) {
      dv(std::integral_constant<int, 16>{});
    } else if (p.dim_qk == 32) {
      dv(std::integral_constant<int, 32>{});
    } else {
      dv(std::integral_constant<int, 64>{});
    }
  };
  if (p.dtype == DType::bfloat16) {
    dims(__nv_bfloat16{});
  } else {
    dims(__half{});
  }
}

// The fused path's row passes: a group of G = dim / 8 consecutive threads per row, each holding
// 8 features (16 bytes) of 16-bit rows with contiguous, 16-byte aligned features; row sums by
// shuffles within the group. (A thread per row would issue a 2-byte access per feature, 32
// rows apart across a warp: several times slower.)
template <class T>
struct Chunk8 {
  float v[8];
  __device__ __forceinline__ void load(const T* x) {
    const uint4 bits = *reinterpret_cast<const uint4*>(x);
    const T* e = reinterpret_cast<const T*>(&bits);
#pragma unroll
    for (int j = 0; j < 8; ++j) v[j] = simple::load(e + j);
  }
  __device__ __forceinline__ void store(T* y) const {
    uint4 bits;
    T* e = reinterpret_cast<T*>(&bits);
#pragma unroll
    for (int j = 0; j < 8; ++j) e[j] = simple::from_float<T>(v[j]);
    *reinterpret_cast<uint4*>(y) = bits;
  }
};

template <int G>
__device__ __forceinline__ float group_sum(float x) {
#pragma unroll
  for (int off = 1; off < G; off *= 2) x += __shfl_xor_sync(0xffffffffu, x, off);
  return x;
}

enum class RowRole { query, key, value };

// Role query: a group per (query row, query head) writes qm (and qn). Role key: a group per
// (key row, query head) writes km for the head (and kn, k_inv for the first head of its
// group). Role value: a group per (key row, kv head) writes vn and v_inv.
template <class T, int D, RowRole Role>
__global__ void fused_prepare_kernel(const AttentionParams p, const ScreeningConfig cfg, const ms::Head<double>* heads,
                                     const UnitRows<T> u, bool backward) {
  constexpr int G = D / 8;
  const std::int64_t thread = static_cast<std::int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  const std::int64_t idx = thread / G;
  const int part = static_cast<int>(thread % G);
  const bool query = Role == RowRole::query;
  const std::int64_t heads_here = Role == RowRole::value ? p.heads_kv : p.heads_q;
  const bool valid = idx < (query ? p.rows_q : p.rows_k) * heads_here;
  const std::int64_t row = valid ? idx / heads_here : 0, h = valid ? idx % heads_here : 0;
  const RowAt at = locate(p, row, query);
  const detail::SequenceExtent s = p.sequence(at.b);
  const std::int64_t hk = Role == RowRole::value ? h : p.kv_head(h);
  const Operand& src = Role == RowRole::query ? p.q : (Role == RowRole::key ? p.k : p.v);
  Chunk8<T> c;
  if (valid) {
    c.load(src.at<const T>(at.b, (query ? s.q_start : s.k_start) + at.r, Role == RowRole::query ? h : hk) + 8 * part);
  } else {
#pragma unroll
    for (int j = 0; j < 8; ++j) c.v[j] = 0.f;
  }
  float sum = 0.f;
#pragma unroll
  for (int j = 0; j < 8; ++j) sum += c.v[j] * c.v[j];
  sum = group_sum<G>(sum);  // every lane takes part
  if (!valid) return;
  const float eps = static_cast<float>(cfg.norm_eps);
  const float inv = math::inverse_norm(sum, eps), signed_inv = math::norm_clipped(sum, eps) ? -inv : inv;
#pragma unroll
  for (int j = 0; j < 8; ++j) c.v[j] *= inv;
  if (Role == RowRole::value) {
    c.store(u.vn + idx * D + 8 * part);
    if (part == 0) u.v_inv[idx] = signed_inv;
    return;
  }
  const bool first = Role == RowRole::query || h % p.group_size() == 0;
  const std::int64_t kv_idx = row * p.heads_kv + hk;
  if (backward && first) c.store((query ? u.qn + idx * D : u.kn + kv_idx * D) + 8 * part);
  if (part == 0) {
    if (query) {
      u.q_inv[idx] = signed_inv;
    } else if (first) {
      u.k_inv[kv_idx] = signed_inv;
    }
    float sn, cs;
    mipe_sincos(query ? at.r + s.q_offset() : at.r, heads[h].rate, &sn, &cs);
    const float x0 = c.v[0], x1 = c.v[1];
    c.v[0] = x0 * cs - x1 * sn;
    c.v[1] = x0 * sn + x1 * cs;
  }
  c.store((query ? u.qm : u.km) + idx * D + 8 * part);
}

template <class T, int D, RowRole Role>
void launch_fused_prepare(const AttentionParams& p, const ScreeningConfig& cfg, const ms::Head<double>* heads,
                          const UnitRows<T>& u, bool backward) {
  const std::int64_t items = (Role == RowRole::query ? p.rows_q : p.rows_k) * (Role == RowRole::value ? p.heads_kv : p.heads_q);
  if (items == 0) return;
  fused_prepare_kernel<T, D, Role><<<blocks_for(items * (D / 8), kThreads), kThreads, 0, stream_of(p)>>>(p, cfg, heads, u, backward);
  check_launch("screening fused_prepare_kernel");
}

// The heads' constants and the rows the fused kernels take (as T), carved from one buffer.
template <class T, int DK, int DV>
struct FusedRows {
  DeviceBuffer buffer;
  ms::Head<double>* heads;
  UnitRows<T> u;
  FusedRows(const AttentionParams& p, const ScreeningConfig& cfg, bool backward)
      : buffer(p, PreparedRows<T, T>::head_bytes(p) + UnitRows<T>::bytes(p)),
        heads(buffer.as<ms::Head<double>>()),
        u(p, buffer.as<unsigned char>() + PreparedRows<T, T>::head_bytes(p)) {
    if (p.heads_q == 0) return;
    head_constants_kernel<<<blocks_for(p.heads_q, kThreads), kThreads, 0, stream_of(p)>>>(p, cfg, heads);
    check_launch("screening head_constants_kernel");
    launch_fused_prepare<T, DK, RowRole::query>(p, cfg, heads, u, backward);
    launch_fused_prepare<T, DK, RowRole::key>(p, cfg, heads, u, backward);
    launch_fused_prepare<T, DV, RowRole::value>(p, cfg, heads, u, backward);
  }
};

// A group of DV / 8 threads per (query row, query head): dL/dh = f du + phi <u, du> u from the
// saved output and norm, into gh (T, contiguous).
template <class T, int DV>
__global__ void fused_tanh_norm_grad_kernel(const AttentionParams p, const GradientParams g, T* gh) {
  constexpr int G = DV / 8;
  const std::int64_t thread = static_cast<std::int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  const std::int64_t idx = thread / G;
  const int part = static_cast<int>(thread % G);
  const bool valid = idx < p.rows_q * p.heads_q;
  const std::int64_t row = valid ? idx / p.heads_q : 0, h = valid ? idx % p.heads_q : 0;
  const RowAt at = locate(p, row, true);
  const std::int64_t abs_row = p.sequence(at.b).q_start + at.r;
  Chunk8<T> u, du;
  float dot = 0.f;
  if (valid) {
    u.load(p.out.at<const T>(at.b, abs_row, h) + 8 * part);
    du.load(g.dout.at<const T>(at.b, abs_row, h) + 8 * part);
#pragma unroll
    for (int j = 0; j < 8; ++j) dot += u.v[j] * du.v[j];
  }
  dot = group_sum<G>(dot);
  if (!valid) return;
  const float n = *p.stats.at<const float>(at.b, abs_row, h);
  const float f = ms::tanh_norm_factor(n), phi_dot = ms::tanh_norm_phi(n) * dot;
#pragma unroll
  for (int j = 0; j < 8; ++j) du.v[j] = f * du.v[j] + phi_dot * u.v[j];
  du.store(gh + idx * DV + 8 * part);
}

struct FusedForward {
  const AttentionParams& p;
  const ScreeningConfig& cfg;
  template <class T, int DK, int DV>
  void operator()() const {
    const FusedRows<T, DK, DV> rows(p, cfg, false);
    ScreeningCudaConfig c;
    c.heads = rows.heads;
    launch_portable_forward<T, DK, DV, ScreeningRows>(kernel_params(p, rows.u.qm, rows.u.km, rows.u.vn), c);
  }
};

// A warp per (key row, head): dL/dkm and dL/dvn from the fp32 accumulators; the key's share of
// d/d rate (position j times <(-km_1, km_0), dkm>) into key_parts; dkm back through MiPE; both
// back through their normalization into dk and dv.
template <class T>
__global__ void fused_key_grads_kernel(const AttentionParams p, const GradientParams g, const UnitRows<T> u,
                                       const ms::Head<double>* heads, const float* dkm, const float* dvn,
                                       const ScalarParts parts) {
  const std::int64_t idx = static_cast<std::int64_t>(blockIdx.x) * kWarpsPerBlock + threadIdx.x / 32;
  if (idx >= p.rows_k * p.heads_q) return;
  const int lane = threadIdx.x % 32, dk = static_cast<int>(p.dim_qk), dv = static_cast<int>(p.dim_v);
  const std::int64_t row = idx / p.heads_q, h = idx % p.heads_q;
  const RowAt at = locate(p, row, false);
  const std::int64_t abs_row = p.sequence(at.b).k_start + at.r;
  const ms::Head<double>& hd = heads[h];
  const float* gk = dkm + idx * dk;
  // Coordinates 0 and 1: the rate's share, then the transposed rotation (lane 0 holds both).
  float g0 = gk[0], g1 = gk[1];
  if (lane == 0) {
    const float k0 = simple::load(u.km + idx * dk), k1 = simple::load(u.km + idx * dk + 1);
    parts.key(h, row) = static_cast<double>(at.r) * static_cast<double>(k0 * g1 - k1 * g0) * hd.rate_slope * hd.dw_ds();
    float g[2] = {g0, g1};
    unrotate(g, at.r, hd.rate);
    g0 = g[0];
    g1 = g[1];
  }
  g0 = __shfl_sync(0xffffffffu, g0, 0);
  g1 = __shfl_sync(0xffffffffu, g1, 0);
  auto grad_k = [&](int d) { return d == 0 ? g0 : d == 1 ? g1 : gk[d]; };
  auto store = [&](auto grad, int dim, const T* hat, float inv, const Operand& out) {
    float dot_n = 0.f;
    for (int d = lane; d < dim; d += 32) dot_n += grad(d) * simple::load(hat + d);
    dot_n = simple::warp_sum(dot_n);
    T* y = out.at<T>(at.b, abs_row, h);
    for (int d = lane; d < dim; d += 32) {
      y[d * out.dim] = simple::from_float<T>(math::normalize_grad(grad(d), simple::load(hat + d), dot_n, fabsf(inv), inv < 0.f));
    }
  };
  store(grad_k, dk, u.kn + idx * dk, u.k_inv[idx], g.dk);
  const float* gv = dvn + idx * dv;
  store([&](int d) { return gv[d]; }, dv, u.vn + idx * dv, u.v_inv[idx], g.dv);
}

struct FusedBackward {
  const AttentionParams& p;
  const GradientParams& g;
  const ScreeningConfig& cfg;
  template <class T, int DK, int DV>
  void operator()() const {
    const cudaStream_t stream = stream_of(p);
    const FusedRows<T, DK, DV> rows(p, cfg, true);
    const std::size_t q_items = static_cast<std::size_t>(p.rows_q * p.heads_q);
    const std::size_t k_items = static_cast<std::size_t>(p.rows_k * p.heads_q);
    const std::size_t parts = 2 * q_items + k_items, sums = 2 * static_cast<std::size_t>(p.heads_q);
    const std::size_t acc_floats = k_items * (DK + DV), counters = backward_order_counters(p, false);
    // doubles, then the fp32 accumulators and counters (cleared), then dL/dh in T.
    const std::size_t head = (parts + sums) * sizeof(double);
    const std::size_t cleared = (acc_floats + counters) * sizeof(float);
    // dL/dh's rows are loaded 16 bytes at a time.
    const std::size_t gh_offset = (head + cleared + 15) / 16 * 16;
    DeviceBuffer buffer(p, gh_offset + q_items * DV * sizeof(T));
    const ScalarParts scalar_parts{p, buffer.as<double>()};
    double* head_sums = buffer.as<double>() + parts;
    float* dkm = reinterpret_cast<float*>(head_sums + sums);
    float* dvn = dkm + k_items * DK;
    int* order = reinterpret_cast<int*>(dvn + k_items * DV);
    T* gh = reinterpret_cast<T*>(buffer.as<unsigned char>() + gh_offset);
    if (cleared > 0) check(cudaMemsetAsync(dkm, 0, cleared, stream), "clearing accumulators");
    if (q_items > 0) {
      fused_tanh_norm_grad_kernel<T, DV><<<blocks_for(q_items * (DV / 8), kThreads), kThreads, 0, stream>>>(p, g, gh);
      check_launch("screening tanh_norm_grad_kernel");
    }
    const AttentionParams kp = kernel_params(p, rows.u.qm, rows.u.km, rows.u.vn);
    GradientParams kg = g;
    kg.dout = contiguous(gh, p, true, p.heads_q, DV);
    ScreeningCudaConfig c;
    c.heads = rows.heads;
    c.q_rotated = contiguous(rows.u.qm, p, true, p.heads_q, DK);
    c.q_unit = contiguous(rows.u.qn, p, true, p.heads_q, DK);
    c.q_inv_norm = rows.u.q_inv;
    c.parts = scalar_parts;
    KeyGradAccumulators acc;
    acc.dk = dkm;
    acc.dv = dvn;
    acc.order = order;
    acc.key_tiles = backward_key_tiles(p);
    acc.deterministic = p.deterministic;
    run_portable_backward<T, DK, DV, ScreeningBackwardRows<T>>(kp, kg, c, acc);
    if (k_items > 0) {
      fused_key_grads_kernel<T><<<blocks_for(k_items, kWarpsPerBlock), kThreads, 0, stream>>>(p, g, rows.u, rows.heads,
                                                                                          dkm, dvn, scalar_parts);
      check_launch("screening fused_key_grads_kernel");
    }
    sum_scalar_grads(p, cfg, scalar_parts, true, head_sums);
  }
};

}  // namespace

// WINNOW_SCREENING_SIMPLE forces the simple path (for comparison and tests).
bool fused_requested() { return std::getenv("WINNOW_SCREENING_SIMPLE") == nullptr; }

void screening_forward(const AttentionParams& p, const ScreeningConfig& cfg) {
  if (fused_requested() && fused_applies(p, nullptr)) return dispatch_screening_fused(p, FusedForward{p, cfg});
  dispatch_simple(p, SimpleForward{p, cfg});
}

void screening_backward(const AttentionParams& p, const GradientParams& g, const ScreeningConfig& cfg) {
  if (fused_requested() && fused_applies(p, &g)) return dispatch_screening_fused(p, FusedBackward{p, g, cfg});
  dispatch_simple(p, SimpleBackward{p, g, cfg});
}

}  // namespace winnow::cuda
