// The building blocks the layers and the model share: norms, the MLP, rotary position
// embedding with its extrapolation variants, and the key/value cache for incremental decoding.
#pragma once

#include <torch/torch.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "nn/config.h"

namespace winnow::nn {

// A bias-free linear layer (or with a zero bias), weights drawn from Normal(0, std): every
// layer initializes its own parameters, so nothing needs to recognize them by name later.
// The initial standard deviation of a layer that writes into the residual stream (attention
// output, MLP down projection): GPT-2's init_std / sqrt(2 layers), so the stream starts near
// unit scale whatever the depth.
double residual_output_std(const ModelConfig& model);

torch::nn::Linear make_linear(torch::nn::Module& owner, const std::string& name, std::int64_t in,
                              std::int64_t out, double std, bool bias = false);

// x (..., K) through bias-free linears with weights (N_i, K): x W_i^T for each i, as linear()
// computes them, but where it pays as one matrix product each way. Under CUDA autocast the
// weights are concatenated and cast once, and their gradient comes out of its product in
// float32 (the weights' dtype) rather than in bf16 to be cast per weight by autograd; with two
// or more weights the backward is one product for the input's gradient (no bf16 additions of
// per-projection gradients) and one for the weights'. The outputs are views of one (..., sum
// N_i) tensor. Elsewhere, and for a single weight outside autocast, linear() per weight.
std::vector<torch::Tensor> project(const torch::Tensor& x, const std::vector<torch::Tensor>& weights);

// The converted (and, for grouped weights, concatenated) weights a model's forward pass projects
// with, made in one launch at its start (torch_ops::cast_concatenate, each group's weights side
// by side so their concatenation is a view) instead of a cast and a concatenation per product:
// MQRAR's model spent 13 launches a step on them. The plan learns its groups from the passes
// it sees (the first casts as before) and casts at every pass, so the copies always reflect the
// weights as they are when the pass starts. WINNOW_SEPARATE_WEIGHT_CASTS=1 turns it off.
class WeightCastPlan {
  struct Group {
    std::vector<torch::Tensor> weights;
    torch::ScalarType dtype;
  };

 public:
  // While alive (on this thread), project() takes its weights' copies from here, and tells the
  // plan which groups it cast itself.
  class Scope {
   public:
    explicit Scope(WeightCastPlan& plan);
    ~Scope();
    Scope(const Scope&) = delete;
    Scope& operator=(const Scope&) = delete;
    // weights in `dtype`, concatenated along dim 0, when this pass cast them; undefined otherwise
    // (and the group is noted for the next pass).
    torch::Tensor lookup(const std::vector<torch::Tensor>& weights, torch::ScalarType dtype);
    static Scope* active();

   private:
    void cast();
    WeightCastPlan& plan_;
    Scope* previous_;
    std::vector<torch::Tensor> copies_;  // per plan group; undefined where not cast this pass
    std::vector<Group> seen_;            // the groups this pass asked for, in order
    bool missed_ = false;
  };

  // The groups the next pass casts.
  std::size_t size() const { return groups_.size(); }

 private:
  std::vector<Group> groups_;
};

// weight[tokens]: embedding(), with a backward that sums the gradient's rows per token as one
// matrix product, one_hot(tokens)^T dy (in the autocast dtype under CUDA autocast, the weight's
// otherwise, with a float32 result), instead of LibTorch's sort of the token ids, whose eight
// small kernels cost about 50 us whatever the batch. Taken when as_product says so, by default
// on CUDA when the one-hot matrix is no larger than the gradient it multiplies (vocab <= 2 d);
// otherwise embedding()'s own backward.
torch::Tensor embed(const torch::Tensor& weight, const torch::Tensor& tokens,
                    std::optional<bool> as_product = std::nullopt);

// RMSNorm over the last dimension with a learned scale.
class RMSNormImpl : public torch::nn::Module {
 public:
  RMSNormImpl(std::int64_t dim, double eps);
  torch::Tensor forward(const torch::Tensor& x);
  // A residual add and this norm: (s, forward(s)) with s = x + residual; an undefined residual
  // adds nothing (s = x). One kernel each way where forward() runs winnow's kernel and the
  // residual comes in the norm's output dtype (the branch outputs of a model under autocast).
  std::pair<torch::Tensor, torch::Tensor> add_forward(const torch::Tensor& x,
                                                      const torch::Tensor& residual);

 private:
  torch::Tensor weight_;
  double eps_;
};
TORCH_MODULE(RMSNorm);

// A norm over each head's output vector of (..., H, Dv) tensors, with a learned scale per
// channel (H, Dv). centered: GroupNorm with one group per head (mean and variance, plus a
// learned bias), the head-wise norm of stick-breaking (002 appendix C); otherwise RMSNorm per
// head, the differential transformer's.
class HeadNormImpl : public torch::nn::Module {
 public:
  HeadNormImpl(std::int64_t heads, std::int64_t dim, double eps, bool centered);
  torch::Tensor forward(const torch::Tensor& x);

