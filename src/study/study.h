// Studies: several attention mechanisms trained on one task with one budget, then evaluated at
// multiples of the training length (spec/tasks.md). A study file is JSON:
//
//   {"name": "mqrar", "title": "...",
//    "base": {an experiment file: seed, device, model, train, task},
//    "mechanisms": [{"label": "Softmax+RoPE", "set": {"model.attention.kind": "softmax", ...},
//                    "eval_set": {"model...": ...}}],
//    "eval": {"multiples": [1, 4, 16], "instances": 1000, ...},
//    "profiles": {"cpu": {"base.train.steps": 300, ...}, "cuda": {...}},
//    "out_dir": "runs/studies/mqrar"}
//
// Each mechanism's run is the base with its `set` applied (dotted keys, as --set takes them).
// The profile matching where the study runs ("cuda" when the base's device resolves to a GPU,
// else "cpu") is applied to the study first, so one file holds a small CPU default and a bigger
// GPU one; command-line overrides come last. Runs continue from their checkpoints.
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "nn/fields.h"

namespace winnow::study {

struct MechanismEntry {
  std::string label;
  nlohmann::json set = nlohmann::json::object();
  // Dotted keys of the model changed for evaluation only, on the trained weights: e.g. 001's
  // screening-window expansion, {"model.multiscreen.window_expansion": 256}.
  nlohmann::json eval_set = nlohmann::json::object();

  template <class V>
  void fields(V& v) {
    v("label", label);
    v("set", set);
    v("eval_set", eval_set);
  }
};

struct EvalConfig {
  std::vector<std::int64_t> multiples = {1, 4, 16};        // of train.seq_len; 1 is in distribution
  std::int64_t instances = 200;                            // fresh instances per length (and depth)
  std::vector<double> depths = {0.1, 0.3, 0.5, 0.7, 0.9};  // generative tasks' needle depths
  // The table's and the plot's measure: accuracy (per labelled position: per query for MQRAR,
  // per token for Copy) or exact_match (per sequence). Generative tasks have exact match only.
  std::string metric = "accuracy";
  std::int64_t batch_tokens = 0;  // tokens per forward pass; 0: 16384 on the CPU, 262144 on CUDA
  // Per-layer, per-head diagnostics (nn/probe.h) at every length up to diagnostics_max_length.
  bool diagnostics = true;
  std::int64_t probe_rows = 16;
  std::int64_t diagnostics_max_length = 16384;
  // Dotted overrides of the task for evaluation only (e.g. {"mqrar.scored_queries": 4}).
  nlohmann::json task = nlohmann::json::object();
  // Loss by position at every length, in bins of train.seq_len / position_bins positions
  // (so a length of m times the training length has m * position_bins bins); 0: not measured.
  std::int64_t position_bins = 0;
  // Full-context forward latency of the evaluated model at these lengths (001 figure 8): one
  // sequence, no gradients, the median of latency_repeats timed passes; []: not measured.
  std::vector<std::int64_t> latency_lengths;
  std::int64_t latency_repeats = 5;
  // Checkpoint selection (000's protocol: the checkpoint chosen at 8x). When > 0, every kept
  // checkpoint of a run (train.checkpoint_every apart; train.keep_checkpoints 0 keeps all) is
  // scored by the study's measure at this multiple of the training length, on select_instances
  // instances drawn apart from the evaluation's, and the evaluation takes the best one's
  // weights (the later on a tie); 0: the final weights.
  std::int64_t select_multiple = 0;
  std::int64_t select_instances = 200;

  template <class V>
  void fields(V& v) {
    v("multiples", multiples, config::at_least(1));
    v("instances", instances, config::at_least(1));
    v("depths", depths, config::in_range(0, 1, true));
    v("metric", metric, config::one_of({"accuracy", "exact_match"}));
    v("batch_tokens", batch_tokens, config::with_words(config::at_least(0), "0: by device"));
    v("diagnostics", diagnostics);
    v("probe_rows", probe_rows, config::at_least(1));
    v("diagnostics_max_length", diagnostics_max_length, config::at_least(1));
    v("task", task);
    v("position_bins", position_bins, config::with_words(config::at_least(0), "0: off"));
    v("latency_lengths", latency_lengths, config::at_least(1));
    v("latency_repeats", latency_repeats, config::at_least(1));
    v("select_multiple", select_multiple, config::with_words(config::at_least(0), "0: the final weights"));
    v("select_instances", select_instances, config::at_least(1));
  }
};

// A sweep trains every mechanism once per value of one key of its experiment (001 figure 5:
// final loss against the learning rate) and reports the final held-out loss of each run,
// marking the runs that diverged, instead of evaluating lengths.
struct SweepConfig {
  std::string key;  // a dotted key of the experiment, e.g. "train.lr"; "": no sweep
  nlohmann::json values = nlohmann::json::array();  // a non-empty list when key is set

  template <class V>
  void fields(V& v) {
    v("key", key);
    v("values", values);
  }
};

struct Study {
  std::string name = "study";
  std::string title;
  nlohmann::json base = nlohmann::json::object();
  std::vector<MechanismEntry> mechanisms;
  EvalConfig eval;
  nlohmann::json profiles = nlohmann::json::object();
  SweepConfig sweep;
  std::string out_dir;  // "": runs/studies/<name>
  std::string profile;  // set by load_study: the profile applied (cpu or cuda)

  template <class V>
  void fields(V& v) {
    v("name", name);
    v("title", title);
    v("base", base);
    v("mechanisms", mechanisms);
    v("eval", eval);
    v("profiles", profiles);
    v("sweep", sweep);
    v("out_dir", out_dir);
  }
};

// Reads a study file, applies the profile for where it will run and then `overrides`
// (`key.path=value`), and checks it: every mechanism's experiment config is parsed, so a bad
// key in a `set` is an error naming the mechanism and the key. Returns the resolved study.
Study load_study(const std::string& path, const std::vector<std::string>& overrides);

struct RunOptions {
  bool fresh = false;             // retrain every mechanism from scratch
  bool quiet = false;             // no training progress lines
  std::vector<std::string> only;  // labels to run (empty: all)
};

// Trains and evaluates every mechanism; writes <out_dir>/result.json, table.md and, when the
// build has PLplot, accuracy.svg (and for language modeling loss_by_position.svg and
// sink_ratio.svg). With a sweep it runs run_sweep instead. Returns the result JSON.
nlohmann::json run_study(const Study& study, const RunOptions& options);

// Trains every mechanism at every value of study.sweep, each run in
// <out_dir>/sweep_<key>/<mechanism>/<value>; a run diverged when a step's loss or gradient
// norm was not finite or its final held-out loss is no better than uniform guessing
// (ln vocab). Writes <out_dir>/sweep_<key>.json, .md and (with PLplot) .svg; returns the JSON.
nlohmann::json run_sweep(const Study& study, const RunOptions& options);

// A short file-system-safe name for a mechanism label.
std::string slug(const std::string& label);

}  // namespace winnow::study
