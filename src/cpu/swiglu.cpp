// SwiGLU's gate on the CPU: a row per iteration.
#include <omp.h>

#include "cpu/cpu.h"
#include "math/swiglu.h"

namespace winnow::cpu {
namespace {

template <class T>
void forward_rows(const detail::SwiGLUParams& p) {
  const T* gate = static_cast<const T*>(p.gate);
  const T* up = static_cast<const T*>(p.up);
  T* y = static_cast<T*>(p.y);
  const int threads = p.num_threads > 0 ? p.num_threads : omp_get_max_threads();
#pragma omp parallel for num_threads(threads) schedule(static)
  for (std::int64_t n = 0; n < p.rows; ++n) {
    for (std::int64_t c = 0; c < p.cols; ++c) {
      y[n * p.y_stride[0] + c * p.y_stride[1]] = math::swiglu::forward(
          gate[n * p.gate_stride[0] + c * p.gate_stride[1]], up[n * p.up_stride[0] + c * p.up_stride[1]]);
    }
  }
}

template <class T>
void backward_rows(const detail::SwiGLUParams& p) {
  const T* gate = static_cast<const T*>(p.gate);
  const T* up = static_cast<const T*>(p.up);
  const T* dy = static_cast<const T*>(p.dy);
  T* dgate = static_cast<T*>(p.dgate);
  T* dup = static_cast<T*>(p.dup);
  const int threads = p.num_threads > 0 ? p.num_threads : omp_get_max_threads();
#pragma omp parallel for num_threads(threads) schedule(static)
  for (std::int64_t n = 0; n < p.rows; ++n) {
    for (std::int64_t c = 0; c < p.cols; ++c) {
      math::swiglu::backward(gate[n * p.gate_stride[0] + c * p.gate_stride[1]],
                             up[n * p.up_stride[0] + c * p.up_stride[1]],
                             dy[n * p.y_stride[0] + c * p.y_stride[1]],
                             dgate[n * p.dgate_stride[0] + c * p.dgate_stride[1]],
                             dup[n * p.dup_stride[0] + c * p.dup_stride[1]]);
    }
  }
}

}  // namespace

void swiglu_forward(const detail::SwiGLUParams& p) {
  if (p.dtype == DType::float64) {
    forward_rows<double>(p);
  } else {
    forward_rows<float>(p);
  }
}

void swiglu_backward(const detail::SwiGLUParams& p) {
  if (p.dtype == DType::float64) {
    backward_rows<double>(p);
  } else {
    backward_rows<float>(p);
  }
}

}  // namespace winnow::cpu
