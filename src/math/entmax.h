// alpha-entmax, per element and per threshold-search step (spec/entmax.md). Shared by the CPU
// kernels and the CUDA kernels; the float64 reference finds its thresholds its own way (sorting
// for alpha = 2 and 1.5, bisection otherwise).
//
// Everything is in x = (alpha - 1) z units, where a row's weights are
//   p_i = [x_i - tau]_+ ^ (1 / (alpha - 1))
// and the backward's u_i = p_i^(2 - alpha) = [x_i - tau]_+ ^ ((2 - alpha) / (alpha - 1)).
#pragma once

#include <cmath>
#include <limits>
#include <type_traits>

#include "math/host_device.h"

namespace winnow::math::entmax {

// The alphas with their own weight functions: sparsemax (alpha = 2) and 1.5-entmax avoid pow.
// Kernels that know the family at compile time (with_family) keep pow and the tests on alpha
// out of their loops over scores; `any` decides per call.
enum class Family { any, sparsemax, entmax15, general };

// A family as with_family hands it to its callback (F is decltype(family)::value). The
// general one carries alpha's two exponents, 1 / (alpha - 1) for p and (2 - alpha) / (alpha - 1)
// for u, computed there once: computed per call, each was a float division per score and probe
// that nvcc did not hoist out of the sweeps' branches (two reciprocals, their slow paths and
// two branches a probe in the CUDA search's step sweep, SASS sm_90a).
template <Family F, class S>
struct FamilyOf {
  static constexpr Family value = F;
  WINNOW_HD explicit FamilyOf(S) {}
};
template <class S>
struct FamilyOf<Family::general, S> {
  static constexpr Family value = Family::general;
  S p_exponent, u_exponent;
  WINNOW_HD explicit FamilyOf(S alpha)
      : p_exponent(S(1) / (alpha - S(1))), u_exponent((S(2) - alpha) / (alpha - S(1))) {}
};

// Calls fn(FamilyOf<F, S>(alpha)) for alpha's family.
template <class S, class Fn>
WINNOW_HD void with_family(S alpha, Fn&& fn) {
  if (alpha == S(2)) {
    fn(FamilyOf<Family::sparsemax, S>(alpha));
  } else if (alpha == S(1.5)) {
    fn(FamilyOf<Family::entmax15, S>(alpha));
  } else {
    fn(FamilyOf<Family::general, S>(alpha));
  }
}

// base^exponent for base > 0: a general alpha's weights in the output sweeps and u in the
// backward's (weight, grad_weight; weight_and_grad has its own GPU form below). On the GPU in
// float as exp2(exponent log2(base)): log2f is a polynomial of about twenty instructions and
// exp2f the special function unit's with its range fixups, where powf (correctly rounded to an
// ulp through a double-float logarithm) took about a hundred. The relative error is then
// about |exponent log2 base| float roundings, a few 1e-7 for the weights that matter (p > 1e-6
// at alpha 1.3), inside spec/conventions.md's float tolerance. Outlined: inlined into the same
// loops as 1.5-entmax's code, it cost 1.5-entmax's listing output sweep 2% at 4K and 16K keys
// (0.539 against 0.530 ms at 4K, H200, 2026-11-30). The CPU, and doubles anywhere, keep pow.
template <class S>
WINNOW_HD_OUTLINED S power(S base, S exponent) {
#ifdef __CUDA_ARCH__
  if constexpr (std::is_same_v<S, float>) return exp2f(exponent * log2f(base));
#endif
  using std::pow;
  return pow(base, exponent);
}

// [gap]_+, and 0 for NaN. On the GPU one max (FMNMX) instead of the compare and select that
// the branch compiles to: the output sweep's per-score work for 1.5-entmax goes from four
// instructions to three (SASS, sm_90a; its ncu duration 533 -> 514 us at 4K keys, H200).
template <class S>
WINNOW_HD S positive_part(S gap) {
#ifdef __CUDA_ARCH__
  return fmax(gap, S(0));
#else
  return gap > S(0) ? gap : S(0);
#endif
}

// p for the gap x - tau.
template <Family F, class S>
WINNOW_HD S weight(const FamilyOf<F, S>& family, S gap) {
  if constexpr (F == Family::sparsemax) {
    return positive_part(gap);
  } else if constexpr (F == Family::entmax15) {
    const S g = positive_part(gap);
    return g * g;
  } else {
    return gap > S(0) ? power(gap, family.p_exponent) : S(0);
  }
}

// u = p^(2 - alpha) for the gap x - tau: the weight each key's logit gradient gets, and
// (times -1 / (alpha - 1)) the derivative of sum_i p_i with respect to tau.
template <Family F, class S>
WINNOW_HD S grad_weight(const FamilyOf<F, S>& family, S gap) {
  if constexpr (F == Family::entmax15) {
    return positive_part(gap);
  } else if constexpr (F == Family::sparsemax) {
    return gap > S(0) ? S(1) : S(0);
  } else {
    return gap > S(0) ? power(gap, family.u_exponent) : S(0);
  }
}

// p and u of one gap together, for the threshold search's sums (f = sum p, f' from sum u) and
// the backward: off the two families with their own forms, u = gap^((2 - alpha) / (alpha - 1))
// and p = u gap, one power instead of two where u is finite (on the CPU the powers were most of
// a general alpha's forward).
template <class S>
struct WeightAndGrad {
  S p, u;
};
template <Family F, class S>
WINNOW_HD WeightAndGrad<S> weight_and_grad(const FamilyOf<F, S>& family, S gap) {
  if constexpr (F == Family::general) {
#ifdef __CUDA_ARCH__
    if constexpr (std::is_same_v<S, float>) {
      // Inlined and without branches, both powers from one logarithm (-infinity for gap <= 0
      // and NaN, where p's exponent takes exp2 to 0, and u is selected to 0): the threshold
      // search's sweeps take K = 4 of these per score, and with a branch and an outlined call
      // each, their latencies never overlapped (an alpha 1.3 step sweep at 4K keys took 7.4
      // ms, H200, where its instructions would issue in about 2). The logarithm is the special
      // function unit's (lg2.approx, absolute error about 2^-22), not log2f's polynomial of
      // twenty instructions: p's and u's relative errors grow to about ln 2 x 2^-22 x their
      // exponent, 6e-7 at alpha 1.3, against the search's tolerance of 1e-5 on sum p and the
      // float tolerance of the dense backward's gradients (the forward's weights come from
      // weight()). The step sweeps at 4K keys: 7.4 -> 2.7 ms (H200, 2026-11-30).
      const float g = positive_part(gap), lg = __log2f(g);
      const float u = exp2f(family.u_exponent * lg);
      return {exp2f(family.p_exponent * lg), g > 0.f ? u : 0.f};
    }
#endif
    if (!(gap > S(0))) return {S(0), S(0)};
    using std::isinf;
    const S u = power(gap, family.u_exponent);
    // For alpha > 2 u's exponent is negative, and past alpha near 9 a gap near the smallest
    // floats takes u to infinity, where p itself is small: p by its own power there.
    return {isinf(u) ? power(gap, family.p_exponent) : u * gap, u};
  } else {
    return {weight(family, gap), grad_weight(family, gap)};
  }
}

// The same with alpha given: its family fixed at compile time (F), or decided per call (any).
template <Family F = Family::any, class S>
WINNOW_HD S weight(S gap, S alpha) {
  if constexpr (F == Family::any) {
    S p = S(0);
    with_family(alpha, [&](auto family) { p = weight(family, gap); });
    return p;
  } else {
    return weight(FamilyOf<F, S>(alpha), gap);
  }
}
template <Family F = Family::any, class S>
WINNOW_HD S grad_weight(S gap, S alpha) {
  if constexpr (F == Family::any) {
    S u = S(0);
    with_family(alpha, [&](auto family) { u = grad_weight(family, gap); });
    return u;
  } else {
    return grad_weight(FamilyOf<F, S>(alpha), gap);
  }
}
template <Family F, class S>
WINNOW_HD WeightAndGrad<S> weight_and_grad(S gap, S alpha) {
  static_assert(F != Family::any, "the family fixed first (with_family)");
  return weight_and_grad(FamilyOf<F, S>(alpha), gap);
}

// dz_i = u_i (dp_i - delta), delta = sum_k u_k dp_k / sum_k u_k.
template <class U, class DP, class R>
WINNOW_HD auto grad_logit(const U& u, const DP& dp, const R& delta) {
  return u * (dp - delta);
}

// The threshold of one row, found on
//   f(tau) = sum_i [x_i - tau]_+^(1 / (alpha - 1)),   f(tau) = 1
// (convex and decreasing for alpha <= 2, concave beyond) by a bracketed search that evaluates
// f and f' at K probes per step, one sweep over the row's keys per step: a sweep costs the
// products Q K^T whatever K is, so the fused CUDA kernels take K = 4 and need about half the
// sweeps of Newton's method (K = 1, which the CPU kernels take: their scores are in memory).
//
// The bracket starts from the row maximum m (x units) and its n visible keys,
// m - 1 <= tau <= m - n^(1 - alpha). Each step keeps the probes nearest the root on either side
// as the new bracket, then places the next probes between two estimates of the root: Newton's
// step from the left end (below the root where f is convex) and the secant through both ends
// (above it there); for alpha > 2, where f is concave, Newton's step from the right end and the
// secant swap roles. With neither inside the bracket the probes split it evenly. The search
// stops once a probe has |f - 1| <= tolerance, or once the bracket is too narrow for float
// arithmetic to shrink: near the root the sign of f - 1 is decided by f's own rounding
// (hundreds of terms at long context), and steps there cannot improve tau.
template <class S, int K>
struct ThresholdSearch {
  static constexpr int kProbes = K;
  S lo = S(0), hi = S(0);           // f(lo) >= 1 >= f(hi)
  S f_lo = S(-1), u_lo = S(0);      // f and sum_i u_i at lo; f < 0: not evaluated yet
  S f_hi = S(-1), u_hi = S(0);      // the same at hi
  S first = S(0), last = S(0);      // this step's probes: K points from first to last