 private:
  torch::Tensor weight_, bias_;
  double eps_;
  bool centered_;
};
TORCH_MODULE(HeadNorm);

class MLPImpl : public torch::nn::Module {
 public:
  explicit MLPImpl(const ModelConfig& c);
  torch::Tensor forward(const torch::Tensor& x);

 private:
  bool swiglu_;
  torch::nn::Linear up_{nullptr}, gate_{nullptr}, down_{nullptr};
};
TORCH_MODULE(MLP);

// Rotary position embedding on (B, L, H, D) tensors, rotating the pairs (i, i + D/2), with the
// variants of spec/softmax.md: linear position interpolation, NTK-aware base scaling, dynamic
// NTK (the base grows with the tokens seen once they exceed the training context) and YaRN.
// fused: rotate through winnow's rotary operator (one kernel forward, one backward; float32 and
// float64 on the CPU, any float dtype on CUDA); otherwise, and for the dtypes it lacks, as
// element-wise LibTorch operations (the composed path, kept for checking).
class Rope {
 public:
  Rope(const RopeConfig& config, std::int64_t head_dim, std::int64_t context_len,
       bool fused = false);

  // Dynamic scaling depends on how many tokens the sequence holds, so keys rotated earlier
  // would go stale; the layers cache such keys unrotated and rotate them on every call. (Beyond
  // the training context the hidden states of earlier tokens also depend on the length at
  // which they were computed, so a model deeper than one layer decodes differently from a full
  // pass once the context is exceeded; that is inherent to dynamic scaling.)
  bool length_dependent() const { return config_.scaling == "dynamic"; }

  // Rotates x whose tokens sit at positions offset .. offset + L - 1 of a sequence that holds
  // `seen` tokens in all (dynamic scaling's length; ignored by the other variants). Computes in
  // x's precision, at least float32.
  torch::Tensor apply(const torch::Tensor& x, std::int64_t offset, std::int64_t seen) const;

  // The (L, D/2) tables rotary_embedding takes for x's tokens at positions 0 .. L - 1 of a
  // sequence of L (a full pass): what an attention operator that rotates its queries and keys
  // itself is given (torch_ops::AttentionCall's rotary_cos / rotary_sin). Nothing where apply()
  // would not run the kernel (16-bit inputs on the CPU, or the layer's composed path).
  std::optional<std::pair<torch::Tensor, torch::Tensor>> kernel_tables(const torch::Tensor& x) const;

 private:
  // cos and sin (len, D) for x's tokens at offset .. offset + len - 1, in x's precision (at
  // least float32) on its device.
  std::pair<torch::Tensor, torch::Tensor> tables(const torch::Tensor& x, std::int64_t offset,
                                                 std::int64_t seen) const;
  bool runs_kernel(const torch::Tensor& x) const;

  // cos and sin (len, D) in float64 on the CPU, YaRN's attention factor included.
  std::pair<torch::Tensor, torch::Tensor> compute(std::int64_t offset, std::int64_t len,
                                                  std::int64_t seen) const;

  RopeConfig config_;
  std::int64_t head_dim_, context_len_;
  bool fused_;
  // Tables for positions [0, cached) on the device and dtype last used: RoPE would otherwise
  // rebuild them on the host for every layer and step.
  mutable torch::Tensor cos_, sin_;
  // Tables replaced by longer ones stay allocated: a captured CUDA graph (the trainer's) reads
  // the tables it was captured with at their addresses, and evaluation at longer lengths must
  // not hand that memory to something else.
  mutable std::vector<torch::Tensor> retired_;
};

// One layer's keys and values for incremental decoding, (B, T, Hkv, D) and (B, T, Hkv, Dv).
// Without gradient recording the cache grows a buffer in place (capacity doubling), so a
// decoding step copies only its own keys; when gradients are recorded it concatenates, keeping
// earlier steps' tensors intact for backward.
class LayerCache {
 public:
  std::int64_t length() const { return length_; }
  // Appends this chunk's keys and values; returns all of them (views of the buffer).
  std::pair<torch::Tensor, torch::Tensor> append(const torch::Tensor& k, const torch::Tensor& v);
  // For layers whose queries never look further back than `keep` keys (Multiscreen's windows):
  // drops all but the last `keep` entries once more than 2 * keep are held, so memory stays
  // O(keep) and a decoding step copies O(1) entries amortized. Order is kept; length() then
  // counts the kept entries, so positions seen through the cache become relative.
  void keep_last(std::int64_t keep);
  // A second stream for layers that cache more than keys and values (GSA's indexer keys, held
  // as its keys with empty values), created on first use and owned by this cache.
  LayerCache& side() {
    if (!side_) side_ = std::make_unique<LayerCache>();
    return *side_;
  }

 private:
  torch::Tensor k_, v_;
  std::int64_t length_ = 0;
  std::unique_ptr<LayerCache> side_;
};

}  // namespace winnow::nn
