// Decoding against paged caches (winnow/decode.h): argument checks, then the CUDA split-KV
// kernels, or on the CPU (and the float64 reference backend) each sequence's keys gathered
// from its pages and handed to the mechanism's own forward call.
#include "winnow/decode.h"

#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "api/view_checks.h"
#include "core/decode_params.h"
#include "cuda/cuda.h"

namespace winnow::decode {
namespace {

using api::describe;

struct Call {
  const char* op;
  const TensorView& q;
  const PagedCache& cache;
  const ExecContext& ctx;

  [[noreturn]] void fail(const std::string& arg, const std::string& expected, const std::string& got,
                         ErrorKind kind = ErrorKind::invalid_argument) const {
    api::fail(op, arg, expected, got, kind);
  }

  std::int64_t B() const { return q.shape[0]; }
  std::int64_t Lq() const { return q.shape[1]; }
  std::int64_t Hq() const { return q.shape[2]; }
  std::int64_t D() const { return q.shape[3]; }
  std::int64_t Hkv() const { return cache.k.shape[2]; }
  std::int64_t Dv() const { return cache.v.shape[3]; }
  std::int64_t page_size() const { return cache.k.shape[1]; }
  std::int64_t capacity() const { return cache.block_table.shape[1] * page_size(); }
  DType stats_dtype() const { return q.dtype == DType::float64 ? DType::float64 : DType::float32; }

  void shape(const char* name, const TensorView& t, std::initializer_list<std::int64_t> want,
             const char* layout, DType dtype) const {
    api::check_data(op, name, t);
    bool ok = t.ndim == static_cast<int>(want.size()) && t.dtype == dtype && t.device == q.device;
    int d = 0;
    for (std::int64_t w : want) ok = ok && t.shape[d++] == w;
    if (!ok) {
      std::string s = "(";
      d = 0;
      for (std::int64_t w : want) s += (d++ ? ", " : "") + std::to_string(w);
      fail(name, std::string(to_string(dtype)) + " " + layout + " = " + s + ") on " + to_string(q.device),
           describe(t));
    }
  }

  void check_inputs() const {
    api::check_data(op, "q", q);
    if (q.ndim != 4 || !is_floating(q.dtype)) fail("q", "a floating-point (B, Lq, Hq, D) tensor", describe(q));
    const TensorView& k = cache.k;
    api::check_data(op, "k", k);
    if (k.ndim != 4 || k.dtype != q.dtype || k.device != q.device || k.shape[3] != D()) {
      fail("k", std::string(to_string(q.dtype)) + " (num_pages, page_size, Hkv, " + std::to_string(D()) +
                    ") on " + to_string(q.device),
           describe(k));
    }
    if (k.shape[1] < 1) fail("k", "a page size of at least 1", describe(k));
    if (Hkv() < 1 || Hq() % Hkv() != 0) {
      fail("k", "a kv head count that divides q's " + std::to_string(Hq()) + " heads", describe(k));
    }
    const TensorView& v = cache.v;
    api::check_data(op, "v", v);
    if (v.ndim != 4 || v.dtype != q.dtype || v.device != q.device || v.shape[0] != k.shape[0] ||
        v.shape[1] != k.shape[1] || v.shape[2] != k.shape[2]) {
      fail("v", std::string(to_string(q.dtype)) + " (" + std::to_string(k.shape[0]) + ", " +
                    std::to_string(k.shape[1]) + ", " + std::to_string(k.shape[2]) + ", Dv) like k",
           describe(v));
    }
    const std::int64_t max_pages = cache.block_table.ndim == 2 ? cache.block_table.shape[1] : 0;
    shape("block_table", cache.block_table, {B(), max_pages}, "(B, max_pages)", DType::int32);
    shape("seq_lens", cache.seq_lens, {B()}, "(B)", DType::int32);
    if (q.device.kind == DeviceKind::cuda && !built_with_cuda()) {
      fail("q", "a CPU tensor (this build has no CUDA kernels)", describe(q), ErrorKind::unsupported);
    }
    if (q.device.kind == DeviceKind::cpu && q.dtype != DType::float32 && q.dtype != DType::float64) {
      fail("q", "float32 or float64 on the CPU", describe(q), ErrorKind::unsupported);
    }
    if (ctx.backend == Backend::reference && (q.dtype != DType::float64 || q.device.kind != DeviceKind::cpu)) {
      fail("q", "float64 on the CPU (the reference backend)", describe(q), ErrorKind::unsupported);
    }
  }

