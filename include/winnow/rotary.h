// Rotary position embedding (spec/softmax.md, RoPE and its scalings) as one kernel: the
// pairs (i, i + D/2) of every head vector turn by their position's angles,
//   y_i       = x_i cos_li - x_{i+D/2} sin_li,
//   y_{i+D/2} = x_{i+D/2} cos_li + x_i sin_li,        i < D/2, l the token's position,
// with cos and sin tables that carry any attention factor (YaRN's). The model layer builds the
// tables; this rotates queries and keys in one pass instead of a chain of element-wise
// operations, and its transpose (rotation by -angle) is the backward.
#pragma once

#include "winnow/attention.h"

namespace winnow::rotary {

// x and out: (B, L, H, D), D even, same dtype (float16 / bfloat16 / float32 / float64 on CUDA,
// float32 / float64 on the CPU) and device; x any strides, out may not overlap x unless it is
// x itself. cos and sin: (L, D/2), float64 for float64 x and float32 otherwise, any strides.
// transpose: multiply by the transposed rotation (sin negated): the gradient of the forward.
// Arithmetic in the tables' precision.
void apply(const TensorView& x, const TensorView& cos, const TensorView& sin, bool transpose,
           const TensorView& out, const ExecContext& ctx = {});

}  // namespace winnow::rotary
