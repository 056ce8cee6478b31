// Stick-breaking attention on CUDA: the fused kernels with the stick-breaking row policies (head
// dimension 64 or 128, and 16 or 32 on the portable kernels), or the simple path.
#include "cuda/attention/stick_breaking_rows.cuh"
#include "cuda/cuda.h"
#include "cuda/launch_attention.cuh"

namespace winnow::cuda {
namespace {

StickBreakingCudaConfig device_config(const detail::StickBreakingConfig& cfg) {
  StickBreakingCudaConfig c;
  c.halt_cutoff = static_cast<float>(cfg.halt_cutoff);
  c.kept_from = cfg.kept_from;
  return c;
}

simple::Extras extras(const StickBreakingCudaConfig& cfg) {
  simple::Extras x;
  x.halt_cutoff = cfg.halt_cutoff;
  x.kept_from = cfg.kept_from;
  return x;
}

struct FusedForward {
  const detail::AttentionParams& p;
  const StickBreakingCudaConfig cfg;
  template <class T, int D>
  void operator()() const {
    launch_fused_forward<T, D, StickBreakingRowsFor<D>>(p, cfg);
  }
};
struct FusedBackward {
  const detail::AttentionParams& p;
  const detail::GradientParams& g;
  const StickBreakingCudaConfig cfg;
  template <class T, int D>
  void operator()() const {
    launch_fused_backward<T, D, StickBreakingBackwardRows<T>>(p, g, cfg);
  }
};
struct SimpleForward {
  const detail::AttentionParams& p;
  const StickBreakingCudaConfig cfg;
  template <class T>
  void operator()() const {
    launch_simple_forward<T, simple::Mechanism::stick_breaking>(p, extras(cfg));
  }
};
struct SimpleBackward {
  const detail::AttentionParams& p;
  const detail::GradientParams& g;
  const StickBreakingCudaConfig cfg;
  template <class T>
  void operator()() const {
    launch_simple_backward<T, simple::Mechanism::stick_breaking>(p, g, extras(cfg));
  }
};

// Head dimensions 16 and 32 (000's protocol: 16 heads of a 256-wide model) run the portable
// fused kernels rather than the simple path.
constexpr bool kSmallDims = true;

}  // namespace

void stick_breaking_forward(const detail::AttentionParams& p, const detail::StickBreakingConfig& cfg) {
  // Halting drops keys per tile of the fused kernels, so a halting call keeps their result.
  if (cfg.halt_cutoff == 0.0 && decode_path_applies(p)) {
    detail::DecodeParams d = decode_params_of(p);
    d.kept_from = cfg.kept_from;
    return stick_breaking_decode(d);
  }
  if (fused_path_applies(p, nullptr, kSmallDims)) return dispatch_fused<kSmallDims>(p, FusedForward{p, device_config(cfg)});
  dispatch_simple(p, SimpleForward{p, device_config(cfg)});
}

void stick_breaking_backward(const detail::AttentionParams& p, const detail::GradientParams& g,
                             const detail::StickBreakingConfig& cfg) {
  if (fused_path_applies(p, &g, kSmallDims)) return dispatch_fused<kSmallDims>(p, FusedBackward{p, g, device_config(cfg)});
  dispatch_simple(p, SimpleBackward{p, g, device_config(cfg)});
}

}  // namespace winnow::cuda
