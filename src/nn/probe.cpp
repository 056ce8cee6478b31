#include "nn/probe.h"

#include <algorithm>

#include "winnow/error.h"

namespace winnow::nn {

AttentionProbe::AttentionProbe(std::int64_t rows) : rows_(rows) {
  if (rows < 1) {
    throw Error(ErrorKind::invalid_argument,
                "AttentionProbe: argument 'rows': expected >= 1, got " + std::to_string(rows));
  }
}

void AttentionProbe::add(std::int64_t layer, const std::string& name,
                         const torch::Tensor& per_row) {
  // (B, H, R) -> per-head sums over B and R.
  const torch::Tensor x = per_row.detach().to(torch::kFloat64);
  const torch::Tensor total = x.sum(std::vector<std::int64_t>{0, 2}).cpu();
  Sum& s = sums_[layer][name];
  s.total = s.total.defined() ? s.total + total : total;
  s.rows += static_cast<double>(x.size(0) * x.size(2));
}

void AttentionProbe::add_max(std::int64_t layer, const std::string& name,
                             const torch::Tensor& per_row) {
  const torch::Tensor x = per_row.detach().to(torch::kFloat64);
  const torch::Tensor top = x.amax(std::vector<std::int64_t>{0, 2}).cpu();
  torch::Tensor& m = maxima_[layer][name];
  m = m.defined() ? torch::maximum(m, top) : top;
}

void AttentionProbe::record(std::int64_t layer, const torch::Tensor& weights, bool attend_current,
                            const std::map<std::string, torch::Tensor>& extra) {
  if (weights.dim() != 4) {
    throw Error(ErrorKind::invalid_argument,
                "AttentionProbe::record: argument 'weights': expected (B, H, R, Lk), got " +
                    c10::str(weights.sizes()));
  }
  const std::int64_t rows = weights.size(2), keys = weights.size(3);
  const torch::Tensor w = weights.detach().to(torch::kFloat64).abs();
  // Row r sits at position keys - rows + r and sees that many keys (plus its own).
  const torch::Tensor visible =
      torch::arange(keys - rows, keys, w.options()) + (attend_current ? 1.0 : 0.0);
  const torch::Tensor mass = w.sum(-1);
  const torch::Tensor has = mass.gt(0);
  const torch::Tensor a = w / mass.clamp_min(1e-300).unsqueeze(-1);
  const torch::Tensor first = a.select(-1, 0).masked_fill(~has, 0);
  add(layer, "first_token_share", first);
  add(layer, "sink_ratio", first * visible.view({1, 1, -1}));
  add(layer, "entropy", -(a * torch::log(a.clamp_min(1e-300))).sum(-1));
  const torch::Tensor position = torch::arange(0, keys, w.options()).view({1, 1, 1, -1});
  const torch::Tensor in_view = position.lt(visible.view({1, 1, -1, 1}));
  const torch::Tensor zeros = (w.eq(0) & in_view).sum(-1).to(torch::kFloat64);
  add(layer, "zero_fraction", zeros / visible.clamp_min(1).view({1, 1, -1}));
  const torch::Tensor support = (w.ne(0) & in_view).sum(-1).to(torch::kFloat64);
  add(layer, "support", support);
  add_max(layer, "support_max", support);
  for (const auto& [name, value] : extra) add(layer, name, value);
}

nlohmann::json AttentionProbe::summary() const {
  nlohmann::json layers = nlohmann::json::array();
  std::map<std::string, std::pair<double, double>> means;  // name -> (sum, count)
  nlohmann::json max = nlohmann::json::object();
  for (const auto& [layer, stats] : sums_) {
    nlohmann::json entry = {{"layer", layer}};
    const auto found = maxima_.find(layer);
    if (found != maxima_.end()) {
      for (const auto& [name, per_head] : found->second) {
        const torch::Tensor c = per_head.contiguous();
        std::vector<double> values(c.data_ptr<double>(), c.data_ptr<double>() + c.numel());
        entry[name] = values;
        const double top = c.max().item<double>();
        max[name] = max.contains(name) ? std::max(max[name].get<double>(), top) : top;
      }
    }
    for (const auto& [name, sum] : stats) {
      const torch::Tensor per_head = sum.total / std::max(sum.rows, 1.0);
      std::vector<double> values(per_head.data_ptr<double>(),
                                 per_head.data_ptr<double>() + per_head.numel());
      entry[name] = values;
      for (double v : values) {
        means[name].first += v;
        means[name].second += 1;
      }
    }
    layers.push_back(entry);
  }
  nlohmann::json mean = nlohmann::json::object();
  for (const auto& [name, sc] : means) mean[name] = sc.first / std::max(sc.second, 1.0);
  return {{"layers", layers}, {"mean", mean}, {"max", max}};
}

}  // namespace winnow::nn
