// AdamW over many float32 tensors with their gradients clipped by the global norm, as one call:
// the optimizer step of winnow's trainer. A framework's multi-tensor update spends about twenty
// small kernels a step on the norm, the clip, the test for a non-finite step and the step
// counts; on CUDA this is three kernels (squared sums per chunk, one block that turns them into
// the norm, the clip factor and the skip flag, and the update), each spread over the whole GPU.
//
//   norm  = || all gradients ||_2,   scale = min(1, max_norm / (norm + 1e-6))   (1 if max_norm <= 0)
//   skip  = norm or one of the guards is not finite
//
// When skip, only `norm` is written. Otherwise every tensor, with g = scale * grad and its step
// count t = step + 1 (written back to step):
//
//   p <- p - lr wd p,   m <- b1 m + (1 - b1) g,   v <- b2 v + (1 - b2) g^2,
//   p <- p - lr / (1 - b1^t) * m / (sqrt(v) / sqrt(1 - b2^t) + eps)
//
// torch.optim.AdamW's update after torch.nn.utils.clip_grad_norm_. The gradients are only read.
#pragma once

#include <vector>

#include "winnow/attention.h"

namespace winnow::adamw {

// Tensors that share a learning rate and a weight decay.
struct Group {
  // A 0-dim float32 tensor on the parameters' device, read when the update runs, so that a
  // captured CUDA graph takes each replay's value.
  TensorView lr;
  double weight_decay = 0;
  // One entry per parameter, all float32 and contiguous; grads, exp_avgs and exp_avg_sqs of
  // their parameter's shape; steps 0-dim (the count of steps taken so far).
  std::vector<TensorView> params, grads, exp_avgs, exp_avg_sqs, steps;
};

struct Options {
  double beta1 = 0.9, beta2 = 0.999, eps = 1e-8;
  double max_norm = 0;  // the clip; <= 0: none
};

// groups: at most 8, every tensor on one device. guards: at most 4 0-dim float32 values whose being
// non-finite also skips the step (the loss). norm: a 0-dim float32 output. The norm's sum runs
// in a fixed order: the same inputs give the same bits.
void clipped_step(const std::vector<Group>& groups, const Options& options,
                  const std::vector<TensorView>& guards, const TensorView& norm,
                  const ExecContext& ctx = {});

}  // namespace winnow::adamw
