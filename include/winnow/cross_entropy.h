// The training loss of a language model as one kernel each way: the masked sum of token
// cross-entropies
//   loss = sum_n mask_n (lse_n - x_{n, t_n}),   lse_n = log sum_v exp(x_nv),
// and its gradient
//   dx_nv = dloss mask_n (exp(x_nv - lse_n) - [v = t_n]).
// A composed expression (float32 copy, log_softmax, gather, product, sum, and as many backward
// kernels) spends a dozen launches a step on it. Rows with mask 0 contribute nothing (whatever
// their logits and targets); a row with a nonzero mask whose target lies outside [0, V) makes
// the loss NaN on CUDA (the device cannot raise) and is an error on the CPU. The loss is summed
// in a fixed order: the same inputs give the same bits. A divisor, when given, divides the loss
// (and so the gradient): a mean over positions counted elsewhere, such as every rank's batch,
// without two more launches.
#pragma once

#include <optional>

#include "winnow/attention.h"

namespace winnow::cross_entropy {

// logits: (N, V), float16 / bfloat16 / float32 / float64 on CUDA, float32 / float64 on the CPU,
// unit column stride, any row stride. targets: (N) int64, any stride. mask: (N) in the
// statistics dtype (float32; float64 for float64 logits), any stride. loss: one value and lse:
// (N) contiguous, both in the statistics dtype, written (lse is what the backward reads).
// divisor: one value in the statistics dtype on the logits' device, read on the device (a captured
// graph takes each replay's value); the loss written is the sum divided by it.
void masked_sum_forward(const TensorView& logits, const TensorView& targets, const TensorView& mask,
                        const TensorView& loss, const TensorView& lse,
                        const std::optional<TensorView>& divisor = std::nullopt, const ExecContext& ctx = {});

// dloss: one value in the statistics dtype (read on the device: a captured graph takes each
// replay's value). dlogits: like logits (dtype and shape, unit column stride), written, apart
// from every input. divisor: the forward's, if it had one (dloss is the divided loss's gradient).
void masked_sum_backward(const TensorView& dloss, const TensorView& logits, const TensorView& targets,
                         const TensorView& mask, const TensorView& lse, const TensorView& dlogits,
                         const std::optional<TensorView>& divisor = std::nullopt, const ExecContext& ctx = {});

}  // namespace winnow::cross_entropy
