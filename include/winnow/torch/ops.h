// The differentiable operators for C++ callers on LibTorch (the model layer, applications):
// the same torch.ops.winnow.* operators Python calls, reached through the dispatcher.
#pragma once

#include <ATen/ATen.h>

#include <string>
#include <tuple>
#include <vector>

#include "winnow/gsa.h"
#include "winnow/torch/bridge.h"

namespace winnow::torch_ops {

struct AttentionCall {
  Opt<at::Tensor> cu_seqlens_q, cu_seqlens_k;
  Opt<double> scale;
  bool attend_current = true;
  // Rotary embedding applied inside the operator (softmax_attention): (Lk, D/2) tables as
  // rotary_embedding takes them (float32; float64 for float64 inputs), the keys at positions
  // 0 .. Lk - 1 and the queries at the last Lq; not with cu_seqlens. Queries and keys are
  // rotated in one launch when they are heads of one buffer, and the gradients of q, k and v
  // come back side by side in one buffer when q, k and v are.
  Opt<at::Tensor> rotary_cos, rotary_sin;
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
// On CUDA with gradients wanted, the forward keeps each row's support keys for the backward
// (winnow/entmax.h's support record; WINNOW_ENTMAX_KEEP_SUPPORT=0 turns it off).
at::Tensor entmax_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                            const AttentionCall& call, double alpha = 1.5);

// Sieve: returns (out, rem, count); rem (B, Lq, Hq) is the stick left over the candidates,
// count (int32, B, Lq, Hq) the number of candidates per row. filter is "exact" (the entmax
// support) or "bound" (keys within eps of the row maximum; eps defaults to 1 / (alpha - 1)).
std::tuple<at::Tensor, at::Tensor, at::Tensor> sieve_attention(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const AttentionCall& call,
    double alpha = 1.5, const std::string& filter = "exact", Opt<double> eps = Opt<double>());

// Threshold attention (winnow/threshold.h): TRA, or TDA when views.lam is given (with q2 and k2,
// TDA's second query/key view). beta and lam are (Hq) or (1) tensors with gradients; queries
// and keys are normalized inside (call.scale is ignored: the scores are cosines).
struct ThresholdViews {
  Opt<at::Tensor> lam, q2, k2;
};
struct ThresholdOptions {
  double power = 2.0;
  bool clamp_lambda = true;
  double norm_eps = 1e-6;
};
at::Tensor threshold_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                               const at::Tensor& beta, const AttentionCall& call,
                               const ThresholdViews& views = {},
                               const ThresholdOptions& options = {});

// Multiscreen's screening unit (winnow/screening.h): s_w and s_r are (Hq) or (1) tensors with
// gradients (window w = exp(s_w) + 1, acceptance width r = sigmoid(s_r)); queries, keys and values
// are normalized inside (call.scale and call.attend_current are ignored: scores are cosines and
// every query sees itself).
struct ScreeningOptions {
  double mipe_threshold = 256.0;
  double expand_windows_above = 0.0;  // > 0: windows wider than this become infinite (SWE)
  double norm_eps = 1e-6;
};
at::Tensor screening_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                               const at::Tensor& s_w, const at::Tensor& s_r, const AttentionCall& call,
                               const ScreeningOptions& options = {});

// Gated Sparse Attention (winnow/gsa.h). The indexer with exact top-k selection: q (B, Lq, H_I,
// d_I) or packed (Tq, H_I, d_I), k with one head, head_weights (B, Lq, H_I) or (Tq, H_I), bias
// (H_I) or (1) (sigmoid form only). Returns (indices, counts, variance): int32 (B, Lq, k_max)
// positions in increasing order, -1 padded; int32 (B, Lq) list lengths min(k_t, t + 1); the
// row variance of the scores (float32, float64 for float64 inputs). No gradient: every output
// is non-differentiable. options.k is the fixed budget (the operator's k_fixed).
std::tuple<at::Tensor, at::Tensor, at::Tensor> gsa_select_keys(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& head_weights,
    const Opt<at::Tensor>& bias, const gsa::IndexerOptions& options,
    const Opt<at::Tensor>& cu_seqlens_q = Opt<at::Tensor>(),
    const Opt<at::Tensor>& cu_seqlens_k = Opt<at::Tensor>());

// Softmax attention of each query over its token's key list (indices, counts as gsa_select_keys
// returns them; one list per token shared by its heads): (B, Lq, Hq, Dv), differentiable in q,
// k and v (keys in no list get zero gradient). The lists are checked before the forward unless
// `trusted` (lists straight from gsa_select_keys); the backward reuses the forward's lists
// without checking them again. call.attend_current is ignored (lists decide what is seen).
at::Tensor gsa_sparse_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                const at::Tensor& indices, const at::Tensor& counts,
                                const AttentionCall& call, bool trusted = false);

