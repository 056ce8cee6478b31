// Experiment files: one JSON object with seed, device, threads, model, train and task. Read
// strictly through the structs' field lists (nn/fields.h): an unknown key, a value of the wrong
// type or out of range is an error naming the full key. Command-line overrides
// (`--set train.lr=3e-4`) are applied to the JSON before it is read, so they get the same checks.
#pragma once

#include <nlohmann/json.hpp>

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "nn/config.h"
#include "nn/fields.h"
#include "tasks/task_config.h"

namespace winnow::train {

// A stretch of training with its own trainable parameters and loss weights (GSA trains its
// indexer alone, on its own loss, before everything trains together). Phases run in order;
// every phase but the last lasts `steps` steps, or `fraction` of train.steps (rounded; so that
// one study file serves short and long runs), the last one runs to train.steps.
struct Phase {
  std::string name;
  std::int64_t steps = 0;
  // Parameter-name substrings. train_only: only matching parameters train; freeze: matching
  // parameters do not. Each must match some parameter of the model.
  std::vector<std::string> train_only, freeze;
  double lr_scale = 1.0;  // multiplies the scheduled learning rate during the phase
  // Weights of auxiliary losses by name, over train.aux_loss_weights.
  std::map<std::string, double> aux_loss_weights;
  double fraction = 0;  // of train.steps, instead of steps

  // The phase's length in a run of `total` steps.
  std::int64_t length(std::int64_t total) const {
    return steps > 0 ? steps : static_cast<std::int64_t>(fraction * static_cast<double>(total) + 0.5);
  }

  template <class V>
  void fields(V& v) {
    v("name", name);
    v("steps", steps, config::at_least(0));
    v("fraction", fraction, config::in_range(0, 1, false));
    v("train_only", train_only);
    v("freeze", freeze);
    v("lr_scale", lr_scale, config::at_least(0));
    v("aux_loss_weights", aux_loss_weights, config::at_least(0));
  }
};

struct TrainConfig {
  std::int64_t steps = 100;
  std::int64_t batch_size = 16;  // sequences per optimizer step, over all micro-batches
  std::int64_t grad_accum = 1;   // micro-batches per step
  std::int64_t seq_len = 64;
  double lr = 1e-3, weight_decay = 0.1, beta1 = 0.9, beta2 = 0.95, eps = 1e-8;
  // Learning-rate multipliers by parameter-name substring; the longest matching substring wins
  // (GSA's indexer trains at 10x: {"indexer": 10}).
  std::map<std::string, double> lr_multipliers;
  std::string schedule = "cosine";  // constant | cosine | wsd (warmup-stable-decay)
  std::int64_t warmup = 0;          // linear warmup steps before the schedule
  double min_lr_ratio = 0.1;        // cosine and wsd end at lr * min_lr_ratio
  double decay_fraction = 0.2;      // wsd: the last fraction of the post-warmup steps decays
  double clip = 0.0;                // global gradient-norm clip; 0: off
  std::string dtype = "auto";       // auto: bf16 autocast on CUDA, float32 on the CPU
  // Deterministic kernels (winnow's backward without atomics on CUDA); the CPU is
  // deterministic for a fixed thread count either way.
  bool deterministic = false;
  // On CUDA, capture the whole step (forward, backward, clipping, AdamW) as a CUDA graph after a
  // few ordinary steps, and replay it: one launch instead of hundreds. Taken where the layer
  // kind allows it (softmax and stick-breaking without dynamic RoPE; see
  // Trainer::graph_blocker) and nothing on the host (step hooks, auxiliary loss functions, a
  // profile) needs to run inside the step. Same results as without it.
  bool cuda_graph = true;
  // Data-parallel training: the largest bucket of gradients summed over the ranks in one
  // all-reduce, in MiB (DistributedDataParallel's bucket_cap_mb; the first bucket holds at
  // most 1 MiB so that communication starts early in the backward pass).
  double bucket_mb = 25;
  std::map<std::string, double> aux_loss_weights;  // by name; an unlisted aux loss weighs 1
  std::vector<Phase> phases;
  std::int64_t log_every = 10;
  // A step whose loss exceeds the running mean by this fraction counts as a loss spike
  // (TrainingHealth in train/trainer.h).
  double spike_threshold = 0.25;
  std::int64_t eval_every = 0;        // 0: only at the end
  std::int64_t eval_batches = 4;
  std::int64_t checkpoint_every = 0;  // 0: only at the end
  std::int64_t keep_checkpoints = 2;  // newest checkpoints kept; 0: all
  std::string out_dir = "runs/default";

