// Softmax attention on CUDA: the fused kernels with the softmax row policies, or the simple path.
#include <cstdlib>

#include "cuda/attention/softmax_backward_keys_sm90.cuh"
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
// Whether the key-stationary Hopper backward takes this call (launch_attention.cuh,
// keys_backward_fits), and not a gradient of the log-sum-exp, which needs the row kernel.
// WINNOW_SOFTMAX_ROW_BACKWARD forces the row kernel, for comparison.
bool keys_backward_applies(const detail::AttentionParams& p, const detail::GradientParams& g) {
  // Read at every call (not once): a test compares the two kernels in one process.
  const bool rows_forced = std::getenv("WINNOW_SOFTMAX_ROW_BACKWARD") != nullptr;
  return !rows_forced && g.dstats.data == nullptr && keys_backward_fits(p, g);
}

template <class T, int D>
bool launch_keys_backward(const detail::AttentionParams& p, const detail::GradientParams& g) {
  if (!keys_backward_runs<T, D, SoftmaxKeys>()) return false;
  KeysBackwardBuffers buf = keys_backward_buffers(p);
  const std::size_t rows = keys_backward_padded_rows(p, buf);
  if (rows == 0) return true;
  DeviceBuffer buffer(p, rows * (2 + D) * sizeof(float));
  float* const dq = buffer.as<float>();
  buf.row_stats[0] = dq + rows * D;
  buf.row_stats[1] = buf.row_stats[0] + rows;
  check(cudaMemsetAsync(dq, 0, rows * D * sizeof(float), stream_of(p)), "clearing the dq accumulator");
  constexpr int kRowsPerBlock = kHelperRowsPerBlock<D>, kThreads = kHelperThreads;
  static_assert(Sm90KeysBackwardShape::kBQ % kRowsPerBlock == 0, "the padded rows fill whole blocks");
  const dim3 stats_grid(static_cast<unsigned>(buf.padded_len / kRowsPerBlock), static_cast<unsigned>(p.heads_q),
                        static_cast<unsigned>(p.num_seqs));
  softmax_backward_row_stats_kernel<T, D><<<stats_grid, kThreads, 0, stream_of(p)>>>(p, g, buf);
  check_launch("softmax_backward_row_stats_kernel");
  launch_keys_backward_kernel<T, D>(p, g, buf, SoftmaxKeys(p.scale, dq), "softmax attention_backward_keys_sm90_kernel");
  const dim3 store_grid(static_cast<unsigned>((p.max_len_q + kRowsPerBlock - 1) / kRowsPerBlock),
                        static_cast<unsigned>(p.heads_q), static_cast<unsigned>(p.num_seqs));
  softmax_backward_store_dq_kernel<T, D><<<store_grid, kThreads, 0, stream_of(p)>>>(p, g, buf, dq);
  check_launch("softmax_backward_store_dq_kernel");
  return true;
}

// dk rotated back by g's RoPE tables in one pass of its own (batched inputs, as the tables are).
void rotate_key_grads_back(const detail::AttentionParams& p, const detail::GradientParams& g) {
  detail::RotaryParams r;
  r.x = g.dk.data;
  r.out = g.dk.data;
  r.cos = g.rotary_cos;
  r.sin = g.rotary_sin;
  r.dtype = p.dtype;
  r.batch = p.num_seqs;
  r.length = p.len_k;
  r.heads = p.heads_kv;
  r.half = p.dim_qk / 2;
  const std::int64_t strides[4] = {g.dk.batch, g.dk.row, g.dk.head, g.dk.dim};
  for (int d = 0; d < 4; ++d) r.x_stride[d] = r.out_stride[d] = strides[d];
  r.table_stride[0] = g.rotary_row;
  r.table_stride[1] = 1;
  r.transpose = true;
  r.cuda_stream = p.cuda_stream;
  rotary(r);
}

struct FusedBackward {
  const detail::AttentionParams& p;
  const detail::GradientParams& g;
  template <class T, int D>
  void operator()() const {
    if (keys_backward_applies(p, g) && launch_keys_backward<T, D>(p, g)) return;
    launch_fused_backward<T, D, SoftmaxBackwardRows<T>>(p, g, SoftmaxConfig{});
    // The row kernel rotates dq back as it stores it, but not dk: dK goes out a key tile at a
    // time inside its loop, where the rotation's registers made ptxas spill 376 bytes at
    // D = 128 (48 without).
    if (g.rotary_cos != nullptr) rotate_key_grads_back(p, g);
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

// On Hopper dq and dk come out rotated back: the key-stationary kernel rotates both as it
// stores them, the row kernel dq (and a pass after it dk). Every instantiation is built for the
// same architectures, so one stands for all.
bool softmax_backward_rotates(const detail::AttentionParams& p, const detail::GradientParams& g) {
  return fused_path_applies(p, &g) &&
         fused_backward_on_hopper<__nv_bfloat16, 64, SoftmaxBackwardRows<__nv_bfloat16>, SoftmaxConfig>();
}

void softmax_backward(const detail::AttentionParams& p, const detail::GradientParams& g) {
  if (fused_path_applies(p, &g)) return dispatch_fused(p, FusedBackward{p, g});
  dispatch_simple(p, SimpleBackward{p, g});
}

}  // namespace winnow::cuda
