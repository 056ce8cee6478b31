// The rotation of one (x_i, x_{i+D/2}) pair, shared by the CPU and CUDA kernels.
#pragma once

#include "math/host_device.h"

namespace winnow::math::rotary {

// transpose: the inverse rotation times the same scale (sin negated): the adjoint.
template <class T>
WINNOW_HD void rotate(T x_low, T x_high, T cos, T sin, bool transpose, T& y_low, T& y_high) {
  const T s = transpose ? -sin : sin;
  y_low = x_low * cos - x_high * s;
  y_high = x_high * cos + x_low * s;
}

}  // namespace winnow::math::rotary
