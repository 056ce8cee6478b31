// RMSNorm on the CPU (and its residual form): a row per iteration; the weight gradient summed
// over fixed chunks of rows and then over the chunks in order, so that it does not depend on the
// thread count.
#include <omp.h>

#include <algorithm>
#include <vector>

#include "cpu/cpu.h"
#include "math/rms_norm.h"

namespace winnow::cpu {
namespace {

constexpr std::int64_t kRowsPerChunk = 64;

template <class T>
void forward_rows(const detail::RMSNormParams& p) {
  using Out = T;  // the CPU writes y in x's dtype (checked by the API)
  const T* x = static_cast<const T*>(p.x);
  const T* w = static_cast<const T*>(p.weight);
  Out* y = static_cast<Out*>(p.y);
  T* rstd = static_cast<T*>(p.rstd);
  const std::int64_t C = p.cols;
  const int threads = p.num_threads > 0 ? p.num_threads : omp_get_max_threads();
#pragma omp parallel for num_threads(threads) schedule(static)
  for (std::int64_t n = 0; n < p.rows; ++n) {
    const T* xr = x + n * p.x_stride[0];
    if (p.residual != nullptr) {
      // The residual form normalizes sum = x + residual, written first and read back.
      const T* rr = static_cast<const T*>(p.residual) + n * p.residual_stride[0];
      T* sr = static_cast<T*>(p.sum) + n * p.sum_stride[0];
      for (std::int64_t c = 0; c < C; ++c) {
        sr[c * p.sum_stride[1]] = xr[c * p.x_stride[1]] + rr[c * p.residual_stride[1]];
      }
      xr = sr;
    }
    const std::int64_t xs = p.residual != nullptr ? p.sum_stride[1] : p.x_stride[1];
    T sum = 0;
    for (std::int64_t c = 0; c < C; ++c) sum += xr[c * xs] * xr[c * xs];
    const T r = math::rms_norm::inverse_rms(sum, static_cast<T>(C), static_cast<T>(p.eps));
    rstd[n * p.rstd_stride] = r;
    Out* yr = y + n * p.y_stride[0];
    for (std::int64_t c = 0; c < C; ++c) yr[c * p.y_stride[1]] = xr[c * xs] * r * w[c * p.weight_stride];
  }
}

template <class T>
void backward_rows(const detail::RMSNormParams& p) {
  const T* x = static_cast<const T*>(p.x);
  const T* w = static_cast<const T*>(p.weight);
  const T* dy = static_cast<const T*>(p.dy);
  const T* rstd = static_cast<const T*>(p.rstd);
  T* dx = static_cast<T*>(p.dx);
  T* dw = static_cast<T*>(p.dweight);
  const std::int64_t C = p.cols, chunks = (p.rows + kRowsPerChunk - 1) / kRowsPerChunk;
  std::vector<T> partial(static_cast<std::size_t>(chunks * C), T(0));
  const int threads = p.num_threads > 0 ? p.num_threads : omp_get_max_threads();
#pragma omp parallel for num_threads(threads) schedule(static)
  for (std::int64_t chunk = 0; chunk < chunks; ++chunk) {
    T* part = partial.data() + chunk * C;
    const std::int64_t end = std::min(p.rows, (chunk + 1) * kRowsPerChunk);
    for (std::int64_t n = chunk * kRowsPerChunk; n < end; ++n) {
      const T* xr = x + n * p.x_stride[0];
      const T* dyr = dy + n * p.y_stride[0];
      const T r = rstd[n * p.rstd_stride];
      T sum_gx = 0;
      for (std::int64_t c = 0; c < C; ++c) {
        const T xc = xr[c * p.x_stride[1]], dyc = dyr[c * p.y_stride[1]];
        sum_gx += dyc * w[c * p.weight_stride] * xc;
        part[c] += dyc * xc * r;
      }
      const T mean_gx = sum_gx / static_cast<T>(C);
      T* dxr = dx + n * p.dx_stride[0];
      const T* din = p.dsum_in ? static_cast<const T*>(p.dsum_in) + n * p.dsum_in_stride[0] : nullptr;
      T* drr = p.dresidual ? static_cast<T*>(p.dresidual) + n * p.dresidual_stride[0] : nullptr;
      for (std::int64_t c = 0; c < C; ++c) {
        T d = math::rms_norm::input_grad(dyr[c * p.y_stride[1]] * w[c * p.weight_stride],
                                         xr[c * p.x_stride[1]], r, mean_gx);
        if (din != nullptr) d += din[c * p.dsum_in_stride[1]];
        dxr[c * p.dx_stride[1]] = d;
        if (drr != nullptr) drr[c * p.dresidual_stride[1]] = d;
      }
    }
  }
  for (std::int64_t c = 0; c < C; ++c) {
    T sum = 0;
    for (std::int64_t chunk = 0; chunk < chunks; ++chunk) sum += partial[chunk * C + c];
    dw[c * p.dweight_stride] = sum;
  }
}

}  // namespace

void rms_norm_forward(const detail::RMSNormParams& p) {
  if (p.x_dtype == DType::float64) {
    forward_rows<double>(p);
  } else {
    forward_rows<float>(p);
  }
}

void rms_norm_backward(const detail::RMSNormParams& p) {
  if (p.x_dtype == DType::float64) {
    backward_rows<double>(p);
  } else {
    backward_rows<float>(p);
  }
}

}  // namespace winnow::cpu
