// Evaluation protocols (spec/tasks.md, "Protocol"): accuracy of whole sequences scored in one
// forward pass (MQRAR, Copy), exact match of answers generated greedily through the KV cache
// (ABCDigits, passkey), and the loss by position of any token stream. Instances are fresh: each
// (length, depth) draws from its own seed stream, disjoint from training's.
#pragma once

#include <torch/torch.h>

#include <cstdint>
#include <vector>

#include "nn/probe.h"
#include "nn/language_model.h"
#include "tasks/task.h"

namespace winnow::eval {

struct Runtime {
  torch::Device device = torch::kCPU;
  bool autocast = false;              // bf16 autocast (CUDA)
  std::int64_t batch_tokens = 16384;  // tokens per forward pass: batch = batch_tokens / length
};
// How a model trained with train.dtype `dtype` is evaluated on `device`: bf16 autocast on CUDA
// unless it trained in float32; batch_tokens 0 picks 16384 on the CPU and 262144 on CUDA.
Runtime runtime_for(const torch::Device& device, const std::string& dtype,
                    std::int64_t batch_tokens);

// Counts over scored positions (loss_mask == 1) and sequences.
struct SequenceScore {
  std::int64_t sequences = 0;
  double scored = 0;    // labelled positions
  double correct = 0;   // labelled positions whose argmax is the target
  double exact = 0;     // sequences with every labelled position right
  double loss_sum = 0;  // cross entropy summed over labelled positions
  double accuracy() const { return scored > 0 ? correct / scored : 0.0; }
  double exact_match() const {
    return sequences > 0 ? exact / static_cast<double>(sequences) : 0.0;
  }
  double loss() const { return scored > 0 ? loss_sum / scored : 0.0; }
  SequenceScore& operator+=(const SequenceScore& o);
};

// Cross entropy summed by position over sequences: nll[t] and count[t] (float64, CPU) over
// the labelled positions t of every sequence scored.
struct PositionSums {
  torch::Tensor nll, count;
  void add(const torch::Tensor& nll_by_position, const torch::Tensor& count_by_position);
};

// Mean cross entropy by position, in bins of positions.
struct PositionLoss {
  std::vector<std::int64_t> bin_start, bin_end;  // [start, end) positions
  std::vector<double> loss;                      // mean nats per predicted token in the bin
  std::vector<double> tokens;                    // predicted tokens counted in the bin
};
// `sums` in `bins` bins of (nearly) equal width; bins with no labelled position have loss 0 and
// tokens 0.
PositionLoss binned(const PositionSums& sums, std::int64_t bins);

// The counts of one batch from its logits (B, L, V). A sequence with no labelled position
// counts as exactly matched. positions, when given, also gets the loss by position.
SequenceScore score_logits(const torch::Tensor& logits, const tasks::Batch& batch,
                           PositionSums* positions = nullptr);

// `instances` fresh sequences of `length` tokens, one forward pass per batch; a probe, when
// given, collects diagnostics on every batch, and positions the loss by position.
SequenceScore score_sequences(const nn::LanguageModel& model, const tasks::Task& task,
                              std::int64_t length, std::int64_t instances, std::uint64_t seed,
                              const Runtime& rt, nn::AttentionProbe* probe = nullptr,
                              PositionSums* positions = nullptr);

// Greedy continuation of prompts (B, P) by `steps` tokens: one prefill pass through the KV
// cache, then one token at a time. Returns (B, steps).
torch::Tensor generate_greedy(const nn::LanguageModel& model, const torch::Tensor& prompts,
                              std::int64_t steps, const Runtime& rt);

// How the next token is drawn from the logits: temperature 0 is greedy (argmax); otherwise
// softmax(logits / temperature) restricted to the top_k most likely tokens (0: all of them).
struct Sampling {
  double temperature = 1.0;
  std::int64_t top_k = 0;
  std::uint64_t seed = 0;  // the draws are a pure function of the seed (on one device)
};
// Continuation of prompts (B, P) by `steps` sampled tokens through the KV cache; (B, steps).
torch::Tensor generate(const nn::LanguageModel& model, const torch::Tensor& prompts, std::int64_t steps,
                       const Runtime& rt, const Sampling& sampling);

struct GenerationScore {
  std::int64_t instances = 0;
  std::int64_t exact = 0;  // answers generated exactly
  double exact_match() const {
    return instances > 0 ? static_cast<double>(exact) / static_cast<double>(instances) : 0.0;
  }
};

// Exact match of `instances` prompts of a generative task at (length, depth).
GenerationScore score_generation(const nn::LanguageModel& model, const tasks::Task& task,
                                 std::int64_t length, double depth, std::int64_t instances,
                                 std::uint64_t seed, const Runtime& rt);

// Mean next-token cross entropy by position of token streams (N, L): position t predicts token
// t + 1; positions are grouped into `bins` equal-width bins.
PositionLoss loss_by_position(const nn::LanguageModel& model, const torch::Tensor& tokens,
                              std::int64_t bins, const Runtime& rt);

// Full-context forward latency (001 figure 8): one sequence of `length` random tokens below
// `vocab`, one forward pass without gradients under the runtime's autocast, no KV cache;
// untimed passes, then `repeats` passes each timed between device synchronizations.
struct ForwardLatency {
  std::int64_t length = 0;
  double median_ms = 0, min_ms = 0;
};
ForwardLatency forward_latency(const nn::LanguageModel& model, std::int64_t vocab, std::int64_t length,
                               std::int64_t repeats, const Runtime& rt);

// The seed of the instances at one evaluation point (length, depth index): a stream of its
// own, apart from the trainer's.
std::uint64_t instance_seed(std::uint64_t seed, std::int64_t length, std::int64_t depth_index,
                            std::int64_t batch_index);

}  // namespace winnow::eval
