// Host side of the tensor copies (tile/tensor_copies.cuh): the maps the Hopper kernels' producers
// copy rows through, built by the driver's cuTensorMapEncodeTiled (found at run time through the
// runtime, so that winnow links no driver library).
#pragma once

#include <cstdint>
#include <optional>

#include "core/params.h"
#include "cuda/tile/row_tile_map.h"

namespace winnow::cuda {

// What row_tile_map asks the driver for: the map's dimensions innermost first (dim, then the
// head, row and batch axes in the order of their strides), the strides of the outer three in
// bytes, the box (a 128-byte panel's columns, box_rows rows of one head and sequence), and
// where each axis went (1, 2 or 3). Host only; no driver needed (tests check it on CPU machines).
struct RowTileLayout {  // in the driver's types (<cuda.h>), passed to it as they are
  cuuint64_t sizes[4] = {0, 0, 0, 0};
  cuuint64_t strides[3] = {0, 0, 0};
  cuuint32_t boxes[4] = {0, 0, 0, 0};
  int head_axis = 1, row_axis = 2, batch_axis = 3;
};

// The layout for operand x ([batches][rows][heads][dim] by its strides, 16-bit elements), or
// nothing where a map cannot describe it: elements not contiguous along dim, dim not a multiple
// of 64, a base or stride not a multiple of 16 bytes (a zero stride included, unless its axis
// has one element: that axis gets a stride past the others), sizes past 32-bit coordinates.
std::optional<RowTileLayout> row_tile_layout(const detail::Operand& x, DType dtype, std::int64_t batches,
                                             std::int64_t rows, std::int64_t heads, std::int64_t dim, int box_rows);

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
