// alpha-entmax and Sieve attention on CUDA. For now both run on the simple path (every dtype,
// head dimension and layout; a warp per query row finds the threshold by sweeps over the row's
// keys). The fused tensor-core kernels for them are not written yet.
#include "cuda/cuda.h"
#include "cuda/launch_attention.cuh"

namespace winnow::cuda {
namespace {

simple::Extras entmax_extras(const detail::EntmaxConfig& cfg) {
  simple::Extras x;
  x.alpha = static_cast<float>(cfg.alpha);
  x.tolerance = static_cast<float>(cfg.tolerance);
  return x;
}

simple::Extras sieve_extras(const detail::SieveConfig& cfg) {
  simple::Extras x;
  x.alpha = static_cast<float>(cfg.alpha);
  x.tolerance = static_cast<float>(cfg.tolerance);
  x.bound = cfg.bound;
  x.eps = static_cast<float>(cfg.eps);
  x.threshold = cfg.threshold;
  x.count = cfg.count;
  return x;
}

template <simple::Mechanism M>
struct SimpleForward {
  const detail::AttentionParams& p;
  const simple::Extras x;
  template <class T>
  void operator()() const {
    launch_simple_forward<T, M>(p, x);
  }
};
template <simple::Mechanism M>
struct SimpleBackward {
  const detail::AttentionParams& p;
  const detail::GradientParams& g;
  const simple::Extras x;
  template <class T>
  void operator()() const {
    launch_simple_backward<T, M>(p, g, x);
  }
};

}  // namespace

void entmax_forward(const detail::AttentionParams& p, const detail::EntmaxConfig& cfg) {
  dispatch_simple(p, SimpleForward<simple::Mechanism::entmax>{p, entmax_extras(cfg)});
}

void entmax_backward(const detail::AttentionParams& p, const detail::GradientParams& g,
                     const detail::EntmaxConfig& cfg) {
  dispatch_simple(p, SimpleBackward<simple::Mechanism::entmax>{p, g, entmax_extras(cfg)});
}

void sieve_forward(const detail::AttentionParams& p, const detail::SieveConfig& cfg) {
  dispatch_simple(p, SimpleForward<simple::Mechanism::sieve>{p, sieve_extras(cfg)});
}

void sieve_backward(const detail::AttentionParams& p, const detail::GradientParams& g,
                    const detail::SieveConfig& cfg) {
  dispatch_simple(p, SimpleBackward<simple::Mechanism::sieve>{p, g, sieve_extras(cfg)});
}

}  // namespace winnow::cuda
