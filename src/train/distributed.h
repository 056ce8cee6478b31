// Data parallelism for the trainer (issue 18) through LibTorch's c10d process groups: which
// rank this process is, and the collective that sums each step's gradients over the ranks.
// A world of one needs none of it.
#pragma once

#include <torch/torch.h>

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

// Whether this build's LibTorch has the gloo process group (c10d with gloo).
bool gloo_available();

// One process group over the ranks (gloo). The ranks meet through a file store when
// WINNOW_STORE_FILE names a file they share, else through a TCP store at MASTER_ADDR:MASTER_PORT
// (torchrun's variables; rank 0 serves it).
class Collective {
 public:
  explicit Collective(const WorldInfo& info);
  ~Collective();
  Collective(const Collective&) = delete;
  Collective& operator=(const Collective&) = delete;

  int rank() const { return info_.rank; }
  int world() const { return info_.world; }
  // Sums every tensor over the ranks, in place: the float32 tensors travel as one flat buffer
  // (one all-reduce per call), others one by one.
  void sum(const std::vector<torch::Tensor>& tensors);
  // Returns when every rank has called it.
  void barrier();

 private:
  struct Group;
  WorldInfo info_;
  std::unique_ptr<Group> group_;
};

}  // namespace winnow::train
