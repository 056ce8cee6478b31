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
// Whether the key-stationary Hopper backward (softmax_backward_keys_sm90.cuh) may take this
// call: not in the deterministic mode (its dQ sums arrive in any order), not for short
// sequences whose rows fit one block (the row kernel writes their dK and dV directly, with no
// accumulator at all), and with dK, dV rows it can store to 4 bytes at a time.
// WINNOW_SOFTMAX_ROW_BACKWARD forces the row kernel, for comparison.
bool keys_backward_applies(const detail::AttentionParams& p, const detail::GradientParams& g) {
  static const bool rows_forced = std::getenv("WINNOW_SOFTMAX_ROW_BACKWARD") != nullptr;
  if (rows_forced || p.deterministic || g.dstats.data != nullptr) return false;
  if (!aligned_rows(g.dk, p.dtype) || !aligned_rows(g.dv, p.dtype)) return false;
  if (p.max_len_q <= kBackwardBQ && p.group_size() == 1) return false;
  // Its row buffers (and the fp32 dQ accumulator) pad every sequence to the longest one's whole
  // query tiles. A packed batch of skewed lengths would make that many times the rows there are
  // (1000 sequences of 100 tokens beside one of 8192: 76x); such batches take the row kernel,
  // whose accumulators follow the key rows.
  const std::int64_t padded = (p.max_len_q + Sm90KeysBackwardShape::kBQ - 1) / Sm90KeysBackwardShape::kBQ *
                              Sm90KeysBackwardShape::kBQ;
  if (p.num_seqs * padded > 2 * p.rows_q + Sm90KeysBackwardShape::kBQ * p.num_seqs) return false;
  // Grid and helper-grid dimensions y and z (kv heads, query heads, sequences) stay within 65535.
  return p.max_len_k / Sm90KeysBackwardShape::kBK < 65535 && p.heads_q <= 65535 && p.num_seqs <= 65535;
}

template <class T, int D>
bool launch_keys_backward(const detail::AttentionParams& p, const detail::GradientParams& g) {
  auto kernel = softmax_backward_keys_sm90_kernel<T, D>;
  if (!hopper_kernel_runs(kernel)) return false;
  using Shape = Sm90KeysBackwardShape;
  SoftmaxKeysBackwardBuffers buf;
  buf.padded_len = (p.max_len_q + Shape::kBQ - 1) / Shape::kBQ * Shape::kBQ;
  const std::size_t rows = static_cast<std::size_t>(p.heads_q * p.num_seqs * buf.padded_len);
  if (rows == 0) return true;
  DeviceBuffer buffer(p, rows * (2 + D) * sizeof(float));
  buf.dq = buffer.as<float>();
  buf.lse_log2 = buf.dq + rows * D;
  buf.delta = buf.lse_log2 + rows;
  check(cudaMemsetAsync(buf.dq, 0, rows * D * sizeof(float), stream_of(p)), "clearing the dq accumulator");
  constexpr int kRowsPerBlock = kHelperRowsPerBlock<D>, kThreads = kHelperThreads;
  static_assert(Shape::kBQ % kRowsPerBlock == 0, "the padded rows fill whole blocks");
  const dim3 stats_grid(static_cast<unsigned>(buf.padded_len / kRowsPerBlock), static_cast<unsigned>(p.heads_q),
                        static_cast<unsigned>(p.num_seqs));
  softmax_backward_row_stats_kernel<T, D><<<stats_grid, kThreads, 0, stream_of(p)>>>(p, g, buf);
  check_launch("softmax_backward_row_stats_kernel");
  const std::int64_t key_blocks = (p.max_len_k + Shape::kBK - 1) / Shape::kBK;
  buf.heads_per_sweep = heads_per_sweep(Pass::backward, key_blocks, p.heads_kv);
  const dim3 grid(static_cast<unsigned>(key_blocks * buf.heads_per_sweep),
                  static_cast<unsigned>((p.heads_kv + buf.heads_per_sweep - 1) / buf.heads_per_sweep),
                  static_cast<unsigned>(p.num_seqs));
  const int smem = Sm90KeysBackwardSmem<T, D>::kBytes;
  allow_shared_memory(kernel, smem);
  kernel<<<grid, Shape::kThreads, smem, stream_of(p)>>>(p, g, buf);
  check_launch("softmax_backward_keys_sm90_kernel");
  const dim3 store_grid(static_cast<unsigned>((p.max_len_q + kRowsPerBlock - 1) / kRowsPerBlock),
                        static_cast<unsigned>(p.heads_q), static_cast<unsigned>(p.num_seqs));
  softmax_backward_store_dq_kernel<T, D><<<store_grid, kThreads, 0, stream_of(p)>>>(p, g, buf);
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
