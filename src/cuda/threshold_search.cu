// The threshold search of the fused path (entmax_rows.cuh), shared by entmax and Sieve.
#include "cuda/threshold_search.cuh"

namespace winnow::cuda {

// Between step sweeps one int comes back to the host: whether any row still moves.
template <class T, int D>
void find_thresholds(const detail::AttentionParams& p, ThresholdCudaConfig cfg) {
  const std::size_t rows = static_cast<std::size_t>(p.rows_q * p.heads_q);
  DeviceBuffer buffer(p, rows * sizeof(SavedSearch) + sizeof(int));
  cfg.state = row_buffer(p, buffer.as<void>(), 1);
  cfg.unfinished = reinterpret_cast<int*>(buffer.as<SavedSearch>() + rows);
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
  clear_flag();
  launch_fused_forward<T, D, ThresholdCollectRows>(p, cfg);
  if (!unfinished()) return;
  for (int step = 0; step < math::entmax::kMaxSearchSteps; ++step) {
    clear_flag();
    launch_fused_forward<T, D, ThresholdStepRows>(p, cfg);
    if (!unfinished()) return;
  }
}

template void find_thresholds<__nv_bfloat16, 64>(const detail::AttentionParams&, ThresholdCudaConfig);
template void find_thresholds<__nv_bfloat16, 128>(const detail::AttentionParams&, ThresholdCudaConfig);
template void find_thresholds<__half, 64>(const detail::AttentionParams&, ThresholdCudaConfig);
template void find_thresholds<__half, 128>(const detail::AttentionParams&, ThresholdCudaConfig);

}  // namespace winnow::cuda
