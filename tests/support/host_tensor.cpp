#include "support/host_tensor.h"

#include <cmath>
#include <cstring>
#include <limits>
#include <numeric>
#include <stdexcept>

namespace winnow::testing {
namespace {

// Round-to-nearest-even conversions for the 16-bit float formats, so host tests can hold
// bf16 / fp16 data without a GPU toolchain.
std::uint16_t to_bf16(float x) {
  std::uint32_t bits;
  std::memcpy(&bits, &x, 4);
  if (std::isnan(x)) return 0x7fc0;
  bits += 0x7fff + ((bits >> 16) & 1);
  return static_cast<std::uint16_t>(bits >> 16);
}
float from_bf16(std::uint16_t h) {
  const std::uint32_t bits = static_cast<std::uint32_t>(h) << 16;
  float x;
  std::memcpy(&x, &bits, 4);
  return x;
}
std::uint16_t to_fp16(float x) {
  const _Float16 h = static_cast<_Float16>(x);
  std::uint16_t bits;
  std::memcpy(&bits, &h, 2);
  return bits;
}
float from_fp16(std::uint16_t bits) {
  _Float16 h;
  std::memcpy(&h, &bits, 2);
  return static_cast<float>(h);
}

}  // namespace

HostTensor::HostTensor(std::vector<std::int64_t> shape, DType dtype,
                       std::vector<int> physical_order)
    : shape_(std::move(shape)), stride_(shape_.size(), 0), dtype_(dtype) {
  const int n = static_cast<int>(shape_.size());
  if (physical_order.empty()) {
    physical_order.resize(static_cast<std::size_t>(n));
    std::iota(physical_order.begin(), physical_order.end(), 0);
  }
  std::int64_t stride = 1;
  for (int i = n - 1; i >= 0; --i) {
    const int dim = physical_order[static_cast<std::size_t>(i)];
    stride_[static_cast<std::size_t>(dim)] = stride;
    stride *= shape_[static_cast<std::size_t>(dim)];
  }
  bytes_.assign(static_cast<std::size_t>(std::max<std::int64_t>(numel(), 1)) * element_size(dtype),
                0);
}

std::int64_t HostTensor::numel() const {
  std::int64_t n = 1;
  for (std::int64_t s : shape_) n *= s;
  return n;
}

TensorView HostTensor::view() const {
  TensorView v;
  v.data = const_cast<unsigned char*>(bytes_.data());
  v.dtype = dtype_;
  v.ndim = static_cast<int>(shape_.size());
  for (int d = 0; d < v.ndim; ++d) {
    v.shape[d] = shape_[static_cast<std::size_t>(d)];
    v.stride[d] = stride_[static_cast<std::size_t>(d)];
  }
  return v;
}

std::int64_t HostTensor::offset(std::int64_t index) const {
  std::int64_t off = 0;
  for (int d = static_cast<int>(shape_.size()) - 1; d >= 0; --d) {
    const std::int64_t size = shape_[static_cast<std::size_t>(d)];
    off += (index % size) * stride_[static_cast<std::size_t>(d)];
    index /= size;
  }
  return off;
}

std::vector<double> HostTensor::values() const {
  std::vector<double> out(static_cast<std::size_t>(numel()));
  for (std::int64_t i = 0; i < numel(); ++i) {
    const std::int64_t o = offset(i);
    switch (dtype_) {
      case DType::float64: out[i] = reinterpret_cast<const double*>(bytes_.data())[o]; break;
      case DType::float32: out[i] = reinterpret_cast<const float*>(bytes_.data())[o]; break;
      case DType::int32: out[i] = reinterpret_cast<const std::int32_t*>(bytes_.data())[o]; break;
      case DType::bfloat16: out[i] = from_bf16(reinterpret_cast<const std::uint16_t*>(bytes_.data())[o]); break;
      case DType::float16: out[i] = from_fp16(reinterpret_cast<const std::uint16_t*>(bytes_.data())[o]); break;
      default: throw std::logic_error("HostTensor: dtype not readable on the host");
    }
  }
  return out;
}

void HostTensor::set_values(const std::vector<double>& logical) {
  if (static_cast<std::int64_t>(logical.size()) != numel()) {
    throw std::logic_error("HostTensor::set_values: wrong number of values");
  }
  for (std::int64_t i = 0; i < numel(); ++i) {
    const std::int64_t o = offset(i);
    switch (dtype_) {
      case DType::float64: reinterpret_cast<double*>(bytes_.data())[o] = logical[i]; break;
      case DType::float32:
        reinterpret_cast<float*>(bytes_.data())[o] = static_cast<float>(logical[i]);
        break;
      case DType::int32:
        reinterpret_cast<std::int32_t*>(bytes_.data())[o] = static_cast<std::int32_t>(logical[i]);
        break;
      case DType::bfloat16:
        reinterpret_cast<std::uint16_t*>(bytes_.data())[o] = to_bf16(static_cast<float>(logical[i]));
        break;
      case DType::float16:
        reinterpret_cast<std::uint16_t*>(bytes_.data())[o] = to_fp16(static_cast<float>(logical[i]));
        break;
      default: throw std::logic_error("HostTensor: dtype not writable on the host");
    }
  }
}

void HostTensor::fill(double value) {
  set_values(std::vector<double>(static_cast<std::size_t>(numel()), value));
}

HostTensor HostTensor::converted(DType dtype, std::vector<int> physical_order) const {
  HostTensor t(shape_, dtype, std::move(physical_order));
  t.set_values(values());
  return t;
}

std::vector<double> random_normal(std::int64_t n, std::mt19937_64& rng, double stddev) {
  std::normal_distribution<double> dist(0.0, stddev);
  std::vector<double> v(static_cast<std::size_t>(n));
  for (double& x : v) x = dist(rng);
  return v;
}

double relative_error(const std::vector<double>& a, const std::vector<double>& b) {
  if (a.size() != b.size()) return std::numeric_limits<double>::infinity();
  double num = 0, den = 0, norm_a = 0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    if (std::isnan(a[i]) || std::isnan(b[i])) return std::numeric_limits<double>::infinity();
    if (std::isinf(a[i]) || std::isinf(b[i])) {
      if (a[i] != b[i]) return std::numeric_limits<double>::infinity();
      continue;
    }
    num += (a[i] - b[i]) * (a[i] - b[i]);
    den += b[i] * b[i];
    norm_a += a[i] * a[i];
  }
  if (den == 0) return std::sqrt(norm_a);
  return std::sqrt(num / den);
}

HostTensor int32_tensor(const std::vector<std::int32_t>& values) {
  HostTensor t({static_cast<std::int64_t>(values.size())}, DType::int32);
  t.set_values(std::vector<double>(values.begin(), values.end()));
  return t;
}

}  // namespace winnow::testing
