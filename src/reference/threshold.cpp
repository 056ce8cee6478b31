// Threshold attention (TRA and TDA) from spec/threshold.md, materialized: every view's
// normalized queries and keys, the full matrix of scores and weights of each (sequence, head).
#include <cstdint>
#include <vector>

#include "math/threshold.h"
#include "reference/dense.h"
#include "reference/reference.h"

namespace winnow::reference {
namespace {

namespace mt = math::threshold;
using detail::AttentionParams;
using detail::Operand;
using detail::ThresholdConfig;

// One view of one (sequence, query head): x = s - tau over the visible keys and the weights.
struct ViewWeights {
  Normalized q, k;
  Dense x, w;
  std::vector<std::int64_t> n;  // visible keys per row
  std::vector<double> unit;     // tau_j / beta
};

ViewWeights view_weights(const AttentionParams& p, const ThresholdConfig& cfg, const Operand& q_op,
                         const Operand& k_op, std::int64_t b, const detail::SequenceExtent& s,
                         std::int64_t h) {
  ViewWeights vw{normalize(gather(q_op, b, s.q_start, s.q_len, h, p.dim_qk), cfg.norm_eps),
                 normalize(gather(k_op, b, s.k_start, s.k_len, p.kv_head(h), p.dim_qk), cfg.norm_eps),
                 Dense(s.q_len, s.k_len),
                 Dense(s.q_len, s.k_len),
                 std::vector<std::int64_t>(static_cast<std::size_t>(s.q_len)),
                 std::vector<double>(static_cast<std::size_t>(s.q_len))};
  const double beta = cfg.beta_at<double>(h);
  for (std::int64_t r = 0; r < s.q_len; ++r) {
    const std::int64_t n = p.last_visible_key(r + s.q_offset()) + 1;
    const auto ri = static_cast<std::size_t>(r);
    vw.n[ri] = n;
    vw.unit[ri] = mt::threshold_unit(static_cast<double>(n), static_cast<double>(p.dim_qk));
    const double tau = beta * vw.unit[ri];
    for (std::int64_t i = 0; i < n; ++i) {
      double score = 0;
      for (std::int64_t d = 0; d < p.dim_qk; ++d) score += vw.q.hat(r, d) * vw.k.hat(i, d);
      vw.x(r, i) = score - tau;
      vw.w(r, i) = mt::weight(vw.x(r, i), cfg.power);
    }
  }
  return vw;
}

double lambda_of(const ThresholdConfig& cfg, std::int64_t h) {
  return mt::lambda_used(cfg.lambda_at<double>(h), cfg.clamp_lambda);
}

}  // namespace

void threshold_forward(const AttentionParams& p, const ThresholdConfig& cfg) {
  for (std::int64_t b = 0; b < p.num_seqs; ++b) {
    const detail::SequenceExtent s = p.sequence(b);
    for (std::int64_t h = 0; h < p.heads_q; ++h) {
      Dense w = view_weights(p, cfg, p.q, p.k, b, s, h).w;
      std::vector<std::int32_t> survivors(static_cast<std::size_t>(s.q_len), 0);
      const auto count = [&](const Dense& wv, bool add) {
        for (std::int64_t r = 0; r < s.q_len; ++r) {
          for (std::int64_t i = 0; i < s.k_len; ++i) {
            // A key counts once however many views it survives in.
            if (wv(r, i) != 0 && (add || w(r, i) == 0)) ++survivors[static_cast<std::size_t>(r)];
          }
        }
      };
      count(w, true);
      if (cfg.differential()) {
        const double lambda = lambda_of(cfg, h);
        const Dense w2 = view_weights(p, cfg, cfg.q2, cfg.k2, b, s, h).w;
        count(w2, false);
        for (std::size_t e = 0; e < w.a.size(); ++e) w.a[e] -= lambda * w2.a[e];
      }
      if (cfg.nonzero.data != nullptr) {
        for (std::int64_t r = 0; r < s.q_len; ++r) {
          *cfg.nonzero.at<std::int32_t>(b, s.q_start + r, h) = survivors[static_cast<std::size_t>(r)];
        }
      }
      Dense o(s.q_len, p.dim_v);
      add_product(w, gather(p.v, b, s.k_start, s.k_len, p.kv_head(h), p.dim_v), o, false, false);
      scatter(o, p.out, b, s.q_start, h);
    }
  }
}

void threshold_backward(const AttentionParams& p, const detail::GradientParams& g,
                        const ThresholdConfig& cfg) {
  const int views = cfg.differential() ? 2 : 1;
  std::vector<double> dbeta(static_cast<std::size_t>(p.heads_q), 0.0);
  std::vector<double> dlambda(static_cast<std::size_t>(p.heads_q), 0.0);
  for (std::int64_t b = 0; b < p.num_seqs; ++b) {
    const detail::SequenceExtent s = p.sequence(b);
    for (std::int64_t hk = 0; hk < p.heads_kv; ++hk) {
      const Dense v = gather(p.v, b, s.k_start, s.k_len, hk, p.dim_v);
      Dense dv(s.k_len, p.dim_v);
      // dL/dk_hat per view, summed over the group's query heads before the normalization's
      // backward (which is linear in it).
      std::vector<Dense> dk_hat(2, Dense(s.k_len, p.dim_qk));
      std::vector<const Normalized*> k_norm(2, nullptr);
      std::vector<ViewWeights> kept;  // keeps the key normalizations alive
      kept.reserve(static_cast<std::size_t>(p.group_size() * views));
      for (std::int64_t h = hk * p.group_size(); h < (hk + 1) * p.group_size(); ++h) {
        const Dense dout = gather(g.dout, b, s.q_start, s.q_len, h, p.dim_v);
        Dense dw(s.q_len, s.k_len);
        add_product(dout, v, dw, false, true);
        const double lambda = cfg.differential() ? lambda_of(cfg, h) : 0.0;
        for (int view = 0; view < views; ++view) {
          kept.push_back(view == 0 ? view_weights(p, cfg, p.q, p.k, b, s, h)
                                   : view_weights(p, cfg, cfg.q2, cfg.k2, b, s, h));
          const ViewWeights& vw = kept.back();
          k_norm[static_cast<std::size_t>(view)] = &vw.k;
          const double sign = view == 0 ? 1.0 : -lambda;
          // dv gets the combined weights w1 - lambda w2.
          Dense signed_w = vw.w;
          for (double& x : signed_w.a) x *= sign;
          add_product(signed_w, dout, dv, true, false);
          Dense ds(s.q_len, s.k_len);
          for (std::int64_t r = 0; r < s.q_len; ++r) {
            const auto ri = static_cast<std::size_t>(r);
            double dtau = 0;
            for (std::int64_t i = 0; i < vw.n[ri]; ++i) {
              ds(r, i) = sign * dw(r, i) * mt::weight_slope(vw.x(r, i), cfg.power);
              dtau -= ds(r, i);
            }
            dbeta[static_cast<std::size_t>(h)] += dtau * vw.unit[ri];
          }
          Dense dq_hat(s.q_len, p.dim_qk);
          add_product(ds, vw.k.hat, dq_hat, false, false);
          add_product(ds, vw.q.hat, dk_hat[static_cast<std::size_t>(view)], true, false);
          scatter(normalize_backward(vw.q, dq_hat), view == 0 ? g.dq : cfg.dq2, b, s.q_start, h);
          if (view == 1) {
            // dlambda = -sum_j <dout_j, (w2 v)_j>, through the clamp.
            double dot = 0;
            for (std::int64_t r = 0; r < s.q_len; ++r) {
              for (std::int64_t i = 0; i < vw.n[static_cast<std::size_t>(r)]; ++i) dot += vw.w(r, i) * dw(r, i);
            }
            dlambda[static_cast<std::size_t>(h)] +=
                -dot * mt::lambda_slope(cfg.lambda_at<double>(h), cfg.clamp_lambda);
          }
        }
      }
      scatter(dv, g.dv, b, s.k_start, hk);
      for (int view = 0; view < views; ++view) {
        const auto vi = static_cast<std::size_t>(view);
        scatter(normalize_backward(*k_norm[vi], dk_hat[vi]), view == 0 ? g.dk : cfg.dk2, b, s.k_start, hk);
      }
    }
  }
  write_per_head(cfg.dbeta, dbeta);
  if (cfg.differential()) write_per_head(cfg.dlambda, dlambda);
}

}  // namespace winnow::reference
