// The CUDA simple path's float32 entmax threshold and logit gradients emulated on the CPU, which
// found the two causes that commit 0e46e43 fixed (docs/performance.md, sessions 79 and 80):
// CudaEntmax.AnyAlphaMatchesTheReference's d128 problem, every row, scores as the forward and the
// search form them (q scaled first, fused multiply-adds in feature order) and as the backward forms
// them (scaled after the dot); tau from ThresholdSearch<float, 4> (the CUDA search) and <float, 1>
// (the CPU's); dS = u (dp - delta) against the float64 reference's, norm-relative over all rows.
// Build from build-cpu (after `cmake --build .`) and run:
//   g++ -std=c++17 -O2 -ffp-contract=off -I ../tests -I ../include -I ../src \
//     ../tools/entmax_float32_emulation.cpp -o /tmp/emulation tests/libwinnow_test_support.a \
//     -L. -lwinnow -Wl,-rpath,$PWD && /tmp/emulation
#include <cmath>
#include <cstdio>
#include <vector>
#include "math/entmax.h"
#include "support/attention_case.h"
using namespace winnow;
using namespace winnow::testing;
namespace em = winnow::math::entmax;
template <class S, int K>
S run_search(const std::vector<S>& x, S alpha, S tol, int* steps) {
  em::ThresholdSearch<S, K> s(alpha, tol);
  S m = x[0];
  for (S v : x) m = v > m ? v : m;
  s.start(m, S(x.size()));
  int n = 0;
  for (; n < em::kMaxSearchSteps && !s.done(); ++n) {
    S f[K] = {}, u[K] = {};
    for (int k = 0; k < K; ++k) {
      for (S v : x) { f[k] += em::weight(v - s.probe(k), alpha); u[k] += em::grad_weight(v - s.probe(k), alpha); }
    }
    s.step(f, u);
  }
  *steps = n;
  return s.tau();
}
int main() {
  const ProblemShape shape{"d128", {{300, 300}}, false, 4, 2, 128, 128};
  const Problem p = Problem::random(shape, 91);
  std::vector<double> qv = p.q.converted(DType::float32).values(), kv = p.k.converted(DType::float32).values();
  std::vector<double> vv = p.v.values(), dov = p.dout.values();
  const int L = 300, H = 4, D = 128;
  const float scale = 1.f / std::sqrt(128.f);
  for (double alpha : {1.75, 2.5}) {
    double num4 = 0, num1 = 0, num4b = 0, den = 0, maxdt4 = 0, maxdt1 = 0; int max4 = 0, max1 = 0;
    for (int h = 0; h < H; ++h) {
      const int hk = h / 2;
      for (int l = 0; l < L; ++l) {
        const int n = l + 1;
        std::vector<double> z64(n), dp(n);
        std::vector<float> zf(n), zb(n);
        for (int j = 0; j < n; ++j) {
          double acc64 = 0; float accf = 0.f, accb = 0.f, dpa = 0;
          for (int d = 0; d < D; ++d) {
            const double qd = qv[(l * H + h) * D + d], kd = kv[(j * 2 + hk) * D + d];
            acc64 += qd * kd;
            accf = std::fma(float(qd) * scale, float(kd), accf);
            accb = std::fma(float(qd), float(kd), accb);
          }
          z64[j] = acc64 * double(scale);
          zf[j] = accf; zb[j] = scale * accb;
          double s = 0; for (int d = 0; d < D; ++d) s += vv[(j * 2 + hk) * D + d] * dov[(l * H + h) * D + d];
          dp[j] = s;
        }
        std::vector<double> x64(n); std::vector<float> xf(n);
        for (int j = 0; j < n; ++j) { x64[j] = (alpha - 1) * z64[j]; xf[j] = float(alpha - 1) * zf[j]; }
        int s64, s4, s1;
        const double t64 = run_search<double, 1>(x64, alpha, 1e-13, &s64);
        const float t4 = run_search<float, 4>(xf, float(alpha), 1e-5f, &s4);
        const float t1 = run_search<float, 1>(xf, float(alpha), 1e-5f, &s1);
        max4 = std::max(max4, s4); max1 = std::max(max1, s1);
        maxdt4 = std::max(maxdt4, std::abs(t4 - t64)); maxdt1 = std::max(maxdt1, std::abs(t1 - t64));
        auto dS = [&](const std::vector<double>& x, double t) {
          std::vector<double> u(n); double su = 0, sud = 0;
          for (int j = 0; j < n; ++j) { u[j] = em::grad_weight(x[j] - t, alpha); su += u[j]; sud += u[j] * dp[j]; }
          for (int j = 0; j < n; ++j) u[j] = u[j] * (dp[j] - sud / su);
          return u;
        };
        std::vector<double> xfd(n), xbd(n);
        for (int j = 0; j < n; ++j) { xfd[j] = float(alpha - 1) * zf[j]; xbd[j] = float(alpha - 1) * zb[j]; }
        const auto ref = dS(x64, t64), g4 = dS(xfd, t4), g1 = dS(xfd, t1), g4b = dS(xbd, t4);
        for (int j = 0; j < n; ++j) {
          den += ref[j] * ref[j];
          num4 += (g4[j] - ref[j]) * (g4[j] - ref[j]);
          num1 += (g1[j] - ref[j]) * (g1[j] - ref[j]);
          num4b += (g4b[j] - ref[j]) * (g4b[j] - ref[j]);
        }
      }
    }
    std::printf("alpha %.2f: dS error K=4 %.2e (backward scores scaled after: %.2e), K=1 %.2e; max |dtau| K=4 %.2e K=1 %.2e; max steps %d / %d\n",
                alpha, std::sqrt(num4 / den), std::sqrt(num4b / den), std::sqrt(num1 / den), maxdt4, maxdt1, max4, max1);
  }
}
