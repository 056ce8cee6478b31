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

}  // namespace

void forward(const TensorView& x, const TensorView& weight, double eps, const TensorView& y,
             const TensorView& rstd, const ExecContext& ctx) {
  constexpr const char* op = "winnow::rms_norm::forward";
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

void backward(const TensorView& dy, const TensorView& x, const TensorView& weight,
              const TensorView& rstd, const TensorView& dx, const TensorView& dweight,
              const ExecContext& ctx) {
  constexpr const char* op = "winnow::rms_norm::backward";
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
  p.num_threads = ctx.num_threads;
  p.cuda_stream = ctx.cuda_stream;
  p.allocator = ctx.allocator;
  if (x.device.kind == DeviceKind::cuda) {
    cuda::rms_norm_backward(p);
  } else {
    cpu::rms_norm_backward(p);
  }
}

}  // namespace winnow::rms_norm
