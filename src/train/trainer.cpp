#include "train/trainer.h"

#include <ATen/Parallel.h>
#include <ATen/record_function.h>
#include <c10/core/impl/VirtualGuardImpl.h>
#include <torch/version.h>

#if defined(WINNOW_TORCH_CUDA) && __has_include(<ATen/cuda/CUDAGraph.h>) && TORCH_VERSION_MAJOR >= 2
#include <ATen/cuda/CUDAGraph.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#define WINNOW_CUDA_GRAPHS 1
#else
#define WINNOW_CUDA_GRAPHS 0
#endif
#include <sstream>
#include <thread>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>

#include "nn/mechanisms.h"
#include "train/autocast.h"
#include "train/checkpoint.h"
#include "train/files.h"
#include "train/runtime.h"
#include "winnow/error.h"
#include "winnow/torch/ops.h"
#include "winnow/winnow.h"

namespace winnow::train {
namespace fs = std::filesystem;

namespace {

// Seed streams of the task's batches: training steps and held-out evaluation never overlap.
constexpr std::uint64_t kTrainStream = 1, kEvalStream = 2;

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

bool contains(const std::string& name, const std::vector<std::string>& patterns) {
  for (const std::string& p : patterns) {
    if (name.find(p) != std::string::npos) return true;
  }
  return false;
}

// Sum of the cross entropy over the positions the mask keeps, divided by `divisor` when given
// (inside the kernels). One kernel each way on the logits as the model returns them (bf16 under
// autocast): no float32 copy, log_softmax, gather, sum and division, nor their backward kernels.
torch::Tensor masked_cross_entropy_sum(const torch::Tensor& logits, const tasks::Batch& batch,
                                       const torch::Tensor& divisor = {}) {
  const auto stats = logits.scalar_type() == torch::kFloat64 ? torch::kFloat64 : torch::kFloat32;
  return torch_ops::masked_cross_entropy_sum(logits, batch.targets, batch.loss_mask.to(stats),
                                             divisor.defined() ? divisor.to(stats) : divisor);
}

// Asynchronous from pinned memory (training batches on CUDA).
tasks::Batch to_device(tasks::Batch b, const torch::Device& device) {
  b.inputs = b.inputs.to(device, /*non_blocking=*/b.inputs.is_pinned());
  b.targets = b.targets.to(device, /*non_blocking=*/b.targets.is_pinned());
  b.loss_mask = b.loss_mask.to(device, /*non_blocking=*/b.loss_mask.is_pinned());
  return b;
}

#if WINNOW_CUDA_GRAPHS
// A replayed step's inputs as one host-to-device copy instead of four (each has a fixed cost
// of some 5 us on the device): the batch's tokens, targets and mask and the count of its
// positions, byte for byte in one buffer, every part starting at a multiple of 8 bytes.
bool packable(const tasks::Batch& b) {
  return b.inputs.scalar_type() == torch::kInt64 && b.targets.scalar_type() == torch::kInt64 &&
         b.loss_mask.scalar_type() == torch::kFloat32;
}

std::int64_t rounded8(std::int64_t bytes) { return (bytes + 7) / 8 * 8; }

std::int64_t packed_bytes(const tasks::Batch& b) {
  return rounded8(b.inputs.numel() * 8) + rounded8(b.targets.numel() * 8) + rounded8(b.loss_mask.numel() * 4) + 8;
}

// Views of the parts of `bytes` (uint8, laid out by pack_batch for batches shaped like `like`).
std::pair<tasks::Batch, torch::Tensor> packed_views(const torch::Tensor& bytes, const tasks::Batch& like) {
  std::int64_t at = 0;
  auto part = [&](std::int64_t n, torch::ScalarType dtype, torch::IntArrayRef shape) {
    const std::int64_t size = n * static_cast<std::int64_t>(c10::elementSize(dtype));
    torch::Tensor v = bytes.narrow(0, at, size).view(dtype).view(shape);
    at += rounded8(size);
    return v;
  };
  tasks::Batch b;
  b.inputs = part(like.inputs.numel(), torch::kInt64, like.inputs.sizes());
  b.targets = part(like.targets.numel(), torch::kInt64, like.targets.sizes());
  b.loss_mask = part(like.loss_mask.numel(), torch::kFloat32, like.loss_mask.sizes());
  torch::Tensor counted = part(1, torch::kFloat32, {});
  return {b, counted};
}

// Writes the batch and its count into `bytes` on the host (pinned, made or remade to size).
void pack_batch(const tasks::Batch& b, double counted, torch::Tensor& bytes) {
  const std::int64_t n = packed_bytes(b);
  if (!bytes.defined() || bytes.numel() != n) {
    bytes = torch::empty({n}, torch::TensorOptions().dtype(torch::kUInt8).pinned_memory(true));
  }
  auto [views, count] = packed_views(bytes, b);
  views.inputs.copy_(b.inputs);
  views.targets.copy_(b.targets);
  views.loss_mask.copy_(b.loss_mask);
  count.fill_(counted);
}
#endif

tasks::Batch rows(const tasks::Batch& b, std::int64_t start, std::int64_t count) {
  return {b.inputs.narrow(0, start, count), b.targets.narrow(0, start, count),
          b.loss_mask.narrow(0, start, count)};
}

// Dotted keys and values of a JSON tree, for naming the first difference between two configs.
void flatten(const nlohmann::json& j, const std::string& prefix,
             std::map<std::string, nlohmann::json>& out) {
  if (j.is_object() && !j.empty()) {
    for (auto it = j.begin(); it != j.end(); ++it) {
      flatten(it.value(), prefix.empty() ? it.key() : prefix + "." + it.key(), out);
    }
  } else {
    out[prefix] = j;
  }
}

// Settings that may change between a checkpoint and its resumption without changing what the
// run computes: its length, reporting cadence, output folder, and where it runs.
bool may_differ_on_resume(const std::string& key) {
  static const std::set<std::string> free = {
      "device", "threads", "train.cuda_graph", "train.bucket_mb", "train.steps", "train.log_every", "train.eval_every",
      "train.eval_batches", "train.checkpoint_every", "train.spike_threshold", "train.keep_checkpoints", "train.out_dir"};
  return free.count(key) > 0;
}

// c10::Event::synchronize arrived in LibTorch 2.x; before it, poll.
template <class Event>
auto wait_for(const Event& e, int) -> decltype(e.synchronize(), void()) {
  e.synchronize();
}
template <class Event>
void wait_for(const Event& e, long) {
  while (!e.query()) std::this_thread::yield();
}

// torch::optim keys its state by the parameter's TensorImpl: as a string before LibTorch 2.x,
// as the pointer after.
template <class StateMap>
typename StateMap::key_type state_key(const StateMap&, const torch::Tensor& p) {
  if constexpr (std::is_same_v<typename StateMap::key_type, std::string>) {
    std::ostringstream key;  // what c10::guts::to_string wrote
    key << p.unsafeGetTensorImpl();
    return key.str();
  } else {
    return static_cast<typename StateMap::key_type>(p.unsafeGetTensorImpl());
  }
}

// One phase of a profiled step (see StepProfile); does nothing without a profile. `scope` is the
// user scope's name, "winnow.step.<phase>": the profiler keeps the pointer, so a literal.
class PhaseScope {
 public:
  PhaseScope(StepProfile* profile, const char* scope, const torch::Device& device)
      : profile_(profile), scope_name_(scope), device_(device) {
    if (profile_ == nullptr) return;
    scope_.emplace(at::RecordScope::USER_SCOPE);
    if (scope_->isActive()) scope_->before(scope);
    start_ = std::chrono::steady_clock::now();
  }
  ~PhaseScope() {
    try {
      close();
    } catch (...) {
      // An error in the step is already on its way out; the profile can lose this phase.
    }
  }
  PhaseScope(const PhaseScope&) = delete;
  PhaseScope& operator=(const PhaseScope&) = delete;

