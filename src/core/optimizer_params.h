// Parameters of the clipped AdamW kernels (winnow/adamw.h): plain data, checked by
// src/api/adamw.cpp.
#pragma once

#include <cstdint>
#include <vector>

#include "winnow/attention.h"

namespace winnow::detail {

// One parameter: every pointer is float32, contiguous, numel elements (step: one).
struct AdamWTensor {
  float* param = nullptr;
  const float* grad = nullptr;
  float* exp_avg = nullptr;
  float* exp_avg_sq = nullptr;
  float* step = nullptr;
  std::int64_t numel = 0;
  int group = 0;
};

struct AdamWParams {
  static constexpr int kMaxGroups = 8;
  static constexpr int kMaxGuards = 4;
  std::vector<AdamWTensor> tensors;  // in the groups' order
  std::vector<const float*> group_lr;  // per group, one float32
  std::vector<double> group_weight_decay;
  std::vector<const float*> guards;  // one float32 each
  float* norm = nullptr;
  double beta1 = 0.9, beta2 = 0.999, eps = 1e-8, max_norm = 0;
  int num_threads = 0;
  void* cuda_stream = nullptr;
  DeviceAllocator* allocator = nullptr;  // the CUDA kernels' partial sums
};

}  // namespace winnow::detail
