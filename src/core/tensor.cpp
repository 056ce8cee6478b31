#include "winnow/tensor.h"


#include "winnow/error.h"

namespace winnow {

const char* to_string(DType dtype) {
  switch (dtype) {
    case DType::float16: return "float16";
    case DType::bfloat16: return "bfloat16";
    case DType::float32: return "float32";
    case DType::float64: return "float64";
    case DType::int32: return "int32";
    case DType::int64: return "int64";
  }
  return "unknown dtype";
}

std::size_t element_size(DType dtype) {
  switch (dtype) {
    case DType::float16:
    case DType::bfloat16: return 2;
    case DType::float32:
    case DType::int32: return 4;
    case DType::float64:
    case DType::int64: return 8;
  }
  return 0;
}

std::string to_string(Device device) {
  if (device.kind == DeviceKind::cpu) return "cpu";
  return "cuda:" + std::to_string(device.index);
}

// Plain string building: no iostreams in the kernel library, whose locale machinery is not
// safe to use from a library linked against a different C++ runtime than its host process
// (seen: a static libstdc++ copy crashing inside Python).
std::string TensorView::shape_string() const {
  std::string s = "(";
  for (int d = 0; d < ndim; ++d) s += (d ? ", " : "") + std::to_string(shape[d]);
  if (ndim == 1) s += ',';
  return s + ')';
}

TensorView make_view(void* data, DType dtype, std::initializer_list<std::int64_t> shape,
                     Device device) {
  if (shape.size() > TensorView::kMaxDims) {
    throw Error(ErrorKind::invalid_argument,
                "winnow::make_view: at most " + std::to_string(TensorView::kMaxDims) +
                    " dimensions, got " + std::to_string(shape.size()));
  }
  TensorView t;
  t.data = data;
  t.dtype = dtype;
  t.device = device;
  t.ndim = static_cast<int>(shape.size());
  int d = 0;
  for (std::int64_t s : shape) t.shape[d++] = s;
  std::int64_t stride = 1;
  for (d = t.ndim - 1; d >= 0; --d) {
    t.stride[d] = stride;
    stride *= t.shape[d];
  }
  return t;
}

}  // namespace winnow