// GSA's indexer loss (winnow/gsa.h, indexer_loss_*): per query row, KL(p_t || softmax_s(I_ts))
// over the row's list (indices and counts as gsa_select_keys returns them) or, without lists,
// every visible key; p_t the mean over attention_q's heads of softmax(<attention_q, attention_k>
// * attention_scale). The indexer's operands as gsa_select_keys takes them. Returns (B, Lq) or
// (Tq) in float32 (float64 for float64 inputs), differentiable in q, k, head_weights and bias;
// the attention's q and k get no gradient.
at::Tensor gsa_indexer_loss(const at::Tensor& q, const at::Tensor& k, const at::Tensor& head_weights,
                            const Opt<at::Tensor>& bias, const at::Tensor& attention_q,
                            const at::Tensor& attention_k, const Opt<at::Tensor>& indices = Opt<at::Tensor>(),
                            const Opt<at::Tensor>& counts = Opt<at::Tensor>(),
                            const gsa::IndexerLossOptions& options = {},
                            const Opt<at::Tensor>& cu_seqlens_q = Opt<at::Tensor>(),
                            const Opt<at::Tensor>& cu_seqlens_k = Opt<at::Tensor>());

// Rotary position embedding of x (B, L, H, D) by tables cos and sin (L, D/2) (winnow/rotary.h):
// one kernel forward and one backward (the transposed rotation); gradients reach x only.
at::Tensor rotary_embedding(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin,
                            bool transpose = false);

// RMSNorm over x's last dimension with weight (C) (winnow/rms_norm.h), one kernel each way;
// y in out_dtype (default: x's), e.g. a float32 residual stream normalized straight into bf16.
// Gradients reach x and weight.
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps = 1e-6,
                    Opt<at::ScalarType> out_dtype = Opt<at::ScalarType>());

// The residual form: (sum, y) with sum = x + residual and y = rms_norm(sum), one kernel each way
// (a transformer's residual add and the next norm). residual in y's dtype (out_dtype, default
// x's); sum in x's dtype. The backward adds the gradient reaching sum and casts it for residual.
std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& residual,
                                                const at::Tensor& weight, double eps = 1e-6,
                                                Opt<at::ScalarType> out_dtype = Opt<at::ScalarType>());

// SwiGLU's gate silu(gate) * up (winnow/swiglu.h), one kernel each way; gate and up of one
// shape and dtype. Gradients reach both.
at::Tensor swiglu(const at::Tensor& gate, const at::Tensor& up);

// The masked sum of token cross-entropies, sum_n mask_n (logsumexp(logits_n) - logits_n[targets_n])
// (winnow/cross_entropy.h), with autograd (gradients reach logits only): logits (..., V) in any
// float dtype, targets (...) int64, mask (...) float32 (float64 for float64 logits); returns a
// 0-dim float32 (float64). Two kernels forward, one backward. divisor (one value in the mask's
// dtype, on the logits' device) divides the result inside the kernels: a mean over positions
// counted elsewhere without two more launches; it gets a gradient too when it needs one. A C++
// helper for training loops (winnow's trainer), not a registered operator.
at::Tensor masked_cross_entropy_sum(const at::Tensor& logits, const at::Tensor& targets, const at::Tensor& mask,
                                    const at::Tensor& divisor = {});

// The sources converted to `dtype` side by side in one new 1-D tensor (winnow/cast.h): one
// launch for any number of sources of one dtype on one device (float32 / float64 on the CPU,
// every float dtype on CUDA). No autograd: the low-precision copies of weights whose gradients
// the caller routes itself (nn::project).
at::Tensor cast_concatenate(at::TensorList sources, at::ScalarType dtype);

// AdamW with the gradients clipped by their global norm (winnow/adamw.h) over float32 tensors:
// three kernels on CUDA for any number of groups and parameters. Parameters, moments and step
// counts (0-dim float32 tensors) are updated in place; the gradients are only read. Not an
// autograd operator: an optimizer step for C++ training loops (winnow's trainer).
struct AdamWGroup {
  at::Tensor lr;  // 0-dim float32 on the parameters' device, read when the update runs
  double weight_decay = 0;
  std::vector<at::Tensor> params, grads, exp_avgs, exp_avg_sqs, steps;
};
// Returns the gradients' norm before the clip (0-dim float32). A step whose norm or one of the
// guards (0-dim float32, e.g. the loss) is not finite changes nothing.
at::Tensor clipped_adamw_step(const std::vector<AdamWGroup>& groups, double beta1, double beta2, double eps,
                              double max_norm, const std::vector<at::Tensor>& guards = {});

}  // namespace winnow::torch_ops