  // Once done, lo = hi = first = last = tau; before, hi > lo. So a search saved as its eight
  // numbers (CUDA keeps them between sweeps) knows whether it is done.
  WINNOW_HD bool done() const { return !(hi > lo); }

  WINNOW_HD static S probe_between(S first, S last, int k) {
    // A constant factor, not a division: the CUDA search runs this per list entry.
    return K == 1 ? first : first + (last - first) * (S(k) / S(K - 1));
  }
  WINNOW_HD S probe(int k) const { return probe_between(first, last, k); }
  // The threshold: final once done; until then the left end of the bracket.
  WINNOW_HD S tau() const { return lo; }

  // floor: a known lower bound on tau (threshold_floor), used where it beats m - 1.
  WINNOW_HD void start(S x_max, S n_visible, S floor = S(-INFINITY)) {
    using std::pow;
    lo = x_max - S(1);
    hi = n_visible > S(1) ? x_max - pow(n_visible, S(1) - alpha_) : lo;
    f_lo = f_hi = S(-1);
    u_lo = u_hi = S(0);
    if (!(hi > lo)) return finish(lo);  // one key: its weight is 1 at m - 1
    if (floor > lo && floor < hi) lo = floor;
    first = lo;
    last = lo + (hi - lo) * (S(K - 1) / S(K));
  }

