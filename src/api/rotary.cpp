#include "winnow/rotary.h"

#include <string>

#include "core/rotary_params.h"
#include "cpu/cpu.h"
#include "cuda/cuda.h"
#include "winnow/error.h"

namespace winnow::rotary {
namespace {

constexpr const char* kOp = "winnow::rotary::apply";

[[noreturn]] void fail(const std::string& arg, const std::string& expected, const std::string& got,
                       ErrorKind kind = ErrorKind::invalid_argument) {
  throw Error(kind, std::string(kOp) + ": argument '" + arg + "': expected " + expected + ", got " + got);
}

std::string describe(const TensorView& t) {
  return std::string(to_string(t.dtype)) + " " + t.shape_string() + " on " + to_string(t.device);
}

void check_data(const char* name, const TensorView& t) {
  if (t.data == nullptr && t.numel() > 0) fail(name, "a view with data", "a null pointer");
}

}  // namespace

void apply(const TensorView& x, const TensorView& cos, const TensorView& sin, bool transpose,
           const TensorView& out, const ExecContext& ctx) {
  if (x.ndim != 4) fail("x", "a (B, L, H, D) tensor", describe(x));
  if (!is_floating(x.dtype)) fail("x", "a floating-point tensor", describe(x));
  const std::int64_t B = x.shape[0], L = x.shape[1], H = x.shape[2], D = x.shape[3];
  if (D % 2 != 0) fail("x", "an even head dimension D", describe(x));
  const DType table_dtype = x.dtype == DType::float64 ? DType::float64 : DType::float32;
  const std::string table = "(" + std::to_string(L) + ", " + std::to_string(D / 2) + ") " +
                            to_string(table_dtype) + " on " + to_string(x.device);
  for (const auto& [name, t] : {std::pair<const char*, const TensorView&>{"cos", cos}, {"sin", sin}}) {
    if (t.ndim != 2 || t.shape[0] != L || t.shape[1] != D / 2 || t.dtype != table_dtype ||
        t.device != x.device) {
      fail(name, table, describe(t));
    }
    if (cos.stride[0] != t.stride[0] || cos.stride[1] != t.stride[1]) {
      fail(name, "the strides of 'cos'", "other strides");
    }
  }
  if (out.ndim != 4 || out.shape[0] != B || out.shape[1] != L || out.shape[2] != H ||
      out.shape[3] != D || out.dtype != x.dtype || out.device != x.device) {
    fail("out", std::string(to_string(x.dtype)) + " " + x.shape_string() + " on " + to_string(x.device),
         describe(out));
  }
  check_data("x", x);
  check_data("cos", cos);
  check_data("sin", sin);
  check_data("out", out);
  if (out.data != x.data && out.numel() > 0) {
    // Partial overlap would read rotated values as inputs; in place (same view) is safe because
    // each pair is read before it is written, by the same thread.
    const auto extent = [](const TensorView& t) {
      std::int64_t last = 0;
      for (int d = 0; d < t.ndim; ++d) last += (t.shape[d] - 1) * t.stride[d];
      return (last + 1) * static_cast<std::int64_t>(element_size(t.dtype));
    };
    const char* xb = static_cast<const char*>(x.data);
    const char* ob = static_cast<const char*>(out.data);
    if (ob < xb + extent(x) && xb < ob + extent(out)) {
      fail("out", "memory apart from x's, or x itself", "an overlapping view");
    }
  } else if (out.data == x.data) {
    for (int d = 0; d < 4; ++d) {
      if (out.stride[d] != x.stride[d]) fail("out", "x's strides when it shares x's memory", "other strides");
    }
  }
  if (x.device.kind == DeviceKind::cpu && x.dtype != DType::float32 && x.dtype != DType::float64) {
    fail("x", "float32 or float64 on the CPU", describe(x), ErrorKind::unsupported);
  }
  if (x.device.kind == DeviceKind::cuda && !built_with_cuda()) {
    fail("x", "a CPU tensor (this build has no CUDA kernels)", describe(x), ErrorKind::unsupported);
  }

  detail::RotaryParams p;
  p.x = x.data;
  p.out = out.data;
  p.cos = cos.data;
  p.sin = sin.data;
  p.dtype = x.dtype;
  p.batch = B;
  p.length = L;
  p.heads = H;
  p.half = D / 2;
  for (int d = 0; d < 4; ++d) {
    p.x_stride[d] = x.stride[d];
    p.out_stride[d] = out.stride[d];
  }
  p.table_stride[0] = cos.stride[0];
  p.table_stride[1] = cos.stride[1];
  p.transpose = transpose;
  p.num_threads = ctx.num_threads;
  p.cuda_stream = ctx.cuda_stream;
  if (out.numel() == 0) return;
  if (x.device.kind == DeviceKind::cuda) {
    cuda::rotary(p);
  } else {
    cpu::rotary(p);
  }
}

}  // namespace winnow::rotary
