// The threshold search's sweeps for __half rows (threshold_search.cuh: launch_threshold_sweep).
#include "cuda/threshold_search.cuh"

namespace winnow::cuda {

WINNOW_THRESHOLD_SWEEPS(, __half)

}  // namespace winnow::cuda
