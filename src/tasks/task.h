// Synthetic tasks as batches of token sequences: inputs, targets and the mask of positions
// the loss counts. A batch is a pure function of its seed, so a training run can be resumed or
// replayed exactly and held-out batches never meet training ones. The length-extrapolation
// tasks of spec/tasks.md (MQRAR, Copy, ABCDigits, passkey) arrive with their own issue; the
// toy task here is what the trainer's tests and the example configs learn.
#pragma once

#include <torch/torch.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "nn/fields.h"

namespace winnow::tasks {

struct Batch {
  torch::Tensor inputs;     // (B, L) int64
  torch::Tensor targets;    // (B, L) int64: what the model should predict at each position
  torch::Tensor loss_mask;  // (B, L) float32: 1 where the loss and the accuracy count
};

struct TaskConfig {
  std::string name = "progression";
  std::int64_t vocab_size = 16;

  template <class V>
  void fields(V& v) {
    v("name", name);
    v("vocab_size", vocab_size, config::at_least(3));
  }
};

class Task {
 public:
  virtual ~Task() = default;
  virtual std::int64_t vocab_size() const = 0;
  virtual Batch sample(std::int64_t batch, std::int64_t length, std::uint64_t seed) const = 0;
};

const std::vector<std::string>& task_names();
// An unknown name is an error naming task.name.
std::unique_ptr<Task> make_task(const TaskConfig& config);

// A seed for (run seed, stream, index): independent, well-spread streams that do not depend
// on how the run was interrupted.
std::uint64_t batch_seed(std::uint64_t run_seed, std::uint64_t stream, std::int64_t index);

}  // namespace winnow::tasks
