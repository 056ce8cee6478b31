// The differentiable operators for C++ callers on LibTorch (the model layer, applications):
// the same torch.ops.winnow.* operators Python calls, reached through the dispatcher.
#pragma once

#include <ATen/ATen.h>

#include <string>
#include <tuple>

#include "winnow/torch/bridge.h"

namespace winnow::torch_ops {

struct AttentionCall {
  Opt<at::Tensor> cu_seqlens_q, cu_seqlens_k;
  Opt<double> scale;
  bool attend_current = true;
};

// (B, Lq, Hq, D), (B, Lk, Hkv, D), (B, Lk, Hkv, Dv) -> (B, Lq, Hq, Dv).
at::Tensor softmax_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                             const AttentionCall& call);

// Returns (out, rem); rem (B, Lq, Hq) is the unallocated stick.
std::tuple<at::Tensor, at::Tensor> stick_breaking_attention(const at::Tensor& q,
                                                            const at::Tensor& k,
                                                            const at::Tensor& v,
                                                            const AttentionCall& call,
                                                            double halt_cutoff = 0.0);

// alpha-entmax: (B, Lq, Hq, Dv); rows of exactly sparse weights (alpha > 1; 2 is sparsemax).
at::Tensor entmax_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                            const AttentionCall& call, double alpha = 1.5);

// Sieve: returns (out, rem, count); rem (B, Lq, Hq) is the stick left over the candidates,
// count (int32, B, Lq, Hq) the number of candidates per row. filter is "exact" (the entmax
// support) or "bound" (keys within eps of the row maximum; eps defaults to 1 / (alpha - 1)).
std::tuple<at::Tensor, at::Tensor, at::Tensor> sieve_attention(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const AttentionCall& call,
    double alpha = 1.5, const std::string& filter = "exact", Opt<double> eps = Opt<double>());

// Rotary position embedding of x (B, L, H, D) by tables cos and sin (L, D/2) (winnow/rotary.h):
// one kernel forward and one backward (the transposed rotation); gradients reach x only.
at::Tensor rotary_embedding(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin,
                            bool transpose = false);

}  // namespace winnow::torch_ops
