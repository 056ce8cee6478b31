// Per-layer, per-head diagnostics of attention weights (spec/tasks.md, "Protocol"). Every
// mechanism feeds the same hook: during a probed forward pass each layer hands the probe its
// weights for the last few query rows of the chunk (materialized on the side, so the probe costs
// O(rows * L) memory whatever the length) and any statistics only it can give (stick-breaking's
// and Sieve's unallocated stick). The probe averages them over rows and batches; the support
// size it derives from the weights (the candidate-set size of the sparse mechanisms) is kept as
// a mean and a maximum.
#pragma once

#include <torch/torch.h>

#include <cstdint>
#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

namespace winnow::nn {

class AttentionProbe {
 public:
  // `rows`: how many of the last query rows of each sequence are inspected.
  explicit AttentionProbe(std::int64_t rows = 16);
  std::int64_t rows() const { return rows_; }

  // weights (B, H, R, Lk): the rows' weights over every key (any sign or normalization), the
  // rows being the last R of the Lk positions. attend_current: whether a row sees its own key.
  // Derived per head: first_token_share (the share of |w| on key 0, 003's "attention to the
  // first token"), sink_ratio (that share times the number of visible keys, 004 section 3's
  // generalized sink ratio: 1 for uniform weights, defined for signed or unnormalized weights
  // because |w| is normalized per row first), entropy (nats, of |w| normalized per row),
  // zero_fraction (exact zeros among the visible keys), support (nonzero weights among the
  // visible keys: entmax's support, Sieve's candidates that did not underflow) and support_max
  // (its largest value over the rows; the one statistic kept as a maximum, not a mean).
  // extra: the mechanism's own statistics per row, (B, H, R) each, averaged as they are.
  void record(std::int64_t layer, const torch::Tensor& weights, bool attend_current,
              const std::map<std::string, torch::Tensor>& extra = {});

  // {"layers": [{"layer": 0, "sink_ratio": [per head], "entropy": [...], ...}, ...],
  //  "mean": {"sink_ratio": over layers and heads, ...}, "max": {"support_max": over layers and
  //  heads}}; empty layers when nothing was recorded.
  nlohmann::json summary() const;
  void clear() {
    sums_.clear();
    maxima_.clear();
  }

 private:
  void add(std::int64_t layer, const std::string& name, const torch::Tensor& per_row);
  void add_max(std::int64_t layer, const std::string& name, const torch::Tensor& per_row);

  std::int64_t rows_;
  struct Sum {
    torch::Tensor total;  // (H) float64 on the CPU
    double rows = 0;
  };
  std::map<std::int64_t, std::map<std::string, Sum>> sums_;
  std::map<std::int64_t, std::map<std::string, torch::Tensor>> maxima_;  // (H) float64, CPU
};

}  // namespace winnow::nn
