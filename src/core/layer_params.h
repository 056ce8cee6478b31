// Parameters of the kernels for a transformer layer's pieces around attention (RMSNorm, SwiGLU):
// plain data, checked by their APIs (src/api/rms_norm.cpp, src/api/swiglu.cpp).
#pragma once

#include <cstdint>

#include "winnow/attention.h"
#include "winnow/tensor.h"

namespace winnow::detail {

struct RMSNormParams {
  // Forward reads x, weight; writes y, rstd. Backward reads dy, x, weight, rstd; writes dx, dweight.
  const void* x = nullptr;
  const void* weight = nullptr;
  void* y = nullptr;  // forward only
  void* rstd = nullptr;
  const void* dy = nullptr;  // backward only
  void* dx = nullptr;
  void* dweight = nullptr;
  DType x_dtype = DType::float32;   // also dx's
  DType y_dtype = DType::float32;   // y's (forward) or dy's (backward)
  DType stat_dtype = DType::float32;  // weight, rstd, dweight: float64 for float64 x, else float32
  std::int64_t rows = 0, cols = 0;
  std::int64_t x_stride[2] = {0, 0};  // elements
  std::int64_t y_stride[2] = {0, 0};  // of y (forward) or dy (backward)
  std::int64_t dx_stride[2] = {0, 0};
  std::int64_t weight_stride = 1, rstd_stride = 1, dweight_stride = 1;
  // The residual form (rms_norm::add_forward / add_backward), all null otherwise. Forward:
  // sum = x + residual (residual in y's dtype) is written and normalized in place of x.
  // Backward, with x the saved sum: dsum_in (x's dtype, may be null) is added to dx, and dx is
  // written a second time into dresidual (dy's dtype).
  const void* residual = nullptr;
  void* sum = nullptr;
  const void* dsum_in = nullptr;
  void* dresidual = nullptr;
  std::int64_t residual_stride[2] = {0, 0}, sum_stride[2] = {0, 0};
  std::int64_t dsum_in_stride[2] = {0, 0}, dresidual_stride[2] = {0, 0};
  double eps = 0;
  int num_threads = 0;
  void* cuda_stream = nullptr;
  DeviceAllocator* allocator = nullptr;  // the CUDA backward's partial weight gradients
};

struct SwiGLUParams {
  // Forward reads gate, up; writes y. Backward reads dy, gate, up; writes dgate, dup.
  const void* gate = nullptr;
  const void* up = nullptr;
  void* y = nullptr;  // forward only
  const void* dy = nullptr;  // backward only
  void* dgate = nullptr;
  void* dup = nullptr;
  DType dtype = DType::float32;  // of every tensor
  std::int64_t rows = 0, cols = 0;
  std::int64_t gate_stride[2] = {0, 0}, up_stride[2] = {0, 0};  // elements
  std::int64_t y_stride[2] = {0, 0};      // of y (forward) or dy (backward)
  std::int64_t dgate_stride[2] = {0, 0}, dup_stride[2] = {0, 0};
  int num_threads = 0;
  void* cuda_stream = nullptr;
};

// The masked cross-entropy (winnow/cross_entropy.h). Forward reads logits, targets, mask; writes
// loss, lse. Backward reads dloss, logits, targets, mask, lse; writes dlogits.
struct CrossEntropyParams {
  const void* logits = nullptr;
  DType logits_dtype = DType::float32;  // also dlogits'
  DType stat_dtype = DType::float32;    // mask, loss, lse, dloss: float64 for float64 logits
  std::int64_t rows = 0, cols = 0;
  std::int64_t logits_row_stride = 0, dlogits_row_stride = 0;  // elements; columns are unit-stride
  const std::int64_t* targets = nullptr;
  std::int64_t targets_stride = 1;
  const void* mask = nullptr;
  std::int64_t mask_stride = 1;
  void* loss = nullptr;  // forward
  void* lse = nullptr;   // (rows), contiguous
  const void* divisor = nullptr;  // one value in the statistics dtype, or none: loss = sum / divisor
  const void* dloss = nullptr;  // backward
  void* dlogits = nullptr;
  int num_threads = 0;
  void* cuda_stream = nullptr;
  DeviceAllocator* allocator = nullptr;  // the CUDA forward's per-block sums
};

}  // namespace winnow::detail
