// Stick-breaking attention from plain C++ memory (the README's snippet, whole): the CPU kernel
// on float32 views, then the float64 reference on float64 copies of the same inputs; a bad
// argument's error. Exits nonzero if the two disagree or the error does not come.
#include <winnow/winnow.h>

#include <cmath>
#include <cstdio>
#include <random>
#include <vector>

namespace {

// out (B, L, H, D) and log_rem (B, L, H) of stick-breaking over q, k, v of type T.
template <class T>
std::vector<T> stick_breaking(const std::vector<T>& q, const std::vector<T>& k, const std::vector<T>& v,
                              std::int64_t B, std::int64_t L, std::int64_t H, std::int64_t D,
                              winnow::DType dtype, winnow::Backend backend) {
  winnow::AttentionInputs in;
  in.q = winnow::make_view(const_cast<T*>(q.data()), dtype, {B, L, H, D});
  in.k = winnow::make_view(const_cast<T*>(k.data()), dtype, {B, L, H, D});
  in.v = winnow::make_view(const_cast<T*>(v.data()), dtype, {B, L, H, D});
  std::vector<T> out(B * L * H * D), log_rem(B * L * H);
  winnow::stick_breaking::Options opt;  // scale 1/sqrt(D), keys i < j, no halting
  winnow::ExecContext ctx;
  ctx.backend = backend;  // reference: the float64 oracle
  winnow::stick_breaking::forward(in, opt,
                                  {winnow::make_view(out.data(), dtype, {B, L, H, D}),
                                   winnow::make_view(log_rem.data(), dtype, {B, L, H}),
                                   std::nullopt},  // kept_from: only for backward with halting
                                  ctx);
  return out;
}

}  // namespace

int main() {
  const std::int64_t B = 2, L = 33, H = 3, D = 16;
  std::mt19937 rng(1);
  std::normal_distribution<float> normal;
  std::vector<float> q(B * L * H * D), k(q.size()), v(q.size());
  for (auto* t : {&q, &k, &v}) {
    for (float& x : *t) x = normal(rng);
  }
  const std::vector<double> q64(q.begin(), q.end()), k64(k.begin(), k.end()), v64(v.begin(), v.end());
  const std::vector<float> out =
      stick_breaking(q, k, v, B, L, H, D, winnow::DType::float32, winnow::Backend::automatic);
  const std::vector<double> ref =
      stick_breaking(q64, k64, v64, B, L, H, D, winnow::DType::float64, winnow::Backend::reference);
  double worst = 0;
  for (std::size_t i = 0; i < ref.size(); ++i) worst = std::fmax(worst, std::fabs(out[i] - ref[i]));
  std::printf("stick-breaking, %lld x %lld x %lld x %lld: max |float32 kernel - float64 reference| = %.2e\n",
              static_cast<long long>(B), static_cast<long long>(L), static_cast<long long>(H),
              static_cast<long long>(D), worst);

  // A bad argument is an error naming it, before anything is written: here values for one key
  // fewer than there are keys.
  try {
    winnow::AttentionInputs in;
    in.q = winnow::make_view(q.data(), winnow::DType::float32, {B, L, H, D});
    in.k = winnow::make_view(k.data(), winnow::DType::float32, {B, L, H, D});
    in.v = winnow::make_view(v.data(), winnow::DType::float32, {B, L - 1, H, D});
    std::vector<float> o(B * L * H * D), r(B * L * H);
    winnow::stick_breaking::forward(in, {},
                                    {winnow::make_view(o.data(), winnow::DType::float32, {B, L, H, D}),
                                     winnow::make_view(r.data(), winnow::DType::float32, {B, L, H}),
                                     std::nullopt});
    std::printf("no error for values of the wrong length\n");
    return 1;
  } catch (const winnow::Error& e) {
    std::printf("bad argument: %s\n", e.what());
  }
  return worst < 1e-5 ? 0 : 1;
}
