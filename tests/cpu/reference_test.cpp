// The oracle checked on its own: the float64 reference's analytic gradients against central
// finite differences of its forward, for every mechanism, both causal conventions, GQA,
// suffix queries and packed sequences.
#include <gtest/gtest.h>

#include <functional>

#include "support/attention_case.h"

namespace winnow::testing {
namespace {

// L = sum(dout * out) + sum(dstat * stat) (the statistic only where it is differentiable).
double loss(const Problem& p, const RunConfig& cfg) {
  const Results r = run(p, cfg);
  const std::vector<double> dout = p.dout.values();
  double l = 0;
  for (std::size_t i = 0; i < dout.size(); ++i) l += dout[i] * r.out[i];
  if ((cfg.mechanism == Mechanism::stick_breaking || is_sieve(cfg.mechanism)) && cfg.with_dstat) {
    const std::vector<double> dstat = p.dstat.values();
    for (std::size_t i = 0; i < dstat.size(); ++i) l += dstat[i] * r.stat[i];
  }
  return l;
}

std::vector<double> finite_difference(Problem p, HostTensor Problem::*which,
                                      const RunConfig& cfg) {
  const double h = 1e-5;
  std::vector<double> x = (p.*which).values();
  std::vector<double> grad(x.size());
  for (std::size_t i = 0; i < x.size(); ++i) {
    const double x0 = x[i];
    x[i] = x0 + h;
    (p.*which).set_values(x);
    const double up = loss(p, cfg);
    x[i] = x0 - h;
    (p.*which).set_values(x);
    const double down = loss(p, cfg);
    x[i] = x0;
    (p.*which).set_values(x);
    grad[i] = (up - down) / (2 * h);
  }
  return grad;
}

using Param = std::tuple<Mechanism, bool /*attend_current*/, int /*shape*/>;

const std::vector<ProblemShape>& small_shapes() {
  static const std::vector<ProblemShape> all = {
      {"gqa", {{6, 6}}, false, 2, 1, 3, 2},
      {"suffix_varlen", {{2, 5}, {0, 3}, {4, 4}}, true, 1, 1, 4, 3},
  };
  return all;
}

class ReferenceGradients : public ::testing::TestWithParam<Param> {};

TEST_P(ReferenceGradients, MatchFiniteDifferences) {
  const auto [mechanism, attend_current, shape_index] = GetParam();
  const Problem p = Problem::random(small_shapes()[static_cast<std::size_t>(shape_index)], 7);
  RunConfig cfg;
  cfg.mechanism = mechanism;
  cfg.attend_current = attend_current;
  cfg.backend = Backend::reference;
  const Results analytic = run(p, cfg);
  EXPECT_LT(relative_error(analytic.dq, finite_difference(p, &Problem::q, cfg)), 1e-7) << "dq";
  EXPECT_LT(relative_error(analytic.dk, finite_difference(p, &Problem::k, cfg)), 1e-7) << "dk";
  EXPECT_LT(relative_error(analytic.dv, finite_difference(p, &Problem::v, cfg)), 1e-7) << "dv";
}

INSTANTIATE_TEST_SUITE_P(
    Reference, ReferenceGradients,
    ::testing::Combine(::testing::ValuesIn(all_mechanisms()),
                       ::testing::Bool(), ::testing::Values(0, 1)),
    [](const ::testing::TestParamInfo<Param>& info) {
      return std::string(name_of(std::get<0>(info.param))) +
             (std::get<1>(info.param) ? "_current_" : "_strict_") +
             small_shapes()[static_cast<std::size_t>(std::get<2>(info.param))].name;
    });

}  // namespace
}  // namespace winnow::testing
