// Experiment files: JSON read strictly into typed configs. Every key is checked: an unknown
// key, a value of the wrong type or out of range is an error naming the key. Command-line
// overrides (`--set train.lr=3e-4`) are applied to the JSON before it is read.
#pragma once

#include <nlohmann/json.hpp>

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "nn/config.h"
#include "tasks/task.h"

namespace winnow::train {

struct TrainConfig {
  std::int64_t steps = 100;
  std::int64_t batch_size = 16;   // sequences per optimizer step (over all micro-batches)
  std::int64_t grad_accum = 1;    // micro-batches per step
  std::int64_t seq_len = 64;
  double lr = 1e-3, weight_decay = 0.1, beta1 = 0.9, beta2 = 0.95, eps = 1e-8;
  // Learning-rate multipliers by parameter-name substring, first match wins (GSA's indexer
  // trains at 10x).
  std::vector<std::pair<std::string, double>> lr_multipliers;
  std::string schedule = "cosine";  // constant | cosine | wsd (warmup-stable-decay)
  std::int64_t warmup = 0;
  double min_lr_ratio = 0.1;        // cosine and wsd end at lr * min_lr_ratio
  double decay_fraction = 0.2;      // wsd: the last fraction of steps decays linearly
  double clip = 0.0;                // global gradient-norm clip; 0 disables
  std::string dtype = "auto";       // auto (bf16 autocast on CUDA, fp32 on CPU) | float32 | bfloat16
  std::int64_t log_every = 10;
  std::int64_t eval_every = 0;      // 0: no periodic evaluation
  std::int64_t eval_batches = 4;
  std::int64_t checkpoint_every = 0;  // 0: only at the end
  std::string out_dir = "runs/default";
};

struct ExperimentConfig {
  std::uint64_t seed = 1;
  std::string device = "auto";  // auto | cpu | cuda | cuda:N
  int threads = 0;              // CPU threads for LibTorch and winnow; 0: default
  nn::ModelConfig model;
  TrainConfig train;
  tasks::TaskConfig task;
};

// Reads a JSON experiment file, applies `key.path=value` overrides, and parses strictly.
ExperimentConfig load_experiment(const std::string& path, const std::vector<std::string>& overrides);
ExperimentConfig parse_experiment(const nlohmann::json& j);
void apply_override(nlohmann::json& j, const std::string& assignment);

// The full configuration with every default filled in (saved beside checkpoints).
nlohmann::json to_json(const ExperimentConfig& c);

}  // namespace winnow::train
