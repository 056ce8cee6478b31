// Softmax attention on CUDA: the fused kernels with the softmax row policies, or the simple path.
#include "cuda/attention/softmax_rows.cuh"
#include "cuda/cuda.h"
#include "cuda/launch_attention.cuh"

namespace winnow::cuda {
namespace {

struct FusedForward {
  const detail::AttentionParams& p;
  template <class T, int D>
  void operator()() const {
    launch_fused_forward<T, D, SoftmaxRows>(p, SoftmaxConfig{});
  }
};
struct FusedBackward {
  const detail::AttentionParams& p;
  const detail::GradientParams& g;
  template <class T, int D>
  void operator()() const {
    launch_fused_backward<T, D, SoftmaxBackwardRows<T>>(p, g, SoftmaxConfig{});
  }
};
struct SimpleForward {
  const detail::AttentionParams& p;
  template <class T>
  void operator()() const {
    launch_simple_forward<T, simple::Mechanism::softmax>(p, {});
  }
};
struct SimpleBackward {
  const detail::AttentionParams& p;
  const detail::GradientParams& g;
  template <class T>
  void operator()() const {
    launch_simple_backward<T, simple::Mechanism::softmax>(p, g, {});
  }
};

}  // namespace

void softmax_forward(const detail::AttentionParams& p) {
  if (decode_path_applies(p)) return softmax_decode(decode_params_of(p));
  if (fused_path_applies(p, nullptr)) return dispatch_fused(p, FusedForward{p});
  dispatch_simple(p, SimpleForward{p});
}

void softmax_backward(const detail::AttentionParams& p, const detail::GradientParams& g) {
  if (fused_path_applies(p, &g)) return dispatch_fused(p, FusedBackward{p, g});
  dispatch_simple(p, SimpleBackward{p, g});
}

}  // namespace winnow::cuda
