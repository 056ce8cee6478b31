#include "cuda/tensor_maps.h"

#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>

#include "cuda/cuda.h"
#include "cuda/element_types.cuh"
#include "winnow/tensor.h"

namespace winnow::cuda {
namespace {

std::atomic<bool> maps_enabled{std::getenv("WINNOW_NO_TENSOR_MAPS") == nullptr};
std::atomic<std::int64_t> map_launches{0};

PFN_cuTensorMapEncodeTiled_v12000 encoder() {
  static const PFN_cuTensorMapEncodeTiled_v12000 fn = [] {
    void* f = nullptr;
    cudaDriverEntryPointQueryResult found{};
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &f, 12000, cudaEnableDefault, &found) !=
            cudaSuccess ||
        found != cudaDriverEntryPointSuccess) {
      (void)cudaGetLastError();
      return static_cast<PFN_cuTensorMapEncodeTiled_v12000>(nullptr);
    }
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(f);
  }();
  return fn;
}

}  // namespace

bool set_tensor_maps(bool enabled) { return maps_enabled.exchange(enabled); }
std::int64_t tensor_map_launches() { return map_launches.load(); }
void count_tensor_map_launch() { ++map_launches; }

std::optional<RowTileLayout> row_tile_layout(const detail::Operand& x, DType dtype, std::int64_t batches,
                                             std::int64_t rows, std::int64_t heads, std::int64_t dim, int box_rows) {
  if (x.data == nullptr || x.dim != 1) return std::nullopt;
  if (dtype != DType::bfloat16 && dtype != DType::float16) return std::nullopt;
  if (batches <= 0 || rows <= 0 || heads <= 0 || dim <= 0 || dim % 64 != 0) return std::nullopt;
  if (box_rows <= 0 || box_rows > 256) return std::nullopt;
  // Coordinates are signed 32-bit; strides below 2^40 bytes.
  constexpr std::int64_t kMaxDim = (std::int64_t{1} << 31) - 1, kMaxStride = std::int64_t{1} << 40;
  if (batches > kMaxDim || rows > kMaxDim || heads > kMaxDim) return std::nullopt;
  if (!aligned_to(x.data, 16)) return std::nullopt;

  // The three outer axes (1 head, 2 row, 3 batch) in the order of their strides. A dimension of
  // one element may take any stride: it gets one past the largest, which keeps the order.
  const std::int64_t bytes = static_cast<std::int64_t>(element_size(dtype));
  struct Axis {
    int name;
    std::int64_t size, stride;
  };
  Axis axes[3] = {{1, heads, x.head * bytes}, {2, rows, x.row * bytes}, {3, batches, x.batch * bytes}};
  std::int64_t widest = dim * bytes;
  for (const Axis& a : axes) {
    if (a.size > 1) widest = std::max(widest, a.stride * a.size);
  }
  for (Axis& a : axes) {
    if (a.size == 1) a.stride = (widest + 15) / 16 * 16;
  }
  std::stable_sort(axes, axes + 3, [](const Axis& a, const Axis& b) { return a.stride < b.stride; });
  RowTileLayout layout;
  layout.sizes[0] = static_cast<cuuint64_t>(dim);
  layout.boxes[0] = static_cast<cuuint32_t>(128 / bytes);  // a 128-byte panel's columns
  for (int i = 0; i < 3; ++i) {
    if (axes[i].stride <= 0 || axes[i].stride % 16 != 0 || axes[i].stride >= kMaxStride) return std::nullopt;
    layout.sizes[i + 1] = static_cast<cuuint64_t>(axes[i].size);
    layout.strides[i] = static_cast<cuuint64_t>(axes[i].stride);
    layout.boxes[i + 1] = axes[i].name == 2 ? static_cast<cuuint32_t>(box_rows) : 1;
    if (axes[i].name == 1) layout.head_axis = i + 1;
    if (axes[i].name == 2) layout.row_axis = i + 1;
    if (axes[i].name == 3) layout.batch_axis = i + 1;
  }
  return layout;
}

bool row_tile_map(tile::RowTileMap& out, const detail::Operand& x, DType dtype, std::int64_t batches,
                  std::int64_t rows, std::int64_t heads, std::int64_t dim, int box_rows) {
  if (!maps_enabled.load()) return false;
  const std::optional<RowTileLayout> layout = row_tile_layout(x, dtype, batches, rows, heads, dim, box_rows);
  if (!layout) return false;
  const PFN_cuTensorMapEncodeTiled_v12000 encode = encoder();
  if (encode == nullptr) return false;
  const cuuint32_t element_strides[4] = {1, 1, 1, 1};
  tile::RowTileMap m;
  const CUresult status =
      encode(&m.map, dtype == DType::bfloat16 ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 : CU_TENSOR_MAP_DATA_TYPE_FLOAT16, 4,
             x.data, layout->sizes, layout->strides, layout->boxes, element_strides, CU_TENSOR_MAP_INTERLEAVE_NONE,
             CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_128B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (status != CUDA_SUCCESS) return false;
  m.head_axis = layout->head_axis;
  m.row_axis = layout->row_axis;
  m.batch_axis = layout->batch_axis;
  out = m;
  return true;
}

}  // namespace winnow::cuda
