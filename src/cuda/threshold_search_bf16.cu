// The threshold search's sweeps for __nv_bfloat16 rows (threshold_search.cuh: launch_threshold_sweep).
#include "cuda/threshold_search.cuh"

namespace winnow::cuda {

WINNOW_THRESHOLD_SWEEPS(, __nv_bfloat16)

}  // namespace winnow::cuda
