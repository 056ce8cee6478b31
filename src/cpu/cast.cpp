// The casting concatenation on the CPU (float32 and float64): an element per iteration.
#include <omp.h>

#include "cpu/cpu.h"

namespace winnow::cpu {
namespace {

template <class From, class To>
void copy_segments(const detail::CastParams& p) {
  To* out = static_cast<To*>(p.destination);
  const int threads = p.num_threads > 0 ? p.num_threads : omp_get_max_threads();
  for (const detail::CastSegment& s : p.segments) {
    const From* in = static_cast<const From*>(s.source);
#pragma omp parallel for num_threads(threads) schedule(static) if (s.count > 65536)
    for (std::int64_t i = 0; i < s.count; ++i) out[s.offset + i] = static_cast<To>(in[i]);
  }
}

template <class From>
void from(const detail::CastParams& p) {
  if (p.destination_dtype == DType::float64) {
    copy_segments<From, double>(p);
  } else {
    copy_segments<From, float>(p);
  }
}

}  // namespace

void cast_concatenate(const detail::CastParams& p) {
  if (p.source_dtype == DType::float64) {
    from<double>(p);
  } else {
    from<float>(p);
  }
}

}  // namespace winnow::cpu
