// Sieve attention on CUDA. On the fused path (bf16 / fp16, D = Dv = 64 or 128, or 16 or 32 on
// the portable kernels): the row thresholds (one sweep for the bound filter, the entmax search
// for the exact one; threshold_search.cuh), then the stick-breaking kernels over each row's
// candidates only (stick_breaking_rows.cuh), visiting only the key tiles where some row of the
// block has a candidate (key_tiles.cuh), or for a short suffix of queries the split-KV decoding
// kernel with the same filter (decode.cuh's SieveDecode). Everything else runs on the simple path, and so do
// forwards with a scale that is not positive (threshold_search_applies).
#include "cuda/attention/stick_breaking_rows.cuh"
#include "cuda/cuda.h"
#include "cuda/threshold_search.cuh"

namespace winnow::cuda {
namespace {

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

SieveCudaConfig sieve_config(const detail::SieveConfig& cfg) {
  SieveCudaConfig c;
  c.threshold = cfg.threshold;
  c.count = cfg.count;
  return c;
}

struct FusedSieveForward {
  const detail::AttentionParams& p;
  const detail::SieveConfig& cfg;
  template <class T, int D>
  void operator()() const {
    ThresholdCudaConfig t = threshold_config(cfg.alpha, cfg.tolerance);
    t.bound = cfg.bound;
    t.eps = static_cast<float>(cfg.eps);
    t.result = cfg.threshold;
    t.result_scale = static_cast<float>(1.0 / (cfg.alpha - 1.0));
    const bool decodes = decode_path_applies(p);
    detail::DecodeParams d;
    if (decodes) {
      d = decode_params_of(p);
      d.threshold = cfg.threshold;
      d.count = cfg.count;
      d.bound_eps = t.eps;
    }
    // The bound filter's search is the row maximum: split across keys like the decoding, rather
    // than a forward sweep per query head over every key.
    if (decodes && cfg.bound) {
      sieve_bound_thresholds(d);
      return sieve_decode(d);
    }
    // The exact filter's: entmax's search on the decoding kernels too, unless a row's candidates
    // overflow their list.
    if (decodes) {
      d.alpha = static_cast<float>(cfg.alpha);
      if (decode_thresholds(d, t.tolerance, cfg.threshold, t.result_scale)) return sieve_decode(d);
    }
    LiveTileSelection tiles(p);
    find_thresholds<T, D>(p, t, tiles, [&] {
      if (decodes) return sieve_decode(d);
      launch_fused_forward<T, D, SieveRowsFor<D>>(p, sieve_config(cfg), tiles.select(cfg.threshold, static_cast<float>(p.scale)));
    });
  }
};

struct FusedSieveBackward {
  const detail::AttentionParams& p;
  const detail::GradientParams& g;
  const detail::SieveConfig& cfg;
  template <class T, int D>
  void operator()() const {
    launch_fused_backward<T, D, SieveBackwardRows<T>>(p, g, sieve_config(cfg));
  }
};

// Head dimensions 16 and 32 (000's protocol: 16 heads of a 256-wide model) run the portable
// fused kernels rather than the simple path.
constexpr bool kSmallDims = true;

}  // namespace

void sieve_forward(const detail::AttentionParams& p, const detail::SieveConfig& cfg) {
  if (threshold_search_applies(p, kSmallDims)) return dispatch_fused<kSmallDims>(p, FusedSieveForward{p, cfg});
  dispatch_simple(p, SimpleForward<simple::Mechanism::sieve>{p, sieve_extras(cfg)});
}

void sieve_backward(const detail::AttentionParams& p, const detail::GradientParams& g,
                    const detail::SieveConfig& cfg) {
  if (fused_path_applies(p, &g, kSmallDims)) return dispatch_fused<kSmallDims>(p, FusedSieveBackward{p, g, cfg});
  dispatch_simple(p, SimpleBackward<simple::Mechanism::sieve>{p, g, sieve_extras(cfg)});
}

}  // namespace winnow::cuda
