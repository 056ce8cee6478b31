// The training loop. AdamW (LibTorch's) with parameter groups by learning-rate multiplier and
// weight decay; linear warmup then a constant, cosine or warmup-stable-decay schedule; gradient
// accumulation and optional clipping; bf16 autocast on CUDA and float32 on the CPU; phases that
// change which parameters train and how auxiliary losses weigh; batches that are a pure function
// of (seed, step), so a resumed run replays an uninterrupted one exactly; atomic checkpoints; a
// JSON-lines metrics log; a progress line; periodic evaluation with hooks.
#pragma once

#include <c10/core/Event.h>
#include <torch/torch.h>

#include <array>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <nlohmann/json.hpp>
#include <string>
#include <utility>
#include <vector>

#include "nn/language_model.h"
#include "tasks/task.h"
#include "train/config.h"
#include "train/distributed.h"
#include "winnow/error.h"

namespace winnow::train {

// The device a configuration's `device` names ("auto": the first GPU when LibTorch sees one);
// errors name the key. needs_winnow_cuda: the model calls winnow's operators there.
torch::Device pick_device(const std::string& name, bool needs_winnow_cuda);

// The learning-rate factor (of train.lr) for the optimizer step `step` (counted from 0): linear
// warmup over train.warmup steps, then the schedule over the remaining steps.
double lr_factor(const TrainConfig& c, std::int64_t step);

// Thrown when a step's loss or gradient norm is not finite.
class TrainingDiverged : public Error {
 public:
  TrainingDiverged(std::int64_t step, const std::string& message)
      : Error(ErrorKind::runtime, message), step_(step) {}
  std::int64_t step() const { return step_; }

 private:
  std::int64_t step_;
};

struct StepStats {
  std::int64_t step = 0;  // the step just taken, counted from 1
  double loss = 0;        // the main (cross-entropy) loss
  std::map<std::string, double> aux;  // unweighted auxiliary losses
  double grad_norm = 0;   // before clipping
  double lr = 0;          // the base learning rate used (before group multipliers)
  std::string phase;
};

// What 001 and 003 watch for training stability. A loss spike is a step whose loss exceeds
// (1 + threshold) times the running mean of the steps before it (an exponential mean with a
// horizon of kHorizon steps, bias-corrected); steps within the first kHorizon are not judged.
// max_loss_ratio is the largest loss / running mean seen, the threshold-free form. The maximum
// activation is the largest |value| of the residual stream after any block, measured on a fixed
// held-out batch at every log step and evaluation.
struct TrainingHealth {
  static constexpr std::int64_t kHorizon = 50;
  double mean = 0;              // unnormalized exponential mean of the losses seen
  std::int64_t seen = 0;        // steps observed (the last one is step `seen`)
  std::int64_t spikes = 0;
  std::int64_t last_spike_step = 0;  // 0: none
  double max_loss_ratio = 0;
  double max_activation = 0;    // largest over the measurements so far

  // Takes step `step`'s loss; returns whether it spiked. Steps at or before the last observed
  // are ignored (a report may be read twice).
  bool observe(std::int64_t step, double loss, double threshold);
  nlohmann::json to_json() const;
  static TrainingHealth from_json(const nlohmann::json& j);
};

// Where a training step's time goes. While one is attached (Trainer::profile), step() waits
// for the device at the end of each phase and adds the wall time since the phase began to it,
// so the phases add up to a synchronized step (slower than a free-running one by the overlap
// of host and device that the waits remove). Each phase is also a user scope
// ("winnow.step.<phase>") for LibTorch's profiler, which can then assign kernels to phases.
struct StepProfile {
  std::vector<std::pair<std::string, double>> seconds;  // per phase, in the order first seen
  std::int64_t steps = 0;
  void add(const std::string& phase, double s);
};

// The optimizer step is winnow's clipped AdamW (winnow/adamw.h; three kernels on CUDA) over the
// parameters of `optimizer` that have gradients: torch::optim::AdamW's update after clipping the
// gradients to max_norm (<= 0: no clip), kept in its state (moments, and step counts through
// device_steps, so checkpoints read the same). group_lrs: one float32 scalar per group on the
// parameters' device, read by the kernel (what a CUDA graph replays). A step whose gradient norm
// or one of the guards (0-dim float32) is not finite changes nothing. Returns the norm before
// the clip. device_adamw_available: whether this build has the kernels for `device`.
bool device_adamw_available(const torch::Device& device);
torch::Tensor device_adamw_step(torch::optim::AdamW& optimizer, std::map<const void*, torch::Tensor>& device_steps,
                                const std::vector<torch::Tensor>& group_lrs, double max_norm,
                                const std::vector<torch::Tensor>& guards = {});
// Creates p's AdamW state (zero moments, step 0) and device step count where missing; returns
// the state.
torch::optim::AdamWParamState& ensure_adamw_state(torch::optim::AdamW& optimizer,
                                                  std::map<const void*, torch::Tensor>& device_steps,
                                                  const torch::Tensor& p);
// Copies the device step counts into the optimizer's state (before a checkpoint).
void sync_optimizer_steps(torch::optim::AdamW& optimizer,
                          const std::map<const void*, torch::Tensor>& device_steps);

class Trainer {
 public:
  explicit Trainer(const ExperimentConfig& config);
  ~Trainer();
  Trainer(Trainer&&) noexcept;
  Trainer& operator=(Trainer&&) noexcept;

