// The attention layers on the CPU. Every layer kind, through the fused operators and through
// its composed implementation, against a reference written here from spec/softmax.md,
// spec/stick-breaking.md, spec/entmax.md and spec/sieve.md (materialized float64 weights, its
// own RoPE, gates, norms), forward and gradients for the input and every parameter. KV-cache
// decoding against full forward passes for every kind. The composed alpha-entmax and Sieve
// against their fused operators at awkward shapes. RoPE's and ALiBi's defining properties.
// Configuration errors.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <map>
#include <optional>
#include <ostream>
#include <set>
#include <stdexcept>
#include <string>
#include <vector>

#include "math/gsa.h"
#include "nn/attention.h"
#include "nn/composed.h"
#include "nn/modules.h"
#include "nn/probe.h"
#include "nn/transformer.h"
#include "winnow/torch/ops.h"
#include "winnow/error.h"

namespace winnow::nn {
namespace {

using torch::Tensor;

double rel(const Tensor& a, const Tensor& b) {
  return ((a - b).norm() / b.norm().clamp_min(1e-300)).item<double>();
}

// ------------------------------------------------------------------ the reference

using Params = std::map<std::string, Tensor>;

Tensor linear(const Tensor& x, const Params& p, const std::string& name, bool bias = false) {
  Tensor y = torch::matmul(x, p.at(name + ".weight").t());
  return bias ? y + p.at(name + ".bias") : y;
}

// RoPE written from spec/softmax.md (and the YaRN / NTK formulas), one angle at a time.
Tensor reference_rope(const Tensor& x, const RopeConfig& c, std::int64_t offset, std::int64_t seen,
                      std::int64_t context) {
  const std::int64_t L = x.size(1), D = x.size(3), half = D / 2;
  const double d = static_cast<double>(D);
  double base = c.theta, mscale = 1;
  if (c.scaling == "ntk") base = c.theta * std::pow(c.factor, d / (d - 2));
  if (c.scaling == "dynamic" && seen > context) {
    base = c.theta * std::pow(c.factor * double(seen) / double(context) - (c.factor - 1), d / (d - 2));
  }
  std::vector<double> freq(half);
  for (std::int64_t i = 0; i < half; ++i) {
    freq[i] = std::pow(base, -2.0 * double(i) / d);
    if (c.scaling == "yarn") {
      // Dimension i turns context * freq / (2 pi) times over the training context.
      auto boundary = [&](double turns) {
        return d * std::log(double(context) / (turns * 2 * M_PI)) / (2 * std::log(c.theta));
      };
      const double lo = std::max(0.0, std::floor(boundary(c.yarn_beta_fast)));
      const double hi = std::min(d / 2 - 1, std::ceil(boundary(c.yarn_beta_slow)));
      const double t = std::clamp((double(i) - lo) / std::max(hi - lo, 1e-3), 0.0, 1.0);
      freq[i] = (1 - t) * freq[i] + t * freq[i] / c.factor;
      mscale = 1 + 0.1 * std::log(c.factor);
    }
  }
  Tensor cos = torch::empty({L, D}, torch::kFloat64), sin = torch::empty({L, D}, torch::kFloat64);
  for (std::int64_t r = 0; r < L; ++r) {
    double pos = double(offset + r);
    if (c.scaling == "linear") pos /= c.factor;
    for (std::int64_t i = 0; i < half; ++i) {
      const double a = pos * freq[i];
      cos[r][i] = cos[r][i + half] = std::cos(a) * mscale;
      sin[r][i] = sin[r][i + half] = std::sin(a) * mscale;
    }
  }
  cos = cos.view({1, L, 1, D});
  sin = sin.view({1, L, 1, D});
  const Tensor x1 = x.narrow(-1, 0, half), x2 = x.narrow(-1, half, half);
  return x * cos + torch::cat({-x2, x1}, -1) * sin;
}

// alpha-entmax of one row's visible scores x = (alpha - 1) z for alpha 1.5 or 2 (spec/entmax.md):
// the support from the sorted values (the largest k whose closed-form threshold tau_k stays at
// or below the k-th largest), then tau in closed form over the support, as a differentiable
// expression of x, so autograd gives the exact gradient. Returns (p, support).
std::pair<Tensor, Tensor> reference_entmax_row(const Tensor& x, double alpha) {
  const std::int64_t n = x.size(0);
  std::vector<double> sorted(static_cast<std::size_t>(n));
  for (std::int64_t i = 0; i < n; ++i) sorted[i] = x[i].item<double>();
  std::sort(sorted.begin(), sorted.end(), std::greater<double>());
  auto closed_form = [alpha](double s1, double s2, double k) {
    // alpha 2: sum (x - tau) = 1; alpha 1.5: sum (x - tau)^2 = 1, the smaller root.
    return alpha == 2 ? (s1 - 1) / k : (s1 - std::sqrt(std::max(s1 * s1 - k * (s2 - 1), 0.0))) / k;
  };
  double s1 = 0, s2 = 0;
  std::int64_t size = 1;
  for (std::int64_t k = 1; k <= n; ++k) {
    s1 += sorted[k - 1];
    s2 += sorted[k - 1] * sorted[k - 1];
    if (closed_form(s1, s2, double(k)) <= sorted[k - 1]) size = k;
  }
  const Tensor support = x.detach() >= sorted[size - 1];
  const Tensor xs = x.masked_select(support);
  const Tensor t1 = xs.sum(), t2 = xs.pow(2).sum();
  const double k = double(size);
  const Tensor tau = alpha == 2 ? (t1 - 1) / k : (t1 - torch::sqrt(t1 * t1 - k * (t2 - 1))) / k;
  return {(x - tau).masked_fill(support.logical_not(), 0).pow(1 / (alpha - 1)), support};
}

struct SparseOptions {
  double alpha = 1.5;
  std::string filter = "exact";
  double eps = 0;  // 0: 1 / (alpha - 1)
};

// Per head: z_ij = scale <q_j, k_i> over keys i visible from query j (queries are the last Lq
// of Lk positions). Returns the output (B, Lq, H, Dv) and, for stick-breaking and Sieve, rem
// (B, Lq, H). Entmax and Sieve take alpha 1.5 or 2 here.
std::pair<Tensor, Tensor> reference_attention(const Tensor& q, const Tensor& k, const Tensor& v,
                                              const std::string& kind, bool attend_current,
                                              const Tensor& slopes = {},
                                              const SparseOptions& sparse = {}) {
  const std::int64_t B = q.size(0), Lq = q.size(1), H = q.size(2), D = q.size(3);
  const std::int64_t Lk = k.size(1), group = H / k.size(2);
  Tensor out = torch::zeros({B, Lq, H, v.size(3)}, torch::kFloat64);
  Tensor rem = torch::zeros({B, Lq, H}, torch::kFloat64);
  Tensor dist = torch::empty({Lq, Lk}, torch::kFloat64);
  for (std::int64_t r = 0; r < Lq; ++r) {
    for (std::int64_t i = 0; i < Lk; ++i) dist[r][i] = double(Lk - Lq + r - i);
  }
  const Tensor visible = attend_current ? dist.ge(0) : dist.gt(0);
  // later[k][i] = 1 when key k sits at or after key i: suffix sums as a product.
  const Tensor later = torch::ones({Lk, Lk}, torch::kFloat64).tril();
  for (std::int64_t h = 0; h < H; ++h) {
    const Tensor qh = q.select(2, h), kh = k.select(2, h / group), vh = v.select(2, h / group);
    Tensor z = torch::matmul(qh, kh.transpose(1, 2)) / std::sqrt(double(D));
    if (slopes.defined()) z = z - slopes[h] * dist;
    Tensor w;
    if (kind == "softmax") {
      w = torch::softmax(z.masked_fill(visible.logical_not(), -INFINITY), -1);
    } else if (kind == "entmax") {
      std::vector<Tensor> rows;
      for (std::int64_t b = 0; b < B; ++b) {
        for (std::int64_t r = 0; r < Lq; ++r) {
          const std::int64_t n = visible[r].sum().item<std::int64_t>();
          Tensor row = torch::zeros({Lk}, torch::kFloat64);
          if (n > 0) {
            const Tensor p = reference_entmax_row(z[b][r].narrow(0, 0, n) * (sparse.alpha - 1),
                                                  sparse.alpha).first;
            row = torch::cat({p, torch::zeros({Lk - n}, torch::kFloat64)});
          }
          rows.push_back(row);
        }
      }
      w = torch::stack(rows).view({B, Lq, Lk});
    } else {
      // Stick-breaking over the visible keys; Sieve over its candidates among them.
      Tensor allowed = visible.to(torch::kFloat64).expand({B, Lq, Lk}).clone();
      if (kind == "sieve") {
        const double eps = sparse.eps > 0 ? sparse.eps : 1 / (sparse.alpha - 1);
        for (std::int64_t b = 0; b < B; ++b) {
          for (std::int64_t r = 0; r < Lq; ++r) {
            const std::int64_t n = visible[r].sum().item<std::int64_t>();
            if (n == 0) continue;
            const Tensor zr = z[b][r].detach().narrow(0, 0, n);
            const Tensor candidates =
                sparse.filter == "exact"
                    ? reference_entmax_row(zr * (sparse.alpha - 1), sparse.alpha).second
                    : zr > zr.max().item<double>() - eps;
            allowed[b][r].narrow(0, 0, n).copy_(candidates);
          }
        }
      }
      const Tensor cost = torch::log1p(torch::exp(z)) * allowed;
      w = torch::exp(z - torch::matmul(cost, later)) * allowed;
      rem.select(2, h).copy_(torch::exp(-cost.sum(-1)));
    }
    out.select(2, h).copy_(torch::matmul(w, vh));
  }
  return {out, rem};
}

Tensor head_norm(const Tensor& o, const Params& p, const std::string& name, bool centered) {
  Tensor x = centered ? o - o.mean(-1, true) : o;
  Tensor y = x / torch::sqrt(x.pow(2).mean(-1, true) + 1e-6) * p.at(name + ".weight");
  return centered ? y + p.at(name + ".bias") : y;
}

// GSA (spec/gsa.md): the indexer's scores (B, L, L) over every key from the layer input, and
// the selection they make (B, L, L) bool: each row's min(k_t, t + 1) best visible keys, ties
// toward the more recent, k_t from the budget with Vbar the batch's mean row variance (what a
// layer's first training batch uses).
Tensor reference_indexer_scores(const AttentionConfig& a, const Params& p, const Tensor& x) {
  const std::int64_t B = x.size(0), L = x.size(1);
  const std::int64_t hi = a.options.value("indexer_heads", 4), di = a.options.value("indexer_dim", 64);
  const bool relu = a.options.value("indexer", std::string("sigmoid")) == "relu";
  const Tensor iq = linear(x, p, "indexer_q").view({B, L, hi, di});
  const Tensor ik = linear(x, p, "indexer_k");                      // (B, L, d_I)
  const Tensor w = linear(x, p, "indexer_weights", !relu);          // (B, L, H_I)
  Tensor scores = torch::zeros({B, L, L}, torch::kFloat64);
  for (std::int64_t j = 0; j < hi; ++j) {
    const Tensor dot = torch::matmul(iq.select(2, j), ik.transpose(1, 2)) / std::sqrt(double(di));
    const Tensor wj = w.select(2, j).unsqueeze(-1);
    scores = scores + (relu ? wj * torch::relu(dot) : torch::sigmoid(wj) * torch::sigmoid(dot + p.at("indexer_bias")[j]));
  }
  return scores;
}

Tensor reference_selection(const AttentionConfig& a, const Tensor& scores) {
  const std::int64_t B = scores.size(0), L = scores.size(1);
  math::gsa::BudgetParams budget;
  const std::string rule = a.options.value("budget", std::string("inverse_variance"));
  budget.rule = rule == "fixed" ? math::gsa::Budget::fixed
                : rule == "eq8" ? math::gsa::Budget::eq8
                : rule == "reference" ? math::gsa::Budget::reference
                                      : math::gsa::Budget::inverse_variance;
  budget.k_max = a.options.value("k_max", 512);
  budget.k = a.options.value("k", 0) > 0 ? a.options.value("k", 0) : budget.k_max;
  budget.k_base = a.options.value("k_base", 256);
  budget.k_min = a.options.value("k_min", 64);
  const Tensor s = scores.detach();
  std::vector<double> variance;
  for (std::int64_t b = 0; b < B; ++b) {
    for (std::int64_t t = 0; t < L; ++t) {
      const Tensor row = s[b][t].narrow(0, 0, t + 1);
      variance.push_back(((row - row.mean()).pow(2)).mean().item<double>());
    }
  }
  double mean = 0;
  for (double v : variance) mean += v / double(variance.size());
  budget.mean_variance = mean;
  Tensor allowed = torch::zeros({B, L, L}, torch::kBool);
  for (std::int64_t b = 0; b < B; ++b) {
    for (std::int64_t t = 0; t < L; ++t) {
      const std::int64_t n = std::min(math::gsa::budget(budget, variance[b * L + t]), t + 1);
      std::vector<std::int64_t> keys(static_cast<std::size_t>(t + 1));
      for (std::int64_t i = 0; i <= t; ++i) keys[i] = i;
      std::sort(keys.begin(), keys.end(), [&](std::int64_t x, std::int64_t y) {
        return math::gsa::ranks_before(s[b][t][x].item<double>(), x, s[b][t][y].item<double>(), y);
      });
      for (std::int64_t i = 0; i < n; ++i) allowed[b][t][keys[i]] = true;
    }
  }
  return allowed;
}

// Softmax over each row's allowed keys (B, L, L), per head.
Tensor reference_masked_softmax(const Tensor& q, const Tensor& k, const Tensor& allowed) {
  const std::int64_t H = q.size(2), group = H / k.size(2);
  std::vector<Tensor> heads;
  for (std::int64_t h = 0; h < H; ++h) {
    const Tensor z = torch::matmul(q.select(2, h), k.select(2, h / group).transpose(1, 2)) / std::sqrt(double(q.size(3)));
    heads.push_back(torch::softmax(z.masked_fill(allowed.logical_not(), -INFINITY), -1));
  }
  return torch::stack(heads, 1);  // (B, H, L, L)
}

// The layer's q and k after positions, for the GSA branch and its loss.
std::pair<Tensor, Tensor> reference_qk(const ModelConfig& model, const Params& p, const Tensor& x) {
  const AttentionConfig& a = model.attention;
  const std::int64_t B = x.size(0), L = x.size(1);
  Tensor q = linear(x, p, "q").view({B, L, a.heads, a.head_dim});
  Tensor k = linear(x, p, "k").view({B, L, a.kv_heads, a.head_dim});
  if (a.position == "rope") {
    q = reference_rope(q, a.rope, 0, L, model.context_len);
    k = reference_rope(k, a.rope, 0, L, model.context_len);
  }
  return {q, k};
}

// GSA's indexer loss (003 section 6, sparse phase): KL(p_t || softmax(I_t)) over the selection,
// p_t the heads' mean attention, per token on average; q, k and the indexer's input detached.
// Zero for every other layer.
// dense: the warm-up phase's form, over every visible key.
Tensor reference_aux(const ModelConfig& model, const Params& p, const Tensor& x, bool dense = false) {
  const AttentionConfig& a = model.attention;
  if (a.kind != "gsa" || a.options.value("indexer", std::string("sigmoid")) == "none") {
    return torch::zeros({}, torch::kFloat64);
  }
  const auto [q, k] = reference_qk(model, p, x.detach());
  const Tensor scores = reference_indexer_scores(a, p, x.detach());
  const std::int64_t L = x.size(1);
  const Tensor allowed = dense ? torch::ones({L, L}, torch::kBool).tril().expand({x.size(0), L, L})
                               : reference_selection(a, scores);
  const Tensor target = reference_masked_softmax(q.detach(), k.detach(), allowed).mean(1);
  const Tensor log_q = torch::log_softmax(scores.masked_fill(allowed.logical_not(), -INFINITY), -1);
  const Tensor terms = torch::xlogy(target, target) - target * log_q.masked_fill(allowed.logical_not(), 0);
  return terms.masked_fill(allowed.logical_not(), 0).sum() / double(x.size(0) * x.size(1));
}

// One attention layer (layer_index 1, i.e. layer 2) of `model` from its parameters.
Tensor reference_layer(const ModelConfig& model, const Params& p, const Tensor& x) {
  const AttentionConfig& a = model.attention;
  const std::int64_t B = x.size(0), L = x.size(1), H = a.heads, Hkv = a.kv_heads, D = a.head_dim;
  const bool differential = a.kind == "differential";
  const std::string threshold_variant = a.options.value("variant", std::string("tda"));
  const bool threshold_two_views =
      a.kind == "threshold" && (threshold_variant == "tda" || threshold_variant == "differential_rela");
  const std::int64_t views = differential || threshold_two_views ? 2 : 1;
  Tensor q = linear(x, p, "q").view({B, L, views * H, D});
  Tensor k = linear(x, p, "k").view({B, L, views * Hkv, D});
  Tensor v = linear(x, p, "v").view({B, L, Hkv, D});
  if (a.options.value("qk_norm", false)) {
    q = head_norm(q, p, "q_norm", false);
    k = head_norm(k, p, "k_norm", false);
  }
  const std::string gate = a.options.value("gate", std::string("none"));
  if (gate == "g2" || gate == "g1g2") v = v * torch::sigmoid(linear(x, p, "value_gate", true)).view({B, L, Hkv, D});
  if (a.position == "rope") {
    q = reference_rope(q, a.rope, 0, L, model.context_len);
    k = reference_rope(k, a.rope, 0, L, model.context_len);
  }
  if (a.options.value("ssmax", false)) {
    Tensor log_n = torch::log(torch::arange(1, L + 1, torch::kFloat64)).view({1, L, 1, 1});
    q = q * log_n * p.at("ssmax_scale").view({1, 1, H, 1});
  }
  Tensor o;
  if (a.kind == "softmax") {
    const Tensor slopes = a.position == "alibi"
                              ? torch::pow(2.0, -8.0 * torch::arange(1, H + 1, torch::kFloat64) / double(H))
                              : Tensor();
    o = reference_attention(q, k, v, "softmax", true, slopes).first;
    if (gate == "g1" || gate == "g1g2") o = o * torch::sigmoid(linear(x, p, "output_gate", true)).view({B, L, H, D});
  } else if (differential) {
    const Tensor o1 = reference_attention(q.narrow(2, 0, H), k.narrow(2, 0, Hkv), v, "softmax", true).first;
    const Tensor o2 = reference_attention(q.narrow(2, H, H), k.narrow(2, Hkv, Hkv), v, "softmax", true).first;
    const double lambda_init = 0.8 - 0.6 * std::exp(-0.3 * (2 - 1));
    const Tensor lambda = torch::exp((p.at("lambda_q1") * p.at("lambda_k1")).sum()) -
                          torch::exp((p.at("lambda_q2") * p.at("lambda_k2")).sum()) + lambda_init;
    o = head_norm(o1 - lambda * o2, p, "head_norm", false) * (1 - lambda_init);
  } else if (a.kind == "threshold") {
    // spec/threshold.md: cosine scores, tau_j = beta sqrt(2 log(j + 1) / D), relu(s - tau)^p.
    const bool rela = threshold_variant == "rela" || threshold_variant == "differential_rela";
    const double power = rela ? 1.0 : a.options.value("power", 2.0);
    const Tensor beta = p.count("beta") ? p.at("beta") : torch::zeros({1}, torch::kFloat64);
    const Tensor n = torch::arange(1, L + 1, torch::kFloat64);
    const Tensor unit = torch::where(n.gt(1), torch::sqrt(2 * torch::log(n) / double(D)), torch::zeros_like(n));
    const Tensor causal = torch::ones({L, L}, torch::kBool).tril();
    const Tensor vh = v.repeat_interleave(H / Hkv, 2);
    auto tra = [&](const Tensor& qq, const Tensor& kk) {
      const Tensor qn = qq / qq.norm(2, -1, true).clamp_min(1e-6);
      const Tensor kn = (kk / kk.norm(2, -1, true).clamp_min(1e-6)).repeat_interleave(H / Hkv, 2);
      const Tensor sc = torch::einsum("bjhd,bihd->bhji", {qn, kn});
      const Tensor xw = sc - beta.view({1, -1, 1, 1}) * unit.view({1, 1, L, 1});
      const Tensor w = torch::relu(xw).pow(power).masked_fill(causal.logical_not(), 0);
      return torch::einsum("bhji,bihd->bjhd", {w, vh});
    };
    o = tra(q.narrow(2, 0, H), k.narrow(2, 0, Hkv));
    if (threshold_two_views) {
      const bool reparam = a.options.value("lambda_form", std::string("scalar")) == "reparam";
      Tensor lam = reparam ? (torch::exp((p.at("lambda_q1") * p.at("lambda_k1")).sum()) -
                              torch::exp((p.at("lambda_q2") * p.at("lambda_k2")).sum()) +
                              a.options.value("lambda_init", 0.5)).reshape({1})
                           : p.at("lambda");
      if (!reparam && a.options.value("clamp_lambda", true)) lam = lam.clamp(0.0, 1.0);
      o = o - lam.view({1, 1, -1, 1}) * tra(q.narrow(2, H, H), k.narrow(2, Hkv, Hkv));
    }
    if (a.options.value("head_norm", true)) o = head_norm(o, p, "head_norm", false);
  } else if (a.kind == "gsa") {
    const bool gates = a.options.value("gates", true);
    Tensor vg = linear(x, p, "v").view({B, L, Hkv, D});
    if (gates) vg = vg * torch::sigmoid(linear(x, p, "value_gate", true)).view({B, L, Hkv, D});
    if (a.options.value("indexer", std::string("sigmoid")) == "none") {
      o = reference_attention(q, k, vg, "softmax", true).first;
    } else {
      const Tensor allowed = reference_selection(a, reference_indexer_scores(a, p, x));
      const Tensor w = reference_masked_softmax(q, k, allowed);  // (B, H, L, L)
      o = torch::einsum("bhji,bihd->bjhd", {w, vg.repeat_interleave(H / Hkv, 2)});
    }
    if (gates) o = o * torch::sigmoid(linear(x, p, "output_gate", true)).view({B, L, H, D});
  } else if (a.kind == "entmax") {
    SparseOptions sparse;
    sparse.alpha = a.options.value("alpha", 1.5);
    o = reference_attention(q, k, v, "entmax", a.options.value("attend_current", true), {}, sparse).first;
  } else {
    SparseOptions sparse;
    sparse.alpha = a.options.value("alpha", 1.5);
    sparse.filter = a.options.value("filter", std::string("exact"));
    if (a.options.contains("eps") && !a.options["eps"].is_null()) sparse.eps = a.options["eps"].get<double>();
    Tensor rem;
    std::tie(o, rem) = reference_attention(q, k, v, a.kind, a.options.value("attend_current", false), {}, sparse);
    if (a.options.value("remainder_bias", false)) o = o + rem.unsqueeze(-1) * p.at("remainder_bias");
    if (a.options.value("head_norm", false)) o = head_norm(o, p, "head_norm", true);
  }
  return linear(o.reshape({B, L, H * D}), p, "o");
}

// ------------------------------------------------------------------ variants

struct Variant {
  std::string name;
  std::function<void(AttentionConfig&)> set;
};

const std::vector<Variant>& variants() {
  static const std::vector<Variant> all = {
      {"softmax_rope", [](AttentionConfig&) {}},
      {"softmax_rope_linear", [](AttentionConfig& a) { a.rope.scaling = "linear"; a.rope.factor = 16; }},
      {"softmax_rope_ntk", [](AttentionConfig& a) { a.rope.scaling = "ntk"; a.rope.factor = 4; }},
      {"softmax_rope_dynamic", [](AttentionConfig& a) { a.rope.scaling = "dynamic"; a.rope.factor = 2; }},
      {"softmax_rope_yarn", [](AttentionConfig& a) { a.rope.scaling = "yarn"; a.rope.factor = 8; }},
      {"softmax_nope_gqa", [](AttentionConfig& a) { a.position = "nope"; a.kv_heads = 1; }},
      {"softmax_alibi", [](AttentionConfig& a) { a.position = "alibi"; }},
      {"ssmax", [](AttentionConfig& a) { a.options["ssmax"] = true; }},
      {"gated_g1", [](AttentionConfig& a) { a.options["gate"] = "g1"; }},
      {"softmax_rope_qk_norm_gqa", [](AttentionConfig& a) { a.options["qk_norm"] = true; a.kv_heads = 1; }},
      {"threshold_tda_rope", [](AttentionConfig& a) { a.kind = "threshold"; a.options["beta_init"] = 0.3; }},
      {"threshold_tra_nope_gqa_per_head", [](AttentionConfig& a) {
         a.kind = "threshold"; a.position = "nope"; a.kv_heads = 1;
         a.options["variant"] = "tra"; a.options["beta_per_head"] = true; a.options["power"] = 1.5; }},
      {"threshold_rela", [](AttentionConfig& a) { a.kind = "threshold"; a.options["variant"] = "rela"; }},
      {"threshold_tda_reparam_lambda", [](AttentionConfig& a) {
         a.kind = "threshold"; a.options["lambda_form"] = "reparam"; a.options["lambda_init"] = 0.8; }},
      {"threshold_differential_rela_unclamped", [](AttentionConfig& a) {
         a.kind = "threshold"; a.options["variant"] = "differential_rela";
         a.options["clamp_lambda"] = false; a.options["head_norm"] = false; }},
      {"gated_g2_gqa", [](AttentionConfig& a) { a.options["gate"] = "g2"; a.kv_heads = 1; }},
      {"gated_g1g2_ssmax_nope", [](AttentionConfig& a) { a.options["gate"] = "g1g2"; a.options["ssmax"] = true; a.position = "nope"; }},
      {"differential", [](AttentionConfig& a) { a.kind = "differential"; }},
      {"differential_nope", [](AttentionConfig& a) { a.kind = "differential"; a.position = "nope"; a.kv_heads = 4; }},
      {"stick_breaking", [](AttentionConfig& a) { a.kind = "stick_breaking"; }},
      {"stick_breaking_rb", [](AttentionConfig& a) { a.kind = "stick_breaking"; a.options["remainder_bias"] = true; }},
      {"stick_breaking_rb_gn_rope",
       [](AttentionConfig& a) {
         a.kind = "stick_breaking";
         a.position = "rope";
         a.options["remainder_bias"] = true;
         a.options["head_norm"] = true;
       }},
      {"stick_breaking_attend_current", [](AttentionConfig& a) { a.kind = "stick_breaking"; a.options["attend_current"] = true; }},
      {"entmax_rope", [](AttentionConfig& a) { a.kind = "entmax"; }},
      {"entmax_rope_yarn", [](AttentionConfig& a) { a.kind = "entmax"; a.rope.scaling = "yarn"; a.rope.factor = 8; }},
      {"sparsemax_nope_gqa",
       [](AttentionConfig& a) {
         a.kind = "entmax";
         a.position = "nope";
         a.kv_heads = 1;
         a.options["alpha"] = 2.0;
       }},
      {"entmax_previous_keys", [](AttentionConfig& a) { a.kind = "entmax"; a.options["attend_current"] = false; }},
      // GSA: 13 tokens against budgets of 2-7 keys, so most rows select.
      {"gsa_rope_fixed", [](AttentionConfig& a) {
         a.kind = "gsa"; a.options["budget"] = "fixed"; a.options["k"] = 5; a.options["k_max"] = 6;
         a.options["indexer_heads"] = 2; a.options["indexer_dim"] = 4; }},
      {"gsa_nope_variance_budget_gqa", [](AttentionConfig& a) {
         a.kind = "gsa"; a.position = "nope"; a.kv_heads = 1; a.options["k_base"] = 3; a.options["k_min"] = 2;
         a.options["k_max"] = 7; a.options["indexer_heads"] = 3; a.options["indexer_dim"] = 4;
         a.options["variance_momentum"] = 1.0; a.options["loss_chunk"] = 4; }},  // four chunks of the loss
      {"gsa_sparse_only_relu", [](AttentionConfig& a) {
         a.kind = "gsa"; a.options["gates"] = false; a.options["indexer"] = "relu"; a.options["budget"] = "fixed";
         a.options["k"] = 4; a.options["k_max"] = 4; a.options["indexer_heads"] = 2; a.options["indexer_dim"] = 4; }},
      {"gsa_gated_only", [](AttentionConfig& a) { a.kind = "gsa"; a.options["indexer"] = "none"; }},
      {"sieve", [](AttentionConfig& a) { a.kind = "sieve"; }},
      {"sieve_alpha2_gqa",
       [](AttentionConfig& a) {
         a.kind = "sieve";
         a.kv_heads = 1;
         a.options["alpha"] = 2.0;
       }},
      {"sieve_bound_rb_gn",
       [](AttentionConfig& a) {
         a.kind = "sieve";
         a.options["filter"] = "bound";
         a.options["remainder_bias"] = true;
         a.options["head_norm"] = true;
       }},
      {"sieve_bound_eps_attend_current",
       [](AttentionConfig& a) {
         a.kind = "sieve";
         a.options["filter"] = "bound";
         a.options["eps"] = 0.5;
         a.options["attend_current"] = true;
       }},
  };
  return all;
}

const Variant& variant(const std::string& name) {
  for (const Variant& v : variants()) {
    if (v.name == name) return v;
  }
  throw std::runtime_error("no variant " + name);
}

// d_model 32, 4 heads of 8, 2 kv heads; a training context (8) shorter than the test
// sequences, so every RoPE scaling and SSMax is engaged.
ModelConfig tiny(const Variant& v, const std::string& implementation) {
  ModelConfig c;
  c.vocab_size = 11;
  c.d_model = 32;
  c.layers = 2;
  c.context_len = 8;
  c.attention.heads = 4;
  c.attention.kv_heads = 2;
  c.attention.implementation = implementation;
  v.set(c.attention);
  resolve(c);
  return c;
}

struct Case {
  int variant;
  std::string implementation;
};
void PrintTo(const Case& c, std::ostream* os) {
  *os << variants()[static_cast<std::size_t>(c.variant)].name << " via " << c.implementation;
}

std::vector<Case> cases() {
  std::vector<Case> out;
  for (int i = 0; i < static_cast<int>(variants().size()); ++i) {
    for (const char* impl : {"kernel", "composed"}) {
      ModelConfig probe;
      probe.vocab_size = 11;
      probe.context_len = 8;
      variants()[i].set(probe.attention);
      // ALiBi has no fused path (see KernelWithAlibiIsAConfigError); only "composed" exists.
      if (std::string(impl) == "kernel" && probe.attention.position == "alibi") continue;
      out.push_back({i, impl});
    }
  }
  return out;
}

std::string case_name(const ::testing::TestParamInfo<Case>& info) {
  return variants()[static_cast<std::size_t>(info.param.variant)].name + "_" + info.param.implementation;
}

class Layer : public ::testing::TestWithParam<Case> {};

TEST_P(Layer, ForwardAndGradientsMatchTheReference) {
  const Variant& v = variants()[static_cast<std::size_t>(GetParam().variant)];
  const ModelConfig c = tiny(v, GetParam().implementation);
  EXPECT_EQ(c.attention.implementation, GetParam().implementation);
  torch::manual_seed(3);
  auto layer = make_attention(c, 1);
  layer->to(torch::kFloat64);
  Params p;
  {
    torch::NoGradGuard no_grad;
    for (auto& item : layer->named_parameters()) {
      // Perturbed, so parameters that start at zero or one (remainder bias, gate biases, norm
      // gains) are exercised too.
      item.value().add_(torch::randn_like(item.value()) * 0.3);
      p[item.key()] = item.value().detach().clone().requires_grad_();
    }
  }
  const Tensor x = torch::randn({2, 13, 32}, torch::kFloat64).requires_grad_();
  const Tensor x_ref = x.detach().clone().requires_grad_();
  const Tensor w = torch::randn({2, 13, 32}, torch::kFloat64);
  const Tensor y = layer->forward(x, nullptr);
  const Tensor y_ref = reference_layer(c, p, x_ref);
  // Auxiliary losses (GSA's indexer KL) train parameters the output does not reach.
  Tensor loss = (y * w).sum();
  for (const auto& [name, value] : layer->aux_losses()) loss = loss + value;
  const Tensor aux_ref = reference_aux(c, p, x_ref);
  if (!layer->aux_losses().empty()) {
    EXPECT_LT(rel(layer->aux_losses()[0].second.to(torch::kFloat64), aux_ref), 1e-10) << "auxiliary loss";
  }
  loss.backward();
  ((y_ref * w).sum() + aux_ref).backward();
  EXPECT_LT(rel(y, y_ref), 1e-10);
  EXPECT_LT(rel(x.grad(), x_ref.grad()), 1e-9);
  for (const auto& item : layer->named_parameters()) {
    ASSERT_TRUE(item.value().grad().defined()) << item.key();
    EXPECT_LT(rel(item.value().grad(), p[item.key()].grad()), 1e-9) << item.key();
  }
}

// The precision training runs in on the CPU.
TEST_P(Layer, Float32ForwardMatchesTheReference) {
  const Variant& v = variants()[static_cast<std::size_t>(GetParam().variant)];
  const ModelConfig c = tiny(v, GetParam().implementation);
  torch::manual_seed(5);
  auto layer = make_attention(c, 1);
  Params p;
  for (auto& item : layer->named_parameters()) p[item.key()] = item.value().detach().to(torch::kFloat64);
  const Tensor x = torch::randn({2, 13, 32});
  torch::NoGradGuard no_grad;
  EXPECT_LT(rel(layer->forward(x, nullptr).to(torch::kFloat64), reference_layer(c, p, x.to(torch::kFloat64))), 1e-5);
}

// The whole model decoding with its cache, chunk by chunk, against full forward passes over
// each prefix (the chunks' rows of a full pass over exactly the tokens seen so far).
void expect_cache_matches(ModelConfig c, bool record_gradients, std::int64_t length = 14) {
  torch::manual_seed(4);
  TransformerLM model(c);
  model->to(torch::kFloat64);
  const Tensor tokens = torch::randint(0, c.vocab_size, {2, length}, torch::kInt64);
  std::optional<torch::NoGradGuard> no_grad;
  if (!record_gradients) no_grad.emplace();
  KVCache cache = model->new_cache();
  std::int64_t seen = 0;
  for (std::int64_t chunk : {5, 1, 1, 3, 1, 2, 1}) {
    chunk = std::min(chunk, length - seen);
    if (chunk == 0) break;
    const Tensor logits = model->forward(tokens.narrow(1, seen, chunk), &cache);
    seen += chunk;
    ASSERT_EQ(cache.length(), seen);
    const Tensor full = model->forward(tokens.narrow(1, 0, seen)).narrow(1, seen - chunk, chunk);
    EXPECT_LT(rel(logits, full), 1e-10) << "after " << seen << " tokens";
  }
}

TEST_P(Layer, KvCacheDecodingReproducesFullForwardLogits) {
  const Variant& v = variants()[static_cast<std::size_t>(GetParam().variant)];
  ModelConfig c = tiny(v, GetParam().implementation);
  // Dynamic NTK rotates with the base of the current sequence length, so beyond the training
  // context a token's hidden state depends on how long the sequence was when it was computed:
  // from the second layer on, no cache can reproduce a longer full pass (an inherent property
  // of dynamic scaling). The layer re-rotates its cached keys at every step, so one layer is
  // exact at every length (here); two layers are exact within the context (the next test).
  if (c.attention.rope.scaling == "dynamic") c.layers = 1;
  expect_cache_matches(c, false);
}

// GSA's warm-up phase: attention is dense (the gated-only layer on the same parameters) and
// the indexer's loss spans every visible key; the probe sees the selection afterwards.
// nn::project against one linear() per weight: outputs, the input's and every weight's
// gradient, with an output left unused (its gradient undefined), with outputs whose gradients
// arrive side by side in one buffer (SwiGLU's backward over the packed gate and up), and with
// one weight.
TEST(Project, MatchesOneLinearPerWeight) {
  torch::manual_seed(11);
  for (const bool swiglu : {false, true}) {
    for (const std::vector<std::int64_t>& rows : {std::vector<std::int64_t>{6, 3, 5}, std::vector<std::int64_t>{7}}) {
      if (swiglu && rows.size() != 1) continue;
      const std::vector<std::int64_t> out = swiglu ? std::vector<std::int64_t>{9, 9} : rows;
      const Tensor x = torch::randn({2, 5, 4}, torch::kFloat64).requires_grad_();
      const Tensor x_ref = x.detach().clone().requires_grad_();
      std::vector<Tensor> w, w_ref;
      for (const std::int64_t n : out) {
        w.push_back(torch::randn({n, 4}, torch::kFloat64).requires_grad_());
        w_ref.push_back(w.back().detach().clone().requires_grad_());
      }
      const std::vector<Tensor> y = project(x, w);
      ASSERT_EQ(y.size(), out.size());
      Tensor loss = torch::zeros({}, torch::kFloat64), loss_ref = torch::zeros({}, torch::kFloat64);
      if (swiglu) {
        loss = (torch_ops::swiglu(y[0], y[1]) * torch::arange(9, torch::kFloat64)).sum();
        const Tensor g = torch::nn::functional::linear(x_ref, w_ref[0]);
        const Tensor u = torch::nn::functional::linear(x_ref, w_ref[1]);
        loss_ref = (torch::silu(g) * u * torch::arange(9, torch::kFloat64)).sum();
      } else {
        // The second output is unused when there are three.
        for (std::size_t i = 0; i < y.size(); ++i) {
          const Tensor y_ref = torch::nn::functional::linear(x_ref, w_ref[i]);
          EXPECT_LT(rel(y[i], y_ref), 1e-14) << i;
          if (y.size() == 3 && i == 1) continue;
          const Tensor c = torch::randn_like(y_ref);
          loss = loss + (y[i] * c).sum();
          loss_ref = loss_ref + (y_ref * c).sum();
        }
      }
      EXPECT_LT(rel(loss, loss_ref), 1e-13);
      loss.backward();
      loss_ref.backward();
      EXPECT_LT(rel(x.grad(), x_ref.grad()), 1e-13) << "swiglu " << swiglu << ", " << out.size() << " weights";
      for (std::size_t i = 0; i < w.size(); ++i) {
        ASSERT_TRUE(w[i].grad().defined()) << i;
        if (w_ref[i].grad().defined()) {
          EXPECT_LT(rel(w[i].grad(), w_ref[i].grad()), 1e-13) << i;
        } else {
          EXPECT_EQ(w[i].grad().abs().max().item<double>(), 0.0) << i;
        }
      }
    }
  }
}

// nn::embed through the one-hot product against embedding(): the same rows forward, the same
// weight gradient (tokens repeated, some never drawn), in float64 and float32.
TEST(Embed, ProductBackwardMatchesEmbedding) {
  torch::manual_seed(12);
  for (const auto dtype : {torch::kFloat64, torch::kFloat32}) {
    const Tensor w = torch::randn({9, 6}, dtype).requires_grad_();
    const Tensor w_ref = w.detach().clone().requires_grad_();
    const Tensor tokens = torch::randint(0, 7, {3, 11}, torch::kInt64);  // tokens 7 and 8 unused
    const Tensor y = embed(w, tokens, true);
    const Tensor y_ref = torch::embedding(w_ref, tokens);
    EXPECT_TRUE(torch::equal(y, y_ref));
    const Tensor c = torch::randn_like(y_ref);
    (y * c).sum().backward();
    (y_ref * c).sum().backward();
    EXPECT_LT(rel(w.grad(), w_ref.grad()), dtype == torch::kFloat64 ? 1e-14 : 1e-6);
    EXPECT_EQ(w.grad().narrow(0, 7, 2).abs().max().item<double>(), 0.0);
  }
}

TEST(GsaLayer, WarmupPhaseIsDenseAndTheProbeReportsTheSelection) {
  const ModelConfig c = tiny(variant("gsa_rope_fixed"), "kernel");
  ModelConfig dense = c;
  dense.attention.options["indexer"] = "none";
  torch::manual_seed(8);
  auto layer = make_attention(c, 1);
  layer->to(torch::kFloat64);
  Params p;
  for (auto& item : layer->named_parameters()) p[item.key()] = item.value().detach().clone();
  const Tensor x = torch::randn({2, 13, 32}, torch::kFloat64);
  layer->set_phase("indexer_warmup");
  const Tensor y = layer->forward(x, nullptr);
  EXPECT_LT(rel(y, reference_layer(dense, p, x)), 1e-10);
  ASSERT_EQ(layer->aux_losses().size(), 1u);
  EXPECT_LT(rel(layer->aux_losses()[0].second, reference_aux(c, p, x, /*dense=*/true)), 1e-10);
  // The sparse phase differs: 13 tokens, 5 keys each from the sixth on.
  layer->set_phase("sparse");
  layer->clear_aux_losses();
  EXPECT_GT(rel(layer->forward(x, nullptr), y), 1e-3);
  AttentionProbe probe(4);
  layer->attach_probe(&probe, 0);
  torch::NoGradGuard no_grad;
  layer->forward(x, nullptr);
  const nlohmann::json s = probe.summary();
  ASSERT_EQ(s["layers"].size(), 1u);
  for (double selected : s["layers"][0]["selected_keys"]) EXPECT_EQ(selected, 5.0);
  for (double support : s["layers"][0]["support"]) EXPECT_LE(support, 5.0);
}

TEST(KvCache, DynamicRopeModelIsExactWithinTheTrainingContext) {
  expect_cache_matches(tiny(variant("softmax_rope_dynamic"), "kernel"), false, 8);
}

INSTANTIATE_TEST_SUITE_P(Models, Layer, ::testing::ValuesIn(cases()), case_name);

TEST(KvCache, RecordingGradientsConcatenatesInsteadOfWritingInPlace) {
  expect_cache_matches(tiny(variant("softmax_rope"), "kernel"), true);
  expect_cache_matches(tiny(variant("stick_breaking_rb"), "kernel"), true);
  ModelConfig one_layer = tiny(variant("softmax_rope_dynamic"), "composed");
  one_layer.layers = 1;
  expect_cache_matches(one_layer, true);
}

TEST(TransformerLM, GeluMlpAndUntiedHeadDecodeLikeTheFullPass) {
  ModelConfig c = tiny(variant("stick_breaking_rb"), "kernel");
  c.mlp = "gelu";
  c.mlp_hidden = 0;
  c.tie_embeddings = false;
  resolve(c);
  EXPECT_EQ(c.mlp_hidden, 128);
  TransformerLM model(c);
  EXPECT_TRUE(model->named_parameters().contains("head.weight"));
  EXPECT_FALSE(model->named_parameters().contains("block0.mlp.gate.weight"));
  expect_cache_matches(c, false);
  TransformerLM tied(tiny(variant("softmax_rope"), "kernel"));
  EXPECT_FALSE(tied->named_parameters().contains("head.weight"));
  EXPECT_TRUE(tied->named_parameters().contains("block0.mlp.gate.weight"));
}

// The weight-cast plan: the first pass learns the model's grouped projections (q, k and v and
// gate and up each one group; the CPU copies them, concatenated, in one call) and every later
// pass projects with its copies: the same logits and gradients, bit for bit, and a plan that
// follows the model into another dtype.
TEST(WeightCasts, LaterPassesEqualTheFirstBitForBit) {
  torch::manual_seed(12);
  TransformerLM model(tiny(variant("softmax_rope"), "kernel"));
  const Tensor tokens = torch::randint(0, model->config().vocab_size, {2, 9}, torch::kInt64);
  for (const auto dtype : {torch::kFloat32, torch::kFloat64}) {
    model->to(dtype);
    std::vector<Tensor> logits, grads;
    for (int pass = 0; pass < 3; ++pass) {
      model->zero_grad();
      const Tensor y = model->forward(tokens);
      (y * torch::linspace(-1, 1, y.size(-1), y.options())).sum().backward();
      logits.push_back(y.detach());
      std::vector<Tensor> g;
      for (const auto& p : model->parameters()) g.push_back(p.grad().reshape(-1));
      grads.push_back(torch::cat(g));
      // Two groups a block (q, k, v and gate, up): the single weights need no copy outside autocast.
      EXPECT_EQ(model->weight_casts().size(), static_cast<std::size_t>(2 * model->config().layers)) << pass;
    }
    for (int pass = 1; pass < 3; ++pass) {
      EXPECT_TRUE(torch::equal(logits[pass], logits[0])) << dtype << " pass " << pass;
      EXPECT_TRUE(torch::equal(grads[pass], grads[0])) << dtype << " pass " << pass;
    }
  }
}

TEST(KvCache, RejectsKeysThatDoNotContinueTheCache) {
  LayerCache cache;
  cache.append(torch::zeros({1, 3, 2, 8}), torch::zeros({1, 3, 2, 8}));
  EXPECT_THROW(cache.append(torch::zeros({1, 1, 4, 8}), torch::zeros({1, 1, 4, 8})), Error);
  EXPECT_THROW(cache.append(torch::zeros({2, 1, 2, 8}), torch::zeros({2, 1, 2, 8})), Error);
  EXPECT_THROW(cache.append(torch::zeros({1, 1, 2, 8}, torch::kFloat64), torch::zeros({1, 1, 2, 8}, torch::kFloat64)), Error);
  EXPECT_EQ(cache.length(), 3);
}

// ------------------------------------------------------------------ positions

TEST(Rope, ScoresDependOnlyOnRelativePosition) {
  for (const char* scaling : {"none", "linear", "ntk", "yarn"}) {
    RopeConfig c;
    c.scaling = scaling;
    c.factor = 4;
    const Rope rope(c, 16, 64);
    torch::manual_seed(5);
    const Tensor q = torch::randn({1, 1, 1, 16}, torch::kFloat64), k = torch::randn({1, 1, 1, 16}, torch::kFloat64);
    auto score = [&](std::int64_t pq, std::int64_t pk) {
      return (rope.apply(q, pq, 200) * rope.apply(k, pk, 200)).sum().item<double>();
    };
    EXPECT_NEAR(score(10, 3), score(40, 33), 1e-9) << scaling;
    EXPECT_NEAR(score(7, 7), score(100, 100), 1e-9) << scaling;
  }
}

TEST(Rope, LinearScalingIsPositionInterpolation) {
  RopeConfig none, linear;
  linear.scaling = "linear";
  linear.factor = 4;
  const Tensor x = torch::randn({1, 1, 2, 8}, torch::kFloat64);
  EXPECT_LT(rel(Rope(linear, 8, 64).apply(x, 12, 13), Rope(none, 8, 64).apply(x, 3, 4)), 1e-12);
}

TEST(Rope, DynamicScalingWaitsForTheTrainingContext) {
  RopeConfig none, dynamic;
  dynamic.scaling = "dynamic";
  dynamic.factor = 4;
  const Tensor x = torch::randn({1, 8, 2, 8}, torch::kFloat64);
  EXPECT_LT(rel(Rope(dynamic, 8, 32).apply(x, 20, 32), Rope(none, 8, 32).apply(x, 20, 32)), 1e-12);
  EXPECT_GT(rel(Rope(dynamic, 8, 32).apply(x, 20, 33), Rope(none, 8, 32).apply(x, 20, 33)), 1e-3);
}

TEST(Rope, YarnScalesNormsByItsAttentionFactor) {
  RopeConfig yarn;
  yarn.scaling = "yarn";
  yarn.factor = 8;
  const Tensor x = torch::randn({1, 5, 2, 16}, torch::kFloat64);
  const Tensor y = Rope(yarn, 16, 64).apply(x, 3, 8);
  EXPECT_NEAR((y.norm() / x.norm()).item<double>(), 1 + 0.1 * std::log(8.0), 1e-12);
}

TEST(Rope, Float32InputsRotateInFloat32AndMatchFloat64) {
  RopeConfig c;
  const Tensor x = torch::randn({2, 6, 3, 16});
  const Rope rope(c, 16, 8);
  const Tensor y = rope.apply(x, 100, 106);
  EXPECT_EQ(y.scalar_type(), torch::kFloat32);
  EXPECT_LT(rel(y.to(torch::kFloat64), rope.apply(x.to(torch::kFloat64), 100, 106)), 1e-6);
}

// The fused rotary operator against the composed expression, forward and gradient, for every
// scaling (dynamic's tables depend on the length seen), in float64 and float32.
TEST(Rope, FusedOperatorMatchesTheComposedExpression) {
  for (const char* scaling : {"none", "linear", "ntk", "dynamic", "yarn"}) {
    for (torch::ScalarType dtype : {torch::kFloat64, torch::kFloat32}) {
      RopeConfig c;
      c.scaling = scaling;
      c.factor = 4;
      const Rope composed(c, 16, 32), fused(c, 16, 32, /*fused=*/true);
      torch::manual_seed(9);
      const Tensor x = torch::randn({2, 9, 3, 16}, dtype).requires_grad_(true);
      const Tensor w = torch::randn({2, 9, 3, 16}, dtype);
      const Tensor y_composed = composed.apply(x, 30, 39), y_fused = fused.apply(x, 30, 39);
      const Tensor g_composed = torch::autograd::grad({(y_composed * w).sum()}, {x})[0];
      const Tensor g_fused = torch::autograd::grad({(y_fused * w).sum()}, {x})[0];
      const double tol = dtype == torch::kFloat64 ? 1e-14 : 1e-6;
      EXPECT_LT(rel(y_fused, y_composed), tol) << scaling;
      EXPECT_LT(rel(g_fused, g_composed), tol) << scaling;
      // A strided input (a view of a wider projection) takes the same path.
      const Tensor wide = torch::randn({2, 9, 3, 32}, dtype);
      EXPECT_LT(rel(fused.apply(wide.narrow(3, 8, 16), 0, 9), composed.apply(wide.narrow(3, 8, 16), 0, 9)), tol)
          << scaling;
    }
  }
}

TEST(Alibi, BiasDecaysWithDistanceBySlope) {
  // q = 0: all logits equal, so the weights are exp(-m (j - i)) normalized; v = identity
  // reads them out.
  const std::int64_t L = 5;
  const Tensor q = torch::zeros({1, L, 2, 4}, torch::kFloat64), k = torch::randn({1, L, 2, 4}, torch::kFloat64);
  const Tensor v = torch::eye(L, torch::kFloat64).view({1, L, 1, L}).expand({1, L, 2, L});
  const Tensor slopes = alibi_slopes(2);
  EXPECT_DOUBLE_EQ(slopes[0].item<double>(), std::pow(2.0, -4.0));
  EXPECT_DOUBLE_EQ(slopes[1].item<double>(), std::pow(2.0, -8.0));
  const Tensor w = composed::softmax_attention(q, k, v, 1.0, true, slopes);
  for (std::int64_t h = 0; h < 2; ++h) {
    const double m = slopes[h].item<double>();
    double norm = 0;
    for (std::int64_t i = 0; i < L; ++i) norm += std::exp(-m * double(L - 1 - i));
    for (std::int64_t i = 0; i < L; ++i) {
      EXPECT_NEAR(w[0][L - 1][h][i].item<double>(), std::exp(-m * double(L - 1 - i)) / norm, 1e-12);
    }
  }
}

// ------------------------------------------------------------------ composed against the operators

// |a - b| <= tol (1 + |b|) elementwise, so rows that are exactly zero compare too.
::testing::AssertionResult close(const Tensor& a, const Tensor& b, double tol) {
  const double err = ((a - b).abs() - tol * (1 + b.abs())).max().item<double>();
  if (err <= 0) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << "max |a - b| " << (a - b).abs().max().item<double>()
                                       << " beyond tolerance " << tol;
}

// Small, awkward shapes: one key, odd head dimensions, fewer queries than keys (the queries are
// the last positions), grouped-query attention (Hq a multiple of Hkv).
struct Shape {
  std::int64_t B, Lq, Lk, Hq, Hkv, D, Dv;
  double scale;
};
const std::vector<Shape>& shapes() {
  static const std::vector<Shape> all = {
      {1, 1, 1, 1, 1, 3, 2, 1.0},
      {2, 5, 5, 4, 2, 7, 5, 1.3},
      {1, 3, 9, 6, 2, 8, 3, 2.0},
      {2, 17, 17, 2, 1, 16, 16, 0.7},
  };
  return all;
}

struct Qkv {
  Tensor q, k, v;
  std::vector<Tensor> leaves() const { return {q, k, v}; }
};
Qkv random_qkv(const Shape& s, std::uint64_t seed) {
  torch::manual_seed(seed);
  const auto f64 = torch::TensorOptions().dtype(torch::kFloat64);
  return {torch::randn({s.B, s.Lq, s.Hq, s.D}, f64).requires_grad_(),
          torch::randn({s.B, s.Lk, s.Hkv, s.D}, f64).requires_grad_(),
          torch::randn({s.B, s.Lk, s.Hkv, s.Dv}, f64).requires_grad_()};
}

std::vector<Tensor> grads_of(const Tensor& loss, const Qkv& in) {
  return torch::autograd::grad({loss}, in.leaves());
}

TEST(Composed, EntmaxMatchesTheFusedOperatorForwardAndBackward) {
  std::uint64_t seed = 10;
  for (const Shape& s : shapes()) {
    for (double alpha : {1.25, 1.5, 2.0, 3.0}) {
      for (bool attend_current : {true, false}) {
        const Qkv in = random_qkv(s, ++seed);
        torch_ops::AttentionCall call;
        call.scale = s.scale;
        call.attend_current = attend_current;
        const Tensor fused = torch_ops::entmax_attention(in.q, in.k, in.v, call, alpha);
        const Tensor mine =
            composed::entmax_attention(in.q, in.k, in.v, s.scale, attend_current, alpha);
        const std::string what = "Lq " + std::to_string(s.Lq) + " Lk " + std::to_string(s.Lk) +
                                 " alpha " + std::to_string(alpha) +
                                 (attend_current ? " attend_current" : "");
        EXPECT_TRUE(close(mine, fused, 1e-10)) << what;
        const Tensor w = torch::randn_like(fused);
        const auto g_fused = grads_of((fused * w).sum(), in);
        const auto g_mine = grads_of((mine * w).sum(), in);
        for (std::size_t i = 0; i < 3; ++i) {
          EXPECT_TRUE(close(g_mine[i], g_fused[i], 1e-9)) << what << ", gradient " << "qkv"[i];
        }
      }
    }
  }
}

TEST(Composed, SieveMatchesTheFusedOperatorForwardBackwardAndCount) {
  struct Filter {
    std::string name;
    std::optional<double> eps;
  };
  std::uint64_t seed = 50;
  for (const Shape& s : shapes()) {
    for (double alpha : {1.25, 1.5, 2.0, 3.0}) {
      for (const Filter& f : {Filter{"exact", {}}, Filter{"bound", {}}, Filter{"bound", 0.3}}) {
        for (bool attend_current : {false, true}) {
          const Qkv in = random_qkv(s, ++seed);
          torch_ops::AttentionCall call;
          call.scale = s.scale;
          call.attend_current = attend_current;
          torch_ops::Opt<double> eps;
          if (f.eps) eps = *f.eps;
          const auto [out, rem, count] =
              torch_ops::sieve_attention(in.q, in.k, in.v, call, alpha, f.name, eps);
          const auto [mine, mine_rem] = composed::sieve_attention(
              in.q, in.k, in.v, s.scale, attend_current, alpha, f.name, f.eps);
          const std::string what = "Lq " + std::to_string(s.Lq) + " Lk " + std::to_string(s.Lk) +
                                   " alpha " + std::to_string(alpha) + " " + f.name +
                                   (f.eps ? " eps" : "") + (attend_current ? " attend_current" : "");
          EXPECT_TRUE(close(mine, out, 1e-11)) << what;
          EXPECT_TRUE(close(mine_rem, rem, 1e-11)) << what;
          // float64 at these sizes: no candidate's weight underflows, so the nonzero weights
          // are the candidates.
          const Tensor w = composed::sieve_weights(in.q, in.k, s.scale, attend_current, alpha,
                                                   f.name, f.eps)
                               .first;
          EXPECT_TRUE(torch::equal(w.ne(0).sum(-1).transpose(1, 2).to(torch::kInt32), count))
              << what;
          const Tensor wo = torch::randn_like(out), wr = torch::randn_like(rem);
          const auto g_fused = grads_of((out * wo).sum() + (rem * wr).sum(), in);
          const auto g_mine = grads_of((mine * wo).sum() + (mine_rem * wr).sum(), in);
          for (std::size_t i = 0; i < 3; ++i) {
            EXPECT_TRUE(close(g_mine[i], g_fused[i], 1e-10)) << what << ", gradient " << "qkv"[i];
          }
        }
      }
    }
  }
}

TEST(Composed, EntmaxRowsSumToOneInFloat32AndAreSparse) {
  torch::manual_seed(7);
  const Tensor q = torch::randn({2, 40, 2, 8}), k = torch::randn({2, 40, 1, 8});
  for (double alpha : {1.25, 1.5, 2.0, 3.0}) {
    const Tensor p = composed::entmax_weights(q, k, 2.0, true, alpha);
    EXPECT_EQ(p.scalar_type(), torch::kFloat32);
    EXPECT_LT((p.sum(-1) - 1).abs().max().item<double>(), 1e-5) << alpha;
    EXPECT_GT(p.eq(0).logical_and(torch::ones({40, 40}, torch::kBool).tril()).sum().item<int64_t>(), 0)
        << alpha;
    EXPECT_EQ(p.ne(0).logical_and(torch::ones({40, 40}, torch::kBool).triu(1)).sum().item<int64_t>(), 0)
        << alpha;
  }
  // The first query sees no earlier key: its row is zero.
  const Tensor previous = composed::entmax_weights(q, k, 2.0, false, 1.5);
  EXPECT_EQ(previous.select(2, 0).abs().max().item<double>(), 0.0);
  EXPECT_LT((previous.narrow(2, 1, 39).sum(-1) - 1).abs().max().item<double>(), 1e-5);
}

TEST(Composed, SieveWithAHugeMarginIsStickBreaking) {
  const Qkv in = random_qkv({2, 6, 6, 2, 1, 4, 3, 1.0}, 3);
  const auto [sieve, sieve_rem] =
      composed::sieve_attention(in.q, in.k, in.v, 1.0, false, 1.5, "bound", 1e6);
  const auto [sb, sb_rem] = composed::stick_breaking_attention(in.q, in.k, in.v, 1.0, false);
  EXPECT_TRUE(close(sieve, sb, 1e-14));
  EXPECT_TRUE(close(sieve_rem, sb_rem, 1e-14));
}

TEST(Composed, BadArgumentsAreErrorsNamingThem) {
  const Qkv in = random_qkv({1, 2, 2, 1, 1, 4, 4, 1.0}, 1);
  auto message = [](const std::function<void()>& fn) {
    try {
      fn();
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  EXPECT_NE(message([&] { composed::entmax_weights(in.q, in.k, 1.0, true, 1.0); }).find("argument 'alpha'"),
            std::string::npos);
  EXPECT_NE(message([&] { composed::sieve_weights(in.q, in.k, 1.0, false, 1.5, "top", {}); })
                .find("argument 'filter': expected \"exact\" or \"bound\", got \"top\""),
            std::string::npos);
  EXPECT_NE(message([&] { composed::sieve_weights(in.q, in.k, 1.0, false, 1.5, "exact", 0.5); })
                .find("argument 'eps'"),
            std::string::npos);
  EXPECT_NE(message([&] { composed::sieve_weights(in.q, in.k, 1.0, false, 1.5, "bound", -1.0); })
                .find("argument 'eps'"),
            std::string::npos);
}

// The probe's support size of Sieve's weights is the operator's candidate count: mean and
// largest per head.
TEST(Probe, SupportOfSieveWeightsIsTheCandidateCount) {
  const Qkv in = random_qkv({2, 12, 12, 2, 1, 8, 4, 2.0}, 9);
  torch::NoGradGuard no_grad;
  AttentionProbe probe(12);
  probe.record(0, composed::sieve_weights(in.q, in.k, 2.0, false, 1.5, "exact", {}).first, false);
  torch_ops::AttentionCall call;
  call.scale = 2.0;
  call.attend_current = false;
  const Tensor count = std::get<2>(torch_ops::sieve_attention(in.q, in.k, in.v, call, 1.5));
  const nlohmann::json s = probe.summary();
  for (std::int64_t h = 0; h < 2; ++h) {
    const Tensor c = count.select(2, h).to(torch::kFloat64);
    EXPECT_NEAR(s["layers"][0]["support"][h].get<double>(), c.mean().item<double>(), 1e-12);
    EXPECT_EQ(s["layers"][0]["support_max"][h].get<double>(), c.max().item<double>());
  }
  EXPECT_EQ(s["max"]["support_max"].get<double>(), count.max().item<int>());
  // Sparse: fewer candidates than visible keys on average (query j sees j keys).
  EXPECT_LT(s["mean"]["support"].get<double>(), 5.5);
}

// ------------------------------------------------------------------ configuration

void expect_error(const std::function<void(ModelConfig&)>& set, const std::string& fragment) {
  ModelConfig c;
  c.vocab_size = 11;
  c.d_model = 32;
  c.context_len = 8;
  set(c);
  try {
    TransformerLM model(c);
    ADD_FAILURE() << "no error; expected one mentioning " << fragment;
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(fragment), std::string::npos) << e.what();
  }
}

TEST(ModelConfig, ErrorsNameTheKey) {
  expect_error([](ModelConfig& c) { c.attention.kind = "magic"; }, "'model.attention.kind'");
  expect_error([](ModelConfig& c) { c.attention.kv_heads = 3; }, "'model.attention.kv_heads'");
  expect_error([](ModelConfig& c) { c.attention.position = "sinusoid"; }, "'model.attention.position'");
  expect_error([](ModelConfig& c) { c.attention.options["gate"] = "g3"; }, "'model.attention.gate'");
  expect_error([](ModelConfig& c) { c.attention.options["ssmax"] = 1; }, "'model.attention.ssmax'");
  expect_error([](ModelConfig& c) { c.attention.implementation = "fast"; }, "'model.attention.implementation'");
  expect_error([](ModelConfig& c) { c.mlp = "relu"; }, "'model.mlp'");
  expect_error([](ModelConfig& c) { c.attention.heads = 5; }, "'model.attention.heads'");
  expect_error([](ModelConfig& c) { c.attention.head_dim = 7; }, "'model.attention.head_dim'");
  expect_error([](ModelConfig& c) { c.attention.rope.scaling = "xpos"; }, "'model.attention.rope.scaling'");
  expect_error([](ModelConfig& c) { c.attention.rope.factor = 0.5; }, "'model.attention.rope.factor'");
  expect_error([](ModelConfig& c) { c.vocab_size = 0; }, "'model.vocab_size'");
  expect_error([](ModelConfig& c) { c.norm_eps = 0; }, "'model.norm_eps'");
  expect_error([](ModelConfig& c) {
    c.attention.kind = "stick_breaking";
    c.attention.position = "alibi";
  }, "'model.attention.position'");
  // A key of another mechanism.
  expect_error([](ModelConfig& c) { c.attention.options["remainder_bias"] = true; },
               "unknown key 'model.attention.remainder_bias'");
  expect_error([](ModelConfig& c) {
    c.attention.kind = "stick_breaking";
    c.attention.implementation = "composed";
    c.attention.options["halt_cutoff"] = 40.0;
  }, "'model.attention.halt_cutoff'");
  expect_error([](ModelConfig& c) {
    c.attention.kind = "stick_breaking";
    c.attention.options["halt_cutoff"] = -1.0;
  }, "'model.attention.halt_cutoff'");
}

TEST(ModelConfig, EntmaxAndSieveErrorsNameTheKey) {
  auto with = [](const std::string& kind, nlohmann::json options, std::string position = "auto") {
    return [=](ModelConfig& c) {
      c.attention.kind = kind;
      c.attention.position = position;
      c.attention.options = options;
    };
  };
  expect_error(with("entmax", {{"alpha", 1.0}}), "key 'model.attention.alpha': expected > 1");
  expect_error(with("entmax", {{"alpha", "1.5"}}), "'model.attention.alpha'");
  expect_error(with("entmax", nlohmann::json::object(), "alibi"), "key 'model.attention.position': expected one of rope, nope");
  expect_error(with("entmax", {{"filter", "bound"}}), "unknown key 'model.attention.filter'");
  expect_error(with("sieve", nlohmann::json::object(), "rope"), "key 'model.attention.position': expected one of nope");
  expect_error(with("sieve", {{"alpha", 0.5}}), "'model.attention.alpha'");
  expect_error(with("sieve", {{"filter", "top"}}), "key 'model.attention.filter': expected one of exact, bound");
  expect_error(with("sieve", {{"eps", 0.5}}), "key 'model.attention.eps': expected null or absent unless filter is \"bound\"");
  expect_error(with("sieve", {{"filter", "bound"}, {"eps", -1}}), "key 'model.attention.eps': expected a number > 0");
  expect_error(with("sieve", {{"filter", "bound"}, {"eps", "big"}}), "key 'model.attention.eps'");
  expect_error(with("sieve", {{"halt_cutoff", 1.0}}), "unknown key 'model.attention.halt_cutoff'");
}

TEST(ModelConfig, EntmaxAndSieveDefaults) {
  ModelConfig c;
  c.vocab_size = 11;
  c.context_len = 8;
  c.attention.kind = "entmax";
  resolve(c);
  EXPECT_EQ(c.attention.position, "rope");
  EXPECT_EQ(c.attention.implementation, "kernel");
  EXPECT_EQ(c.attention.options, (nlohmann::json{{"alpha", 1.5}, {"attend_current", true}}));
  c.attention.kind = "sieve";
  c.attention.position = "auto";
  c.attention.options = nlohmann::json::object();
  resolve(c);
  EXPECT_EQ(c.attention.position, "nope");
  EXPECT_EQ(c.attention.options,
            (nlohmann::json{{"alpha", 1.5}, {"filter", "exact"}, {"eps", nullptr},
                            {"attend_current", false}, {"remainder_bias", false}, {"head_norm", false}}));
  c.attention.options = {{"filter", "bound"}, {"eps", 2}};
  resolve(c);
  EXPECT_EQ(c.attention.options["eps"], 2);
  const nlohmann::json once = write_model(c);
  ModelConfig again = read_model(once);
  resolve(again);
  EXPECT_EQ(write_model(again), once);
}

TEST(ModelConfig, KernelWithAlibiIsAConfigError) {
  expect_error([](ModelConfig& c) {
    c.attention.position = "alibi";
    c.attention.implementation = "kernel";
  }, "'model.attention.implementation'");
  ModelConfig c;
  c.vocab_size = 11;
  c.context_len = 8;
  c.attention.position = "alibi";
  resolve(c);
  EXPECT_EQ(c.attention.implementation, "composed");
}

TEST(ModelConfig, ResolveFillsPlaceholdersAndIsIdempotent) {
  ModelConfig c;
  c.vocab_size = 11;
  c.context_len = 8;
  c.attention.kind = "stick_breaking";
  resolve(c);
  EXPECT_EQ(c.attention.position, "nope");
  EXPECT_EQ(c.attention.implementation, "kernel");
  EXPECT_EQ(c.attention.kv_heads, 4);
  EXPECT_EQ(c.attention.head_dim, 64);
  EXPECT_EQ(c.mlp_hidden, 704);
  EXPECT_EQ(c.attention.options["remainder_bias"], false);
  EXPECT_EQ(c.attention.options["halt_cutoff"], 0.0);
  const nlohmann::json once = write_model(c);
  resolve(c);
  EXPECT_EQ(write_model(c), once);
  ModelConfig again = read_model(once);
  resolve(again);
  EXPECT_EQ(write_model(again), once);
}

TEST(Mechanisms, EveryEntryBuildsItsLayerAndNamesAreUnique) {
  std::set<std::string> names;
  for (const Mechanism& m : mechanisms()) {
    EXPECT_TRUE(names.insert(m.name).second) << m.name;
    ModelConfig c;
    c.vocab_size = 11;
    c.d_model = 32;
    c.context_len = 8;
    c.attention.kind = m.name;
    resolve(c);
    EXPECT_EQ(c.attention.position, m.positions.front());
    auto layer = make_attention(c, 0);
    torch::NoGradGuard no_grad;
    EXPECT_EQ(layer->forward(torch::randn({1, 3, 32}), nullptr).sizes(), torch::IntArrayRef({1, 3, 32}));
  }
}

// What keeps a training step out of a CUDA graph is said per configuration: Sieve's bound
// filter has nothing to read on the host, its exact filter and entmax read their search's flag.
TEST(Mechanisms, GraphBlockersFollowTheConfiguration) {
  auto blocker = [](const std::string& kind, const nlohmann::json& options) {
    ModelConfig c;
    c.vocab_size = 11;
    c.d_model = 32;
    c.context_len = 8;
    c.attention.kind = kind;
    c.attention.options = options;
    resolve(c);
    const Mechanism& m = find_mechanism(kind, "model.attention.kind");
    return m.graph_blocker ? m.graph_blocker(c.attention) : std::string("unset");
  };
  EXPECT_EQ(blocker("softmax", nlohmann::json::object()), "");
  EXPECT_EQ(blocker("stick_breaking", nlohmann::json::object()), "");
  EXPECT_EQ(blocker("sieve", {{"filter", "bound"}}), "");
  EXPECT_NE(blocker("sieve", nlohmann::json::object()).find("exact filter"), std::string::npos);
  EXPECT_NE(blocker("entmax", nlohmann::json::object()).find("flag on the host"), std::string::npos);
  EXPECT_NE(blocker("gsa", nlohmann::json::object()).find("budget"), std::string::npos);
}

}  // namespace
}  // namespace winnow::nn
