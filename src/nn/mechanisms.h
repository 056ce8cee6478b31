// The attention mechanisms the model layer can build, one registry entry each. An entry names
// the mechanism, states which positional encodings it takes, checks and completes its own
// configuration keys, and makes its layer. Adding a mechanism is a new layer file with its
// entry, plus one line in the table in nn/attention.cpp; configuration files, `winnow info` and
// the factory pick it up from there.
//
// This header needs no LibTorch, so the configuration reader and `winnow info` stay light.
#pragma once

#include <nlohmann/json.hpp>

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "nn/config.h"

namespace winnow::nn {

class AttentionLayer;

struct Mechanism {
  std::string name;
  std::string summary;                 // one line for `winnow info`
  std::string fused_operator;          // the winnow operator its kernel path calls
  std::vector<std::string> positions;  // the positional encodings it takes; the first is its default
  std::vector<std::string> option_keys;  // its own keys in model.attention, for messages and info
  // Why a training step with this layer cannot be captured as a CUDA graph (a synchronization
  // with the host, or tensors built from host data, inside its forward or backward), or "" when
  // it can; given the resolved configuration, since that can decide it (Sieve's filter). Unset:
  // it cannot, the layer not having been checked for capture.
  std::function<std::string(const AttentionConfig&)> graph_blocker;

  // Checks the mechanism's own keys (found in the attention object at `path`) and returns them
  // with every default filled in; an unknown key or bad value is an error naming it.
  std::function<nlohmann::json(const nlohmann::json& options, const std::string& path)> resolve_options;
  // Why the fused operator cannot evaluate this (resolved) configuration, or "" when it can.
  std::function<std::string(const AttentionConfig&)> kernel_gap;
  // Cross-key checks once options are resolved (errors name `path`.key); may be empty.
  std::function<void(const AttentionConfig&, const std::string& path)> check;
  // Builds the layer; layer_index counts from 0.
  std::function<std::shared_ptr<AttentionLayer>(const ModelConfig&, std::int64_t layer_index)> make;
};

// Mechanism::graph_blocker of a layer whose steps never synchronize with the host.
inline std::string no_graph_blocker(const AttentionConfig&) { return ""; }

const std::vector<Mechanism>& mechanisms();
// The entry called `name`; an unknown name is an error naming `key` and listing the known ones.
const Mechanism& find_mechanism(const std::string& name, const std::string& key);

}  // namespace winnow::nn
