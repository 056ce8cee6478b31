#include "train/trainer.h"

#include <ATen/autocast_mode.h>
#include <torch/version.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>

#include "train/checkpoint.h"
#include "winnow/error.h"

namespace winnow::train {
namespace fs = std::filesystem;

namespace {

[[noreturn]] void bad(const std::string& key, const std::string& expected, const std::string& got) {
  throw Error(ErrorKind::invalid_argument, "config: key '" + key + "': expected " + expected + ", got " + got);
}

torch::Device pick_device(const std::string& name) {
  if (name == "auto") return torch::cuda::is_available() ? torch::Device(torch::kCUDA, 0) : torch::Device(torch::kCPU);
  if (name == "cpu") return torch::Device(torch::kCPU);
  if (!torch::cuda::is_available()) bad("device", "cpu or auto on a machine without CUDA", "'" + name + "'");
  return torch::Device(name);
}

// bf16 autocast on CUDA for the scope of a forward and backward pass.
class Autocast {
 public:
  explicit Autocast(bool on) : on_(on) {
    if (!on_) return;
#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 4)
    at::autocast::set_autocast_enabled(at::kCUDA, true);
    at::autocast::set_autocast_dtype(at::kCUDA, at::kBFloat16);
#else
    at::autocast::set_enabled(true);
    at::autocast::set_autocast_gpu_dtype(at::kBFloat16);
#endif
  }
  ~Autocast() {
    if (!on_) return;
#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 4)
    at::autocast::set_autocast_enabled(at::kCUDA, false);
#else
    at::autocast::set_enabled(false);
#endif
    at::autocast::clear_cache();
  }

