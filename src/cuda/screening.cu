// Multiscreen's screening on CUDA: the simple path, every dtype and head dimension up to
// kMaxScreeningDim, deterministic (no atomics).
//
// A call first writes each query and key unit-normalized and rotated by MiPE (keys once per
// query head, as the rotation is the head's), and each value unit-normalized, in fp32. Then a
// thread per (query row, head) walks only the keys of its window: the forward sums R_ij vn_j
// and applies TanhNorm; the backward's query side recomputes R and gives dq (back through MiPE
// and the normalization) with each row's share of ds_w and ds_r; its key side, a thread per
// (key row, query head), walks the queries whose window holds the key and gives dk and dv.
// Per-head sums and the group's sum of key gradients are reduced in a fixed order.
#include <cub/block/block_reduce.cuh>

#include "cuda/attention/simple.cuh"
#include "cuda/cuda.h"
#include "cuda/launch_attention.cuh"
#include "math/elementwise.h"
#include "math/screening.h"

namespace winnow::cuda {
namespace {

namespace ms = math::screening;
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

// The fp32 rows a call works on, [batch row][head][dim], carved from one buffer.
struct UnitRows {
  float *qn, *qm, *q_inv;  // queries: normalized, rotated (per query head); inverse norms
  float *kn, *km, *k_inv;  // keys: normalized (per kv head), rotated per query head
  float *vn, *v_inv;       // values (per kv head)
  // Inverse norms are negated where the norm was clipped at eps.

