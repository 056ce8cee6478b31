#include "support/threshold_case.h"

#include <cmath>

namespace winnow::testing {

ThresholdInputs make_threshold_inputs(const ThresholdCase& c, std::uint64_t seed, double beta_value,
                                      double lambda_value) {
  ThresholdInputs in{Problem::random(c.shape, seed), Problem::random(c.shape, seed + 1000), {}, {}, c.tda, {}};
  const std::int64_t heads = c.shared_beta ? 1 : c.shape.heads_q;
  in.beta = HostTensor({heads}, DType::float64);
  in.lambda = HostTensor({heads}, DType::float64);
  std::vector<double> b(static_cast<std::size_t>(heads)), l(static_cast<std::size_t>(heads));
  for (std::int64_t h = 0; h < heads; ++h) {
    b[static_cast<std::size_t>(h)] = beta_value + 0.1 * static_cast<double>(h);
    l[static_cast<std::size_t>(h)] = lambda_value + 0.05 * static_cast<double>(h);
  }
  in.beta.set_values(b);
  in.lambda.set_values(l);
  in.options.power = c.power;
  in.options.attend_current = c.attend_current;
  return in;
}

ThresholdInputs converted(const ThresholdInputs& in, DType dtype) {
  ThresholdInputs c = in;
  for (HostTensor* t : {&c.main.q, &c.main.k, &c.main.v, &c.main.dout, &c.second.q, &c.second.k, &c.beta,
                        &c.lambda}) {
    *t = t->converted(dtype);
  }
  return c;
}

ThresholdInputs converted_for_kernels(const ThresholdInputs& in, DType dtype) {
  ThresholdInputs c = converted(in, dtype);
  const DType stats = dtype == DType::float64 ? DType::float64 : DType::float32;
  c.beta = in.beta.converted(stats);
  c.lambda = in.lambda.converted(stats);
  return c;
}

ThresholdInputs rounded(const ThresholdInputs& in, DType dtype) {
  ThresholdInputs r = in;
  for (HostTensor* t : {&r.main.q, &r.main.k, &r.main.v, &r.main.dout, &r.second.q, &r.second.k}) {
    *t = t->converted(dtype).converted(DType::float64);
  }
  for (HostTensor* t : {&r.beta, &r.lambda}) *t = t->converted(DType::float32).converted(DType::float64);
  return r;
}

ExecContext reference_backend() {
  ExecContext ctx;
  ctx.backend = Backend::reference;
  return ctx;
}

namespace {

// Views of the inputs where the call runs.
struct Placed {
  AttentionInputs in;
  threshold::Views views;
  TensorView dout;
};

Placed place(const ThresholdInputs& in, Placement* placement) {
  auto at = [&](const HostTensor& t) { return placement ? placement->place(t) : t.view(); };
  Placed p;
  p.in = AttentionInputs{at(in.main.q), at(in.main.k), at(in.main.v), std::nullopt, std::nullopt};
  if (in.main.cu_q) p.in.cu_seqlens_q = at(*in.main.cu_q);
  if (in.main.cu_k) p.in.cu_seqlens_k = at(*in.main.cu_k);
  p.views.beta = at(in.beta);
  if (in.tda) {
    p.views.lambda = at(in.lambda);
    p.views.q2 = at(in.second.q);
    p.views.k2 = at(in.second.k);
  }
  p.dout = at(in.main.dout);
  return p;
}

}  // namespace

HostTensor saved_rows_record(const ThresholdInputs& in) {
  const std::int64_t dim = in.main.q.shape().back();
  const std::vector<std::int64_t>& qs = in.main.q.shape();
  const std::vector<std::int64_t>& ks = in.main.k.shape();
  const std::int64_t heads_q = qs[qs.size() - 2];
  const std::int64_t num_seqs = qs.size() == 4 ? qs[0] : in.main.cu_q->shape()[0] - 1;
  const std::int64_t key_len = ks.size() == 4 ? ks[1] : ks[0];
  const std::int64_t size = threshold::saved_rows_size<std::int64_t>(
      in.main.q.numel() / dim, in.main.k.numel() / dim, dim,
      static_cast<std::int64_t>(element_size(in.main.q.dtype())), in.tda ? 2 : 1,
      threshold::saved_support_words<std::int64_t>(num_seqs, heads_q, in.main.q.numel() / dim / heads_q, key_len));
  HostTensor record({size}, DType::int32);
  record.fill(0);
  return record;
}

std::vector<double> threshold_forward(const ThresholdInputs& in, const ExecContext& ctx, Placement* placement,
                                      const std::optional<TensorView>& saved_rows) {
  HostTensor out(in.main.dout.shape(), in.main.q.dtype());
  out.fill(std::nan(""));
  const Placed p = place(in, placement);
  const TensorView out_v = placement ? placement->place(out) : out.view();
  threshold::forward(p.in, p.views, in.options, {out_v, std::nullopt, saved_rows}, ctx);
  if (placement) placement->fetch(out_v, out);
  return out.values();
}

std::vector<double> threshold_survivors(const ThresholdInputs& in, const ExecContext& ctx, Placement* placement) {
  std::vector<std::int64_t> shape = in.main.q.shape();
  shape.pop_back();
  HostTensor out(in.main.dout.shape(), in.main.q.dtype()), nonzero(shape, DType::int32);
  nonzero.fill(-1);
  const Placed p = place(in, placement);
  const TensorView out_v = placement ? placement->place(out) : out.view();
  const TensorView nonzero_v = placement ? placement->place(nonzero) : nonzero.view();
  threshold::forward(p.in, p.views, in.options, {out_v, nonzero_v}, ctx);
  if (placement) placement->fetch(nonzero_v, nonzero);
  return nonzero.values();
}

ThresholdGrads threshold_backward(const ThresholdInputs& in, const ExecContext& ctx, Placement* placement,
                                  const std::optional<TensorView>& saved_rows) {
  const DType t = in.main.q.dtype(), s = in.beta.dtype();
  HostTensor dq(in.main.q.shape(), t), dk(in.main.k.shape(), t), dv(in.main.v.shape(), t),
      dq2(in.main.q.shape(), t), dk2(in.main.k.shape(), t), dbeta(in.beta.shape(), s),
      dlambda(in.lambda.shape(), s);
  // Poison: a kernel that skips an element must not pass by reading zeros.
  for (HostTensor* x : {&dq, &dk, &dv, &dq2, &dk2, &dbeta, &dlambda}) x->fill(std::nan(""));
  const Placed p = place(in, placement);
  auto at = [&](HostTensor& x) { return placement ? placement->place(x) : x.view(); };
  const AttentionGrads grads{at(dq), at(dk), at(dv)};
  threshold::ViewGrads vg;
  vg.dbeta = at(dbeta);
  if (in.tda) {
    vg.dlambda = at(dlambda);
    vg.dq2 = at(dq2);
    vg.dk2 = at(dk2);
  }
  threshold::backward(p.in, p.views, in.options, p.dout, grads, vg, ctx, saved_rows);
  if (placement) {
    placement->fetch(grads.dq, dq);
    placement->fetch(grads.dk, dk);
    placement->fetch(grads.dv, dv);
    placement->fetch(vg.dbeta, dbeta);
    if (in.tda) {
      placement->fetch(*vg.dlambda, dlambda);
      placement->fetch(*vg.dq2, dq2);
      placement->fetch(*vg.dk2, dk2);
    }
  }
  ThresholdGrads g{dq.values(), dk.values(), dv.values(), {}, {}, dbeta.values(), {}};
  if (in.tda) {
    g.dq2 = dq2.values();
    g.dk2 = dk2.values();
    g.dlambda = dlambda.values();
  }
  return g;
}

}  // namespace winnow::testing
