// SwiGLU's gate, the element-wise middle of a SwiGLU MLP, as one kernel each way:
//   y = silu(gate) up = gate sigmoid(gate) up,
//   dup = dy silu(gate),   dgate = dy up s (1 + gate (1 - s)),   s = sigmoid(gate).
// One pass over the (N, H) hidden activations instead of LibTorch's silu, multiply and their
// backward kernels. Arithmetic in float32 (float64 for float64 tensors).
#pragma once

#include "winnow/attention.h"

namespace winnow::swiglu {

// gate, up, y: (N, H), one dtype (float16 / bfloat16 / float32 / float64 on CUDA, float32 /
// float64 on the CPU), any strides; y apart from the inputs.
void forward(const TensorView& gate, const TensorView& up, const TensorView& y,
             const ExecContext& ctx = {});

// dy, dgate, dup: (N, H) in the same dtype; the outputs apart from the inputs and each other.
void backward(const TensorView& dy, const TensorView& gate, const TensorView& up,
              const TensorView& dgate, const TensorView& dup, const ExecContext& ctx = {});

}  // namespace winnow::swiglu
