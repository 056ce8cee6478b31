// Multiscreen's screening unit (spec/screening.md; seed 001). Queries, keys and values are
// unit-normalized inside the operator; MiPE rotates the first two coordinates of queries and
// keys by an angle proportional to their absolute position; a key is accepted only where the
// similarity clears 1 - r (Trim), weighed by a causal cosine window of width w (Softmask), and
// the accepted values are summed without normalization, then squashed by TanhNorm:
//   w = exp(s_w) + 1, r = sigmoid(s_r),
//   R_ij = max(1 - (1 - <qm_i, km_j>) / r, 0)^2 * 0.5 (cos(pi (j - i) / w) + 1)   (i - w < j <= i)
//   u_i = TanhNorm(sum_j R_ij vn_j)
// A query whose keys are all rejected outputs exactly zero. Keys outside a head's window are
// never visited, so a head costs O(L min(L, w)).
#pragma once

#include "winnow/attention.h"

namespace winnow::screening {

struct Options {
  double mipe_threshold = 256.0;  // w_th: MiPE fades out as w approaches it, identity beyond
  // Screening-window expansion (001 appendix M): when > 0, a head whose window is wider than
  // this (the training context, say) sees every visible key with Softmask 1 and no MiPE, and
  // its s_w gets no gradient. 0: off.
  double expand_windows_above = 0.0;
  double norm_eps = 1e-6;  // q / max(|q|, eps), and the same for keys and values
};

// The learned scalars: (Hq) (one per query head) or (1) (one for every head), float32 (float64
// for float64 inputs), on q's device.
struct Scalars {
  TensorView s_w;  // window: w = exp(s_w) + 1
  TensorView s_r;  // acceptance width: r = sigmoid(s_r)
};

struct Outputs {
  TensorView out;     // like q with v's head dimension
  TensorView h_norm;  // per row, |h_i| before TanhNorm (statistics dtype); the backward reads it
};

struct ScalarGrads {
  TensorView ds_w;  // shaped like s_w (a (1) tensor gets the sum over every head)
  TensorView ds_r;
};

void forward(const AttentionInputs& in, const Scalars& scalars, const Options& options,
             const Outputs& outputs, const ExecContext& ctx = {});

// Gradients of sum(dout * out) with respect to q, k, v, s_w and s_r; `saved` holds what forward
// wrote.
void backward(const AttentionInputs& in, const Scalars& scalars, const Options& options,
              const Outputs& saved, const TensorView& dout, const AttentionGrads& grads,
              const ScalarGrads& scalar_grads, const ExecContext& ctx = {});

}  // namespace winnow::screening
