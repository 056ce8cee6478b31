// torch.ops.winnow.*: the LibTorch operators. One thin layer: tensors become views, outputs are
// allocated here, the C++ API checks every argument, and a torch::autograd::Function ties each
// mechanism's forward to its backward.
//
// Per mechanism there are three operators:
//   <name>            the differentiable one users call (registered under Autograd);
//   <name>_forward    one forward kernel call, returning the outputs and the per-row statistic;
//   <name>_backward   one backward kernel call.
// The last two take reference=True to run the float64 oracle instead: tests compare through
// the same binding.
#include <ATen/ATen.h>
#include <torch/autograd.h>
#include <torch/library.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/version.h>

#include <cstdlib>
#include <string>
#include <tuple>

#include "winnow/torch/bridge.h"
#include "winnow/torch/ops.h"

namespace winnow::torch_ops {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// "[4, 8]", or "None" for an undefined tensor. Shape messages are built here as plain strings:
// streaming IntArrayRef into TORCH_CHECK's variadic message crashed under torch 2.11 (a
// segmentation fault instead of the ValueError).
std::string shape_text(const at::Tensor& t) {
  if (!t.defined()) return "None";
  std::string out = "[";
  for (int64_t d = 0; d < t.dim(); ++d) out += (d ? ", " : "") + std::to_string(t.size(d));
  return out + "]";
}

// Throws ValueError with message() unless `ok`; the message is built only on failure.
template <class Message>
void check_value(bool ok, const Message& message) {
  if (!ok) TORCH_CHECK_VALUE(false, std::string(message()).c_str());
}

std::optional<double> std_opt(const Opt<double>& x) {
  return x.has_value() ? std::optional<double>(*x) : std::nullopt;
}

AttentionInputs inputs(const char* op, const at::Tensor& q, const at::Tensor& k,
                       const at::Tensor& v, const Opt<at::Tensor>& cu_q,
                       const Opt<at::Tensor>& cu_k) {
  AttentionInputs in;
  in.q = view_of(q, op, "q");
  in.k = view_of(k, op, "k");
  in.v = view_of(v, op, "v");
  in.cu_seqlens_q = view_of(cu_q, op, "cu_seqlens_q");
  in.cu_seqlens_k = view_of(cu_k, op, "cu_seqlens_k");
  return in;
}

// Outputs are allocated from q and v before the API checks them (it reports a wrong rank or
// shape itself); these never throw for defined tensors.
std::vector<int64_t> out_shape(const at::Tensor& q, const at::Tensor& v) {
  std::vector<int64_t> shape = q.sizes().vec();
  if (!shape.empty() && v.dim() > 0) shape.back() = v.size(-1);
  return shape;
}

std::vector<int64_t> stats_shape(const at::Tensor& q) {
  std::vector<int64_t> shape = q.sizes().vec();
  if (!shape.empty()) shape.pop_back();
  return shape;
}

AttentionGrads grad_views(const char* op, const at::Tensor& dq, const at::Tensor& dk,
                          const at::Tensor& dv) {
  return {view_of(dq, op, "dq"), view_of(dk, op, "dk"), view_of(dv, op, "dv")};
}

// ------------------------------------------------------------------ shared by the Functions

// What every autograd Function here saves after its own tensors: the varlen offsets (undefined
// when absent) through save_for_backward, so that torch.compile's tracing sees them as saved
// tensors, and the options as plain values.
void save_call(AutogradContext* ctx, variable_list tensors, const Opt<at::Tensor>& cu_q,
               const Opt<at::Tensor>& cu_k, Opt<double> scale, bool attend_current) {
  tensors.push_back(cu_q.has_value() ? *cu_q : at::Tensor());
  tensors.push_back(cu_k.has_value() ? *cu_k : at::Tensor());
  ctx->save_for_backward(tensors);
  ctx->saved_data["scale"] = scale.has_value() ? c10::IValue(*scale) : c10::IValue();
  ctx->saved_data["attend_current"] = attend_current;
}

struct SavedCall {
  variable_list tensors;  // the Function's own, in the order it saved them
  Opt<at::Tensor> cu_q, cu_k;
  Opt<double> scale;
  bool attend_current;
};
SavedCall saved_call(AutogradContext* ctx) {
  SavedCall c;
  c.tensors = ctx->get_saved_variables();
  const at::Tensor cu_k = c.tensors.back();
  c.tensors.pop_back();
  const at::Tensor cu_q = c.tensors.back();
  c.tensors.pop_back();
  if (cu_q.defined()) c.cu_q = cu_q;
  if (cu_k.defined()) c.cu_k = cu_k;
  if (!ctx->saved_data["scale"].isNone()) c.scale = ctx->saved_data["scale"].toDouble();
  c.attend_current = ctx->saved_data["attend_current"].toBool();
  return c;
}

// The registered operator `name` with the C++ signature of its kernel Fn. The autograd Functions
// and the inference paths call the forward and backward operators through these handles, not
// the kernels directly: the dispatcher then sends fake and meta tensors to the Meta kernels
// below, and torch.compile's tracing records the calls as operators of the graph.
template <class Fn>
c10::TypedOperatorHandle<Fn> operator_handle(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Fn>();
}

// A callable that runs Kernel's operator through the dispatcher.
template <auto Kernel>
struct Dispatched {
  const char* name;
  template <class... Args>
  auto operator()(Args&&... args) const {
    static const auto handle = operator_handle<std::remove_pointer_t<decltype(Kernel)>>(name);
    return handle.call(std::forward<Args>(args)...);
  }
};

// q, k and v split from one projection (nn::project) get their gradients as views of one
// buffer with the same layout, so that the projection's backward reads them without a
// concatenation. The forward notes the layout; the backward then writes straight into such
// a buffer (`into`, the kernels called directly), or else calls the backward operator
// (`separate`), which traced code always does: it sees no layout (heads_side_by_side).
// WINNOW_SEPARATE_ATTENTION_GRADS=1 always takes the operator (for A/B measurements).
void note_layout(AutogradContext* ctx, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
  static const bool separate = [] {
    const char* e = std::getenv("WINNOW_SEPARATE_ATTENTION_GRADS");
    return e != nullptr && std::string(e) == "1";
  }();
  ctx->saved_data["one_buffer"] = !separate && heads_side_by_side({q, k, v}).defined();
}

template <class Into, class Separate>
std::tuple<at::Tensor, at::Tensor, at::Tensor> attention_grads(AutogradContext* ctx, const at::Tensor& q,
                                                               const at::Tensor& k, const at::Tensor& v,
                                                               Into&& into, Separate&& separate) {
  if (!ctx->saved_data["one_buffer"].toBool()) return separate();
  auto grads = packed_grads(q, k, v);
  translate_errors([&] { into(std::get<0>(grads), std::get<1>(grads), std::get<2>(grads)); });
  return grads;
}

// ------------------------------------------------------------------ rotary embedding

at::Tensor rotary_apply_op(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin,
                           bool transpose) {
  constexpr const char* op = "winnow.rotary_embedding_apply";
  return translate_errors([&] {
    at::Tensor out = at::empty(x.sizes(), x.options().memory_format(at::MemoryFormat::Contiguous));
    const DeviceScope scope(x);
    rotary::apply(view_of(x, op, "x"), view_of(cos, op, "cos"), view_of(sin, op, "sin"), transpose,
                  view_of(out, op, "out"), scope.context(false, false));
    return out;
  });
}

constexpr Dispatched<&rotary_apply_op> rotary_apply{"winnow::rotary_embedding_apply"};

// Gradients flow to x only: the tables are functions of positions, not parameters.
struct RotaryFunction : public torch::autograd::Function<RotaryFunction> {
  static variable_list forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& cos,
                               const at::Tensor& sin, bool transpose) {
    ctx->save_for_backward({cos, sin});
    ctx->saved_data["transpose"] = transpose;
    return {rotary_apply(x, cos, sin, transpose)};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const bool transpose = ctx->saved_data["transpose"].toBool();
    at::Tensor dx;
    if (grads[0].defined()) dx = rotary_apply(grads[0], saved[0], saved[1], !transpose);
    return {dx, at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

at::Tensor rotary_embedding_autograd(const at::Tensor& x, const at::Tensor& cos,
                                     const at::Tensor& sin, bool transpose) {
  return RotaryFunction::apply(x, cos, sin, transpose)[0];
}

at::Tensor rotary_embedding_no_grad(const at::Tensor& x, const at::Tensor& cos,
                                    const at::Tensor& sin, bool transpose) {
  return rotary_apply(x, cos, sin, transpose);
}

// Rotary embedding inside an attention operator (its rotary_cos / rotary_sin arguments): the
// keys are positions 0 .. Lk - 1 and the queries the last Lq of them; q and k are rotated before
// the kernels and their gradients rotated back after. Packed sequences restart their positions
// per sequence, which (B, L) tables cannot say: not with cu_seqlens.
struct AttentionRotary {
  at::Tensor cos, sin;  // (Lk, D/2)
  explicit operator bool() const { return cos.defined(); }
};

AttentionRotary attention_rotary(const char* op, const at::Tensor& q, const at::Tensor& k,
                                 const Opt<at::Tensor>& cos, const Opt<at::Tensor>& sin,
                                 const Opt<at::Tensor>& cu_q, const Opt<at::Tensor>& cu_k) {
  const bool has_cos = cos.has_value() && cos->defined(), has_sin = sin.has_value() && sin->defined();
  check_value(has_cos == has_sin, [&] {
    return std::string(op) + ": argument 'rotary_sin': expected " + (has_cos ? "a tensor" : "None") +
           " as 'rotary_cos' is " + (has_cos ? "given" : "None") + ", got " + (has_sin ? "a tensor" : "None");
  });
  if (!has_cos) return {};
  check_value(!(cu_q.has_value() && cu_q->defined()) && !(cu_k.has_value() && cu_k->defined()), [&] {
    return std::string(op) +
           ": argument 'cu_seqlens_q': expected None with rotary tables (positions restart in each packed "
           "sequence), got a tensor";
  });
  check_value(q.dim() == 4 && k.dim() == 4 && q.sym_size(1) <= k.sym_size(1), [&] {
    return std::string(op) + ": argument 'q': expected (B, Lq, Hq, D) with Lq <= Lk = k's second size, got q " +
           shape_text(q) + " and k " + shape_text(k);
  });
  check_value(cos->dim() == 2 && cos->sym_size(0) == k.sym_size(1) && cos->sym_size(1) * 2 == q.sym_size(3), [&] {
    return std::string(op) + ": argument 'rotary_cos': expected (Lk, D/2) with Lk = " + std::to_string(k.size(1)) +
           " and D = " + std::to_string(q.size(3)) + ", got " + shape_text(*cos);
  });
  check_value(sin->sym_sizes() == cos->sym_sizes(), [&] {
    return std::string(op) + ": argument 'rotary_sin': expected the shape of 'rotary_cos', " + shape_text(*cos) +
           ", got " + shape_text(*sin);
  });
  return {*cos, *sin};
}

// The table rows of the queries: the last Lq.
at::Tensor query_rows(const at::Tensor& table, const at::Tensor& q) {
  if (table.sym_size(0) == q.sym_size(1)) return table;
#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 1)
  return table.narrow_symint(0, table.sym_size(0) - q.sym_size(1), q.sym_size(1));
#else
  return table.narrow(0, table.size(0) - q.size(1), q.size(1));
#endif
}

// q's and k's heads as one (B, L, Hq + Hkv, D) view, for heads that lie side by side in one
// buffer (heads_side_by_side) with one head dimension.
at::Tensor joined_heads(const at::Tensor& q, const at::Tensor& k) {
  return q.as_strided({q.size(0), q.size(1), q.size(2) + k.size(2), q.size(3)},
                      {q.stride(0), q.stride(1), q.size(3), 1}, q.storage_offset());
}

// q and k rotated (transpose: by the negative angles, the gradient's way), in one launch when
// their heads lie side by side in one buffer.
std::pair<at::Tensor, at::Tensor> rotate_queries_keys(const AttentionRotary& r, const at::Tensor& q,
                                                      const at::Tensor& k, bool transpose) {
  if (heads_side_by_side({q, k}).defined() && q.size(3) == k.size(3)) {
    const at::Tensor rotated = rotary_apply(joined_heads(q, k), r.cos, r.sin, transpose);
    return {rotated.narrow(2, 0, q.size(2)), rotated.narrow(2, q.size(2), k.size(2))};
  }
  return {rotary_apply(q, query_rows(r.cos, q), query_rows(r.sin, q), transpose),
          rotary_apply(k, r.cos, r.sin, transpose)};
}

// The operator's q and k as the kernels take them: rotated when it was given tables.
std::pair<at::Tensor, at::Tensor> kernel_queries_keys(const AttentionRotary& r, const at::Tensor& q,
                                                      const at::Tensor& k) {
  return r ? rotate_queries_keys(r, q, k, false) : std::make_pair(q, k);
}

// ------------------------------------------------------------------ softmax

std::tuple<at::Tensor, at::Tensor> softmax_forward_op(const at::Tensor& q, const at::Tensor& k,
                                                      const at::Tensor& v,
                                                      const Opt<at::Tensor>& cu_q,
                                                      const Opt<at::Tensor>& cu_k,
                                                      Opt<double> scale, bool attend_current,
                                                      bool reference) {
  constexpr const char* op = "winnow.softmax_attention_forward";
  return translate_errors([&] {
    const AttentionInputs in = inputs(op, q, k, v, cu_q, cu_k);
    at::Tensor out = at::empty(out_shape(q, v), q.options());
    at::Tensor lse = at::empty(stats_shape(q), q.options().dtype(stats_dtype(q)));
    softmax::Options options{std_opt(scale), attend_current};
    const DeviceScope scope(q);
    softmax::forward(in, options, {view_of(out, op, "out"), view_of(lse, op, "lse")},
                     scope.context(false, reference));
    return std::make_tuple(out, lse);
  });
}

// The backward into given gradient tensors: the operator below allocates them; the autograd
// Function may pass views of one buffer (packed_grads).
// With rotary tables, q and k are the rotated ones and dq, dk come back rotated back (on Hopper
// by the kernels as they store them; elsewhere by one more pass each).
void softmax_backward_into(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                           const at::Tensor& out, const at::Tensor& lse, const at::Tensor& dout,
                           const Opt<at::Tensor>& cu_q, const Opt<at::Tensor>& cu_k, Opt<double> scale,
                           bool attend_current, bool deterministic, bool reference, const at::Tensor& dq,
                           const at::Tensor& dk, const at::Tensor& dv, const AttentionRotary& rotary = {}) {
  constexpr const char* op = "winnow.softmax_attention_backward";
  const AttentionInputs in = inputs(op, q, k, v, cu_q, cu_k);
  softmax::Options options{std_opt(scale), attend_current};
  if (rotary) {
    options.rotary_cos = view_of(rotary.cos, op, "rotary_cos");
    options.rotary_sin = view_of(rotary.sin, op, "rotary_sin");
  }
  const DeviceScope scope(q);
  softmax::backward(in, options, {view_of(out, op, "out"), view_of(lse, op, "lse")},
                    view_of(dout, op, "dout"), grad_views(op, dq, dk, dv),
                    scope.context(deterministic, reference));
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> softmax_backward_op(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& out,
    const at::Tensor& lse, const at::Tensor& dout, const Opt<at::Tensor>& cu_q,
    const Opt<at::Tensor>& cu_k, Opt<double> scale, bool attend_current, bool deterministic,
    bool reference) {
  return translate_errors([&] {
    at::Tensor dq = at::empty_like(q), dk = at::empty_like(k), dv = at::empty_like(v);
    softmax_backward_into(q, k, v, out, lse, dout, cu_q, cu_k, scale, attend_current, deterministic,
                          reference, dq, dk, dv);
    return std::make_tuple(dq, dk, dv);
  });
}

constexpr Dispatched<&softmax_forward_op> softmax_forward{"winnow::softmax_attention_forward"};
constexpr Dispatched<&softmax_backward_op> softmax_backward{"winnow::softmax_attention_backward"};

struct SoftmaxFunction : public torch::autograd::Function<SoftmaxFunction> {
  static variable_list forward(AutogradContext* ctx, const at::Tensor& q, const at::Tensor& k,
                               const at::Tensor& v, const Opt<at::Tensor>& cu_q,
                               const Opt<at::Tensor>& cu_k, Opt<double> scale,
                               bool attend_current, const Opt<at::Tensor>& rotary_cos,
                               const Opt<at::Tensor>& rotary_sin) {
    const AttentionRotary rotary =
        attention_rotary("winnow.softmax_attention", q, k, rotary_cos, rotary_sin, cu_q, cu_k);
    const auto [qr, kr] = kernel_queries_keys(rotary, q, k);
    auto [out, lse] = softmax_forward(qr, kr, v, cu_q, cu_k, scale, attend_current, false);
    save_call(ctx, {qr, kr, v, out, lse, rotary.cos, rotary.sin}, cu_q, cu_k, scale, attend_current);
    note_layout(ctx, q, k, v);
    ctx->mark_non_differentiable({lse});
    return {out, lse};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const SavedCall c = saved_call(ctx);
    const variable_list& saved = c.tensors;
    const AttentionRotary rotary{saved[5], saved[6]};
    at::Tensor dout = grads[0].defined() ? grads[0] : at::zeros_like(saved[3]);
    const bool deterministic = at::globalContext().deterministicAlgorithms();
    auto [dq, dk, dv] = attention_grads(
        ctx, saved[0], saved[1], saved[2],
        [&](const at::Tensor& dq, const at::Tensor& dk, const at::Tensor& dv) {
          softmax_backward_into(saved[0], saved[1], saved[2], saved[3], saved[4], dout, c.cu_q, c.cu_k, c.scale,
                                c.attend_current, deterministic, false, dq, dk, dv, rotary);
        },
        [&] {
          auto g = softmax_backward(saved[0], saved[1], saved[2], saved[3], saved[4], dout, c.cu_q, c.cu_k, c.scale,
                                    c.attend_current, deterministic, false);
          if (rotary) std::tie(std::get<0>(g), std::get<1>(g)) = rotate_queries_keys(rotary, std::get<0>(g), std::get<1>(g), true);
          return g;
        });
    return {dq, dk, dv, at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

at::Tensor softmax_attention_autograd(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                      const Opt<at::Tensor>& cu_q, const Opt<at::Tensor>& cu_k,
                                      Opt<double> scale, bool attend_current, const Opt<at::Tensor>& rotary_cos,
                                      const Opt<at::Tensor>& rotary_sin) {
  return SoftmaxFunction::apply(q, k, v, cu_q, cu_k, scale, attend_current, rotary_cos, rotary_sin)[0];
}

at::Tensor softmax_attention_no_grad(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                     const Opt<at::Tensor>& cu_q, const Opt<at::Tensor>& cu_k,
                                     Opt<double> scale, bool attend_current, const Opt<at::Tensor>& rotary_cos,
                                     const Opt<at::Tensor>& rotary_sin) {
  const AttentionRotary rotary =
      attention_rotary("winnow.softmax_attention", q, k, rotary_cos, rotary_sin, cu_q, cu_k);
  const auto [qr, kr] = kernel_queries_keys(rotary, q, k);
  return std::get<0>(softmax_forward(qr, kr, v, cu_q, cu_k, scale, attend_current, false));
}

// ------------------------------------------------------------------ stick-breaking

std::tuple<at::Tensor, at::Tensor, at::Tensor> stick_breaking_forward_op(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const Opt<at::Tensor>& cu_q,
    const Opt<at::Tensor>& cu_k, Opt<double> scale, bool attend_current, double halt_cutoff,
    bool reference) {
  constexpr const char* op = "winnow.stick_breaking_attention_forward";
  return translate_errors([&] {
    const AttentionInputs in = inputs(op, q, k, v, cu_q, cu_k);
    at::Tensor out = at::empty(out_shape(q, v), q.options());
    at::Tensor log_rem = at::empty(stats_shape(q), q.options().dtype(stats_dtype(q)));
    at::Tensor kept_from = at::empty(stats_shape(q), q.options().dtype(at::kInt));
    stick_breaking::Options options{std_opt(scale), attend_current, halt_cutoff};
    const DeviceScope scope(q);
    stick_breaking::forward(in, options,
                            {view_of(out, op, "out"), view_of(log_rem, op, "log_rem"),
                             view_of(kept_from, op, "kept_from")},
                            scope.context(false, reference));
    return std::make_tuple(out, log_rem, kept_from);
  });
}

void stick_breaking_backward_into(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                  const at::Tensor& out, const at::Tensor& log_rem,
                                  const Opt<at::Tensor>& kept_from, const at::Tensor& dout,
                                  const Opt<at::Tensor>& dlog_rem, const Opt<at::Tensor>& cu_q,
                                  const Opt<at::Tensor>& cu_k, Opt<double> scale, bool attend_current,
                                  double halt_cutoff, bool deterministic, bool reference, const at::Tensor& dq,
                                  const at::Tensor& dk, const at::Tensor& dv) {
  constexpr const char* op = "winnow.stick_breaking_attention_backward";
  const AttentionInputs in = inputs(op, q, k, v, cu_q, cu_k);
  stick_breaking::Options options{std_opt(scale), attend_current, halt_cutoff};
  const DeviceScope scope(q);
  stick_breaking::backward(in, options,
                           {view_of(out, op, "out"), view_of(log_rem, op, "log_rem"),
                            view_of(kept_from, op, "kept_from")},
                           view_of(dout, op, "dout"), view_of(dlog_rem, op, "dlog_rem"),
                           grad_views(op, dq, dk, dv), scope.context(deterministic, reference));
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> stick_breaking_backward_op(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& out,
    const at::Tensor& log_rem, const Opt<at::Tensor>& kept_from, const at::Tensor& dout,
    const Opt<at::Tensor>& dlog_rem, const Opt<at::Tensor>& cu_q, const Opt<at::Tensor>& cu_k,
    Opt<double> scale,
    bool attend_current, double halt_cutoff, bool deterministic, bool reference) {
  return translate_errors([&] {
    at::Tensor dq = at::empty_like(q), dk = at::empty_like(k), dv = at::empty_like(v);
    stick_breaking_backward_into(q, k, v, out, log_rem, kept_from, dout, dlog_rem, cu_q, cu_k, scale,
                                 attend_current, halt_cutoff, deterministic, reference, dq, dk, dv);
    return std::make_tuple(dq, dk, dv);
  });
}

constexpr Dispatched<&stick_breaking_forward_op> stick_breaking_forward{
    "winnow::stick_breaking_attention_forward"};
constexpr Dispatched<&stick_breaking_backward_op> stick_breaking_backward{
    "winnow::stick_breaking_attention_backward"};

struct StickBreakingFunction : public torch::autograd::Function<StickBreakingFunction> {
  static variable_list forward(AutogradContext* ctx, const at::Tensor& q, const at::Tensor& k,
                               const at::Tensor& v, const Opt<at::Tensor>& cu_q,
                               const Opt<at::Tensor>& cu_k, Opt<double> scale,
                               bool attend_current, double halt_cutoff) {
    auto [out, log_rem, kept_from] =
        stick_breaking_forward(q, k, v, cu_q, cu_k, scale, attend_current, halt_cutoff, false);
    save_call(ctx, {q, k, v, out, log_rem, kept_from}, cu_q, cu_k, scale, attend_current);
    note_layout(ctx, q, k, v);
    ctx->mark_non_differentiable({kept_from});
    ctx->saved_data["halt_cutoff"] = halt_cutoff;
    return {out, log_rem};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const SavedCall c = saved_call(ctx);
    const variable_list& saved = c.tensors;
    at::Tensor dout = grads[0].defined() ? grads[0] : at::zeros_like(saved[3]);
    Opt<at::Tensor> dlog_rem;
    if (grads[1].defined()) dlog_rem = grads[1];
    const double halt_cutoff = ctx->saved_data["halt_cutoff"].toDouble();
    const bool deterministic = at::globalContext().deterministicAlgorithms();
    auto [dq, dk, dv] = attention_grads(
        ctx, saved[0], saved[1], saved[2],
        [&](const at::Tensor& dq, const at::Tensor& dk, const at::Tensor& dv) {
          stick_breaking_backward_into(saved[0], saved[1], saved[2], saved[3], saved[4], saved[5], dout, dlog_rem,
                                       c.cu_q, c.cu_k, c.scale, c.attend_current, halt_cutoff, deterministic, false,
                                       dq, dk, dv);
        },
        [&] {
          return stick_breaking_backward(saved[0], saved[1], saved[2], saved[3], saved[4], saved[5], dout, dlog_rem,
                                         c.cu_q, c.cu_k, c.scale, c.attend_current, halt_cutoff, deterministic,
                                         false);
        });
    return {dq, dk, dv, at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

// Returns (out, rem) with rem = exp(log_rem): the unallocated stick, differentiable.
std::tuple<at::Tensor, at::Tensor> stick_breaking_attention_autograd(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const Opt<at::Tensor>& cu_q,
    const Opt<at::Tensor>& cu_k, Opt<double> scale, bool attend_current, double halt_cutoff) {
  auto outs =
      StickBreakingFunction::apply(q, k, v, cu_q, cu_k, scale, attend_current, halt_cutoff);
  return std::make_tuple(outs[0], outs[1].exp());
}

std::tuple<at::Tensor, at::Tensor> stick_breaking_attention_no_grad(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const Opt<at::Tensor>& cu_q,
    const Opt<at::Tensor>& cu_k, Opt<double> scale, bool attend_current, double halt_cutoff) {
  auto [out, log_rem, kept_from] =
      stick_breaking_forward(q, k, v, cu_q, cu_k, scale, attend_current, halt_cutoff, false);
  return std::make_tuple(out, log_rem.exp());
}


// ------------------------------------------------------------------ alpha-entmax

// Rows times heads of an attention operand's sizes (ints or symbolic): all dimensions but the last.
template <class Int, class Sizes>
Int rows_and_heads(Sizes sizes) {
  Int n = 1;
  for (std::size_t d = 0; d + 1 < sizes.size(); ++d) n = n * sizes[d];
  return n;
}

// The support record's length (winnow/entmax.h) for q's and k's sizes.
template <class Int, class Sizes>
Int support_record_length(Sizes q_sizes, Sizes k_sizes) {
  return entmax::support_record_size<Int>(rows_and_heads<Int>(q_sizes), rows_and_heads<Int>(k_sizes));
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> entmax_forward_op(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const Opt<at::Tensor>& cu_q,
    const Opt<at::Tensor>& cu_k, Opt<double> scale, bool attend_current, double alpha,
    Opt<double> tolerance, bool reference, bool keep_support) {
  constexpr const char* op = "winnow.entmax_attention_forward";
  return translate_errors([&] {
    const AttentionInputs in = inputs(op, q, k, v, cu_q, cu_k);
    at::Tensor out = at::empty(out_shape(q, v), q.options());
    at::Tensor tau = at::empty(stats_shape(q), q.options().dtype(stats_dtype(q)));
    const std::int64_t record = keep_support ? support_record_length<std::int64_t>(q.sizes(), k.sizes()) : 0;
    at::Tensor support = at::empty({record}, q.options().dtype(at::kInt));
    entmax::Options options{std_opt(scale), attend_current, alpha, std_opt(tolerance)};
    entmax::Outputs outputs{view_of(out, op, "out"), view_of(tau, op, "tau"), std::nullopt};
    if (keep_support) outputs.support = view_of(support, op, "support");
    const DeviceScope scope(q);
    entmax::forward(in, options, outputs, scope.context(false, reference));
    return std::make_tuple(out, tau, support);
  });
}

void entmax_backward_into(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& out,
                          const at::Tensor& tau, const at::Tensor& dout, const Opt<at::Tensor>& cu_q,
                          const Opt<at::Tensor>& cu_k, Opt<double> scale, bool attend_current, double alpha,
                          bool deterministic, bool reference, const Opt<at::Tensor>& support, const at::Tensor& dq,
                          const at::Tensor& dk, const at::Tensor& dv) {
  constexpr const char* op = "winnow.entmax_attention_backward";
  const AttentionInputs in = inputs(op, q, k, v, cu_q, cu_k);
  entmax::Options options{std_opt(scale), attend_current, alpha, std::nullopt};
  entmax::Outputs saved{view_of(out, op, "out"), view_of(tau, op, "tau"), std::nullopt};
  if (support && support->defined()) saved.support = view_of(*support, op, "support");
  const DeviceScope scope(q);
  entmax::backward(in, options, saved, view_of(dout, op, "dout"), grad_views(op, dq, dk, dv),
                   scope.context(deterministic, reference));
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> entmax_backward_op(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& out,
    const at::Tensor& tau, const at::Tensor& dout, const Opt<at::Tensor>& cu_q,
    const Opt<at::Tensor>& cu_k, Opt<double> scale, bool attend_current, double alpha,
    bool deterministic, bool reference, const Opt<at::Tensor>& support) {
  return translate_errors([&] {
    at::Tensor dq = at::empty_like(q), dk = at::empty_like(k), dv = at::empty_like(v);
    entmax_backward_into(q, k, v, out, tau, dout, cu_q, cu_k, scale, attend_current, alpha, deterministic,
                         reference, support, dq, dk, dv);
    return std::make_tuple(dq, dk, dv);
  });
}

constexpr Dispatched<&entmax_forward_op> entmax_forward{"winnow::entmax_attention_forward"};
constexpr Dispatched<&entmax_backward_op> entmax_backward{"winnow::entmax_attention_backward"};

// keep_support: the forward lists each row's support for the backward (winnow/entmax.h), which
// then skips its own listing sweep; asked for only where it can pay (CUDA, gradients wanted),
// unless WINNOW_ENTMAX_KEEP_SUPPORT=0 in the environment trades that time for the record's
// memory (516 bytes per query row and head, held from forward to backward).
struct EntmaxFunction : public torch::autograd::Function<EntmaxFunction> {
  static variable_list forward(AutogradContext* ctx, const at::Tensor& q, const at::Tensor& k,
                               const at::Tensor& v, const Opt<at::Tensor>& cu_q,
                               const Opt<at::Tensor>& cu_k, Opt<double> scale,
                               bool attend_current, double alpha, bool keep_support) {
    auto [out, tau, support] = entmax_forward(q, k, v, cu_q, cu_k, scale, attend_current, alpha,
                                              Opt<double>(), false, keep_support);
    save_call(ctx, {q, k, v, out, tau, support}, cu_q, cu_k, scale, attend_current);
    note_layout(ctx, q, k, v);
    ctx->saved_data["alpha"] = alpha;
    ctx->saved_data["keep_support"] = keep_support;
    ctx->mark_non_differentiable({tau});
    return {out, tau};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const SavedCall c = saved_call(ctx);
    const variable_list& saved = c.tensors;
    at::Tensor dout = grads[0].defined() ? grads[0] : at::zeros_like(saved[3]);
    Opt<at::Tensor> support;
    if (ctx->saved_data["keep_support"].toBool()) support = saved[5];
    const double alpha = ctx->saved_data["alpha"].toDouble();
    const bool deterministic = at::globalContext().deterministicAlgorithms();
    auto [dq, dk, dv] = attention_grads(
        ctx, saved[0], saved[1], saved[2],
        [&](const at::Tensor& dq, const at::Tensor& dk, const at::Tensor& dv) {
          entmax_backward_into(saved[0], saved[1], saved[2], saved[3], saved[4], dout, c.cu_q, c.cu_k, c.scale,
                               c.attend_current, alpha, deterministic, false, support, dq, dk, dv);
        },
        [&] {
          return entmax_backward(saved[0], saved[1], saved[2], saved[3], saved[4], dout, c.cu_q, c.cu_k, c.scale,
                                 c.attend_current, alpha, deterministic, false, support);
        });
    return {dq, dk, dv, at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

at::Tensor entmax_attention_autograd(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                     const Opt<at::Tensor>& cu_q, const Opt<at::Tensor>& cu_k,
                                     Opt<double> scale, bool attend_current, double alpha) {
  const bool wants_grad = at::GradMode::is_enabled() && (q.requires_grad() || k.requires_grad() || v.requires_grad());
  static const bool allowed = [] {
    const char* v = std::getenv("WINNOW_ENTMAX_KEEP_SUPPORT");
    return v == nullptr || std::string(v) != "0";
  }();
  const bool keep_support = allowed && wants_grad && q.is_cuda();
  return EntmaxFunction::apply(q, k, v, cu_q, cu_k, scale, attend_current, alpha, keep_support)[0];
}

at::Tensor entmax_attention_no_grad(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                    const Opt<at::Tensor>& cu_q, const Opt<at::Tensor>& cu_k,
                                    Opt<double> scale, bool attend_current, double alpha) {
  return std::get<0>(entmax_forward(q, k, v, cu_q, cu_k, scale, attend_current, alpha,
                                    Opt<double>(), false, false));
}

// ------------------------------------------------------------------ Sieve

sieve::Options sieve_options(const char* op, Opt<double> scale, bool attend_current, double alpha,
                             const std::string& filter, Opt<double> eps, Opt<double> tolerance) {
  sieve::Options o;
  o.scale = std_opt(scale);
  o.attend_current = attend_current;
  o.alpha = alpha;
  if (filter == "exact") {
    o.filter = sieve::Filter::exact;
  } else if (filter == "bound") {
    o.filter = sieve::Filter::bound;
  } else {
    throw Error(ErrorKind::invalid_argument,
                std::string(op) + ": argument 'filter': expected \"exact\" or \"bound\", got \"" + filter + "\"");
  }
  o.eps = std_opt(eps);
  o.tolerance = std_opt(tolerance);
  return o;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> sieve_forward_op(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const Opt<at::Tensor>& cu_q,
    const Opt<at::Tensor>& cu_k, Opt<double> scale, bool attend_current, double alpha,
    c10::string_view filter, Opt<double> eps, Opt<double> tolerance, bool reference) {
  constexpr const char* op = "winnow.sieve_attention_forward";
  return translate_errors([&] {
    const sieve::Options options = sieve_options(op, scale, attend_current, alpha,
                                                 std::string(filter), eps, tolerance);
    const AttentionInputs in = inputs(op, q, k, v, cu_q, cu_k);
    at::Tensor out = at::empty(out_shape(q, v), q.options());
    at::Tensor log_rem = at::empty(stats_shape(q), q.options().dtype(stats_dtype(q)));
    at::Tensor threshold = at::empty(stats_shape(q), q.options().dtype(stats_dtype(q)));
    at::Tensor count = at::empty(stats_shape(q), q.options().dtype(at::kInt));
    const DeviceScope scope(q);
    sieve::forward(in, options,
                   {view_of(out, op, "out"), view_of(log_rem, op, "log_rem"),
                    view_of(threshold, op, "threshold"), view_of(count, op, "count")},
                   scope.context(false, reference));
    return std::make_tuple(out, log_rem, threshold, count);
  });
}

void sieve_backward_into(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& out,
                         const at::Tensor& log_rem, const at::Tensor& threshold, const at::Tensor& dout,
                         const Opt<at::Tensor>& dlog_rem, const Opt<at::Tensor>& cu_q, const Opt<at::Tensor>& cu_k,
                         Opt<double> scale, bool attend_current, double alpha, c10::string_view filter,
                         Opt<double> eps, bool deterministic, bool reference, const at::Tensor& dq,
                         const at::Tensor& dk, const at::Tensor& dv) {
  constexpr const char* op = "winnow.sieve_attention_backward";
  const sieve::Options options = sieve_options(op, scale, attend_current, alpha, std::string(filter), eps,
                                               Opt<double>());
  const AttentionInputs in = inputs(op, q, k, v, cu_q, cu_k);
  const DeviceScope scope(q);
  sieve::backward(in, options,
                  {view_of(out, op, "out"), view_of(log_rem, op, "log_rem"), view_of(threshold, op, "threshold"),
                   std::nullopt},
                  view_of(dout, op, "dout"), view_of(dlog_rem, op, "dlog_rem"), grad_views(op, dq, dk, dv),
                  scope.context(deterministic, reference));
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> sieve_backward_op(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& out,
    const at::Tensor& log_rem, const at::Tensor& threshold, const at::Tensor& dout,
    const Opt<at::Tensor>& dlog_rem, const Opt<at::Tensor>& cu_q, const Opt<at::Tensor>& cu_k,
    Opt<double> scale, bool attend_current, double alpha, c10::string_view filter,
    Opt<double> eps, bool deterministic, bool reference) {
  return translate_errors([&] {
    at::Tensor dq = at::empty_like(q), dk = at::empty_like(k), dv = at::empty_like(v);
    sieve_backward_into(q, k, v, out, log_rem, threshold, dout, dlog_rem, cu_q, cu_k, scale, attend_current, alpha,
                        filter, eps, deterministic, reference, dq, dk, dv);
    return std::make_tuple(dq, dk, dv);
  });
}

constexpr Dispatched<&sieve_forward_op> sieve_forward{"winnow::sieve_attention_forward"};
constexpr Dispatched<&sieve_backward_op> sieve_backward{"winnow::sieve_attention_backward"};

struct SieveFunction : public torch::autograd::Function<SieveFunction> {
  static variable_list forward(AutogradContext* ctx, const at::Tensor& q, const at::Tensor& k,
                               const at::Tensor& v, const Opt<at::Tensor>& cu_q,
                               const Opt<at::Tensor>& cu_k, Opt<double> scale, bool attend_current,
                               double alpha, c10::string_view filter, Opt<double> eps) {
    auto [out, log_rem, threshold, count] = sieve_forward(
        q, k, v, cu_q, cu_k, scale, attend_current, alpha, filter, eps, Opt<double>(), false);
    save_call(ctx, {q, k, v, out, log_rem, threshold}, cu_q, cu_k, scale, attend_current);
    note_layout(ctx, q, k, v);
    ctx->mark_non_differentiable({count});
    ctx->saved_data["alpha"] = alpha;
    ctx->saved_data["filter"] = std::string(filter);
    ctx->saved_data["eps"] = eps.has_value() ? c10::IValue(*eps) : c10::IValue();
    return {out, log_rem, count};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const SavedCall c = saved_call(ctx);
    const variable_list& saved = c.tensors;
    at::Tensor dout = grads[0].defined() ? grads[0] : at::zeros_like(saved[3]);
    Opt<at::Tensor> dlog_rem;
    if (grads[1].defined()) dlog_rem = grads[1];
    Opt<double> eps;
    if (!ctx->saved_data["eps"].isNone()) eps = ctx->saved_data["eps"].toDouble();
    const std::string filter = ctx->saved_data["filter"].toStringRef();
    const double alpha = ctx->saved_data["alpha"].toDouble();
    const bool deterministic = at::globalContext().deterministicAlgorithms();
    auto [dq, dk, dv] = attention_grads(
        ctx, saved[0], saved[1], saved[2],
        [&](const at::Tensor& dq, const at::Tensor& dk, const at::Tensor& dv) {
          sieve_backward_into(saved[0], saved[1], saved[2], saved[3], saved[4], saved[5], dout, dlog_rem, c.cu_q,
                              c.cu_k, c.scale, c.attend_current, alpha, filter, eps, deterministic, false, dq, dk, dv);
        },
        [&] {
          return sieve_backward(saved[0], saved[1], saved[2], saved[3], saved[4], saved[5], dout, dlog_rem, c.cu_q,
                                c.cu_k, c.scale, c.attend_current, alpha, filter, eps, deterministic, false);
        });
    return {dq, dk, dv, at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(),
            at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

// Returns (out, rem, count) with rem = exp(log_rem) differentiable.
std::tuple<at::Tensor, at::Tensor, at::Tensor> sieve_attention_autograd(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const Opt<at::Tensor>& cu_q,
    const Opt<at::Tensor>& cu_k, Opt<double> scale, bool attend_current, double alpha,
    c10::string_view filter, Opt<double> eps) {
  auto outs = SieveFunction::apply(q, k, v, cu_q, cu_k, scale, attend_current, alpha, filter, eps);
  return std::make_tuple(outs[0], outs[1].exp(), outs[2]);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> sieve_attention_no_grad(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const Opt<at::Tensor>& cu_q,
    const Opt<at::Tensor>& cu_k, Opt<double> scale, bool attend_current, double alpha,
    c10::string_view filter, Opt<double> eps) {
  auto [out, log_rem, threshold, count] = sieve_forward(
      q, k, v, cu_q, cu_k, scale, attend_current, alpha, filter, eps, Opt<double>(), false);
  return std::make_tuple(out, log_rem.exp(), count);
}

// ------------------------------------------------------------------ threshold (TRA, TDA)

// TRA's gradients of a second view do not exist: empty tensors stand in, so the operator's
// outputs have one schema.
at::Tensor no_tensor(const at::Tensor& like) { return at::empty({0}, like.options()); }

threshold::Views threshold_views(const char* op, const at::Tensor& beta, const Opt<at::Tensor>& lam,
                                 const Opt<at::Tensor>& q2, const Opt<at::Tensor>& k2) {
  threshold::Views v;
  v.beta = view_of(beta, op, "beta");
  if (lam.has_value()) v.lambda = view_of(*lam, op, "lam");
  if (q2.has_value()) v.q2 = view_of(*q2, op, "q2");
  if (k2.has_value()) v.k2 = view_of(*k2, op, "k2");
  return v;
}

// The saved rows' length (winnow/threshold.h) for q's and k's sizes (ints or symbolic), with the
// sequences' count: batched inputs (B, L, H, D) have B, packed ones (T, H, D) cu_seqlens_q's
// length (cu_q_len) less one.
template <class Int, class Sizes>
Int saved_rows_length(Sizes q_sizes, Sizes k_sizes, std::int64_t element_bytes, bool tda, Int cu_q_len) {
  const bool batched = q_sizes.size() == 4;
  const Int num_seqs = batched ? Int(q_sizes[0]) : cu_q_len - Int(1);
  const Int heads_q = Int(q_sizes[q_sizes.size() - 2]);
  const Int query_rows = rows_and_heads<Int>(q_sizes) / heads_q;
  const Int key_len = Int(k_sizes.size() == 4 ? k_sizes[1] : k_sizes[0]);
  return threshold::saved_rows_size<Int>(rows_and_heads<Int>(q_sizes), rows_and_heads<Int>(k_sizes),
                                         Int(q_sizes.back()), Int(element_bytes), Int(tda ? 2 : 1),
                                         threshold::saved_support_words<Int>(num_seqs, heads_q, query_rows, key_len));
}

// nonzero: per query row, the keys kept in some view (int32), when count_nonzero; else empty.
// saved_rows: the normalized rows for the backward (winnow/threshold.h; CUDA), when keep_rows;
// else empty.
std::tuple<at::Tensor, at::Tensor, at::Tensor> threshold_forward_op(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& beta,
    const Opt<at::Tensor>& lam, const Opt<at::Tensor>& q2, const Opt<at::Tensor>& k2,
    const Opt<at::Tensor>& cu_q, const Opt<at::Tensor>& cu_k, double power, bool attend_current,
    bool clamp_lambda, double norm_eps, bool count_nonzero, bool reference, bool keep_rows) {
  constexpr const char* op = "winnow.threshold_attention_forward";
  return translate_errors([&] {
    const AttentionInputs in = inputs(op, q, k, v, cu_q, cu_k);
    at::Tensor out = at::empty(out_shape(q, v), q.options());
    at::Tensor nonzero = count_nonzero ? at::empty(stats_shape(q), q.options().dtype(at::kInt))
                                       : at::empty({0}, q.options().dtype(at::kInt));
    const std::int64_t rows =
        keep_rows ? saved_rows_length<std::int64_t>(q.sizes(), k.sizes(), q.element_size(), lam.has_value(),
                                                    cu_q.has_value() ? cu_q->size(0) : std::int64_t(1))
                  : 0;
    at::Tensor saved_rows = at::empty({rows}, q.options().dtype(at::kInt));
    const threshold::Options options{power, attend_current, clamp_lambda, norm_eps};
    threshold::Outputs outputs{view_of(out, op, "out"), std::nullopt, std::nullopt};
    if (count_nonzero) outputs.nonzero = view_of(nonzero, op, "nonzero");
    if (keep_rows) outputs.saved_rows = view_of(saved_rows, op, "saved_rows");
    const DeviceScope scope(q);
    threshold::forward(in, threshold_views(op, beta, lam, q2, k2), options, outputs,
                       scope.context(false, reference));
    return std::make_tuple(out, nonzero, saved_rows);
  });
}

using ThresholdGrads = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor,
                                  at::Tensor, at::Tensor>;

ThresholdGrads threshold_backward_op(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                     const at::Tensor& beta, const Opt<at::Tensor>& lam,
                                     const Opt<at::Tensor>& q2, const Opt<at::Tensor>& k2,
                                     const at::Tensor& dout, const Opt<at::Tensor>& cu_q,
                                     const Opt<at::Tensor>& cu_k, double power,
                                     bool attend_current, bool clamp_lambda, double norm_eps,
                                     bool deterministic, bool reference,
                                     const Opt<at::Tensor>& saved_rows) {
  constexpr const char* op = "winnow.threshold_attention_backward";
  return translate_errors([&] {
    const AttentionInputs in = inputs(op, q, k, v, cu_q, cu_k);
    at::Tensor dq = at::empty_like(q), dk = at::empty_like(k), dv = at::empty_like(v);
    at::Tensor dbeta = at::empty_like(beta);
    const bool tda = lam.has_value();
    at::Tensor dlam = tda ? at::empty_like(*lam) : no_tensor(beta);
    at::Tensor dq2 = tda && q2.has_value() ? at::empty_like(*q2) : no_tensor(q);
    at::Tensor dk2 = tda && k2.has_value() ? at::empty_like(*k2) : no_tensor(k);
    threshold::ViewGrads vg;
    vg.dbeta = view_of(dbeta, op, "dbeta");
    if (tda) {
      vg.dlambda = view_of(dlam, op, "dlam");
      vg.dq2 = view_of(dq2, op, "dq2");
      vg.dk2 = view_of(dk2, op, "dk2");
    }
    const threshold::Options options{power, attend_current, clamp_lambda, norm_eps};
    std::optional<TensorView> rows;
    if (saved_rows.has_value()) rows = view_of(*saved_rows, op, "saved_rows");
    const DeviceScope scope(q);
    threshold::backward(in, threshold_views(op, beta, lam, q2, k2), options,
                        view_of(dout, op, "dout"), grad_views(op, dq, dk, dv), vg,
                        scope.context(deterministic, reference), rows);
    return std::make_tuple(dq, dk, dv, dbeta, dlam, dq2, dk2);
  });
}

constexpr Dispatched<&threshold_forward_op> threshold_forward{"winnow::threshold_attention_forward"};
constexpr Dispatched<&threshold_backward_op> threshold_backward{"winnow::threshold_attention_backward"};

Opt<at::Tensor> defined_or_none(const at::Tensor& t) {
  return t.defined() ? Opt<at::Tensor>(t) : Opt<at::Tensor>();
}

// keep_rows: the forward keeps the normalized rows for the backward (winnow/threshold.h), which
// then normalizes nothing; asked for only where it can pay (CUDA), unless
// WINNOW_THRESHOLD_KEEP_ROWS=0 in the environment trades that time for the rows' memory (per
// view as much as q and k, held from forward to backward).
struct ThresholdFunction : public torch::autograd::Function<ThresholdFunction> {
  static variable_list forward(AutogradContext* ctx, const at::Tensor& q, const at::Tensor& k,
                               const at::Tensor& v, const at::Tensor& beta,
                               const Opt<at::Tensor>& lam, const Opt<at::Tensor>& q2,
                               const Opt<at::Tensor>& k2, const Opt<at::Tensor>& cu_q,
                               const Opt<at::Tensor>& cu_k, double power, bool attend_current,
                               bool clamp_lambda, double norm_eps, bool keep_rows) {
    auto [out, nonzero, saved_rows] = threshold_forward(q, k, v, beta, lam, q2, k2, cu_q, cu_k, power,
                                                        attend_current, clamp_lambda, norm_eps, false, false,
                                                        keep_rows);
    const auto or_undefined = [](const Opt<at::Tensor>& t) { return t.has_value() ? *t : at::Tensor(); };
    save_call(ctx, {q, k, v, beta, or_undefined(lam), or_undefined(q2), or_undefined(k2), saved_rows}, cu_q,
              cu_k, Opt<double>(), attend_current);
    ctx->saved_data["power"] = power;
    ctx->saved_data["clamp_lambda"] = clamp_lambda;
    ctx->saved_data["norm_eps"] = norm_eps;
    ctx->saved_data["keep_rows"] = keep_rows;
    return {out};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const SavedCall c = saved_call(ctx);
    const variable_list& s = c.tensors;
    at::Tensor dout = grads[0];
    if (!dout.defined()) {
      std::vector<int64_t> shape = s[0].sizes().vec();
      shape.back() = s[2].size(-1);
      dout = at::zeros(shape, s[0].options());
    }
    Opt<at::Tensor> saved_rows;
    if (ctx->saved_data["keep_rows"].toBool()) saved_rows = s[7];
    auto [dq, dk, dv, dbeta, dlam, dq2, dk2] = threshold_backward(
        s[0], s[1], s[2], s[3], defined_or_none(s[4]), defined_or_none(s[5]), defined_or_none(s[6]),
        dout, c.cu_q, c.cu_k, ctx->saved_data["power"].toDouble(), c.attend_current,
        ctx->saved_data["clamp_lambda"].toBool(), ctx->saved_data["norm_eps"].toDouble(),
        at::globalContext().deterministicAlgorithms(), false, saved_rows);
    const bool tda = s[4].defined();
    return {dq, dk, dv, dbeta, tda ? dlam : at::Tensor(), tda ? dq2 : at::Tensor(),
            tda ? dk2 : at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(),
            at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

at::Tensor threshold_attention_autograd(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                        const at::Tensor& beta, const Opt<at::Tensor>& lam,
                                        const Opt<at::Tensor>& q2, const Opt<at::Tensor>& k2,
                                        const Opt<at::Tensor>& cu_q, const Opt<at::Tensor>& cu_k,
                                        double power, bool attend_current, bool clamp_lambda,
                                        double norm_eps) {
  static const bool allowed = [] {
    const char* v = std::getenv("WINNOW_THRESHOLD_KEEP_ROWS");
    return v == nullptr || std::string(v) != "0";
  }();
  return ThresholdFunction::apply(q, k, v, beta, lam, q2, k2, cu_q, cu_k, power, attend_current,
                                  clamp_lambda, norm_eps, allowed && q.is_cuda())[0];
}

at::Tensor threshold_attention_no_grad(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                       const at::Tensor& beta, const Opt<at::Tensor>& lam,
                                       const Opt<at::Tensor>& q2, const Opt<at::Tensor>& k2,
                                       const Opt<at::Tensor>& cu_q, const Opt<at::Tensor>& cu_k,
                                       double power, bool attend_current, bool clamp_lambda,
                                       double norm_eps) {
  return std::get<0>(threshold_forward(q, k, v, beta, lam, q2, k2, cu_q, cu_k, power,
                                      attend_current, clamp_lambda, norm_eps, false, false, false));
}

// ------------------------------------------------------------------ screening (Multiscreen)

std::tuple<at::Tensor, at::Tensor> screening_forward_op(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& s_w,
    const at::Tensor& s_r, const Opt<at::Tensor>& cu_q, const Opt<at::Tensor>& cu_k,
    double mipe_threshold, double expand_windows_above, double norm_eps, bool reference) {
  constexpr const char* op = "winnow.screening_attention_forward";
  return translate_errors([&] {
    const AttentionInputs in = inputs(op, q, k, v, cu_q, cu_k);
    at::Tensor out = at::empty(out_shape(q, v), q.options());
    at::Tensor h_norm = at::empty(stats_shape(q), q.options().dtype(stats_dtype(q)));
    const screening::Options options{mipe_threshold, expand_windows_above, norm_eps};
    const DeviceScope scope(q);
    screening::forward(in, {view_of(s_w, op, "s_w"), view_of(s_r, op, "s_r")}, options,
                       {view_of(out, op, "out"), view_of(h_norm, op, "h_norm")},
                       scope.context(false, reference));
    return std::make_tuple(out, h_norm);
  });
}

using ScreeningGrads = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>;

ScreeningGrads screening_backward_op(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                     const at::Tensor& s_w, const at::Tensor& s_r,
                                     const at::Tensor& out, const at::Tensor& h_norm,
                                     const at::Tensor& dout, const Opt<at::Tensor>& cu_q,
                                     const Opt<at::Tensor>& cu_k, double mipe_threshold,
                                     double expand_windows_above, double norm_eps,
                                     bool reference) {
  constexpr const char* op = "winnow.screening_attention_backward";
  return translate_errors([&] {
    const AttentionInputs in = inputs(op, q, k, v, cu_q, cu_k);
    at::Tensor dq = at::empty_like(q), dk = at::empty_like(k), dv = at::empty_like(v);
    at::Tensor ds_w = at::empty_like(s_w), ds_r = at::empty_like(s_r);
    const screening::Options options{mipe_threshold, expand_windows_above, norm_eps};
    const DeviceScope scope(q);
    screening::backward(in, {view_of(s_w, op, "s_w"), view_of(s_r, op, "s_r")}, options,
                        {view_of(out, op, "out"), view_of(h_norm, op, "h_norm")},
                        view_of(dout, op, "dout"), grad_views(op, dq, dk, dv),
                        {view_of(ds_w, op, "ds_w"), view_of(ds_r, op, "ds_r")},
                        scope.context(false, reference));
    return std::make_tuple(dq, dk, dv, ds_w, ds_r);
  });
}

constexpr Dispatched<&screening_forward_op> screening_forward{"winnow::screening_attention_forward"};
constexpr Dispatched<&screening_backward_op> screening_backward{"winnow::screening_attention_backward"};

struct ScreeningFunction : public torch::autograd::Function<ScreeningFunction> {
  static variable_list forward(AutogradContext* ctx, const at::Tensor& q, const at::Tensor& k,
                               const at::Tensor& v, const at::Tensor& s_w, const at::Tensor& s_r,
                               const Opt<at::Tensor>& cu_q, const Opt<at::Tensor>& cu_k,
                               double mipe_threshold, double expand_windows_above, double norm_eps) {
    auto [out, h_norm] = screening_forward(q, k, v, s_w, s_r, cu_q, cu_k, mipe_threshold,
                                           expand_windows_above, norm_eps, false);
    save_call(ctx, {q, k, v, s_w, s_r, out, h_norm}, cu_q, cu_k, Opt<double>(), true);
    ctx->saved_data["mipe_threshold"] = mipe_threshold;
    ctx->saved_data["expand_windows_above"] = expand_windows_above;
    ctx->saved_data["norm_eps"] = norm_eps;
    ctx->mark_non_differentiable({h_norm});
    return {out};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const SavedCall c = saved_call(ctx);
    const variable_list& s = c.tensors;
    at::Tensor dout = grads[0].defined() ? grads[0] : at::zeros_like(s[5]);
    auto [dq, dk, dv, ds_w, ds_r] = screening_backward(
        s[0], s[1], s[2], s[3], s[4], s[5], s[6], dout, c.cu_q, c.cu_k,
        ctx->saved_data["mipe_threshold"].toDouble(), ctx->saved_data["expand_windows_above"].toDouble(),
        ctx->saved_data["norm_eps"].toDouble(), false);
    return {dq, dk, dv, ds_w, ds_r, at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

at::Tensor screening_attention_autograd(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                        const at::Tensor& s_w, const at::Tensor& s_r,
                                        const Opt<at::Tensor>& cu_q, const Opt<at::Tensor>& cu_k,
                                        double mipe_threshold, double expand_windows_above,
                                        double norm_eps) {
  return ScreeningFunction::apply(q, k, v, s_w, s_r, cu_q, cu_k, mipe_threshold, expand_windows_above,
                                  norm_eps)[0];
}

at::Tensor screening_attention_no_grad(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                       const at::Tensor& s_w, const at::Tensor& s_r,
                                       const Opt<at::Tensor>& cu_q, const Opt<at::Tensor>& cu_k,
                                       double mipe_threshold, double expand_windows_above,
                                       double norm_eps) {
  return std::get<0>(screening_forward(q, k, v, s_w, s_r, cu_q, cu_k, mipe_threshold,
                                       expand_windows_above, norm_eps, false));
}

// ------------------------------------------------------------------ GSA (Gated Sparse Attention)
// Two pieces (winnow/gsa.h): the indexer with exact top-k selection (gsa_select_keys: integer
// lists and a statistic, no gradient) and softmax attention over those per-token key lists
// (gsa_sparse_attention, differentiable in q, k and v).

// The indexer's options as the C++ API takes them. The fixed budget is `k_fixed` here (the
// operator's `k` is the key tensor); None means k_max. k_max is checked before anything is
// allocated, since the lists' width comes from it.
gsa::ScoreForm gsa_score_form(const char* op, c10::string_view form) {
  const std::string form_s(form);
  if (form_s == "sigmoid") return gsa::ScoreForm::sigmoid;
  if (form_s == "relu") return gsa::ScoreForm::relu;
  throw Error(ErrorKind::invalid_argument,
              std::string(op) + ": argument 'form': expected \"sigmoid\" or \"relu\", got \"" + form_s + "\"");
}

gsa::IndexerOptions gsa_indexer_options(const char* op, c10::string_view form, Opt<double> scale,
                                        c10::string_view budget, Opt<int64_t> k_fixed,
                                        int64_t k_base, int64_t k_min, int64_t k_max,
                                        double mean_variance) {
  const auto fail = [&](const char* name, const std::string& expected, const std::string& got) {
    throw Error(ErrorKind::invalid_argument,
                std::string(op) + ": argument '" + name + "': expected " + expected + ", got " + got);
  };
  gsa::IndexerOptions o;
  const std::string budget_s(budget);
  o.form = gsa_score_form(op, form);
  if (budget_s == "fixed") {
    o.budget = gsa::Budget::fixed;
  } else if (budget_s == "inverse_variance") {
    o.budget = gsa::Budget::inverse_variance;
  } else if (budget_s == "eq8") {
    o.budget = gsa::Budget::eq8;
  } else if (budget_s == "reference") {
    o.budget = gsa::Budget::reference;
  } else {
    fail("budget", "\"fixed\", \"inverse_variance\", \"eq8\" or \"reference\"", "\"" + budget_s + "\"");
  }
  if (k_max < 1) fail("k_max", "an integer >= 1 (the width of the key lists)", std::to_string(k_max));
  if (o.budget == gsa::Budget::fixed) {
    o.k = k_fixed.value_or(k_max);
    if (o.k < 1) fail("k_fixed", "an integer >= 1 (the fixed budget) or None (k_max)", std::to_string(o.k));
  } else if (k_fixed.has_value()) {
    fail("k_fixed", "None unless budget is \"fixed\"", std::to_string(*k_fixed));
  }
  o.scale = std_opt(scale);
  o.k_base = k_base;
  o.k_min = k_min;
  o.k_max = k_max;
  o.mean_variance = mean_variance;
  return o;
}

// q (B, Lq, H_I, d_I) or (Tq, H_I, d_I) -> (B, Lq) or (Tq): one entry per query row.
std::vector<int64_t> query_rows_shape(const at::Tensor& q) {
  std::vector<int64_t> shape = q.sizes().vec();
  shape.resize(shape.size() >= 2 ? shape.size() - 2 : 0);
  return shape;
}

using SelectionTensors = std::tuple<at::Tensor, at::Tensor, at::Tensor>;

SelectionTensors gsa_select_keys_op(const at::Tensor& q, const at::Tensor& k,
                                    const at::Tensor& head_weights, const Opt<at::Tensor>& bias,
                                    int64_t k_max, const Opt<at::Tensor>& cu_q,
                                    const Opt<at::Tensor>& cu_k, c10::string_view form,
                                    Opt<double> scale, c10::string_view budget,
                                    Opt<int64_t> k_fixed, int64_t k_base, int64_t k_min,
                                    double mean_variance, bool reference) {
  constexpr const char* op = "winnow.gsa_select_keys";
  return translate_errors([&] {
    const gsa::IndexerOptions options = gsa_indexer_options(op, form, scale, budget, k_fixed, k_base,
                                                            k_min, k_max, mean_variance);
    gsa::IndexerInputs in;
    in.q = view_of(q, op, "q");
    in.k = view_of(k, op, "k");
    in.head_weights = view_of(head_weights, op, "head_weights");
    in.bias = view_of(bias, op, "bias");
    in.cu_seqlens_q = view_of(cu_q, op, "cu_seqlens_q");
    in.cu_seqlens_k = view_of(cu_k, op, "cu_seqlens_k");
    std::vector<int64_t> rows = query_rows_shape(q), lists = rows;
    lists.push_back(k_max);
    at::Tensor indices = at::empty(lists, q.options().dtype(at::kInt));
    at::Tensor counts = at::empty(rows, q.options().dtype(at::kInt));
    at::Tensor variance = at::empty(rows, q.options().dtype(stats_dtype(q)));
    const DeviceScope scope(q);
    gsa::select_keys(in, options,
                     {view_of(indices, op, "indices"), view_of(counts, op, "counts"),
                      view_of(variance, op, "variance")},
                     scope.context(false, reference));
    return std::make_tuple(indices, counts, variance);
  });
}

constexpr Dispatched<&gsa_select_keys_op> gsa_select_keys_dispatched{"winnow::gsa_select_keys"};

// The selection has no gradient: its autograd kernel runs the operator below autograd, so the
// outputs never require grad (the variance is a statistic, the lists integers), whatever the
// inputs do; backpropagating into them is an error rather than a silent zero.
SelectionTensors gsa_select_keys_autograd(const at::Tensor& q, const at::Tensor& k,
                                          const at::Tensor& head_weights,
                                          const Opt<at::Tensor>& bias, int64_t k_max,
                                          const Opt<at::Tensor>& cu_q, const Opt<at::Tensor>& cu_k,
                                          c10::string_view form, Opt<double> scale,
                                          c10::string_view budget, Opt<int64_t> k_fixed,
                                          int64_t k_base, int64_t k_min, double mean_variance,
                                          bool reference) {
  const at::AutoDispatchBelowADInplaceOrView below_autograd;
  return gsa_select_keys_dispatched(q, k, head_weights, bias, k_max, cu_q, cu_k, form, scale, budget,
                                    k_fixed, k_base, k_min, mean_variance, reference);
}

gsa::KeyLists gsa_key_lists(const char* op, const at::Tensor& indices, const at::Tensor& counts,
                            bool trusted) {
  gsa::KeyLists lists;
  lists.indices = view_of(indices, op, "indices");
  lists.counts = view_of(counts, op, "counts");
  lists.trusted = trusted;
  return lists;
}

std::tuple<at::Tensor, at::Tensor> gsa_sparse_forward_op(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& indices,
    const at::Tensor& counts, const Opt<at::Tensor>& cu_q, const Opt<at::Tensor>& cu_k,
    Opt<double> scale, bool trusted, bool reference) {
  constexpr const char* op = "winnow.gsa_sparse_attention_forward";
  return translate_errors([&] {
    const AttentionInputs in = inputs(op, q, k, v, cu_q, cu_k);
    const gsa::KeyLists lists = gsa_key_lists(op, indices, counts, trusted);
    at::Tensor out = at::empty(out_shape(q, v), q.options());
    at::Tensor lse = at::empty(stats_shape(q), q.options().dtype(stats_dtype(q)));
    const DeviceScope scope(q);
    gsa::sparse_forward(in, lists, std_opt(scale), {view_of(out, op, "out"), view_of(lse, op, "lse")},
                        scope.context(false, reference));
    return std::make_tuple(out, lse);
  });
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> gsa_sparse_backward_op(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& indices,
    const at::Tensor& counts, const at::Tensor& out, const at::Tensor& lse, const at::Tensor& dout,
    const Opt<at::Tensor>& cu_q, const Opt<at::Tensor>& cu_k, Opt<double> scale, bool trusted,
    bool deterministic, bool reference) {
  constexpr const char* op = "winnow.gsa_sparse_attention_backward";
  return translate_errors([&] {
    const AttentionInputs in = inputs(op, q, k, v, cu_q, cu_k);
    const gsa::KeyLists lists = gsa_key_lists(op, indices, counts, trusted);
    at::Tensor dq = at::empty_like(q), dk = at::empty_like(k), dv = at::empty_like(v);
    const DeviceScope scope(q);
    gsa::sparse_backward(in, lists, std_opt(scale), {view_of(out, op, "out"), view_of(lse, op, "lse")},
                         view_of(dout, op, "dout"), grad_views(op, dq, dk, dv),
                         scope.context(deterministic, reference));
    return std::make_tuple(dq, dk, dv);
  });
}

constexpr Dispatched<&gsa_sparse_forward_op> gsa_sparse_forward{"winnow::gsa_sparse_attention_forward"};
constexpr Dispatched<&gsa_sparse_backward_op> gsa_sparse_backward{"winnow::gsa_sparse_attention_backward"};

struct GsaSparseFunction : public torch::autograd::Function<GsaSparseFunction> {
  static variable_list forward(AutogradContext* ctx, const at::Tensor& q, const at::Tensor& k,
                               const at::Tensor& v, const at::Tensor& indices,
                               const at::Tensor& counts, const Opt<at::Tensor>& cu_q,
                               const Opt<at::Tensor>& cu_k, Opt<double> scale, bool trusted) {
    auto [out, lse] = gsa_sparse_forward(q, k, v, indices, counts, cu_q, cu_k, scale, trusted, false);
    save_call(ctx, {q, k, v, indices, counts, out, lse}, cu_q, cu_k, scale, true);
    ctx->mark_non_differentiable({lse});
    return {out, lse};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const SavedCall c = saved_call(ctx);
    const variable_list& s = c.tensors;
    at::Tensor dout = grads[0].defined() ? grads[0] : at::zeros_like(s[5]);
    // The lists were checked by the forward (or trusted by its caller), and autograd refuses
    // saved tensors modified in place since: the backward does not read every entry again (on
    // CUDA that check waits for the device).
    auto [dq, dk, dv] = gsa_sparse_backward(s[0], s[1], s[2], s[3], s[4], s[5], s[6], dout, c.cu_q,
                                            c.cu_k, c.scale, true,
                                            at::globalContext().deterministicAlgorithms(), false);
    return {dq, dk, dv, at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(),
            at::Tensor()};
  }
};

at::Tensor gsa_sparse_attention_autograd(const at::Tensor& q, const at::Tensor& k,
                                         const at::Tensor& v, const at::Tensor& indices,
                                         const at::Tensor& counts, const Opt<at::Tensor>& cu_q,
                                         const Opt<at::Tensor>& cu_k, Opt<double> scale,
                                         bool trusted) {
  return GsaSparseFunction::apply(q, k, v, indices, counts, cu_q, cu_k, scale, trusted)[0];
}

at::Tensor gsa_sparse_attention_no_grad(const at::Tensor& q, const at::Tensor& k,
                                        const at::Tensor& v, const at::Tensor& indices,
                                        const at::Tensor& counts, const Opt<at::Tensor>& cu_q,
                                        const Opt<at::Tensor>& cu_k, Opt<double> scale,
                                        bool trusted) {
  return std::get<0>(gsa_sparse_forward(q, k, v, indices, counts, cu_q, cu_k, scale, trusted, false));
}

// The indexer's loss (gsa::indexer_loss_*): per query row KL(p_t || softmax(I_t)) over the row's
// list, or every visible key without lists; differentiable in the indexer's q, k, head weights
// and bias (the attention's q and k are the target's, and get no gradient).
gsa::IndexerLossInputs gsa_loss_inputs(const char* op, const at::Tensor& q, const at::Tensor& k,
                                       const at::Tensor& head_weights, const Opt<at::Tensor>& bias,
                                       const at::Tensor& attention_q, const at::Tensor& attention_k,
                                       const Opt<at::Tensor>& indices, const Opt<at::Tensor>& counts,
                                       const Opt<at::Tensor>& cu_q, const Opt<at::Tensor>& cu_k) {
  if (indices.has_value() != counts.has_value()) {
    throw Error(ErrorKind::invalid_argument,
                std::string(op) + ": argument '" + (indices.has_value() ? "counts" : "indices") +
                    "': expected a tensor with the other half of the key lists, got None");
  }
  gsa::IndexerLossInputs in;
  in.indexer.q = view_of(q, op, "q");
  in.indexer.k = view_of(k, op, "k");
  in.indexer.head_weights = view_of(head_weights, op, "head_weights");
  in.indexer.bias = view_of(bias, op, "bias");
  in.indexer.cu_seqlens_q = view_of(cu_q, op, "cu_seqlens_q");
  in.indexer.cu_seqlens_k = view_of(cu_k, op, "cu_seqlens_k");
  in.q = view_of(attention_q, op, "attention_q");
  in.k = view_of(attention_k, op, "attention_k");
  if (indices.has_value()) {
    // Lists from gsa_select_keys or the caller's: checked by the API either way.
    in.lists = gsa_key_lists(op, *indices, *counts, false);
  }
  return in;
}

gsa::IndexerLossOptions gsa_loss_options(const char* op, c10::string_view form, Opt<double> scale,
                                         Opt<double> attention_scale) {
  gsa::IndexerLossOptions o;
  o.form = gsa_score_form(op, form);
  o.scale = std_opt(scale);
  o.attention_scale = std_opt(attention_scale);
  return o;
}

std::vector<int64_t> gsa_loss_lse_shape(const at::Tensor& q, const at::Tensor& attention_q) {
  std::vector<int64_t> shape = query_rows_shape(q);
  shape.push_back(attention_q.dim() >= 2 ? attention_q.size(attention_q.dim() - 2) + 1 : 1);
  return shape;
}

std::tuple<at::Tensor, at::Tensor> gsa_indexer_loss_forward_op(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& head_weights, const Opt<at::Tensor>& bias,
    const at::Tensor& attention_q, const at::Tensor& attention_k, const Opt<at::Tensor>& indices,
    const Opt<at::Tensor>& counts, const Opt<at::Tensor>& cu_q, const Opt<at::Tensor>& cu_k,
    c10::string_view form, Opt<double> scale, Opt<double> attention_scale, bool reference) {
  constexpr const char* op = "winnow.gsa_indexer_loss_forward";
  return translate_errors([&] {
    const gsa::IndexerLossOptions options = gsa_loss_options(op, form, scale, attention_scale);
    const gsa::IndexerLossInputs in =
        gsa_loss_inputs(op, q, k, head_weights, bias, attention_q, attention_k, indices, counts, cu_q, cu_k);
    at::Tensor loss = at::empty(query_rows_shape(q), q.options().dtype(stats_dtype(q)));
    at::Tensor lse = at::empty(gsa_loss_lse_shape(q, attention_q), q.options().dtype(stats_dtype(q)));
    const DeviceScope scope(q);
    gsa::indexer_loss_forward(in, options, {view_of(loss, op, "loss"), view_of(lse, op, "lse")},
                              scope.context(false, reference));
    return std::make_tuple(loss, lse);
  });
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> gsa_indexer_loss_backward_op(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& head_weights, const Opt<at::Tensor>& bias,
    const at::Tensor& attention_q, const at::Tensor& attention_k, const Opt<at::Tensor>& indices,
    const Opt<at::Tensor>& counts, const at::Tensor& loss, const at::Tensor& lse, const at::Tensor& dloss,
    const Opt<at::Tensor>& cu_q, const Opt<at::Tensor>& cu_k, c10::string_view form, Opt<double> scale,
    Opt<double> attention_scale, bool reference) {
  constexpr const char* op = "winnow.gsa_indexer_loss_backward";
  return translate_errors([&] {
    const gsa::IndexerLossOptions options = gsa_loss_options(op, form, scale, attention_scale);
    const gsa::IndexerLossInputs in =
        gsa_loss_inputs(op, q, k, head_weights, bias, attention_q, attention_k, indices, counts, cu_q, cu_k);
    const auto grad_options = q.options().dtype(stats_dtype(q));
    at::Tensor dq = at::empty(q.sizes(), grad_options), dk = at::empty(k.sizes(), grad_options);
    at::Tensor dw = at::empty(head_weights.sizes(), grad_options);
    at::Tensor dbias = bias.has_value() ? at::empty(bias->sizes(), grad_options) : at::empty({0}, grad_options);
    gsa::IndexerLossGrads grads{view_of(dq, op, "dq"), view_of(dk, op, "dk"), view_of(dw, op, "dhead_weights"),
                                std::nullopt};
    if (bias.has_value()) grads.dbias = view_of(dbias, op, "dbias");
    const DeviceScope scope(q);
    gsa::indexer_loss_backward(in, options, {view_of(loss, op, "loss"), view_of(lse, op, "lse")},
                               view_of(dloss.contiguous(), op, "dloss"), grads, scope.context(false, reference));
    return std::make_tuple(dq, dk, dw, dbias);
  });
}

constexpr Dispatched<&gsa_indexer_loss_forward_op> gsa_indexer_loss_forward{"winnow::gsa_indexer_loss_forward"};
constexpr Dispatched<&gsa_indexer_loss_backward_op> gsa_indexer_loss_backward{"winnow::gsa_indexer_loss_backward"};

struct GsaIndexerLossFunction : public torch::autograd::Function<GsaIndexerLossFunction> {
  static variable_list forward(AutogradContext* ctx, const at::Tensor& q, const at::Tensor& k,
                               const at::Tensor& head_weights, const Opt<at::Tensor>& bias,
                               const at::Tensor& attention_q, const at::Tensor& attention_k,
                               const Opt<at::Tensor>& indices, const Opt<at::Tensor>& counts,
                               const Opt<at::Tensor>& cu_q, const Opt<at::Tensor>& cu_k, c10::string_view form,
                               Opt<double> scale, Opt<double> attention_scale) {
    auto [loss, lse] = gsa_indexer_loss_forward(q, k, head_weights, bias, attention_q, attention_k, indices, counts,
                                                cu_q, cu_k, form, scale, attention_scale, false);
    auto or_undefined = [](const Opt<at::Tensor>& t) { return t.has_value() ? *t : at::Tensor(); };
    save_call(ctx, {q, k, head_weights, or_undefined(bias), attention_q, attention_k, or_undefined(indices),
                    or_undefined(counts), loss, lse},
              cu_q, cu_k, scale, true);
    ctx->saved_data["form"] = std::string(form);
    ctx->saved_data["attention_scale"] = attention_scale.has_value() ? c10::IValue(*attention_scale) : c10::IValue();
    return {loss};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const SavedCall c = saved_call(ctx);
    const variable_list& s = c.tensors;
    auto opt = [](const at::Tensor& t) { return t.defined() ? Opt<at::Tensor>(t) : Opt<at::Tensor>(); };
    const c10::IValue& saved_attention_scale = ctx->saved_data["attention_scale"];
    const Opt<double> attention_scale =
        saved_attention_scale.isNone() ? Opt<double>() : Opt<double>(saved_attention_scale.toDouble());
    const std::string form = ctx->saved_data["form"].toStringRef();
    const at::Tensor dloss = grads[0].defined() ? grads[0] : at::zeros_like(s[8]);
    auto [dq, dk, dw, dbias] =
        gsa_indexer_loss_backward(s[0], s[1], s[2], opt(s[3]), s[4], s[5], opt(s[6]), opt(s[7]), s[8], s[9], dloss,
                                  c.cu_q, c.cu_k, c10::string_view(form), c.scale, attention_scale, false);
    return {dq.to(s[0].scalar_type()),
            dk.to(s[1].scalar_type()),
            dw.to(s[2].scalar_type()),
            s[3].defined() ? dbias.to(s[3].scalar_type()) : at::Tensor(),
            at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(),
            at::Tensor(), at::Tensor()};
  }
};

at::Tensor gsa_indexer_loss_autograd(const at::Tensor& q, const at::Tensor& k, const at::Tensor& head_weights,
                                     const Opt<at::Tensor>& bias, const at::Tensor& attention_q,
                                     const at::Tensor& attention_k, const Opt<at::Tensor>& indices,
                                     const Opt<at::Tensor>& counts, const Opt<at::Tensor>& cu_q,
                                     const Opt<at::Tensor>& cu_k, c10::string_view form, Opt<double> scale,
                                     Opt<double> attention_scale) {
  return GsaIndexerLossFunction::apply(q, k, head_weights, bias, attention_q, attention_k, indices, counts, cu_q,
                                       cu_k, form, scale, attention_scale)[0];
}

at::Tensor gsa_indexer_loss_no_grad(const at::Tensor& q, const at::Tensor& k, const at::Tensor& head_weights,
                                    const Opt<at::Tensor>& bias, const at::Tensor& attention_q,
                                    const at::Tensor& attention_k, const Opt<at::Tensor>& indices,
                                    const Opt<at::Tensor>& counts, const Opt<at::Tensor>& cu_q,
                                    const Opt<at::Tensor>& cu_k, c10::string_view form, Opt<double> scale,
                                    Opt<double> attention_scale) {
  return std::get<0>(gsa_indexer_loss_forward(q, k, head_weights, bias, attention_q, attention_k, indices, counts,
                                              cu_q, cu_k, form, scale, attention_scale, false));
}

// ------------------------------------------------------------------ RMSNorm

// x (..., C) as the (N, C) rows the kernels take: a view when x's leading dimensions allow one.
at::Tensor as_rows(const char* op, const char* name, const at::Tensor& t) {
  check_value(t.defined() && t.dim() >= 1, [&] {
    return std::string(op) + ": argument '" + name + "': expected a tensor of at least 1 dimension, got " +
        (t.defined() ? "a 0-dimensional tensor" : "None");
  });
  const int64_t cols = t.size(-1);
  return t.reshape({cols == 0 ? 0 : t.numel() / cols, cols});
}

std::tuple<at::Tensor, at::Tensor> rms_norm_forward_op(const at::Tensor& x, const at::Tensor& weight,
                                                       double eps, Opt<at::ScalarType> out_dtype) {
  constexpr const char* op = "winnow.rms_norm_forward";
  return translate_errors([&] {
    const at::Tensor rows = as_rows(op, "x", x);
    at::Tensor y = at::empty(x.sizes(), x.options().dtype(out_dtype.value_or(x.scalar_type())));
    at::Tensor rstd = at::empty(stats_shape(x), x.options().dtype(stats_dtype(x)));
    const DeviceScope scope(x);
    rms_norm::forward(view_of(rows, op, "x"), view_of(weight, op, "weight"), eps,
                      view_of(y.view(rows.sizes()), op, "y"), view_of(rstd.view({rows.size(0)}), op, "rstd"),
                      scope.context(false, false));
    return std::make_tuple(y, rstd);
  });
}

std::tuple<at::Tensor, at::Tensor> rms_norm_backward_op(const at::Tensor& dy, const at::Tensor& x,
                                                        const at::Tensor& weight,
                                                        const at::Tensor& rstd) {
  constexpr const char* op = "winnow.rms_norm_backward";
  return translate_errors([&] {
    const at::Tensor rows = as_rows(op, "x", x);
    check_value(dy.defined() && dy.sizes() == x.sizes(), [&] {
      return std::string(op) + ": argument 'dy': expected x's shape " + shape_text(x) + ", got " + shape_text(dy);
    });
    check_value(rstd.defined() && rstd.numel() == rows.size(0), [&] {
      return std::string(op) + ": argument 'rstd': expected x's shape without its last dimension, got " +
          shape_text(rstd);
    });
    at::Tensor dx = at::empty(x.sizes(), x.options());
    at::Tensor dweight = at::empty(weight.sizes(), weight.options());
    const DeviceScope scope(x);
    rms_norm::backward(view_of(dy.reshape(rows.sizes()), op, "dy"), view_of(rows, op, "x"),
                       view_of(weight, op, "weight"), view_of(rstd.reshape({rows.size(0)}), op, "rstd"),
                       view_of(dx.view(rows.sizes()), op, "dx"), view_of(dweight, op, "dweight"),
                       scope.context(false, false));
    return std::make_tuple(dx, dweight);
  });
}

constexpr Dispatched<&rms_norm_forward_op> rms_norm_forward{"winnow::rms_norm_forward"};
constexpr Dispatched<&rms_norm_backward_op> rms_norm_backward{"winnow::rms_norm_backward"};

struct RMSNormFunction : public torch::autograd::Function<RMSNormFunction> {
  static variable_list forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& weight,
                               double eps, Opt<at::ScalarType> out_dtype) {
    auto [y, rstd] = rms_norm_forward(x, weight, eps, out_dtype);
    ctx->save_for_backward({x, weight, rstd});
    return {y};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    at::Tensor dx, dweight;
    if (grads[0].defined()) std::tie(dx, dweight) = rms_norm_backward(grads[0], saved[0], saved[1], saved[2]);
    return {dx, dweight, at::Tensor(), at::Tensor()};
  }
};

at::Tensor rms_norm_autograd(const at::Tensor& x, const at::Tensor& weight, double eps,
                             Opt<at::ScalarType> out_dtype) {
  return RMSNormFunction::apply(x, weight, eps, out_dtype)[0];
}

at::Tensor rms_norm_no_grad(const at::Tensor& x, const at::Tensor& weight, double eps,
                            Opt<at::ScalarType> out_dtype) {
  return std::get<0>(rms_norm_forward(x, weight, eps, out_dtype));
}

// The residual form: (sum, y) = (x + residual, rms_norm(x + residual)), residual in y's dtype.
std::tuple<at::Tensor, at::Tensor, at::Tensor> add_rms_norm_forward_op(
    const at::Tensor& x, const at::Tensor& residual, const at::Tensor& weight, double eps,
    Opt<at::ScalarType> out_dtype) {
  constexpr const char* op = "winnow.add_rms_norm_forward";
  return translate_errors([&] {
    const at::Tensor rows = as_rows(op, "x", x);
    check_value(residual.defined() && residual.sizes() == x.sizes(), [&] {
      return std::string(op) + ": argument 'residual': expected x's shape " + shape_text(x) + ", got " +
          shape_text(residual);
    });
    at::Tensor sum = at::empty(x.sizes(), x.options());
    at::Tensor y = at::empty(x.sizes(), x.options().dtype(out_dtype.value_or(x.scalar_type())));
    at::Tensor rstd = at::empty(stats_shape(x), x.options().dtype(stats_dtype(x)));
    const DeviceScope scope(x);
    rms_norm::add_forward(view_of(rows, op, "x"), view_of(residual.reshape(rows.sizes()), op, "residual"),
                          view_of(weight, op, "weight"), eps, view_of(sum.view(rows.sizes()), op, "sum"),
                          view_of(y.view(rows.sizes()), op, "y"), view_of(rstd.view({rows.size(0)}), op, "rstd"),
                          scope.context(false, false));
    return std::make_tuple(sum, y, rstd);
  });
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> add_rms_norm_backward_op(
    const at::Tensor& dy, const Opt<at::Tensor>& dsum, const at::Tensor& sum,
    const at::Tensor& weight, const at::Tensor& rstd) {
  constexpr const char* op = "winnow.add_rms_norm_backward";
  return translate_errors([&] {
    const at::Tensor rows = as_rows(op, "sum", sum);
    check_value(dy.defined() && dy.sizes() == sum.sizes(), [&] {
      return std::string(op) + ": argument 'dy': expected sum's shape " + shape_text(sum) + ", got " + shape_text(dy);
    });
    const bool has_dsum = dsum.has_value() && dsum->defined();
    check_value(!has_dsum || dsum->sizes() == sum.sizes(), [&] {
      return std::string(op) + ": argument 'dsum': expected sum's shape " + shape_text(sum) + ", got " +
          (has_dsum ? shape_text(*dsum) : std::string("None"));
    });
    check_value(rstd.defined() && rstd.numel() == rows.size(0), [&] {
      return std::string(op) + ": argument 'rstd': expected sum's shape without its last dimension, got " +
          shape_text(rstd);
    });
    at::Tensor dx = at::empty(sum.sizes(), sum.options());
    at::Tensor dresidual = at::empty(sum.sizes(), dy.options());
    at::Tensor dweight = at::empty(weight.sizes(), weight.options());
    const DeviceScope scope(sum);
    std::optional<TensorView> dsum_view;
    if (has_dsum) dsum_view = view_of(dsum->reshape(rows.sizes()), op, "dsum");
    rms_norm::add_backward(view_of(dy.reshape(rows.sizes()), op, "dy"), dsum_view ? &*dsum_view : nullptr,
                           view_of(rows, op, "sum"), view_of(weight, op, "weight"),
                           view_of(rstd.reshape({rows.size(0)}), op, "rstd"),
                           view_of(dx.view(rows.sizes()), op, "dx"),
                           view_of(dresidual.view(rows.sizes()), op, "dresidual"),
                           view_of(dweight, op, "dweight"), scope.context(false, false));
    return std::make_tuple(dx, dresidual, dweight);
  });
}

constexpr Dispatched<&add_rms_norm_forward_op> add_rms_norm_forward{"winnow::add_rms_norm_forward"};
constexpr Dispatched<&add_rms_norm_backward_op> add_rms_norm_backward{"winnow::add_rms_norm_backward"};

struct AddRMSNormFunction : public torch::autograd::Function<AddRMSNormFunction> {
  static variable_list forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& residual,
                               const at::Tensor& weight, double eps, Opt<at::ScalarType> out_dtype) {
    auto [sum, y, rstd] = add_rms_norm_forward(x, residual, weight, eps, out_dtype);
    ctx->save_for_backward({sum, weight, rstd});
    ctx->saved_data["residual_dtype"] = static_cast<int64_t>(residual.scalar_type());
    return {sum, y};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const at::Tensor& dsum = grads[0];
    const at::Tensor& dy = grads[1];
    at::Tensor dx, dresidual, dweight;
    if (dy.defined()) {
      std::tie(dx, dresidual, dweight) =
          add_rms_norm_backward(dy, dsum.defined() ? Opt<at::Tensor>(dsum) : Opt<at::Tensor>(),
                                saved[0], saved[1], saved[2]);
    } else if (dsum.defined()) {
      // Only the sum was used: the norm contributes nothing.
      dx = dsum;
      dresidual = dsum.to(static_cast<at::ScalarType>(ctx->saved_data["residual_dtype"].toInt()));
    }
    return {dx, dresidual, dweight, at::Tensor(), at::Tensor()};
  }
};

std::tuple<at::Tensor, at::Tensor> add_rms_norm_autograd(const at::Tensor& x, const at::Tensor& residual,
                                                         const at::Tensor& weight, double eps,
                                                         Opt<at::ScalarType> out_dtype) {
  const auto out = AddRMSNormFunction::apply(x, residual, weight, eps, out_dtype);
  return std::make_tuple(out[0], out[1]);
}

std::tuple<at::Tensor, at::Tensor> add_rms_norm_no_grad(const at::Tensor& x, const at::Tensor& residual,
                                                        const at::Tensor& weight, double eps,
                                                        Opt<at::ScalarType> out_dtype) {
  auto [sum, y, rstd] = add_rms_norm_forward(x, residual, weight, eps, out_dtype);
  return std::make_tuple(sum, y);
}

// ------------------------------------------------------------------ SwiGLU

at::Tensor swiglu_forward_op(const at::Tensor& gate, const at::Tensor& up) {
  constexpr const char* op = "winnow.swiglu_forward";
  return translate_errors([&] {
    const at::Tensor g = as_rows(op, "gate", gate);
    check_value(up.defined() && up.sizes() == gate.sizes(), [&] {
      return std::string(op) + ": argument 'up': expected gate's shape " + shape_text(gate) + ", got " +
          shape_text(up);
    });
    at::Tensor y = at::empty(gate.sizes(), gate.options());
    const DeviceScope scope(gate);
    swiglu::forward(view_of(g, op, "gate"), view_of(up.reshape(g.sizes()), op, "up"),
                    view_of(y.view(g.sizes()), op, "y"), scope.context(false, false));
    return y;
  });
}

// The backward into dgate and dup given (gate's shape, any row strides).
void swiglu_backward_into(const char* op, const at::Tensor& dy, const at::Tensor& gate, const at::Tensor& up,
                          const at::Tensor& dgate, const at::Tensor& dup) {
  const at::Tensor g = as_rows(op, "gate", gate);
  for (const auto& [name, t] : {std::pair<const char*, const at::Tensor&>{"dy", dy}, {"up", up}}) {
    check_value(t.defined() && t.sizes() == gate.sizes(), [&] {
      return std::string(op) + ": argument '" + name + "': expected gate's shape " + shape_text(gate) +
          ", got " + shape_text(t);
    });
  }
  const DeviceScope scope(gate);
  swiglu::backward(view_of(dy.reshape(g.sizes()), op, "dy"), view_of(g, op, "gate"),
                   view_of(up.reshape(g.sizes()), op, "up"), view_of(dgate.view(g.sizes()), op, "dgate"),
                   view_of(dup.view(g.sizes()), op, "dup"), scope.context(false, false));
}

std::tuple<at::Tensor, at::Tensor> swiglu_backward_op(const at::Tensor& dy, const at::Tensor& gate,
                                                      const at::Tensor& up) {
  constexpr const char* op = "winnow.swiglu_backward";
  return translate_errors([&] {
    at::Tensor dgate = at::empty(gate.sizes(), gate.options());
    at::Tensor dup = at::empty(gate.sizes(), gate.options());
    swiglu_backward_into(op, dy, gate, up, dgate, dup);
    return std::make_tuple(dgate, dup);
  });
}

constexpr Dispatched<&swiglu_forward_op> swiglu_forward{"winnow::swiglu_forward"};
constexpr Dispatched<&swiglu_backward_op> swiglu_backward{"winnow::swiglu_backward"};

struct SwiGLUFunction : public torch::autograd::Function<SwiGLUFunction> {
  static variable_list forward(AutogradContext* ctx, const at::Tensor& gate, const at::Tensor& up) {
    ctx->save_for_backward({gate, up});
    return {swiglu_forward(gate, up)};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    at::Tensor dgate, dup;
    if (!grads[0].defined()) return {dgate, dup};
    if (side_by_side({saved[0], saved[1]}).defined()) {
      // gate and up are the halves of one packed projection (nn::project): the gradients side
      // by side too, so that its backward reads them as one tensor instead of concatenating them.
      std::vector<int64_t> shape(saved[0].sizes().begin(), saved[0].sizes().end());
      const int64_t c = shape.back();
      shape.back() = 2 * c;
      const at::Tensor both = at::empty(shape, saved[0].options());
      dgate = both.narrow(-1, 0, c);
      dup = both.narrow(-1, c, c);
      translate_errors([&] { swiglu_backward_into("winnow.swiglu_backward", grads[0], saved[0], saved[1], dgate, dup); });
      return {dgate, dup};
    }
    std::tie(dgate, dup) = swiglu_backward(grads[0], saved[0], saved[1]);
    return {dgate, dup};
  }
};

at::Tensor swiglu_autograd(const at::Tensor& gate, const at::Tensor& up) {
  return SwiGLUFunction::apply(gate, up)[0];
}

at::Tensor swiglu_no_grad(const at::Tensor& gate, const at::Tensor& up) {
  return swiglu_forward(gate, up);
}

// ------------------------------------------------------------------ Meta kernels
// What each forward and backward operator returns, computed from shapes alone: the same
// shapes, dtypes and strides as the kernels above allocate, from symbolic sizes, so that the
// meta device, fake tensors and torch.compile's tracing (dynamic shapes included) never
// reach a kernel. The full argument checks run with the kernel, on real tensors.
// ------------------------------------------------------------------ decoding (paged caches)

// One decode step against a paged cache (winnow/decode.h); inference only, no autograd.
std::tuple<at::Tensor, at::Tensor> paged_decode_op(const at::Tensor& q, const at::Tensor& k_cache,
                                                   const at::Tensor& v_cache, const at::Tensor& block_table,
                                                   const at::Tensor& seq_lens, c10::string_view mechanism,
                                                   Opt<double> scale, Opt<bool> attend_current, bool trusted,
                                                   bool reference) {
  constexpr const char* op = "winnow.paged_decode";
  return translate_errors([&] {
    const bool stick_breaking = mechanism == "stick_breaking";
    check_value(stick_breaking || mechanism == "softmax", [&] {
      return std::string(op) + ": argument 'mechanism': expected \"softmax\" or \"stick_breaking\", got \"" +
             std::string(mechanism) + "\"";
    });
    at::Tensor out = at::empty(out_shape(q, v_cache), q.options());
    at::Tensor stat = at::empty(stats_shape(q), q.options().dtype(stats_dtype(q)));
    decode::PagedCache cache{view_of(k_cache, op, "k_cache"), view_of(v_cache, op, "v_cache"),
                             view_of(block_table, op, "block_table"), view_of(seq_lens, op, "seq_lens"), trusted};
    const DeviceScope scope(q);
    const ExecContext ctx = scope.context(false, reference);
    if (stick_breaking) {
      stick_breaking::Options o;
      o.scale = std_opt(scale);
      o.attend_current = attend_current.value_or(false);
      decode::stick_breaking(view_of(q, op, "q"), cache, o,
                             {view_of(out, op, "out"), view_of(stat, op, "log_rem"), std::nullopt}, ctx);
    } else {
      softmax::Options o{std_opt(scale), attend_current.value_or(true)};
      decode::softmax(view_of(q, op, "q"), cache, o, {view_of(out, op, "out"), view_of(stat, op, "lse")}, ctx);
    }
    return std::make_tuple(out, stat);
  });
}

constexpr Dispatched<&paged_decode_op> paged_decode_dispatched{"winnow::paged_decode"};

// Decoding has no gradient: the outputs never require grad, as for the selection above.
std::tuple<at::Tensor, at::Tensor> paged_decode_autograd(const at::Tensor& q, const at::Tensor& k_cache,
                                                         const at::Tensor& v_cache, const at::Tensor& block_table,
                                                         const at::Tensor& seq_lens, c10::string_view mechanism,
                                                         Opt<double> scale, Opt<bool> attend_current, bool trusted,
                                                         bool reference) {
  const at::AutoDispatchBelowADInplaceOrView below_autograd;
  return paged_decode_dispatched(q, k_cache, v_cache, block_table, seq_lens, mechanism, scale, attend_current,
                                 trusted, reference);
}

namespace meta {

// Ranks only: enough to build the output shapes safely. q, k, v are (B, L, H, D) or packed
// (T, H, D).
void check_rank(const char* op, const char* name, const at::Tensor& t) {
  check_value(t.defined() && (t.dim() == 3 || t.dim() == 4), [&] {
    return std::string(op) + ": argument '" + name + "': expected a tensor of 3 or 4 dimensions, got " +
        (t.defined() ? std::to_string(t.dim()) + " dimensions" : std::string("None"));
  });
}

void check_attention(const char* op, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
  check_rank(op, "q", q);
  check_rank(op, "k", k);
  check_rank(op, "v", v);
}

std::vector<c10::SymInt> out_shape(const at::Tensor& q, const at::Tensor& v) {
  std::vector<c10::SymInt> shape = q.sym_sizes().vec();
  shape.back() = v.sym_sizes().back();
  return shape;
}

std::vector<c10::SymInt> stats_shape(const at::Tensor& q) {
  std::vector<c10::SymInt> shape = q.sym_sizes().vec();
  shape.pop_back();
  return shape;
}

at::Tensor out(const at::Tensor& q, const at::Tensor& v) {
  return at::empty_symint(out_shape(q, v), q.options());
}
at::Tensor stats(const at::Tensor& q) {
  return at::empty_symint(stats_shape(q), q.options().dtype(stats_dtype(q)));
}
at::Tensor counts(const at::Tensor& q) {
  return at::empty_symint(stats_shape(q), q.options().dtype(at::kInt));
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> grads(const char* op, const at::Tensor& q,
                                                     const at::Tensor& k, const at::Tensor& v) {
  check_attention(op, q, k, v);
  return std::make_tuple(at::empty_like(q), at::empty_like(k), at::empty_like(v));
}

std::tuple<at::Tensor, at::Tensor> softmax_forward(const at::Tensor& q, const at::Tensor& k,
                                                   const at::Tensor& v, const Opt<at::Tensor>&,
                                                   const Opt<at::Tensor>&, Opt<double>, bool, bool) {
  check_attention("winnow.softmax_attention_forward", q, k, v);
  return std::make_tuple(out(q, v), stats(q));
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> softmax_backward(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor&,
    const at::Tensor&, const at::Tensor&, const Opt<at::Tensor>&, const Opt<at::Tensor>&,
    Opt<double>, bool, bool, bool) {
  return grads("winnow.softmax_attention_backward", q, k, v);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> stick_breaking_forward(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const Opt<at::Tensor>&,
    const Opt<at::Tensor>&, Opt<double>, bool, double, bool) {
  check_attention("winnow.stick_breaking_attention_forward", q, k, v);
  return std::make_tuple(out(q, v), stats(q), counts(q));
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> stick_breaking_backward(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor&,
    const at::Tensor&, const Opt<at::Tensor>&, const at::Tensor&, const Opt<at::Tensor>&,
    const Opt<at::Tensor>&, const Opt<at::Tensor>&, Opt<double>, bool, double, bool, bool) {
  return grads("winnow.stick_breaking_attention_backward", q, k, v);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> entmax_forward(const at::Tensor& q, const at::Tensor& k,
                                                              const at::Tensor& v, const Opt<at::Tensor>&,
                                                              const Opt<at::Tensor>&, Opt<double>, bool,
                                                              double, Opt<double>, bool, bool keep_support) {
  check_attention("winnow.entmax_attention_forward", q, k, v);
  const c10::SymInt record = keep_support ? support_record_length<c10::SymInt>(q.sym_sizes(), k.sym_sizes())
                                          : c10::SymInt(0);
  return std::make_tuple(out(q, v), stats(q), at::empty_symint({record}, q.options().dtype(at::kInt)));
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> entmax_backward(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor&,
    const at::Tensor&, const at::Tensor&, const Opt<at::Tensor>&, const Opt<at::Tensor>&,
    Opt<double>, bool, double, bool, bool, const Opt<at::Tensor>&) {
  return grads("winnow.entmax_attention_backward", q, k, v);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> sieve_forward(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const Opt<at::Tensor>&,
    const Opt<at::Tensor>&, Opt<double>, bool, double, c10::string_view, Opt<double>,
    Opt<double>, bool) {
  check_attention("winnow.sieve_attention_forward", q, k, v);
  return std::make_tuple(out(q, v), stats(q), stats(q), counts(q));
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> sieve_backward(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor&,
    const at::Tensor&, const at::Tensor&, const at::Tensor&, const Opt<at::Tensor>&,
    const Opt<at::Tensor>&, const Opt<at::Tensor>&, Opt<double>, bool, double, c10::string_view,
    Opt<double>, bool, bool) {
  return grads("winnow.sieve_attention_backward", q, k, v);
}

at::Tensor rotary_apply(const at::Tensor& x, const at::Tensor&, const at::Tensor&, bool) {
  check_value(x.defined() && x.dim() == 4, [&] {
    return std::string("winnow.rotary_embedding_apply: argument 'x': expected a tensor of 4 dimensions, got ") +
        (x.defined() ? std::to_string(x.dim()) + " dimensions" : std::string("None"));
  });
  return at::empty_symint(x.sym_sizes(), x.options());
}

std::tuple<at::Tensor, at::Tensor> rms_norm_forward(const at::Tensor& x, const at::Tensor&, double,
                                                    Opt<at::ScalarType> out_dtype) {
  check_value(x.defined() && x.dim() >= 1, [&] {
    return "winnow.rms_norm_forward: argument 'x': expected a tensor of at least 1 dimension";
  });
  return std::make_tuple(
      at::empty_symint(x.sym_sizes(), x.options().dtype(out_dtype.value_or(x.scalar_type()))),
      stats(x));
}

std::tuple<at::Tensor, at::Tensor> rms_norm_backward(const at::Tensor&, const at::Tensor& x,
                                                     const at::Tensor& weight, const at::Tensor&) {
  check_value(x.defined() && x.dim() >= 1, [&] {
    return "winnow.rms_norm_backward: argument 'x': expected a tensor of at least 1 dimension";
  });
  return std::make_tuple(at::empty_symint(x.sym_sizes(), x.options()),
                         at::empty_symint(weight.sym_sizes(), weight.options()));
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> add_rms_norm_forward(const at::Tensor& x,
                                                                    const at::Tensor&,
                                                                    const at::Tensor&, double,
                                                                    Opt<at::ScalarType> out_dtype) {
  check_value(x.defined() && x.dim() >= 1, [&] {
    return "winnow.add_rms_norm_forward: argument 'x': expected a tensor of at least 1 dimension";
  });
  return std::make_tuple(
      at::empty_symint(x.sym_sizes(), x.options()),
      at::empty_symint(x.sym_sizes(), x.options().dtype(out_dtype.value_or(x.scalar_type()))),
      stats(x));
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> add_rms_norm_backward(const at::Tensor& dy,
                                                                     const Opt<at::Tensor>&,
                                                                     const at::Tensor& sum,
                                                                     const at::Tensor& weight,
                                                                     const at::Tensor&) {
  check_value(sum.defined() && sum.dim() >= 1, [&] {
    return "winnow.add_rms_norm_backward: argument 'sum': expected a tensor of at least 1 dimension";
  });
  return std::make_tuple(at::empty_symint(sum.sym_sizes(), sum.options()),
                         at::empty_symint(sum.sym_sizes(), dy.options()),
                         at::empty_symint(weight.sym_sizes(), weight.options()));
}

at::Tensor swiglu_forward(const at::Tensor& gate, const at::Tensor&) {
  check_value(gate.defined() && gate.dim() >= 1, [&] {
    return "winnow.swiglu_forward: argument 'gate': expected a tensor of at least 1 dimension";
  });
  return at::empty_symint(gate.sym_sizes(), gate.options());
}

std::tuple<at::Tensor, at::Tensor> swiglu_backward(const at::Tensor&, const at::Tensor& gate,
                                                   const at::Tensor&) {
  check_value(gate.defined() && gate.dim() >= 1, [&] {
    return "winnow.swiglu_backward: argument 'gate': expected a tensor of at least 1 dimension";
  });
  return std::make_tuple(at::empty_symint(gate.sym_sizes(), gate.options()),
                         at::empty_symint(gate.sym_sizes(), gate.options()));
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> threshold_forward(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor&,
    const Opt<at::Tensor>& lam, const Opt<at::Tensor>&, const Opt<at::Tensor>&,
    const Opt<at::Tensor>& cu_q, const Opt<at::Tensor>&, double, bool, bool, double,
    bool count_nonzero, bool, bool keep_rows) {
  check_attention("winnow.threshold_attention_forward", q, k, v);
  const c10::SymInt rows =
      keep_rows ? saved_rows_length<c10::SymInt>(q.sym_sizes(), k.sym_sizes(), q.element_size(), lam.has_value(),
                                                 cu_q.has_value() ? cu_q->sym_sizes()[0] : c10::SymInt(1))
                : c10::SymInt(0);
  return std::make_tuple(out(q, v), count_nonzero ? counts(q) : at::empty({0}, q.options().dtype(at::kInt)),
                         at::empty_symint({rows}, q.options().dtype(at::kInt)));
}

ThresholdGrads threshold_backward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                  const at::Tensor& beta, const Opt<at::Tensor>& lam,
                                  const Opt<at::Tensor>& q2, const Opt<at::Tensor>& k2,
                                  const at::Tensor&, const Opt<at::Tensor>&, const Opt<at::Tensor>&,
                                  double, bool, bool, double, bool, bool, const Opt<at::Tensor>&) {
  auto [dq, dk, dv] = grads("winnow.threshold_attention_backward", q, k, v);
  const bool tda = lam.has_value();
  return std::make_tuple(dq, dk, dv, at::empty_like(beta),
                         tda ? at::empty_like(*lam) : at::empty({0}, beta.options()),
                         tda && q2.has_value() ? at::empty_like(*q2) : at::empty({0}, q.options()),
                         tda && k2.has_value() ? at::empty_like(*k2) : at::empty({0}, k.options()));
}

std::tuple<at::Tensor, at::Tensor> screening_forward(const at::Tensor& q, const at::Tensor& k,
                                                     const at::Tensor& v, const at::Tensor&,
                                                     const at::Tensor&, const Opt<at::Tensor>&,
                                                     const Opt<at::Tensor>&, double, double, double,
                                                     bool) {
  check_attention("winnow.screening_attention_forward", q, k, v);
  return std::make_tuple(out(q, v), stats(q));
}

ScreeningGrads screening_backward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                  const at::Tensor& s_w, const at::Tensor& s_r, const at::Tensor&,
                                  const at::Tensor&, const at::Tensor&, const Opt<at::Tensor>&,
                                  const Opt<at::Tensor>&, double, double, double, bool) {
  auto [dq, dk, dv] = grads("winnow.screening_attention_backward", q, k, v);
  return std::make_tuple(dq, dk, dv, at::empty_like(s_w), at::empty_like(s_r));
}

// GSA: the indexer's lists (B, Lq, k_max) or (Tq, k_max) from q without its last two
// dimensions; the sparse attention's outputs like softmax's.
SelectionTensors gsa_select_keys(const at::Tensor& q, const at::Tensor& k, const at::Tensor&,
                                 const Opt<at::Tensor>&, int64_t k_max, const Opt<at::Tensor>&,
                                 const Opt<at::Tensor>&, c10::string_view form, Opt<double> scale,
                                 c10::string_view budget, Opt<int64_t> k_fixed, int64_t k_base,
                                 int64_t k_min, double mean_variance, bool) {
  constexpr const char* op = "winnow.gsa_select_keys";
  translate_errors([&] {
    return gsa_indexer_options(op, form, scale, budget, k_fixed, k_base, k_min, k_max, mean_variance);
  });
  check_rank(op, "q", q);
  check_rank(op, "k", k);
  std::vector<c10::SymInt> rows = q.sym_sizes().vec();
  rows.resize(rows.size() - 2);
  std::vector<c10::SymInt> lists = rows;
  lists.emplace_back(k_max);
  return std::make_tuple(at::empty_symint(lists, q.options().dtype(at::kInt)),
                         at::empty_symint(rows, q.options().dtype(at::kInt)),
                         at::empty_symint(rows, q.options().dtype(stats_dtype(q))));
}

std::tuple<at::Tensor, at::Tensor> gsa_sparse_forward(const at::Tensor& q, const at::Tensor& k,
                                                      const at::Tensor& v, const at::Tensor&,
                                                      const at::Tensor&, const Opt<at::Tensor>&,
                                                      const Opt<at::Tensor>&, Opt<double>, bool,
                                                      bool) {
  check_attention("winnow.gsa_sparse_attention_forward", q, k, v);
  return std::make_tuple(out(q, v), stats(q));
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> gsa_sparse_backward(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor&,
    const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
    const Opt<at::Tensor>&, const Opt<at::Tensor>&, Opt<double>, bool, bool, bool) {
  return grads("winnow.gsa_sparse_attention_backward", q, k, v);
}

// The indexer loss: one float32 (float64) value per query row, and H + 1 log-sum-exps; the
// gradients in that dtype shaped like their inputs (dbias empty without a bias).
std::tuple<at::Tensor, at::Tensor> gsa_indexer_loss_forward(const at::Tensor& q, const at::Tensor& k,
                                                            const at::Tensor&, const Opt<at::Tensor>&,
                                                            const at::Tensor& attention_q, const at::Tensor&,
                                                            const Opt<at::Tensor>&, const Opt<at::Tensor>&,
                                                            const Opt<at::Tensor>&, const Opt<at::Tensor>&,
                                                            c10::string_view, Opt<double>, Opt<double>, bool) {
  constexpr const char* op = "winnow.gsa_indexer_loss_forward";
  check_rank(op, "q", q);
  check_rank(op, "k", k);
  check_rank(op, "attention_q", attention_q);
  std::vector<c10::SymInt> rows = q.sym_sizes().vec();
  rows.resize(rows.size() - 2);
  std::vector<c10::SymInt> lse = rows;
  lse.emplace_back(attention_q.sym_size(attention_q.dim() - 2) + 1);
  const auto options = q.options().dtype(stats_dtype(q));
  return std::make_tuple(at::empty_symint(rows, options), at::empty_symint(lse, options));
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> gsa_indexer_loss_backward(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& head_weights, const Opt<at::Tensor>& bias,
    const at::Tensor&, const at::Tensor&, const Opt<at::Tensor>&, const Opt<at::Tensor>&, const at::Tensor&,
    const at::Tensor&, const at::Tensor&, const Opt<at::Tensor>&, const Opt<at::Tensor>&, c10::string_view,
    Opt<double>, Opt<double>, bool) {
  const auto options = q.options().dtype(stats_dtype(q));
  return std::make_tuple(at::empty_symint(q.sym_sizes(), options), at::empty_symint(k.sym_sizes(), options),
                         at::empty_symint(head_weights.sym_sizes(), options),
                         bias.has_value() ? at::empty_symint(bias->sym_sizes(), options) : at::empty({0}, options));
}

std::tuple<at::Tensor, at::Tensor> paged_decode(const at::Tensor& q, const at::Tensor&, const at::Tensor& v_cache,
                                                const at::Tensor&, const at::Tensor&, c10::string_view,
                                                Opt<double>, Opt<bool>, bool, bool) {
  check_rank("winnow.paged_decode", "q", q);
  check_rank("winnow.paged_decode", "v_cache", v_cache);
  return std::make_tuple(out(q, v_cache), stats(q));
}

}  // namespace meta

}  // namespace

TORCH_LIBRARY(winnow, m) {
  m.def(
      "softmax_attention(Tensor q, Tensor k, Tensor v, *, Tensor? cu_seqlens_q=None, "
      "Tensor? cu_seqlens_k=None, float? scale=None, bool attend_current=True, "
      "Tensor? rotary_cos=None, Tensor? rotary_sin=None) -> Tensor");
  m.def(
      "softmax_attention_forward(Tensor q, Tensor k, Tensor v, Tensor? cu_seqlens_q=None, "
      "Tensor? cu_seqlens_k=None, float? scale=None, bool attend_current=True, "
      "bool reference=False) -> (Tensor out, Tensor lse)");
  m.def(
      "softmax_attention_backward(Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, "
      "Tensor dout, Tensor? cu_seqlens_q=None, Tensor? cu_seqlens_k=None, float? scale=None, "
      "bool attend_current=True, bool deterministic=False, bool reference=False) "
      "-> (Tensor dq, Tensor dk, Tensor dv)");
  m.def(
      "stick_breaking_attention(Tensor q, Tensor k, Tensor v, *, Tensor? cu_seqlens_q=None, "
      "Tensor? cu_seqlens_k=None, float? scale=None, bool attend_current=False, "
      "float halt_cutoff=0.0) -> (Tensor out, Tensor rem)");
  m.def(
      "stick_breaking_attention_forward(Tensor q, Tensor k, Tensor v, "
      "Tensor? cu_seqlens_q=None, Tensor? cu_seqlens_k=None, float? scale=None, "
      "bool attend_current=False, float halt_cutoff=0.0, bool reference=False) "
      "-> (Tensor out, Tensor log_rem, Tensor kept_from)");
  m.def(
      "stick_breaking_attention_backward(Tensor q, Tensor k, Tensor v, Tensor out, "
      "Tensor log_rem, Tensor? kept_from, Tensor dout, Tensor? dlog_rem=None, "
      "Tensor? cu_seqlens_q=None, "
      "Tensor? cu_seqlens_k=None, float? scale=None, bool attend_current=False, "
      "float halt_cutoff=0.0, bool deterministic=False, bool reference=False) "
      "-> (Tensor dq, Tensor dk, Tensor dv)");
  m.def(
      "entmax_attention(Tensor q, Tensor k, Tensor v, *, Tensor? cu_seqlens_q=None, "
      "Tensor? cu_seqlens_k=None, float? scale=None, bool attend_current=True, "
      "float alpha=1.5) -> Tensor");
  m.def(
      "entmax_attention_forward(Tensor q, Tensor k, Tensor v, Tensor? cu_seqlens_q=None, "
      "Tensor? cu_seqlens_k=None, float? scale=None, bool attend_current=True, "
      "float alpha=1.5, float? tolerance=None, bool reference=False, bool keep_support=False) "
      "-> (Tensor out, Tensor tau, Tensor support)");
  m.def(
      "entmax_attention_backward(Tensor q, Tensor k, Tensor v, Tensor out, Tensor tau, "
      "Tensor dout, Tensor? cu_seqlens_q=None, Tensor? cu_seqlens_k=None, float? scale=None, "
      "bool attend_current=True, float alpha=1.5, bool deterministic=False, "
      "bool reference=False, Tensor? support=None) -> (Tensor dq, Tensor dk, Tensor dv)");
  m.def(
      "sieve_attention(Tensor q, Tensor k, Tensor v, *, Tensor? cu_seqlens_q=None, "
      "Tensor? cu_seqlens_k=None, float? scale=None, bool attend_current=False, "
      "float alpha=1.5, str filter=\"exact\", float? eps=None) "
      "-> (Tensor out, Tensor rem, Tensor count)");
  m.def(
      "sieve_attention_forward(Tensor q, Tensor k, Tensor v, Tensor? cu_seqlens_q=None, "
      "Tensor? cu_seqlens_k=None, float? scale=None, bool attend_current=False, "
      "float alpha=1.5, str filter=\"exact\", float? eps=None, float? tolerance=None, "
      "bool reference=False) -> (Tensor out, Tensor log_rem, Tensor threshold, Tensor count)");
  m.def(
      "sieve_attention_backward(Tensor q, Tensor k, Tensor v, Tensor out, Tensor log_rem, "
      "Tensor threshold, Tensor dout, Tensor? dlog_rem=None, Tensor? cu_seqlens_q=None, "
      "Tensor? cu_seqlens_k=None, float? scale=None, bool attend_current=False, "
      "float alpha=1.5, str filter=\"exact\", float? eps=None, bool deterministic=False, "
      "bool reference=False) -> (Tensor dq, Tensor dk, Tensor dv)");
  m.def(
      "threshold_attention(Tensor q, Tensor k, Tensor v, Tensor beta, *, Tensor? lam=None, "
      "Tensor? q2=None, Tensor? k2=None, Tensor? cu_seqlens_q=None, Tensor? cu_seqlens_k=None, "
      "float power=2.0, bool attend_current=True, bool clamp_lambda=True, "
      "float norm_eps=1e-06) -> Tensor");
  m.def(
      "threshold_attention_forward(Tensor q, Tensor k, Tensor v, Tensor beta, Tensor? lam=None, "
      "Tensor? q2=None, Tensor? k2=None, Tensor? cu_seqlens_q=None, Tensor? cu_seqlens_k=None, "
      "float power=2.0, bool attend_current=True, bool clamp_lambda=True, float norm_eps=1e-06, "
      "bool count_nonzero=False, bool reference=False, bool keep_rows=False) "
      "-> (Tensor out, Tensor nonzero, Tensor saved_rows)");
  m.def(
      "threshold_attention_backward(Tensor q, Tensor k, Tensor v, Tensor beta, Tensor? lam, "
      "Tensor? q2, Tensor? k2, Tensor dout, Tensor? cu_seqlens_q=None, "
      "Tensor? cu_seqlens_k=None, float power=2.0, bool attend_current=True, "
      "bool clamp_lambda=True, float norm_eps=1e-06, bool deterministic=False, "
      "bool reference=False, Tensor? saved_rows=None) -> (Tensor dq, Tensor dk, Tensor dv, "
      "Tensor dbeta, Tensor dlam, Tensor dq2, Tensor dk2)");
  m.def(
      "screening_attention(Tensor q, Tensor k, Tensor v, Tensor s_w, Tensor s_r, *, "
      "Tensor? cu_seqlens_q=None, Tensor? cu_seqlens_k=None, float mipe_threshold=256.0, "
      "float expand_windows_above=0.0, float norm_eps=1e-06) -> Tensor");
  m.def(
      "screening_attention_forward(Tensor q, Tensor k, Tensor v, Tensor s_w, Tensor s_r, "
      "Tensor? cu_seqlens_q=None, Tensor? cu_seqlens_k=None, float mipe_threshold=256.0, "
      "float expand_windows_above=0.0, float norm_eps=1e-06, bool reference=False) "
      "-> (Tensor out, Tensor h_norm)");
  m.def(
      "screening_attention_backward(Tensor q, Tensor k, Tensor v, Tensor s_w, Tensor s_r, "
      "Tensor out, Tensor h_norm, Tensor dout, Tensor? cu_seqlens_q=None, "
      "Tensor? cu_seqlens_k=None, float mipe_threshold=256.0, float expand_windows_above=0.0, "
      "float norm_eps=1e-06, bool reference=False) "
      "-> (Tensor dq, Tensor dk, Tensor dv, Tensor ds_w, Tensor ds_r)");
  m.def(
      "gsa_select_keys(Tensor q, Tensor k, Tensor head_weights, Tensor? bias=None, *, "
      "int k_max, Tensor? cu_seqlens_q=None, Tensor? cu_seqlens_k=None, str form=\"sigmoid\", "
      "float? scale=None, str budget=\"inverse_variance\", int? k_fixed=None, int k_base=0, "
      "int k_min=1, float mean_variance=1.0, bool reference=False) "
      "-> (Tensor indices, Tensor counts, Tensor variance)");
  m.def(
      "gsa_sparse_attention(Tensor q, Tensor k, Tensor v, Tensor indices, Tensor counts, *, "
      "Tensor? cu_seqlens_q=None, Tensor? cu_seqlens_k=None, float? scale=None, "
      "bool trusted=False) -> Tensor");
  m.def(
      "gsa_sparse_attention_forward(Tensor q, Tensor k, Tensor v, Tensor indices, Tensor counts, "
      "Tensor? cu_seqlens_q=None, Tensor? cu_seqlens_k=None, float? scale=None, "
      "bool trusted=False, bool reference=False) -> (Tensor out, Tensor lse)");
  m.def(
      "gsa_sparse_attention_backward(Tensor q, Tensor k, Tensor v, Tensor indices, "
      "Tensor counts, Tensor out, Tensor lse, Tensor dout, Tensor? cu_seqlens_q=None, "
      "Tensor? cu_seqlens_k=None, float? scale=None, bool trusted=False, "
      "bool deterministic=False, bool reference=False) -> (Tensor dq, Tensor dk, Tensor dv)");
  m.def(
      "gsa_indexer_loss(Tensor q, Tensor k, Tensor head_weights, Tensor? bias, Tensor attention_q, "
      "Tensor attention_k, Tensor? indices=None, Tensor? counts=None, *, Tensor? cu_seqlens_q=None, "
      "Tensor? cu_seqlens_k=None, str form=\"sigmoid\", float? scale=None, float? attention_scale=None) "
      "-> Tensor");
  m.def(
      "gsa_indexer_loss_forward(Tensor q, Tensor k, Tensor head_weights, Tensor? bias, Tensor attention_q, "
      "Tensor attention_k, Tensor? indices=None, Tensor? counts=None, Tensor? cu_seqlens_q=None, "
      "Tensor? cu_seqlens_k=None, str form=\"sigmoid\", float? scale=None, float? attention_scale=None, "
      "bool reference=False) -> (Tensor loss, Tensor lse)");
  m.def(
      "gsa_indexer_loss_backward(Tensor q, Tensor k, Tensor head_weights, Tensor? bias, Tensor attention_q, "
      "Tensor attention_k, Tensor? indices, Tensor? counts, Tensor loss, Tensor lse, Tensor dloss, "
      "Tensor? cu_seqlens_q=None, Tensor? cu_seqlens_k=None, str form=\"sigmoid\", float? scale=None, "
      "float? attention_scale=None, bool reference=False) "
      "-> (Tensor dq, Tensor dk, Tensor dhead_weights, Tensor dbias)");
  m.def(
      "paged_decode(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_table, Tensor seq_lens, *, "
      "str mechanism=\"softmax\", float? scale=None, bool? attend_current=None, bool trusted=False, "
      "bool reference=False) -> (Tensor out, Tensor stat)");
  m.def("rotary_embedding(Tensor x, Tensor cos, Tensor sin, bool transpose=False) -> Tensor");
  m.def("rotary_embedding_apply(Tensor x, Tensor cos, Tensor sin, bool transpose=False) -> Tensor");
  m.def("rms_norm(Tensor x, Tensor weight, float eps=1e-06, ScalarType? out_dtype=None) -> Tensor");
  m.def(
      "rms_norm_forward(Tensor x, Tensor weight, float eps=1e-06, ScalarType? out_dtype=None) "
      "-> (Tensor y, Tensor rstd)");
  m.def(
      "rms_norm_backward(Tensor dy, Tensor x, Tensor weight, Tensor rstd) "
      "-> (Tensor dx, Tensor dweight)");
  m.def(
      "add_rms_norm(Tensor x, Tensor residual, Tensor weight, float eps=1e-06, "
      "ScalarType? out_dtype=None) -> (Tensor sum, Tensor y)");
  m.def(
      "add_rms_norm_forward(Tensor x, Tensor residual, Tensor weight, float eps=1e-06, "
      "ScalarType? out_dtype=None) -> (Tensor sum, Tensor y, Tensor rstd)");
  m.def(
      "add_rms_norm_backward(Tensor dy, Tensor? dsum, Tensor sum, Tensor weight, Tensor rstd) "
      "-> (Tensor dx, Tensor dresidual, Tensor dweight)");
  m.def("swiglu(Tensor gate, Tensor up) -> Tensor");
  m.def("swiglu_forward(Tensor gate, Tensor up) -> Tensor");
  m.def("swiglu_backward(Tensor dy, Tensor gate, Tensor up) -> (Tensor dgate, Tensor dup)");
}

// The kernel calls dispatch on the tensors' device themselves (winnow's API), so one
// registration serves CPU and CUDA; the Meta kernels above take precedence for meta and fake
// tensors.
TORCH_LIBRARY_IMPL(winnow, CompositeExplicitAutograd, m) {
  m.impl("softmax_attention_forward", softmax_forward_op);
  m.impl("softmax_attention_backward", softmax_backward_op);
  m.impl("stick_breaking_attention_forward", stick_breaking_forward_op);
  m.impl("stick_breaking_attention_backward", stick_breaking_backward_op);
  m.impl("entmax_attention_forward", entmax_forward_op);
  m.impl("entmax_attention_backward", entmax_backward_op);
  m.impl("sieve_attention_forward", sieve_forward_op);
  m.impl("sieve_attention_backward", sieve_backward_op);
  m.impl("threshold_attention_forward", threshold_forward_op);
  m.impl("threshold_attention_backward", threshold_backward_op);
  m.impl("screening_attention_forward", screening_forward_op);
  m.impl("screening_attention_backward", screening_backward_op);
  m.impl("gsa_select_keys", gsa_select_keys_op);
  m.impl("gsa_sparse_attention_forward", gsa_sparse_forward_op);
  m.impl("gsa_sparse_attention_backward", gsa_sparse_backward_op);
  m.impl("gsa_indexer_loss_forward", gsa_indexer_loss_forward_op);
  m.impl("gsa_indexer_loss_backward", gsa_indexer_loss_backward_op);
  m.impl("paged_decode", paged_decode_op);
  m.impl("rotary_embedding_apply", rotary_apply_op);
  m.impl("rms_norm_forward", rms_norm_forward_op);
  m.impl("rms_norm_backward", rms_norm_backward_op);
  m.impl("add_rms_norm_forward", add_rms_norm_forward_op);
  m.impl("add_rms_norm_backward", add_rms_norm_backward_op);
  m.impl("swiglu_forward", swiglu_forward_op);
  m.impl("swiglu_backward", swiglu_backward_op);
}

TORCH_LIBRARY_IMPL(winnow, Meta, m) {
  m.impl("softmax_attention_forward", meta::softmax_forward);
  m.impl("softmax_attention_backward", meta::softmax_backward);
  m.impl("stick_breaking_attention_forward", meta::stick_breaking_forward);
  m.impl("stick_breaking_attention_backward", meta::stick_breaking_backward);
  m.impl("entmax_attention_forward", meta::entmax_forward);
  m.impl("entmax_attention_backward", meta::entmax_backward);
  m.impl("sieve_attention_forward", meta::sieve_forward);
  m.impl("sieve_attention_backward", meta::sieve_backward);
  m.impl("threshold_attention_forward", meta::threshold_forward);
  m.impl("threshold_attention_backward", meta::threshold_backward);
  m.impl("screening_attention_forward", meta::screening_forward);
  m.impl("screening_attention_backward", meta::screening_backward);
  m.impl("gsa_select_keys", meta::gsa_select_keys);
  m.impl("gsa_sparse_attention_forward", meta::gsa_sparse_forward);
  m.impl("gsa_sparse_attention_backward", meta::gsa_sparse_backward);
  m.impl("gsa_indexer_loss_forward", meta::gsa_indexer_loss_forward);
  m.impl("gsa_indexer_loss_backward", meta::gsa_indexer_loss_backward);
  m.impl("paged_decode", meta::paged_decode);
  m.impl("rotary_embedding_apply", meta::rotary_apply);
  m.impl("rms_norm_forward", meta::rms_norm_forward);
  m.impl("rms_norm_backward", meta::rms_norm_backward);
  m.impl("add_rms_norm_forward", meta::add_rms_norm_forward);
  m.impl("add_rms_norm_backward", meta::add_rms_norm_backward);
  m.impl("swiglu_forward", meta::swiglu_forward);
  m.impl("swiglu_backward", meta::swiglu_backward);
}

#if TORCH_VERSION_MAJOR < 2
// LibTorch 1.x has no autograd fallback for meta tensors: let them through to the Meta kernels
// (later versions fall through by themselves).
TORCH_LIBRARY_IMPL(winnow, AutogradMeta, m) {
  for (const char* name : {"softmax_attention_forward", "softmax_attention_backward",
                           "stick_breaking_attention_forward", "stick_breaking_attention_backward",
                           "entmax_attention_forward", "entmax_attention_backward",
                           "sieve_attention_forward", "sieve_attention_backward",
                           "threshold_attention_forward", "threshold_attention_backward",
                           "screening_attention_forward", "screening_attention_backward",
                           "gsa_sparse_attention_forward", "gsa_sparse_attention_backward",
                           "gsa_indexer_loss_forward", "gsa_indexer_loss_backward",
                           "rotary_embedding_apply", "rms_norm_forward", "rms_norm_backward",
                           "add_rms_norm_forward", "add_rms_norm_backward", "swiglu_forward",
                           "swiglu_backward"}) {
    m.impl(name, torch::CppFunction::makeFallthrough());
  }
}
#endif

// The differentiable operators: the autograd kernel records the backward; below autograd
// (inference mode, or tensors that never need gradients) the plain forward runs.
TORCH_LIBRARY_IMPL(winnow, Autograd, m) {
  m.impl("softmax_attention", softmax_attention_autograd);
  m.impl("stick_breaking_attention", stick_breaking_attention_autograd);
  m.impl("entmax_attention", entmax_attention_autograd);
  m.impl("sieve_attention", sieve_attention_autograd);
  m.impl("threshold_attention", threshold_attention_autograd);
  m.impl("screening_attention", screening_attention_autograd);
  m.impl("gsa_select_keys", gsa_select_keys_autograd);
  m.impl("paged_decode", paged_decode_autograd);
  m.impl("gsa_sparse_attention", gsa_sparse_attention_autograd);
  m.impl("gsa_indexer_loss", gsa_indexer_loss_autograd);
  m.impl("rotary_embedding", rotary_embedding_autograd);
  m.impl("rms_norm", rms_norm_autograd);
  m.impl("add_rms_norm", add_rms_norm_autograd);
  m.impl("swiglu", swiglu_autograd);
}

TORCH_LIBRARY_IMPL(winnow, CompositeExplicitAutograd, m) {
  m.impl("softmax_attention", softmax_attention_no_grad);
  m.impl("stick_breaking_attention", stick_breaking_attention_no_grad);
  m.impl("entmax_attention", entmax_attention_no_grad);
  m.impl("sieve_attention", sieve_attention_no_grad);
  m.impl("threshold_attention", threshold_attention_no_grad);
  m.impl("screening_attention", screening_attention_no_grad);
  m.impl("gsa_sparse_attention", gsa_sparse_attention_no_grad);
  m.impl("gsa_indexer_loss", gsa_indexer_loss_no_grad);
  m.impl("rotary_embedding", rotary_embedding_no_grad);
  m.impl("rms_norm", rms_norm_no_grad);
  m.impl("add_rms_norm", add_rms_norm_no_grad);
  m.impl("swiglu", swiglu_no_grad);
}

// The C++ entry points (torch/ops.h) call the registered operators through the dispatcher,
// exactly as Python does.
at::Tensor softmax_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                             const AttentionCall& call) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("winnow::softmax_attention", "")
                       .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                         const Opt<at::Tensor>&, const Opt<at::Tensor>&,
                                         Opt<double>, bool, const Opt<at::Tensor>&, const Opt<at::Tensor>&)>();
  return op.call(q, k, v, call.cu_seqlens_q, call.cu_seqlens_k, call.scale, call.attend_current,
                 call.rotary_cos, call.rotary_sin);
}

std::tuple<at::Tensor, at::Tensor> stick_breaking_attention(const at::Tensor& q,
                                                            const at::Tensor& k,
                                                            const at::Tensor& v,
                                                            const AttentionCall& call,
                                                            double halt_cutoff) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("winnow::stick_breaking_attention", "")
                       .typed<std::tuple<at::Tensor, at::Tensor>(
                           const at::Tensor&, const at::Tensor&, const at::Tensor&,
                           const Opt<at::Tensor>&, const Opt<at::Tensor>&, Opt<double>, bool,
                           double)>();
  return op.call(q, k, v, call.cu_seqlens_q, call.cu_seqlens_k, call.scale, call.attend_current,
                 halt_cutoff);
}

at::Tensor entmax_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                            const AttentionCall& call, double alpha) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("winnow::entmax_attention", "")
                       .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                         const Opt<at::Tensor>&, const Opt<at::Tensor>&,
                                         Opt<double>, bool, double)>();
  return op.call(q, k, v, call.cu_seqlens_q, call.cu_seqlens_k, call.scale, call.attend_current,
                 alpha);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> sieve_attention(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const AttentionCall& call,
    double alpha, const std::string& filter, Opt<double> eps) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("winnow::sieve_attention", "")
                       .typed<std::tuple<at::Tensor, at::Tensor, at::Tensor>(
                           const at::Tensor&, const at::Tensor&, const at::Tensor&,
                           const Opt<at::Tensor>&, const Opt<at::Tensor>&, Opt<double>, bool,
                           double, c10::string_view, Opt<double>)>();
  return op.call(q, k, v, call.cu_seqlens_q, call.cu_seqlens_k, call.scale, call.attend_current,
                 alpha, filter, eps);
}

at::Tensor threshold_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                               const at::Tensor& beta, const AttentionCall& call,
                               const ThresholdViews& views, const ThresholdOptions& options) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("winnow::threshold_attention", "")
                       .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                         const at::Tensor&, const Opt<at::Tensor>&,
                                         const Opt<at::Tensor>&, const Opt<at::Tensor>&,
                                         const Opt<at::Tensor>&, const Opt<at::Tensor>&, double,
                                         bool, bool, double)>();
  return op.call(q, k, v, beta, views.lam, views.q2, views.k2, call.cu_seqlens_q,
                 call.cu_seqlens_k, options.power, call.attend_current, options.clamp_lambda,
                 options.norm_eps);
}

at::Tensor screening_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                               const at::Tensor& s_w, const at::Tensor& s_r, const AttentionCall& call,
                               const ScreeningOptions& options) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("winnow::screening_attention", "")
                       .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                         const at::Tensor&, const at::Tensor&, const Opt<at::Tensor>&,
                                         const Opt<at::Tensor>&, double, double, double)>();
  return op.call(q, k, v, s_w, s_r, call.cu_seqlens_q, call.cu_seqlens_k, options.mipe_threshold,
                 options.expand_windows_above, options.norm_eps);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> gsa_select_keys(const at::Tensor& q, const at::Tensor& k,
                                                               const at::Tensor& head_weights,
                                                               const Opt<at::Tensor>& bias,
                                                               const gsa::IndexerOptions& options,
                                                               const Opt<at::Tensor>& cu_seqlens_q,
                                                               const Opt<at::Tensor>& cu_seqlens_k) {
  static const char* const forms[] = {"sigmoid", "relu"};
  static const char* const budgets[] = {"fixed", "inverse_variance", "eq8", "reference"};
  const bool fixed = options.budget == gsa::Budget::fixed;
  return gsa_select_keys_dispatched(
      q, k, head_weights, bias, options.k_max, cu_seqlens_q, cu_seqlens_k,
      c10::string_view(forms[static_cast<int>(options.form)]),
      options.scale ? Opt<double>(*options.scale) : Opt<double>(),
      c10::string_view(budgets[static_cast<int>(options.budget)]),
      fixed ? Opt<int64_t>(options.k) : Opt<int64_t>(), options.k_base, options.k_min,
      options.mean_variance, false);
}

at::Tensor gsa_sparse_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                const at::Tensor& indices, const at::Tensor& counts,
                                const AttentionCall& call, bool trusted) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("winnow::gsa_sparse_attention", "")
                       .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                         const at::Tensor&, const at::Tensor&,
                                         const Opt<at::Tensor>&, const Opt<at::Tensor>&,
                                         Opt<double>, bool)>();
  return op.call(q, k, v, indices, counts, call.cu_seqlens_q, call.cu_seqlens_k, call.scale, trusted);
}

at::Tensor gsa_indexer_loss(const at::Tensor& q, const at::Tensor& k, const at::Tensor& head_weights,
                            const Opt<at::Tensor>& bias, const at::Tensor& attention_q,
                            const at::Tensor& attention_k, const Opt<at::Tensor>& indices,
                            const Opt<at::Tensor>& counts, const gsa::IndexerLossOptions& options,
                            const Opt<at::Tensor>& cu_seqlens_q, const Opt<at::Tensor>& cu_seqlens_k) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("winnow::gsa_indexer_loss", "")
                       .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                         const Opt<at::Tensor>&, const at::Tensor&, const at::Tensor&,
                                         const Opt<at::Tensor>&, const Opt<at::Tensor>&, const Opt<at::Tensor>&,
                                         const Opt<at::Tensor>&, c10::string_view, Opt<double>, Opt<double>)>();
  const char* form = options.form == gsa::ScoreForm::relu ? "relu" : "sigmoid";
  return op.call(q, k, head_weights, bias, attention_q, attention_k, indices, counts, cu_seqlens_q, cu_seqlens_k,
                 c10::string_view(form), options.scale ? Opt<double>(*options.scale) : Opt<double>(),
                 options.attention_scale ? Opt<double>(*options.attention_scale) : Opt<double>());
}

at::Tensor rotary_embedding(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin,
                            bool transpose) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("winnow::rotary_embedding", "")
                       .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, bool)>();
  return op.call(x, cos, sin, transpose);
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps,
                    Opt<at::ScalarType> out_dtype) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("winnow::rms_norm", "")
                       .typed<at::Tensor(const at::Tensor&, const at::Tensor&, double, Opt<at::ScalarType>)>();
  return op.call(x, weight, eps, out_dtype);
}

std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& residual,
                                                const at::Tensor& weight, double eps,
                                                Opt<at::ScalarType> out_dtype) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("winnow::add_rms_norm", "")
                       .typed<std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&,
                                                                 const at::Tensor&, double,
                                                                 Opt<at::ScalarType>)>();
  return op.call(x, residual, weight, eps, out_dtype);
}

at::Tensor swiglu(const at::Tensor& gate, const at::Tensor& up) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("winnow::swiglu", "")
                       .typed<at::Tensor(const at::Tensor&, const at::Tensor&)>();
  return op.call(gate, up);
}

}  // namespace winnow::torch_ops
