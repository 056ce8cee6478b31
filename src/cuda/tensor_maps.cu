#include "cuda/tensor_maps.h"

#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>

#include "cuda/cuda.h"
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

bool row_tile_map(tile::RowTileMap& out, const detail::Operand& x, DType dtype, std::int64_t batches,
                  std::int64_t rows, std::int64_t heads, std::int64_t dim, int box_rows) {
  if (!maps_enabled.load() || x.data == nullptr || x.dim != 1) return false;
  if (dtype != DType::bfloat16 && dtype != DType::float16) return false;
  if (batches <= 0 || rows <= 0 || heads <= 0 || dim <= 0 || dim % 64 != 0) return false;
  // Coordinates are signed 32-bit.
  constexpr std::int64_t kMaxDim = (std::int64_t{1} << 31) - 1, kMaxStride = std::int64_t{1} << 40;
  if (batches > kMaxDim || rows > kMaxDim || heads > kMaxDim) return false;
  if (reinterpret_cast<std::uintptr_t>(x.data) % 16 != 0) return false;
  const PFN_cuTensorMapEncodeTiled_v12000 encode = encoder();
  if (encode == nullptr) return false;

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
  cuuint64_t sizes[4] = {static_cast<cuuint64_t>(dim), 0, 0, 0};
  cuuint64_t strides[3];
  for (int i = 0; i < 3; ++i) {
    if (axes[i].stride <= 0 || axes[i].stride % 16 != 0 || axes[i].stride >= kMaxStride) return false;
    sizes[i + 1] = static_cast<cuuint64_t>(axes[i].size);
    strides[i] = static_cast<cuuint64_t>(axes[i].stride);
  }
  cuuint32_t boxes[4] = {static_cast<cuuint32_t>(128 / bytes), 1, 1, 1};  // a 128-byte panel's columns
  for (int i = 0; i < 3; ++i) {
    if (axes[i].name == 2) boxes[i + 1] = static_cast<cuuint32_t>(box_rows);
  }
  const cuuint32_t element_strides[4] = {1, 1, 1, 1};
  tile::RowTileMap m;
  const CUresult status =
      encode(&m.map, dtype == DType::bfloat16 ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 : CU_TENSOR_MAP_DATA_TYPE_FLOAT16, 4,
             x.data, sizes, strides, boxes, element_strides, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
             CU_TENSOR_MAP_L2_PROMOTION_L2_128B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (status != CUDA_SUCCESS) return false;
  for (int i = 0; i < 3; ++i) {
    const int axis = i + 1;
    if (axes[i].name == 1) m.head_axis = axis;
    if (axes[i].name == 2) m.row_axis = axis;
    if (axes[i].name == 3) m.batch_axis = axis;
  }
  out = m;
  return true;
}

}  // namespace winnow::cuda
