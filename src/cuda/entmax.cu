// alpha-entmax attention on CUDA. On the fused path (bf16 / fp16, D = Dv = 64 or 128) the row
// thresholds come from value-free sweeps of the fused forward kernel (threshold_search.cuh),
// then one sweep with the weights [x - tau]_+^(1 / (alpha - 1)) over the key tiles where some
// row of the block has support (key_tiles.cuh). The backward first lists every row's support
// and, when all lists fit, works on those keys alone (entmax_sparse.cuh); otherwise (and in
// deterministic mode) it is dense: a sweep with the weights u (U = sum u v and sum u, for
// delta), which marks the cells with support, and then the fused backward kernel over those
// cells only.
// Everything else runs on the simple path (a warp per query row).
#include <atomic>
#include <climits>
#include <cstdlib>

#include <cub/device/device_scan.cuh>

#include "cuda/attention/entmax_sparse.cuh"
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
    EntmaxCudaConfig e;
    e.alpha = static_cast<float>(cfg.alpha);
    e.tau = p.stats;
    find_thresholds<T, D>(p, t, tiles, [&] {
      launch_fused_forward<T, D, EntmaxRows>(p, e, tiles.select(p.stats, static_cast<float>(p.scale * (cfg.alpha - 1.0))));
    });
  }
};

std::atomic<std::int64_t> sparse_backward_calls{0};

// Whether the support-list backward may take the call: not in deterministic mode, not when
// WINNOW_DENSE_ENTMAX_BACKWARD is set (for comparison), only with slots that fit an int, and
// only while the lists (516 bytes per query row and head, twice the dense path's scratch at
// D = 128) stay under 2 GiB: past that the dense path's smaller footprint is worth more.
bool sparse_backward_allowed(const detail::AttentionParams& p) {
  const bool dense_forced = std::getenv("WINNOW_DENSE_ENTMAX_BACKWARD") != nullptr;
  const std::int64_t rows = p.rows_q * p.heads_q;
  const std::int64_t list_bytes = rows * (kSupportCapacity + 1) * static_cast<std::int64_t>(sizeof(int));
  return !p.deterministic && !dense_forced && rows < INT_MAX && p.rows_k * p.heads_kv < INT_MAX &&
         list_bytes <= (std::int64_t{1} << 31);
}

// The backward over the support lists (entmax_sparse.cuh). Returns false, having written
// nothing but scratch, when some row's support overflows its list.
template <class T, int D>
bool sparse_entmax_backward(const detail::AttentionParams& p, const detail::GradientParams& g,
                            const detail::EntmaxConfig& cfg) {
  const std::size_t rows = static_cast<std::size_t>(p.rows_q * p.heads_q);
  const std::size_t keys = static_cast<std::size_t>(p.rows_k * p.heads_kv);
  cudaStream_t stream = stream_of(p);
  // key_counts, key_fill and totals first: one clear covers them.
  DeviceBuffer lists(p, (2 * keys + 2 + keys + rows + rows * kSupportCapacity) * sizeof(int));
  int* const key_counts = lists.as<int>();
  int* const key_fill = key_counts + keys;
  int* const totals = key_fill + keys;
  int* const key_offsets = totals + 2;
  int* const counts = key_offsets + keys;
  int* const listed = counts + rows;
  check(cudaMemsetAsync(key_counts, 0, (2 * keys + 2) * sizeof(int), stream), "clearing the support counts");

  EntmaxSupportConfig support;
  support.alpha = static_cast<float>(cfg.alpha);
  support.tau = p.stats;
  support.lists = SupportLists{listed, counts, key_counts, totals};
  launch_fused_forward<T, D, EntmaxSupportRows>(p, support);
  int host_totals[2] = {0, 0};
  check(cudaMemcpyAsync(host_totals, totals, sizeof(host_totals), cudaMemcpyDeviceToHost, stream),
        "reading the support totals");
  check(cudaStreamSynchronize(stream), "waiting for the support sweep");
  if (host_totals[1] != 0) return false;

  std::size_t scan_bytes = 0;
  check(cub::DeviceScan::ExclusiveSum(nullptr, scan_bytes, key_counts, key_offsets, static_cast<int>(keys), stream),
        "sizing the key scan");
  DeviceBuffer scan_scratch(p, scan_bytes);
  check(cub::DeviceScan::ExclusiveSum(scan_scratch.as<void>(), scan_bytes, key_counts, key_offsets,
                                      static_cast<int>(keys), stream),
        "scanning the key counts");

  const std::size_t entries = static_cast<std::size_t>(host_totals[0]);
  DeviceBuffer entry_buffer(p, entries * (sizeof(int) + 2 * sizeof(float)));
  SparseBackwardParams sp;
  sp.alpha = static_cast<float>(cfg.alpha);
  sp.keys = listed;
  sp.counts = counts;
  sp.key_counts = key_counts;
  sp.key_offsets = key_offsets;
  sp.key_fill = key_fill;
  sp.entry_query = entry_buffer.as<int>();
  sp.entry_dz = reinterpret_cast<float*>(sp.entry_query + entries);
  sp.entry_p = sp.entry_dz + entries;

  const unsigned seqs = static_cast<unsigned>(p.num_seqs);
  const dim3 row_grid(static_cast<unsigned>((p.max_len_q + kSparseWarps - 1) / kSparseWarps),
                      static_cast<unsigned>(p.heads_q), seqs);
  if (row_grid.x > 0 && seqs > 0) {
    entmax_sparse_rows_kernel<T, D><<<row_grid, 32 * kSparseWarps, 0, stream>>>(p, g, sp);
    check_launch("entmax_sparse_rows_kernel");
  }
  const dim3 key_grid(static_cast<unsigned>((p.max_len_k + kSparseWarps - 1) / kSparseWarps),
                      static_cast<unsigned>(p.heads_kv), seqs);
  if (key_grid.x > 0 && seqs > 0) {
    entmax_sparse_keys_kernel<T, D><<<key_grid, 32 * kSparseWarps, 0, stream>>>(p, g, sp);
    check_launch("entmax_sparse_keys_kernel");
  }
  sparse_backward_calls.fetch_add(1, std::memory_order_relaxed);
  return true;
}

struct FusedEntmaxBackward {
  const detail::AttentionParams& p;
  const detail::GradientParams& g;
  const detail::EntmaxConfig& cfg;
  template <class T, int D>
  void operator()() const {
    if (sparse_backward_allowed(p) && sparse_entmax_backward<T, D>(p, g, cfg)) return;
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

std::int64_t entmax_sparse_backward_calls() { return sparse_backward_calls.load(); }

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
