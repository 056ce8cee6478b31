// What the attention CUDA tests compare against: the float64 reference run on the inputs
// rounded to the kernel's dtype, within spec/conventions.md's tolerance for that dtype.
#pragma once

#include "support/attention_case.h"

namespace winnow::testing {

// The problem's inputs rounded to dtype: the reference then sees what the kernel sees.
inline Problem rounded(const Problem& p, DType dtype) {
  Problem r = p;
  for (HostTensor* t : {&r.q, &r.k, &r.v, &r.dout}) *t = t->converted(dtype).converted(DType::float64);
  r.dstat = r.dstat.converted(DType::float32).converted(DType::float64);
  return r;
}

inline double tolerance(DType dtype) {
  switch (dtype) {
    case DType::bfloat16: return 2e-2;
    case DType::float16: return 5e-3;
    default: return 1e-5;
  }
}

}  // namespace winnow::testing
