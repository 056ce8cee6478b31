// What a model is made of, as plain values: the train layer fills these from JSON experiment
// files, tests fill them directly.
#pragma once

#include <cstdint>
#include <string>

namespace winnow::nn {

// Rotary position embedding and the extrapolation variants the seeds use (spec/softmax.md).
struct RopeConfig {
  std::string scaling = "none";  // none | linear | ntk | dynamic | yarn
  double theta = 10000.0;
  double factor = 1.0;                 // linear / ntk / dynamic / yarn scale
  std::int64_t original_max_len = 0;   // training length (dynamic, yarn); 0: from the model
  double yarn_beta_fast = 32.0, yarn_beta_slow = 1.0;
};

struct AttentionConfig {
  // softmax | differential | stick_breaking
  std::string kind = "softmax";
  // rope | nope | alibi (alibi: softmax only, composed implementation)
  std::string position = "rope";
  RopeConfig rope;
  std::int64_t heads = 4;
  std::int64_t kv_heads = 0;   // 0: same as heads
  std::int64_t head_dim = 0;   // 0: d_model / heads
  // Options of the softmax family (spec/softmax.md).
  bool ssmax = false;            // scalable softmax: logits times s_h log(n_j)
  std::string gate = "none";     // none | g1 (output gate) | g2 (value gate) | g1g2
  // Options of stick-breaking (spec/stick-breaking.md).
  bool remainder_bias = false;   // o_j += rem_j r_h
  bool head_norm = false;        // RMS norm over each head's output, after the remainder bias
  double halt_cutoff = 0.0;
  // Which implementation evaluates the attention: the fused operators (kernel) or the
  // equivalent LibTorch expression (composed; the baseline the benchmarks compare against).
  std::string implementation = "kernel";
};

struct ModelConfig {
  std::int64_t vocab_size = 16;
  std::int64_t d_model = 256;
  std::int64_t layers = 2;
  std::string mlp = "swiglu";    // swiglu | gelu
  std::int64_t mlp_hidden = 0;   // 0: 8/3 d (swiglu) or 4 d (gelu), rounded to 64
  bool tie_embeddings = true;
  double norm_eps = 1e-6;
  std::int64_t max_len = 1024;   // training context (RoPE scaling and SSMax use it)
  double init_std = 0.02;
  AttentionConfig attention;
};

}  // namespace winnow::nn
