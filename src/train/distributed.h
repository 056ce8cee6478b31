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
// computing the gradients of earlier layers (DistributedDataParallel's scheme). The parameters
// are packed into flat buffers of at most `bucket_bytes` (the first one smaller, so that
// communication starts early): at first in reverse order of registration, and from the second
// step on in the order their gradients arrived in the first (rank 0's order, so that every
// rank has the same buckets). A hook on each parameter notes its gradient's arrival; when a
// bucket's gradients are all in, one concatenation writes them into its buffer (from .grad,
// where autograd has put them, and the arriving one from the hook) and its all-reduce starts,
// buckets always in the same order on every rank. The hooks keep no reference to a gradient:
// autograd would then copy it into .grad instead of taking it. The buffers live until the next
// rebuild, so a CUDA graph captured after it replays into the same memory. Parameters that
// do not train are left out.
class GradientBuckets {
 public:
  GradientBuckets(Collective& collective, const std::vector<torch::Tensor>& params, std::int64_t bucket_bytes);
  ~GradientBuckets();
  GradientBuckets(const GradientBuckets&) = delete;
  GradientBuckets& operator=(const GradientBuckets&) = delete;

  // The next backward pass (a step's last micro-batch; earlier ones accumulate as usual) feeds
  // the buckets. `report`: scalars (the step's loss and auxiliary losses) to travel in the last
  // bucket, after the gradients, rather than in an all-reduce of their own; finish() writes
  // their sums back into them. Returns false when they cannot (a dtype other than the last
  // bucket's, or no bucket): the caller sums them itself.
  bool arm(const std::vector<torch::Tensor>& report = {});
  // After that backward pass: starts the buckets still waiting (parameters that got no
  // gradient add zeros), waits for all of them, and points every gradient that was computed at
  // its summed slice. A parameter that got no gradient keeps none (every rank runs the same
  // model, so none got one). After the first call the buckets are rebuilt in arrival order.
  void finish();
  std::size_t buckets() const { return buckets_.size(); }
  // The trainable parameters in bucket order, as indices among them (in the order given).
  std::vector<std::size_t> order() const;

 private:
  struct Slot {
    std::size_t param = 0;  // index into params_
    std::size_t bucket = 0;
    std::int64_t offset = 0;
    bool filled = false;  // its gradient arrived in this pass
  };
  struct Bucket {
    torch::Tensor flat;
    std::vector<std::size_t> slots;
    std::size_t waiting = 0;
    Collective::Pending pending;
  };
  void build(const std::vector<std::size_t>& order);
  void on_gradient(std::size_t param, const torch::Tensor& grad);
  // Starts the buckets that are complete, in order; `arriving` is the gradient of `param` that
  // a hook holds right now (not in .grad yet), or undefined.
  void start_ready(std::size_t param = 0, const torch::Tensor& arriving = {});
  torch::Tensor slice(const Slot& s) const;

  Collective& collective_;
  std::int64_t bucket_bytes_;
  std::vector<torch::Tensor> report_;  // armed with the last bucket
  std::int64_t report_offset_ = 0;     // where they sit in its buffer, after the gradients
  std::int64_t report_room_ = 0;       // how many the last bucket has room for
  std::vector<torch::Tensor> params_;  // the trainable ones
  std::vector<unsigned> hooks_;        // by param
  std::vector<std::size_t> slot_of_;   // by param
  std::vector<Slot> slots_;
  std::vector<Bucket> buckets_;
  std::vector<std::size_t> arrivals_;  // params in the order the first armed pass gave them
  bool rebuilt_ = false;
  std::size_t next_to_start_ = 0;
  bool armed_ = false;
};

}  // namespace winnow::train
