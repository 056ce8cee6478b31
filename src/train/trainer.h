// The training loop: AdamW with per-parameter-group learning-rate multipliers, warmup then
// constant / cosine / warmup-stable-decay schedules, gradient accumulation and clipping,
// bf16 autocast on CUDA, seeded batches (a pure function of run seed and step, so resumed runs
// replay exactly), atomic checkpoints, a JSON-lines metrics log, a progress line, and hooks
// for evaluation, auxiliary losses and phased schedules.
#pragma once

#include <torch/torch.h>

#include <functional>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "nn/transformer.h"
#include "tasks/task.h"
#include "train/config.h"

namespace winnow::train {

// The learning-rate factor (of train.lr) at a step: linear warmup, then the schedule.
double lr_factor(const TrainConfig& c, std::int64_t step);

// Cross entropy over the positions the mask keeps, and the fraction predicted exactly.
struct LossResult {
  torch::Tensor loss;  // scalar, differentiable
  double accuracy = 0;
};
LossResult masked_cross_entropy(const torch::Tensor& logits, const tasks::Batch& batch);

class Trainer {
 public:
  explicit Trainer(const ExperimentConfig& config);

  // Continues from <out_dir>/checkpoints/latest when one exists; returns whether it did.
  bool resume();
  // Trains until `until_step` (default: train.steps), logging, evaluating and checkpointing
  // as configured; saves a checkpoint at the end.
  void train(std::int64_t until_step = -1);
  // Mean loss and accuracy over train.eval_batches held-out batches.
  nlohmann::json evaluate();
  std::string save();

  std::int64_t step() const { return step_; }
  nn::TransformerLM& model() { return model_; }
  const ExperimentConfig& config() const { return config_; }
  torch::Device device() const { return device_; }

  // Extension points. Loss of a micro-batch (default: masked cross entropy); auxiliary
  // losses add to it. Step hooks run before each step (freezing parameters for a phase,
  // changing loss weights). Evaluation hooks add metrics to each evaluation.
  std::function<LossResult(Trainer&, const tasks::Batch&, const torch::Tensor& logits)> loss_fn;
  std::vector<std::function<void(Trainer&, std::int64_t step)>> step_hooks;
  std::vector<std::function<nlohmann::json(Trainer&)>> eval_hooks;
  bool quiet = false;  // no progress line on stdout

 private:
  void log(const nlohmann::json& record);
  double train_step();

  ExperimentConfig config_;
  torch::Device device_;
  bool autocast_ = false;
  nn::TransformerLM model_{nullptr};
  std::unique_ptr<tasks::Task> task_;
  std::unique_ptr<torch::optim::AdamW> optimizer_;
  std::vector<double> group_multipliers_;
  std::int64_t step_ = 0;
  std::string metrics_path_;
};

}  // namespace winnow::train
