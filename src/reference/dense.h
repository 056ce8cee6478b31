// What the reference implementations share: dense float64 matrices per (sequence, head),
// gathered from and scattered to strided operands, and the two drivers that loop over
// sequences and heads so each mechanism only states its row formulas.
#pragma once

#include <cstdint>
#include <functional>
#include <vector>

#include "core/params.h"

namespace winnow::reference {

struct Dense {
  std::int64_t rows = 0, cols = 0;
  std::vector<double> a;
  Dense(std::int64_t r, std::int64_t c) : rows(r), cols(c), a(static_cast<std::size_t>(r * c), 0.0) {}
  double& operator()(std::int64_t r, std::int64_t c) { return a[static_cast<std::size_t>(r * cols + c)]; }
  double operator()(std::int64_t r, std::int64_t c) const { return a[static_cast<std::size_t>(r * cols + c)]; }
};

// Rows [start, start + rows) of sequence b, head h, of an operand, as a rows x cols matrix; and
// back.
Dense gather(const detail::Operand& op, std::int64_t b, std::int64_t start, std::int64_t rows,
             std::int64_t h, std::int64_t cols);
void scatter(const Dense& m, const detail::Operand& op, std::int64_t b, std::int64_t start,
             std::int64_t h);
// c += op(a) op(b) with op the transpose where asked: a b (false, false), a b^T (false, true),
// a^T b (true, false).
void add_product(const Dense& a, const Dense& b, Dense& c, bool a_transposed, bool b_transposed);

// Rows of x scaled to unit length (or by 1 / eps when shorter than eps), with what the gradient
// needs; and dL/dx from dL/dx_hat.
struct Normalized {
  Dense hat;
  std::vector<double> inv_norm;
  std::vector<bool> clipped;
};
Normalized normalize(const Dense& x, double eps);
Dense normalize_backward(const Normalized& n, const Dense& g);

// Writes per-head values into an operand of one value per head, or their sum into a shared one
// (head stride 0).
void write_per_head(const detail::Operand& o, const std::vector<double>& values);

// One (sequence, query head) problem: scores over the visible keys.
struct HeadProblem {
  Dense z;                      // Lq x Lk scaled scores (0 where not visible)
  std::vector<std::int64_t> n;  // visible keys of each row: 0 .. n[r]-1
  explicit HeadProblem(std::int64_t lq, std::int64_t lk) : z(lq, lk), n(static_cast<std::size_t>(lq), 0) {}
};

// Fills w (Lq x Lk weights, 0 off the visible set) and stat (per row) from the scores.
using ForwardRows = std::function<void(const HeadProblem&, Dense& w, std::vector<double>& stat)>;
// Gives dz (Lq x Lk) from the scores, dw = dout v^T, and the per-row stat gradient (may be
// all zero). w is filled by the mechanism's own forward rows.
using BackwardRows = std::function<void(const HeadProblem&, const Dense& w, const Dense& dw,
                                        const std::vector<double>& dstat, Dense& dz)>;

void run_forward(const detail::AttentionParams& p, const ForwardRows& rows);
// Calls fn(b, q_start, h, scores) for every (sequence, query head): for per-row outputs beyond
// the one statistic run_forward writes.
void for_each_head(const detail::AttentionParams& p,
                   const std::function<void(std::int64_t b, std::int64_t q_start, std::int64_t h,
                                            const HeadProblem&)>& fn);
void run_backward(const detail::AttentionParams& p, const detail::GradientParams& g,
                  const ForwardRows& forward_rows, const BackwardRows& backward_rows);

}  // namespace winnow::reference