  // Records f and sum_i u_i at each probe; returns true once tau is final.
  WINNOW_HD bool step(const S (&f)[K], const S (&u)[K]) {
    using std::fabs;
    if (done()) return true;
    for (int k = 0; k < K; ++k) {
      if (fabs(f[k] - S(1)) <= tolerance_) {
        // Ends one Newton step past the probe, from the f and f' in hand: no sweep more, and
        // tau's error, not only f's, goes down by about the tolerance's factor again, where
        // the gradients' u is steep at the support's edge (alpha past 1.5). A step that would
        // leave the bracket is not taken.
        const S t = probe(k);
        const S newton = u[k] > S(0) ? t + (alpha_ - S(1)) * (f[k] - S(1)) / u[k] : t;
        finish(newton > lo && newton < hi ? newton : t);
        return true;
      }
    }
    const S residual_before = residual();
    for (int k = 0; k < K; ++k) {
      const S t = probe(k);
      if (f[k] > S(1)) {
        if (t >= lo) lo = t, f_lo = f[k], u_lo = u[k];
      } else if (t <= hi) {
        hi = t, f_hi = f[k], u_hi = u[k];
      }
    }
    S c0 = hi, c1 = lo;
    int estimates = 0;
    // With one probe a step, an estimate can creep: past alpha = 2 f is concave between the
    // keys but not across them (each term's slope runs to -infinity at its key's kink), and
    // near a kink Newton's step from the right end advanced by a few percent of the gap per
    // step, the left end stuck (alpha 4, a row of 25 keys whose second key sits 1e-7 above the
    // root: 76 steps to a float64 tolerance, past kMaxSearchSteps). A step that did not halve
    // the better end's |f - 1| makes the next probe split the bracket. K probes spread from one
    // estimate to the other already bracket the root closely, and are left as they were.
    const bool creeping = K == 1 && residual() > S(0.5) * residual_before;
    // f'(tau) = -sum_i u_i / (alpha - 1).
    if (alpha_ <= S(2)) {
      if (f_lo >= S(0) && u_lo > S(0)) consider(lo + (alpha_ - S(1)) * (f_lo - S(1)) / u_lo, c0, c1, estimates);
    } else if (f_hi >= S(0) && u_hi > S(0)) {
      consider(hi + (alpha_ - S(1)) * (f_hi - S(1)) / u_hi, c0, c1, estimates);
    }
    if (f_lo >= S(0) && f_hi >= S(0)) consider(lo + (hi - lo) * (f_lo - S(1)) / (f_lo - f_hi), c0, c1, estimates);
    const S width = hi - lo;
    if (estimates == 0 || creeping) {
      first = lo + width * (S(1) / S(K + 1));
      last = lo + width * (S(K) / S(K + 1));
    } else if (!(c1 > c0)) {
      first = c0;
      last = c0 + (hi - c0) * (S(K - 1) / S(K));
    } else {
      first = c0;
      last = c1;
    }
    // Relative to tau's own magnitude: an absolute floor would stop rows of small, nearly equal
    // scores early, where f' = -n (sparsemax) turns a tiny step into a large error in f.
    const S resolution = S(4) * std::numeric_limits<S>::epsilon();
    const S magnitude = fabs(lo) > fabs(hi) ? fabs(lo) : fabs(hi);
    if (!(width > resolution * magnitude + std::numeric_limits<S>::min()) || !(first > lo && last < hi)) {
      // An estimate inside a bracket too narrow for its probes is within rounding of the root
      // (Newton's and the secant's are exact where f is linear: equal scores under sparsemax,
      // whose root is the bracket's unevaluated right end); otherwise the nearer end.
      const bool lo_nearer = f_hi < S(0) || (f_lo >= S(0) && f_lo - S(1) <= S(1) - f_hi);
      finish(estimates > 0 ? c0 : lo_nearer ? lo : hi);
    }
    return done();
  }