  // Continues from <out_dir>/checkpoints/latest; returns false when there is none. A checkpoint
  // written under a different model, task, seed or optimization setting is refused with the
  // first key that differs.
  bool resume();
  // Deletes <out_dir>'s checkpoints and metrics log: the CLI's --fresh.
  void clear_outputs();

  // Trains until `until_step` (default: train.steps), logging, evaluating and checkpointing as
  // configured; evaluates and saves a checkpoint at the end. Returns the last evaluation.
  nlohmann::json train(std::int64_t until_step = -1);
  // Why this run's steps are not captured as a CUDA graph (train.cuda_graph), or "" when they
  // are, after kEagerStepsBeforeCapture ordinary steps in each phase.
  std::string graph_blocker() const;
  static constexpr std::int64_t kEagerStepsBeforeCapture = 3;
  // Whether the last step replayed (or captured) a CUDA graph.
  bool graph_active() const { return graph_ != nullptr; }

  // One optimizer step, without logging or checkpointing; waits for the device to report the
  // step's loss and gradient norm (and throws if either is not finite).
  StepStats step();
  // The same step without waiting: on CUDA the host goes on to the next step while the device
  // works. Its report lands in pinned memory and is checked for divergence two steps later, or
  // at wait_for_steps(), save() and evaluate(), whichever comes first.
  void enqueue_step();
  // Waits for every enqueued step, checks each report, and returns the last step's statistics.
  StepStats wait_for_steps();
  // Mean loss and accuracy over train.eval_batches held-out batches, plus the eval hooks' keys.
  nlohmann::json evaluate();
  std::string save();

  std::int64_t current_step() const { return step_; }
  const TrainingHealth& health() const { return health_; }
  // The largest |activation| of the residual stream, by block, on the first held-out batch
  // (and folded into health().max_activation).
  std::vector<double> measure_activations();
  nn::LanguageModel& model() { return model_; }
  torch::optim::AdamW& optimizer() { return *optimizer_; }
  const ExperimentConfig& config() const { return config_; }
  torch::Device device() const { return device_; }
  std::int64_t tokens_per_step() const { return config_.train.batch_size * config_.train.seq_len; }
  // Data parallelism (torchrun's environment): this process's rank among world() processes.
  // Each takes a contiguous slice of every step's batch; gradients are summed over the ranks in
  // buckets started from the backward pass (GradientBuckets), the step's report in the last one,
  // all before clipping, so every rank takes the same update. Over NCCL the sums run on the device
  // and the whole step, all-reduces included, is captured as one CUDA graph. Only rank 0 writes
  // checkpoints and metrics and prints progress.
  const WorldInfo& world() const { return world_; }

  // Extension points.
  // Named auxiliary losses computed from a micro-batch and its logits, added to the model's
  // own (layers report theirs through AttentionLayer::add_aux_loss); weighted by
  // train.aux_loss_weights and the phase's weights.
  using AuxLossFn =
      std::function<torch::Tensor(Trainer&, const tasks::Batch&, const torch::Tensor& logits)>;
  std::vector<std::pair<std::string, AuxLossFn>> aux_loss_fns;
  // Run before every step (after the phase for the step is set).
  std::vector<std::function<void(Trainer&, std::int64_t step)>> step_hooks;
  // Add keys to every evaluation.
  std::vector<std::function<nlohmann::json(Trainer&)>> eval_hooks;
  bool quiet = false;  // no progress lines on stdout
  StepProfile* profile = nullptr;  // see StepProfile; nullptr: free-running steps

