// The one device operation the argument checks need: reading a small device buffer (the
// cu_seqlens offsets) on the host. Implemented by the CUDA backend; builds without it throw.
#pragma once

#include <cstddef>

#include "winnow/tensor.h"

namespace winnow::detail {

void copy_to_host(void* dst, const void* src, std::size_t bytes, Device device, void* stream);

}  // namespace winnow::detail
