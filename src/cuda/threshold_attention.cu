// Threshold attention (TRA / TDA) on CUDA. Every call first writes each view's queries and keys
// L2-normalized (T, contiguous) with their inverse norms, so the kernels see cosines; the
// gradients come back through the normalization at the end (dq inside the fused backward's
// last step, dk from its fp32 accumulator).
//
// Fused path (16-bit inputs, D 64 or 128): the shared forward and backward kernels with the
// threshold row policies, one launch per view. TDA's second view is a second launch with
// weights scaled by -lambda: the forward adds the first view's output (already in out) before
// storing, the backward adds into the same dV accumulator. That reads V twice where a kernel
// holding both score tiles would read it once.
//
// Simple path (float32, other head dimensions, unaligned rows, and every call that asks for
// the per-row survivor count): a warp per query row for the forward, with both views in one
// sweep (so a key kept in either view counts once), and a block per (sequence, kv head) for the
// backward.
#include <cub/block/block_reduce.cuh>

#include "cuda/attention/simple.cuh"
#include "cuda/attention/threshold_rows.cuh"
#include "cuda/cuda.h"
#include "cuda/launch_attention.cuh"

namespace winnow::cuda {
namespace {

namespace mt = math::threshold;
using detail::Operand;
using detail::ThresholdConfig;

constexpr int kWarpsPerBlock = 8;

// Rows of a per-row buffer laid out [batch row][head][dim]: which (sequence, row) a batch row is.
struct RowGeometry {
  std::int64_t rows = 0, heads = 0, len = 0;  // len: rows per sequence (batched); 0 when packed
  int dim = 0;
  __device__ __forceinline__ std::int64_t sequence(std::int64_t row) const { return len > 0 ? row / len : 0; }
  __device__ __forceinline__ std::int64_t row_in(std::int64_t row) const { return len > 0 ? row % len : row; }
};

RowGeometry query_rows(const detail::AttentionParams& p) {
  return {p.rows_q, p.heads_q, p.cu_seqlens_q != nullptr ? 0 : p.len_q, static_cast<int>(p.dim_qk)};
}
RowGeometry key_rows(const detail::AttentionParams& p, int dim) {
  return {p.rows_k, p.heads_kv, p.cu_seqlens_k != nullptr ? 0 : p.len_k, dim};
}

// An operand over a contiguous [batch row][head][dim] buffer, addressed like the caller's.
Operand contiguous(void* data, const RowGeometry& r) {
  Operand o;
  o.data = data;
  o.dim = 1;
  o.head = r.dim;
  o.row = r.heads * r.dim;
  o.batch = r.len * o.row;
  return o;
}

// A warp per (batch row, head): x / max(|x|, eps) into dst, and the inverse norm (negated
// where the norm was clipped at eps).
template <class T>
__global__ void normalize_rows_kernel(const Operand src, const Operand dst, float* inv_norm,
                                      const RowGeometry r, float eps) {
  const std::int64_t idx = static_cast<std::int64_t>(blockIdx.x) * kWarpsPerBlock + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (idx >= r.rows * r.heads) return;
  const std::int64_t row = idx / r.heads, h = idx % r.heads, b = r.sequence(row), at = r.row_in(row);
  const T* x = src.at<const T>(b, at, h);
  float sum = 0.f;
  for (int d = lane; d < r.dim; d += 32) {
    const float v = simple::load(x + d * src.dim);
    sum += v * v;
  }
  sum = simple::warp_sum(sum);
  const float inv = mt::inverse_norm(sum, eps);
  T* y = dst.at<T>(b, at, h);
  for (int d = lane; d < r.dim; d += 32) y[d] = simple::from_float<T>(simple::load(x + d * src.dim) * inv);
  if (lane == 0) inv_norm[idx] = mt::norm_clipped(sum, eps) ? -inv : inv;
}

// A warp per (batch row, head): out = the gradient through the normalization from dL/dx_hat
// (fp32 [batch row][head][dim]); with hat.data == nullptr, a plain store of the fp32 rows.
template <class T>
__global__ void store_grad_rows_kernel(const float* g_hat, const Operand hat, const float* inv_norm,
                                       const Operand out, const RowGeometry r) {
  const std::int64_t idx = static_cast<std::int64_t>(blockIdx.x) * kWarpsPerBlock + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (idx >= r.rows * r.heads) return;
  const std::int64_t row = idx / r.heads, h = idx % r.heads, b = r.sequence(row), at = r.row_in(row);
  const float* g = g_hat + idx * r.dim;
  T* y = out.at<T>(b, at, h);
  if (hat.data == nullptr) {
    for (int d = lane; d < r.dim; d += 32) y[d * out.dim] = simple::from_float<T>(g[d]);
    return;
  }
  const T* x = hat.at<const T>(b, at, h);
  float dot = 0.f;
  for (int d = lane; d < r.dim; d += 32) dot += simple::load(x + d) * g[d];
  dot = simple::warp_sum(dot);
  const float inv = inv_norm[idx];
  for (int d = lane; d < r.dim; d += 32) {
    y[d * out.dim] = simple::from_float<T>(mt::normalize_grad(g[d], simple::load(x + d), dot, fabsf(inv), inv < 0.f));
  }
}

// dbeta and dlambda from their per-head fp32 sums, into the caller's per-head (or shared) tensors.
__global__ void store_head_grads_kernel(const float* dbeta_sum, const float* lambda_dot, const ThresholdConfig cfg,
                                        std::int64_t heads) {
  if (threadIdx.x != 0 || blockIdx.x != 0) return;
  float beta_total = 0.f, lambda_total = 0.f;
  for (std::int64_t h = 0; h < heads; ++h) {
    const float db = dbeta_sum[h];
    if (cfg.dbeta.head != 0) static_cast<float*>(cfg.dbeta.data)[h * cfg.dbeta.head] = db;
    beta_total += db;
    if (lambda_dot != nullptr) {
      const float dl = -lambda_dot[h] * mt::lambda_slope(cfg.lambda_at<float>(h), cfg.clamp_lambda);
      if (cfg.dlambda.head != 0) static_cast<float*>(cfg.dlambda.data)[h * cfg.dlambda.head] = dl;
      lambda_total += dl;
    }
  }
  if (cfg.dbeta.head == 0) *static_cast<float*>(cfg.dbeta.data) = beta_total;
  if (lambda_dot != nullptr && cfg.dlambda.head == 0) *static_cast<float*>(cfg.dlambda.data) = lambda_total;
}

unsigned warp_blocks(const RowGeometry& r) {
  return static_cast<unsigned>((r.rows * r.heads + kWarpsPerBlock - 1) / kWarpsPerBlock);
}

// What the simple kernels need beyond the attention operands (p.q, p.k: the first view's
// normalized rows).
struct SimpleThreshold {
  ThresholdCudaConfig view;  // power, dim, beta, lambda (TDA)
  Operand q2_hat, k2_hat;    // TDA
  Operand nonzero;           // int32 per query row; data == nullptr: not counted
  // Backward: fp32 [batch row][head][dim] accumulators of dL/dq_hat, dL/dk_hat per view and
  // of dv, and the per-head sums of dbeta and of sum dP w2.
  float* dq_hat[2] = {nullptr, nullptr};
  float* dk_hat[2] = {nullptr, nullptr};
  float* dv = nullptr;
  float* dbeta = nullptr;
  float* lambda_dot = nullptr;
};

// Forward: a warp per query row; each lane takes keys base + lane, scores both views, then the
// warp adds the weighted values one key at a time (skipping exact zeros).
template <class T>
__global__ void simple_forward_kernel(const detail::AttentionParams p, const SimpleThreshold x) {
  extern __shared__ float smem[];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int D = static_cast<int>(p.dim_qk), DV = static_cast<int>(p.dim_v);
  float* q1 = smem + warp * (2 * D + DV);
  float* q2 = q1 + D;
  float* o = q2 + D;
  const std::int64_t b = blockIdx.z, h = blockIdx.y, hk = p.kv_head(h);
  const detail::SequenceExtent s = p.sequence(b);
  const std::int64_t r = static_cast<std::int64_t>(blockIdx.x) * simple::kRowsPerBlock + warp;
  if (r >= s.q_len) return;
  const bool tda = x.view.lambda != nullptr;
  const std::int64_t row = s.q_start + r;
  for (int d = lane; d < D; d += 32) {
    q1[d] = simple::load(p.q.at<const T>(b, row, h) + d);
    q2[d] = tda ? simple::load(x.q2_hat.at<const T>(b, row, h) + d) : 0.f;
  }
  for (int d = lane; d < DV; d += 32) o[d] = 0.f;
  __syncwarp();
  const std::int64_t limit = simple::row_limit(p, s, r);
  const float tau = x.view.beta[h * x.view.beta_head] * x.view.unit(limit);
  const float lambda = tda ? -x.view.factor(h) : 0.f;
  const float power = x.view.power;
  int kept = 0;
  for (std::int64_t base = 0; base <= limit; base += 32) {
    const std::int64_t key = base + lane;
    float w = 0.f;
    if (key <= limit) {
      const float w1 = mt::weight(simple::dot_row(q1, p.k.at<const T>(b, s.k_start + key, hk), 1, D) - tau, power);
      float w2 = 0.f;
      if (tda) w2 = mt::weight(simple::dot_row(q2, x.k2_hat.at<const T>(b, s.k_start + key, hk), 1, D) - tau, power);
      kept += (w1 != 0.f || w2 != 0.f) ? 1 : 0;
      w = w1 - lambda * w2;
    }
    for (int j = 0; j < 32; ++j) {
      const float wj = __shfl_sync(0xffffffffu, w, j);
      if (wj == 0.f) continue;
      const T* v = p.v.at<const T>(b, s.k_start + base + j, hk);
      for (int d = lane; d < DV; d += 32) o[d] += wj * simple::load(v + d * p.v.dim);
    }
  }
  for (int off = 16; off > 0; off /= 2) kept += __shfl_xor_sync(0xffffffffu, kept, off);
  T* out = p.out.at<T>(b, row, h);
  for (int d = lane; d < DV; d += 32) out[d * p.out.dim] = simple::from_float<T>(o[d]);
  if (lane == 0 && x.nonzero.data != nullptr) *x.nonzero.at<std::int32_t>(b, row, h) = kept;
}

// Backward: a block per (sequence, kv head) walks the group's query rows in order, a thread per
// key, so the fp32 key accumulators need no atomics.
template <class T>
__global__ void __launch_bounds__(simple::kBackwardThreads)
    simple_backward_kernel(const detail::AttentionParams p, const detail::GradientParams g, const SimpleThreshold x) {
  constexpr int kThreads = simple::kBackwardThreads;
  using Reduce = cub::BlockReduce<float, kThreads>;
  __shared__ typename Reduce::TempStorage reduce_storage;
  extern __shared__ float smem[];
  const int D = static_cast<int>(p.dim_qk), DV = static_cast<int>(p.dim_v);
  float* q1 = smem;
  float* q2 = q1 + D;
  float* dout = q2 + D;
  float* ds1_of = dout + DV;
  float* ds2_of = ds1_of + kThreads;
  const int t = threadIdx.x;
  const std::int64_t b = blockIdx.y, hk = blockIdx.x;
  const detail::SequenceExtent s = p.sequence(b);
  const bool tda = x.view.lambda != nullptr;
  const float power = x.view.power;

  for (std::int64_t h = hk * p.group_size(); h < (hk + 1) * p.group_size(); ++h) {
    const float beta = x.view.beta[h * x.view.beta_head];
    const float factor2 = tda ? x.view.factor(h) : 0.f;  // -lambda
    float beta_part = 0.f, lambda_part = 0.f;
    for (std::int64_t r = 0; r < s.q_len; ++r) {
      const std::int64_t row = s.q_start + r;
      for (int d = t; d < D; d += kThreads) {
        q1[d] = simple::load(p.q.at<const T>(b, row, h) + d);
        q2[d] = tda ? simple::load(x.q2_hat.at<const T>(b, row, h) + d) : 0.f;
      }
      for (int d = t; d < DV; d += kThreads) dout[d] = simple::load(g.dout.at<const T>(b, row, h) + d * g.dout.dim);
      __syncthreads();
      const std::int64_t limit = simple::row_limit(p, s, r);
      const float unit = x.view.unit(limit), tau = beta * unit;
      float* dq1 = x.dq_hat[0] + (p.batch_row_q(b, row) * p.heads_q + h) * D;
      float* dq2 = tda ? x.dq_hat[1] + (p.batch_row_q(b, row) * p.heads_q + h) * D : nullptr;
      for (int d = t; d < D; d += kThreads) {
        dq1[d] = 0.f;
        if (tda) dq2[d] = 0.f;
      }
      for (std::int64_t base = 0; base <= limit; base += kThreads) {
        const std::int64_t key = base + t;
        float ds1 = 0.f, ds2 = 0.f;
        if (key <= limit) {
          const T* k1 = p.k.at<const T>(b, s.k_start + key, hk);
          const float dp = simple::dot_row(dout, p.v.at<const T>(b, s.k_start + key, hk), p.v.dim, DV);
          const float x1 = simple::dot_row(q1, k1, 1, D) - tau;
          const float w1 = mt::weight(x1, power);
          ds1 = dp * mt::weight_slope(x1, power);
          float w2 = 0.f;
          if (tda) {
            const float x2 = simple::dot_row(q2, x.k2_hat.at<const T>(b, s.k_start + key, hk), 1, D) - tau;
            w2 = mt::weight(x2, power);
            ds2 = factor2 * dp * mt::weight_slope(x2, power);
            lambda_part += dp * w2;
          }
          beta_part -= (ds1 + ds2) * unit;
          const std::int64_t key_row = (p.batch_row_k(b, s.k_start + key) * p.heads_kv + hk);
          float* dk1 = x.dk_hat[0] + key_row * D;
          for (int d = 0; d < D; ++d) dk1[d] += ds1 * q1[d];
          if (tda) {
            float* dk2 = x.dk_hat[1] + key_row * D;
            for (int d = 0; d < D; ++d) dk2[d] += ds2 * q2[d];
          }
          const float w = w1 + factor2 * w2;
          float* dv = x.dv + key_row * DV;
          if (w != 0.f) {
            for (int d = 0; d < DV; ++d) dv[d] += w * dout[d];
          }
        }
        ds1_of[t] = ds1;
        ds2_of[t] = ds2;
        __syncthreads();
        // dq_hat += sum over the chunk's keys of ds k_hat, a feature per thread, keys in order.
        for (int d = t; d < D; d += kThreads) {
          float a1 = dq1[d], a2 = tda ? dq2[d] : 0.f;
          for (int j = 0; j < kThreads && base + j <= limit; ++j) {
            const std::int64_t kj = s.k_start + base + j;
            a1 += ds1_of[j] * simple::load(p.k.at<const T>(b, kj, hk) + d);
            if (tda) a2 += ds2_of[j] * simple::load(x.k2_hat.at<const T>(b, kj, hk) + d);
          }
          dq1[d] = a1;
          if (tda) dq2[d] = a2;
        }
        __syncthreads();
      }
    }
    const float beta_total = Reduce(reduce_storage).Sum(beta_part);
    __syncthreads();
    const float lambda_total = Reduce(reduce_storage).Sum(lambda_part);
    __syncthreads();
    if (t == 0) {
      atomicAdd(x.dbeta + h, beta_total);
      if (tda) atomicAdd(x.lambda_dot + h, lambda_total);
    }
  }
}

// One view's normalized queries and keys.
struct ViewRows {
  Operand q_hat, k_hat;
  float* q_inv = nullptr;
  float* k_inv = nullptr;
};

// Scratch for every view's normalized rows, from the caller's allocator.
class NormalizedViews {
 public:
  NormalizedViews(const detail::AttentionParams& p, const ThresholdConfig& cfg)
      : views_(cfg.differential() ? 2 : 1),
        q_(query_rows(p)),
        k_(key_rows(p, static_cast<int>(p.dim_qk))),
        q_elems_(static_cast<std::size_t>(q_.rows * q_.heads * q_.dim)),
        k_elems_(static_cast<std::size_t>(k_.rows * k_.heads * k_.dim)),
        q_norms_(static_cast<std::size_t>(q_.rows * q_.heads)),
        k_norms_(static_cast<std::size_t>(k_.rows * k_.heads)),
        buffer_(p, views_ * ((q_elems_ + k_elems_) * element_size(p.dtype) + (q_norms_ + k_norms_) * sizeof(float) + 32)) {}