  void check_output(const char* name, const TensorView& t, bool per_feature, DType dtype) const {
    if (per_feature) {
      shape(name, t, {B(), Lq(), Hq(), Dv()}, "(B, Lq, Hq, Dv)", dtype);
    } else {
      shape(name, t, {B(), Lq(), Hq()}, "(B, Lq, Hq)", dtype);
    }
    for (int d = 0; d < t.ndim; ++d) {
      if (t.shape[d] > 1 && t.stride[d] == 0) fail(name, "a writable view (no zero strides)", describe(t));
    }
  }

  // The CPU reads the lengths and pages directly; CUDA checks them on the device.
  void check_lengths_on_host() const {
    const auto* lens = static_cast<const std::int32_t*>(cache.seq_lens.data);
    const auto* table = static_cast<const std::int32_t*>(cache.block_table.data);
    for (std::int64_t b = 0; b < B(); ++b) {
      const std::int64_t n = lens[b * cache.seq_lens.stride[0]];
      report(b, n < Lq() ? 1 : n > capacity() ? 2 : 0);
      for (std::int64_t i = 0; i < (n + page_size() - 1) / page_size(); ++i) {
        const std::int64_t page = table[b * cache.block_table.stride[0] + i * cache.block_table.stride[1]];
        if (page < 0 || page >= cache.k.shape[0]) report(b, 3);
      }
    }
  }

