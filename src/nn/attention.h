// The attention layers: what every one of them shares, and the factory that builds the one a
// config names. Each mechanism's layer lives in its own file (softmax_attention.cpp,
// differential_attention.cpp, stick_breaking_attention.cpp, entmax_attention.cpp,
// sieve_attention.cpp, threshold_attention.cpp, gsa_attention.cpp) with its registry entry; the table of entries is in attention.cpp.
//
// Every layer maps x (B, L, d_model) to (B, L, d_model) and owns its projections, positional
// encoding and gates. With a cache, x's tokens continue the cached sequence: they sit at
// positions cache->length() onwards, the layer appends their keys and values, and its queries
// attend over everything cached (the operators take fewer queries than keys).
#pragma once

#include <torch/torch.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "nn/config.h"
#include "nn/mechanisms.h"
#include "nn/modules.h"
#include "nn/probe.h"

namespace winnow::nn {

class AttentionLayer : public torch::nn::Module {
 public:
  virtual torch::Tensor forward(const torch::Tensor& x, LayerCache* cache) = 0;

  // Phased training (train.phases) tells layers which phase runs; a mechanism whose
  // behaviour changes by phase (GSA's dense indexer warm-up) overrides this.
  virtual void set_phase(const std::string& /*phase*/) {}

  // Auxiliary losses the last forward pass produced (a layer adds them in training mode);
  // the trainer weights them by name (train.aux_loss_weights).
  const std::vector<std::pair<std::string, torch::Tensor>>& aux_losses() const { return aux_; }
  void clear_aux_losses() { aux_.clear(); }

  // Diagnostics: while a probe is attached (nullptr detaches), forward() also hands it the
  // weights of the chunk's last probe->rows() queries, computed on the side.
  void attach_probe(AttentionProbe* probe, std::int64_t layer) {
    probe_ = probe;
    probe_layer_ = layer;
  }

 protected:
  AttentionProbe* probe() const { return probe_; }
  std::int64_t probe_layer() const { return probe_layer_; }
  // The probed rows of a chunk's queries (B, L, H, D): its last min(rows, L) positions.
  torch::Tensor probed_queries(const torch::Tensor& q) const {
    const std::int64_t r = std::min(probe_->rows(), q.size(1));
    return q.narrow(1, q.size(1) - r, r);
  }

  void add_aux_loss(std::string name, torch::Tensor value) {
    aux_.emplace_back(std::move(name), std::move(value));
  }

 private:
  std::vector<std::pair<std::string, torch::Tensor>> aux_;
  AttentionProbe* probe_ = nullptr;
  std::int64_t probe_layer_ = 0;
};

// Head counts and sizes of a (resolved) attention config.
struct HeadLayout {
  std::int64_t heads, kv_heads, head_dim, value_dim;
  double scale;  // 1 / sqrt(head_dim)
};
HeadLayout head_layout(const ModelConfig& model);

// A layer's positional encoding (rope, nope or alibi) and its bookkeeping with the cache.
class PositionalEncoding {
 public:
  PositionalEncoding(const ModelConfig& model, std::int64_t head_dim);

  struct Prepared {
    torch::Tensor q, k, v;  // q for this chunk; k and v for every position its queries see
    std::int64_t offset;    // absolute position of the chunk's first token
  };
  // Rotates this chunk's q and k (RoPE), appends k and v to the cache, and returns what the
  // attention call needs. q and k may hold several views per head (differential attention).
  Prepared prepare(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                   LayerCache* cache) const;

  // For an operator that rotates queries and keys itself (AttentionCall's rotary_cos /
  // rotary_sin; RoPE only): the tables for a full pass over q and k without a cache, which then
  // go to the operator unrotated. Nothing otherwise: prepare() rotates.
  std::optional<std::pair<torch::Tensor, torch::Tensor>> operator_tables(const torch::Tensor& q,
                                                                         const torch::Tensor& k,
                                                                         const LayerCache* cache) const;

  const std::string& kind() const { return kind_; }

 private:
  std::string kind_;
  std::optional<Rope> rope_;
};

// ALiBi slopes m_h = 2^(-8 h / H), h = 1..H (spec/softmax.md).
torch::Tensor alibi_slopes(std::int64_t heads);

// Whether a (resolved) attention config runs the fused operator.
bool uses_kernel(const AttentionConfig& a);

std::shared_ptr<AttentionLayer> make_attention(const ModelConfig& model, std::int64_t layer_index);

// The registry entries of the built-in mechanisms (defined beside their layers).
const Mechanism& softmax_mechanism();
const Mechanism& differential_mechanism();
const Mechanism& stick_breaking_mechanism();
const Mechanism& entmax_mechanism();
const Mechanism& sieve_mechanism();
const Mechanism& threshold_mechanism();
const Mechanism& gsa_mechanism();

// Mechanism options: a struct with a field list, checked and completed through it.
template <class Options>
nlohmann::json resolve_options_as(const nlohmann::json& given, const std::string& path) {
  return config::write(config::read<Options>(given, path));
}
template <class Options>
std::vector<std::string> option_keys_of() {
  return config::keys_of<Options>();
}
template <class Options>
Options options_of(const AttentionConfig& a) {
  return config::read<Options>(a.options, "model.attention");
}

}  // namespace winnow::nn
