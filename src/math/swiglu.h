// SwiGLU's gate (winnow/swiglu.h), shared by the CPU and CUDA kernels.
#pragma once

#include "math/elementwise.h"
#include "math/host_device.h"

namespace winnow::math::swiglu {

template <class T>
WINNOW_HD T forward(T gate, T up) {
  return gate * sigmoid(gate) * up;
}

// silu'(g) = s + g s (1 - s) = s (1 + g (1 - s)).
template <class T>
WINNOW_HD void backward(T gate, T up, T dy, T& dgate, T& dup) {
  const T s = sigmoid(gate);
  dup = dy * gate * s;
  dgate = dy * up * s * (T(1) + gate * (T(1) - s));
}

}  // namespace winnow::math::swiglu
