// Parameters of the casting concatenation (winnow/cast.h): plain data, checked by
// src/api/cast.cpp.
#pragma once

#include <cstdint>
#include <vector>

#include "winnow/attention.h"

namespace winnow::detail {

struct CastSegment {
  const void* source = nullptr;  // contiguous
  std::int64_t count = 0;        // elements
  std::int64_t offset = 0;       // where it starts in the destination, in elements
};

struct CastParams {
  std::vector<CastSegment> segments;
  DType source_dtype = DType::float32;
  DType destination_dtype = DType::bfloat16;
  void* destination = nullptr;
  int num_threads = 0;
  void* cuda_stream = nullptr;
};

}  // namespace winnow::detail
