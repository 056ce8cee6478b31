// alpha-entmax attention on CUDA. On the fused path (bf16 / fp16, D = Dv = 64 or 128) the row
// thresholds come from value-free sweeps of the fused forward kernel (threshold_search.cuh),
// then one sweep with the weights [x - tau]_+^(1 / (alpha - 1)) over the key tiles where some
// row of the block has support (key_tiles.cuh); the backward is a sweep with the weights u
// (U = sum u v and sum u, for delta), which marks the cells with support, and then the fused
// backward kernel over those cells only.
// Everything else runs on the simple path (a warp per query row).
#include "cuda/cuda.h"
#include "cuda/threshold_search.cuh"

namespace winnow::cuda {
namespace {

simple::Extras entmax_extras(const detail::EntmaxConfig& cfg) {
  simple::Extras x;
  x.alpha = static_cast<float>(cfg.alpha);
  x.tolerance = static_cast<float>(cfg.tolerance);
  return x;
}

struct FusedEntmaxForward {
  const detail::AttentionParams& p;
  const detail::EntmaxConfig& cfg;
  template <class T, int D>
  void operator()() const {
    ThresholdCudaConfig t = threshold_config(cfg.alpha, cfg.tolerance);
    t.result = p.stats;  // entmax's statistic is tau (x units)
    LiveTileSelection tiles(p);
    find_thresholds<T, D>(p, t, tiles);
    EntmaxCudaConfig e;
    e.alpha = static_cast<float>(cfg.alpha);
    e.tau = p.stats;
    launch_fused_forward<T, D, EntmaxRows>(p, e, tiles.select(p.stats, static_cast<float>(p.scale * (cfg.alpha - 1.0))));
  }
};

struct FusedEntmaxBackward {
  const detail::AttentionParams& p;
  const detail::GradientParams& g;
  const detail::EntmaxConfig& cfg;
  template <class T, int D>
  void operator()() const {
    const std::size_t rows = static_cast<std::size_t>(p.rows_q * p.heads_q);
    const bool skipping = key_tile_skipping_enabled(p);
    const std::size_t bits = skipping ? map_blocks(p) * static_cast<std::size_t>(map_words(p)) : 0;
    DeviceBuffer buffer(p, rows * (static_cast<std::size_t>(p.dim_v) * sizeof(T) + sizeof(float)) +
                               bits * sizeof(std::uint32_t));
    detail::AttentionParams sweep = p;
    sweep.out = row_buffer(p, buffer.as<void>(), p.dim_v);
    sweep.stats = row_buffer(p, buffer.as<T>() + rows * p.dim_v, 1);
    EntmaxCudaConfig e;
    e.alpha = static_cast<float>(cfg.alpha);
    e.tau = p.stats;
    if (skipping) {
      // After U (rows x Dv of T) and sum u (rows of float): 4-byte aligned, Dv being even.
      e.support.bits = reinterpret_cast<std::uint32_t*>(buffer.as<unsigned char>() +
                                                        rows * (p.dim_v * sizeof(T) + sizeof(float)));
      e.support.q_blocks = map_query_blocks(p);
      e.support.words = map_words(p);
      check(cudaMemsetAsync(e.support.bits, 0, bits * sizeof(std::uint32_t), stream_of(p)), "clearing the support bits");
    }
    launch_fused_forward<T, D, EntmaxGradWeightRows>(sweep, e);
    EntmaxBackwardConfig b;
    b.alpha = e.alpha;
    b.weighted_values = sweep.out;
    b.sum_u = sweep.stats;
    launch_fused_backward<T, D, EntmaxBackwardRows<T>>(p, g, b, e.support.live());
  }
};

}  // namespace

void entmax_forward(const detail::AttentionParams& p, const detail::EntmaxConfig& cfg) {
  if (fused_path_applies(p, nullptr)) return dispatch_fused(p, FusedEntmaxForward{p, cfg});
  dispatch_simple(p, SimpleForward<simple::Mechanism::entmax>{p, entmax_extras(cfg)});
}

void entmax_backward(const detail::AttentionParams& p, const detail::GradientParams& g,
                     const detail::EntmaxConfig& cfg) {
  if (fused_path_applies(p, &g)) return dispatch_fused(p, FusedEntmaxBackward{p, g, cfg});
  dispatch_simple(p, SimpleBackward<simple::Mechanism::entmax>{p, g, entmax_extras(cfg)});
}

}  // namespace winnow::cuda
