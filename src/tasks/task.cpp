#include "tasks/task.h"

#include <random>

namespace winnow::tasks {
namespace {

// Arithmetic progressions modulo the vocabulary: a, a + s, a + 2s, ... with a and s drawn per
// sequence. Token t >= 2 follows from the two tokens before it, so the model has to attend to
// earlier positions (and tell them apart); the first prediction is unknowable and not counted.
class Progression final : public Task {
 public:
  explicit Progression(std::int64_t vocab) : vocab_(vocab) {}
  std::int64_t vocab_size() const override { return vocab_; }

  Batch sample(std::int64_t batch, std::int64_t length, std::uint64_t seed) const override {
    std::mt19937_64 rng(seed);
    std::uniform_int_distribution<std::int64_t> start(0, vocab_ - 1), step(1, vocab_ - 1);
    torch::Tensor seq = torch::empty({batch, length + 1}, torch::kInt64);
    auto s = seq.accessor<std::int64_t, 2>();
    for (std::int64_t b = 0; b < batch; ++b) {
      const std::int64_t a = start(rng), d = step(rng);
      for (std::int64_t t = 0; t <= length; ++t) s[b][t] = (a + d * t) % vocab_;
    }
    Batch out;
    out.inputs = seq.narrow(1, 0, length).contiguous();
    out.targets = seq.narrow(1, 1, length).contiguous();
    out.loss_mask = torch::ones({batch, length});
    out.loss_mask.narrow(1, 0, 1).zero_();
    return out;
  }

 private:
  std::int64_t vocab_;
};

}  // namespace

const std::vector<std::string>& task_names() {
  static const std::vector<std::string> names = {"progression"};
  return names;
}

std::unique_ptr<Task> make_task(const TaskConfig& config) {
  if (config.name == "progression") return std::make_unique<Progression>(config.vocab_size);
  config::fail("task.name", "one of " + config::join(task_names()), "\"" + config.name + "\"");
}

std::uint64_t batch_seed(std::uint64_t run_seed, std::uint64_t stream, std::int64_t index) {
  // SplitMix64's finalizer over a mix of the three numbers.
  std::uint64_t x = run_seed * 0x9E3779B97F4A7C15ull + stream * 0xBF58476D1CE4E5B9ull +
                    static_cast<std::uint64_t>(index) * 0x94D049BB133111EBull;
  x ^= x >> 30;
  x *= 0xBF58476D1CE4E5B9ull;
  x ^= x >> 27;
  x *= 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

}  // namespace winnow::tasks
