#include "reference/dense.h"

#include "math/elementwise.h"

namespace winnow::reference {

using detail::AttentionParams;
using detail::Operand;

Dense gather(const Operand& op, std::int64_t b, std::int64_t start, std::int64_t rows,
             std::int64_t h, std::int64_t cols) {
  Dense m(rows, cols);
  for (std::int64_t r = 0; r < rows; ++r) {
    const double* src = op.at<double>(b, start + r, h);
    for (std::int64_t c = 0; c < cols; ++c) m(r, c) = src[c * op.dim];
  }
  return m;
}

void scatter(const Dense& m, const Operand& op, std::int64_t b, std::int64_t start,
             std::int64_t h) {
  for (std::int64_t r = 0; r < m.rows; ++r) {
    double* dst = op.at<double>(b, start + r, h);
    for (std::int64_t c = 0; c < m.cols; ++c) dst[c * op.dim] = m(r, c);
  }
}

void add_product(const Dense& a, const Dense& b, Dense& c, bool a_transposed, bool b_transposed) {
  const std::int64_t inner = a_transposed ? a.rows : a.cols;
  for (std::int64_t i = 0; i < c.rows; ++i) {
    for (std::int64_t j = 0; j < c.cols; ++j) {
      double s = 0;
      for (std::int64_t k = 0; k < inner; ++k) {
        s += (a_transposed ? a(k, i) : a(i, k)) * (b_transposed ? b(j, k) : b(k, j));
      }
      c(i, j) += s;
    }
  }
}

Normalized normalize(const Dense& x, double eps) {
  Normalized n{Dense(x.rows, x.cols), std::vector<double>(static_cast<std::size_t>(x.rows)),
               std::vector<bool>(static_cast<std::size_t>(x.rows))};
  for (std::int64_t r = 0; r < x.rows; ++r) {
    double sum = 0;
    for (std::int64_t c = 0; c < x.cols; ++c) sum += x(r, c) * x(r, c);
    const auto i = static_cast<std::size_t>(r);
    n.inv_norm[i] = math::inverse_norm(sum, eps);
    n.clipped[i] = math::norm_clipped(sum, eps);
    for (std::int64_t c = 0; c < x.cols; ++c) n.hat(r, c) = x(r, c) * n.inv_norm[i];
  }
  return n;
}

Dense normalize_backward(const Normalized& n, const Dense& g) {
  Dense dx(g.rows, g.cols);
  for (std::int64_t r = 0; r < g.rows; ++r) {
    double dot = 0;
    for (std::int64_t c = 0; c < g.cols; ++c) dot += n.hat(r, c) * g(r, c);
    const auto i = static_cast<std::size_t>(r);
    for (std::int64_t c = 0; c < g.cols; ++c) {
      dx(r, c) = math::normalize_grad(g(r, c), n.hat(r, c), dot, n.inv_norm[i], n.clipped[i]);
    }
  }
  return dx;
}

void write_per_head(const Operand& o, const std::vector<double>& values) {
  auto* data = static_cast<double*>(o.data);
  if (o.head == 0) {
    double sum = 0;
    for (double v : values) sum += v;
    *data = sum;
    return;
  }
  for (std::size_t h = 0; h < values.size(); ++h) data[static_cast<std::int64_t>(h) * o.head] = values[h];
}


namespace {

HeadProblem scores(const AttentionParams& p, const Dense& q, const Dense& k,
                   const detail::SequenceExtent& s) {
  HeadProblem hp(s.q_len, s.k_len);
  for (std::int64_t r = 0; r < s.q_len; ++r) {
    const std::int64_t last = p.last_visible_key(r + s.q_offset());
    hp.n[static_cast<std::size_t>(r)] = last + 1;
    for (std::int64_t i = 0; i <= last; ++i) {
      double dot = 0;
      for (std::int64_t d = 0; d < p.dim_qk; ++d) dot += q(r, d) * k(i, d);
      hp.z(r, i) = p.scale * dot;
    }
  }
  return hp;
}

void write_stats(const AttentionParams& p, std::int64_t b, std::int64_t start, std::int64_t h,
                 const std::vector<double>& stat) {
  for (std::size_t r = 0; r < stat.size(); ++r) {
    *p.stats.at<double>(b, start + static_cast<std::int64_t>(r), h) = stat[r];
  }
}

}  // namespace

void run_forward(const AttentionParams& p, const ForwardRows& rows) {
  for (std::int64_t b = 0; b < p.num_seqs; ++b) {
    const detail::SequenceExtent s = p.sequence(b);
    for (std::int64_t h = 0; h < p.heads_q; ++h) {
      const std::int64_t hk = p.kv_head(h);
      const Dense q = gather(p.q, b, s.q_start, s.q_len, h, p.dim_qk);
      const Dense k = gather(p.k, b, s.k_start, s.k_len, hk, p.dim_qk);
      const Dense v = gather(p.v, b, s.k_start, s.k_len, hk, p.dim_v);
      const HeadProblem hp = scores(p, q, k, s);
      Dense w(s.q_len, s.k_len);
      std::vector<double> stat(static_cast<std::size_t>(s.q_len), 0.0);
      rows(hp, w, stat);
      Dense o(s.q_len, p.dim_v);
      add_product(w, v, o, false, false);
      scatter(o, p.out, b, s.q_start, h);
      write_stats(p, b, s.q_start, h, stat);
    }
  }
}

void for_each_head(const AttentionParams& p,
                   const std::function<void(std::int64_t, std::int64_t, std::int64_t,
                                            const HeadProblem&)>& fn) {
  for (std::int64_t b = 0; b < p.num_seqs; ++b) {
    const detail::SequenceExtent s = p.sequence(b);
    for (std::int64_t h = 0; h < p.heads_q; ++h) {
      const Dense q = gather(p.q, b, s.q_start, s.q_len, h, p.dim_qk);
      const Dense k = gather(p.k, b, s.k_start, s.k_len, p.kv_head(h), p.dim_qk);
      fn(b, s.q_start, h, scores(p, q, k, s));
    }
  }
}

void run_backward(const AttentionParams& p, const detail::GradientParams& g,
                  const ForwardRows& forward_rows, const BackwardRows& backward_rows) {
  for (std::int64_t b = 0; b < p.num_seqs; ++b) {
    const detail::SequenceExtent s = p.sequence(b);
    for (std::int64_t hk = 0; hk < p.heads_kv; ++hk) {
      const Dense k = gather(p.k, b, s.k_start, s.k_len, hk, p.dim_qk);
      const Dense v = gather(p.v, b, s.k_start, s.k_len, hk, p.dim_v);
      Dense dk(s.k_len, p.dim_qk), dv(s.k_len, p.dim_v);
      for (std::int64_t h = hk * p.group_size(); h < (hk + 1) * p.group_size(); ++h) {
        const Dense q = gather(p.q, b, s.q_start, s.q_len, h, p.dim_qk);
        const Dense dout = gather(g.dout, b, s.q_start, s.q_len, h, p.dim_v);
        std::vector<double> dstat(static_cast<std::size_t>(s.q_len), 0.0);
        if (g.dstats.data != nullptr) {
          for (std::int64_t r = 0; r < s.q_len; ++r) {
            dstat[static_cast<std::size_t>(r)] = *g.dstats.at<double>(b, s.q_start + r, h);
          }
        }
        const HeadProblem hp = scores(p, q, k, s);
        Dense w(s.q_len, s.k_len);
        std::vector<double> stat(static_cast<std::size_t>(s.q_len), 0.0);
        forward_rows(hp, w, stat);
        Dense dw(s.q_len, s.k_len);
        add_product(dout, v, dw, false, true);
        Dense dz(s.q_len, s.k_len);
        backward_rows(hp, w, dw, dstat, dz);
        for (double& x : dz.a) x *= p.scale;  // z = scale <q, k>
        Dense dq(s.q_len, p.dim_qk);
        add_product(dz, k, dq, false, false);
        add_product(dz, q, dk, true, false);
        add_product(w, dout, dv, true, false);
        scatter(dq, g.dq, b, s.q_start, h);
      }
      scatter(dk, g.dk, b, s.k_start, hk);
      scatter(dv, g.dv, b, s.k_start, hk);
    }
  }
}

}  // namespace winnow::reference