 private:
  bool on_;
};

std::string duration(double seconds) {
  char text[32];
  const long s = static_cast<long>(seconds + 0.5);
  if (s >= 3600) {
    std::snprintf(text, sizeof text, "%ldh%02ldm", s / 3600, (s / 60) % 60);
  } else if (s >= 60) {
    std::snprintf(text, sizeof text, "%ldm%02lds", s / 60, s % 60);
  } else {
    std::snprintf(text, sizeof text, "%lds", s);
  }
  return text;
}

}  // namespace

double lr_factor(const TrainConfig& c, std::int64_t step) {
  if (c.warmup > 0 && step < c.warmup) return static_cast<double>(step + 1) / static_cast<double>(c.warmup);
  if (c.schedule == "constant") return 1.0;
  const double total = static_cast<double>(std::max<std::int64_t>(c.steps - c.warmup, 1));
  const double progress = std::min(1.0, static_cast<double>(step - c.warmup) / total);
  if (c.schedule == "cosine") {
    return c.min_lr_ratio + (1 - c.min_lr_ratio) * 0.5 * (1 + std::cos(M_PI * progress));
  }
  // wsd: hold, then decay linearly over the last decay_fraction of the steps.
  const double decay_start = 1.0 - c.decay_fraction;
  if (progress <= decay_start) return 1.0;
  return 1.0 - (1.0 - c.min_lr_ratio) * (progress - decay_start) / c.decay_fraction;
}

LossResult masked_cross_entropy(const torch::Tensor& logits, const tasks::Batch& batch) {
  const torch::Tensor logp = torch::log_softmax(logits.to(torch::kFloat32), -1);
  const torch::Tensor target_logp = logp.gather(-1, batch.targets.unsqueeze(-1)).squeeze(-1);
  const torch::Tensor mask = batch.loss_mask.to(logp.device());
  const torch::Tensor count = mask.sum().clamp_min(1);
  LossResult r;
  r.loss = -(target_logp * mask).sum() / count;
  torch::NoGradGuard no_grad;
  const torch::Tensor correct = logits.argmax(-1).eq(batch.targets).to(torch::kFloat32);
  r.accuracy = ((correct * mask).sum() / count).item<double>();
  return r;
}

Trainer::Trainer(const ExperimentConfig& config)
    : config_(config), device_(pick_device(config.device)) {
  const TrainConfig& t = config_.train;
  if (config_.threads > 0) torch::set_num_threads(config_.threads);
  if (t.dtype == "bfloat16" && !device_.is_cuda()) bad("train.dtype", "float32 or auto on the CPU", "'bfloat16'");
  autocast_ = device_.is_cuda() && t.dtype != "float32";
  torch::manual_seed(config_.seed);
  task_ = tasks::make_task(config_.task);
  model_ = nn::TransformerLM(config_.model);
  model_->to(device_);

  // Parameter groups: by learning-rate multiplier (longest matching name substring wins) and
  // by weight decay (matrices decay; norms, biases and per-head scalars do not).
  std::map<std::pair<double, bool>, std::vector<torch::Tensor>> groups;
  for (const auto& item : model_->named_parameters()) {
    double mult = 1.0;
    std::size_t best = 0;
    for (const auto& [pattern, m] : t.lr_multipliers) {
      if (item.key().find(pattern) != std::string::npos && pattern.size() > best) {
        mult = m;
        best = pattern.size();
      }
    }
    groups[{mult, item.value().dim() >= 2}].push_back(item.value());
  }
  std::vector<torch::optim::OptimizerParamGroup> param_groups;
  for (auto& [key, params] : groups) {
    auto options = std::make_unique<torch::optim::AdamWOptions>(t.lr * key.first);
    options->betas({t.beta1, t.beta2}).eps(t.eps).weight_decay(key.second ? t.weight_decay : 0.0);
    param_groups.emplace_back(params, std::move(options));
    group_multipliers_.push_back(key.first);
  }
  optimizer_ = std::make_unique<torch::optim::AdamW>(param_groups, torch::optim::AdamWOptions(t.lr));
  loss_fn = [](Trainer&, const tasks::Batch& batch, const torch::Tensor& logits) {
    return masked_cross_entropy(logits, batch);
  };
  fs::create_directories(t.out_dir);
  metrics_path_ = (fs::path(t.out_dir) / "metrics.jsonl").string();
}

bool Trainer::resume() {
  const std::string folder = latest_checkpoint((fs::path(config_.train.out_dir) / "checkpoints").string());
  if (folder.empty()) return false;
  const CheckpointState state = load_checkpoint(folder, *model_, *optimizer_);
  const nlohmann::json mine = to_json(config_);
  for (const char* section : {"model", "task", "seed"}) {
    if (state.config.value(section, nlohmann::json()) != mine.at(section)) {
      throw Error(ErrorKind::invalid_argument,
                  "checkpoint: '" + folder + "' was trained with a different '" + section +
                      "' configuration; use another train.out_dir or the same configuration");
    }
  }
  step_ = state.step;
  if (!quiet) std::printf("resumed from %s at step %lld\n", folder.c_str(), static_cast<long long>(step_));
  return true;
}

std::string Trainer::save() {
  return save_checkpoint((fs::path(config_.train.out_dir) / "checkpoints").string(), *model_,
                         *optimizer_, CheckpointState{step_, to_json(config_)});
}

void Trainer::log(const nlohmann::json& record) {
  std::ofstream f(metrics_path_, std::ios::app);
  f << record.dump() << '\n';
}

double Trainer::train_step() {
  const TrainConfig& t = config_.train;
  for (auto& hook : step_hooks) hook(*this, step_);
  const double factor = lr_factor(t, step_);
  for (std::size_t g = 0; g < optimizer_->param_groups().size(); ++g) {
    auto& options = static_cast<torch::optim::AdamWOptions&>(optimizer_->param_groups()[g].options());
    options.lr(t.lr * group_multipliers_[g] * factor);
  }
  model_->train();
  optimizer_->zero_grad();
  const std::int64_t micro = t.batch_size / t.grad_accum;
  double loss_sum = 0;
  for (std::int64_t m = 0; m < t.grad_accum; ++m) {
    tasks::Batch batch = task_->sample(micro, t.seq_len, tasks::batch_seed(config_.seed, step_, m));
    batch.inputs = batch.inputs.to(device_);
    batch.targets = batch.targets.to(device_);
    batch.loss_mask = batch.loss_mask.to(device_);
    torch::Tensor loss;
    {
      Autocast autocast(autocast_);
      const torch::Tensor logits = model_->forward(batch.inputs);
      loss = loss_fn(*this, batch, logits).loss / static_cast<double>(t.grad_accum);
    }
    loss.backward();
    loss_sum += loss.item<double>();
  }
  std::vector<torch::Tensor> params = model_->parameters();
  const double limit = t.clip > 0 ? t.clip : std::numeric_limits<double>::infinity();
  const double grad_norm = torch::nn::utils::clip_grad_norm_(params, limit);
  if (!std::isfinite(loss_sum) || !std::isfinite(grad_norm)) {
    throw Error(ErrorKind::runtime, "training diverged at step " + std::to_string(step_) +
                                        ": loss " + std::to_string(loss_sum) + ", gradient norm " +
                                        std::to_string(grad_norm));
  }
  optimizer_->step();
  ++step_;
  return loss_sum;
}

nlohmann::json Trainer::evaluate() {
  const TrainConfig& t = config_.train;
  torch::NoGradGuard no_grad;
  model_->eval();
  double loss = 0, accuracy = 0;
  for (std::int64_t i = 0; i < t.eval_batches; ++i) {
    // Held-out batches: a seed stream the training batches never use.
    tasks::Batch batch = task_->sample(t.batch_size / t.grad_accum, t.seq_len,
                                       tasks::batch_seed(~config_.seed, i, 0x5eed));
    batch.inputs = batch.inputs.to(device_);
    batch.targets = batch.targets.to(device_);
    batch.loss_mask = batch.loss_mask.to(device_);
    Autocast autocast(autocast_);
    const LossResult r = masked_cross_entropy(model_->forward(batch.inputs), batch);
    loss += r.loss.item<double>();
    accuracy += r.accuracy;
  }
  nlohmann::json out = {{"step", step_},
                        {"eval_loss", loss / static_cast<double>(t.eval_batches)},
                        {"eval_accuracy", accuracy / static_cast<double>(t.eval_batches)}};
  for (auto& hook : eval_hooks) out.update(hook(*this));
  return out;
}

void Trainer::train(std::int64_t until_step) {
  const TrainConfig& t = config_.train;
  if (until_step < 0) until_step = t.steps;
  using Clock = std::chrono::steady_clock;
  const auto start = Clock::now();
  auto window_start = start;
  std::int64_t window_tokens = 0;
  const std::int64_t first_step = step_;
  while (step_ < until_step) {
    const double loss = train_step();
    window_tokens += t.batch_size * t.seq_len;
    if (step_ % t.log_every == 0 || step_ == until_step) {
      if (device_.is_cuda()) torch::cuda::synchronize();
      const auto now = Clock::now();
      const double window = std::chrono::duration<double>(now - window_start).count();
      const double elapsed = std::chrono::duration<double>(now - start).count();
      const double tokens_per_s = window > 0 ? static_cast<double>(window_tokens) / window : 0.0;
      const double eta = elapsed / static_cast<double>(step_ - first_step) * static_cast<double>(until_step - step_);
      const double lr = t.lr * lr_factor(t, step_ - 1);
      log({{"step", step_}, {"loss", loss}, {"lr", lr}, {"tokens_per_s", tokens_per_s}, {"elapsed_s", elapsed}});
      if (!quiet) {
        std::printf("step %lld/%lld | loss %.4f | lr %.2e | %.1fk tok/s | ETA %s\n",
                    static_cast<long long>(step_), static_cast<long long>(until_step), loss, lr,
                    tokens_per_s / 1e3, duration(eta).c_str());
        std::fflush(stdout);
      }
      window_start = now;
      window_tokens = 0;
    }
    if (t.eval_every > 0 && step_ % t.eval_every == 0) {
      const nlohmann::json e = evaluate();
      log(e);
      if (!quiet) std::printf("eval  %s\n", e.dump().c_str());
    }
    if (t.checkpoint_every > 0 && step_ % t.checkpoint_every == 0 && step_ < until_step) save();
  }
  save();
}

}  // namespace winnow::train
