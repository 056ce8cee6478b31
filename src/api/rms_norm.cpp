#include "winnow/rms_norm.h"

#include <string>

#include "api/view_checks.h"
#include "core/layer_params.h"
#include "cpu/cpu.h"
#include "cuda/cuda.h"
#include "winnow/error.h"

namespace winnow::rms_norm {
namespace {

using api::check_data;
using api::describe;
using api::fail;
using api::overlaps;

std::string expected(DType dtype, const std::string& shape, const Device& device) {
  return describe(dtype, shape, device);
}

std::string shape_of(std::int64_t n, std::int64_t c) {
  return "(" + std::to_string(n) + ", " + std::to_string(c) + ")";
}

// What forward and backward both check of x and weight; returns the statistics' dtype.
DType check_x_and_weight(const char* op, const TensorView& x, const TensorView& weight) {
  if (x.ndim != 2) fail(op, "x", "an (N, C) tensor", describe(x));
  api::check_device(op, "x", x);
  if (x.shape[1] < 1) fail(op, "x", "at least one column", describe(x));
  const DType stat = x.dtype == DType::float64 ? DType::float64 : DType::float32;
  if (weight.ndim != 1 || weight.shape[0] != x.shape[1] || weight.dtype != stat ||
      weight.device != x.device) {
    fail(op, "weight", expected(stat, "(" + std::to_string(x.shape[1]) + ")", x.device), describe(weight));
  }
  check_data(op, "x", x);
  check_data(op, "weight", weight);
  return stat;
}

void check_rows(const char* op, const char* name, const TensorView& t, DType dtype,
                const TensorView& x) {
  if (t.ndim != 2 || t.shape[0] != x.shape[0] || t.shape[1] != x.shape[1] || t.dtype != dtype ||
      t.device != x.device) {
    fail(op, name, expected(dtype, shape_of(x.shape[0], x.shape[1]), x.device), describe(t));
  }
  check_data(op, name, t);
}

void check_stat(const char* op, const char* name, const TensorView& t, DType dtype,
                std::int64_t n, const Device& device) {
  if (t.ndim != 1 || t.shape[0] != n || t.dtype != dtype || t.device != device) {
    fail(op, name, expected(dtype, "(" + std::to_string(n) + ")", device), describe(t));
  }
  check_data(op, name, t);
}


// forward and add_forward: residual and sum are null for the plain norm.
void run_forward(const char* op, const TensorView& x, const TensorView* residual,
                 const TensorView& weight, double eps, const TensorView* sum, const TensorView& y,
                 const TensorView& rstd, const ExecContext& ctx) {
  const DType stat = check_x_and_weight(op, x, weight);
  if (!(eps >= 0)) fail(op, "eps", ">= 0", std::to_string(eps));
  if (!is_floating(y.dtype)) fail(op, "y", "a floating-point tensor", describe(y));
  check_rows(op, "y", y, y.dtype, x);
  if (x.device.kind == DeviceKind::cpu && y.dtype != x.dtype) {
    fail(op, "y", std::string(to_string(x.dtype)) + " (x's dtype) on the CPU", describe(y),
         ErrorKind::unsupported);
  }
  if ((y.dtype == DType::float64) != (x.dtype == DType::float64)) {
    fail(op, "y", "float64 exactly when x is float64", describe(y), ErrorKind::unsupported);
  }
  check_stat(op, "rstd", rstd, stat, x.shape[0], x.device);
  if (overlaps(y, x) || overlaps(y, rstd) || overlaps(y, weight) || overlaps(rstd, x) ||
      overlaps(rstd, weight)) {
    fail(op, overlaps(y, x) || overlaps(y, rstd) || overlaps(y, weight) ? "y" : "rstd",
         "memory apart from the inputs and the other output", "an overlapping view");
  }
  if (residual != nullptr) {
    check_rows(op, "residual", *residual, y.dtype, x);
    check_rows(op, "sum", *sum, x.dtype, x);
    for (const TensorView* other : {&x, residual, &weight, &y, &rstd}) {
      if (overlaps(*sum, *other)) {
        fail(op, "sum", "memory apart from the inputs and the other outputs", "an overlapping view");
      }
    }
    if (overlaps(y, *residual) || overlaps(rstd, *residual)) {
      fail(op, overlaps(y, *residual) ? "y" : "rstd", "memory apart from the inputs and the other output",
           "an overlapping view");
    }
  }

  detail::RMSNormParams p;
  p.x = x.data;
  p.weight = weight.data;
  p.y = y.data;
  p.rstd = rstd.data;
  p.x_dtype = x.dtype;
  p.y_dtype = y.dtype;
  p.stat_dtype = stat;
  p.rows = x.shape[0];
  p.cols = x.shape[1];
  for (int d = 0; d < 2; ++d) {
    p.x_stride[d] = x.stride[d];
    p.y_stride[d] = y.stride[d];
  }
  p.weight_stride = weight.stride[0];
  p.rstd_stride = rstd.stride[0];
  if (residual != nullptr) {
    p.residual = residual->data;
    p.sum = sum->data;
    for (int d = 0; d < 2; ++d) {
      p.residual_stride[d] = residual->stride[d];
      p.sum_stride[d] = sum->stride[d];
    }
  }
  p.eps = eps;
  p.num_threads = ctx.num_threads;
  p.cuda_stream = ctx.cuda_stream;
  p.allocator = ctx.allocator;
  if (p.rows == 0) return;
  if (x.device.kind == DeviceKind::cuda) {
    cuda::rms_norm_forward(p);
  } else {
    cpu::rms_norm_forward(p);
  }
}

// backward and add_backward: dsum_in and dresidual are null for the plain norm (dsum_in may be
// null for the residual form too).
void run_backward(const char* op, const TensorView& dy, const TensorView* dsum_in,
                  const TensorView& x, const TensorView& weight, const TensorView& rstd,
                  const TensorView& dx, const TensorView* dresidual, const TensorView& dweight,
                  const ExecContext& ctx) {
  const DType stat = check_x_and_weight(op, x, weight);
  if (!is_floating(dy.dtype)) fail(op, "dy", "a floating-point tensor", describe(dy));
  check_rows(op, "dy", dy, dy.dtype, x);
  if (x.device.kind == DeviceKind::cpu && dy.dtype != x.dtype) {
    fail(op, "dy", std::string(to_string(x.dtype)) + " (x's dtype) on the CPU", describe(dy),
         ErrorKind::unsupported);
  }
  if ((dy.dtype == DType::float64) != (x.dtype == DType::float64)) {
    fail(op, "dy", "float64 exactly when x is float64", describe(dy), ErrorKind::unsupported);
  }
  check_stat(op, "rstd", rstd, stat, x.shape[0], x.device);
  check_rows(op, "dx", dx, x.dtype, x);
  check_stat(op, "dweight", dweight, stat, x.shape[1], x.device);
  for (const TensorView* in : {&dy, &x, &weight, &rstd}) {
    if (overlaps(dx, *in) || overlaps(dx, dweight)) {
      fail(op, "dx", "memory apart from the inputs and dweight", "an overlapping view");
    }
    if (overlaps(dweight, *in)) fail(op, "dweight", "memory apart from the inputs", "an overlapping view");
  }
  if (dsum_in != nullptr) {
    check_rows(op, "dsum_in", *dsum_in, x.dtype, x);
    if (overlaps(dx, *dsum_in) || overlaps(dweight, *dsum_in)) {
      fail(op, overlaps(dx, *dsum_in) ? "dx" : "dweight", "memory apart from the inputs", "an overlapping view");
    }
  }
  if (dresidual != nullptr) {
    check_rows(op, "dresidual", *dresidual, dy.dtype, x);
    for (const TensorView* other : {&dy, &x, &weight, &rstd, &dx, &dweight}) {
      if (overlaps(*dresidual, *other) || (dsum_in != nullptr && overlaps(*dresidual, *dsum_in))) {
        fail(op, "dresidual", "memory apart from the inputs and the other outputs", "an overlapping view");
      }
    }
  }

  detail::RMSNormParams p;
  p.x = x.data;
  p.weight = weight.data;
  p.rstd = rstd.data;
  p.dy = dy.data;
  p.dx = dx.data;
  p.dweight = dweight.data;
  p.x_dtype = x.dtype;
  p.y_dtype = dy.dtype;
  p.stat_dtype = stat;
  p.rows = x.shape[0];
  p.cols = x.shape[1];
  for (int d = 0; d < 2; ++d) {
    p.x_stride[d] = x.stride[d];
    p.y_stride[d] = dy.stride[d];
    p.dx_stride[d] = dx.stride[d];
  }
  p.weight_stride = weight.stride[0];
  p.rstd_stride = rstd.stride[0];
  p.dweight_stride = dweight.stride[0];
  if (dsum_in != nullptr) {
    p.dsum_in = dsum_in->data;
    for (int d = 0; d < 2; ++d) p.dsum_in_stride[d] = dsum_in->stride[d];
  }
  if (dresidual != nullptr) {
    p.dresidual = dresidual->data;
    for (int d = 0; d < 2; ++d) p.dresidual_stride[d] = dresidual->stride[d];
  }
  p.num_threads = ctx.num_threads;
  p.cuda_stream = ctx.cuda_stream;
  p.allocator = ctx.allocator;
  if (x.device.kind == DeviceKind::cuda) {
    cuda::rms_norm_backward(p);
  } else {
    cpu::rms_norm_backward(p);
  }
}

}  // namespace

void forward(const TensorView& x, const TensorView& weight, double eps, const TensorView& y,
             const TensorView& rstd, const ExecContext& ctx) {
  run_forward("winnow::rms_norm::forward", x, nullptr, weight, eps, nullptr, y, rstd, ctx);
}

void add_forward(const TensorView& x, const TensorView& residual, const TensorView& weight,
                 double eps, const TensorView& sum, const TensorView& y, const TensorView& rstd,
                 const ExecContext& ctx) {
  run_forward("winnow::rms_norm::add_forward", x, &residual, weight, eps, &sum, y, rstd, ctx);
}

void backward(const TensorView& dy, const TensorView& x, const TensorView& weight,
              const TensorView& rstd, const TensorView& dx, const TensorView& dweight,
              const ExecContext& ctx) {
  run_backward("winnow::rms_norm::backward", dy, nullptr, x, weight, rstd, dx, nullptr, dweight, ctx);
}

void add_backward(const TensorView& dy, const TensorView* dsum_in, const TensorView& sum,
                  const TensorView& weight, const TensorView& rstd, const TensorView& dx,
                  const TensorView& dresidual, const TensorView& dweight, const ExecContext& ctx) {
  run_backward("winnow::rms_norm::add_backward", dy, dsum_in, sum, weight, rstd, dx, &dresidual,
               dweight, ctx);
}

}  // namespace winnow::rms_norm
