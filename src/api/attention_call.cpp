#include "api/attention_call.h"

#include "core/device_copy.h"

#include <algorithm>
#include <cmath>

namespace winnow::detail {
namespace {

std::string describe(const TensorView& t) {
  return std::string(to_string(t.dtype)) + ' ' + t.shape_string() + " on " + to_string(t.device);
}

std::string shape_string(const std::int64_t* shape, int ndim) {
  TensorView t;
  t.ndim = ndim;
  for (int d = 0; d < ndim; ++d) t.shape[d] = shape[d];
  return t.shape_string();
}

bool dtype_runs_on(DType dtype, Route route) {
  switch (route) {
    case Route::reference: return dtype == DType::float64;
    case Route::cpu: return dtype == DType::float32 || dtype == DType::float64;
    case Route::cuda:
      return dtype == DType::float16 || dtype == DType::bfloat16 || dtype == DType::float32;
  }
  return false;
}

const char* dtypes_of(Route route) {
  switch (route) {
    case Route::reference: return "float64 (the reference backend)";
    case Route::cpu: return "float32 or float64 on the CPU";
    case Route::cuda: return "float16, bfloat16 or float32 on CUDA";
  }
  return "";
}

}  // namespace

AttentionCall::AttentionCall(const char* op, const AttentionInputs& in, const ExecContext& ctx)
    : op_(op), in_(in), ctx_(ctx) {
  varlen_ = in.cu_seqlens_q.has_value();
  if (!varlen_ && in.cu_seqlens_k.has_value()) {
    fail("cu_seqlens_k", "absent unless cu_seqlens_q is given", "a tensor without cu_seqlens_q");
  }
  check_operand("q", in.q);
  check_operand("k", in.k);
  check_operand("v", in.v);

  const TensorView &q = in.q, &k = in.k, &v = in.v;
  const int rank = varlen_ ? 3 : 4;
  const char* layout = varlen_ ? "(T, H, D) with cu_seqlens" : "(B, L, H, D)";
  if (q.ndim != rank) fail("q", std::to_string(rank) + " dimensions " + layout, describe(q));
  if (k.ndim != rank) fail("k", std::to_string(rank) + " dimensions " + layout, describe(k));
  if (v.ndim != rank) fail("v", std::to_string(rank) + " dimensions " + layout, describe(v));

  if (ctx.backend == Backend::reference) {
    route_ = Route::reference;
    if (q.device.kind != DeviceKind::cpu) {
      fail("q", "a CPU tensor (the reference backend runs on the CPU)", describe(q));
    }
  } else {
    route_ = q.device.kind == DeviceKind::cuda ? Route::cuda : Route::cpu;
  }
  if (!dtype_runs_on(q.dtype, route_)) fail("q", dtypes_of(route_), describe(q));
  if (route_ == Route::cuda && !built_with_cuda()) {
    fail("q", "a CPU tensor (this build of winnow has no CUDA kernels)", describe(q),
         ErrorKind::unsupported);
  }
  for (const auto* name : {"k", "v"}) {
    const TensorView& t = name[0] == 'k' ? k : v;
    if (t.dtype != q.dtype) fail(name, std::string(to_string(q.dtype)) + " like q", describe(t));
    if (t.device != q.device) fail(name, "on " + to_string(q.device) + " like q", describe(t));
  }

  const int row = varlen_ ? 0 : 1;  // index of the L (or T) dimension
  const int head = row + 1, dim = row + 2;
  if (!varlen_ && k.shape[0] != q.shape[0]) {
    fail("k", "batch size " + std::to_string(q.shape[0]) + " like q", describe(k));
  }
  if (!varlen_ && v.shape[0] != q.shape[0]) {
    fail("v", "batch size " + std::to_string(q.shape[0]) + " like q", describe(v));
  }
  if (v.shape[row] != k.shape[row]) {
    fail("v", std::to_string(k.shape[row]) + " rows like k", describe(v));
  }
  if (k.shape[dim] != q.shape[dim]) {
    fail("k", "head dimension " + std::to_string(q.shape[dim]) + " like q", describe(k));
  }
  if (v.shape[head] != k.shape[head]) {
    fail("v", std::to_string(k.shape[head]) + " heads like k", describe(v));
  }
  if (q.shape[head] < 1 || k.shape[head] < 1 || q.shape[head] % k.shape[head] != 0) {
    fail("k", "a number of heads >= 1 dividing q's " + std::to_string(q.shape[head]) +
                  " (grouped-query attention)",
         describe(k));
  }
  if (q.shape[dim] < 1) fail("q", "head dimension >= 1", describe(q));
  if (v.shape[dim] < 1) fail("v", "head dimension >= 1", describe(v));

  AttentionParams& p = params_;
  p.dtype = q.dtype;
  p.heads_q = q.shape[head];
  p.heads_kv = k.shape[head];
  p.dim_qk = q.shape[dim];
  p.dim_v = v.shape[dim];
  p.rows_q = varlen_ ? q.shape[0] : q.shape[0] * q.shape[1];
  p.rows_k = varlen_ ? k.shape[0] : k.shape[0] * k.shape[1];
  p.q = operand(q, row);
  p.k = operand(k, row);
  p.v = operand(v, row);
  p.num_threads = ctx.num_threads;
  p.deterministic = ctx.deterministic;
  p.cuda_stream = ctx.cuda_stream;
  p.allocator = ctx.allocator;

  if (!varlen_) {
    p.num_seqs = q.shape[0];
    p.len_q = q.shape[1];
    p.len_k = k.shape[1];
    if (p.len_q > p.len_k) {
      fail("q", "at most as many rows as k (queries are the last positions of the keys)",
           describe(q) + " against k " + describe(k));
    }
    p.max_len_q = p.len_q;
    p.max_len_k = p.len_k;
    return;
  }

  const TensorView& cu_q = *in.cu_seqlens_q;
  const TensorView& cu_k = in.cu_seqlens_k ? *in.cu_seqlens_k : cu_q;
  const std::vector<std::int32_t> offsets_q = check_cu_seqlens("cu_seqlens_q", cu_q, q.shape[0]);
  const std::vector<std::int32_t> offsets_k = check_cu_seqlens(
      in.cu_seqlens_k ? "cu_seqlens_k" : "cu_seqlens_q (used for k)", cu_k, k.shape[0]);
  if (cu_k.shape[0] != cu_q.shape[0]) {
    fail("cu_seqlens_k", std::to_string(cu_q.shape[0]) + " entries like cu_seqlens_q",
         describe(cu_k));
  }
  p.num_seqs = cu_q.shape[0] - 1;
  // Kernels read the offsets where they run; the checks below use the host copies.
  p.cu_seqlens_q = static_cast<const std::int32_t*>(cu_q.data);
  p.cu_seqlens_k = static_cast<const std::int32_t*>(cu_k.data);
  for (std::int64_t b = 0; b < p.num_seqs; ++b) {
    const std::int64_t q_len = offsets_q[b + 1] - offsets_q[b];
    const std::int64_t k_len = offsets_k[b + 1] - offsets_k[b];
    if (q_len > k_len) {
      fail("cu_seqlens_q", "sequence lengths at most those of cu_seqlens_k",
           "sequence " + std::to_string(b) + " with " + std::to_string(q_len) + " queries and " +
               std::to_string(k_len) + " keys");
    }
    p.max_len_q = std::max(p.max_len_q, q_len);
    p.max_len_k = std::max(p.max_len_k, k_len);
  }
}

void AttentionCall::fail(const std::string& arg, const std::string& expected,
                         const std::string& got, ErrorKind kind) const {
  throw Error(kind, std::string(op_) + ": argument '" + arg + "': expected " + expected +
                        ", got " + got);
}

void AttentionCall::check_operand(const char* name, const TensorView& t) const {
  if (t.ndim < 0 || t.ndim > TensorView::kMaxDims) {
    fail(name, "between 0 and 4 dimensions", std::to_string(t.ndim) + " dimensions");
  }
  for (int d = 0; d < t.ndim; ++d) {
    if (t.shape[d] < 0) fail(name, "non-negative sizes", t.shape_string());
  }
  if (t.data == nullptr && t.numel() > 0) fail(name, "a data pointer", "nullptr");
}

std::vector<std::int32_t> AttentionCall::check_cu_seqlens(const char* name, const TensorView& t,
                                                          std::int64_t total_rows) const {
  check_operand(name, t);
  if (t.dtype != DType::int32) fail(name, "int32", describe(t));
  if (t.ndim != 1 || t.shape[0] < 1) fail(name, "a 1-D tensor of B + 1 offsets", describe(t));
  if (t.device != in_.q.device) fail(name, "on " + to_string(in_.q.device) + " like q", describe(t));
  if (t.shape[0] > 1 && t.stride[0] != 1) {
    fail(name, "contiguous", "stride " + std::to_string(t.stride[0]));
  }
  std::vector<std::int32_t> cu(static_cast<std::size_t>(t.shape[0]));
  if (t.device.kind == DeviceKind::cpu) {
    const auto* src = static_cast<const std::int32_t*>(t.data);
    std::copy(src, src + t.shape[0], cu.begin());
  } else {
    copy_to_host(cu.data(), t.data, cu.size() * sizeof(std::int32_t), t.device, ctx_.cuda_stream);
  }
  if (cu[0] != 0) fail(name, "cu_seqlens[0] == 0", std::to_string(cu[0]));
  for (std::size_t b = 1; b < cu.size(); ++b) {
    if (cu[b] < cu[b - 1]) {
      fail(name, "non-decreasing offsets",
           "cu_seqlens[" + std::to_string(b) + "] = " + std::to_string(cu[b]) + " < cu_seqlens[" +
               std::to_string(b - 1) + "] = " + std::to_string(cu[b - 1]));
    }
  }
  if (cu.back() != total_rows) {
    fail(name, "last offset == " + std::to_string(total_rows) + " (rows of the packed tensor)",
         std::to_string(cu.back()));
  }
  return cu;
}

void AttentionCall::check_shape(const char* name, const TensorView& t, const std::int64_t* shape,
                                int ndim, const char* layout) const {
  check_operand(name, t);
  bool same = t.ndim == ndim;
  for (int d = 0; same && d < ndim; ++d) same = t.shape[d] == shape[d];
  if (!same) fail(name, "shape " + shape_string(shape, ndim) + " " + layout, describe(t));
  if (t.device != in_.q.device) fail(name, "on " + to_string(in_.q.device) + " like q", describe(t));
}

Operand AttentionCall::operand(const TensorView& t, int row_dim) const {
  Operand o;
  o.data = t.data;
  o.batch = row_dim == 1 ? t.stride[0] : 0;
  o.row = t.stride[row_dim];
  o.head = t.stride[row_dim + 1];
  o.dim = row_dim + 2 < t.ndim ? t.stride[row_dim + 2] : 0;
  return o;
}

GradientParams AttentionCall::gradients(const TensorView& dout, const AttentionGrads& grads,
                                        const std::optional<TensorView>& dstats,
                                        const char* dstats_name) const {
  GradientParams g;
  g.dout = like_q("dout", dout, /*value_dim=*/true);
  if (dstats) g.dstats = row_stats(dstats_name, *dstats);
  g.dq = like_q("dq", grads.dq, false);
  g.dk = like_k("dk", grads.dk, false);
  g.dv = like_k("dv", grads.dv, true);
  require_writable("dq", grads.dq);
  require_writable("dk", grads.dk);
  require_writable("dv", grads.dv);
  return g;
}

Operand AttentionCall::per_head(const char* name, const TensorView& t) const {
  const std::int64_t heads = params_.heads_q;
  const std::string expected = std::string(to_string(stats_dtype())) + " (" + std::to_string(heads) +
                               ") or (1) on " + to_string(in_.q.device);
  if (t.ndim != 1 || (t.shape[0] != heads && t.shape[0] != 1) || t.dtype != stats_dtype() ||
      t.device != in_.q.device) {
    fail(name, expected, describe(t));
  }
  if (t.data == nullptr) fail(name, "a view with data", "a null pointer");
  Operand o;
  o.data = t.data;
  o.head = t.shape[0] == 1 ? 0 : t.stride[0];
  return o;
}

Operand AttentionCall::per_head_grad(const char* name, const TensorView& t, const char* like_name,
                                     const TensorView& like) const {
  if (t.ndim != 1 || like.ndim != 1 || t.shape[0] != like.shape[0]) {
    fail(name, std::string("a tensor shaped like ") + like_name + " " + like.shape_string(), describe(t));
  }
  Operand o = per_head(name, t);
  require_writable(name, t);
  return o;
}

void AttentionCall::require_writable(const char* name, const TensorView& t) const {
  for (int d = 0; d < t.ndim; ++d) {
    if (t.shape[d] > 1 && t.stride[d] == 0) {
      fail(name, "a writable tensor (no zero stride on dimensions of size > 1)",
           "stride 0 on dimension " + std::to_string(d) + " of " + describe(t));
    }
  }
}

Operand AttentionCall::like_q(const char* name, const TensorView& t, bool value_dim,
                              std::optional<DType> dtype) const {
  std::int64_t shape[4];
  const int n = in_.q.ndim;
  for (int d = 0; d < n; ++d) shape[d] = in_.q.shape[d];
  if (value_dim) shape[n - 1] = in_.v.shape[n - 1];
  check_shape(name, t, shape, n, value_dim ? "(q's shape with v's head dimension)" : "(like q)");
  if (dtype && t.dtype != *dtype) fail(name, to_string(*dtype), describe(t));
  if (!dtype && t.dtype != in_.q.dtype) fail(name, std::string(to_string(in_.q.dtype)) + " like q", describe(t));
  return operand(t, varlen_ ? 0 : 1);
}

Operand AttentionCall::like_k(const char* name, const TensorView& t, bool value_dim,
                              std::optional<DType> dtype) const {
  const TensorView& ref = value_dim ? in_.v : in_.k;
  check_shape(name, t, ref.shape, ref.ndim, value_dim ? "(like v)" : "(like k)");
  if (dtype && t.dtype != *dtype) fail(name, to_string(*dtype), describe(t));
  if (!dtype && t.dtype != in_.q.dtype) fail(name, std::string(to_string(in_.q.dtype)) + " like q", describe(t));
  return operand(t, varlen_ ? 0 : 1);
}

Operand AttentionCall::row_stats(const char* name, const TensorView& t) const {
  return row_stats(name, t, stats_dtype());
}

Operand AttentionCall::row_stats(const char* name, const TensorView& t, DType dtype) const {
  std::int64_t shape[3];
  const int n = in_.q.ndim - 1;
  for (int d = 0; d < n; ++d) shape[d] = in_.q.shape[d];
  check_shape(name, t, shape, n, varlen_ ? "(T, H) per query row" : "(B, L, H) per query row");
  if (t.dtype != dtype) fail(name, to_string(dtype), describe(t));
  Operand o;
  o.data = t.data;
  o.batch = varlen_ ? 0 : t.stride[0];
  o.row = t.stride[varlen_ ? 0 : 1];
  o.head = t.stride[varlen_ ? 1 : 2];
  return o;
}

Operand AttentionCall::per_query_row(const char* name, const TensorView& t, DType dtype,
                                     std::int64_t width) const {
  std::int64_t shape[3];
  const int rows = varlen_ ? 1 : 2;
  for (int d = 0; d < rows; ++d) shape[d] = in_.q.shape[d];
  int n = rows;
  if (width > 0) shape[n++] = width;
  const char* layout = width > 0 ? (varlen_ ? "(T, width) per query row" : "(B, L, width) per query row")
                                 : (varlen_ ? "(T) per query row" : "(B, L) per query row");
  check_shape(name, t, shape, n, layout);
  if (t.dtype != dtype) fail(name, to_string(dtype), describe(t));
  Operand o;
  o.data = t.data;
  o.batch = varlen_ ? 0 : t.stride[0];
  o.row = t.stride[varlen_ ? 0 : 1];
  o.head = width > 0 ? t.stride[rows] : 0;
  return o;
}

void* AttentionCall::flat(const char* name, const TensorView& t, DType dtype, std::int64_t elements) const {
  check_shape(name, t, &elements, 1, "(elements)");
  if (t.dtype != dtype) fail(name, to_string(dtype), describe(t));
  if (elements > 1 && t.stride[0] != 1) fail(name, "contiguous (stride 1)", describe(t));
  return t.data;
}

void AttentionCall::check_scale(const std::optional<double>& scale) const {
  if (scale && !std::isfinite(*scale)) {
    fail("scale", "a finite number", std::to_string(*scale));
  }
}

void AttentionCall::check_option(const char* name, bool ok, const std::string& expected,
                                 const std::string& got) const {
  if (!ok) fail(name, expected, got);
}

AttentionParams AttentionCall::params(const std::optional<double>& scale,
                                      bool attend_current) const {
  check_scale(scale);
  AttentionParams p = params_;
  p.scale = scale ? *scale : 1.0 / std::sqrt(static_cast<double>(p.dim_qk));
  p.attend_current = attend_current;
  return p;
}

double resolve_tolerance(const AttentionCall& call, const std::optional<double>& tolerance) {
  if (tolerance) {
    call.check_option("tolerance", std::isfinite(*tolerance) && *tolerance > 0,
                      "a finite number > 0", std::to_string(*tolerance));
    return *tolerance;
  }
  return call.stats_dtype() == DType::float64 ? 1e-12 : 1e-5;
}

}  // namespace winnow::detail
