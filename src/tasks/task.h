// Synthetic tasks as batches of token sequences: inputs, targets and the mask of positions
// the loss and the accuracy count. A batch is a pure function of its seed, so a training run can
// be resumed or replayed exactly, held-out batches never meet training ones, and the same seed
// gives the same instances on every machine (the generators use only std::mt19937_64's raw
// output, never the standard distributions, whose algorithms differ between libraries).
//
// The tasks of spec/tasks.md: MQRAR and Copy are scored on whole sequences in one forward pass;
// ABCDigits and passkey are generative: a prompt, then an answer the model must produce greedily
// (eval/ runs that through the KV cache). `progression` is the toy task the trainer's tests use.
#pragma once

#include <torch/torch.h>

#include <cstdint>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "tasks/task_config.h"

namespace winnow::tasks {

struct Batch {
  torch::Tensor inputs;     // (B, L) int64
  torch::Tensor targets;    // (B, L) int64: what the model should predict at each position
  torch::Tensor loss_mask;  // (B, L) float32: 1 where the loss and the accuracy count
};

// A prompt of a generative task and the tokens that must follow it.
struct Prompt {
  std::vector<std::int64_t> tokens;
  std::vector<std::int64_t> answer;
};

class Task {
 public:
  virtual ~Task() = default;
  virtual std::int64_t vocab_size() const = 0;
  // The shortest sequence the task can fill (errors name the length asked for).
  virtual std::int64_t min_length() const { return 1; }
  // `batch` sequences of exactly `length` tokens. Generative tasks' sequences are prompt +
  // answer with the loss on the answer only, needles at uniformly random depths.
  virtual Batch sample(std::int64_t batch, std::int64_t length, std::uint64_t seed) const = 0;
  // What training draws: sample() unless a task trains on a wider distribution than it is
  // evaluated on (Copy's varied_training).
  virtual Batch sample_training(std::int64_t batch, std::int64_t length, std::uint64_t seed) const {
    return sample(batch, length, seed);
  }

  // Generative tasks only: a prompt such that prompt + answer has exactly `length` tokens, with
  // the needle at `depth` in [0, 1].
  virtual bool generative() const { return false; }
  virtual Prompt prompt(std::int64_t length, double depth, std::uint64_t seed) const;

  // Tokens as text, for examples in reports and tests.
  virtual std::string render(const std::vector<std::int64_t>& tokens) const;

 protected:
  // Throws naming `what` when length < min_length().
  void check_length(std::int64_t length, const std::string& what = "length") const;
  // Throws naming `depth` unless 0 <= depth <= 1 (NaN included).
  static void check_depth(double depth);
  // A batch of zero inputs, targets and mask for a generator to fill.
  static Batch blank_batch(std::int64_t batch, std::int64_t length);
  // sample() of a generative task, from prompt().
  Batch sample_prompts(std::int64_t batch, std::int64_t length, std::uint64_t seed) const;
};

// The generative tasks over character tokens (ABCDigits, passkey): they write prompt() and
// min_length(); training batches are prompt + answer, tokens render as text.
class CharacterPromptTask : public Task {
 public:
  // training_loss: "answer" or "document" (task_config.h, AbcdigitsConfig).
  explicit CharacterPromptTask(const std::string& training_loss = "answer");
  std::int64_t vocab_size() const override { return text::kVocab; }
  bool generative() const override { return true; }
  Batch sample(std::int64_t batch, std::int64_t length, std::uint64_t seed) const override {
    return sample_prompts(batch, length, seed);
  }
  Batch sample_training(std::int64_t batch, std::int64_t length, std::uint64_t seed) const override;
  std::string render(const std::vector<std::int64_t>& tokens) const override {
    return text::decode(tokens);
  }

 private:
  bool document_loss_;
};

// An unknown name is an error naming task.name.
std::unique_ptr<Task> make_task(const TaskConfig& config);

// The generators, each in its own file.
std::unique_ptr<Task> make_mqrar(const MqrarConfig& config);
std::unique_ptr<Task> make_copy(const CopyConfig& config);
std::unique_ptr<Task> make_abcdigits(const AbcdigitsConfig& config = {});
std::unique_ptr<Task> make_passkey(const PasskeyConfig& config);
std::unique_ptr<Task> make_corpus(const CorpusConfig& config);

// MQRAR's labels for one sequence of `tokens` (key tokens < keys, value tokens >= keys) whose
// first `initial_pairs` pairs are the initial assignment: at each later key position, the value
// bound to that key by its most recent pair; -1 at every other position.
std::vector<std::int64_t> mqrar_labels(const std::vector<std::int64_t>& tokens, std::int64_t keys,
                                       std::int64_t initial_pairs);
// How a sequence of `length` tokens splits into initial and query pairs.
struct MqrarShape {
  std::int64_t initial_pairs, queries;
};
MqrarShape mqrar_shape(const MqrarConfig& config, std::int64_t length);

// A seed for (run seed, stream, index): independent, well-spread streams that do not depend
// on how the run was interrupted.
std::uint64_t batch_seed(std::uint64_t run_seed, std::uint64_t stream, std::int64_t index);

// Portable random draws on std::mt19937_64's raw output (same numbers on every platform).
class Rng {
 public:
  explicit Rng(std::uint64_t seed) : engine_(seed) {}
  // Uniform in [0, n), n >= 1 (rejection sampling, no modulo bias).
  std::uint64_t below(std::uint64_t n);
  // Uniform in [0, 1).
  double uniform();
  // Fisher-Yates.
  template <class T>
  void shuffle(std::vector<T>& items) {
    for (std::size_t i = items.size(); i > 1; --i) std::swap(items[i - 1], items[below(i)]);
  }

 private:
  std::mt19937_64 engine_;
};

}  // namespace winnow::tasks