  static std::size_t floats(const AttentionParams& p) {
    const std::size_t q = static_cast<std::size_t>(p.rows_q * p.heads_q);
    const std::size_t kq = static_cast<std::size_t>(p.rows_k * p.heads_q);
    const std::size_t kv = static_cast<std::size_t>(p.rows_k * p.heads_kv);
    return q * (2 * p.dim_qk + 1) + kq * p.dim_qk + kv * (p.dim_qk + 1 + p.dim_v + 1);
  }
  UnitRows(const AttentionParams& p, float* base) {
    const std::size_t q = static_cast<std::size_t>(p.rows_q * p.heads_q);
    const std::size_t kq = static_cast<std::size_t>(p.rows_k * p.heads_q);
    const std::size_t kv = static_cast<std::size_t>(p.rows_k * p.heads_kv);
    qn = base;
    qm = qn + q * p.dim_qk;
    q_inv = qm + q * p.dim_qk;
    km = q_inv + q;
    kn = km + kq * p.dim_qk;
    k_inv = kn + kv * p.dim_qk;
    vn = k_inv + kv;
    v_inv = vn + kv * p.dim_v;
  }
};

// A warp normalizes one row of `dim` features of x into y (fp32); returns the inverse norm,
// negated where the norm was clipped.
template <class T>
__device__ float normalize_row(const T* x, std::int64_t stride, int dim, float eps, float* y) {
  const int lane = threadIdx.x % 32;
  float sum = 0.f;
  for (int d = lane; d < dim; d += 32) {
    const float v = simple::load(x + d * stride);
    sum += v * v;
  }
  sum = simple::warp_sum(sum);
  const float inv = math::inverse_norm(sum, eps);
  for (int d = lane; d < dim; d += 32) y[d] = simple::load(x + d * stride) * inv;
  return math::norm_clipped(sum, eps) ? -inv : inv;
}

// Coordinates 0 and 1 of src rotated by angle (src may be dst).
__device__ __forceinline__ void rotate_pair(const float* src, float* dst, double angle) {
  double s, c;
  sincos(angle, &s, &c);
  const float x0 = src[0], x1 = src[1];
  dst[0] = x0 * static_cast<float>(c) - x1 * static_cast<float>(s);
  dst[1] = x0 * static_cast<float>(s) + x1 * static_cast<float>(c);
}

// A warp per (query row, query head): qn, qm, q_inv.
template <class T>
__global__ void prepare_queries_kernel(const AttentionParams p, const ScreeningConfig cfg, const UnitRows u) {
  const std::int64_t idx = static_cast<std::int64_t>(blockIdx.x) * kWarpsPerBlock + threadIdx.x / 32;
  if (idx >= p.rows_q * p.heads_q) return;
  const int lane = threadIdx.x % 32, dk = static_cast<int>(p.dim_qk);
  const std::int64_t row = idx / p.heads_q, h = idx % p.heads_q;
  const RowAt at = locate(p, row, true);
  const detail::SequenceExtent s = p.sequence(at.b);
  float* qn = u.qn + idx * dk;
  float* qm = u.qm + idx * dk;
  const float inv = normalize_row(p.q.at<const T>(at.b, s.q_start + at.r, h), p.q.dim, dk,
                                  static_cast<float>(cfg.norm_eps), qn);
  __syncwarp();
  for (int d = lane; d < dk; d += 32) qm[d] = qn[d];
  __syncwarp();
  if (lane == 0) {
    u.q_inv[idx] = inv;
    rotate_pair(qn, qm, static_cast<double>(at.r + s.q_offset()) * head_of(cfg, h).rate);
  }
}

// A warp per (key row, query head): km for the head; the group's first head also writes kn,
// k_inv, vn and v_inv of the kv head.
template <class T>
__global__ void prepare_keys_kernel(const AttentionParams p, const ScreeningConfig cfg, const UnitRows u) {
  const std::int64_t idx = static_cast<std::int64_t>(blockIdx.x) * kWarpsPerBlock + threadIdx.x / 32;
  if (idx >= p.rows_k * p.heads_q) return;
  const int lane = threadIdx.x % 32, dk = static_cast<int>(p.dim_qk), dv = static_cast<int>(p.dim_v);
  const std::int64_t row = idx / p.heads_q, h = idx % p.heads_q, hk = p.kv_head(h);
  const RowAt at = locate(p, row, false);
  const detail::SequenceExtent s = p.sequence(at.b);
  const std::int64_t kv_idx = row * p.heads_kv + hk;
  const bool first = h % p.group_size() == 0;
  float* km = u.km + idx * dk;
  const float eps = static_cast<float>(cfg.norm_eps);
  const float inv = normalize_row(p.k.at<const T>(at.b, s.k_start + at.r, hk), p.k.dim, dk, eps, km);
  __syncwarp();
  if (first) {
    for (int d = lane; d < dk; d += 32) u.kn[kv_idx * dk + d] = km[d];
    const float v_inv = normalize_row(p.v.at<const T>(at.b, s.k_start + at.r, hk), p.v.dim, dv, eps, u.vn + kv_idx * dv);
    if (lane == 0) {
      u.k_inv[kv_idx] = inv;
      u.v_inv[kv_idx] = v_inv;
    }
  }
  __syncwarp();
  if (lane == 0) rotate_pair(km, km, static_cast<double>(at.r) * head_of(cfg, h).rate);
}

// One query row's view of its head: position, window and the key range it visits.
struct QueryRow {
  std::int64_t b, h, hk, i, q_row;  // q_row: batch row of the query
  detail::SequenceExtent s;
  ms::Head<double> hd;
  float w, r;
  std::int64_t first, last;  // keys visited (positions)

