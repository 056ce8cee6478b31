#include "support/screening_case.h"

#include <cmath>

namespace winnow::testing {

ScreeningInputs make_screening_inputs(const ScreeningCase& c, std::uint64_t seed) {
  ScreeningInputs in{Problem::random(c.shape, seed), {}, {}, {}};
  const std::int64_t heads = c.shared_scalars ? 1 : c.shape.heads_q;
  in.s_w = HostTensor({heads}, DType::float64);
  in.s_r = HostTensor({heads}, DType::float64);
  std::vector<double> sw(static_cast<std::size_t>(heads)), sr(static_cast<std::size_t>(heads));
  for (std::int64_t h = 0; h < heads; ++h) {
    const double w = c.windows[static_cast<std::size_t>(h) % c.windows.size()];
    const double r = c.widths[static_cast<std::size_t>(h) % c.widths.size()];
    sw[static_cast<std::size_t>(h)] = std::log(w - 1.0);
    sr[static_cast<std::size_t>(h)] = std::log(r / (1.0 - r));
  }
  in.s_w.set_values(sw);
  in.s_r.set_values(sr);
  in.options.expand_windows_above = c.expand_above;
  return in;
}

ScreeningInputs converted_for_kernels(const ScreeningInputs& in, DType dtype) {
  ScreeningInputs c = in;
  for (HostTensor* t : {&c.main.q, &c.main.k, &c.main.v, &c.main.dout}) *t = t->converted(dtype);
  const DType stats = dtype == DType::float64 ? DType::float64 : DType::float32;
  c.s_w = in.s_w.converted(stats);
  c.s_r = in.s_r.converted(stats);
  return c;
}

ScreeningInputs rounded(const ScreeningInputs& in, DType dtype) {
  ScreeningInputs r = in;
  for (HostTensor* t : {&r.main.q, &r.main.k, &r.main.v, &r.main.dout}) {
    *t = t->converted(dtype).converted(DType::float64);
  }
  if (dtype != DType::float64) {
    for (HostTensor* t : {&r.s_w, &r.s_r}) *t = t->converted(DType::float32).converted(DType::float64);
  }
  return r;
}

namespace {

std::vector<std::int64_t> row_shape(const HostTensor& q) {
  std::vector<std::int64_t> shape = q.shape();
  shape.pop_back();
  return shape;
}

DType stats_dtype(const ScreeningInputs& in) { return in.s_w.dtype(); }

ScreeningResults screening_run_impl(const ScreeningInputs& in, const ExecContext& ctx, Placement* placement,
                                    bool with_backward) {
  auto at = [&](const HostTensor& t) { return placement ? placement->place(t) : t.view(); };
  AttentionInputs a{at(in.main.q), at(in.main.k), at(in.main.v), std::nullopt, std::nullopt};
  if (in.main.cu_q) a.cu_seqlens_q = at(*in.main.cu_q);
  if (in.main.cu_k) a.cu_seqlens_k = at(*in.main.cu_k);
  const screening::Scalars scalars{at(in.s_w), at(in.s_r)};
  HostTensor out(in.main.dout.shape(), in.main.q.dtype()), h_norm(row_shape(in.main.q), stats_dtype(in));
  // Poison: a kernel that skips an element must not pass by reading what was there.
  out.fill(std::nan(""));
  h_norm.fill(std::nan(""));
  const screening::Outputs outputs{at(out), at(h_norm)};
  screening::forward(a, scalars, in.options, outputs, ctx);
  if (placement) {
    placement->fetch(outputs.out, out);
    placement->fetch(outputs.h_norm, h_norm);
  }
  ScreeningResults r;
  r.out = out.values();
  r.h_norm = h_norm.values();
  if (!with_backward) return r;
  const DType t = in.main.q.dtype();
  HostTensor dq(in.main.q.shape(), t), dk(in.main.k.shape(), t), dv(in.main.v.shape(), t),
      ds_w(in.s_w.shape(), stats_dtype(in)), ds_r(in.s_r.shape(), stats_dtype(in));
  for (HostTensor* x : {&dq, &dk, &dv, &ds_w, &ds_r}) x->fill(std::nan(""));
  const AttentionGrads grads{at(dq), at(dk), at(dv)};
  const screening::ScalarGrads sg{at(ds_w), at(ds_r)};
  screening::backward(a, scalars, in.options, outputs, at(in.main.dout), grads, sg, ctx);
  if (placement) {
    placement->fetch(grads.dq, dq);
    placement->fetch(grads.dk, dk);
    placement->fetch(grads.dv, dv);
    placement->fetch(sg.ds_w, ds_w);
    placement->fetch(sg.ds_r, ds_r);
  }
  r.dq = dq.values();
  r.dk = dk.values();
  r.dv = dv.values();
  r.ds_w = ds_w.values();
  r.ds_r = ds_r.values();
  return r;
}

}  // namespace

ScreeningResults screening_forward(const ScreeningInputs& in, const ExecContext& ctx, Placement* placement) {
  return screening_run_impl(in, ctx, placement, false);
}

ScreeningResults screening_run(const ScreeningInputs& in, const ExecContext& ctx, Placement* placement) {
  return screening_run_impl(in, ctx, placement, true);
}

}  // namespace winnow::testing
