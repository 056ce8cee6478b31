// SwiGLU's gate written out in float64, with its derivative taken by hand from
// silu(g) = g / (1 + e^-g), independent of the kernels' shared formulas.
#pragma once

#include <cmath>
#include <vector>

namespace winnow::testing {

struct SwiGLUExpected {
  std::vector<double> y, dgate, dup;
};

inline SwiGLUExpected swiglu_expected(const std::vector<double>& gate, const std::vector<double>& up,
                                      const std::vector<double>& dy) {
  SwiGLUExpected e{std::vector<double>(gate.size()), std::vector<double>(gate.size()),
                   std::vector<double>(gate.size())};
  for (std::size_t i = 0; i < gate.size(); ++i) {
    const double g = gate[i], silu = g / (1.0 + std::exp(-g));
    // d/dg [g / (1 + e^-g)] = 1 / (1 + e^-g) + g e^-g / (1 + e^-g)^2.
    const double q = 1.0 + std::exp(-g);
    const double dsilu = 1.0 / q + g * std::exp(-g) / (q * q);
    e.y[i] = silu * up[i];
    e.dup[i] = dy[i] * silu;
    e.dgate[i] = dy[i] * up[i] * dsilu;
  }
  return e;
}

}  // namespace winnow::testing
