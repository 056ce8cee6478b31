#include "winnow/gsa.h"

#include <cmath>
#include <string>

#include "api/attention_call.h"
#include "api/view_checks.h"
#include "core/device_copy.h"
#include "cpu/cpu.h"
#include "cuda/cuda.h"
#include "reference/reference.h"

namespace winnow::gsa {

using detail::AttentionCall;
using detail::Route;

void select_keys(const IndexerInputs& in, const IndexerOptions& options, const Selection& out,
                 const ExecContext& ctx) {
  // The indexer's single key head doubles as v: AttentionCall checks a value operand, and the
  // indexer reads none.
  const AttentionInputs attention{in.q, in.k, in.k, in.cu_seqlens_q, in.cu_seqlens_k};
  AttentionCall call("winnow::gsa::select_keys", attention, ctx);
  call.check_scale(options.scale);
  detail::AttentionParams p = call.params(options.scale, /*attend_current=*/true);
  if (p.heads_kv != 1) call.fail("k", "one key head shared by the indexer's heads", std::to_string(p.heads_kv) + " heads");

  const std::string k_max = std::to_string(options.k_max);
  call.check_option("k_max", options.k_max >= 1, "an integer >= 1", k_max);
  if (options.budget == Budget::fixed) {
    call.check_option("k", options.k >= 1, "an integer >= 1 (the fixed budget)", std::to_string(options.k));
  } else {
    call.check_option("k_min", options.k_min >= 1 && options.k_min <= options.k_max,
                      "an integer in [1, k_max = " + k_max + "]", std::to_string(options.k_min));
    call.check_option("k_base", options.k_base >= 1, "an integer >= 1", std::to_string(options.k_base));
    call.check_option("mean_variance", std::isfinite(options.mean_variance) && options.mean_variance > 0,
                      "a finite number > 0", std::to_string(options.mean_variance));
  }

  detail::IndexerConfig c;
  c.form = options.form == ScoreForm::relu ? math::gsa::ScoreForm::relu : math::gsa::ScoreForm::sigmoid;
  c.budget.rule = options.budget == Budget::fixed              ? math::gsa::Budget::fixed
                  : options.budget == Budget::inverse_variance ? math::gsa::Budget::inverse_variance
                  : options.budget == Budget::eq8              ? math::gsa::Budget::eq8
                                                               : math::gsa::Budget::reference;
  c.budget.k = options.k;
  c.budget.k_base = options.k_base;
  c.budget.k_min = options.budget == Budget::fixed ? 1 : options.k_min;
  c.budget.k_max = options.k_max;
  c.budget.mean_variance = options.mean_variance;

  c.weights = call.row_stats("head_weights", in.head_weights, p.dtype);
  if (in.bias) {
    if (c.form == math::gsa::ScoreForm::relu) call.fail("bias", "absent for the relu score form", "a tensor");
    c.bias = call.per_head("bias", *in.bias);
  }
  c.indices = call.per_query_row("indices", out.indices, DType::int32, options.k_max);
  c.counts = call.per_query_row("counts", out.counts, DType::int32);
  p.stats = call.per_query_row("variance", out.variance, call.stats_dtype());
  for (const auto& [name, view] : {std::pair<const char*, const TensorView*>{"indices", &out.indices},
                                   {"counts", &out.counts}, {"variance", &out.variance}}) {
    call.require_writable(name, *view);
  }
  switch (call.route()) {
    case Route::reference: return reference::gsa_select_keys(p, c);
    case Route::cpu: return cpu::gsa_select_keys(p, c);
    case Route::cuda: return cuda::gsa_select_keys(p, c);
  }
}

namespace {

// One row's list against its visible keys [0, t]; `entry(i)` reads slot i wherever it lives.
template <class Entry>
void check_list(const AttentionCall& call, std::int64_t k_max, std::int64_t b, std::int64_t r, std::int64_t t,
                std::int32_t n, Entry&& entry) {
  const std::string where = "sequence " + std::to_string(b) + ", query row " + std::to_string(r);
  if (n < 0 || n > k_max) {
    call.fail("counts", "values in [0, k_max = " + std::to_string(k_max) + "]", std::to_string(n) + " at " + where);
  }
  std::int64_t previous = -1;
  for (std::int32_t i = 0; i < n; ++i) {
    const std::int32_t key = entry(i);
    if (key <= previous || key > t) {
      call.fail("indices", "strictly increasing positions in [0, " + std::to_string(t) + "] at " + where,
                std::to_string(key) + " in slot " + std::to_string(i));
    }
    previous = key;
  }
}

// The lists as the kernels take them, every entry checked first unless trusted: an index out
// of its row's visible range would read outside the keys. CUDA lists are checked on the device;
// the host then reads back the first bad row alone, to name what is wrong with it.
detail::KeyListConfig checked_lists(const AttentionCall& call, const detail::AttentionParams& p,
                                    const KeyLists& lists) {
  const TensorView& idx = lists.indices;
  detail::KeyListConfig c;
  c.k_max = idx.ndim >= 1 ? idx.shape[idx.ndim - 1] : 0;
  if (c.k_max < 1) call.fail("indices", "a trailing dimension of k_max >= 1 slots", idx.shape_string());
  c.indices = call.per_query_row("indices", idx, DType::int32, c.k_max);
  c.counts = call.per_query_row("counts", lists.counts, DType::int32);
  if (lists.trusted) return c;
  if (idx.device.kind == DeviceKind::cpu) {
    for (std::int64_t b = 0; b < p.num_seqs; ++b) {
      const detail::SequenceExtent s = p.sequence(b);
      for (std::int64_t r = 0; r < s.q_len; ++r) {
        const std::int64_t row = s.q_start + r;
        check_list(call, c.k_max, b, r, r + s.q_offset(), *c.counts.at<const std::int32_t>(b, row, 0),
                   [&](std::int32_t i) { return *c.indices.at<const std::int32_t>(b, row, i); });
      }
    }
    return c;
  }
  const std::int64_t first = cuda::gsa_first_bad_list(p, c);
  if (first < 0) return c;
  const std::int64_t b = first >> 32, r = first & 0xffffffff;
  auto read = [&](const void* at) {
    std::int32_t x = 0;
    detail::copy_to_host(&x, at, sizeof x, idx.device, p.cuda_stream);
    return x;
  };
  std::int64_t q_start = 0, t = r + p.len_k - p.len_q;
  if (p.cu_seqlens_q != nullptr) {
    q_start = read(p.cu_seqlens_q + b);
    t = r + (read(p.cu_seqlens_k + b + 1) - read(p.cu_seqlens_k + b)) - (read(p.cu_seqlens_q + b + 1) - q_start);
  }
  const std::int64_t row = q_start + r;
  check_list(call, c.k_max, b, r, t, read(c.counts.at<const std::int32_t>(b, row, 0)),
             [&](std::int32_t i) { return read(c.indices.at<const std::int32_t>(b, row, i)); });
  call.fail("indices", "well-formed lists", "a list the device check refused (sequence " + std::to_string(b) +
                                                ", query row " + std::to_string(r) + ")");
}

}  // namespace

void sparse_forward(const AttentionInputs& in, const KeyLists& lists, std::optional<double> scale,
                    const SparseOutputs& out, const ExecContext& ctx) {
  AttentionCall call("winnow::gsa::sparse_forward", in, ctx);
  call.check_scale(scale);
  detail::AttentionParams p = call.params(scale, /*attend_current=*/true);
  p.out = call.like_q("out", out.out, /*value_dim=*/true);
  p.stats = call.row_stats("lse", out.lse);
  call.require_writable("out", out.out);
  call.require_writable("lse", out.lse);
  const detail::KeyListConfig c = checked_lists(call, p, lists);
  switch (call.route()) {
    case Route::reference: return reference::gsa_sparse_forward(p, c);
    case Route::cpu: return cpu::gsa_sparse_forward(p, c);
    case Route::cuda: return cuda::gsa_sparse_forward(p, c);
  }
}

void sparse_backward(const AttentionInputs& in, const KeyLists& lists, std::optional<double> scale,
                     const SparseOutputs& saved, const TensorView& dout, const AttentionGrads& grads,
                     const ExecContext& ctx) {
  AttentionCall call("winnow::gsa::sparse_backward", in, ctx);
  call.check_scale(scale);
  detail::AttentionParams p = call.params(scale, /*attend_current=*/true);
  p.out = call.like_q("out", saved.out, /*value_dim=*/true);
  p.stats = call.row_stats("lse", saved.lse);
  const detail::GradientParams g = call.gradients(dout, grads);
  const detail::KeyListConfig c = checked_lists(call, p, lists);
  switch (call.route()) {
    case Route::reference: return reference::gsa_sparse_backward(p, g, c);
    case Route::cpu: return cpu::gsa_sparse_backward(p, g, c);
    case Route::cuda: return cuda::gsa_sparse_backward(p, g, c);
  }
}

}  // namespace winnow::gsa

