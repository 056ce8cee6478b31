// Shared by entmax.cu and sieve.cu (separate files so the two compile in parallel): the row
// threshold search on the fused path, and per-row scratch buffers.
#pragma once

#include "cuda/attention/entmax_rows.cuh"
#include "cuda/launch_attention.cuh"

namespace winnow::cuda {

// A per-row buffer laid out like the row statistics: [row][head] of `width` elements, rows
// counted over the whole batch (packed mode indexes absolute rows, batched mode b and row).
inline detail::Operand row_buffer(const detail::AttentionParams& p, void* data, std::int64_t width) {
  detail::Operand o;
  o.data = data;
  o.head = width;
  o.row = p.heads_q * width;
  o.batch = p.cu_seqlens_q != nullptr ? 0 : p.len_q * o.row;
  o.dim = 1;
  return o;
}

inline ThresholdCudaConfig threshold_config(double alpha, double tolerance) {
  ThresholdCudaConfig c;
  c.alpha = static_cast<float>(alpha);
  c.tolerance = static_cast<float>(tolerance);
  return c;
}

// Runs the threshold sweeps (entmax_rows.cuh); cfg.result then holds each row's threshold.
// Between step sweeps one int comes back to the host: whether any row still moves.
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

// The simple path's launch for either mechanism (a warp per query row).
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

}  // namespace winnow::cuda
