// The rotary kernels' parameters: plain data, checked by the API (src/api/rotary.cpp).
#pragma once

#include <cstdint>

#include "winnow/tensor.h"

namespace winnow::detail {

struct RotaryParams {
  const void* x = nullptr;
  void* out = nullptr;
  const void* cos = nullptr;  // (L, D/2), float64 for float64 x, else float32
  const void* sin = nullptr;
  DType dtype = DType::float32;  // of x and out
  std::int64_t batch = 0, length = 0, heads = 0, half = 0;  // half = D/2
  std::int64_t x_stride[4] = {0, 0, 0, 0};    // elements, (B, L, H, D)
  std::int64_t out_stride[4] = {0, 0, 0, 0};
  std::int64_t table_stride[2] = {0, 0};     // of cos and sin alike
  bool transpose = false;
  int num_threads = 0;
  void* cuda_stream = nullptr;
};

}  // namespace winnow::detail
