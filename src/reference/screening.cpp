// Multiscreen's screening unit from spec/screening.md, materialized: per (sequence, query head)
// the normalized and MiPE-rotated queries and keys, the full relevance matrix R, and the
// per-pair gradients, including both of s_w's paths (Softmask and MiPE).
#include <cmath>
#include <cstdint>
#include <vector>

#include "math/screening.h"
#include "reference/dense.h"
#include "reference/reference.h"

namespace winnow::reference {
namespace {

namespace ms = math::screening;
using detail::AttentionParams;
using detail::ScreeningConfig;
using detail::SequenceExtent;

using Head = ms::Head<double>;

Head head_of(const ScreeningConfig& cfg, std::int64_t h) {
  return Head(cfg.s_w_at<double>(h), cfg.s_r_at<double>(h), cfg.mipe_threshold, cfg.expand_above);
}

// Rotates coordinates 0 and 1 of row r by `angle`.
void rotate(Dense& x, std::int64_t r, double angle) {
  const double c = std::cos(angle), s = std::sin(angle);
  const double x0 = x(r, 0), x1 = x(r, 1);
  x(r, 0) = x0 * c - x1 * s;
  x(r, 1) = x0 * s + x1 * c;
}

// One (sequence, query head): the unit rows, their MiPE rotations, and R over visible keys.
struct HeadRelevance {
  Normalized q, k, v;
  Dense qm, km;  // after MiPE
  Dense s, r;    // scores and relevance, Lq x Lk (0 where not visible)
  Dense h;       // R vn, Lq x Dv
  std::vector<double> norm;  // |h_i|
};

HeadRelevance relevance(const AttentionParams& p, const ScreeningConfig& cfg, std::int64_t b,
                        const SequenceExtent& sq, std::int64_t h, const Head& hd) {
  const std::int64_t hk = p.kv_head(h);
  HeadRelevance x{normalize(gather(p.q, b, sq.q_start, sq.q_len, h, p.dim_qk), cfg.norm_eps),
                  normalize(gather(p.k, b, sq.k_start, sq.k_len, hk, p.dim_qk), cfg.norm_eps),
                  normalize(gather(p.v, b, sq.k_start, sq.k_len, hk, p.dim_v), cfg.norm_eps),
                  Dense(0, 0),
                  Dense(0, 0),
                  Dense(sq.q_len, sq.k_len),
                  Dense(sq.q_len, sq.k_len),
                  Dense(sq.q_len, p.dim_v),
                  std::vector<double>(static_cast<std::size_t>(sq.q_len))};
  x.qm = x.q.hat;
  x.km = x.k.hat;
  for (std::int64_t r = 0; r < sq.q_len; ++r) rotate(x.qm, r, static_cast<double>(r + sq.q_offset()) * hd.rate);
  for (std::int64_t j = 0; j < sq.k_len; ++j) rotate(x.km, j, static_cast<double>(j) * hd.rate);
  for (std::int64_t r = 0; r < sq.q_len; ++r) {
    const std::int64_t i = r + sq.q_offset();
    for (std::int64_t j = 0; j <= i && j < sq.k_len; ++j) {
      double dot = 0;
      for (std::int64_t d = 0; d < p.dim_qk; ++d) dot += x.qm(r, d) * x.km(j, d);
      x.s(r, j) = dot;
      x.r(r, j) = ms::trim(dot, hd.r) * ms::softmask(static_cast<double>(j - i), hd.w, hd.infinite);
    }
  }
  add_product(x.r, x.v.hat, x.h, false, false);
  for (std::int64_t r = 0; r < sq.q_len; ++r) {
    double sum = 0;
    for (std::int64_t d = 0; d < p.dim_v; ++d) sum += x.h(r, d) * x.h(r, d);
    x.norm[static_cast<std::size_t>(r)] = std::sqrt(sum);
  }
  return x;
}

}  // namespace

void screening_forward(const AttentionParams& p, const ScreeningConfig& cfg) {
  for (std::int64_t b = 0; b < p.num_seqs; ++b) {
    const SequenceExtent sq = p.sequence(b);
    for (std::int64_t h = 0; h < p.heads_q; ++h) {
      const HeadRelevance x = relevance(p, cfg, b, sq, h, head_of(cfg, h));
      Dense u = x.h;
      for (std::int64_t r = 0; r < sq.q_len; ++r) {
        const double n = x.norm[static_cast<std::size_t>(r)];
        const double f = ms::tanh_norm_factor(n);
        for (std::int64_t d = 0; d < p.dim_v; ++d) u(r, d) *= f;
        *p.stats.at<double>(b, sq.q_start + r, h) = n;
      }
      scatter(u, p.out, b, sq.q_start, h);
    }
  }
}

void screening_backward(const AttentionParams& p, const detail::GradientParams& g,
                        const ScreeningConfig& cfg) {
  std::vector<double> ds_w(static_cast<std::size_t>(p.heads_q), 0.0);
  std::vector<double> ds_r(static_cast<std::size_t>(p.heads_q), 0.0);
  for (std::int64_t b = 0; b < p.num_seqs; ++b) {
    const SequenceExtent sq = p.sequence(b);
    for (std::int64_t hk = 0; hk < p.heads_kv; ++hk) {
      Dense dkn(sq.k_len, p.dim_qk), dvn(sq.k_len, p.dim_v);
      std::vector<HeadRelevance> kept;  // the last one's key and value normalizations serve all
      for (std::int64_t h = hk * p.group_size(); h < (hk + 1) * p.group_size(); ++h) {
        const Head hd = head_of(cfg, h);
        kept.push_back(relevance(p, cfg, b, sq, h, hd));
        const HeadRelevance& x = kept.back();
        // dL/dh through TanhNorm: f du + phi f^2 <h, du> h.
        const Dense du = gather(g.dout, b, sq.q_start, sq.q_len, h, p.dim_v);
        Dense gh(sq.q_len, p.dim_v);
        for (std::int64_t r = 0; r < sq.q_len; ++r) {
          const double n = x.norm[static_cast<std::size_t>(r)];
          const double f = ms::tanh_norm_factor(n), phi = ms::tanh_norm_phi(n);
          double dot = 0;
          for (std::int64_t d = 0; d < p.dim_v; ++d) dot += x.h(r, d) * du(r, d);
          for (std::int64_t d = 0; d < p.dim_v; ++d) gh(r, d) = f * du(r, d) + phi * f * f * dot * x.h(r, d);
        }
        Dense dr(sq.q_len, sq.k_len);
        add_product(gh, x.v.hat, dr, false, true);
        add_product(x.r, gh, dvn, true, false);
        Dense ds(sq.q_len, sq.k_len);
        double dw = 0, drate = 0, dr_total = 0;
        for (std::int64_t r = 0; r < sq.q_len; ++r) {
          const std::int64_t i = r + sq.q_offset();
          for (std::int64_t j = 0; j <= i && j < sq.k_len; ++j) {
            const double d = static_cast<double>(j - i), s = x.s(r, j);
            const double m = ms::softmask(d, hd.w, hd.infinite);
            ds(r, j) = dr(r, j) * m * ms::trim_slope_s(s, hd.r);
            dr_total += dr(r, j) * m * ms::trim_slope_r(s, hd.r);
            dw += dr(r, j) * ms::trim(s, hd.r) * ms::softmask_slope(d, hd.w, hd.infinite);
            // s depends on the rate through the angle between the two rows, d * rate.
            drate += ds(r, j) * d * (x.qm(r, 1) * x.km(j, 0) - x.qm(r, 0) * x.km(j, 1));
          }
        }
        ds_w[static_cast<std::size_t>(h)] += (dw + drate * hd.rate_slope) * hd.dw_ds();
        ds_r[static_cast<std::size_t>(h)] += dr_total * hd.dr_ds();
        Dense dqm(sq.q_len, p.dim_qk), dkm(sq.k_len, p.dim_qk);
        add_product(ds, x.km, dqm, false, false);
        add_product(ds, x.qm, dkm, true, false);
        // Back through MiPE: the transposed rotation.
        for (std::int64_t r = 0; r < sq.q_len; ++r) rotate(dqm, r, -static_cast<double>(r + sq.q_offset()) * hd.rate);
        for (std::int64_t j = 0; j < sq.k_len; ++j) rotate(dkm, j, -static_cast<double>(j) * hd.rate);
        for (std::size_t e = 0; e < dkn.a.size(); ++e) dkn.a[e] += dkm.a[e];
        scatter(normalize_backward(x.q, dqm), g.dq, b, sq.q_start, h);
      }
      scatter(normalize_backward(kept.back().k, dkn), g.dk, b, sq.k_start, hk);
      scatter(normalize_backward(kept.back().v, dvn), g.dv, b, sq.k_start, hk);
    }
  }
  write_per_head(cfg.ds_w, ds_w);
  write_per_head(cfg.ds_r, ds_r);
}

}  // namespace winnow::reference