  void close() {
    if (profile_ == nullptr) return;
    StepProfile* profile = profile_;
    profile_ = nullptr;
    if (device_.is_cuda()) torch::cuda::synchronize();
    const double s =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
    scope_.reset();
    profile->add(std::string(scope_name_).substr(std::string("winnow.step.").size()), s);
  }

 private:
  StepProfile* profile_;
  const char* scope_name_;
  torch::Device device_;
  std::optional<at::RecordFunction> scope_;
  std::chrono::steady_clock::time_point start_;
};

}  // namespace

// The captured step: the graph and the tensors it reads and writes, at fixed addresses.
struct Trainer::GraphState {
#if WINNOW_CUDA_GRAPHS
  at::cuda::CUDAGraph graph;
#endif
  std::size_t phase = 0;
  torch::Tensor inputs, targets, loss_mask, counted, values;
  torch::Tensor packed;  // on the device, where inputs .. counted are views (pack_batch's layout)
  std::vector<std::string> aux_names;
};

Trainer::~Trainer() = default;
Trainer::Trainer(Trainer&&) noexcept = default;
Trainer& Trainer::operator=(Trainer&&) noexcept = default;

void StepProfile::add(const std::string& phase, double s) {
  for (auto& [name, total] : seconds) {
    if (name == phase) {
      total += s;
      return;
    }
  }
  seconds.emplace_back(phase, s);
}

torch::Device pick_device(const std::string& name, bool needs_winnow_cuda) {
  const bool cuda = torch::cuda::is_available();
  if (name == "cpu" || (name == "auto" && !cuda)) return torch::Device(torch::kCPU);
  if (!cuda) {
    config::fail("device", "cpu or auto (this LibTorch sees no CUDA device)", "\"" + name + "\"");
  }
  const torch::Device device = name == "auto" ? torch::Device(torch::kCUDA, 0) : torch::Device(name);
  const std::int64_t index = device.has_index() ? device.index() : 0;
  if (index >= static_cast<std::int64_t>(torch::cuda::device_count())) {
    config::fail("device", "cuda:0 .. cuda:" + std::to_string(torch::cuda::device_count() - 1),
                 "\"" + name + "\"");
  }
  if (needs_winnow_cuda && !winnow::built_with_cuda()) {
    config::fail("device", "cpu (this build of winnow has no CUDA kernels; build with nvcc, or "
                           "set model.attention.implementation to composed)",
                 "\"" + name + "\"");
  }
  return torch::Device(torch::kCUDA, static_cast<c10::DeviceIndex>(index));
}

double lr_factor(const TrainConfig& c, std::int64_t step) {
  if (step < c.warmup) return static_cast<double>(step + 1) / static_cast<double>(c.warmup);
  if (c.schedule == "constant") return 1.0;
  const double span = static_cast<double>(std::max<std::int64_t>(c.steps - c.warmup, 1));
  const double progress = std::min(1.0, static_cast<double>(step - c.warmup) / span);
  if (c.schedule == "cosine") {
    return c.min_lr_ratio + (1 - c.min_lr_ratio) * 0.5 * (1 + std::cos(M_PI * progress));
  }
  // wsd: hold the rate, then decay linearly to min_lr_ratio over the last decay_fraction.
  const double decay_start = 1.0 - c.decay_fraction;
  if (progress <= decay_start) return 1.0;
  return 1.0 - (1.0 - c.min_lr_ratio) * (progress - decay_start) / c.decay_fraction;
}

namespace {
ExperimentConfig resolved(ExperimentConfig c) {
  resolve(c);
  return c;
}

// A data-parallel rank's GPU is its local rank's.
torch::Device rank_device(torch::Device device, const WorldInfo& world) {
  if (!device.is_cuda() || !world.distributed()) return device;
  const auto count = static_cast<int>(torch::cuda::device_count());
  if (world.local_rank >= count) {
    throw Error(ErrorKind::unsupported, "winnow: LOCAL_RANK " + std::to_string(world.local_rank) +
                                            " asks for GPU " + std::to_string(world.local_rank) + ", but " +
                                            std::to_string(count) + " are visible");
  }
  return torch::Device(torch::kCUDA, static_cast<c10::DeviceIndex>(world.local_rank));
}
}  // namespace

Trainer::Trainer(const ExperimentConfig& config)
    : config_(resolved(config)),
      world_(world_from_environment()),
      device_(rank_device(pick_device(config_.device, nn::uses_kernel(config_.model)), world_)) {
  const TrainConfig& t = config_.train;
  if (world_.distributed()) {
    const std::int64_t shard = t.batch_size / world_.world;
    if (t.batch_size % world_.world != 0 || shard % t.grad_accum != 0) {
      config::fail("train.batch_size",
                   "a multiple of WORLD_SIZE x train.grad_accum (" + std::to_string(world_.world) + " x " +
                       std::to_string(t.grad_accum) + ") for data-parallel training",
                   std::to_string(t.batch_size));
    }
    if (device_.is_cuda()) c10::impl::VirtualGuardImpl(c10::DeviceType::CUDA).setDevice(device_);
    collective_ = &Collective::of_process(world_, device_);
    quiet = world_.rank != 0;
  }
  if (config_.threads > 0) at::set_num_threads(static_cast<int>(config_.threads));
  if (t.dtype == "bfloat16" && !device_.is_cuda()) {
    config::fail("train.dtype", "auto or float32 on the CPU (winnow's CPU kernels run float32)",
                 "\"bfloat16\"");
  }
  if (t.deterministic) at::globalContext().setDeterministicAlgorithms(true, /*warn_only=*/true);
  autocast_ = uses_autocast(device_, t.dtype);
  torch::manual_seed(config_.seed);
  task_ = tasks::make_task(config_.task);
  model_ = nn::make_language_model(config_.model);
  model_->to(device_);

  const auto named = model_->named_parameters();
  auto check_patterns = [&](const std::vector<std::string>& patterns, const std::string& key) {
    for (std::size_t i = 0; i < patterns.size(); ++i) {
      bool found = false;
      for (const auto& item : named) found |= item.key().find(patterns[i]) != std::string::npos;
      if (!found) {
        config::fail(key + "[" + std::to_string(i) + "]",
                     "a substring of some parameter name (e.g. " + named[0].key() + ")",
                     "\"" + patterns[i] + "\"");
      }
    }
  };
  for (const auto& [pattern, mult] : t.lr_multipliers) {
    bool found = false;
    for (const auto& item : named) found |= item.key().find(pattern) != std::string::npos;
    if (!found) {
      config::fail("train.lr_multipliers." + pattern,
                   "a key that is a substring of some parameter name (e.g. " + named[0].key() + ")",
                   "no parameter matching it");
    }
  }
  for (std::size_t i = 0; i < t.phases.size(); ++i) {
    const std::string key = "train.phases[" + std::to_string(i) + "]";
    check_patterns(t.phases[i].train_only, key + ".train_only");
    check_patterns(t.phases[i].freeze, key + ".freeze");
  }

  // Parameter groups by learning-rate multiplier (the longest matching substring wins) and by
  // weight decay (matrices decay; norms, biases, gains and per-head scalars do not; without
  // weight decay they share a group).
  std::map<std::pair<double, bool>, std::vector<torch::Tensor>> groups;
  for (const auto& item : named) {
    double mult = 1.0;
    std::size_t best = 0;
    for (const auto& [pattern, m] : t.lr_multipliers) {
      if (item.key().find(pattern) != std::string::npos && pattern.size() > best) {
        mult = m;
        best = pattern.size();
      }
    }
    groups[{mult, t.weight_decay != 0 && item.value().dim() >= 2}].push_back(item.value());
  }
  std::vector<torch::optim::OptimizerParamGroup> param_groups;
  for (auto& [key, params] : groups) {
    auto options = std::make_unique<torch::optim::AdamWOptions>(t.lr * key.first);
    options->betas({t.beta1, t.beta2}).eps(t.eps).weight_decay(key.second ? t.weight_decay : 0.0);
    param_groups.emplace_back(params, std::move(options));
    group_multipliers_.push_back(key.first);
  }
  optimizer_ = std::make_unique<torch::optim::AdamW>(param_groups, torch::optim::AdamWOptions(t.lr));

  fs::create_directories(t.out_dir);
  metrics_path_ = (fs::path(t.out_dir) / "metrics.jsonl").string();
}

std::size_t Trainer::phase_index(std::int64_t step) const {
  const auto& phases = config_.train.phases;
  std::int64_t end = 0;
  for (std::size_t i = 0; i + 1 < phases.size(); ++i) {
    end += phases[i].length(config_.train.steps);
    if (step < end) return i;
  }
  return phases.empty() ? 0 : phases.size() - 1;
}

void Trainer::enter_phase(std::size_t index) {
  if (index == phase_) return;
  phase_ = index;
  eager_steps_in_phase_ = 0;
  const auto& phases = config_.train.phases;
  if (!phases.empty()) {
    const Phase& p = phases[index];
    for (auto& item : model_->named_parameters()) {
      const bool trains = (p.train_only.empty() || contains(item.key(), p.train_only)) &&
                          !contains(item.key(), p.freeze);
      item.value().requires_grad_(trains);
    }
    model_->set_phase(p.name);
    if (!quiet) std::printf("phase %s from step %lld\n", p.name.c_str(), static_cast<long long>(step_));
  }
  // The buckets hold the parameters that train in this phase.
  if (collective_) {
    gradient_buckets_.reset();
    gradient_buckets_ = std::make_unique<GradientBuckets>(
        *collective_, model_->parameters(), static_cast<std::int64_t>(config_.train.bucket_mb * (1 << 20)));
  }
}

double Trainer::aux_weight(const std::string& name) const {
  const auto& phases = config_.train.phases;
  if (!phases.empty()) {
    const auto& w = phases[phase_].aux_loss_weights;
    if (auto it = w.find(name); it != w.end()) return it->second;
  }
  const auto& w = config_.train.aux_loss_weights;
  if (auto it = w.find(name); it != w.end()) return it->second;
  return 1.0;
}

void Trainer::check_aux_names(const std::map<std::string, torch::Tensor>& produced) {
  if (!aux_checked_.insert(phase_).second) return;
  auto check = [&](const std::map<std::string, double>& weights, const std::string& key) {
    for (const auto& [name, weight] : weights) {
      if (!produced.count(name)) {
        std::string names;
        for (const auto& [n, v] : produced) names += (names.empty() ? "" : ", ") + n;
        config::fail(key + "." + name,
                     "the name of an auxiliary loss this model produces (" +
                         (names.empty() ? std::string("it produces none") : names) + ")",
                     "\"" + name + "\"");
      }
    }
  };
  if (aux_checked_.size() == 1) check(config_.train.aux_loss_weights, "train.aux_loss_weights");
  if (!config_.train.phases.empty()) {
    check(config_.train.phases[phase_].aux_loss_weights,
          "train.phases[" + std::to_string(phase_) + "].aux_loss_weights");
  }
}

tasks::Batch Trainer::training_batch(std::int64_t step) const {
  const TrainConfig& t = config_.train;
  return task_->sample_training(t.batch_size, t.seq_len,
                                tasks::batch_seed(config_.seed, kTrainStream, step));
}

Trainer::PinnedSlot& Trainer::stage_pinned(const tasks::Batch& batch) {
  PinnedSlot& slot = pinned_slots_[next_pinned_slot_];
  next_pinned_slot_ = (next_pinned_slot_ + 1) % pinned_slots_.size();
  if (slot.read) wait_for(*slot.read, 0);
  slot.read.reset();
  auto staged = [](torch::Tensor& buffer, const torch::Tensor& from) {
    if (!buffer.defined() || buffer.sizes() != from.sizes() ||
        buffer.scalar_type() != from.scalar_type()) {
      buffer = torch::empty(from.sizes(), from.options().pinned_memory(true));
    }
    buffer.copy_(from);
  };
  staged(slot.batch.inputs, batch.inputs);
  staged(slot.batch.targets, batch.targets);
  staged(slot.batch.loss_mask, batch.loss_mask);
  return slot;
}

bool device_adamw_available(const torch::Device& device) {
  return device.is_cpu() || (device.is_cuda() && winnow::built_with_cuda());
}

torch::optim::AdamWParamState& ensure_adamw_state(torch::optim::AdamW& optimizer,
                                                  std::map<const void*, torch::Tensor>& device_steps,
                                                  const torch::Tensor& p) {
  auto& state_map = optimizer.state();
  auto it = state_map.find(state_key(state_map, p));
  if (it == state_map.end()) {
    auto state = std::make_unique<torch::optim::AdamWParamState>();
    state->step(0);
    state->exp_avg(torch::zeros_like(p, torch::MemoryFormat::Preserve));
    state->exp_avg_sq(torch::zeros_like(p, torch::MemoryFormat::Preserve));
    it = state_map.emplace(state_key(state_map, p), std::move(state)).first;
  }
  auto& state = static_cast<torch::optim::AdamWParamState&>(*it->second);
  torch::Tensor& step = device_steps[p.unsafeGetTensorImpl()];
  if (!step.defined()) {
    step = torch::full({}, static_cast<double>(state.step()),
                       torch::TensorOptions().dtype(torch::kFloat32).device(p.device()));
  }
  return state;
}

torch::Tensor device_adamw_step(torch::optim::AdamW& optimizer, std::map<const void*, torch::Tensor>& device_steps,
                                const std::vector<torch::Tensor>& group_lrs, double max_norm,
                                const std::vector<torch::Tensor>& guards) {
  auto& param_groups = optimizer.param_groups();
  if (group_lrs.size() != param_groups.size()) {
    throw Error(ErrorKind::invalid_argument,
                "device_adamw_step: argument 'group_lrs': expected " + std::to_string(param_groups.size()) +
                    " tensors (one per parameter group), got " + std::to_string(group_lrs.size()));
  }
  std::vector<torch_ops::AdamWGroup> groups;
  double beta1 = 0.9, beta2 = 0.999, eps = 1e-8;
  for (std::size_t g = 0; g < param_groups.size(); ++g) {
    const auto& o = static_cast<const torch::optim::AdamWOptions&>(param_groups[g].options());
    if (o.amsgrad()) throw Error(ErrorKind::unsupported, "device_adamw_step: amsgrad is not supported");
    if (g == 0) {
      beta1 = std::get<0>(o.betas());
      beta2 = std::get<1>(o.betas());
      eps = o.eps();
    } else if (std::get<0>(o.betas()) != beta1 || std::get<1>(o.betas()) != beta2 || o.eps() != eps) {
      throw Error(ErrorKind::unsupported, "device_adamw_step: parameter groups with different betas or eps");
    }
    torch_ops::AdamWGroup group;
    group.lr = group_lrs[g];
    group.weight_decay = o.weight_decay();
    for (auto& p : param_groups[g].params()) {
      if (!p.grad().defined()) continue;
      auto& state = ensure_adamw_state(optimizer, device_steps, p);
      // The host count is what checkpoints hold; on the device only the device count moves,
      // and sync_optimizer_steps() brings the host's up to date.
      state.step(state.step() + 1);
      group.params.push_back(p.detach());
      group.grads.push_back(p.grad());
      group.exp_avgs.push_back(state.exp_avg());
      group.exp_avg_sqs.push_back(state.exp_avg_sq());
      group.steps.push_back(device_steps.at(p.unsafeGetTensorImpl()));
    }
    groups.push_back(std::move(group));
  }
  return torch_ops::clipped_adamw_step(groups, beta1, beta2, eps, max_norm, guards);
}

void sync_optimizer_steps(torch::optim::AdamW& optimizer,
                          const std::map<const void*, torch::Tensor>& device_steps) {
  for (auto& group : optimizer.param_groups()) {
    for (auto& p : group.params()) {
      const auto d = device_steps.find(p.unsafeGetTensorImpl());
      auto it = optimizer.state().find(state_key(optimizer.state(), p));
      if (d == device_steps.end() || it == optimizer.state().end()) continue;
      static_cast<torch::optim::AdamWParamState&>(*it->second)
          .step(static_cast<std::int64_t>(d->second.item<double>()));
    }
  }
}

// Why this run's steps cannot be captured as a CUDA graph, or "" when they can.
std::string Trainer::graph_blocker() const {
#if WINNOW_CUDA_GRAPHS
  if (!config_.train.cuda_graph) return "train.cuda_graph is false";
  if (!device_.is_cuda()) return "not on CUDA";
  if (!device_adamw_available(device_)) return "this build has no CUDA kernels";
  if (profile != nullptr) return "a profile is attached";
  if (collective_ && !collective_->stream_ordered()) {
    return "data-parallel steps sum their gradients through the host (gloo)";
  }
  if (!step_hooks.empty() || !aux_loss_fns.empty()) return "host code runs inside the step";
  const nn::AttentionConfig& a = config_.model.attention;
  const nn::Mechanism& m = nn::find_mechanism(a.kind, "model.attention.kind");
  if (!m.graph_blocker) return a.kind + " attention has not been checked for capture";
  if (std::string why = m.graph_blocker(a); !why.empty()) return why;
  if (a.position == "rope" && a.rope.scaling == "dynamic") {
    return "dynamic RoPE builds its tables on the host every call";
  }
  return "";
#else
  return "this LibTorch has no CUDA graphs";
#endif
}

torch::Tensor Trainer::step_body(const tasks::Batch& batch, const torch::Tensor& counted,
                                 std::vector<std::string>& aux_names) {
  const TrainConfig& t = config_.train;
  const std::int64_t micro = t.batch_size / world_.world / t.grad_accum;
  torch::Tensor loss_sum;  // the first micro-batch's loss itself: no zeros and no addition a step
  std::map<std::string, torch::Tensor> aux_sums;
  std::vector<torch::Tensor> reported;  // summed over the ranks apart from the gradients
  for (std::int64_t m = 0; m < t.grad_accum; ++m) {
    PhaseScope copy(profile, "winnow.step.copy", device_);
    const tasks::Batch mb = to_device(rows(batch, m * micro, micro), device_);
    copy.close();
    torch::Tensor total;
    {
      PhaseScope forward(profile, "winnow.step.forward", device_);
      Autocast autocast(autocast_);
      const torch::Tensor logits = model_->forward(mb.inputs);
      const torch::Tensor loss = masked_cross_entropy_sum(logits, mb, counted);
      std::map<std::string, torch::Tensor> aux = model_->aux_losses();
      for (auto& [name, fn] : aux_loss_fns) {
        torch::Tensor value = fn(*this, mb, logits);
        auto it = aux.find(name);
        if (it == aux.end()) {
          aux.emplace(name, value);
        } else {
          it->second = it->second + value;
        }
      }
      check_aux_names(aux);
      total = loss;
      for (auto& [name, value] : aux) {
        // A mean over all micro-batches of all ranks (the ranks' sums are added below).
        const torch::Tensor v = value.to(torch::kFloat32) / static_cast<double>(t.grad_accum * world_.world);
        const double w = aux_weight(name);
        if (w != 0) total = total + w * v;
        auto it = aux_sums.find(name);
        if (it == aux_sums.end()) {
          aux_sums.emplace(name, v.detach());
        } else {
          it->second = it->second + v.detach();
        }
      }
      // The data-parallel report sums it over the ranks in place after the backward: safe, since
      // the loss's backward keeps counted, not the quotient (counted needs no gradient).
      loss_sum = m == 0 ? loss.detach() : loss_sum + loss.detach();
    }
    PhaseScope backward(profile, "winnow.step.backward", device_);
    if (gradient_buckets_ && m + 1 == t.grad_accum) {
      // The step's report rides in the last bucket when it can.
      reported = {loss_sum};
      for (auto& [name, value] : aux_sums) reported.push_back(value);
      if (gradient_buckets_->arm(reported)) reported.clear();
    }
    if (total.requires_grad()) total.backward();
  }
  if (gradient_buckets_) {
    // The losses are already divided by the whole batch's counted positions: summing the ranks'
    // gradients gives the whole batch's gradient.
    PhaseScope reduce(profile, "winnow.step.all_reduce", device_);
    gradient_buckets_->finish();
    if (!reported.empty()) collective_->sum(reported);
  }

  // The clip and the update in one call (three kernels on CUDA), enqueued before the report is
  // read: a step whose loss or gradient norm is not finite changes nothing, and the error comes
  // when the report is read.
  PhaseScope update(profile, "winnow.step.optimizer", device_);
  const torch::Tensor norm =
      device_adamw_step(*optimizer_, device_steps_, lr_tensors_, t.clip, {loss_sum.to(torch::kFloat32)});
  update.close();
  // On CUDA in the loss's dtype (float32 but for float64 models), widened on the host when read:
  // one launch fewer a step than a float64 copy on the device.
  const auto dtype = device_.is_cuda() ? loss_sum.scalar_type() : torch::kFloat64;
  std::vector<torch::Tensor> report = {loss_sum.to(dtype), norm.to(dtype)};
  aux_names.clear();
  for (auto& [name, value] : aux_sums) {
    report.push_back(value.to(dtype));
    aux_names.push_back(name);
  }
  return torch::stack(report);
}

void Trainer::enqueue_step() {
  const TrainConfig& t = config_.train;
  enter_phase(phase_index(step_));
  for (auto& hook : step_hooks) hook(*this, step_);
  const double phase_scale = t.phases.empty() ? 1.0 : t.phases[phase_].lr_scale;
  const double lr = t.lr * lr_factor(t, step_) * phase_scale;
  auto& groups = optimizer_->param_groups();
  for (std::size_t g = 0; g < groups.size(); ++g) {
    static_cast<torch::optim::AdamWOptions&>(groups[g].options()).lr(lr * group_multipliers_[g]);
  }
  model_->train();

  PhaseScope sample(profile, "winnow.step.sample", device_);
  PinnedSlot* staged_slot = nullptr;
  tasks::Batch batch;
  if (next_batch_step_ == step_) {
    staged_slot = next_batch_;
    batch = staged_slot->batch;
  } else if (device_.is_cuda()) {
    staged_slot = &stage_pinned(training_batch(step_));
    batch = staged_slot->batch;
  } else {
    batch = training_batch(step_);
  }
  next_batch_ = nullptr;
  next_batch_step_ = -1;
  // The loss is the mean over every counted position of the whole batch, however it is split
  // into micro-batches: accumulation then computes the same gradient as one big batch.
  const double counted = std::max(1.0, batch.loss_mask.sum().item<double>());
  if (world_.distributed()) {
    // Every rank draws the step's whole batch (a pure function of seed and step), counts its
    // positions above, and keeps its slice: the ranks together see exactly the batch one
    // process would, and need no collective to agree on the count.
    const std::int64_t shard = t.batch_size / world_.world;
    batch = rows(batch, world_.rank * shard, shard);
  }
  sample.close();

  PendingReport pending;
  pending.stats.lr = lr;
  pending.stats.phase = t.phases.empty() ? "" : t.phases[phase_].name;
  pending.stats.step = step_ + 1;
  torch::Tensor values;
#if WINNOW_CUDA_GRAPHS
  const bool graphs = graph_blocker().empty();
  if (graphs && graph_ && graph_->phase != phase_) graph_.reset();  // frozen sets changed
  if (graphs && graph_) {
    // Replay: the step's inputs go into the captured tensors, then one launch.
    if (graph_->packed.defined() && staged_slot != nullptr) {
      pack_batch(batch, counted, staged_slot->packed);
      graph_->packed.copy_(staged_slot->packed, /*non_blocking=*/true);
    } else {
      graph_->inputs.copy_(batch.inputs, /*non_blocking=*/true);
      graph_->targets.copy_(batch.targets, /*non_blocking=*/true);
      graph_->loss_mask.copy_(batch.loss_mask, /*non_blocking=*/true);
      graph_->counted.fill_(counted);
    }
    set_lr_tensors(lr);
    graph_->graph.replay();
    values = graph_->values;
    pending.aux_names = graph_->aux_names;
  } else if (graphs && eager_steps_in_phase_ + 1 >= kEagerStepsBeforeCapture) {
    capture_and_replay(batch, counted, lr);
    values = graph_->values;
    pending.aux_names = graph_->aux_names;
  } else
#endif
  {
#if WINNOW_CUDA_GRAPHS
    // The step before a capture runs on the stream the capture will use (see capture_and_replay).
    std::optional<c10::cuda::CUDAStreamGuard> side;
    if (graphs && eager_steps_in_phase_ + 2 == kEagerStepsBeforeCapture) {
      torch::cuda::synchronize();
      side.emplace(capture_stream());
    }
#endif
    // Gradients start undefined, not zero: AdamW then skips frozen parameters entirely (a zero
    // gradient would still move them through the moments and weight decay).
    for (auto& p : model_->parameters()) p.mutable_grad() = torch::Tensor();
    torch::Tensor counted_tensor = torch::full({}, counted, torch::TensorOptions().device(device_));
    set_lr_tensors(lr);
    values = step_body(batch, counted_tensor, pending.aux_names);
    if (!device_.is_cuda()) {
      // The report is at hand on the CPU: a diverged step (its update skipped) throws here,
      // before it counts.
      pending.values = values;
      resolve(pending);
    }
    ++eager_steps_in_phase_;
#if WINNOW_CUDA_GRAPHS
    if (side) {
      side.reset();
      torch::cuda::synchronize();
    }
#endif
  }

  PhaseScope report_phase(profile, "winnow.step.report", device_);
  if (device_.is_cuda()) {
    // One device-to-host transfer per step for everything the step reports, read later.
    pending.values = torch::empty(values.sizes(), torch::TensorOptions().dtype(values.scalar_type()).pinned_memory(true));
    pending.values.copy_(values, /*non_blocking=*/true);
    auto event = std::make_shared<c10::Event>(c10::DeviceType::CUDA);
    event->record(c10::impl::VirtualGuardImpl(c10::DeviceType::CUDA).getStream(device_));
    pending.landed = event;
    if (staged_slot != nullptr) staged_slot->read = event;
  } else {
    pending.values = values;
  }
  report_phase.close();
  // The next batch is drawn and staged while the device works on this step.
  if (device_.is_cuda()) {
    PhaseScope sample_next(profile, "winnow.step.sample", device_);
    next_batch_ = &stage_pinned(training_batch(step_ + 1));
    next_batch_step_ = step_ + 1;
  }
  if (profile != nullptr) ++profile->steps;
  ++step_;
  pending_.push_back(std::move(pending));
  // Two steps in flight at most: the host waits for the older one while the device still has
  // the newer one queued.
  while (pending_.size() > 2) {
    PendingReport front = std::move(pending_.front());
    pending_.pop_front();
    resolve(front);
  }
}

void Trainer::set_lr_tensors(double lr) {
  auto& groups = optimizer_->param_groups();
  if (lr_tensors_.size() != groups.size()) {
    lr_tensors_.clear();
    for (std::size_t g = 0; g < groups.size(); ++g) {
      lr_tensors_.push_back(torch::zeros({}, torch::TensorOptions().dtype(torch::kFloat32).device(device_)));
    }
  }
  for (std::size_t g = 0; g < groups.size(); ++g) lr_tensors_[g].fill_(lr * group_multipliers_[g]);
}

#if WINNOW_CUDA_GRAPHS
// Captures this step on a side stream after one more ordinary step there (lazily created
// library state, cuBLAS's workspace for that stream among it, must not first appear inside a
// capture), then replays it to take the step. The captured tensors keep their addresses for
// every replay.
c10::Stream Trainer::capture_stream() {
  if (!capture_stream_) capture_stream_ = c10::cuda::getStreamFromPool(false, device_.index());
  return *capture_stream_;
}

void Trainer::capture_and_replay(const tasks::Batch& batch, double counted, double lr) {
  auto state = std::make_unique<GraphState>();
  state->phase = phase_;
  if (packable(batch)) {
    torch::Tensor host;
    pack_batch(batch, counted, host);
    state->packed = host.to(device_);
    auto [views, count] = packed_views(state->packed, batch);
    state->inputs = views.inputs;
    state->targets = views.targets;
    state->loss_mask = views.loss_mask;
    state->counted = count;
  } else {
    state->inputs = batch.inputs.to(device_);
    state->targets = batch.targets.to(device_);
    state->loss_mask = batch.loss_mask.to(device_);
    state->counted = torch::full({}, counted, torch::TensorOptions().device(device_));
  }
  set_lr_tensors(lr);
  const tasks::Batch on_device{state->inputs, state->targets, state->loss_mask};
  // Optimizer state created inside the capture would be recreated (zeroed) by every replay.
  for (auto& group : optimizer_->param_groups()) {
    for (auto& p : group.params()) {
      if (p.requires_grad()) ensure_adamw_state(*optimizer_, device_steps_, p);
    }
  }
  torch::cuda::synchronize();
  // The capture allocates from a pool of its own; memory cached by the ordinary pool (earlier
  // steps, earlier runs in this process) would otherwise stay out of its reach.
  c10::cuda::CUDACachingAllocator::emptyCache();
  {
    c10::cuda::CUDAStreamGuard side(capture_stream());
    for (auto& p : model_->parameters()) p.mutable_grad() = torch::Tensor();
    state->graph.capture_begin();
    try {
      state->values = step_body(on_device, state->counted, state->aux_names);
      state->graph.capture_end();
    } catch (const std::exception& e) {
      // End the capture so that the stream (and with it the process) stays usable.
      cudaGraph_t partial = nullptr;
      cudaStreamEndCapture(c10::cuda::getCurrentCUDAStream(device_.index()).stream(), &partial);
      if (partial != nullptr) cudaGraphDestroy(partial);
      cudaGetLastError();
      throw Error(ErrorKind::runtime,
                  std::string("capturing the training step as a CUDA graph failed (set "
                              "train.cuda_graph to false to train without): ") + e.what());
    }
  }
  torch::cuda::synchronize();
  graph_ = std::move(state);
  graph_->graph.replay();
}
#endif

bool TrainingHealth::observe(std::int64_t step, double loss, double threshold) {
  if (step <= seen) return false;
  constexpr double beta = 1.0 - 1.0 / static_cast<double>(kHorizon);
  bool spiked = false;
  if (seen >= kHorizon && std::isfinite(loss)) {
    const double running = mean / (1.0 - std::pow(beta, static_cast<double>(seen)));
    if (running > 0) {
      const double ratio = loss / running;
      max_loss_ratio = std::max(max_loss_ratio, ratio);
      if (ratio > 1.0 + threshold) {
        spiked = true;
        ++spikes;
        last_spike_step = step;
      }
    }
  }
  if (std::isfinite(loss)) mean = beta * mean + (1.0 - beta) * loss;
  seen = step;
  return spiked;
}

nlohmann::json TrainingHealth::to_json() const {
  return {{"mean", mean},
          {"seen", seen},
          {"spikes", spikes},
          {"last_spike_step", last_spike_step},
          {"max_loss_ratio", max_loss_ratio},
          {"max_activation", max_activation}};
}

TrainingHealth TrainingHealth::from_json(const nlohmann::json& j) {
  TrainingHealth h;
  h.mean = j.value("mean", 0.0);
  h.seen = j.value("seen", std::int64_t{0});
  h.spikes = j.value("spikes", std::int64_t{0});
  h.last_spike_step = j.value("last_spike_step", std::int64_t{0});
  h.max_loss_ratio = j.value("max_loss_ratio", 0.0);
  h.max_activation = j.value("max_activation", 0.0);
  return h;
}

std::vector<double> Trainer::measure_activations() {
  wait_for_steps();
  torch::NoGradGuard no_grad;
  model_->eval();
  const TrainConfig& t = config_.train;
  const torch::Tensor inputs =
      task_->sample(t.batch_size / t.grad_accum, t.seq_len, tasks::batch_seed(config_.seed, kEvalStream, 0))
          .inputs.to(device_);
  torch::Tensor maxima;
  {
    Autocast autocast(autocast_);
    maxima = model_->residual_maxima(inputs).to(torch::kCPU, torch::kFloat64).contiguous();
  }
  model_->train();
  std::vector<double> out(maxima.data_ptr<double>(), maxima.data_ptr<double>() + maxima.numel());
  for (double m : out) health_.max_activation = std::max(health_.max_activation, m);
  return out;
}

StepStats Trainer::resolve(PendingReport& report) {
  if (report.landed) wait_for(*report.landed, 0);
  StepStats s = report.stats;
  const torch::Tensor values = report.values.to(torch::kFloat64);
  const double* v = values.data_ptr<double>();
  s.loss = v[0];
  s.grad_norm = v[1];
  for (std::size_t i = 0; i < report.aux_names.size(); ++i) s.aux[report.aux_names[i]] = v[2 + i];
  if (!std::isfinite(s.loss) || !std::isfinite(s.grad_norm)) {
    pending_.clear();
    throw TrainingDiverged(s.step, "training diverged at step " + std::to_string(s.step) +
                                        ": loss " + std::to_string(s.loss) + ", gradient norm " +
                                        std::to_string(s.grad_norm) +
                                        " (lower train.lr or set train.clip)");
  }
  if (health_.observe(s.step, s.loss, config_.train.spike_threshold)) {
    log({{"event", "loss_spike"}, {"step", s.step}, {"loss", s.loss},
         {"max_loss_ratio", health_.max_loss_ratio}});
  }
  return s;
}

StepStats Trainer::wait_for_steps() {
  StepStats last;
  while (!pending_.empty()) {
    PendingReport front = std::move(pending_.front());
    pending_.pop_front();
    last = resolve(front);
  }
  return last;
}

StepStats Trainer::step() {
  enqueue_step();
  return wait_for_steps();
}

nlohmann::json Trainer::evaluate() {
  wait_for_steps();
  const TrainConfig& t = config_.train;
  torch::NoGradGuard no_grad;
  model_->eval();
  double loss = 0, correct = 0, counted = 0;
  for (std::int64_t i = 0; i < t.eval_batches; ++i) {
    const tasks::Batch b = to_device(
        task_->sample(t.batch_size / t.grad_accum, t.seq_len,
                      tasks::batch_seed(config_.seed, kEvalStream, i)),
        device_);
    Autocast autocast(autocast_);
    const torch::Tensor logits = model_->forward(b.inputs);
    loss += masked_cross_entropy_sum(logits, b).item<double>();
    correct += (logits.argmax(-1).eq(b.targets).to(torch::kFloat32) * b.loss_mask).sum().item<double>();
    counted += b.loss_mask.sum().item<double>();
  }
  model_->train();
  counted = std::max(counted, 1.0);
  const std::vector<double> activations = measure_activations();
  nlohmann::json out = {{"event", "eval"},
                        {"step", step_},
                        {"eval_loss", loss / counted},
                        {"eval_accuracy", correct / counted},
                        {"max_activation_by_layer", activations},
                        {"max_activation", health_.max_activation},
                        {"loss_spikes", health_.spikes},
                        {"max_loss_ratio", health_.max_loss_ratio}};
  for (auto& hook : eval_hooks) out.update(hook(*this));
  return out;
}

void Trainer::log(const nlohmann::json& record) {
  if (world_.rank != 0) return;
  std::ofstream f(metrics_path_, std::ios::app);
  f << record.dump() << '\n';
  if (!f) throw Error(ErrorKind::runtime, "cannot append to '" + metrics_path_ + "'");
}

std::string Trainer::save() {
  wait_for_steps();
  sync_optimizer_steps(*optimizer_, device_steps_);
  // One copy of the replicated state, written by rank 0; the others wait for it, so that a rank
  // never reads a checkpoint half written.
  if (world_.rank != 0) {
    collective_->barrier();
    return latest_checkpoint((fs::path(config_.train.out_dir) / "checkpoints").string());
  }
  std::error_code ec;
  const auto bytes = fs::exists(metrics_path_) ? fs::file_size(metrics_path_, ec) : 0;
  CheckpointMeta meta;
  meta.step = step_;
  meta.config = to_json(config_);
  meta.trainer = {{"metrics_bytes", bytes},
                  {"lr_factor", lr_factor(config_.train, std::max<std::int64_t>(step_ - 1, 0))},
                  {"phase", config_.train.phases.empty() ? "" : config_.train.phases[phase_index(step_)].name},
                  {"health", health_.to_json()}};
  const std::string folder =
      save_checkpoint((fs::path(config_.train.out_dir) / "checkpoints").string(), *model_, *optimizer_, meta,
                      config_.train.keep_checkpoints,
                      device_.is_cuda() ? std::optional<torch::Device>(device_) : std::nullopt);
  if (collective_) collective_->barrier();
  return folder;
}

bool Trainer::resume() {
  const std::string folder =
      latest_checkpoint((fs::path(config_.train.out_dir) / "checkpoints").string());
  if (folder.empty()) return false;
  const CheckpointMeta meta = read_checkpoint(folder);
  std::map<std::string, nlohmann::json> theirs, mine;
  flatten(meta.config, "", theirs);
  flatten(to_json(config_), "", mine);
  for (const auto& source : {theirs, mine}) {
    for (const auto& [key, unused] : source) {
      if (may_differ_on_resume(key)) continue;
      const auto a = theirs.find(key), b = mine.find(key);
      const std::string was = a == theirs.end() ? "absent" : a->second.dump();
      const std::string now = b == mine.end() ? "absent" : b->second.dump();
      if (was != now) {
        throw Error(ErrorKind::invalid_argument,
                    "checkpoint: '" + folder + "' was written with " + key + " = " + was +
                        ", this configuration has " + now +
                        "; resume with the same value, or start over (--fresh or another "
                        "train.out_dir)");
      }
    }
  }
  pending_.clear();
  graph_.reset();
  device_steps_.clear();
  eager_steps_in_phase_ = 0;
  next_batch_step_ = -1;
  restore_checkpoint(folder, *model_, *optimizer_,
                     device_.is_cuda() ? std::optional<torch::Device>(device_) : std::nullopt);
  step_ = meta.step;
  health_ = TrainingHealth::from_json(meta.trainer.value("health", nlohmann::json::object()));
  phase_ = static_cast<std::size_t>(-1);
  // Metrics logged after the checkpoint belong to steps that will run again.
  if (world_.rank == 0 && meta.trainer.contains("metrics_bytes") && fs::exists(metrics_path_)) {
    const auto bytes = meta.trainer["metrics_bytes"].get<std::uintmax_t>();
    if (fs::file_size(metrics_path_) > bytes) fs::resize_file(metrics_path_, bytes);
  }
  if (!quiet) std::printf("resumed from %s at step %lld\n", folder.c_str(), static_cast<long long>(step_));
  return true;
}

void Trainer::clear_outputs() {
  if (world_.rank == 0) {
    std::error_code ec;
    remove_tree(fs::path(config_.train.out_dir) / "checkpoints");
    fs::remove(metrics_path_, ec);
  }
  if (collective_) collective_->barrier();
}

nlohmann::json Trainer::train(std::int64_t until_step) {
  const TrainConfig& t = config_.train;
  if (until_step < 0) until_step = t.steps;
  using Clock = std::chrono::steady_clock;
  const auto start = Clock::now();
  auto window_start = start;
  std::int64_t window_tokens = 0;
  const std::int64_t first_step = step_;
  nlohmann::json last_eval;
  bool evaluated_now = false;
  while (step_ < until_step) {
    enqueue_step();
    const std::int64_t done = step_;
    evaluated_now = false;
    window_tokens += tokens_per_step();
    if (done % t.log_every == 0 || done == until_step) {
      const StepStats s = wait_for_steps();
      if (device_.is_cuda()) torch::cuda::synchronize();
      const auto now = Clock::now();
      double activation = 0;
      for (double m : measure_activations()) activation = std::max(activation, m);
      const double window = std::chrono::duration<double>(now - window_start).count();
      const double elapsed = std::chrono::duration<double>(now - start).count();
      const double tokens_per_s = window > 0 ? static_cast<double>(window_tokens) / window : 0.0;
      const double eta = elapsed / static_cast<double>(s.step - first_step) *
                         static_cast<double>(until_step - s.step);
      nlohmann::json record = {{"event", "train"},          {"step", s.step},
                               {"loss", s.loss},            {"lr", s.lr},
                               {"grad_norm", s.grad_norm},  {"tokens_per_s", tokens_per_s},
                               {"elapsed_s", elapsed},     {"max_activation", activation},
                               {"loss_spikes", health_.spikes}};
      if (!s.aux.empty()) record["aux"] = s.aux;
      if (!s.phase.empty()) record["phase"] = s.phase;
      log(record);
      if (!quiet) {
        std::string aux;
        for (const auto& [name, value] : s.aux) {
          char text[96];
          std::snprintf(text, sizeof text, " | %s %.4f", name.c_str(), value);
          aux += text;
        }
        std::printf("step %lld/%lld%s | loss %.4f%s | lr %.2e | %.1fk tok/s | ETA %s\n",
                    static_cast<long long>(s.step), static_cast<long long>(until_step),
                    s.phase.empty() ? "" : (" [" + s.phase + "]").c_str(), s.loss, aux.c_str(),
                    s.lr, tokens_per_s / 1e3, duration(eta).c_str());
        std::fflush(stdout);
      }
      window_start = Clock::now();  // the activation measurement is not training time
      window_tokens = 0;
    }
    // Evaluations and checkpoints are not training time: a window's tokens/s leaves them out.
    // (A checkpoint costs the same wall time at any speed, so counting it would make faster
    // runs, more GPUs among them, look slower than they train.)
    const bool eval_now = t.eval_every > 0 && done % t.eval_every == 0;
    const bool save_now = t.checkpoint_every > 0 && done % t.checkpoint_every == 0 && done < until_step;
    // The steps in flight finish first and count as training.
    if ((eval_now || save_now) && device_.is_cuda()) torch::cuda::synchronize();
    const auto pause_start = Clock::now();
    if (eval_now) {
      last_eval = evaluate();
      evaluated_now = true;
      log(last_eval);
      if (!quiet) std::printf("eval %s\n", last_eval.dump().c_str());
    }
    if (save_now) save();
    if (eval_now || save_now) window_start += Clock::now() - pause_start;
  }
  if (!evaluated_now) {
    last_eval = evaluate();
    log(last_eval);
    if (!quiet) std::printf("eval %s\n", last_eval.dump().c_str());
  }
  save();
  return last_eval;
}

std::vector<std::pair<std::string, std::string>> runtime_report() {
  const std::string cuda = torch::cuda::is_available()
                               ? std::to_string(torch::cuda::device_count()) + " CUDA device(s)"
                               : std::string("no CUDA device");
  return {{"LibTorch", std::string(TORCH_VERSION) + ", " + cuda + ", " +
                           std::to_string(at::get_num_threads()) + " intra-op thread(s)"},
          {"tasks", config::join(tasks::task_names())}};
}

}  // namespace winnow::train
