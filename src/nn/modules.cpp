#include "nn/modules.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <optional>
#include <string>

#include "winnow/torch/ops.h"

#include <ATen/autocast_mode.h>
#include <torch/version.h>

#include "winnow/error.h"

namespace winnow::nn {

torch::nn::Linear make_linear(torch::nn::Module& owner, const std::string& name, std::int64_t in,
                              std::int64_t out, double std, bool bias) {
  auto linear = owner.register_module(
      name, torch::nn::Linear(torch::nn::LinearOptions(in, out).bias(bias)));
  torch::NoGradGuard no_grad;
  linear->weight.normal_(0.0, std);
  if (bias) linear->bias.zero_();
  return linear;
}

// ------------------------------------------------------------------ projections

namespace {

#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 8)
// at::mm with out_dtype: bf16 / fp16 operands, a float32 product straight from the GEMM.
#define WINNOW_MM_OUT_DTYPE 1
#endif

// The dtype CUDA autocast would run a matrix product of x in, or nothing when it is off.
std::optional<torch::ScalarType> autocast_dtype(const torch::Tensor& x) {
  if (!x.is_cuda()) return std::nullopt;
#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 4)
  if (at::autocast::is_autocast_enabled(at::kCUDA)) return at::autocast::get_autocast_dtype(at::kCUDA);
#else
  if (at::autocast::is_enabled()) return at::autocast::get_autocast_gpu_dtype();
#endif
  return std::nullopt;
}

struct Projections : public torch::autograd::Function<Projections> {
  // cast: the weights in `compute`, concatenated, when a WeightCastPlan made them (an optional:
  // LibTorch 2's Function::apply rejects undefined inputs).
  static torch::autograd::variable_list forward(torch::autograd::AutogradContext* ctx, const torch::Tensor& x,
                                                at::TensorList weights, torch::ScalarType compute,
                                                const c10::optional<torch::Tensor>& cast) {
    std::vector<std::int64_t> rows;
    for (const torch::Tensor& w : weights) rows.push_back(w.size(0));
    const torch::Tensor w =
        cast.has_value() ? *cast : (weights.size() == 1 ? weights[0] : torch::cat(weights, 0)).to(compute);
    const torch::Tensor xc = x.to(compute);
    const torch::Tensor y = torch::matmul(xc, w.t());
    ctx->save_for_backward({xc, w});
    ctx->saved_data["rows"] = rows;
    ctx->saved_data["weight_dtype"] = weights[0].scalar_type();
    return y.split_with_sizes(rows, -1);
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const torch::Tensor& xc = saved[0];
    const torch::Tensor& w = saved[1];
    const std::vector<std::int64_t> rows = ctx->saved_data["rows"].toIntVector();
    const auto weight_dtype = static_cast<torch::ScalarType>(ctx->saved_data["weight_dtype"].toInt());
    // Without a copy when they already lie side by side, as SwiGLU's backward writes them.
    torch::Tensor dy = torch_ops::side_by_side(grads);
    if (!dy.defined() || dy.scalar_type() != xc.scalar_type()) {
      std::vector<torch::Tensor> parts;
      for (std::size_t i = 0; i < rows.size(); ++i) {
        if (grads[i].defined()) {
          parts.push_back(grads[i].to(xc.scalar_type()));
        } else {
          std::vector<std::int64_t> shape(xc.sizes().begin(), xc.sizes().end());
          shape.back() = rows[i];
          parts.push_back(torch::zeros(shape, xc.options()));
        }
      }
      dy = parts.size() == 1 ? parts[0] : torch::cat(parts, -1);
    }
    torch::autograd::variable_list out(1 + rows.size() + 2);  // x, the weights, compute, cast
    if (ctx->needs_input_grad(0)) out[0] = torch::matmul(dy, w);
    const std::int64_t n = dy.size(-1), k = xc.size(-1);
    const torch::Tensor dy2 = dy.reshape({-1, n}).t(), x2 = xc.reshape({-1, k});
    torch::Tensor dw;
#ifdef WINNOW_MM_OUT_DTYPE
    if (xc.is_cuda() && weight_dtype == torch::kFloat32 && xc.scalar_type() != weight_dtype) {
      dw = at::mm(dy2, x2, weight_dtype);
    }
#endif
    if (!dw.defined()) dw = torch::mm(dy2, x2).to(weight_dtype);
    std::int64_t start = 0;
    for (std::size_t i = 0; i < rows.size(); ++i) {
      if (ctx->needs_input_grad(1 + i)) out[1 + i] = dw.narrow(0, start, rows[i]);
      start += rows[i];
    }
    return out;
  }
};

struct ProductEmbedding : public torch::autograd::Function<ProductEmbedding> {
  static torch::autograd::variable_list forward(torch::autograd::AutogradContext* ctx, const torch::Tensor& weight,
                                                const torch::Tensor& tokens) {
    ctx->save_for_backward({tokens});
    ctx->saved_data["vocab"] = weight.size(0);
    ctx->saved_data["weight_dtype"] = weight.scalar_type();
    const auto autocast = autocast_dtype(weight);
    ctx->saved_data["compute"] = autocast && weight.scalar_type() == torch::kFloat32 ? *autocast : weight.scalar_type();
    return {torch::embedding(weight, tokens)};
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const torch::Tensor tokens = ctx->get_saved_variables()[0].reshape({-1});
    const std::int64_t vocab = ctx->saved_data["vocab"].toInt();
    const auto weight_dtype = static_cast<torch::ScalarType>(ctx->saved_data["weight_dtype"].toInt());
    const auto compute = static_cast<torch::ScalarType>(ctx->saved_data["compute"].toInt());
    if (!grads[0].defined()) return {torch::Tensor(), torch::Tensor()};
    const torch::Tensor dy = grads[0].reshape({tokens.size(0), -1}).to(compute);
    const torch::Tensor one_hot = torch::zeros({tokens.size(0), vocab}, dy.options()).scatter_(1, tokens.unsqueeze(1), 1.0);
    torch::Tensor dw;
#ifdef WINNOW_MM_OUT_DTYPE
    if (dy.is_cuda() && compute != weight_dtype && weight_dtype == torch::kFloat32) dw = at::mm(one_hot.t(), dy, weight_dtype);
#endif
    if (!dw.defined()) dw = torch::mm(one_hot.t(), dy).to(weight_dtype);
    return {dw, torch::Tensor()};
  }
};

}  // namespace

torch::Tensor embed(const torch::Tensor& weight, const torch::Tensor& tokens, std::optional<bool> as_product) {
  const bool product = as_product.value_or(weight.is_cuda() && weight.dim() == 2 && weight.size(0) <= 2 * weight.size(1));
  if (!product || !weight.requires_grad() || !torch::GradMode::is_enabled()) return torch::embedding(weight, tokens);
  return ProductEmbedding::apply(weight, tokens)[0];
}

std::vector<torch::Tensor> project(const torch::Tensor& x, const std::vector<torch::Tensor>& weights) {
  const auto autocast = autocast_dtype(x);
  bool same_dtype = true, floating = true;
  for (const torch::Tensor& w : weights) {
    same_dtype &= w.scalar_type() == x.scalar_type();
    floating &= w.scalar_type() == torch::kFloat32;
  }
  if (!weights.empty() && ((autocast && floating) || (weights.size() > 1 && same_dtype))) {
    const torch::ScalarType compute = autocast && floating ? *autocast : x.scalar_type();
    c10::optional<torch::Tensor> cast;
    if (WeightCastPlan::Scope* scope = WeightCastPlan::Scope::active();
        scope != nullptr && (weights.size() > 1 || weights[0].scalar_type() != compute)) {
      if (torch::Tensor copy = scope->lookup(weights, compute); copy.defined()) cast = copy;
    }
    // As a TensorList: a std::vector would not count as variables (autograd would not see the
    // weights as inputs).
    return Projections::apply(x, at::TensorList(weights), compute, cast);
  }
  std::vector<torch::Tensor> out;
  for (const torch::Tensor& w : weights) out.push_back(torch::nn::functional::linear(x, w));
  return out;
}

// ------------------------------------------------------------------ weight casts

namespace {

thread_local WeightCastPlan::Scope* active_weight_casts = nullptr;

bool separate_weight_casts() {
  static const bool separate = [] {
    const char* v = std::getenv("WINNOW_SEPARATE_WEIGHT_CASTS");
    return v != nullptr && *v != '\0' && std::string(v) != "0";
  }();
  return separate;
}

bool same_weights(const std::vector<torch::Tensor>& a, const std::vector<torch::Tensor>& b) {
  if (a.size() != b.size()) return false;
  for (std::size_t i = 0; i < a.size(); ++i) {
    if (a[i].unsafeGetTensorImpl() != b[i].unsafeGetTensorImpl()) return false;
  }
  return true;
}

}  // namespace

WeightCastPlan::Scope::Scope(WeightCastPlan& plan) : plan_(plan), previous_(active_weight_casts) {
  copies_.resize(plan_.groups_.size());
  cast();
  active_weight_casts = this;  // last: a constructor that throws leaves no dangling scope behind
}

void WeightCastPlan::Scope::cast() {
  if (plan_.groups_.empty() || separate_weight_casts()) return;
  // One launch per (weights' dtype and device, copies' dtype): each group's weights side by side,
  // for the groups whose weights are still 2-D, contiguous and of one width, dtype and device.
  struct Launch {
    torch::ScalarType from, to;
    torch::Device device;
    std::vector<torch::Tensor> sources;
    std::vector<std::size_t> groups;
  };
  std::vector<Launch> launches;
  for (std::size_t g = 0; g < plan_.groups_.size(); ++g) {
    const Group& group = plan_.groups_[g];
    const torch::Tensor& head = group.weights.front();
    bool ok = head.defined();
    for (const torch::Tensor& w : group.weights) {
      ok = ok && w.defined() && w.dim() == 2 && w.is_contiguous() && w.scalar_type() == head.scalar_type() &&
           w.device() == head.device() && w.size(1) == head.size(1);
    }
    if (!ok) continue;
    auto it = std::find_if(launches.begin(), launches.end(), [&](const Launch& l) {
      return l.from == head.scalar_type() && l.to == group.dtype && l.device == head.device();
    });
    if (it == launches.end()) it = launches.insert(launches.end(), Launch{head.scalar_type(), group.dtype, head.device(), {}, {}});
    it->sources.insert(it->sources.end(), group.weights.begin(), group.weights.end());
    it->groups.push_back(g);
  }
  torch::NoGradGuard no_grad;
  for (const Launch& l : launches) {
    const torch::Tensor arena = torch_ops::cast_concatenate(l.sources, l.to);
    std::int64_t at = 0;
    for (std::size_t g : l.groups) {
      const std::vector<torch::Tensor>& weights = plan_.groups_[g].weights;
      std::int64_t rows = 0;
      for (const torch::Tensor& w : weights) rows += w.size(0);
      const std::int64_t width = weights.front().size(1);
      copies_[g] = arena.narrow(0, at, rows * width).view({rows, width});
      at += rows * width;
    }
  }
}

WeightCastPlan::Scope::~Scope() {
  active_weight_casts = previous_;
  // A pass that asked for a group the plan did not cast: the next casts exactly this pass's groups.
  if (missed_) plan_.groups_ = std::move(seen_);
}

WeightCastPlan::Scope* WeightCastPlan::Scope::active() { return active_weight_casts; }

torch::Tensor WeightCastPlan::Scope::lookup(const std::vector<torch::Tensor>& weights, torch::ScalarType dtype) {
  if (separate_weight_casts()) return {};
  const auto same = [&](const Group& g) { return g.dtype == dtype && same_weights(g.weights, weights); };
  if (std::none_of(seen_.begin(), seen_.end(), same)) seen_.push_back({weights, dtype});
  for (std::size_t g = 0; g < plan_.groups_.size(); ++g) {
    if (same(plan_.groups_[g]) && copies_[g].defined()) return copies_[g];
  }
  missed_ = true;
  return {};
}

// ------------------------------------------------------------------ norms

namespace {

// Norm statistics in at least float32: bf16 activations under autocast would lose them.
torch::ScalarType stats_type(const torch::Tensor& x) {
  return x.scalar_type() == torch::kFloat64 ? torch::kFloat64 : torch::kFloat32;
}

}  // namespace

RMSNormImpl::RMSNormImpl(std::int64_t dim, double eps) : eps_(eps) {
  weight_ = register_parameter("weight", torch::ones({dim}));
}

namespace {

// The dtype a norm's output is consumed in: under CUDA autocast the next matrix product reads
// the autocast dtype, so the norm writes that directly instead of a float32 tensor to be cast.
torch::ScalarType consumer_dtype(const torch::Tensor& x) { return autocast_dtype(x).value_or(x.scalar_type()); }

}  // namespace

torch::Tensor RMSNormImpl::forward(const torch::Tensor& x) {
  // winnow's kernel (one pass each way, the weight gradient included) wherever it runs: float32
  // or float64 streams with a weight of the same dtype, on the CPU and on CUDA; on CUDA also
  // bf16 or fp16 inputs with a float32 weight (QK-norm of projections made under autocast),
  // which the composed expression would widen, square, reduce and scale in six passes.
  const bool wide = x.scalar_type() == torch::kFloat32 || x.scalar_type() == torch::kFloat64;
  const bool narrow_on_cuda = x.is_cuda() && weight_.scalar_type() == torch::kFloat32 &&
                              (x.scalar_type() == torch::kBFloat16 || x.scalar_type() == torch::kHalf);
  if (((wide && weight_.scalar_type() == x.scalar_type()) || narrow_on_cuda) && x.dim() >= 1) {
    return torch_ops::rms_norm(x, weight_, eps_, consumer_dtype(x));
  }
  const torch::Tensor xf = x.to(stats_type(x));
  const torch::Tensor normed = xf * torch::rsqrt(xf.pow(2).mean(-1, /*keepdim=*/true) + eps_);
  return (normed * weight_).to(x.scalar_type());
}

std::pair<torch::Tensor, torch::Tensor> RMSNormImpl::add_forward(const torch::Tensor& x,
                                                                 const torch::Tensor& residual) {
  if (!residual.defined()) return {x, forward(x)};
  const bool wide = x.scalar_type() == torch::kFloat32 || x.scalar_type() == torch::kFloat64;
  if (wide && weight_.scalar_type() == x.scalar_type() && x.dim() >= 1 &&
      residual.sizes() == x.sizes() && residual.scalar_type() == consumer_dtype(x) &&
      residual.device() == x.device()) {
    auto [s, y] = torch_ops::add_rms_norm(x, residual, weight_, eps_, consumer_dtype(x));
    return {s, y};
  }
  const torch::Tensor s = x + residual;
  return {s, forward(s)};
}

HeadNormImpl::HeadNormImpl(std::int64_t heads, std::int64_t dim, double eps, bool centered)
    : eps_(eps), centered_(centered) {
  weight_ = register_parameter("weight", torch::ones({heads, dim}));
  if (centered_) bias_ = register_parameter("bias", torch::zeros({heads, dim}));
}

torch::Tensor HeadNormImpl::forward(const torch::Tensor& x) {
  torch::Tensor xf = x.to(stats_type(x));
  if (centered_) xf = xf - xf.mean(-1, /*keepdim=*/true);
  torch::Tensor y = xf * torch::rsqrt(xf.pow(2).mean(-1, /*keepdim=*/true) + eps_) * weight_;
  if (centered_) y = y + bias_;
  return y.to(x.scalar_type());
}

double residual_output_std(const ModelConfig& model) {
  return model.init_std / std::sqrt(2.0 * static_cast<double>(model.layers));
}

// ------------------------------------------------------------------ MLP

MLPImpl::MLPImpl(const ModelConfig& c) : swiglu_(c.mlp == "swiglu") {
  const std::int64_t hidden = c.mlp_hidden;
  up_ = make_linear(*this, "up", c.d_model, hidden, c.init_std);
  if (swiglu_) gate_ = make_linear(*this, "gate", c.d_model, hidden, c.init_std);
  down_ = make_linear(*this, "down", hidden, c.d_model, residual_output_std(c));
}

torch::Tensor MLPImpl::forward(const torch::Tensor& x) {
  // winnow's gate kernel (one pass each way) where it runs: CUDA, and float32 / float64 on the
  // CPU; otherwise LibTorch's silu and product.
  if (swiglu_) {
    const auto gate_up = project(x, {gate_->weight, up_->weight});
    const torch::Tensor &gate = gate_up[0], &up = gate_up[1];
    const bool kernel = gate.is_cuda() || gate.scalar_type() == torch::kFloat32 ||
                        gate.scalar_type() == torch::kFloat64;
    const torch::Tensor hidden =
        kernel && gate.scalar_type() == up.scalar_type() ? torch_ops::swiglu(gate, up) : torch::silu(gate) * up;
    return project(hidden, {down_->weight})[0];
  }
  return project(torch::gelu(project(x, {up_->weight})[0]), {down_->weight})[0];
}

// ------------------------------------------------------------------ RoPE

Rope::Rope(const RopeConfig& config, std::int64_t head_dim, std::int64_t context_len, bool fused)
    : config_(config), head_dim_(head_dim), context_len_(context_len), fused_(fused) {
  if (head_dim % 2 != 0) {
    config::fail("model.attention.head_dim", "an even head dimension for RoPE",
                 std::to_string(head_dim));
  }
}

std::pair<torch::Tensor, torch::Tensor> Rope::compute(std::int64_t offset, std::int64_t len,
                                                      std::int64_t seen) const {
  const double d = static_cast<double>(head_dim_);
  const auto f64 = torch::TensorOptions().dtype(torch::kFloat64);
  const torch::Tensor i = torch::arange(0, head_dim_ / 2, f64);
  const double factor = config_.factor;
  double theta = config_.theta, attention_factor = 1.0;
  torch::Tensor positions = torch::arange(offset, offset + len, f64);
  if (config_.scaling == "ntk") {
    // NTK-aware: a larger base stretches the low frequencies by about `factor` and leaves the
    // highest nearly unchanged.
    theta *= std::pow(factor, d / (d - 2));
  } else if (config_.scaling == "dynamic") {
    const double ratio = static_cast<double>(seen) / static_cast<double>(context_len_);
    if (ratio > 1) theta *= std::pow(factor * ratio - (factor - 1), d / (d - 2));
  }
  torch::Tensor inv_freq = torch::pow(theta, -2.0 * i / d);
  if (config_.scaling == "linear") {
    positions = positions / factor;
  } else if (config_.scaling == "yarn" && factor > 1) {
    // Frequency index where a dimension completes `rotations` turns over the training context.
    auto index_of = [&](double rotations) {
      return d * std::log(static_cast<double>(context_len_) / (rotations * 2 * M_PI)) /
             (2 * std::log(config_.theta));
    };
    const double low = std::max(0.0, std::floor(index_of(config_.yarn_beta_fast)));
    const double high = std::min(d / 2 - 1, std::ceil(index_of(config_.yarn_beta_slow)));
    // 0 below `low` (fast dimensions keep their frequency), 1 above `high` (interpolated).
    const torch::Tensor ramp = ((i - low) / std::max(high - low, 1e-3)).clamp(0, 1);
    inv_freq = inv_freq * (1 - ramp) + inv_freq / factor * ramp;
    // Both q and k carry the factor, so logits grow by its square: (0.1 ln s + 1)^2.
    attention_factor = 0.1 * std::log(factor) + 1.0;
  }
  const torch::Tensor angles = torch::outer(positions, inv_freq);
  const torch::Tensor full = torch::cat({angles, angles}, -1);
  return {full.cos() * attention_factor, full.sin() * attention_factor};
}

std::pair<torch::Tensor, torch::Tensor> Rope::tables(const torch::Tensor& x, std::int64_t offset,
                                                     std::int64_t seen) const {
  const std::int64_t len = x.size(1);
  const torch::ScalarType work = x.scalar_type() == torch::kFloat64 ? torch::kFloat64 : torch::kFloat32;
  const auto options = torch::TensorOptions().dtype(work).device(x.device());
  torch::Tensor cos, sin;
  if (length_dependent()) {
    std::tie(cos, sin) = compute(offset, len, seen);
    return {cos.to(options), sin.to(options)};
  }
  if (!cos_.defined() || cos_.size(0) < offset + len || cos_.device() != x.device() || cos_.scalar_type() != work) {
    const std::int64_t have = cos_.defined() ? cos_.size(0) : 0;
    const std::int64_t n = std::max<std::int64_t>({offset + len, 2 * have, 64});
    auto [c, s] = compute(0, n, n);
    if (cos_.defined()) {
      retired_.push_back(cos_);
      retired_.push_back(sin_);
    }
    cos_ = c.to(options);
    sin_ = s.to(options);
  }
  return {cos_.narrow(0, offset, len), sin_.narrow(0, offset, len)};
}

bool Rope::runs_kernel(const torch::Tensor& x) const {
  return fused_ && (x.is_cuda() || x.scalar_type() == torch::kFloat32 || x.scalar_type() == torch::kFloat64);
}

torch::Tensor Rope::apply(const torch::Tensor& x, std::int64_t offset, std::int64_t seen) const {
  const std::int64_t len = x.size(1), half = head_dim_ / 2;
  auto [cos, sin] = tables(x, offset, seen);
  if (runs_kernel(x)) {
    // The tables repeat their first half (the pairs (i, i + D/2) share an angle).
    return torch_ops::rotary_embedding(x, cos.narrow(1, 0, half), sin.narrow(1, 0, half));
  }
  cos = cos.view({1, len, 1, head_dim_});
  sin = sin.view({1, len, 1, head_dim_});
  const torch::Tensor xw = x.to(cos.scalar_type());
  const torch::Tensor rotated = torch::cat({-xw.narrow(-1, half, half), xw.narrow(-1, 0, half)}, -1);
  return (xw * cos + rotated * sin).to(x.scalar_type());
}

std::optional<std::pair<torch::Tensor, torch::Tensor>> Rope::kernel_tables(const torch::Tensor& x) const {
  if (!runs_kernel(x)) return std::nullopt;
  const std::int64_t half = head_dim_ / 2;
  auto [cos, sin] = tables(x, 0, x.size(1));
  return std::make_pair(cos.narrow(1, 0, half), sin.narrow(1, 0, half));
}

// ------------------------------------------------------------------ KV cache

std::pair<torch::Tensor, torch::Tensor> LayerCache::append(const torch::Tensor& k,
                                                           const torch::Tensor& v) {
  if (k.dim() != 4 || v.dim() != 4 || k.size(0) != v.size(0) || k.size(1) != v.size(1)) {
    throw Error(ErrorKind::invalid_argument,
                "LayerCache::append: arguments 'k' and 'v': expected (B, L, H, D) tensors with "
                "the same B and L, got " + c10::str(k.sizes()) + " and " + c10::str(v.sizes()));
  }
  if (length_ > 0) {
    auto same = [](const torch::Tensor& a, const torch::Tensor& cached) {
      return a.size(0) == cached.size(0) && a.size(2) == cached.size(2) &&
             a.size(3) == cached.size(3) && a.scalar_type() == cached.scalar_type() &&
             a.device() == cached.device();
    };
    if (!same(k, k_) || !same(v, v_)) {
      throw Error(ErrorKind::invalid_argument,
                  "LayerCache::append: argument 'k': expected batch, heads, head dimension, "
                  "dtype and device of the cached keys " + c10::str(k_.sizes()) + ", got " +
                      c10::str(k.sizes()) + " " + c10::toString(k.scalar_type()));
    }
  }
  const std::int64_t n = k.size(1), total = length_ + n;
  if (torch::GradMode::is_enabled() && (k.requires_grad() || v.requires_grad())) {
    k_ = length_ > 0 ? torch::cat({k_.narrow(1, 0, length_), k}, 1) : k;
    v_ = length_ > 0 ? torch::cat({v_.narrow(1, 0, length_), v}, 1) : v;
    length_ = total;
    return {k_, v_};
  }
  if (!k_.defined() || k_.size(1) < total) {
    const std::int64_t capacity =
        std::max<std::int64_t>(total, k_.defined() ? 2 * k_.size(1) : 0);
    torch::Tensor nk = torch::empty({k.size(0), capacity, k.size(2), k.size(3)}, k.options());
    torch::Tensor nv = torch::empty({v.size(0), capacity, v.size(2), v.size(3)}, v.options());
    if (length_ > 0) {
      nk.narrow(1, 0, length_).copy_(k_.narrow(1, 0, length_));
      nv.narrow(1, 0, length_).copy_(v_.narrow(1, 0, length_));
    }
    k_ = nk;
    v_ = nv;
  }
  k_.narrow(1, length_, n).copy_(k);
  v_.narrow(1, length_, n).copy_(v);
  length_ = total;
  return {k_.narrow(1, 0, total), v_.narrow(1, 0, total)};
}

void LayerCache::keep_last(std::int64_t keep) {
  if (keep < 1) {
    throw Error(ErrorKind::invalid_argument,
                "LayerCache::keep_last: argument 'keep': expected >= 1, got " + std::to_string(keep));
  }
  if (length_ <= 2 * keep) return;
  const std::int64_t drop = length_ - keep;
  if (torch::GradMode::is_enabled() && (k_.requires_grad() || v_.requires_grad())) {
    k_ = k_.narrow(1, drop, keep);
    v_ = v_.narrow(1, drop, keep);
  } else {
    // drop > keep: the kept range and its destination do not overlap.
    k_.narrow(1, 0, keep).copy_(k_.narrow(1, drop, keep));
    v_.narrow(1, 0, keep).copy_(v_.narrow(1, drop, keep));
  }
  length_ = keep;
}

}  // namespace winnow::nn
