// Unit-normalized rows of an operand (threshold attention's queries and keys; Multiscreen's
// queries, keys and values) and the normalization's backward, for the CPU kernels.
#pragma once

#include <cstdint>
#include <vector>

#include "cpu/tiles.h"
#include "math/elementwise.h"

namespace winnow::cpu {

// Rows loaded and scaled to unit length (x / max(|x|, eps)), with what the gradient needs.
template <class T>
struct UnitRows {
  RowMatrix<T> hat;
  RowVector<T> inv_norm;
  std::vector<char> clipped;

  void load(const Operand& op, std::int64_t b, std::int64_t start, std::int64_t n, std::int64_t h,
            std::int64_t cols, T eps) {
    load_rows<T>(op, b, start, n, h, cols, hat);
    inv_norm.resize(n);
    clipped.resize(static_cast<std::size_t>(n));
    for (std::int64_t r = 0; r < n; ++r) {
      const T sum = hat.row(r).squaredNorm();
      inv_norm[r] = math::inverse_norm(sum, eps);
      clipped[static_cast<std::size_t>(r)] = math::norm_clipped(sum, eps) ? 1 : 0;
      hat.row(r) *= inv_norm[r];
    }
  }

  // g (rows x cols, dL/dx_hat) becomes dL/dx, row by row.
  void backward(RowMatrix<T>& g) const {
    for (std::int64_t r = 0; r < g.rows(); ++r) {
      const T dot = hat.row(r).dot(g.row(r));
      const bool c = clipped[static_cast<std::size_t>(r)] != 0;
      for (std::int64_t d = 0; d < g.cols(); ++d) {
        g(r, d) = math::normalize_grad(g(r, d), hat(r, d), dot, inv_norm[r], c);
      }
    }
  }
};

}  // namespace winnow::cpu