  __device__ QueryRow(const AttentionParams& p, const ScreeningConfig& cfg, std::int64_t idx)
      : h(idx % p.heads_q), hk(p.kv_head(idx % p.heads_q)), q_row(idx / p.heads_q), hd(head_of(cfg, idx % p.heads_q)) {
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
__global__ void __launch_bounds__(kThreads) forward_kernel(const AttentionParams p, const ScreeningConfig cfg, const UnitRows u) {
  const std::int64_t idx = static_cast<std::int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  if (idx >= p.rows_q * p.heads_q) return;
  const int dk = static_cast<int>(p.dim_qk), dv = static_cast<int>(p.dim_v);
  const QueryRow q(p, cfg, idx);
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
// norm, into gh (fp32).
template <class T>
__global__ void tanh_norm_grad_kernel(const AttentionParams p, const GradientParams g, float* gh) {
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
  const float phi_dot = static_cast<float>(ms::tanh_norm_phi(static_cast<double>(n))) * dot_u;
  for (int d = lane; d < dv; d += 32) {
    gh[idx * dv + d] = f * simple::load(du + d * g.dout.dim) + phi_dot * simple::load(u + d * p.out.dim);
  }
}

// A thread per (query row, query head): dq through MiPE and the normalization, and the row's
// shares of ds_w and ds_r (double, [row][head][2]).
template <class T>
__global__ void __launch_bounds__(kThreads) query_grads_kernel(const AttentionParams p, const GradientParams g,
                                                               const ScreeningConfig cfg, const UnitRows u,
                                                               const float* gh, double* scalar_parts) {
  const std::int64_t idx = static_cast<std::int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  if (idx >= p.rows_q * p.heads_q) return;
  const int dk = static_cast<int>(p.dim_qk), dv = static_cast<int>(p.dim_v);
  const QueryRow q(p, cfg, idx);
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
  rotate_pair(dqm, dqm, -static_cast<double>(q.i) * q.hd.rate);
  const float* qn = u.qn + idx * dk;
  const float inv = u.q_inv[idx], dot_n = dot(qn, dqm, dk);
  T* dq = g.dq.at<T>(q.b, q.s.q_start + (q.i - q.s.q_offset()), q.h);
  for (int d = 0; d < dk; ++d) {
    dq[d * g.dq.dim] = simple::from_float<T>(math::normalize_grad(dqm[d], qn[d], dot_n, fabsf(inv), inv < 0.f));
  }
  scalar_parts[2 * idx] = (dw + drate * q.hd.rate_slope) * q.hd.dw_ds();
  scalar_parts[2 * idx + 1] = dr_total * q.hd.dr_ds();
}

// A thread per (key row, query head): the queries whose window holds the key; dL/dkn (back
// through this head's MiPE) and dL/dvn of this head, fp32 [key row][query head][dim].
__global__ void __launch_bounds__(kThreads) key_grads_kernel(const AttentionParams p, const ScreeningConfig cfg,
                                                             const UnitRows u, const float* gh, float* dkn_h,
                                                             float* dvn_h) {
  const std::int64_t idx = static_cast<std::int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  if (idx >= p.rows_k * p.heads_q) return;
  const int dk = static_cast<int>(p.dim_qk), dv = static_cast<int>(p.dim_v);
  const std::int64_t row = idx / p.heads_q, h = idx % p.heads_q, hk = p.kv_head(h);
  const RowAt at = locate(p, row, false);
  const detail::SequenceExtent s = p.sequence(at.b);
  const ms::Head<double> hd = head_of(cfg, h);
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
  rotate_pair(dkm, dkm, -static_cast<double>(j) * hd.rate);
  for (int d = 0; d < dk; ++d) dkn_h[idx * dk + d] = dkm[d];
  for (int d = 0; d < dv; ++d) dvn_h[idx * dv + d] = dvn[d];
}

// A warp per (key row, kv head): the group's heads summed in order, then back through the
// normalization into dk and dv.
template <class T>
__global__ void store_key_grads_kernel(const AttentionParams p, const GradientParams g, const UnitRows u,
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

// A block per query head: the rows' shares of ds_w and ds_r summed in a fixed order.
__global__ void __launch_bounds__(kThreads) head_sums_kernel(const AttentionParams p, const double* parts,
                                                             double* sums) {
  using Reduce = cub::BlockReduce<double, kThreads>;
  __shared__ typename Reduce::TempStorage storage;
  const std::int64_t h = blockIdx.x;
  for (int k = 0; k < 2; ++k) {
    double x = 0;
    for (std::int64_t row = threadIdx.x; row < p.rows_q; row += kThreads) x += parts[2 * (row * p.heads_q + h) + k];
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

template <class T>
void prepare(const AttentionParams& p, const ScreeningConfig& cfg, const UnitRows& u) {
  const cudaStream_t stream = stream_of(p);
  if (p.rows_q * p.heads_q > 0) {
    prepare_queries_kernel<T><<<blocks_for(p.rows_q * p.heads_q, kWarpsPerBlock), kThreads, 0, stream>>>(p, cfg, u);
    check_launch("screening prepare_queries_kernel");
  }
  if (p.rows_k * p.heads_q > 0) {
    prepare_keys_kernel<T><<<blocks_for(p.rows_k * p.heads_q, kWarpsPerBlock), kThreads, 0, stream>>>(p, cfg, u);
    check_launch("screening prepare_keys_kernel");
  }
}

struct SimpleForward {
  const AttentionParams& p;
  const ScreeningConfig& cfg;
  template <class T>
  void operator()() const {
    DeviceBuffer rows(p, UnitRows::floats(p) * sizeof(float));
    const UnitRows u(p, rows.as<float>());
    prepare<T>(p, cfg, u);
    if (p.rows_q * p.heads_q == 0) return;
    forward_kernel<T><<<blocks_for(p.rows_q * p.heads_q, kThreads), kThreads, 0, stream_of(p)>>>(p, cfg, u);
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
    const std::size_t unit = UnitRows::floats(p), gh = q_items * p.dim_v, dkn = k_items * p.dim_qk,
                      dvn = k_items * p.dim_v;
    const std::size_t float_count = unit + gh + dkn + dvn;
    const std::size_t parts = 2 * q_items, sums = 2 * static_cast<std::size_t>(p.heads_q);
    // doubles first, so that they are aligned.
    DeviceBuffer buffer(p, (parts + sums) * sizeof(double) + float_count * sizeof(float));
    double* scalar_parts = buffer.as<double>();
    double* head_sums = scalar_parts + parts;
    float* floats = reinterpret_cast<float*>(head_sums + sums);
    const UnitRows u(p, floats);
    float* g_h = floats + unit;
    float* dkn_h = g_h + gh;
    float* dvn_h = dkn_h + dkn;
    prepare<T>(p, cfg, u);
    if (q_items > 0) {
      tanh_norm_grad_kernel<T><<<blocks_for(q_items, kWarpsPerBlock), kThreads, 0, stream>>>(p, g, g_h);
      check_launch("screening tanh_norm_grad_kernel");
      query_grads_kernel<T><<<blocks_for(q_items, kThreads), kThreads, 0, stream>>>(p, g, cfg, u, g_h, scalar_parts);
      check_launch("screening query_grads_kernel");
    }
    if (k_items > 0) {
      key_grads_kernel<<<blocks_for(k_items, kThreads), kThreads, 0, stream>>>(p, cfg, u, g_h, dkn_h, dvn_h);
      check_launch("screening key_grads_kernel");
      store_key_grads_kernel<T><<<blocks_for(p.rows_k * p.heads_kv, kWarpsPerBlock), kThreads, 0, stream>>>(p, g, u, dkn_h, dvn_h);
      check_launch("screening store_key_grads_kernel");
    }
    if (p.heads_q > 0) {
      head_sums_kernel<<<static_cast<unsigned>(p.heads_q), kThreads, 0, stream>>>(p, scalar_parts, head_sums);
      check_launch("screening head_sums_kernel");
      store_scalar_grads_kernel<<<1, 1, 0, stream>>>(p, cfg, head_sums);
      check_launch("screening store_scalar_grads_kernel");
    }
  }
};

}  // namespace

void screening_forward(const AttentionParams& p, const ScreeningConfig& cfg) {
  dispatch_simple(p, SimpleForward{p, cfg});
}

void screening_backward(const AttentionParams& p, const GradientParams& g, const ScreeningConfig& cfg) {
  dispatch_simple(p, SimpleBackward{p, g, cfg});
}

}  // namespace winnow::cuda
