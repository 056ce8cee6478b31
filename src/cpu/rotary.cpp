// Rotary position embedding on the CPU: one (b, l, h) head vector per iteration.
#include <omp.h>

#include "cpu/cpu.h"
#include "math/rotary.h"

namespace winnow::cpu {
namespace {

template <class T>
void rotate_all(const detail::RotaryParams& p) {
  const T* x = static_cast<const T*>(p.x);
  T* out = static_cast<T*>(p.out);
  const T* cos = static_cast<const T*>(p.cos);
  const T* sin = static_cast<const T*>(p.sin);
  const std::int64_t rows = p.batch * p.length * p.heads, half = p.half;
  const int threads = p.num_threads > 0 ? p.num_threads : omp_get_max_threads();
#pragma omp parallel for num_threads(threads) schedule(static)
  for (std::int64_t r = 0; r < rows; ++r) {
    const std::int64_t h = r % p.heads, l = (r / p.heads) % p.length, b = r / (p.heads * p.length);
    const T* xr = x + b * p.x_stride[0] + l * p.x_stride[1] + h * p.x_stride[2];
    T* outr = out + b * p.out_stride[0] + l * p.out_stride[1] + h * p.out_stride[2];
    const T* c = cos + l * p.table_stride[0];
    const T* s = sin + l * p.table_stride[0];
    for (std::int64_t i = 0; i < half; ++i) {
      T low, high;
      math::rotary::rotate(xr[i * p.x_stride[3]], xr[(i + half) * p.x_stride[3]],
                           c[i * p.table_stride[1]], s[i * p.table_stride[1]], p.transpose, low, high);
      outr[i * p.out_stride[3]] = low;
      outr[(i + half) * p.out_stride[3]] = high;
    }
  }
}

}  // namespace

void rotary(const detail::RotaryParams& p) {
  if (p.dtype == DType::float64) {
    rotate_all<double>(p);
  } else {
    rotate_all<float>(p);
  }
}

}  // namespace winnow::cpu