  // Ends the search at tau found some other way (ListThreshold on the CUDA collect sweep's lists).
  WINNOW_HD void settle(S tau) { finish(tau); }

  WINNOW_HD ThresholdSearch(S alpha, S tolerance) : alpha_(alpha), tolerance_(tolerance) {}

 private:
  WINNOW_HD void finish(S tau) {
    lo = hi = first = last = tau;
  }
  // |f - 1| at the bracket's better evaluated end; +infinity before either is evaluated.
  WINNOW_HD S residual() const {
    const S at_lo = f_lo >= S(0) ? f_lo - S(1) : std::numeric_limits<S>::infinity();
    const S at_hi = f_hi >= S(0) ? S(1) - f_hi : std::numeric_limits<S>::infinity();
    return at_lo < at_hi ? at_lo : at_hi;
  }
  WINNOW_HD void consider(S estimate, S& c0, S& c1, int& count) const {
    if (!(estimate > lo && estimate < hi)) return;
    c0 = estimate < c0 ? estimate : c0;
    c1 = estimate > c1 ? estimate : c1;
    ++count;
  }

  S alpha_, tolerance_;
};

// A lower bound on a row's threshold from some of its keys x[0..N) (the rest -infinity): f
// over a subset of the keys is at most f over all of them, so the subset's own root is at
// most the row's. Bisection on [m - 1, m] keeping f(lo) >= 1; `steps` halvings leave lo
// within 2^-steps of the subset's root. The fused CUDA search takes each row's few largest
// scores from its first sweep and collects only the keys above this bound.
// Takes the family in hand (with_family's), so that a general alpha's exponents are not
// computed again for each of its steps x N weights; and each weight by weight_and_grad (u
// unused), whose general-alpha GPU form is inlined and branch-free: the CUDA start sweep runs
// this per row at its end, 16 x 8 weights, and a general alpha's outlined power made that
// sweep 2.7x 1.5-entmax's (0.576 against 0.213 ms at 4K keys, H200; 0.257 in this form,
// 2026-11-30). That form's logarithm (lg2.approx) moves f by about 1e-7 of itself, the floor by
// less than the bisection's own 2^-16; a floor that lands a rounding above tau leaves out keys
// whose weights are below float resolution.
template <Family F, int N, class S>
WINNOW_HD S threshold_floor(const FamilyOf<F, S>& family, const S (&x)[N], int steps = 16) {
  S m = x[0];
  for (int i = 1; i < N; ++i) m = x[i] > m ? x[i] : m;
  S lo = m - S(1), hi = m;
  for (int step = 0; step < steps; ++step) {
    const S mid = S(0.5) * (lo + hi);
    S f = S(0);
    for (int i = 0; i < N; ++i) f += weight_and_grad(family, x[i] - mid).p;
    (f >= S(1) ? lo : hi) = mid;
  }
  return lo;
}

// The positive gaps d = x - tau of some keys, as the moments that f and f' of sparsemax and
// 1.5-entmax need: f = sum d (sparsemax) or sum d^2 (1.5), f' = -count or -2 sum d. Kept apart
// from the step so that the CUDA kernel can sum a quad's four partial lists with shuffles.
template <class S>
struct GapMoments {
  S count = S(0), sum = S(0), sum_sq = S(0);
  S min = std::numeric_limits<S>::infinity();  // the smallest positive gap
  WINNOW_HD void add(S gap) {
    if (!(gap > S(0))) return;
    count += S(1);
    sum += gap;
    sum_sq += gap * gap;
    min = gap < min ? gap : min;
  }
};

// The threshold of a row from a list that holds every key above a lower bound of it (the CUDA
// collect sweep's lists), for sparsemax and 1.5-entmax, where f is a polynomial in tau between
// consecutive keys: linear, or quadratic. Each step takes the keys above the current tau (its
// active set) and solves f restricted to them exactly. That root is the row's threshold when no
// active key lies below it (f is that polynomial all the way there), which the smallest gap
// tells; otherwise the step is Newton's from tau, which stays at or below the root since f is
// convex, so the active set only shrinks. On the tests' random rows (Entmax.ListThreshold*) it
// ends in 1.6 steps on average for 1.5-entmax (at most 5) and one for sparsemax (at most 2),
// each a handful of operations per key, where the bracketed search (four probes, f and f' at
// each) takes three to six steps of four times the work; and it ends exact, not within tolerance.
template <Family F, class S>
struct ListThreshold {
  static_assert(F == Family::sparsemax || F == Family::entmax15, "f must be piecewise linear or quadratic");
  S tau;              // at or below the root until done
  bool done = false;

