// The plain structs every attention kernel family receives. They hold raw pointers, sizes
// and strides only: the API layer validates the caller's TensorViews and fills them, and
// kernels (CPU or CUDA) never see a TensorView, a framework tensor or an option that was
// left unresolved.
#pragma once

#include <cstdint>

#include "math/gsa.h"
#include "math/host_device.h"
#include "winnow/attention.h"
#include "winnow/tensor.h"

namespace winnow::detail {

// Element (sequence b, row r, head h, feature d) lives at
//   data + b * batch + (row_start_b + r) * row + h * head + d * dim
// where row_start_b is 0 for batched inputs and cu_seqlens[b] for packed ones (whose batch
// stride is 0). Per-row statistics use the same scheme with dim unused.
struct Operand {
  void* data = nullptr;
  std::int64_t batch = 0, row = 0, head = 0, dim = 0;

  template <class T>
  WINNOW_HD T* at(std::int64_t b, std::int64_t abs_row, std::int64_t h) const {
    return static_cast<T*>(data) + b * batch + abs_row * row + h * head;
  }
  // Whether sequences of len rows lie end to end, so that (b, r) is also (0, b len + r); an
  // absent operand does.
  WINNOW_HD bool sequences_end_to_end(std::int64_t len) const { return data == nullptr || batch == len * row; }
};

// Rows of one sequence: queries occupy the last q_len of its k_len positions.
struct SequenceExtent {
  std::int64_t q_start = 0, q_len = 0;  // rows of q / out / stats
  std::int64_t k_start = 0, k_len = 0;  // rows of k / v
  // Absolute position of query row r is r + q_offset.
  WINNOW_HD std::int64_t q_offset() const { return k_len - q_len; }
};

struct AttentionParams {
  DType dtype = DType::float32;  // of q, k, v, out (and of the gradients)
  std::int64_t num_seqs = 0, heads_q = 0, heads_kv = 0, dim_qk = 0, dim_v = 0;
  std::int64_t len_q = 0, len_k = 0;    // batched mode
  std::int64_t rows_q = 0, rows_k = 0;  // rows of q and k over all sequences (B L or T)
  // Packed mode when non-null: B + 1 offsets, readable by the device that runs the kernel.
  const std::int32_t* cu_seqlens_q = nullptr;
  const std::int32_t* cu_seqlens_k = nullptr;
  std::int64_t max_len_q = 0, max_len_k = 0;

  Operand q, k, v, out;
  Operand stats;  // float32, or float64 for float64 inputs

  double scale = 1.0;
  bool attend_current = true;
  // > 0: the batch's sequences were laid end to end as one (num_seqs 1, len_q == len_k), in
  // segments of this many rows that each see only their own keys: the CUDA kernels' packing
  // of short sequences (launch_attention.cuh, packed_short_sequences). 0 elsewhere.
  std::int64_t segment_len = 0;

  int num_threads = 0;
  bool deterministic = false;
  // CUDA kernels of query tiles (cuda/attention/geometry.cuh): query heads whose tiles interleave
  // in the grid's order. Set by the launchers (launch_attention.cuh); 1 elsewhere.
  int heads_per_sweep = 1;
  void* cuda_stream = nullptr;
  DeviceAllocator* allocator = nullptr;  // temporary device buffers (launchers only)

