// Checkpoints: one folder per saved step holding the model, the optimizer (AdamW moments and
// step counts), the random generators and a trainer.json (step, format version, the full
// configuration). Written under a temporary name and renamed into place, then `latest` is
// replaced the same way: a crash leaves either the old or the new checkpoint, never half of
// one. Loading checks every file and turns any failure into a winnow::Error naming it.
#pragma once

#include <torch/torch.h>

#include <nlohmann/json.hpp>
#include <string>

namespace winnow::train {

struct CheckpointState {
  std::int64_t step = 0;
  nlohmann::json config;  // to_json(ExperimentConfig)
};

// Saves into <root>/step_<step>/ and points <root>/latest at it. Returns the folder.
std::string save_checkpoint(const std::string& root, torch::nn::Module& model,
                            torch::optim::Optimizer& optimizer, const CheckpointState& state);

// The folder <root>/latest names, or "" when there is none.
std::string latest_checkpoint(const std::string& root);

// Restores model, optimizer and generators from a checkpoint folder; returns its state.
CheckpointState load_checkpoint(const std::string& folder, torch::nn::Module& model,
                                torch::optim::Optimizer& optimizer);

}  // namespace winnow::train
