// The only place where LibTorch tensors meet winnow: views of at::Tensor, and the translation
// of winnow::Error into the exceptions PyTorch users expect.
#pragma once

#include <ATen/ATen.h>
#include <torch/version.h>

#include <optional>
#include <string>

#include "winnow/winnow.h"

namespace winnow::torch_ops {

// The optional type LibTorch's operator schemas bind to (std::optional from 2.4 on).
#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 4)
template <class T>
using Opt = std::optional<T>;
#else
template <class T>
using Opt = c10::optional<T>;
#endif

// A view of t's memory (no copy). `op` and `name` label the error if t cannot be viewed.
TensorView view_of(const at::Tensor& t, const char* op, const char* name);
std::optional<TensorView> view_of(const c10::optional<at::Tensor>& t, const char* op,
                                  const char* name);

// How a kernel call on q's device runs: for CUDA tensors, q's device made current for the
// scope, its current stream, and LibTorch's caching allocator for temporary buffers.
class DeviceScope {
 public:
  explicit DeviceScope(const at::Tensor& q);
  ~DeviceScope();
  DeviceScope(const DeviceScope&) = delete;
  DeviceScope& operator=(const DeviceScope&) = delete;
  ExecContext context(bool deterministic, bool reference) const;

 private:
  const at::Tensor& q_;
  int previous_device_ = -1;
};

// parts as one tensor concatenated along the last dimension, when they already lie so in one
// buffer (same dtype, leading sizes and strides, unit column stride, each starting where the
// one before ends in a row): a view, no copy. Undefined otherwise, if any part is, or if any
// has symbolic sizes (traced by torch.compile), whose offsets cannot be compared.
at::Tensor side_by_side(at::TensorList parts);

// Attention operands (B, L, H_i, D_i) whose heads lie side by side in each row of one buffer,
// in the order given (nn::project's q, k and v, split from one product): the (B, L, sum H_i
// D_i) view of those rows. Undefined otherwise, or for tensors that hold no data of their own
// (traced by torch.compile: fake, functional or meta tensors), which the kernels cannot be
// called on directly.
at::Tensor heads_side_by_side(at::TensorList parts);

// Empty gradients of the shapes of q, k and v in one fresh buffer, their heads side by side in
// each row in that order: what the projection's backward reads as one tensor instead of
// concatenating three.
std::tuple<at::Tensor, at::Tensor, at::Tensor> packed_grads(const at::Tensor& q, const at::Tensor& k,
                                                            const at::Tensor& v);

// Per-row statistics dtype: float64 for float64 inputs, float32 otherwise.
at::ScalarType stats_dtype(const at::Tensor& q);

// Runs fn, turning winnow::Error into c10 errors (ValueError / NotImplementedError /
// RuntimeError in Python) with the same message.
template <class Fn>
auto translate_errors(Fn&& fn) -> decltype(fn()) {
  try {
    return fn();
  } catch (const Error& e) {
    switch (e.kind()) {
      case ErrorKind::invalid_argument: TORCH_CHECK_VALUE(false, e.what());
      case ErrorKind::unsupported: TORCH_CHECK_NOT_IMPLEMENTED(false, e.what());
      case ErrorKind::runtime: TORCH_CHECK(false, e.what());
    }
    throw;
  }
}

}  // namespace winnow::torch_ops
