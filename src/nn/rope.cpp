#include "nn/rope.h"

#include <cmath>

#include "winnow/error.h"

namespace winnow::nn {

Rope::Rope(const RopeConfig& config, std::int64_t head_dim, std::int64_t train_len)
    : config_(config), head_dim_(head_dim), train_len_(config.original_max_len > 0 ? config.original_max_len : train_len) {
  if (head_dim % 2 != 0) {
    throw Error(ErrorKind::invalid_argument,
                "rope: head dimension must be even, got " + std::to_string(head_dim));
  }
  const std::string& s = config.scaling;
  if (s != "none" && s != "linear" && s != "ntk" && s != "dynamic" && s != "yarn") {
    throw Error(ErrorKind::invalid_argument,
                "rope: scaling must be none, linear, ntk, dynamic or yarn, got '" + s + "'");
  }
}

std::pair<torch::Tensor, torch::Tensor> Rope::tables(std::int64_t offset, std::int64_t len,
                                                     const torch::Device& device) const {
  const double d = static_cast<double>(head_dim_);
  const auto f64 = torch::TensorOptions().dtype(torch::kFloat64);
  const torch::Tensor i = torch::arange(0, head_dim_ / 2, f64);
  double theta = config_.theta, factor = config_.factor, attention_factor = 1.0;
  torch::Tensor positions = torch::arange(offset, offset + len, f64);
  if (config_.scaling == "ntk") {
    theta *= std::pow(factor, d / (d - 2));
  } else if (config_.scaling == "dynamic") {
    // Dynamic NTK: the base grows only once the context exceeds the training length.
    const double seen = static_cast<double>(offset + len);
    if (seen > static_cast<double>(train_len_)) {
      const double f = factor * seen / static_cast<double>(train_len_) - (factor - 1);
      theta *= std::pow(f, d / (d - 2));
    }
  }
  torch::Tensor inv_freq = torch::pow(theta, -2.0 * i / d);
  if (config_.scaling == "linear") {
    positions = positions / factor;
  } else if (config_.scaling == "yarn") {
    // YaRN: interpolate the low frequencies (long wavelengths) by the factor, keep the high
    // ones, ramp in between; scale the logits by (0.1 ln factor + 1)^2 through cos and sin.
    auto dim_of = [&](double rotations) {
      return d * std::log(static_cast<double>(train_len_) / (rotations * 2 * M_PI)) /
             (2 * std::log(config_.theta));
    };
    const double low = std::max(0.0, std::floor(dim_of(config_.yarn_beta_fast)));
    const double high = std::min(d / 2 - 1, std::ceil(dim_of(config_.yarn_beta_slow)));
    const torch::Tensor ramp = ((i - low) / std::max(high - low, 1e-3)).clamp(0, 1);
    const torch::Tensor keep = 1 - ramp;  // 1: extrapolate (keep), 0: interpolate
    inv_freq = inv_freq / factor * (1 - keep) + inv_freq * keep;
    attention_factor = 0.1 * std::log(factor) + 1.0;
  }
  const torch::Tensor angles = torch::outer(positions, inv_freq);        // (L, D/2)
  const torch::Tensor full = torch::cat({angles, angles}, /*dim=*/-1);   // (L, D)
  const auto out = torch::TensorOptions().dtype(torch::kFloat32).device(device);
  return {(full.cos() * attention_factor).to(out), (full.sin() * attention_factor).to(out)};
}

torch::Tensor Rope::apply(const torch::Tensor& x, std::int64_t offset) const {
  const std::int64_t len = x.size(1);
  auto [cos, sin] = tables(offset, len, x.device());
  cos = cos.view({1, len, 1, head_dim_});
  sin = sin.view({1, len, 1, head_dim_});
  const torch::Tensor xf = x.to(torch::kFloat32);
  const torch::Tensor x1 = xf.narrow(-1, 0, head_dim_ / 2), x2 = xf.narrow(-1, head_dim_ / 2, head_dim_ / 2);
  const torch::Tensor rotated = torch::cat({-x2, x1}, -1);
  return (xf * cos + rotated * sin).to(x.scalar_type());
}

}  // namespace winnow::nn
