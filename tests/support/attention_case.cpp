#include "support/attention_case.h"

#include <sstream>
#include <stdexcept>

namespace winnow::testing {

const char* name_of(Mechanism m) {
  switch (m) {
    case Mechanism::softmax: return "softmax";
    case Mechanism::stick_breaking: return "stick_breaking";
    case Mechanism::entmax15: return "entmax15";
    case Mechanism::sparsemax: return "sparsemax";
    case Mechanism::entmax13: return "entmax13";
    case Mechanism::sieve_exact: return "sieve_exact";
    case Mechanism::sieve_bound: return "sieve_bound";
  }
  return "";
}

const std::vector<Mechanism>& all_mechanisms() {
  static const std::vector<Mechanism> all = {
      Mechanism::softmax,  Mechanism::stick_breaking, Mechanism::entmax15,   Mechanism::sparsemax,
      Mechanism::entmax13, Mechanism::sieve_exact,    Mechanism::sieve_bound};
  return all;
}

bool is_sieve(Mechanism m) { return m == Mechanism::sieve_exact || m == Mechanism::sieve_bound; }
bool is_entmax(Mechanism m) {
  return m == Mechanism::entmax15 || m == Mechanism::sparsemax || m == Mechanism::entmax13;
}

double alpha_of(Mechanism m) {
  switch (m) {
    case Mechanism::sparsemax: return 2.0;
    case Mechanism::entmax13: return 1.3;
    default: return 1.5;
  }
}

std::string describe(const ProblemShape& s) {
  std::ostringstream o;
  o << s.name << " [" << (s.varlen ? "varlen" : "batched") << " Hq=" << s.heads_q
    << " Hkv=" << s.heads_kv << " D=" << s.dim << " Dv=" << s.dim_v << " seqs=";
  for (auto [lq, lk] : s.seqs) o << '(' << lq << ',' << lk << ')';
  o << ']';
  return o.str();
}

namespace {

std::vector<std::int64_t> rows_shape(const ProblemShape& s, bool queries, std::int64_t heads,
                                     std::int64_t dim) {
  if (s.varlen) {
    std::int64_t total = 0;
    for (auto [lq, lk] : s.seqs) total += queries ? lq : lk;
    return {total, heads, dim};
  }
  const auto [lq, lk] = s.seqs.front();
  return {static_cast<std::int64_t>(s.seqs.size()), queries ? lq : lk, heads, dim};
}

HostTensor random_tensor(std::vector<std::int64_t> shape, std::mt19937_64& rng, double std) {
  HostTensor t(std::move(shape), DType::float64);
  t.set_values(random_normal(t.numel(), rng, std));
  return t;
}

std::vector<int> order_for(const HostTensor& t, bool permuted) {
  if (!permuted) return {};
  if (t.shape().size() == 4) return {0, 2, 1, 3};
  if (t.shape().size() == 3) return {1, 0, 2};
  if (t.shape().size() == 2) return {1, 0};
  return {};
}

}  // namespace

Problem Problem::random(const ProblemShape& s, std::uint64_t seed, double input_std) {
  if (!s.varlen) {
    for (auto seq : s.seqs) {
      if (seq != s.seqs.front()) throw std::logic_error("batched shape with unequal sequences");
    }
  }
  std::mt19937_64 rng(seed);
  Problem p;
  p.shape = s;
  p.q = random_tensor(rows_shape(s, true, s.heads_q, s.dim), rng, input_std);
  p.k = random_tensor(rows_shape(s, false, s.heads_kv, s.dim), rng, input_std);
  p.v = random_tensor(rows_shape(s, false, s.heads_kv, s.dim_v), rng, 1.0);
  p.dout = random_tensor(rows_shape(s, true, s.heads_q, s.dim_v), rng, 1.0);
  std::vector<std::int64_t> stat_shape = p.q.shape();
  stat_shape.pop_back();
  p.dstat = random_tensor(stat_shape, rng, 1.0);
  if (s.varlen) {
    std::vector<std::int32_t> cq{0}, ck{0};
    for (auto [lq, lk] : s.seqs) {
      cq.push_back(cq.back() + static_cast<std::int32_t>(lq));
      ck.push_back(ck.back() + static_cast<std::int32_t>(lk));
    }
    p.cu_q = int32_tensor(cq);
    p.cu_k = int32_tensor(ck);
  }
  return p;
}

Results run(const Problem& p, const RunConfig& cfg) {
  const HostTensor q = p.q.converted(cfg.dtype, order_for(p.q, cfg.permuted));
  const HostTensor k = p.k.converted(cfg.dtype, order_for(p.k, cfg.permuted));
  const HostTensor v = p.v.converted(cfg.dtype, order_for(p.v, cfg.permuted));
  const HostTensor dout = p.dout.converted(cfg.dtype, order_for(p.dout, cfg.permuted));
  const DType stat_dtype = cfg.dtype == DType::float64 ? DType::float64 : DType::float32;
  const HostTensor dstat = p.dstat.converted(stat_dtype, order_for(p.dstat, cfg.permuted));
  HostTensor out(p.dout.shape(), cfg.dtype, order_for(p.dout, cfg.permuted));
  HostTensor stat(p.dstat.shape(), stat_dtype, order_for(p.dstat, cfg.permuted));
  HostTensor kept(p.dstat.shape(), DType::int32, order_for(p.dstat, cfg.permuted));
  HostTensor threshold(p.dstat.shape(), stat_dtype, order_for(p.dstat, cfg.permuted));
  HostTensor dq(p.q.shape(), cfg.dtype), dk(p.k.shape(), cfg.dtype), dv(p.v.shape(), cfg.dtype);
  // Poison outputs: a kernel that skips an element must not pass by reading zeros.
  for (HostTensor* t : {&out, &stat, &threshold, &dq, &dk, &dv}) t->fill(std::nan(""));
  kept.fill(-1);

  auto placed = [&](const HostTensor& t) { return cfg.placement ? cfg.placement->place(t) : t.view(); };
  AttentionInputs in;
  in.q = placed(q);
  in.k = placed(k);
  in.v = placed(v);
  if (p.cu_q) in.cu_seqlens_q = placed(*p.cu_q);
  if (p.cu_k) in.cu_seqlens_k = placed(*p.cu_k);
  const TensorView out_v = placed(out), stat_v = placed(stat), kept_v = placed(kept);
  const TensorView threshold_v = placed(threshold);
  const TensorView dout_v = placed(dout), dstat_v = placed(dstat);
  const AttentionGrads grads{placed(dq), placed(dk), placed(dv)};
  std::vector<double> support_values;
  ExecContext ctx;
  ctx.backend = cfg.backend;
  ctx.num_threads = cfg.num_threads;
  ctx.deterministic = cfg.deterministic;

  if (cfg.mechanism == Mechanism::softmax) {
    softmax::Options opt;
    opt.scale = cfg.scale;
    opt.attend_current = cfg.attend_current;
    const softmax::Outputs outputs{out_v, stat_v};
    softmax::forward(in, opt, outputs, ctx);
    softmax::backward(in, opt, outputs, dout_v, grads, ctx);
  } else if (is_entmax(cfg.mechanism)) {
    entmax::Options opt;
    opt.scale = cfg.scale;
    opt.attend_current = cfg.attend_current;
    opt.alpha = cfg.alpha.value_or(alpha_of(cfg.mechanism));
    opt.tolerance = cfg.tolerance;
    entmax::Outputs outputs{out_v, stat_v, std::nullopt};
    std::optional<HostTensor> record;
    if (cfg.keep_support) {
      std::int64_t q_rows = 1, k_rows = 1;
      for (std::size_t d = 0; d + 1 < q.shape().size(); ++d) q_rows *= q.shape()[d];
      for (std::size_t d = 0; d + 1 < k.shape().size(); ++d) k_rows *= k.shape()[d];
      record.emplace(std::vector<std::int64_t>{entmax::support_record_size(q_rows, k_rows)}, DType::int32);
      record->fill(-7);  // poison: the forward must write the record's first element
      outputs.support = placed(*record);
    }
    entmax::forward(in, opt, outputs, ctx);
    if (record) {
      if (cfg.placement) cfg.placement->fetch(*outputs.support, *record);
      support_values = record->values();
    }
    entmax::backward(in, opt, outputs, dout_v, grads, ctx);
  } else if (is_sieve(cfg.mechanism)) {
    sieve::Options opt;
    opt.scale = cfg.scale;
    opt.attend_current = cfg.attend_current;
    opt.alpha = cfg.alpha.value_or(alpha_of(cfg.mechanism));
    opt.filter = cfg.mechanism == Mechanism::sieve_bound ? sieve::Filter::bound : sieve::Filter::exact;
    opt.tolerance = cfg.tolerance;
    opt.eps = cfg.eps;
    const sieve::Outputs outputs{out_v, stat_v, threshold_v, kept_v};
    sieve::forward(in, opt, outputs, ctx);
    std::optional<TensorView> dlog_rem;
    if (cfg.with_dstat) dlog_rem = dstat_v;
    sieve::backward(in, opt, outputs, dout_v, dlog_rem, grads, ctx);
  } else {
    stick_breaking::Options opt;
    opt.scale = cfg.scale;
    opt.attend_current = cfg.attend_current;
    opt.halt_cutoff = cfg.halt_cutoff;
    const stick_breaking::Outputs outputs{out_v, stat_v, kept_v};
    stick_breaking::forward(in, opt, outputs, ctx);
    std::optional<TensorView> dlog_rem;
    if (cfg.with_dstat) dlog_rem = dstat_v;
    stick_breaking::backward(in, opt, outputs, dout_v, dlog_rem, grads, ctx);
  }
  if (cfg.placement) {
    cfg.placement->fetch(out_v, out);
    cfg.placement->fetch(stat_v, stat);
    cfg.placement->fetch(kept_v, kept);
    cfg.placement->fetch(threshold_v, threshold);
    cfg.placement->fetch(grads.dq, dq);
    cfg.placement->fetch(grads.dk, dk);
    cfg.placement->fetch(grads.dv, dv);
  }
  Results r{out.values(), stat.values(), dq.values(), dk.values(), dv.values(), {}};
  r.support = std::move(support_values);
  if (cfg.mechanism == Mechanism::stick_breaking) r.kept_from = kept.values();
  if (is_sieve(cfg.mechanism)) {
    r.threshold = threshold.values();
    r.count = kept.values();
  }
  return r;
}

}  // namespace winnow::testing
