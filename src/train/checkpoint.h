// Checkpoints: one folder per saved step holding model.pt, optimizer.pt (AdamW's moments and
// step counts), rng.pt (the CPU generator, and the CUDA one when training on CUDA) and
// trainer.json (format version, step, the full configuration, the trainer's own state such as
// the metrics log size, and the size and checksum of every other file).
//
// Writing is atomic: the folder is written under a temporary name, flushed to disk, renamed
// into place, and only then is `latest` replaced (also by rename). A crash or kill at any
// moment leaves the previous checkpoint intact and `latest` naming a complete one.
// Loading verifies sizes and checksums before LibTorch reads anything, so a truncated or
// corrupt file is a winnow::Error naming it, never a crash or silently wrong weights.
#pragma once

#include <torch/torch.h>

#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace winnow::train {

struct CheckpointMeta {
  std::int64_t step = 0;
  nlohmann::json config;                              // train::to_json(ExperimentConfig)
  nlohmann::json trainer = nlohmann::json::object();  // the trainer's own state
};

// Saves into <root>/step_<step>/ and points <root>/latest at it; keeps the newest `keep`
// step folders (0: all). `cuda_device`: also save that device's generator. Returns the folder.
std::string save_checkpoint(const std::string& root, torch::nn::Module& model,
                            torch::optim::Optimizer& optimizer, const CheckpointMeta& meta,
                            std::int64_t keep, std::optional<torch::Device> cuda_device);

// The folder <root>/latest names, or "" when there is none.
std::string latest_checkpoint(const std::string& root);

// The step folders under root (<root>/step_<step>, not the .tmp ones of an unfinished save),
// oldest first: (step, folder).
std::vector<std::pair<std::int64_t, std::string>> step_checkpoints(const std::string& root);

// Reads trainer.json and verifies every file of the folder against it.
CheckpointMeta read_checkpoint(const std::string& folder);

// Restores model, optimizer and generators from a folder read_checkpoint accepted.
void restore_checkpoint(const std::string& folder, torch::nn::Module& model,
                        torch::optim::Optimizer& optimizer, std::optional<torch::Device> cuda_device);

// Restores only the model's weights (evaluation), from a folder read_checkpoint accepted.
void restore_model(const std::string& folder, torch::nn::Module& model);

}  // namespace winnow::train
