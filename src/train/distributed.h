// Data parallelism for the trainer (issue 18) through LibTorch's c10d process groups: which
// rank this process is, the collective that sums over the ranks (NCCL between GPUs, gloo on
// the CPU), and the gradient buckets that start summing while the backward pass still runs.
// A world of one needs none of it.
#pragma once

#include <torch/torch.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

namespace winnow::train {

struct WorldInfo {
  int rank = 0, world = 1, local_rank = 0;
  bool distributed() const { return world > 1; }
};

// From torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK); a world of one when WORLD_SIZE is
// unset. Errors name the variable that is malformed or inconsistent.
WorldInfo world_from_environment();

// Which c10d process groups this build's LibTorch has.
bool gloo_available();
bool nccl_available();
// "nccl, gloo", "gloo", ... or "none": for `winnow info` and error messages.
std::string collective_backends();

// One process group over the ranks: NCCL when `device` is a GPU and the build has it, else
// gloo. The ranks meet through a file store when WINNOW_STORE_FILE names a file they share,
// else through a TCP store at MASTER_ADDR:MASTER_PORT (torchrun's variables; rank 0 serves it).
// The constructor runs one collective, so that NCCL's communicator exists before any CUDA graph
// capture.
class Collective {
 public:
  // The process's one group, made at the first call and kept to the end of the process (as
  // torch.distributed's default group is): the trainings of a study share it, where a group
  // per training would open a new store on the same port while the last one may still be up.
  // Later calls must name the same world and device.
  static Collective& of_process(const WorldInfo& info, torch::Device device);

  Collective(const WorldInfo& info, torch::Device device);
  ~Collective();
  Collective(const Collective&) = delete;
  Collective& operator=(const Collective&) = delete;

  int rank() const { return info_.rank; }
  int world() const { return info_.world; }
  const std::string& backend() const { return backend_; }
  // NCCL's collectives are ordered on the device's streams (and can be captured in a CUDA
  // graph); gloo's return to the host.
  bool stream_ordered() const { return backend_ == "nccl"; }

  // A sum in flight: wait() makes the caller's stream (NCCL) or the caller (gloo) wait for it.
  class Pending {
   public:
    Pending() = default;
    void wait();
    bool started() const { return static_cast<bool>(wait_); }

   private:
    friend class Collective;
    std::function<void()> wait_;
  };
  // Starts summing one contiguous tensor over the ranks, in place.
  Pending start_sum(torch::Tensor t);
  // Sums every tensor over the ranks, in place, and waits: the float32 tensors travel as one
  // flat buffer (one all-reduce per call), others one by one.
  void sum(const std::vector<torch::Tensor>& tensors);
  // Returns when every rank has called it.
  void barrier();

 private:
  struct Group;
  WorldInfo info_;
  torch::Device device_;
  std::string backend_;
  std::unique_ptr<Group> group_;
};

// Sums a model's gradients over the ranks in buckets, started while the backward pass is still
// computing the gradients of earlier layers (DistributedDataParallel's scheme): the parameters
// are packed in reverse order of registration (roughly the order backward reaches them) into
// flat buffers of at most `bucket_bytes` (the first one smaller, so communication starts
// early); a hook on each parameter copies its gradient into its bucket, and a bucket whose
// gradients are all in starts its all-reduce, buckets always in the same order on every rank.
// The buffers live as long as this object, so a captured CUDA graph replays into the same
// memory. Parameters that do not train are left out.
class GradientBuckets {
 public:
  GradientBuckets(Collective& collective, const std::vector<torch::Tensor>& params, std::int64_t bucket_bytes);
  ~GradientBuckets();
  GradientBuckets(const GradientBuckets&) = delete;
  GradientBuckets& operator=(const GradientBuckets&) = delete;

  // The next backward pass (a step's last micro-batch; earlier ones accumulate as usual) feeds
  // the buckets.
  void arm();
  // After that backward pass: starts the buckets still waiting (parameters that got no
  // gradient add zeros), waits for all of them, and points every gradient that was computed at
  // its summed slice. A parameter no rank computed a gradient for keeps none.
  void finish();
  std::size_t buckets() const { return buckets_.size(); }

 private:
  struct Slot {
    torch::Tensor param;
    std::size_t bucket = 0;
    std::int64_t offset = 0;
    bool filled = false;
  };
  struct Bucket {
    torch::Tensor flat;
    std::vector<std::size_t> slots;
    std::size_t waiting = 0;
    Collective::Pending pending;
  };
  void on_gradient(std::size_t slot, const torch::Tensor& grad);
  void start_ready();
  torch::Tensor slice(const Slot& s) const;

  Collective& collective_;
  std::vector<Slot> slots_;
  std::vector<Bucket> buckets_;
  std::vector<unsigned> hooks_;
  std::size_t next_to_start_ = 0;
  bool armed_ = false;
};

}  // namespace winnow::train
