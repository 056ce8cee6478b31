// Threshold attention (spec/threshold.md; seed 004). Queries and keys are L2-normalized inside
// the operator, so scores are cosine similarities, and a row keeps the keys that clear a
// length-dependent threshold:
//   s_ij = <q_j / |q_j|, k_i / |k_i|>,   tau_j = beta * sqrt(2 log(n_j) / D),
//   w_ij = relu(s_ij - tau_j)^p,          o_j = sum_i w_ij v_i       (TRA)
// with n_j the keys query j sees. TDA adds a second query/key view on the same values and
// subtracts it: o_j = TRA(q, k, v)_j - lambda TRA(q2, k2, v)_j. ReLA is TRA with beta = 0 and
// p = 1 (on cosine scores); differential ReLA is TDA with beta = 0 and p = 1. The weights are
// not normalized (004 follows the head output with an RMSNorm, at the module level), and are
// exactly zero wherever s_ij <= tau_j.
#pragma once

#include <optional>

#include "winnow/attention.h"

namespace winnow::threshold {

struct Options {
  double power = 2.0;          // p > 0 (004's best: 2)
  bool attend_current = true;  // query j sees key j
  // TDA: lambda enters as min(max(lambda, 0), 1), as in 004's kernel; its gradient passes
  // where 0 <= lambda <= 1. false: lambda as given.
  bool clamp_lambda = true;
  double norm_eps = 1e-6;      // q / max(|q|, eps), and the same for keys
};

// The learnable scalars, and TDA's second view. beta and lambda are (Hq) (one per query head)
// or (1) (one for the layer), float32 (float64 for float64 inputs), on q's device.
struct Views {
  TensorView beta;
  std::optional<TensorView> lambda;  // present: TDA (then q2 and k2 are required)
  std::optional<TensorView> q2;      // like q
  std::optional<TensorView> k2;      // like k
};

// The saved rows: what the CUDA forward normalized, kept so that its backward need not
// normalize q and k (and q2, k2) again (for TDA at B L = 16384, H 12, D 128, about 0.1 ms of
// the 0.2 ms its backward spends outside its main kernels), and where its weights can be
// nonzero, so that the backward visits only those tiles. An int32 vector of saved_rows_size()
// elements on q's device, opaque to the caller: per view the normalized queries and keys in the
// input dtype, then their inverse norms, then the support map (one bit per 64 query rows and
// 128 keys: see saved_support_words), each segment starting on a 256-byte boundary. Memory: per
// view as much as q and k, plus 8 bytes per row and head; the map about rows x keys / 8192 bits
// per query head. Only the CUDA route keeps and reads saved rows; elsewhere they are an error.
template <class Int>
Int saved_rows_segment_bytes(Int bytes) {
  return (bytes + Int(255)) / Int(256) * Int(256);
}
// The support map's int32 words: a flag (nonzero once a forward recorded the map), padded to 256
// bytes, then per query head and row tile a row of ceil(ceil(key_len / 128) / 32) words, a bit a
// cell of 128 keys. Row tile: 64 rows of a sequence, numbered b + floor(first / 64) + r / 64 for
// row r of sequence b whose first row is `first` among all query rows, so that the tiles of every
// layout fit in num_seqs + ceil(query_rows / 64). num_seqs: the batch, or cu_seqlens' length - 1;
// query_rows: B Lq, or T; key_len: Lk for batched inputs, the key rows T_k for packed ones.
template <class Int>
Int saved_support_row_tiles(Int num_seqs, Int query_rows) {
  return num_seqs + (query_rows + Int(63)) / Int(64);
}
template <class Int>
Int saved_support_row_words(Int key_len) {
  return ((key_len + Int(127)) / Int(128) + Int(31)) / Int(32);
}
template <class Int>
Int saved_support_words(Int num_seqs, Int heads_q, Int query_rows, Int key_len) {
  const Int bytes = heads_q * saved_support_row_tiles<Int>(num_seqs, query_rows) * saved_support_row_words<Int>(key_len) *
                    Int(4);
  return Int(64) + saved_rows_segment_bytes<Int>(bytes) / Int(4);
}
// query_row_heads, key_row_heads: all of q's and k's dimensions but the last, multiplied; dim:
// the head dimension of q and k; views: 2 for TDA, else 1; support_words: saved_support_words.
template <class Int>
Int saved_rows_size(Int query_row_heads, Int key_row_heads, Int dim, Int element_bytes, Int views,
                    Int support_words) {
  const Int per_view = saved_rows_segment_bytes<Int>(query_row_heads * dim * element_bytes) +
                       saved_rows_segment_bytes<Int>(key_row_heads * dim * element_bytes) +
                       saved_rows_segment_bytes<Int>(query_row_heads * Int(4)) +
                       saved_rows_segment_bytes<Int>(key_row_heads * Int(4));
  return views * per_view / Int(4) + support_words;
}

struct Outputs {
  TensorView out;  // like q with v's head dimension; zero for a row that sees no key
  // Optional, int32 per query row ((B, Lq, Hq) or (Tq, Hq)): the visible keys whose weight is
  // nonzero in some view (s_ij > tau_j). 1 - nonzero / n_j is the row's exact-zero fraction.
  std::optional<TensorView> nonzero;
  // Optional (CUDA only): the saved rows, written for a later backward of the same inputs.
  std::optional<TensorView> saved_rows;
};

// Gradients of beta, lambda and the second view; dbeta and dlambda are shaped like beta and
// lambda (a (1) tensor gets the sum over every head).
struct ViewGrads {
  TensorView dbeta;
  std::optional<TensorView> dlambda;  // TDA
  std::optional<TensorView> dq2;      // TDA, like q
  std::optional<TensorView> dk2;      // TDA, like k
};

void forward(const AttentionInputs& in, const Views& views, const Options& options,
             const Outputs& outputs, const ExecContext& ctx = {});

// Gradients of sum(dout * out) with respect to q, k, v, beta and (TDA) lambda, q2, k2. Nothing
// from the forward is needed: the weights are recomputed from the inputs. saved_rows (CUDA
// only): what a forward of the same inputs and options wrote to Outputs::saved_rows; the
// backward then reads the normalized rows from it instead of normalizing again, and skips the
// tiles of 64 rows and 128 keys where the forward found every weight zero.
void backward(const AttentionInputs& in, const Views& views, const Options& options,
              const TensorView& dout, const AttentionGrads& grads, const ViewGrads& view_grads,
              const ExecContext& ctx = {}, const std::optional<TensorView>& saved_rows = std::nullopt);

}  // namespace winnow::threshold