  template <class T>
  void compute(const detail::AttentionParams& p, const ThresholdConfig& cfg) {
    auto* base = buffer_.as<unsigned char>();
    const float eps = static_cast<float>(cfg.norm_eps);
    for (int v = 0; v < views_; ++v) {
      ViewRows& vr = rows_[v];
      vr.q_hat = contiguous(base, q_);
      base += q_elems_ * sizeof(T);
      vr.k_hat = contiguous(base, k_);
      base += k_elems_ * sizeof(T);
      base = reinterpret_cast<unsigned char*>((reinterpret_cast<std::uintptr_t>(base) + 15) / 16 * 16);
      vr.q_inv = reinterpret_cast<float*>(base);
      vr.k_inv = vr.q_inv + q_norms_;
      base += (q_norms_ + k_norms_) * sizeof(float);
      base = reinterpret_cast<unsigned char*>((reinterpret_cast<std::uintptr_t>(base) + 15) / 16 * 16);
      const Operand& q_src = v == 0 ? p.q : cfg.q2;
      const Operand& k_src = v == 0 ? p.k : cfg.k2;
      if (q_norms_ > 0) {
        normalize_rows_kernel<T><<<warp_blocks(q_), 32 * kWarpsPerBlock, 0, stream_of(p)>>>(q_src, vr.q_hat, vr.q_inv, q_, eps);
        check_launch("threshold normalize_rows_kernel");
      }
      if (k_norms_ > 0) {
        normalize_rows_kernel<T><<<warp_blocks(k_), 32 * kWarpsPerBlock, 0, stream_of(p)>>>(k_src, vr.k_hat, vr.k_inv, k_, eps);
        check_launch("threshold normalize_rows_kernel");
      }
    }
  }
  const ViewRows& view(int v) const { return rows_[v]; }
  int count() const { return views_; }
  const RowGeometry& queries() const { return q_; }
  const RowGeometry& keys() const { return k_; }

