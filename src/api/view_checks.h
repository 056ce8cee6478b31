// Argument checks the element-wise operators' APIs share (RMSNorm, SwiGLU): errors that name
// the operator, the argument, what was expected and what came.
#pragma once

#include <cstdint>
#include <string>

#include "winnow/error.h"
#include "winnow/attention.h"
#include "winnow/tensor.h"

namespace winnow::api {

[[noreturn]] inline void fail(const char* op, const std::string& arg, const std::string& expected,
                              const std::string& got, ErrorKind kind = ErrorKind::invalid_argument) {
  throw Error(kind, std::string(op) + ": argument '" + arg + "': expected " + expected + ", got " + got);
}

inline std::string describe(const TensorView& t) {
  return std::string(to_string(t.dtype)) + " " + t.shape_string() + " on " + to_string(t.device);
}

inline std::string describe(DType dtype, const std::string& shape, const Device& device) {
  return std::string(to_string(dtype)) + " " + shape + " on " + to_string(device);
}

// Row-major without gaps (sizes of 1 may have any stride).
inline bool contiguous(const TensorView& t) {
  std::int64_t expected = 1;
  for (int d = t.ndim - 1; d >= 0; --d) {
    if (t.shape[d] != 1 && t.stride[d] != expected) return false;
    expected *= t.shape[d];
  }
  return true;
}

inline void check_data(const char* op, const char* name, const TensorView& t) {
  if (t.data == nullptr && t.numel() > 0) fail(op, name, "a view with data", "a null pointer");
}

// Whether two views can touch a common byte.
inline bool overlaps(const TensorView& a, const TensorView& b) {
  if (a.numel() == 0 || b.numel() == 0) return false;
  const auto extent = [](const TensorView& t) {
    std::int64_t last = 0;
    for (int d = 0; d < t.ndim; ++d) last += (t.shape[d] - 1) * t.stride[d];
    return (last + 1) * static_cast<std::int64_t>(element_size(t.dtype));
  };
  const char* pa = static_cast<const char*>(a.data);
  const char* pb = static_cast<const char*>(b.data);
  if (!(pa < pb + extent(b) && pb < pa + extent(a))) return false;
  // Interleaved rows: two views of the same layout whose rows are side by side in one buffer
  // (the halves of a packed gate-and-up gradient) share a range but no byte. With unit column
  // strides and every outer stride a multiple of the row stride S, a view's elements lie at
  // residues [start, start + C) modulo S, so two views are apart when their residue intervals
  // are.
  const int n = a.ndim;
  if (n < 2 || b.ndim != n || a.dtype != b.dtype || a.stride[n - 1] != 1 || b.stride[n - 1] != 1) return true;
  const std::int64_t row = a.stride[n - 2], cols = a.shape[n - 1];
  if (row <= 0 || b.shape[n - 1] != cols || cols > row) return true;
  for (int d = 0; d < n - 1; ++d) {
    if (a.stride[d] != b.stride[d] || (a.shape[d] > 1 && a.stride[d] % row != 0) ||
        (b.shape[d] > 1 && b.stride[d] % row != 0)) {
      return true;
    }
  }
  const std::int64_t bytes = static_cast<std::int64_t>(pb - pa), size = element_size(a.dtype);
  if (bytes % size != 0) return true;
  const std::int64_t apart = ((bytes / size) % row + row) % row;
  return apart < cols || row - apart < cols;
}

// The device kinds and dtypes the element-wise kernels have: float32 / float64 on the CPU, every
// float dtype on CUDA (when this build has CUDA kernels).
inline void check_device(const char* op, const char* name, const TensorView& t) {
  if (!is_floating(t.dtype)) fail(op, name, "a floating-point tensor", describe(t));
  if (t.device.kind == DeviceKind::cpu && t.dtype != DType::float32 && t.dtype != DType::float64) {
    fail(op, name, "float32 or float64 on the CPU", describe(t), ErrorKind::unsupported);
  }
  if (t.device.kind == DeviceKind::cuda && !built_with_cuda()) {
    fail(op, name, "a CPU tensor (this build has no CUDA kernels)", describe(t), ErrorKind::unsupported);
  }
}

}  // namespace winnow::api
