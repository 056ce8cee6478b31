// Shared by entmax.cu and sieve.cu (separate files so the two compile in parallel): the row
// threshold search on the fused path, and per-row scratch buffers.
#pragma once

#include <functional>

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

// Whether a forward may take the fused threshold search: the fused path, with a positive scale
// (the search keeps raw scores q . k, whose largest are the largest x only then). Other scales
// run on the simple path; the backward's fused kernels take any scale. small_dims: head
// dimensions 16 and 32 too (fused_path_applies), for Sieve.
inline bool threshold_search_applies(const detail::AttentionParams& p, bool small_dims = false) {
  return fused_path_applies(p, nullptr, small_dims) && p.scale > 0.0;
}

inline ThresholdCudaConfig threshold_config(double alpha, double tolerance) {
  ThresholdCudaConfig c;
  c.alpha = static_cast<float>(alpha);
  c.tolerance = static_cast<float>(tolerance);
  return c;
}

// The key tiles an output sweep after the threshold search visits (key_tiles.cuh): the first
// threshold sweep records the tile-max map into map(); select() then marks the cells whose
// largest score clears the smallest threshold of their block. Owns the map and the bits, which
// the sweeps launched after a select() read: keep it alive until they are enqueued.
// WINNOW_DENSE_KEY_TILES set in the environment turns skipping off (every tile is visited),
// for comparison.
class LiveTileSelection {
 public:
  explicit LiveTileSelection(const detail::AttentionParams& p);
  const TileMaxMap& map() const { return map_; }
  // threshold: float per row, in units of score_to_threshold * q . k (entmax's tau: the scale
  // times alpha - 1; Sieve's threshold: the scale).
  LiveKeyTiles select(const detail::Operand& threshold, float score_to_threshold);
  // The same against the floors of searches in progress (SavedSearch per row, x units).
  LiveKeyTiles select_above_floors(const detail::Operand& state, float score_to_x);

 private:
  template <class Thresholds>
  LiveKeyTiles select_by(const Thresholds& threshold, float score_to_threshold);

  const detail::AttentionParams& p_;
  bool enabled_;
  int words_ = 0;
  DeviceBuffer buffer_;
  TileMaxMap map_;
};

// Runs the threshold sweeps (entmax_rows.cuh) and enqueues output_sweep (which reads
// cfg.result, each row's threshold, and may select tiles by the first sweep's tile-max map),
// possibly twice: see threshold_search.cu. Defined once in threshold_search.cu for the fused
// path's types and head dimensions, so that entmax.cu and sieve.cu do not each compile the
// sweep kernels.
// What the sweeps counted of the rows' supports (ThresholdCudaConfig::support_totals), when
// asked: known only when the collect sweep settled every row it saw.
struct CountedSupport {
  bool known = false;
  std::int64_t entries = 0;  // sum of the rows' support sizes, each at most the list length
  bool overflow = false;     // some row's support is longer than its list
};

// Finds each row's threshold and calls output_sweep to launch the sweep that uses it (again,
// in the rare call where the search needed step sweeps). beside_first_sweep, when given, is
// called once the first sweep is launched: work for the host (or a side stream) while the GPU
// runs it.
template <class T, int D>
void find_thresholds(const detail::AttentionParams& p, ThresholdCudaConfig cfg, LiveTileSelection& tiles,
                     const std::function<void()>& output_sweep, CountedSupport* counted = nullptr,
                     const std::function<void()>& beside_first_sweep = {});

// One sweep of the search on the forward kernel (entmax_rows.cuh: ThresholdStartRows,
// ThresholdCollectRows, ThresholdStepRows). find_thresholds' control flow is one function in
// threshold_search.cu; the sweeps' kernels, most of the search's compile time, are compiled per
// element type in threshold_search_bf16.cu and threshold_search_fp16.cu, in parallel.
// collect_to_pool: the collect sweep filing into the pool (ThresholdCollectToPoolRows) where the
// Hopper kernel runs, else the one with lists in shared memory (which then publishes them).
enum class ThresholdSweep { start, collect, collect_to_pool, step };
template <class T, int D>
void launch_threshold_sweep(ThresholdSweep sweep, const detail::AttentionParams& p, const ThresholdCudaConfig& cfg,
                            const LiveKeyTiles& live) {
  switch (sweep) {
    case ThresholdSweep::start: return launch_fused_forward<T, D, ThresholdStartRows>(p, cfg, live);
    case ThresholdSweep::collect_to_pool:
      if constexpr (kHopperDim<D>) {
        if (launch_sm90_forward<T, D, ThresholdCollectToPoolRows>(p, cfg, live)) return;
      }
      [[fallthrough]];
    case ThresholdSweep::collect: return launch_fused_forward<T, D, ThresholdCollectRows>(p, cfg, live);
    case ThresholdSweep::step: return launch_fused_forward<T, D, ThresholdStepRows>(p, cfg, live);
  }
}
// The instantiations: entmax's and Sieve's head dimensions 64 and 128, and Sieve's 16 and 32 (on
// the portable kernels); extern here, defined in the file of their element type (which may
// follow the declaration).
#define WINNOW_THRESHOLD_SWEEP(EXTERN, T, D)                                                  \
  EXTERN template void launch_threshold_sweep<T, D>(ThresholdSweep, const detail::AttentionParams&, \
                                                    const ThresholdCudaConfig&, const LiveKeyTiles&);
#define WINNOW_THRESHOLD_SWEEPS(EXTERN, T) \
  WINNOW_THRESHOLD_SWEEP(EXTERN, T, 16)    \
  WINNOW_THRESHOLD_SWEEP(EXTERN, T, 32)    \
  WINNOW_THRESHOLD_SWEEP(EXTERN, T, 64)    \
  WINNOW_THRESHOLD_SWEEP(EXTERN, T, 128)
WINNOW_THRESHOLD_SWEEPS(extern, __nv_bfloat16)
WINNOW_THRESHOLD_SWEEPS(extern, __half)

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