 private:
  int views_;
  RowGeometry q_, k_;
  std::size_t q_elems_, k_elems_, q_norms_, k_norms_;
  DeviceBuffer buffer_;
  ViewRows rows_[2];
};

ThresholdCudaConfig view_config(const detail::AttentionParams& p, const ThresholdConfig& cfg, int view) {
  ThresholdCudaConfig c;
  c.power = static_cast<float>(cfg.power);
  c.dim = static_cast<float>(p.dim_qk);
  c.beta = static_cast<const float*>(cfg.beta.data);
  c.beta_head = cfg.beta.head;
  c.clamp_lambda = cfg.clamp_lambda;
  if (view == 1) {
    c.lambda = static_cast<const float*>(cfg.lambda.data);
    c.lambda_head = cfg.lambda.head;
    c.add_to_output = true;
  }
  return c;
}

// The attention operands of one view: its normalized queries and keys, unit scale.
detail::AttentionParams view_params(const detail::AttentionParams& p, const ViewRows& v) {
  detail::AttentionParams pv = p;
  pv.q = v.q_hat;
  pv.k = v.k_hat;
  pv.scale = 1.0;
  return pv;
}

bool fused_applies(const detail::AttentionParams& p, const ThresholdConfig& cfg, const detail::GradientParams* g) {
  if (g == nullptr && cfg.nonzero.data != nullptr) return false;  // counts come from the simple path
  detail::AttentionParams check = p;
  if (g != nullptr) check.out = check.q;  // the backward writes no output
  if (!fused_path_applies(check, g)) return false;
  if (g != nullptr && cfg.differential()) {
    detail::GradientParams g2 = *g;
    g2.dq = cfg.dq2;
    return fused_path_applies(check, &g2);
  }
  return true;
}

template <class T, int D>
void fused_forward(const detail::AttentionParams& p, const ThresholdConfig& cfg, const NormalizedViews& views) {
  for (int v = 0; v < views.count(); ++v) {
    launch_fused_forward<T, D, ThresholdRows>(view_params(p, views.view(v)), view_config(p, cfg, v));
  }
}

template <class T>
void simple_forward(const detail::AttentionParams& p, const ThresholdConfig& cfg, const NormalizedViews& views) {
  SimpleThreshold x;
  x.view = view_config(p, cfg, cfg.differential() ? 1 : 0);
  x.nonzero = cfg.nonzero;
  if (cfg.differential()) {
    x.q2_hat = views.view(1).q_hat;
    x.k2_hat = views.view(1).k_hat;
  }
  const dim3 grid(static_cast<unsigned>((p.max_len_q + simple::kRowsPerBlock - 1) / simple::kRowsPerBlock),
                  static_cast<unsigned>(p.heads_q), static_cast<unsigned>(p.num_seqs));
  if (grid.x == 0 || grid.z == 0) return;
  const int smem = static_cast<int>(simple::kRowsPerBlock * (2 * p.dim_qk + p.dim_v) * sizeof(float));
  auto kernel = simple_forward_kernel<T>;
  allow_shared_memory(kernel, smem);
  kernel<<<grid, 32 * simple::kRowsPerBlock, smem, stream_of(p)>>>(view_params(p, views.view(0)), x);
  check_launch("threshold simple_forward_kernel");
}

// fp32 scratch of a backward: dk_hat per view, dv, the fused kernels' order counters and the
// per-head sums; cleared.
struct BackwardScratch {
  float* dk_hat[2] = {nullptr, nullptr};
  float* dv = nullptr;
  float* dq_hat[2] = {nullptr, nullptr};  // simple path only
  int* order[2] = {nullptr, nullptr};
  float* dbeta = nullptr;
  float* lambda_dot = nullptr;
};

class BackwardBuffer {
 public:
  // Every segment a multiple of four floats: the fused kernels add into dk and dv 16 bytes at a time.
  static std::size_t aligned(std::size_t n) { return (n + 3) / 4 * 4; }
  BackwardBuffer(const detail::AttentionParams& p, int views, bool with_dq, std::size_t order_per_view)
      : dk_(aligned(static_cast<std::size_t>(p.rows_k * p.heads_kv * p.dim_qk))),
        dv_(aligned(static_cast<std::size_t>(p.rows_k * p.heads_kv * p.dim_v))),
        dq_(with_dq ? aligned(static_cast<std::size_t>(p.rows_q * p.heads_q * p.dim_qk)) : 0),
        order_(aligned(order_per_view)),
        heads_(aligned(static_cast<std::size_t>(p.heads_q))),
        floats_(views * (dk_ + dq_ + order_) + dv_ + 2 * heads_),
        buffer_(p, floats_ * sizeof(float)) {
    float* at = buffer_.as<float>();
    if (floats_ > 0) check(cudaMemsetAsync(at, 0, floats_ * sizeof(float), stream_of(p)), "clearing accumulators");
    for (int v = 0; v < views; ++v) {
      s_.dk_hat[v] = at;
      at += dk_;
      s_.dq_hat[v] = with_dq ? at : nullptr;
      at += dq_;
      s_.order[v] = reinterpret_cast<int*>(at);
      at += order_;
    }
    s_.dv = at;
    at += dv_;
    s_.dbeta = at;
    s_.lambda_dot = at + heads_;
  }
  const BackwardScratch& scratch() const { return s_; }

