// What a model is made of, as plain values. Experiment files fill these through their field
// lists (nn/fields.h); tests and programs fill them directly. resolve() checks a config and
// replaces every "auto" or 0 placeholder by the value it stands for; the model calls it too,
// so a config built in code gets the same errors as one read from a file.
#pragma once

#include <cstdint>
#include <string>

#include "nn/fields.h"

namespace winnow::nn {

// Rotary position embedding and the extrapolation variants the seeds use (spec/softmax.md).
struct RopeConfig {
  std::string scaling = "none";  // none | linear | ntk | dynamic | yarn
  double theta = 10000.0;
  double factor = 1.0;  // the context extension factor of linear / ntk / dynamic / yarn
  // YaRN's ramp: dimensions rotating more than beta_fast times over the training context keep
  // their frequency, those rotating fewer than beta_slow times are interpolated.
  double yarn_beta_fast = 32.0, yarn_beta_slow = 1.0;

  template <class V>
  void fields(V& v) {
    v("scaling", scaling, config::one_of({"none", "linear", "ntk", "dynamic", "yarn"}));
    v("theta", theta, config::greater_than(1));
    v("factor", factor, config::at_least(1));
    v("yarn_beta_fast", yarn_beta_fast, config::greater_than(0));
    v("yarn_beta_slow", yarn_beta_slow, config::greater_than(0));
  }
};

// The keys every attention layer shares. A mechanism's own keys (stick-breaking's
// remainder_bias, softmax's gate, ...) sit beside them in the same JSON object and are kept in
// `options`, which the mechanism's registry entry checks and completes (nn/mechanisms.h).
struct AttentionConfig {
  std::string kind = "softmax";    // a mechanism's name, see nn::mechanisms()
  std::string position = "auto";   // rope | nope | alibi; auto: the mechanism's default
  RopeConfig rope;
  std::int64_t heads = 4;
  std::int64_t kv_heads = 0;       // 0: as many as heads
  std::int64_t head_dim = 0;       // 0: d_model / heads
  // kernel: the fused winnow operator; composed: the same attention as a LibTorch expression
  // on materialized scores (the baseline benchmarks compare against); auto: kernel wherever the
  // operator covers the configuration.
  std::string implementation = "auto";
  nlohmann::json options = nlohmann::json::object();

  template <class V>
  void fields(V& v) {
    v("kind", kind);
    v("position", position, config::one_of({"auto", "rope", "nope", "alibi"}));
    v("rope", rope);
    v("heads", heads, config::at_least(1));
    v("kv_heads", kv_heads, config::with_words(config::at_least(0), "0: as many as heads"));
    v("head_dim", head_dim, config::with_words(config::at_least(0), "0: d_model / heads"));
    v("implementation", implementation, config::one_of({"auto", "kernel", "composed"}));
  }
};

// Multiscreen (seed 001, spec/screening.md), the architecture "multiscreen": layers of gated
// screening tiles added to a residual stream, tied unit-norm embeddings with learned scales, no
// norm layers and no MLP. ModelConfig::d_model is d_E and layers the layer count (001 scales
// both with one psi: layers = tiles = psi, d_E = psi^2); attention and the MLP keys are unused.
struct MultiscreenConfig {
  std::int64_t tiles = 0;  // screening tiles per layer; 0: as many as layers
  std::int64_t key_dim = 16, value_dim = 64;
  double mipe_threshold = 256.0;
  // Screening-window expansion (001 appendix M): > 0 makes windows wider than this infinite
  // (set at inference to the training context). 0: off.
  double window_expansion = 0.0;
  // kernel: winnow::screening_attention; composed: the LibTorch expression (nn/composed.h).
  std::string implementation = "kernel";

  template <class V>
  void fields(V& v) {
    v("tiles", tiles, config::with_words(config::at_least(0), "0: as many as layers"));
    v("key_dim", key_dim, config::at_least(2));
    v("value_dim", value_dim, config::at_least(1));
    v("mipe_threshold", mipe_threshold, config::greater_than(0));
    v("window_expansion", window_expansion, config::with_words(config::at_least(0), "0: off"));
    v("implementation", implementation, config::one_of({"kernel", "composed"}));
  }
};

struct ModelConfig {
  std::string architecture = "transformer";  // transformer | multiscreen
  std::int64_t vocab_size = 0;    // 0: the task's vocabulary
  std::int64_t d_model = 256;
  std::int64_t layers = 2;
  std::string mlp = "swiglu";     // swiglu | gelu
  std::int64_t mlp_hidden = 0;    // 0: 8/3 d (swiglu) or 4 d (gelu), rounded up to 64
  bool tie_embeddings = true;
  double norm_eps = 1e-6;
  // The context length the model trains at: RoPE's scalings (dynamic, YaRN) and SSMax's
  // initial scale refer to it. 0: train.seq_len.
  std::int64_t context_len = 0;
  double init_std = 0.02;
  AttentionConfig attention;
  MultiscreenConfig multiscreen;

  template <class V>
  void fields(V& v) {
    v("architecture", architecture, config::one_of({"transformer", "multiscreen"}));
    v("vocab_size", vocab_size, config::with_words(config::at_least(0), "0: the task's"));
    v("d_model", d_model, config::at_least(1));
    v("layers", layers, config::at_least(1));
    v("mlp", mlp, config::one_of({"swiglu", "gelu"}));
    v("mlp_hidden", mlp_hidden, config::with_words(config::at_least(0), "0: from d_model"));
    v("tie_embeddings", tie_embeddings);
    v("norm_eps", norm_eps, config::greater_than(0));
    v("context_len", context_len, config::with_words(config::at_least(0), "0: train.seq_len"));
    v("init_std", init_std, config::greater_than(0));
    v("multiscreen", multiscreen);
    // attention is read and written by read_model / write_model: its JSON object also holds
    // the mechanism's own keys.
  }
};

// Reads the `model` object of an experiment file (at `path`). Unknown keys are errors; the
// attention mechanism's own keys are checked by resolve(), once the caller has filled in what
// the model takes from elsewhere (vocab_size, context_len).
ModelConfig read_model(const nlohmann::json& j, const std::string& path = "model");
// The model object with every default filled in.
nlohmann::json write_model(const ModelConfig& c);

// Checks every value (errors name `path`.key) and fills placeholders: attention.position
// "auto", implementation "auto", kv_heads 0, head_dim 0, mlp_hidden 0, and the mechanism's
// option defaults. vocab_size and context_len must be set (> 0) by then. Idempotent.
void resolve(ModelConfig& c, const std::string& path = "model");

}  // namespace winnow::nn
