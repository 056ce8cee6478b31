// What entmax and Sieve need before their weights: one query tile's scores over every key it
// sees, held at once (n x keys, O(L) memory per thread), and the per-row thresholds found on
// them. Holding the block lets the threshold search sweep the row as often as it needs
// without recomputing Q K^T.
#pragma once

#include <limits>

#include "cpu/tiles.h"
#include "math/entmax.h"

namespace winnow::cpu {

// z = q_scaled K^T for keys 0 .. last_limit of the tile, -inf where a row does not see a key.
template <class T>
void score_block(const AttentionParams& p, const QueryTile& qt, const SequenceExtent& s,
                 const RowMatrix<T>& q_scaled, RowMatrix<T>& k_scratch, ScoreTile<T>& z) {
  const std::int64_t keys = qt.last_limit + 1;
  z.resize(qt.n, keys);
  for (std::int64_t kt = 0; kt <= qt.last_key_tile(); ++kt) {
    const KeyRange kr = key_range(qt, kt);
    load_rows<T>(p.k, qt.b, s.k_start + kr.i0, kr.size(), p.kv_head(qt.h), p.dim_qk, k_scratch);
    z.middleCols(kr.i0, kr.size()).noalias() = q_scaled * k_scratch.transpose();
  }
  for (std::int64_t kt = 0; kt <= qt.last_key_tile(); ++kt) {
    const KeyRange kr = key_range(qt, kt);
    auto cols = z.middleCols(kr.i0, kr.size());
    mask_invisible(qt, kr, cols, -std::numeric_limits<T>::infinity());
  }
}

// Per row the entmax threshold tau (in x = (alpha - 1) z units) of a score block; 0 for rows
// that see no key. All rows search together, one sweep over the block per step.
template <class T>
void entmax_thresholds(const QueryTile& qt, const ScoreTile<T>& z, double alpha, double tolerance,
                       RowVector<T>& tau) {
  namespace em = math::entmax;
  const T a = T(alpha);
  tau.setZero(qt.n);
  if (z.cols() == 0) return;
  // One probe per sweep: the scores are in memory, so a sweep costs as much per probe as
  // the products did on CUDA, and Newton's steps are the cheapest way there.
  using Search = em::ThresholdSearch<T, 1>;
  std::vector<Search> search(static_cast<std::size_t>(qt.n), Search(a, T(tolerance)));
  const RowVector<T> x_max = (a - T(1)) * z.rowwise().maxCoeff().array();
  for (std::int64_t r = 0; r < qt.n; ++r) {
    // Row r sees keys 0 .. first_limit + r (clamped to the block).
    const std::int64_t visible = std::min<std::int64_t>(qt.first_limit + r + 1, z.cols());
    if (visible > 0) search[static_cast<std::size_t>(r)].start(x_max[r], T(visible));
  }
  RowVector<T> f(qt.n), sum_u(qt.n), t(qt.n);
  // alpha's family fixed outside the sweeps: no test of alpha per score, and one power per
  // score for the general family (weight_and_grad).
  em::with_family(a, [&](auto family) {
    for (int step = 0; step < em::kMaxSearchSteps; ++step) {
      for (std::int64_t r = 0; r < qt.n; ++r) t[r] = search[static_cast<std::size_t>(r)].probe(0);
      f.setZero();
      sum_u.setZero();
      for (std::int64_t c = 0; c < z.cols(); ++c) {
        for (std::int64_t r = 0; r < qt.n; ++r) {
          const auto w = em::weight_and_grad(family, (a - T(1)) * z(r, c) - t[r]);
          f[r] += w.p;
          sum_u[r] += w.u;
        }
      }
      bool all_done = true;
      for (std::int64_t r = 0; r < qt.n; ++r) {
        const T fr[1] = {f[r]}, ur[1] = {sum_u[r]};
        all_done &= search[static_cast<std::size_t>(r)].step(fr, ur);
      }
      if (all_done) break;
    }
  });
  for (std::int64_t r = 0; r < qt.n; ++r) {
    const std::int64_t visible = std::min<std::int64_t>(qt.first_limit + r + 1, z.cols());
    tau[r] = visible > 0 ? search[static_cast<std::size_t>(r)].tau() : T(0);
  }
}

}  // namespace winnow::cpu
