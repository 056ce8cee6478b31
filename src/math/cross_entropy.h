// The masked cross-entropy of a language model's logits (winnow/cross_entropy.h), shared by the
// CPU and CUDA kernels.
#pragma once

#include <cmath>

#include "math/host_device.h"

namespace winnow::math::cross_entropy {

// log sum_v exp(x_v) from the row's maximum and sum_v exp(x_v - max).
template <class T>
WINNOW_HD T log_sum_exp(T max, T sum_of_exp) {
  using std::log;
  return max + log(sum_of_exp);
}

// A row's term of the loss: mask (lse - x_target).
template <class T>
WINNOW_HD T row_loss(T lse, T target_logit, T mask) {
  return mask * (lse - target_logit);
}

// The loss divided by the caller's divisor (a mean over positions counted elsewhere, such as the
// whole batch of every rank), and the gradient arriving at the sum: the same two roundings as
// dividing the sum afterwards, in the kernels instead of two launches of their own.
template <class T>
WINNOW_HD T divided(T value, const T* divisor) {
  return divisor != nullptr ? value / *divisor : value;
}

// d loss / d x_v = dloss mask (softmax_v - [v is the target]), with scale = dloss * mask.
template <class T>
WINNOW_HD T logit_grad(T x, T lse, bool is_target, T scale) {
  using std::exp;
  return scale * (exp(x - lse) - (is_target ? T(1) : T(0)));
}

}  // namespace winnow::math::cross_entropy
