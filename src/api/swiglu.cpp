#include "winnow/swiglu.h"

#include <string>

#include "api/view_checks.h"
#include "core/layer_params.h"
#include "cpu/cpu.h"
#include "cuda/cuda.h"

namespace winnow::swiglu {
namespace {

using api::describe;
using api::fail;

// Every operand is (N, H) like gate, in gate's dtype and on its device.
void check_like_gate(const char* op, const char* name, const TensorView& t, const TensorView& gate) {
  if (t.ndim != 2 || t.shape[0] != gate.shape[0] || t.shape[1] != gate.shape[1] ||
      t.dtype != gate.dtype || t.device != gate.device) {
    fail(op, name, describe(gate.dtype, gate.shape_string(), gate.device), describe(t));
  }
  api::check_data(op, name, t);
}

void check_gate(const char* op, const TensorView& gate) {
  if (gate.ndim != 2) fail(op, "gate", "an (N, H) tensor", describe(gate));
  api::check_device(op, "gate", gate);
  api::check_data(op, "gate", gate);
}

void copy_strides(std::int64_t (&to)[2], const TensorView& t) {
  to[0] = t.stride[0];
  to[1] = t.stride[1];
}

}  // namespace

void forward(const TensorView& gate, const TensorView& up, const TensorView& y, const ExecContext& ctx) {
  constexpr const char* op = "winnow::swiglu::forward";
  check_gate(op, gate);
  check_like_gate(op, "up", up, gate);
  check_like_gate(op, "y", y, gate);
  if (api::overlaps(y, gate) || api::overlaps(y, up)) {
    fail(op, "y", "memory apart from gate and up", "an overlapping view");
  }
  detail::SwiGLUParams p;
  p.gate = gate.data;
  p.up = up.data;
  p.y = y.data;
  p.dtype = gate.dtype;
  p.rows = gate.shape[0];
  p.cols = gate.shape[1];
  copy_strides(p.gate_stride, gate);
  copy_strides(p.up_stride, up);
  copy_strides(p.y_stride, y);
  p.num_threads = ctx.num_threads;
  p.cuda_stream = ctx.cuda_stream;
  if (y.numel() == 0) return;
  if (gate.device.kind == DeviceKind::cuda) {
    cuda::swiglu_forward(p);
  } else {
    cpu::swiglu_forward(p);
  }
}

void backward(const TensorView& dy, const TensorView& gate, const TensorView& up,
              const TensorView& dgate, const TensorView& dup, const ExecContext& ctx) {
  constexpr const char* op = "winnow::swiglu::backward";
  check_gate(op, gate);
  check_like_gate(op, "up", up, gate);
  check_like_gate(op, "dy", dy, gate);
  check_like_gate(op, "dgate", dgate, gate);
  check_like_gate(op, "dup", dup, gate);
  for (const TensorView* in : {&dy, &gate, &up}) {
    if (api::overlaps(dgate, *in) || api::overlaps(dgate, dup)) {
      fail(op, "dgate", "memory apart from the inputs and dup", "an overlapping view");
    }
    if (api::overlaps(dup, *in)) fail(op, "dup", "memory apart from the inputs", "an overlapping view");
  }
  detail::SwiGLUParams p;
  p.gate = gate.data;
  p.up = up.data;
  p.dy = dy.data;
  p.dgate = dgate.data;
  p.dup = dup.data;
  p.dtype = gate.dtype;
  p.rows = gate.shape[0];
  p.cols = gate.shape[1];
  copy_strides(p.gate_stride, gate);
  copy_strides(p.up_stride, up);
  copy_strides(p.y_stride, dy);
  copy_strides(p.dgate_stride, dgate);
  copy_strides(p.dup_stride, dup);
  p.num_threads = ctx.num_threads;
  p.cuda_stream = ctx.cuda_stream;
  if (gate.numel() == 0) return;
  if (gate.device.kind == DeviceKind::cuda) {
    cuda::swiglu_backward(p);
  } else {
    cpu::swiglu_backward(p);
  }
}

}  // namespace winnow::swiglu
