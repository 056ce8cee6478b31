#include "nn/composed.h"

#include <cmath>
#include <string>
#include <tuple>
#include <vector>

#include "winnow/error.h"

namespace winnow::nn::composed {
namespace {

// (Lq, Lk): j - i for query row r (at position r + Lk - Lq) and key i.
torch::Tensor distance(std::int64_t lq, std::int64_t lk, const torch::Device& device) {
  const auto opts = torch::TensorOptions().dtype(torch::kInt64).device(device);
  return torch::arange(lk - lq, lk, opts).unsqueeze(1) - torch::arange(0, lk, opts).unsqueeze(0);
}

torch::ScalarType work_type(const torch::Tensor& q) {
  return q.scalar_type() == torch::kFloat64 ? torch::kFloat64 : torch::kFloat32;
}

// Query heads first: (B, L, H, D) -> (B, Hq, L, D), k repeated over each group's query heads.
torch::Tensor keys_per_query_head(const torch::Tensor& k, std::int64_t query_heads) {
  return k.repeat_interleave(query_heads / k.size(2), 2).transpose(1, 2);
}

// z (B, Hq, Lq, Lk) = scale <q_j, k_i> in the work type, and which keys each row sees (Lq, Lk).
struct Scores {
  torch::Tensor z, visible;
};
Scores scores(const torch::Tensor& q, const torch::Tensor& k, double scale, bool attend_current) {
  const torch::Tensor qh = q.transpose(1, 2), kh = keys_per_query_head(k, q.size(2));
  const torch::Tensor dist = distance(q.size(1), k.size(1), q.device());
  return {torch::matmul(qh, kh.transpose(-1, -2)).to(work_type(q)) * scale,
          attend_current ? dist.ge(0) : dist.gt(0)};
}

// log A_ij = z_ij - sum_{k >= i, allowed} softplus(z_kj) on the allowed keys, 0 elsewhere
// (spec/stick-breaking.md); returns (A, rem).
std::pair<torch::Tensor, torch::Tensor> stick_breaking_over(const torch::Tensor& z,
                                                            const torch::Tensor& allowed) {
  const torch::Tensor hidden = allowed.logical_not();
  // Hidden logits are zeroed before anything is exponentiated, so no inf or NaN can reach the
  // gradient through the masked branch.
  const torch::Tensor zm = z.masked_fill(hidden, 0);
  // softplus spelled as in math/elementwise.h: torch's softplus returns z itself above z = 20,
  // which leaves a weight sigmoid(z) at 1 instead of 1 - e^-z (an error of 2e-9 at z = 20).
  // (z + |z|) / 2 also gives the right gradient, sigmoid(0) = 1/2, at z = 0.
  const torch::Tensor a = zm.abs();
  const torch::Tensor cost = ((zm + a) * 0.5 + torch::log1p(torch::exp(-a))).masked_fill(hidden, 0);
  const torch::Tensor suffix = cost.flip(-1).cumsum(-1).flip(-1);
  return {torch::exp(zm - suffix).masked_fill(hidden, 0), torch::exp(-cost.sum(-1))};
}

void check_alpha(const char* fn, double alpha) {
  if (!(std::isfinite(alpha) && alpha > 1)) {
    throw Error(ErrorKind::invalid_argument, std::string(fn) +
                                                 ": argument 'alpha': expected a finite number > "
                                                 "1, got " +
                                                 std::to_string(alpha));
  }
}

// The alpha-entmax threshold of each row of x = (alpha - 1) z, shifted so that the row maximum
// is 0 (the support then lies in (-1, 0], and float32 sums stay exact enough), with hidden keys
// at -2, below any support; n (..., 1) counts the visible keys (>= 1). No gradient.
torch::Tensor entmax_threshold(const torch::Tensor& x, const torch::Tensor& n, double alpha) {
  const std::int64_t len = x.size(-1);
  if (alpha == 2.0 || alpha == 1.5) {
    // The exact sort-based forms (reference/entmax.cpp): with the k largest as support, tau_k
    // solves the mass equation in closed form; the support is the largest k with
    // tau_k <= x_(k).
    const torch::Tensor xs = std::get<0>(x.sort(-1, /*descending=*/true));
    const torch::Tensor k = torch::arange(1, len + 1, x.options());
    const torch::Tensor mean = xs.cumsum(-1) / k;
    torch::Tensor tau;
    if (alpha == 2.0) {
      tau = mean - 1 / k;
    } else {
      const torch::Tensor var = (xs * xs).cumsum(-1) / k - mean * mean;
      tau = mean - ((1 - var * k) / k).clamp_min(0).sqrt();
    }
    const torch::Tensor size = (k * tau.le(xs)).amax(-1, /*keepdim=*/true);
    return tau.gather(-1, size.to(torch::kInt64) - 1);
  }
  // Bisection on the spec's bracket (the maximum is 0): -1 <= tau <= -n^(1 - alpha); enough
  // halvings to reach the dtype's resolution from a bracket no wider than 1.
  torch::Tensor lo = torch::full_like(n, -1.0), hi = -torch::pow(n, 1 - alpha);
  const int halvings = x.scalar_type() == torch::kFloat64 ? 60 : 30;
  for (int it = 0; it < halvings; ++it) {
    const torch::Tensor mid = (lo + hi) / 2;
    const torch::Tensor over = (x - mid).clamp_min(0).pow(1 / (alpha - 1)).sum(-1, true).gt(1);
    lo = torch::where(over, mid, lo);
    hi = torch::where(over, hi, mid);
  }
  return (lo + hi) / 2;
}

// For x = (alpha - 1) z (no gradient): each row's maximum over visible keys m (0 for a row
// that sees none), its threshold tau relative to m, and the support { x - m > tau } (visible
// keys only).
struct EntmaxSupport {
  torch::Tensor max, tau, support;
};
EntmaxSupport entmax_support(const torch::Tensor& x, const torch::Tensor& visible, double alpha) {
  torch::NoGradGuard no_grad;
  const torch::Tensor hidden = visible.logical_not();
  const torch::Tensor any = visible.any(-1, /*keepdim=*/true);
  const torch::Tensor n = visible.sum(-1, /*keepdim=*/true).clamp_min(1).to(x.scalar_type());
  const torch::Tensor m =
      x.masked_fill(hidden, -INFINITY).amax(-1, true).masked_fill(any.logical_not(), 0);
  const torch::Tensor shifted = (x - m).masked_fill(hidden, -2);
  const torch::Tensor tau = entmax_threshold(shifted, n.expand(m.sizes()).contiguous(), alpha);
  return {m, tau, shifted.gt(tau) & visible};
}

}  // namespace

torch::Tensor softmax_weights(const torch::Tensor& q, const torch::Tensor& k, double scale,
                              bool attend_current,
                              const std::optional<torch::Tensor>& alibi_slopes) {
  const torch::Tensor qh = q.transpose(1, 2), kh = keys_per_query_head(k, q.size(2));
  const torch::Tensor dist = distance(q.size(1), k.size(1), q.device());
  const torch::Tensor visible = attend_current ? dist.ge(0) : dist.gt(0);
  const torch::ScalarType wt = work_type(q);
  torch::Tensor z = torch::matmul(qh, kh.transpose(-1, -2)).to(wt) * scale;
  if (alibi_slopes) z = z - alibi_slopes->to(wt).view({1, -1, 1, 1}) * dist.to(wt);
  // A row that sees no key outputs zero: softmax over a row of -inf alone would be NaN.
  const torch::Tensor any = visible.any(-1, /*keepdim=*/true);
  return torch::softmax(z.masked_fill(visible.logical_not(), -INFINITY)
                            .masked_fill(any.logical_not(), 0),
                        -1) *
         any;
}

std::pair<torch::Tensor, torch::Tensor> stick_breaking_weights(const torch::Tensor& q,
                                                               const torch::Tensor& k,
                                                               double scale, bool attend_current) {
  const Scores s = scores(q, k, scale, attend_current);
  return stick_breaking_over(s.z, s.visible);
}

torch::Tensor entmax_weights(const torch::Tensor& q, const torch::Tensor& k, double scale,
                             bool attend_current, double alpha) {
  check_alpha("composed::entmax_weights", alpha);
  const Scores s = scores(q, k, scale, attend_current);
  const torch::Tensor x = s.z * (alpha - 1);
  const EntmaxSupport e = entmax_support(x.detach(), s.visible, alpha);
  const torch::Tensor outside = e.support.logical_not();
  // p = y^(1 / (alpha - 1)) with y = x - m - tau on the support. tau depends on x (the mass
  // equation), with d tau / d x_i = u_i / sum_k u_k, u = p^(2 - alpha) = y^((2 - alpha) /
  // (alpha - 1)): subtracting sum_k u_k (x_k - x_k) / sum_k u_k, which is 0, gives y exactly
  // that derivative, so autograd produces the spec's dz = u (dp - delta).
  torch::Tensor y = (x - e.max) - e.tau;
  const torch::Tensor u =
      y.detach().masked_fill(outside, 1).pow((2 - alpha) / (alpha - 1)).masked_fill(outside, 0);
  const torch::Tensor su = u.sum(-1, /*keepdim=*/true);
  y = y - (u * (x - x.detach())).sum(-1, true) / su.masked_fill(su.eq(0), 1);
  // Off the support y^(1 / (alpha - 1)) is replaced before the power, not after: for alpha > 2
  // its derivative at 0 is infinite and would turn the masked gradient into NaN.
  return y.masked_fill(outside, 1).pow(1 / (alpha - 1)).masked_fill(outside, 0);
}

std::pair<torch::Tensor, torch::Tensor> sieve_weights(const torch::Tensor& q,
                                                      const torch::Tensor& k, double scale,
                                                      bool attend_current, double alpha,
                                                      const std::string& filter,
                                                      std::optional<double> eps) {
  constexpr const char* fn = "composed::sieve_weights";
  check_alpha(fn, alpha);
  if (filter != "exact" && filter != "bound") {
    throw Error(ErrorKind::invalid_argument, std::string(fn) +
                                                 ": argument 'filter': expected \"exact\" or "
                                                 "\"bound\", got \"" +
                                                 filter + "\"");
  }
  if (eps && filter != "bound") {
    throw Error(ErrorKind::invalid_argument,
                std::string(fn) +
                    ": argument 'eps': expected none unless filter is \"bound\", got " +
                    std::to_string(*eps) + " with filter \"" + filter + "\"");
  }
  if (eps && !(std::isfinite(*eps) && *eps >= 0)) {
    throw Error(ErrorKind::invalid_argument, std::string(fn) +
                                                 ": argument 'eps': expected a finite number "
                                                 ">= 0, got " +
                                                 std::to_string(*eps));
  }
  const Scores s = scores(q, k, scale, attend_current);
  torch::Tensor candidates;
  if (filter == "exact") {
    candidates = entmax_support(s.z.detach() * (alpha - 1), s.visible, alpha).support;
  } else {
    torch::NoGradGuard no_grad;
    const torch::Tensor z = s.z.detach();
    const torch::Tensor m = z.masked_fill(s.visible.logical_not(), -INFINITY).amax(-1, true);
    candidates = z.gt(m - eps.value_or(1 / (alpha - 1))) & s.visible;
  }
  return stick_breaking_over(s.z, candidates);
}

torch::Tensor softmax_attention(const torch::Tensor& q, const torch::Tensor& k,
                                const torch::Tensor& v, double scale, bool attend_current,
                                const std::optional<torch::Tensor>& alibi_slopes) {
  const torch::Tensor p = softmax_weights(q, k, scale, attend_current, alibi_slopes);
  const torch::Tensor vh = keys_per_query_head(v, q.size(2));
  return torch::matmul(p.to(vh.scalar_type()), vh).transpose(1, 2).to(q.scalar_type());
}

std::pair<torch::Tensor, torch::Tensor> stick_breaking_attention(const torch::Tensor& q,
                                                                 const torch::Tensor& k,
                                                                 const torch::Tensor& v,
                                                                 double scale,
                                                                 bool attend_current) {
  const auto [w, rem] = stick_breaking_weights(q, k, scale, attend_current);
  const torch::Tensor vh = keys_per_query_head(v, q.size(2));
  const torch::Tensor out = torch::matmul(w.to(vh.scalar_type()), vh).transpose(1, 2);
  return {out.to(q.scalar_type()), rem.transpose(1, 2)};
}

torch::Tensor entmax_attention(const torch::Tensor& q, const torch::Tensor& k,
                               const torch::Tensor& v, double scale, bool attend_current,
                               double alpha) {
  const torch::Tensor p = entmax_weights(q, k, scale, attend_current, alpha);
  const torch::Tensor vh = keys_per_query_head(v, q.size(2));
  return torch::matmul(p.to(vh.scalar_type()), vh).transpose(1, 2).to(q.scalar_type());
}

std::pair<torch::Tensor, torch::Tensor> sieve_attention(
    const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v, double scale,
    bool attend_current, double alpha, const std::string& filter, std::optional<double> eps) {
  const auto [w, rem] = sieve_weights(q, k, scale, attend_current, alpha, filter, eps);
  const torch::Tensor vh = keys_per_query_head(v, q.size(2));
  const torch::Tensor out = torch::matmul(w.to(vh.scalar_type()), vh).transpose(1, 2);
  return {out.to(q.scalar_type()), rem.transpose(1, 2)};
}

namespace {

// One view's weights: the queries may be fewer than the keys (the probe's last rows), their
// positions the last q.size(1) of the keys'.
torch::Tensor threshold_view(const torch::Tensor& q, const torch::Tensor& k, bool attend_current,
                             const ThresholdSpec& spec) {
  const auto normalized = [&](const torch::Tensor& x) {
    const torch::Tensor w = x.to(work_type(q));
    return w / w.norm(2, -1, /*keepdim=*/true).clamp_min(spec.norm_eps);
  };
  const Scores s = scores(normalized(q), normalized(k), 1.0, attend_current);
  // n_j visible keys; tau_j = beta sqrt(2 log n_j / D), 0 for n_j <= 1.
  const torch::Tensor n = s.visible.sum(-1).to(s.z.scalar_type());
  const torch::Tensor unit = torch::where(
      n.gt(1), torch::sqrt(2.0 * torch::log(n.clamp_min(1)) / static_cast<double>(q.size(-1))),
      torch::zeros_like(n));
  const torch::Tensor beta = spec.beta.to(s.z.scalar_type()).reshape({1, -1, 1, 1});
  const torch::Tensor x = s.z - beta * unit.reshape({1, 1, -1, 1});
  torch::Tensor w = spec.power == 1.0 ? torch::relu(x)
                    : spec.power == 2.0 ? torch::relu(x).square()
                                        : torch::relu(x).pow(spec.power);
  return w.masked_fill(s.visible.logical_not(), 0);
}

}  // namespace

torch::Tensor threshold_weights(const torch::Tensor& q, const torch::Tensor& k,
                                bool attend_current, const ThresholdSpec& spec) {
  torch::Tensor w = threshold_view(q, k, attend_current, spec);
  if (spec.lam) {
    if (!spec.q2 || !spec.k2) {
      throw Error(ErrorKind::invalid_argument,
                  "composed::threshold_weights: argument 'q2' / 'k2': expected TDA's second view "
                  "with lam, got none");
    }
    torch::Tensor lam = spec.lam->to(w.scalar_type());
    if (spec.clamp_lambda) lam = lam.clamp(0.0, 1.0);
    w = w - lam.reshape({1, -1, 1, 1}) * threshold_view(*spec.q2, *spec.k2, attend_current, spec);
  }
  return w;
}

torch::Tensor threshold_attention(const torch::Tensor& q, const torch::Tensor& k,
                                  const torch::Tensor& v, bool attend_current,
                                  const ThresholdSpec& spec) {
  const torch::Tensor w = threshold_weights(q, k, attend_current, spec);
  const torch::Tensor vh = keys_per_query_head(v, q.size(2));
  return torch::matmul(w.to(v.scalar_type()), vh).transpose(1, 2);
}

torch::Tensor screening(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                        const torch::Tensor& s_w, const torch::Tensor& s_r, double mipe_threshold,
                        double expand_above, double norm_eps) {
  using torch::indexing::Slice;
  const std::int64_t heads = q.size(2), group = heads / k.size(2);
  const auto work = q.scalar_type() == torch::kFloat64 ? torch::kFloat64 : torch::kFloat32;
  const auto opts = q.options().dtype(work);
  const torch::Tensor sw = s_w.to(work).expand({heads}), sr = s_r.to(work).expand({heads});
  const torch::Tensor w = torch::exp(sw) + 1, r = torch::sigmoid(sr);
  const torch::Tensor infinite = expand_above > 0 ? w > expand_above : torch::zeros_like(w, torch::kBool);
  const double pi = 3.14159265358979323846;
  const torch::Tensor gamma = torch::where(w < mipe_threshold, 0.5 * (torch::cos(pi * w / mipe_threshold) + 1),
                                           torch::zeros_like(w));
  const torch::Tensor rate = torch::where(infinite, torch::zeros_like(w), pi * gamma / w);  // (H)
  auto unit = [&](const torch::Tensor& x) {
    const torch::Tensor xf = x.to(work);
    return xf / xf.norm(2, -1, true).clamp_min(norm_eps);
  };
  // (B, H, L, D), the kv heads repeated for their query heads.
  const torch::Tensor qh = unit(q).transpose(1, 2);
  const torch::Tensor kh = unit(k).repeat_interleave(group, 2).transpose(1, 2);
  const torch::Tensor vh = unit(v).repeat_interleave(group, 2).transpose(1, 2);
  const std::int64_t lq = q.size(1), lk = k.size(1);
  const torch::Tensor pos_q = torch::arange(lq, opts) + static_cast<double>(lk - lq);
  const torch::Tensor pos_k = torch::arange(lk, opts);
  auto mipe = [&](const torch::Tensor& x, const torch::Tensor& pos) {
    const torch::Tensor angle = rate.view({1, heads, 1}) * pos.view({1, 1, -1});  // (1, H, L)
    const torch::Tensor c = torch::cos(angle), s = torch::sin(angle);
    const torch::Tensor x0 = x.index({"...", 0}), x1 = x.index({"...", 1});
    return torch::cat({(x0 * c - x1 * s).unsqueeze(-1), (x0 * s + x1 * c).unsqueeze(-1),
                       x.index({"...", Slice(2, torch::indexing::None)})},
                      -1);
  };
  const torch::Tensor scores = torch::matmul(mipe(qh, pos_q), mipe(kh, pos_k).transpose(-1, -2));
  const torch::Tensor alpha = torch::relu(1 - (1 - scores) / r.view({1, heads, 1, 1})).pow(2);
  const torch::Tensor d = (pos_k.view({1, -1}) - pos_q.view({-1, 1})).view({1, 1, lq, lk});  // j - i
  const torch::Tensor wh = w.view({1, heads, 1, 1});
  const torch::Tensor inf = infinite.view({1, heads, 1, 1});
  const torch::Tensor inside = (d <= 0) & ((d > -wh) | inf);
  const torch::Tensor mask = torch::where(inf, torch::ones_like(wh), 0.5 * (torch::cos(pi * d / wh) + 1));
  const torch::Tensor rel = torch::where(inside, alpha * mask, torch::zeros_like(alpha));
  const torch::Tensor h = torch::matmul(rel, vh);
  const torch::Tensor n = h.norm(2, -1, true);
  const torch::Tensor factor = torch::where(n > 1e-4, torch::tanh(n) / n.clamp_min(1e-4), 1 - n * n / 3);
  return (h * factor).transpose(1, 2).to(q.scalar_type());
}

torch::Tensor list_mask(const torch::Tensor& indices, const torch::Tensor& counts, std::int64_t keys) {
  const std::int64_t k_max = indices.size(-1);
  const torch::Tensor slot = torch::arange(k_max, indices.options().dtype(torch::kInt64));
  const torch::Tensor used = slot.lt(counts.to(torch::kInt64).unsqueeze(-1));
  // Unused slots scatter into an extra column that is dropped.
  const torch::Tensor target = torch::where(used, indices.to(torch::kInt64), torch::full_like(slot, keys));
  std::vector<std::int64_t> shape = indices.sizes().vec();
  shape.back() = keys + 1;
  return torch::zeros(shape, indices.options().dtype(torch::kBool))
      .scatter(-1, target, true)
      .narrow(-1, 0, keys);
}

torch::Tensor masked_softmax_weights(const torch::Tensor& q, const torch::Tensor& k, double scale,
                                     const torch::Tensor& allowed) {
  const torch::Tensor qh = q.transpose(1, 2), kh = keys_per_query_head(k, q.size(2));
  const torch::Tensor z = torch::matmul(qh, kh.transpose(-1, -2)).to(work_type(q)) * scale;
  const torch::Tensor mask = allowed.unsqueeze(1);  // shared by the heads
  const torch::Tensor any = mask.any(-1, /*keepdim=*/true);
  return torch::softmax(z.masked_fill(mask.logical_not(), -INFINITY).masked_fill(any.logical_not(), 0), -1) * any;
}

torch::Tensor gsa_sparse_attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                                   const torch::Tensor& indices, const torch::Tensor& counts, double scale) {
  const torch::Tensor p = masked_softmax_weights(q, k, scale, list_mask(indices, counts, k.size(1)));
  const torch::Tensor vh = keys_per_query_head(v, q.size(2));
  return torch::matmul(p.to(vh.scalar_type()), vh).transpose(1, 2).to(q.scalar_type());
}

torch::Tensor gsa_indexer_scores(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& head_weights,
                                 const torch::Tensor& bias, bool relu, double scale) {
  const torch::ScalarType wt = work_type(q);
  // (B, H_I, Lq, Lk) dot products of each indexer head with the one key head.
  const torch::Tensor dot = torch::matmul(q.transpose(1, 2), k.transpose(1, 2).transpose(-1, -2)).to(wt) * scale;
  const torch::Tensor w = head_weights.to(wt).transpose(1, 2).unsqueeze(-1);  // (B, H_I, Lq, 1)
  if (relu) return (w * torch::relu(dot)).sum(1);
  const torch::Tensor b = bias.defined() ? bias.to(wt).view({1, -1, 1, 1}) : torch::zeros({1}, dot.options());
  return (torch::sigmoid(w) * torch::sigmoid(dot + b)).sum(1);
}

}  // namespace winnow::nn::composed
