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
// Defined once in threshold_search.cu for the fused path's types and head dimensions, so that
// entmax.cu and sieve.cu do not each compile the sweep kernels.
template <class T, int D>
void find_thresholds(const detail::AttentionParams& p, ThresholdCudaConfig cfg);

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