  WINNOW_HD SequenceExtent sequence(std::int64_t b) const {
    SequenceExtent s;
    if (cu_seqlens_q != nullptr) {
      s.q_start = cu_seqlens_q[b];
      s.q_len = cu_seqlens_q[b + 1] - cu_seqlens_q[b];
      s.k_start = cu_seqlens_k[b];
      s.k_len = cu_seqlens_k[b + 1] - cu_seqlens_k[b];
    } else {
      s.q_len = len_q;
      s.k_len = len_k;
    }
    return s;
  }
  // The most keys a sequence can have, as the shapes tell: L_k batched, T_k packed.
  WINNOW_HD std::int64_t key_len_bound() const { return cu_seqlens_k != nullptr ? rows_k : len_k; }
  // An operand row of sequence b (q_start + r or k_start + r; the starts are 0 in batched mode)
  // as a row over the whole batch: the index that per-row buffers laid out [row][head] use.
  WINNOW_HD std::int64_t batch_row_q(std::int64_t b, std::int64_t row) const {
    return (cu_seqlens_q != nullptr ? 0 : b * len_q) + row;
  }
  WINNOW_HD std::int64_t batch_row_k(std::int64_t b, std::int64_t row) const {
    return (cu_seqlens_k != nullptr ? 0 : b * len_k) + row;
  }
  WINNOW_HD std::int64_t kv_head(std::int64_t hq) const { return hq / (heads_q / heads_kv); }
  WINNOW_HD std::int64_t group_size() const { return heads_q / heads_kv; }
  // Last key index visible to the query at absolute position j (-1: none).
  WINNOW_HD std::int64_t last_visible_key(std::int64_t j) const {
    return attend_current ? j : j - 1;
  }
  // First key index visible to the query at absolute position j: its segment's first.
  WINNOW_HD std::int64_t first_visible_key(std::int64_t j) const {
    return segment_len > 0 ? j - j % segment_len : 0;
  }
};

// Backward-only operands: the incoming gradients and the outputs' gradients.
struct GradientParams {
  Operand dout;
  Operand dstats;  // gradient of the per-row statistic; data == nullptr means zero
  Operand dq, dk, dv;
  // Softmax's Hopper backward: dq and dk stored rotated back by these RoPE tables (float32,
  // (Lk, D/2), rows at stride rotary_row, columns contiguous; a row's or key's position in its
  // sequence picks the table row). nullptr: stored as computed.
  const float* rotary_cos = nullptr;
  const float* rotary_sin = nullptr;
  std::int64_t rotary_row = 0;
};

struct StickBreakingConfig {
  double halt_cutoff = 0.0;  // 0: never halt
  Operand kept_from;         // int32 per row; forward writes it, backward reads it (when halting)
};

// alpha-entmax (spec/entmax.md). The per-row statistic is tau.
struct EntmaxConfig {
  double alpha = 1.5;
  double tolerance = 1e-5;  // |sum p - 1| at which the threshold search stops
  // The support record (winnow/entmax.h), contiguous int32 on the inputs' device, or null.
  std::int32_t* support = nullptr;
};

// Sieve (spec/sieve.md). The per-row statistic is log_rem, as in stick-breaking; the filter's
// threshold (score units) is written by the forward and read by the backward.
struct SieveConfig {
  double alpha = 1.5;
  bool bound = false;  // true: threshold = row max - eps; false: the entmax threshold
  double eps = 2.0;
  double tolerance = 1e-5;
  Operand threshold;  // float32 / float64 per row
  Operand count;      // int32 per row; written when data != nullptr
};

// Threshold attention (spec/threshold.md). One view: TRA; two (lambda.data != nullptr): TDA.
// beta, lambda, dbeta and dlambda hold one value per query head at stride `head` (0: one value
// for every head; the backward then adds every head's gradient into it).
struct ThresholdConfig {
  double power = 2.0;
  double norm_eps = 1e-6;
  bool clamp_lambda = true;
  Operand beta, lambda;
  Operand q2, k2;  // TDA's second view, laid out like q and k
  Operand nonzero;  // int32 per query row, written when data != nullptr (forward only)
  // The saved rows (winnow/threshold.h; CUDA only): the forward writes them, the backward reads
  // them instead of normalizing, where data != nullptr.
  void* saved_rows = nullptr;
  // Backward only.
  Operand dbeta, dlambda, dq2, dk2;
  WINNOW_HD bool differential() const { return lambda.data != nullptr; }
  // beta and lambda of query head h, stored as T.
  template <class T>
  WINNOW_HD T beta_at(std::int64_t h) const {
    return static_cast<const T*>(beta.data)[h * beta.head];
  }
  template <class T>
  WINNOW_HD T lambda_at(std::int64_t h) const {
    return static_cast<const T*>(lambda.data)[h * lambda.head];
  }
};

// Multiscreen's screening (spec/screening.md). s_w and s_r (and their gradients) hold one value
// per query head at stride `head` (0: one for every head; the backward then adds every head's
// gradient into it). The per-row statistic (AttentionParams::stats) is |h_i|, the norm TanhNorm
// saw: the forward writes it, the backward reads it with the output.
// The CUDA kernels hold a row of each head dimension per thread.
inline constexpr std::int64_t kMaxScreeningCudaDim = 256;
struct ScreeningConfig {
  double mipe_threshold = 256.0;  // w_th
  double expand_above = 0.0;      // > 0: windows wider than this are infinite (SWE)
  double norm_eps = 1e-6;
  Operand s_w, s_r;
  Operand ds_w, ds_r;  // backward only
  template <class T>
  WINNOW_HD T s_w_at(std::int64_t h) const {
    return static_cast<const T*>(s_w.data)[h * s_w.head];
  }
  template <class T>
  WINNOW_HD T s_r_at(std::int64_t h) const {
    return static_cast<const T*>(s_r.data)[h * s_r.head];
  }
};

// GSA's indexer with selection (spec/gsa.md). AttentionParams carries the indexer's queries
// (q: H_I heads of d_I) and its single key head (k), the sequences and the scale; the per-row
// statistic (stats) is the row's score variance over its visible keys. `weights` holds the
// heads' pre-activation weights per query row and head, in q's dtype; `bias` one value per head
// at stride `head` (sigmoid form; absent: zero). `indices` (int32, the k_max slots of a row at stride `head`)
// gets the selected keys' positions in their sequence in increasing order, -1 after `counts`.
struct IndexerConfig {
  math::gsa::ScoreForm form = math::gsa::ScoreForm::sigmoid;
  math::gsa::BudgetParams budget;
  Operand weights, bias;
  Operand indices, counts;
  // b_j; a missing bias (data == nullptr) is zero.
  template <class T>
  WINNOW_HD T bias_at(std::int64_t h) const {
    return bias.data == nullptr ? T(0) : static_cast<const T*>(bias.data)[h * bias.head];
  }
};

// GSA's sparse attention: each query row's key list (positions in its sequence, increasing),
// shared by the row's heads; the per-row statistic (AttentionParams::stats) is the
// log-sum-exp over the list.
struct KeyListConfig {
  Operand indices, counts;  // int32; indices' k_max slots of a row at stride `head`
  std::int64_t k_max = 0;
};

// GSA's indexer loss (winnow/gsa.h, indexer_loss_*). The kernels' AttentionParams carries the
// indexer (q: H_I heads of d_I, k: its one key head, the sequences, the indexer's scale, the
// per-row KL in `stats`); `attention` the layer's queries and keys over the same sequences with
// their scale (its stats, out and v unused). Without lists (indices.data == nullptr) a row's
// set is every visible key. `lse` holds a row's H + 1 log-sum-exps at stride `head`: the
// attention heads', then the indexer's. Backward only: dloss per row, and the gradients,
// float32 (float64 for float64 inputs), dk and dbias zeroed by the kernels before they add.
struct IndexerLossConfig {
  math::gsa::ScoreForm form = math::gsa::ScoreForm::sigmoid;
  AttentionParams attention;
  Operand weights, bias;
  Operand indices, counts;
  std::int64_t k_max = 0;
  Operand lse;
  Operand dloss, dq, dk, dweights, dbias;
  WINNOW_HD bool has_lists() const { return indices.data != nullptr; }
  template <class T>
  WINNOW_HD T bias_at(std::int64_t h) const {
    return bias.data == nullptr ? T(0) : static_cast<const T*>(bias.data)[h * bias.head];
  }
};

}  // namespace winnow::detail
