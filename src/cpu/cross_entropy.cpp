// The masked cross-entropy on the CPU: a row per iteration; the loss added in row order, so the
// result does not depend on the thread count.
#include <omp.h>

#include <cmath>
#include <limits>
#include <vector>

#include "cpu/cpu.h"
#include "math/cross_entropy.h"

namespace winnow::cpu {
namespace {

template <class T>
void forward_rows(const detail::CrossEntropyParams& p) {
  const T* logits = static_cast<const T*>(p.logits);
  const T* mask = static_cast<const T*>(p.mask);
  T* lse = static_cast<T*>(p.lse);
  std::vector<double> terms(static_cast<std::size_t>(p.rows), 0.0);
  const int threads = p.num_threads > 0 ? p.num_threads : omp_get_max_threads();
#pragma omp parallel for num_threads(threads) schedule(static)
  for (std::int64_t n = 0; n < p.rows; ++n) {
    const T* x = logits + n * p.logits_row_stride;
    T m = -std::numeric_limits<T>::infinity();
    for (std::int64_t v = 0; v < p.cols; ++v) m = std::max(m, x[v]);
    T s = 0;
    for (std::int64_t v = 0; v < p.cols; ++v) s += std::exp(x[v] - m);
    lse[n] = math::cross_entropy::log_sum_exp(m, s);
    const T w = mask[n * p.mask_stride];
    if (w != 0) terms[n] = math::cross_entropy::row_loss(lse[n], x[p.targets[n * p.targets_stride]], w);
  }
  double total = 0;
  for (double t : terms) total += t;
  *static_cast<T*>(p.loss) = math::cross_entropy::divided(static_cast<T>(total), static_cast<const T*>(p.divisor));
}

template <class T>
void backward_rows(const detail::CrossEntropyParams& p) {
  const T* logits = static_cast<const T*>(p.logits);
  const T* mask = static_cast<const T*>(p.mask);
  const T* lse = static_cast<const T*>(p.lse);
  T* dlogits = static_cast<T*>(p.dlogits);
  const T dloss = math::cross_entropy::divided(*static_cast<const T*>(p.dloss), static_cast<const T*>(p.divisor));
  const int threads = p.num_threads > 0 ? p.num_threads : omp_get_max_threads();
#pragma omp parallel for num_threads(threads) schedule(static)
  for (std::int64_t n = 0; n < p.rows; ++n) {
    const T* x = logits + n * p.logits_row_stride;
    T* dx = dlogits + n * p.dlogits_row_stride;
    const T w = mask[n * p.mask_stride];
    if (w == 0) {
      for (std::int64_t v = 0; v < p.cols; ++v) dx[v] = 0;
      continue;
    }
    const std::int64_t target = p.targets[n * p.targets_stride];
    for (std::int64_t v = 0; v < p.cols; ++v) {
      dx[v] = math::cross_entropy::logit_grad(x[v], lse[n], v == target, dloss * w);
    }
  }
}

}  // namespace

void cross_entropy_forward(const detail::CrossEntropyParams& p) {
  if (p.logits_dtype == DType::float64) {
    forward_rows<double>(p);
  } else {
    forward_rows<float>(p);
  }
}

void cross_entropy_backward(const detail::CrossEntropyParams& p) {
  if (p.logits_dtype == DType::float64) {
    backward_rows<double>(p);
  } else {
    backward_rows<float>(p);
  }
}

}  // namespace winnow::cpu
