// Synthetic tasks as batches of token sequences: inputs, next-token targets and the mask of
// positions the loss counts. Every batch is a pure function of its seed, so a training run
// can be resumed (or replayed) exactly.
#pragma once

#include <torch/torch.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace winnow::tasks {

struct Batch {
  torch::Tensor inputs;     // (B, L) int64
  torch::Tensor targets;    // (B, L) int64: the token that should follow each input position
  torch::Tensor loss_mask;  // (B, L) float: 1 where the loss counts
};

struct TaskConfig {
  std::string name = "progression";
  std::int64_t vocab_size = 16;
};

class Task {
 public:
  virtual ~Task() = default;
  virtual std::string name() const = 0;
  virtual std::int64_t vocab_size() const = 0;
  virtual Batch sample(std::int64_t batch, std::int64_t length, std::uint64_t seed) const = 0;
};

const std::vector<std::string>& task_names();
std::unique_ptr<Task> make_task(const TaskConfig& config);

// A seed for (run seed, step, micro-batch): distinct streams, stable across resumes.
std::uint64_t batch_seed(std::uint64_t run_seed, std::int64_t step, std::int64_t micro_batch);

}  // namespace winnow::tasks
