// `winnow demo`: what "selecting instead of spreading" means, on two tiny rows of logits.
// One query attends over 16 keys whose logits are set by hand; with the values chosen as the
// identity matrix, the attention output row is the weight row itself, so the table shows the
// weights each mechanism gives every key, computed by the library's CPU kernels.
#include <cmath>
#include <cstdio>
#include <string>
#include <vector>

#include "commands.h"
#include "winnow/winnow.h"

namespace winnow::apps {
namespace {

constexpr int kKeys = 16;

struct Scenario {
  const char* title;
  std::vector<double> logits;  // one per key position
};

// Weights of the last query over all keys: q = e_0, k_i = logit_i e_0, v = identity.
std::vector<double> weights(const Scenario& s, bool stick_breaking, double* rem) {
  const int d = 2;
  std::vector<double> q(d, 0.0), k(kKeys * d, 0.0), v(kKeys * kKeys, 0.0), out(kKeys), stat(1);
  q[0] = 1.0;
  for (int i = 0; i < kKeys; ++i) {
    k[i * d] = s.logits[i];
    v[i * kKeys + i] = 1.0;
  }
  AttentionInputs in;
  in.q = make_view(q.data(), DType::float64, {1, 1, 1, d});
  in.k = make_view(k.data(), DType::float64, {1, kKeys, 1, d});
  in.v = make_view(v.data(), DType::float64, {1, kKeys, 1, kKeys});
  const TensorView o = make_view(out.data(), DType::float64, {1, 1, 1, kKeys});
  const TensorView st = make_view(stat.data(), DType::float64, {1, 1, 1});
  if (stick_breaking) {
    stick_breaking::Options opt;
    opt.scale = 1.0;
    opt.attend_current = true;  // same visible keys as softmax
    stick_breaking::forward(in, opt, {o, st, std::nullopt});
    *rem = std::exp(stat[0]);
  } else {
    softmax::Options opt;
    opt.scale = 1.0;
    softmax::forward(in, opt, {o, st});
  }
  return out;
}

void show(const Scenario& s) {
  double rem = 0;
  const std::vector<double> soft = weights(s, false, &rem);
  const std::vector<double> stick = weights(s, true, &rem);
  std::printf("\n%s\n", s.title);
  std::printf("  %3s  %7s  %9s  %14s\n", "key", "logit", "softmax", "stick-breaking");
  for (int i = 0; i < kKeys; ++i) {
    std::printf("  %3d  %7.2f  %9.4f  %14.4f\n", i, s.logits[i], soft[i], stick[i]);
  }
  std::printf("  %-22s %14.4f\n", "unallocated stick", rem);
}

}  // namespace

void add_demo_command(CLI::App& app) {
  CLI::App* cmd = app.add_subcommand(
      "demo", "Show softmax and stick-breaking weights on two hand-made rows of logits");
  cmd->callback([] {
    std::printf(
        "One query (the last position) attends over %d keys. Softmax spreads its mass over\n"
        "every key in proportion to exp(logit); stick-breaking lets each key, from the most\n"
        "recent backwards, take a sigmoid(logit) share of the stick that is left.\n",
        kKeys);
    std::vector<double> twins(kKeys, -2.0);
    twins[3] = twins[11] = 6.0;
    show({"Two equally good matches (keys 3 and 11): softmax splits, stick-breaking takes the "
          "recent one",
          twins});
    std::vector<double> crowd(kKeys, 2.0);
    crowd[13] = 5.0;
    crowd[14] = crowd[15] = -3.0;
    show({"Thirteen fair distractors (keys 0-12) before one strong match (key 13): softmax "
          "leaks to the crowd",
          crowd});
  });
}

}  // namespace winnow::apps