  template <class V>
  void fields(V& v) {
    v("steps", steps, config::at_least(0));
    v("batch_size", batch_size, config::at_least(1));
    v("grad_accum", grad_accum, config::at_least(1));
    v("seq_len", seq_len, config::at_least(1));
    v("lr", lr, config::greater_than(0));
    v("weight_decay", weight_decay, config::at_least(0));
    v("beta1", beta1, config::in_range(0, 1, false));
    v("beta2", beta2, config::in_range(0, 1, false));
    v("eps", eps, config::greater_than(0));
    v("lr_multipliers", lr_multipliers, config::greater_than(0));
    v("schedule", schedule, config::one_of({"constant", "cosine", "wsd"}));
    v("warmup", warmup, config::at_least(0));
    v("min_lr_ratio", min_lr_ratio, config::in_range(0, 1, true));
    v("decay_fraction", decay_fraction, config::with_words(config::in_range(0, 1, true), "> 0"));
    v("clip", clip, config::with_words(config::at_least(0), "0: off"));
    v("dtype", dtype, config::one_of({"auto", "float32", "bfloat16"}));
    v("deterministic", deterministic);
    v("cuda_graph", cuda_graph);
    v("bucket_mb", bucket_mb, config::greater_than(0));
    v("aux_loss_weights", aux_loss_weights, config::at_least(0));
    v("phases", phases);
    v("log_every", log_every, config::at_least(1));
    v("spike_threshold", spike_threshold, config::greater_than(0));
    v("eval_every", eval_every, config::with_words(config::at_least(0), "0: only at the end"));
    v("eval_batches", eval_batches, config::at_least(1));
    v("checkpoint_every", checkpoint_every,
      config::with_words(config::at_least(0), "0: only at the end"));
    v("keep_checkpoints", keep_checkpoints, config::with_words(config::at_least(0), "0: all"));
    v("out_dir", out_dir);
  }
};

struct ExperimentConfig {
  std::uint64_t seed = 1;
  std::string device = "auto";  // auto | cpu | cuda | cuda:N
  std::int64_t threads = 0;     // CPU threads for LibTorch and winnow's kernels; 0: default
  nn::ModelConfig model;
  TrainConfig train;
  tasks::TaskConfig task;

  template <class V>
  void fields(V& v) {
    v("seed", seed);
    v("device", device);
    v("threads", threads, config::with_words(config::at_least(0), "0: the default"));
    // model is read and written by nn::read_model / nn::write_model; train and task here.
    v("train", train);
    v("task", task);
  }
};

// A JSON file; errors name the command-line `argument` it came from.
nlohmann::json read_json_file(const std::string& path, const std::string& argument);

// Reads an experiment file, applies `key.path=value` overrides, and parses strictly.
ExperimentConfig load_experiment(const std::string& path, const std::vector<std::string>& overrides);
// Parses and resolves: every placeholder (model.vocab_size 0, "auto", ...) replaced.
ExperimentConfig parse_experiment(const nlohmann::json& j);
// Checks a configuration (also one built in code) and fills its placeholders; errors name the
// key. Idempotent.
void resolve(ExperimentConfig& c);
// Sets the value at a dotted key path; the value is parsed as JSON, or taken as a string when
// it is not JSON (so --set model.attention.kind=softmax needs no quotes).
void apply_override(nlohmann::json& j, const std::string& assignment);

// The full configuration with every default filled in, as checkpoints store it.
nlohmann::json to_json(const ExperimentConfig& c);

}  // namespace winnow::train
