// Several tensors converted into one buffer, side by side, in one pass: a step's low-precision
// copies of a model's weights (each product's weights adjacent, so their concatenation is a
// view) in one launch, instead of a cast and a concatenation per matrix product.
#pragma once

#include <vector>

#include "winnow/attention.h"

namespace winnow::cast {

// sources: contiguous tensors of one floating dtype (float16, bfloat16, float32, float64) on one
// device. destination: a contiguous tensor of any of those dtypes on the same device, with at
// least as many elements as the sources together, apart from every source. Source s's element
// i is written, rounded to nearest even, at index (sizes of sources 0 .. s-1) + i; the rest of
// the destination is left alone.
void concatenate(const std::vector<TensorView>& sources, const TensorView& destination, const ExecContext& ctx = {});

}  // namespace winnow::cast
