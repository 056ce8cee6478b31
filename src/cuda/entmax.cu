// alpha-entmax and Sieve attention on CUDA. On the fused path (bf16 / fp16, D = Dv = 64 or 128)
// the row thresholds come from sweeps of the fused forward kernel without values
// (entmax_rows.cuh), then
//   entmax forward    one sweep with the weights [x - tau]_+^(1 / (alpha - 1))
//   entmax backward   a sweep with the weights u (U = sum u v, sum u), then the fused backward
//   Sieve             the stick-breaking kernels with each row's candidates only
// Everything else runs on the simple path (a warp per query row).
#include <cmath>

#include "cuda/attention/entmax_rows.cuh"
#include "cuda/attention/stick_breaking_rows.cuh"
#include "cuda/cuda.h"
#include "cuda/launch_attention.cuh"

namespace winnow::cuda {
namespace {

simple::Extras entmax_extras(const detail::EntmaxConfig& cfg) {
  simple::Extras x;
  x.alpha = static_cast<float>(cfg.alpha);
  x.tolerance = static_cast<float>(cfg.tolerance);
  return x;
}

simple::Extras sieve_extras(const detail::SieveConfig& cfg) {
  simple::Extras x;
  x.alpha = static_cast<float>(cfg.alpha);
  x.tolerance = static_cast<float>(cfg.tolerance);
  x.bound = cfg.bound;
  x.eps = static_cast<float>(cfg.eps);
  x.threshold = cfg.threshold;
  x.count = cfg.count;
  return x;
}

// A per-row buffer laid out like the row statistics: [row][head] of `width` elements, rows
// counted over the whole batch (packed mode indexes absolute rows, batched mode b and row).
detail::Operand row_buffer(const detail::AttentionParams& p, void* data, std::int64_t width) {
  detail::Operand o;
  o.data = data;
  o.head = width;
  o.row = p.heads_q * width;
  o.batch = p.cu_seqlens_q != nullptr ? 0 : p.len_q * o.row;
  o.dim = 1;
  return o;
}

// Runs the threshold sweeps; cfg.result then holds each row's threshold. Between step sweeps
// one int comes back to the host: whether any row still moves.
template <class T, int D>
void find_thresholds(const detail::AttentionParams& p, ThresholdCudaConfig cfg) {
  const std::size_t rows = static_cast<std::size_t>(p.rows_q * p.heads_q);
  DeviceBuffer buffer(p, rows * sizeof(float4) + sizeof(int));
  cfg.state = row_buffer(p, buffer.as<void>(), 1);
  cfg.unfinished = reinterpret_cast<int*>(buffer.as<float4>() + rows);
  cudaStream_t stream = stream_of(p);
  auto clear_flag = [&] {
    check(cudaMemsetAsync(cfg.unfinished, 0, sizeof(int), stream), "clearing the search flag");
  };
  auto unfinished = [&] {
    int host = 0;
    check(cudaMemcpyAsync(&host, cfg.unfinished, sizeof(int), cudaMemcpyDeviceToHost, stream),
          "reading the search flag");
    check(cudaStreamSynchronize(stream), "waiting for a threshold sweep");
    return host != 0;
  };
  clear_flag();
  launch_fused_forward<T, D, ThresholdStartRows>(p, cfg);
  if (cfg.bound || !unfinished()) return;
  for (int step = 0; step < math::entmax::kMaxSearchSteps; ++step) {
    clear_flag();
    launch_fused_forward<T, D, ThresholdStepRows>(p, cfg);
    if (!unfinished()) return;
  }
}

ThresholdCudaConfig threshold_config(double alpha, double tolerance) {
  ThresholdCudaConfig c;
  c.alpha = static_cast<float>(alpha);
  c.tolerance = static_cast<float>(tolerance);
  return c;
}

struct FusedEntmaxForward {
  const detail::AttentionParams& p;
  const detail::EntmaxConfig& cfg;
  template <class T, int D>
  void operator()() const {
    ThresholdCudaConfig t = threshold_config(cfg.alpha, cfg.tolerance);
    t.result = p.stats;  // entmax's statistic is tau (x units)
    find_thresholds<T, D>(p, t);
    EntmaxCudaConfig e;
    e.alpha = static_cast<float>(cfg.alpha);
    e.tau = p.stats;
    launch_fused_forward<T, D, EntmaxRows>(p, e);
  }
};

struct FusedEntmaxBackward {
  const detail::AttentionParams& p;
  const detail::GradientParams& g;
  const detail::EntmaxConfig& cfg;
  template <class T, int D>
  void operator()() const {
    const std::size_t rows = static_cast<std::size_t>(p.rows_q * p.heads_q);
    DeviceBuffer buffer(p, rows * (static_cast<std::size_t>(p.dim_v) * sizeof(T) + sizeof(float)));
    detail::AttentionParams sweep = p;
    sweep.out = row_buffer(p, buffer.as<void>(), p.dim_v);
    sweep.stats = row_buffer(p, buffer.as<T>() + rows * p.dim_v, 1);
    EntmaxCudaConfig e;
    e.alpha = static_cast<float>(cfg.alpha);
    e.tau = p.stats;
    launch_fused_forward<T, D, EntmaxGradWeightRows>(sweep, e);
    EntmaxBackwardConfig b;
    b.alpha = e.alpha;
    b.weighted_values = sweep.out;
    b.sum_u = sweep.stats;
    launch_fused_backward<T, D, EntmaxBackwardRows<T>>(p, g, b);
  }
};

SieveCudaConfig sieve_config(const detail::SieveConfig& cfg) {
  SieveCudaConfig c;
  c.threshold = cfg.threshold;
  c.count = cfg.count;
  return c;
}

struct FusedSieveForward {
  const detail::AttentionParams& p;
  const detail::SieveConfig& cfg;
  template <class T, int D>
  void operator()() const {
    ThresholdCudaConfig t = threshold_config(cfg.alpha, cfg.tolerance);
    t.bound = cfg.bound;
    t.eps = static_cast<float>(cfg.eps);
    t.result = cfg.threshold;
    t.result_scale = static_cast<float>(1.0 / (cfg.alpha - 1.0));
    find_thresholds<T, D>(p, t);
    launch_fused_forward<T, D, SieveRows>(p, sieve_config(cfg));
  }
};

struct FusedSieveBackward {
  const detail::AttentionParams& p;
  const detail::GradientParams& g;
  const detail::SieveConfig& cfg;
  template <class T, int D>
  void operator()() const {
    launch_fused_backward<T, D, SieveBackwardRows<T>>(p, g, sieve_config(cfg));
  }
};

template <simple::Mechanism M>
struct SimpleForward {
  const detail::AttentionParams& p;
  const simple::Extras x;
  template <class T>
  void operator()() const {
    launch_simple_forward<T, M>(p, x);
  }
};
template <simple::Mechanism M>
struct SimpleBackward {
  const detail::AttentionParams& p;
  const detail::GradientParams& g;
  const simple::Extras x;
  template <class T>
  void operator()() const {
    launch_simple_backward<T, M>(p, g, x);
  }
};

}  // namespace

void entmax_forward(const detail::AttentionParams& p, const detail::EntmaxConfig& cfg) {
  if (fused_path_applies(p, nullptr)) return dispatch_fused(p, FusedEntmaxForward{p, cfg});
  dispatch_simple(p, SimpleForward<simple::Mechanism::entmax>{p, entmax_extras(cfg)});
}

void entmax_backward(const detail::AttentionParams& p, const detail::GradientParams& g,
                     const detail::EntmaxConfig& cfg) {
  if (fused_path_applies(p, &g)) return dispatch_fused(p, FusedEntmaxBackward{p, g, cfg});
  dispatch_simple(p, SimpleBackward<simple::Mechanism::entmax>{p, g, entmax_extras(cfg)});
}

void sieve_forward(const detail::AttentionParams& p, const detail::SieveConfig& cfg) {
  if (fused_path_applies(p, nullptr)) return dispatch_fused(p, FusedSieveForward{p, cfg});
  dispatch_simple(p, SimpleForward<simple::Mechanism::sieve>{p, sieve_extras(cfg)});
}

void sieve_backward(const detail::AttentionParams& p, const detail::GradientParams& g,
                    const detail::SieveConfig& cfg) {
  if (fused_path_applies(p, &g)) return dispatch_fused(p, FusedSieveBackward{p, g, cfg});
  dispatch_simple(p, SimpleBackward<simple::Mechanism::sieve>{p, g, sieve_extras(cfg)});
}

}  // namespace winnow::cuda