namespace winnow::gsa {
namespace {

// Both halves of the indexer loss checked and bound: the indexer's operands (the call that
// routes, and whose params the kernels take) and the attention's q and k over the indexer's
// sequences (its cu_seqlens serve both).
struct IndexerLossBinding {
  // First: the calls keep a pointer to their op's name.
  std::string op_indexer, op_attention;
  AttentionInputs indexer_inputs, attention_inputs;  // the calls keep a reference to these
  AttentionCall indexer;
  detail::AttentionParams p;
  detail::IndexerLossConfig c;

  IndexerLossBinding(const std::string& op, const IndexerLossInputs& in, const IndexerLossOptions& options,
                     const IndexerLossOutputs& saved, const ExecContext& ctx)
      : op_indexer(op + " (indexer operands)"),
        op_attention(op + " (attention operands)"),
        indexer_inputs{in.indexer.q, in.indexer.k, in.indexer.k, in.indexer.cu_seqlens_q, in.indexer.cu_seqlens_k},
        attention_inputs{in.q, in.k, in.k, in.indexer.cu_seqlens_q, in.indexer.cu_seqlens_k},
        indexer(op_indexer.c_str(), indexer_inputs, ctx) {
    indexer.check_scale(options.scale);
    p = indexer.params(options.scale, /*attend_current=*/true);
    if (p.heads_kv != 1) {
      indexer.fail("k", "one key head shared by the indexer's heads", std::to_string(p.heads_kv) + " heads");
    }
    AttentionCall attention(op_attention.c_str(), attention_inputs, ctx);
    attention.check_scale(options.attention_scale);
    c.attention = attention.params(options.attention_scale, /*attend_current=*/true);
    const detail::AttentionParams& a = c.attention;
    if (in.q.dtype != in.indexer.q.dtype) {
      attention.fail("q", std::string(to_string(in.indexer.q.dtype)) + " like the indexer's q", api::describe(in.q));
    }
    if (in.q.device != in.indexer.q.device) {
      attention.fail("q", "on " + to_string(in.indexer.q.device) + " like the indexer's q", api::describe(in.q));
    }
    if (a.num_seqs != p.num_seqs || a.len_q != p.len_q || a.len_k != p.len_k || a.rows_q != p.rows_q ||
        a.rows_k != p.rows_k) {
      attention.fail("q", "the indexer's sequences (" + std::to_string(p.num_seqs) + " of " +
                              std::to_string(p.len_q) + " queries over " + std::to_string(p.len_k) + " keys)",
                     api::describe(in.q) + " with k " + api::describe(in.k));
    }
    c.form = options.form == ScoreForm::relu ? math::gsa::ScoreForm::relu : math::gsa::ScoreForm::sigmoid;
    c.weights = indexer.row_stats("head_weights", in.indexer.head_weights, p.dtype);
    if (in.indexer.bias) {
      if (c.form == math::gsa::ScoreForm::relu) indexer.fail("bias", "absent for the relu score form", "a tensor");
      c.bias = indexer.per_head("bias", *in.indexer.bias);
    }
    if (in.lists) {
      const detail::KeyListConfig lists = checked_lists(indexer, p, *in.lists);
      c.indices = lists.indices;
      c.counts = lists.counts;
      c.k_max = lists.k_max;
    }
    p.stats = indexer.per_query_row("loss", saved.loss, indexer.stats_dtype());
    c.lse = indexer.per_query_row("lse", saved.lse, indexer.stats_dtype(), a.heads_q + 1);
  }
};

}  // namespace

void indexer_loss_forward(const IndexerLossInputs& in, const IndexerLossOptions& options,
                          const IndexerLossOutputs& out, const ExecContext& ctx) {
  IndexerLossBinding bound("winnow::gsa::indexer_loss_forward", in, options, out, ctx);
  bound.indexer.require_writable("loss", out.loss);
  bound.indexer.require_writable("lse", out.lse);
  switch (bound.indexer.route()) {
    case Route::reference: return reference::gsa_indexer_loss_forward(bound.p, bound.c);
    case Route::cpu: return cpu::gsa_indexer_loss_forward(bound.p, bound.c);
    case Route::cuda: return cuda::gsa_indexer_loss_forward(bound.p, bound.c);
  }
}

void indexer_loss_backward(const IndexerLossInputs& in, const IndexerLossOptions& options,
                           const IndexerLossOutputs& saved, const TensorView& dloss,
                           const IndexerLossGrads& grads, const ExecContext& ctx) {
  IndexerLossBinding bound("winnow::gsa::indexer_loss_backward", in, options, saved, ctx);
  AttentionCall& call = bound.indexer;
  detail::IndexerLossConfig& c = bound.c;
  const DType stats = call.stats_dtype();
  c.dloss = call.per_query_row("dloss", dloss, stats);
  c.dq = call.like_q("dq", grads.dq, false, stats);
  c.dk = call.like_k("dk", grads.dk, false, stats);
  c.dweights = call.row_stats("dhead_weights", grads.dhead_weights, stats);
  if (grads.dbias) {
    if (!in.indexer.bias) call.fail("dbias", "absent when there is no bias", "a tensor");
    c.dbias = call.per_head_grad("dbias", *grads.dbias, "bias", *in.indexer.bias);
  }
  call.require_writable("dq", grads.dq);
  call.require_writable("dk", grads.dk);
  call.require_writable("dhead_weights", grads.dhead_weights);
  switch (call.route()) {
    case Route::reference: return reference::gsa_indexer_loss_backward(bound.p, c);
    case Route::cpu: return cpu::gsa_indexer_loss_backward(bound.p, c);
    case Route::cuda: return cuda::gsa_indexer_loss_backward(bound.p, c);
  }
}

}  // namespace winnow::gsa
