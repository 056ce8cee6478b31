// Framework-free tensor views: what every winnow entry point takes instead of a framework's
// tensor type, so the kernel library can be embedded anywhere (LibTorch, inference engines,
// plain C++).
#pragma once

#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <string>

namespace winnow {

enum class DType : std::uint8_t { float16, bfloat16, float32, float64, int32, int64 };

const char* to_string(DType dtype);
std::size_t element_size(DType dtype);
inline bool is_floating(DType dtype) {
  return dtype == DType::float16 || dtype == DType::bfloat16 || dtype == DType::float32 ||
         dtype == DType::float64;
}

enum class DeviceKind : std::uint8_t { cpu, cuda };

struct Device {
  DeviceKind kind = DeviceKind::cpu;
  int index = 0;  // CUDA ordinal; 0 for the CPU

  static Device cpu() { return {DeviceKind::cpu, 0}; }
  static Device cuda(int index = 0) { return {DeviceKind::cuda, index}; }
  bool operator==(const Device& o) const { return kind == o.kind && index == o.index; }
  bool operator!=(const Device& o) const { return !(*this == o); }
};

std::string to_string(Device device);

// A strided view of memory owned by someone else. Strides count elements, not bytes.
// A view with data == nullptr and numel() > 0 is invalid; zero-sized views may have no data.
struct TensorView {
  static constexpr int kMaxDims = 4;

  void* data = nullptr;
  DType dtype = DType::float32;
  Device device{};
  int ndim = 0;
  std::int64_t shape[kMaxDims] = {0, 0, 0, 0};
  std::int64_t stride[kMaxDims] = {0, 0, 0, 0};

  std::int64_t size(int dim) const { return shape[dim]; }
  std::int64_t numel() const {
    std::int64_t n = 1;
    for (int d = 0; d < ndim; ++d) n *= shape[d];
    return n;
  }
  // "(2, 16, 8, 64)"
  std::string shape_string() const;
};

// A view over contiguous (row-major) memory: the common case when calling from plain C++.
TensorView make_view(void* data, DType dtype, std::initializer_list<std::int64_t> shape,
                     Device device = Device::cpu());

}  // namespace winnow
