#include <omp.h>

#include "cpu/tiles.h"

namespace winnow::cpu {

int thread_count(const AttentionParams& p) {
  return p.num_threads > 0 ? p.num_threads : omp_get_max_threads();
}

}  // namespace winnow::cpu