  WINNOW_HD explicit ListThreshold(S lower_bound) : tau(lower_bound) {}

  WINNOW_HD void step(const GapMoments<S>& m, S tolerance) {
    using std::fabs;
    using std::sqrt;
    if (done) return;
    if (!(m.count > S(0))) {  // tau at or above every key: only rounding gets here
      done = true;
      return;
    }
    S exact, newton;
    if constexpr (F == Family::sparsemax) {
      exact = newton = (m.sum - S(1)) / m.count;
    } else {
      // count s^2 - 2 sum s + (sum_sq - 1) = 0, its smaller root in the form that does not
      // cancel; no real root means the active set is still larger than the support.
      const S excess = m.sum_sq - S(1);
      const S discriminant = m.sum * m.sum - m.count * excess;
      exact = discriminant >= S(0) ? excess / (m.sum + sqrt(discriminant)) : std::numeric_limits<S>::infinity();
      newton = excess / (S(2) * m.sum);
    }
    const S f = F == Family::sparsemax ? m.sum : m.sum_sq;
    if (exact <= m.min) {
      tau += exact;
      done = true;
    } else if (fabs(f - S(1)) <= tolerance || !(tau + newton > tau)) {
      done = true;
    } else {
      tau += newton;
    }
  }
};

// Steps a search takes at most (each one sweep). The bracket shrinks by at least K + 1 on
// steps without estimates, so this bounds the worst case well past float64 resolution.
inline constexpr int kMaxSearchSteps = 64;
// Probes per sweep on CUDA, where each sweep recomputes the scores.
inline constexpr int kCudaSearchProbes = 4;

}  // namespace winnow::math::entmax

namespace winnow::math::sieve {

// Whether key i is one of row j's candidates, given the row's threshold in score units
// (entmax: tau / (alpha - 1); bound: row max - eps).
template <class X, class R>
WINNOW_HD bool admitted(X z, R threshold) {
  return z > threshold;
}

}  // namespace winnow::math::sieve