  void report(std::int64_t b, int reason) const {
    const std::string seq = "sequence " + std::to_string(b);
    switch (reason) {
      case 0: return;
      case 1: fail("seq_lens", seq + " holding at least its " + std::to_string(Lq()) + " queries' keys", "fewer");
      case 2:
        fail("seq_lens", seq + " holding at most the " + std::to_string(capacity()) +
                             " keys its block_table row addresses (max_pages * page_size)",
             "more");
      default:
        fail("block_table", seq + "'s pages in [0, " + std::to_string(cache.k.shape[0]) + ")",
             "a page index outside it");
    }
  }
};

TensorView sequence_view(const TensorView& t, std::int64_t b) {
  TensorView s = t;
  s.shape[0] = 1;
  s.data = static_cast<char*>(t.data) + b * t.stride[0] * static_cast<std::int64_t>(element_size(t.dtype));
  return s;
}

// Sequence b's n keys (or values) as a contiguous (1, n, H, D) buffer.
TensorView gather(const Call& call, const TensorView& pages, std::int64_t b, std::int64_t n,
                  std::vector<unsigned char>& buffer) {
  const std::int64_t heads = pages.shape[2], dim = pages.shape[3];
  const std::size_t bytes = element_size(pages.dtype);
  buffer.resize(static_cast<std::size_t>(n * heads * dim) * bytes);
  const auto* table = static_cast<const std::int32_t*>(call.cache.block_table.data);
  const std::int64_t page_size = call.page_size();
  unsigned char* out = buffer.data();
  for (std::int64_t i = 0; i < n; ++i) {
    const std::int64_t page = table[b * call.cache.block_table.stride[0] + (i / page_size) * call.cache.block_table.stride[1]];
    for (std::int64_t h = 0; h < heads; ++h) {
      const auto* row = static_cast<const unsigned char*>(pages.data) +
                        (page * pages.stride[0] + (i % page_size) * pages.stride[1] + h * pages.stride[2]) * bytes;
      for (std::int64_t d = 0; d < dim; ++d, out += bytes) std::memcpy(out, row + d * pages.stride[3] * bytes, bytes);
    }
  }
  return make_view(buffer.data(), pages.dtype, {1, n, heads, dim});
}

detail::Operand operand(const TensorView& t) {
  detail::Operand o;
  o.data = t.data;
  o.batch = t.stride[0];
  o.row = t.stride[1];
  o.head = t.stride[2];
  o.dim = t.ndim > 3 ? t.stride[3] : 0;
  return o;
}

detail::CacheOperand cache_operand(const Call& call, const TensorView& t) {
  if (t.stride[3] != 1 && t.shape[3] > 1) {
    call.fail(&t == &call.cache.k ? "k" : "v", "contiguous features (stride 1 along the head dimension) on CUDA",
              "stride " + std::to_string(t.stride[3]), ErrorKind::unsupported);
  }
  return {t.data, t.stride[0], t.stride[1], t.stride[2]};
}

detail::DecodeParams cuda_params(const Call& call, double scale, bool attend_current, const TensorView& out,
                                 const TensorView& stats) {
  detail::DecodeParams p;
  p.dtype = call.q.dtype;
  p.num_seqs = call.B();
  p.heads_q = call.Hq();
  p.heads_kv = call.Hkv();
  p.dim_qk = call.D();
  p.dim_v = call.Dv();
  p.len_q = call.Lq();
  p.q = operand(call.q);
  p.out = operand(out);
  p.stats = operand(stats);
  p.k = cache_operand(call, call.cache.k);
  p.v = cache_operand(call, call.cache.v);
  p.block_table = static_cast<const std::int32_t*>(call.cache.block_table.data);
  p.table_stride = call.cache.block_table.stride[0];
  p.page_size = call.page_size();
  p.seq_lens = static_cast<const std::int32_t*>(call.cache.seq_lens.data);
  p.capacity = call.capacity();
  p.scale = scale;
  p.attend_current = attend_current;
  p.cuda_stream = call.ctx.cuda_stream;
  p.allocator = call.ctx.allocator;
  if (call.cache.block_table.stride[1] != 1 && call.cache.block_table.shape[1] > 1) {
    call.fail("block_table", "contiguous rows (stride 1 along max_pages) on CUDA",
              "stride " + std::to_string(call.cache.block_table.stride[1]), ErrorKind::unsupported);
  }
  if (p.dtype == DType::float64 || !cuda::decode_kernels_take(p)) {
    call.fail("q", "float16, bfloat16 or float32 with D and Dv multiples of 8 up to 256 and 16-byte aligned "
                   "cache rows (the CUDA decoding kernels)",
              describe(call.q) + " with Dv " + std::to_string(call.Dv()), ErrorKind::unsupported);
  }
  if (!call.cache.trusted) {
    const std::int64_t bad = cuda::first_bad_paged_sequence(p, call.cache.k.shape[0]);
    if (bad >= 0) call.report(bad / 4, static_cast<int>(bad % 4));
  }
  return p;
}

template <class Forward, class CudaRun>
void run(const Call& call, const std::optional<double>& scale, bool attend_current, const TensorView& out,
         const TensorView& stats, Forward forward_on_keys, CudaRun cuda_run) {
  call.check_inputs();
  if (scale && !std::isfinite(*scale)) call.fail("scale", "a finite number", std::to_string(*scale));
  call.check_output("out", out, true, call.q.dtype);
  if (call.B() == 0 || call.Lq() == 0 || call.Hq() == 0) return;
  if (call.q.device.kind == DeviceKind::cuda) {
    const double s = scale ? *scale : 1.0 / std::sqrt(static_cast<double>(call.D()));
    return cuda_run(cuda_params(call, s, attend_current, out, stats));
  }
  call.check_lengths_on_host();
  std::vector<unsigned char> k_buffer, v_buffer;
  const auto* lens = static_cast<const std::int32_t*>(call.cache.seq_lens.data);
  for (std::int64_t b = 0; b < call.B(); ++b) {
    const std::int64_t n = lens[b * call.cache.seq_lens.stride[0]];
    AttentionInputs in{sequence_view(call.q, b), gather(call, call.cache.k, b, n, k_buffer),
                       gather(call, call.cache.v, b, n, v_buffer), std::nullopt, std::nullopt};
    forward_on_keys(in, b);
  }
}

}  // namespace

void softmax(const TensorView& q, const PagedCache& cache, const softmax::Options& options,
             const softmax::Outputs& outputs, const ExecContext& ctx) {
  const Call call{"winnow::decode::softmax", q, cache, ctx};
  call.check_inputs();
  call.check_output("lse", outputs.lse, false, call.stats_dtype());
  run(call, options.scale, options.attend_current, outputs.out, outputs.lse,
      [&](const AttentionInputs& in, std::int64_t b) {
        softmax::forward(in, options, {sequence_view(outputs.out, b), sequence_view(outputs.lse, b)}, ctx);
      },
      [&](const detail::DecodeParams& p) { cuda::softmax_decode(p); });
}

void stick_breaking(const TensorView& q, const PagedCache& cache, const stick_breaking::Options& options,
                    const stick_breaking::Outputs& outputs, const ExecContext& ctx) {
  const Call call{"winnow::decode::stick_breaking", q, cache, ctx};
  call.check_inputs();
  if (options.halt_cutoff != 0.0) {
    call.fail("halt_cutoff", "0 (decoding keeps every key)", std::to_string(options.halt_cutoff));
  }
  call.check_output("log_rem", outputs.log_rem, false, call.stats_dtype());
  if (outputs.kept_from) call.check_output("kept_from", *outputs.kept_from, false, DType::int32);
  run(call, options.scale, options.attend_current, outputs.out, outputs.log_rem,
      [&](const AttentionInputs& in, std::int64_t b) {
        stick_breaking::Outputs o{sequence_view(outputs.out, b), sequence_view(outputs.log_rem, b), std::nullopt};
        if (outputs.kept_from) o.kept_from = sequence_view(*outputs.kept_from, b);
        stick_breaking::forward(in, options, o, ctx);
      },
      [&](detail::DecodeParams p) {
        if (outputs.kept_from) p.kept_from = operand(*outputs.kept_from);
        cuda::stick_breaking_decode(p);
      });
}

}  // namespace winnow::decode
