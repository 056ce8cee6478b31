// A tensor map of an operand's rows, as the host builds it (cuda/tensor_maps.h) and the Hopper
// kernels' tensor copies read it (tile/tensor_copies.cuh). Host and device code include this.
#pragma once

#include <cuda.h>  // CUtensorMap

#include <cstdint>

namespace winnow::cuda::tile {

// The map's dimensions are the operand's, innermost first: dim, then head, row and batch in
// the order of their strides (the driver describes strides as growing outwards). The axes say
// where each went.
struct RowTileMap {  // 128-byte aligned, as CUtensorMap is
  CUtensorMap map;
  std::int32_t head_axis = 1, row_axis = 2, batch_axis = 3;
};

}  // namespace winnow::cuda::tile
