// Host side of the tensor copies (tile/tensor_copies.cuh): the maps the Hopper kernels' producers
// copy rows through, built by the driver's cuTensorMapEncodeTiled (found at run time through the
// runtime, so that winnow links no driver library).
#pragma once

#include <cstdint>

#include "core/params.h"
#include "cuda/tile/tensor_copies.cuh"

namespace winnow::cuda {

// A map of operand x's rows ([batches][rows][heads][dim] by its strides, 16-bit elements) in
// boxes of box_rows rows x 64 columns of one head and sequence, with the 128-byte swizzle of
// tile::PanelTile. False, with `out` unusable, where the copies cannot read x: the tensor copies
// are turned off (set_tensor_maps), the driver has no entry point, x's base or strides are not
// multiples of 16 bytes or its elements not contiguous along dim, or the driver refuses the
// map; the caller then copies with cp.async. Only for batched operands: in packed ones a box
// past a sequence's last row would read the next sequence's.
bool row_tile_map(tile::RowTileMap& out, const detail::Operand& x, DType dtype, std::int64_t batches,
                  std::int64_t rows, std::int64_t heads, std::int64_t dim, int box_rows);

// Counts a launch that copies through maps (cuda::tensor_map_launches, for tests).
void count_tensor_map_launch();

}  // namespace winnow::cuda
