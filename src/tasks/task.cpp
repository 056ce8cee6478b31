#include "tasks/task.h"

#include <sstream>

#include "winnow/error.h"

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
    check_length(length);
    Rng rng(seed);
    const auto v = static_cast<std::uint64_t>(vocab_);
    torch::Tensor seq = torch::empty({batch, length + 1}, torch::kInt64);
    auto s = seq.accessor<std::int64_t, 2>();
    for (std::int64_t b = 0; b < batch; ++b) {
      const auto a = static_cast<std::int64_t>(rng.below(v));
      const auto d = static_cast<std::int64_t>(1 + rng.below(v - 1));
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

Prompt Task::prompt(std::int64_t, double, std::uint64_t) const {
  throw Error(ErrorKind::invalid_argument,
              "task: prompts are for generative tasks (abcdigits, passkey); this task is scored "
              "on whole sequences");
}

std::string Task::render(const std::vector<std::int64_t>& tokens) const {
  std::string out;
  for (std::int64_t t : tokens) out += (out.empty() ? "" : " ") + std::to_string(t);
  return out;
}

void Task::check_length(std::int64_t length, const std::string& what) const {
  if (length < min_length()) {
    throw Error(ErrorKind::invalid_argument,
                what + ": expected >= " + std::to_string(min_length()) +
                    " tokens for this task, got " + std::to_string(length));
  }
}

void Task::check_depth(double depth) {
  if (!(depth >= 0 && depth <= 1)) {  // written this way so that NaN fails too
    std::ostringstream got;
    got << depth;
    throw Error(ErrorKind::invalid_argument, "depth: expected in [0, 1], got " + got.str());
  }
}

Batch Task::blank_batch(std::int64_t batch, std::int64_t length) {
  return {torch::zeros({batch, length}, torch::kInt64),
          torch::zeros({batch, length}, torch::kInt64), torch::zeros({batch, length})};
}

Batch Task::sample_prompts(std::int64_t batch, std::int64_t length, std::uint64_t seed) const {
  check_length(length);
  Rng rng(seed);
  Batch out = blank_batch(batch, length);
  auto in = out.inputs.accessor<std::int64_t, 2>();
  auto tg = out.targets.accessor<std::int64_t, 2>();
  auto m = out.loss_mask.accessor<float, 2>();
  for (std::int64_t b = 0; b < batch; ++b) {
    const double depth = rng.uniform();
    const std::uint64_t row_seed = rng.below(~0ull);
    Prompt p = prompt(length, depth, row_seed);
    std::vector<std::int64_t> full = std::move(p.tokens);
    full.insert(full.end(), p.answer.begin(), p.answer.end());
    const auto answer = static_cast<std::int64_t>(p.answer.size());
    if (static_cast<std::int64_t>(full.size()) != length) {
      throw Error(ErrorKind::runtime, "task: a prompt and its answer have " +
                                          std::to_string(full.size()) + " tokens, not " +
                                          std::to_string(length));
    }
    for (std::int64_t t = 0; t < length; ++t) {
      in[b][t] = full[t];
      if (t + 1 < length) tg[b][t] = full[t + 1];
    }
    // The prediction made at position t is of token t + 1: the answer's tokens are predicted
    // from positions L - answer - 1 .. L - 2, the last position predicts nothing.
    for (std::int64_t t = length - answer - 1; t <= length - 2; ++t) m[b][t] = 1.0f;
  }
  return out;
}

CharacterPromptTask::CharacterPromptTask(const std::string& training_loss)
    : document_loss_(training_loss == "document") {
  if (training_loss != "answer" && training_loss != "document") {
    config::fail("training_loss", "answer or document", "\"" + training_loss + "\"");
  }
}

Batch CharacterPromptTask::sample_training(std::int64_t batch, std::int64_t length,
                                           std::uint64_t seed) const {
  Batch out = sample_prompts(batch, length, seed);
  // Every position but the last predicts a token of the document.
  if (document_loss_) out.loss_mask.narrow(1, 0, length - 1).fill_(1.0f);
  return out;
}

std::unique_ptr<Task> make_task(const TaskConfig& config) {
  if (config.name == "progression") return std::make_unique<Progression>(config.vocab_size);
  if (config.name == "mqrar") return make_mqrar(config.mqrar);
  if (config.name == "copy") return make_copy(config.copy);
  if (config.name == "abcdigits") return make_abcdigits(config.abcdigits);
  if (config.name == "passkey") return make_passkey(config.passkey);
  if (config.name == "corpus") return make_corpus(config.corpus);
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

std::uint64_t Rng::below(std::uint64_t n) {
  if (n == 0) throw Error(ErrorKind::runtime, "Rng::below(0): an empty range");
  // The largest multiple of n that fits, so every residue is equally likely.
  const std::uint64_t limit = n == 0 ? 0 : (~0ull / n) * n;
  std::uint64_t x = engine_();
  while (x >= limit) x = engine_();
  return x % n;
}

double Rng::uniform() { return static_cast<double>(engine_() >> 11) * 0x1.0p-53; }

}  // namespace winnow::tasks