 private:
  void enter_phase(std::size_t index);
  std::size_t phase_index(std::int64_t step) const;
  double aux_weight(const std::string& name) const;
  void check_aux_names(const std::map<std::string, torch::Tensor>& produced);
  void log(const nlohmann::json& record);
  // A step's report: loss, gradient norm and auxiliary losses, in flight to the host.
  struct PendingReport {
    StepStats stats;  // all but the numbers the device reports
    std::vector<std::string> aux_names;
    // On the host, filled when `landed` is; on CUDA pinned, and float32 but for float64 models.
    torch::Tensor values;
    std::shared_ptr<c10::Event> landed;  // recorded after the copy; null on the CPU
  };
  StepStats resolve(PendingReport& report);
  struct PinnedSlot {
    tasks::Batch batch;
    torch::Tensor packed;  // a replayed step's inputs in one buffer (pack_batch), this rank's rows
    std::shared_ptr<c10::Event> read;  // recorded after the step that copied from it
  };
  // The step's batch drawn on the host, in pageable memory.
  tasks::Batch training_batch(std::int64_t step) const;
  // On CUDA, `batch` copied into the next of a few pinned buffers allocated once per run, so
  // that its copy to the device is asynchronous (a pageable copy would wait for the device to
  // drain the work queued before it). Drawing and pinning each batch on another thread cost
  // about 10 ms a step on the H100, more than the step. A buffer is reused only after the
  // step that read it has landed.
  PinnedSlot& stage_pinned(const tasks::Batch& batch);
  void set_lr_tensors(double lr);
  // Forward and backward over the micro-batches, the gradient clipping and the update
  // (device_adamw_step, which reads lr_tensors_: set them first); returns the report
  // (loss, gradient norm, auxiliary losses named in aux_names) as a float64 device vector.
  torch::Tensor step_body(const tasks::Batch& batch, const torch::Tensor& counted,
                          std::vector<std::string>& aux_names);
  struct GraphState;
  void capture_and_replay(const tasks::Batch& batch, double counted, double lr);
  c10::Stream capture_stream();  // a side stream from LibTorch's pool, kept for the run
  std::optional<c10::Stream> capture_stream_;

  ExperimentConfig config_;
  WorldInfo world_;
  Collective* collective_ = nullptr;  // the process's group (Collective::of_process)
  torch::Device device_;
  bool autocast_ = false;
  nn::LanguageModel model_;
  // Data-parallel runs: the current phase's gradient buckets (after model_: its hooks go first).
  std::unique_ptr<GradientBuckets> gradient_buckets_;
  std::unique_ptr<tasks::Task> task_;
  std::unique_ptr<torch::optim::AdamW> optimizer_;
  std::vector<double> group_multipliers_;
  std::int64_t step_ = 0;
  std::size_t phase_ = static_cast<std::size_t>(-1);  // none entered yet
  std::set<std::size_t> aux_checked_;                  // phases whose aux names were checked
  std::string metrics_path_;
  std::deque<PendingReport> pending_;
  // On CUDA the next step's batch, drawn and staged in pinned memory right after this step
  // is enqueued, while the device runs it.
  PinnedSlot* next_batch_ = nullptr;  // in pinned_slots_
  std::int64_t next_batch_step_ = -1;
  std::array<PinnedSlot, 3> pinned_slots_;
  std::size_t next_pinned_slot_ = 0;
  // The optimizer's step counts as tensors on the parameters' device, for device_adamw_step (kept equal to
  // the counts in the optimizer's state, which checkpoints hold).
  std::map<const void*, torch::Tensor> device_steps_;
  std::vector<torch::Tensor> lr_tensors_;  // per parameter group, float32 on the device
  std::unique_ptr<GraphState> graph_;
  TrainingHealth health_;
  std::int64_t eager_steps_in_phase_ = 0;
};

}  // namespace winnow::train