 private:
  std::size_t dk_, dv_, dq_, order_, heads_, floats_;
  DeviceBuffer buffer_;
  BackwardScratch s_;
};

// dk (per view) through the normalization, dv, and the per-head gradients.
template <class T>
void store_backward(const detail::AttentionParams& p, const detail::GradientParams& g, const ThresholdConfig& cfg,
                    const NormalizedViews& views, const BackwardScratch& s) {
  const RowGeometry kr = views.keys(), vr = key_rows(p, static_cast<int>(p.dim_v));
  if (kr.rows * kr.heads > 0) {
    for (int v = 0; v < views.count(); ++v) {
      store_grad_rows_kernel<T><<<warp_blocks(kr), 32 * kWarpsPerBlock, 0, stream_of(p)>>>(
          s.dk_hat[v], views.view(v).k_hat, views.view(v).k_inv, v == 0 ? g.dk : cfg.dk2, kr);
      check_launch("threshold store_grad_rows_kernel");
    }
    store_grad_rows_kernel<T><<<warp_blocks(vr), 32 * kWarpsPerBlock, 0, stream_of(p)>>>(s.dv, Operand{}, nullptr, g.dv, vr);
    check_launch("threshold store_grad_rows_kernel");
  }
  store_head_grads_kernel<<<1, 32, 0, stream_of(p)>>>(s.dbeta, cfg.differential() ? s.lambda_dot : nullptr, cfg,
                                                     p.heads_q);
  check_launch("threshold store_head_grads_kernel");
}

template <class T, int D>
void fused_backward(const detail::AttentionParams& p, const detail::GradientParams& g, const ThresholdConfig& cfg,
                    const NormalizedViews& views) {
  const bool sm90 = fused_backward_on_hopper<T, D, ThresholdBackwardRows<T>, ThresholdCudaConfig>();
  BackwardBuffer buffer(p, views.count(), false, backward_order_counters(p, sm90));
  const BackwardScratch& s = buffer.scratch();
  for (int v = 0; v < views.count(); ++v) {
    const ViewRows& rows = views.view(v);
    ThresholdCudaConfig c = view_config(p, cfg, v);
    c.q_hat = rows.q_hat;
    c.q_inv_norm = rows.q_inv;
    c.dbeta = s.dbeta;
    c.lambda_dot = s.lambda_dot;
    detail::GradientParams gv = g;
    if (v == 1) gv.dq = cfg.dq2;
    KeyGradAccumulators acc;
    acc.deterministic = p.deterministic;
    acc.key_tiles = backward_key_tiles(p);
    acc.dk = s.dk_hat[v];
    acc.dv = s.dv;
    acc.order = s.order[v];
    run_fused_backward<T, D, ThresholdBackwardRows<T>>(view_params(p, rows), gv, c, acc);
  }
  store_backward<T>(p, g, cfg, views, s);
}

template <class T>
void simple_backward(const detail::AttentionParams& p, const detail::GradientParams& g, const ThresholdConfig& cfg,
                     const NormalizedViews& views) {
  BackwardBuffer buffer(p, views.count(), true, 0);
  const BackwardScratch& s = buffer.scratch();
  SimpleThreshold x;
  x.view = view_config(p, cfg, cfg.differential() ? 1 : 0);
  if (cfg.differential()) {
    x.q2_hat = views.view(1).q_hat;
    x.k2_hat = views.view(1).k_hat;
  }
  for (int v = 0; v < 2; ++v) {
    x.dq_hat[v] = s.dq_hat[v];
    x.dk_hat[v] = s.dk_hat[v];
  }
  x.dv = s.dv;
  x.dbeta = s.dbeta;
  x.lambda_dot = s.lambda_dot;
  const dim3 grid(static_cast<unsigned>(p.heads_kv), static_cast<unsigned>(p.num_seqs));
  if (grid.x > 0 && grid.y > 0) {
    const int smem = static_cast<int>((2 * p.dim_qk + p.dim_v + 2 * simple::kBackwardThreads) * sizeof(float));
    auto kernel = simple_backward_kernel<T>;
    allow_shared_memory(kernel, smem);
    kernel<<<grid, simple::kBackwardThreads, smem, stream_of(p)>>>(view_params(p, views.view(0)), g, x);
    check_launch("threshold simple_backward_kernel");
  }
  const RowGeometry qr = views.queries();
  if (qr.rows * qr.heads > 0) {
    for (int v = 0; v < views.count(); ++v) {
      store_grad_rows_kernel<T><<<warp_blocks(qr), 32 * kWarpsPerBlock, 0, stream_of(p)>>>(
          s.dq_hat[v], views.view(v).q_hat, views.view(v).q_inv, v == 0 ? g.dq : cfg.dq2, qr);
      check_launch("threshold store_grad_rows_kernel");
    }
  }
  store_backward<T>(p, g, cfg, views, s);
}

struct FusedForward {
  const detail::AttentionParams& p;
  const ThresholdConfig& cfg;
  NormalizedViews& views;
  template <class T, int D>
  void operator()() const {
    views.compute<T>(p, cfg);
    fused_forward<T, D>(p, cfg, views);
  }
};
struct SimpleForward {
  const detail::AttentionParams& p;
  const ThresholdConfig& cfg;
  NormalizedViews& views;
  template <class T>
  void operator()() const {
    views.compute<T>(p, cfg);
    simple_forward<T>(p, cfg, views);
  }
};
struct FusedBackward {
  const detail::AttentionParams& p;
  const detail::GradientParams& g;
  const ThresholdConfig& cfg;
  NormalizedViews& views;
  template <class T, int D>
  void operator()() const {
    views.compute<T>(p, cfg);
    fused_backward<T, D>(p, g, cfg, views);
  }
};
struct SimpleBackward {
  const detail::AttentionParams& p;
  const detail::GradientParams& g;
  const ThresholdConfig& cfg;
  NormalizedViews& views;
  template <class T>
  void operator()() const {
    views.compute<T>(p, cfg);
    simple_backward<T>(p, g, cfg, views);
  }
};

}  // namespace

void threshold_forward(const detail::AttentionParams& p, const detail::ThresholdConfig& cfg) {
  NormalizedViews views(p, cfg);
  if (fused_applies(p, cfg, nullptr)) return dispatch_fused(p, FusedForward{p, cfg, views});
  dispatch_simple(p, SimpleForward{p, cfg, views});
}

void threshold_backward(const detail::AttentionParams& p, const detail::GradientParams& g,
                        const detail::ThresholdConfig& cfg) {
  NormalizedViews views(p, cfg);
  if (fused_applies(p, cfg, &g)) return dispatch_fused(p, FusedBackward{p, g, cfg, views});
  dispatch_simple(p, SimpleBackward{p, g, cfg, views});
}

}  // namespace winnow::cuda
