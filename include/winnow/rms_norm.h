// RMSNorm as one kernel each way (the transformer's norm, spec/conventions.md's model layer):
//   rstd_n = 1 / sqrt(mean_c x_nc^2 + eps),   y_nc = x_nc rstd_n w_c,
// and its gradient
//   dx_nc = rstd_n (g_nc - x_nc rstd_n^2 mean_c(g_nc x_nc)),  g_nc = dy_nc w_c,
//   dw_c  = sum_n dy_nc x_nc rstd_n.
// The output may be narrower than the input: a float32 residual stream normalized straight into
// the bf16 operand of the next matrix product, with no cast in between. Statistics and
// arithmetic in float32 (float64 for float64 inputs).
#pragma once

#include "winnow/attention.h"

namespace winnow::rms_norm {

// x: (N, C) rows, any strides; float16 / bfloat16 / float32 / float64 on CUDA, float32 / float64
// on the CPU. weight: (C), float32 (float64 for float64 x), any stride. y: (N, C), any floating
// dtype the device has (float32 / float64 on the CPU), any strides, apart from x. rstd: (N),
// float32 (float64 for float64 x): saved for the backward.
void forward(const TensorView& x, const TensorView& weight, double eps, const TensorView& y,
             const TensorView& rstd, const ExecContext& ctx = {});

// dy: (N, C) in any floating dtype; x, weight and rstd as the forward took and gave them.
// dx: like x (dtype and shape, any strides); dweight: like weight, overwritten. The weight
// gradient is summed in a fixed order: bitwise repeatable.
void backward(const TensorView& dy, const TensorView& x, const TensorView& weight,
              const TensorView& rstd, const TensorView& dx, const TensorView& dweight,
              const ExecContext& ctx = {});

// The residual form, a transformer's residual add and the norm after it in one pass:
//   sum = x + residual,  y = rms_norm(sum).
// residual: (N, C) in y's dtype (the branch output of a bf16 product added to a float32 stream);
// sum: (N, C) in x's dtype, written (the stream's next value), apart from every other tensor.
void add_forward(const TensorView& x, const TensorView& residual, const TensorView& weight,
                 double eps, const TensorView& sum, const TensorView& y, const TensorView& rstd,
                 const ExecContext& ctx = {});

// Its gradient, given dy and the gradient dsum_in that reaches sum from its other uses (null:
// none): dx = dsum_in + the norm's input gradient at sum, written to dx (x's dtype) and again to
// dresidual (dy's dtype); dweight as backward's. sum and rstd are what add_forward wrote.
void add_backward(const TensorView& dy, const TensorView* dsum_in, const TensorView& sum,
                  const TensorView& weight, const TensorView& rstd, const TensorView& dx,
                  const TensorView& dresidual, const TensorView& dweight,
                  const ExecContext& ctx = {});

}  // namespace winnow::rms_norm
