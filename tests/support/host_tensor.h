// Test-side tensors: host memory of any float dtype in any dimension order, filled from and
// read back to logical (row-major) float64 values, exposed as winnow TensorViews.
#pragma once

#include <cstdint>
#include <random>
#include <vector>

#include "winnow/tensor.h"

namespace winnow::testing {

class HostTensor {
 public:
  HostTensor() = default;
  // physical_order lists the logical dimensions from outermost to innermost in memory
  // (empty: row-major). {0, 2, 1, 3} stores a (B, L, H, D) tensor as (B, H, L, D).
  HostTensor(std::vector<std::int64_t> shape, DType dtype, std::vector<int> physical_order = {});

  TensorView view() const;
  std::int64_t numel() const;
  const std::vector<std::int64_t>& shape() const { return shape_; }
  DType dtype() const { return dtype_; }

  std::vector<double> values() const;  // logical row-major order
  void set_values(const std::vector<double>& logical);
  void fill(double value);

  HostTensor converted(DType dtype, std::vector<int> physical_order = {}) const;

  // The raw storage, for copies to and from a device.
  void* bytes() { return bytes_.data(); }
  const void* bytes() const { return bytes_.data(); }
  std::size_t byte_size() const { return bytes_.size(); }

 private:
  std::int64_t offset(std::int64_t logical_index) const;

  std::vector<std::int64_t> shape_, stride_;
  DType dtype_ = DType::float64;
  std::vector<unsigned char> bytes_;
};

std::vector<double> random_normal(std::int64_t n, std::mt19937_64& rng, double stddev = 1.0);

// ||a - b|| / ||b|| over finite values (||a|| when b is all zero); infinity if any entry of a
// is NaN or if a and b disagree on which entries are infinite.
double relative_error(const std::vector<double>& a, const std::vector<double>& b);

HostTensor int32_tensor(const std::vector<std::int32_t>& values);

}  // namespace winnow::testing
