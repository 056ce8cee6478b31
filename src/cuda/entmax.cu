// alpha-entmax attention on CUDA. On the fused path (bf16 / fp16, D = Dv = 64 or 128) the row
// thresholds come from value-free sweeps of the fused forward kernel (threshold_search.cuh),
// then one sweep with the weights [x - tau]_+^(1 / (alpha - 1)) over the key tiles where some
// row of the block has support (key_tiles.cuh), or, for a short suffix of queries without a
// support record, the split-KV decoding kernel (decode.cuh's EntmaxDecode); given a support record (winnow/entmax.h), that
// sweep also lists each row's support keys, and the threshold search counts them, so that the
// backward can size its buffers without reading the record back (CountedRecords). The
// backward takes those lists, or lists every row's support itself, and when all lists fit
// works on those keys alone (entmax_sparse.cuh); otherwise (and in deterministic mode) it is
// dense: a sweep with the weights u (U = sum u v and sum u, for delta), which marks the cells
// with support, and then the fused backward kernel over those cells only.
// Everything else runs on the simple path (a warp per query row), and so do forwards with a
// scale that is not positive (threshold_search_applies).
#include <algorithm>
#include <atomic>
#include <climits>
#include <cstdlib>
#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <utility>

#include <cub/device/device_scan.cuh>

#include "cuda/attention/entmax_sparse.cuh"
#include "cuda/cuda.h"
#include "cuda/side_stream.h"
#include "cuda/threshold_search.cuh"

namespace winnow::cuda {
namespace {

simple::Extras entmax_extras(const detail::EntmaxConfig& cfg) {
  simple::Extras x;
  x.alpha = static_cast<float>(cfg.alpha);
  x.tolerance = static_cast<float>(cfg.tolerance);
  return x;
}

std::atomic<std::int64_t> sparse_backward_calls{0};
std::atomic<std::int64_t> counted_backward_calls{0};

// The totals of support records whose forward counted them on the way (find_thresholds), by
// device and record address: the backward takes them from here instead of reading the record
// back, which would make the host wait for the GPU in the middle of the backward. Every
// forward given a record writes or erases its entry, so an entry always describes what the
// last forward at that address listed; a backward reads it without erasing, so that a second
// backward over the same graph (retain_graph) needs no read-back either. Records whose
// backward never runs leave entries behind; past kMaxEntries the map starts over (a missing
// entry only costs the read-back).
class CountedRecords {
 public:
  static CountedRecords& instance() {
    static CountedRecords records;
    return records;
  }
  void put(const int* record, const CountedSupport& c) {
    std::lock_guard<std::mutex> lock(mutex_);
    if (by_record_.size() >= kMaxEntries) by_record_.clear();
    by_record_[key(record)] = c;
  }
  void erase(const int* record) {
    std::lock_guard<std::mutex> lock(mutex_);
    by_record_.erase(key(record));
  }
  std::optional<CountedSupport> find(const int* record) {
    std::lock_guard<std::mutex> lock(mutex_);
    const auto it = by_record_.find(key(record));
    if (it == by_record_.end()) return std::nullopt;
    return it->second;
  }

 private:
  static constexpr std::size_t kMaxEntries = 4096;
  static std::pair<int, const int*> key(const int* record) {
    int device = 0;
    check(cudaGetDevice(&device), "asking for the current device");
    return {device, record};
  }
  std::mutex mutex_;
  std::map<std::pair<int, const int*>, CountedSupport> by_record_;
};

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
    const float tau_to_score = static_cast<float>(p.scale * (cfg.alpha - 1.0));
    if (cfg.support == nullptr) {
      // A short suffix of queries without a support record (inference) takes the cache in the
      // split-KV decoding kernels, the threshold search's too (the forward kernel's sweeps where
      // a row's candidates overflow their list); with one, the forward's output sweep lists the
      // supports.
      const bool decodes = decode_path_applies(p);
      detail::DecodeParams d;
      if (decodes) {
        d = decode_params_of(p);
        d.threshold = p.stats;
        d.alpha = static_cast<float>(cfg.alpha);
        if (decode_thresholds(d, t.tolerance, p.stats, 1.f)) return entmax_decode(d);
      }
      find_thresholds<T, D>(p, t, tiles, [&] {
        if (decodes) return entmax_decode(d);
        launch_fused_forward<T, D, EntmaxRows>(p, e, tiles.select(p.stats, tau_to_score));
      });
      return;
    }
    const SupportRecord record = SupportRecord::over(cfg.support, p);
    cudaStream_t stream = stream_of(p);
    EntmaxListedConfig listed;
    static_cast<EntmaxCudaConfig&>(listed) = e;
    listed.lists = record.lists;
    // WINNOW_ENTMAX_STAGED_RECORDS=n (tests): Hopper's listing sweep files its warps' staged
    // support bits once a thread has n records for a row, not 16; read on every call, so that a
    // test can switch it.
    if (const char* staged = std::getenv("WINNOW_ENTMAX_STAGED_RECORDS")) {
      listed.staged_records = std::clamp(std::atoi(staged), 1, kStagedSupportRecords);
    }
    // From zero before every output sweep: it runs a second time when the search needed step
    // sweeps. Then [0] = 1 (one byte on the zeros: little-endian int 1). For the first, on the
    // side stream while the first sweep runs, where the clears do not stand between the sweeps.
    auto clear_record = [&](cudaStream_t s) {
      check(cudaMemsetAsync(record.listed, 0, record.clear_ints * sizeof(int), s), "clearing the support record");
      check(cudaMemsetAsync(record.listed, 1, 1, s), "marking the support record listed");
    };
    SideStream& side = for_current_device<SideStream>();
    bool cleared_beside = false;  // and not yet listed into
    CountedSupport counted;
    find_thresholds<T, D>(
        p, t, tiles,
        [&] {
          if (cleared_beside) {
            side.wait_for_mark(stream);
            cleared_beside = false;
          } else {
            clear_record(stream);
          }
          launch_fused_forward<T, D, EntmaxListedRows>(p, listed, tiles.select(p.stats, tau_to_score));
        },
        &counted,
        [&] {
          // After the first sweep (the record's memory may be what the caller's stream used
          // before), beside the second.
          side.follow(stream);
          clear_record(side.stream());
          side.mark();
          cleared_beside = true;
        });
    if (counted.known) {
      CountedRecords::instance().put(cfg.support, counted);
    } else {
      CountedRecords::instance().erase(cfg.support);
    }
  }
};

// The backward over the support lists (entmax_sparse.cuh), from the forward's support record
// when it listed one, else listed here first. Returns false, having written nothing but
// scratch, when some row's support overflows its list.
template <class T, int D>
bool sparse_entmax_backward(const detail::AttentionParams& p, const detail::GradientParams& g,
                            const detail::EntmaxConfig& cfg) {
  const std::size_t keys = static_cast<std::size_t>(p.rows_k * p.heads_kv);
  cudaStream_t stream = stream_of(p);
  int header[entmax::kSupportRecordHeader] = {0, 0, 0, 0};  // listed, entries, overflow
  auto read_header = [&](const int* device_header, const char* what) {
    check(cudaMemcpyAsync(header, device_header, sizeof(header), cudaMemcpyDeviceToHost, stream),
          "reading the support record's totals");
    check(cudaStreamSynchronize(stream), what);
  };
  SupportRecord record;
  std::optional<CountedSupport> counted;
  // WINNOW_ENTMAX_READ_BACK_SUPPORT=1 reads the record back even when the forward counted it
  // (for comparison).
  static const bool read_back = std::getenv("WINNOW_ENTMAX_READ_BACK_SUPPORT") != nullptr;
  if (cfg.support != nullptr && !read_back) counted = CountedRecords::instance().find(cfg.support);
  if (counted) {
    // The forward's own count of what its output sweep lists (ThresholdCudaConfig::
    // support_totals): no need to wait for the record.
    header[0] = 1;
    header[1] = static_cast<int>(counted->entries);
    header[2] = counted->overflow ? 1 : 0;
    record = SupportRecord::over(cfg.support, p);
    counted_backward_calls.fetch_add(1, std::memory_order_relaxed);
    if (std::getenv("WINNOW_ENTMAX_CHECK_COUNTS") != nullptr) {  // tests: the count against the record
      const int counted_header[3] = {header[0], header[1], header[2]};
      read_header(cfg.support, "waiting for the support record");
      if (header[0] != counted_header[0] || header[1] != counted_header[1] || (header[2] != 0) != (counted_header[2] != 0)) {
        throw Error(ErrorKind::runtime, "winnow::entmax: the forward counted " + std::to_string(counted_header[1]) +
                                            " support entries (overflow " + std::to_string(counted_header[2]) +
                                            "), its record lists " + std::to_string(header[1]) + " (listed " +
                                            std::to_string(header[0]) + ", overflow " + std::to_string(header[2]) + ")");
      }
    }
  } else if (cfg.support != nullptr) {
    read_header(cfg.support, "waiting for the support record");
    if (header[0] == 1) record = SupportRecord::over(cfg.support, p);
  }
  std::optional<DeviceBuffer> own;
  if (record.listed == nullptr) {
    own.emplace(p, SupportRecord::ints(p) * sizeof(int));
    record = SupportRecord::over(own->as<int>(), p);
    check(cudaMemsetAsync(record.listed, 0, record.clear_ints * sizeof(int), stream), "clearing the support counts");
    EntmaxSupportConfig support;
    support.alpha = static_cast<float>(cfg.alpha);
    support.tau = p.stats;
    support.lists = record.lists;
    launch_fused_forward<T, D, EntmaxSupportRows>(p, support);
    read_header(record.listed, "waiting for the support sweep");
  }
  if (header[2] != 0) return false;
  const int* const key_counts = record.lists.key_counts;
  DeviceBuffer key_scratch(p, 2 * keys * sizeof(int));
  int* const key_fill = key_scratch.as<int>();
  int* const key_offsets = key_fill + keys;
  check(cudaMemsetAsync(key_fill, 0, keys * sizeof(int), stream), "clearing the key fill counts");

  std::size_t scan_bytes = 0;
  check(cub::DeviceScan::ExclusiveSum(nullptr, scan_bytes, key_counts, key_offsets, static_cast<int>(keys), stream),
        "sizing the key scan");
  DeviceBuffer scan_scratch(p, scan_bytes);
  check(cub::DeviceScan::ExclusiveSum(scan_scratch.as<void>(), scan_bytes, key_counts, key_offsets,
                                      static_cast<int>(keys), stream),
        "scanning the key counts");

  const std::size_t entries = static_cast<std::size_t>(header[1]);
  DeviceBuffer entry_buffer(p, entries * (sizeof(int) + 2 * sizeof(float)));
  SparseBackwardParams sp;
  sp.alpha = static_cast<float>(cfg.alpha);
  sp.keys = record.lists.keys;
  sp.counts = record.lists.counts;
  sp.key_counts = key_counts;
  sp.key_offsets = key_offsets;
  sp.key_fill = key_fill;
  sp.entry_capacity = static_cast<int>(entries);
  while ((std::int64_t{1} << sp.group_bits) < p.group_size()) ++sp.group_bits;
  sp.entry_query = entry_buffer.as<std::uint32_t>();
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
std::int64_t entmax_counted_backward_calls() { return counted_backward_calls.load(); }

void entmax_forward(const detail::AttentionParams& p, const detail::EntmaxConfig& cfg) {
  const bool fused = threshold_search_applies(p);
  // Only the fused path lists supports, and only for a backward that can take them: any other
  // record is marked empty, and the forward runs as without one.
  detail::EntmaxConfig c = cfg;
  if (c.support != nullptr && !(fused && sparse_backward_allowed(p))) {
    CountedRecords::instance().erase(c.support);
    check(cudaMemsetAsync(c.support, 0, sizeof(int), stream_of(p)), "marking the support record unlisted");
    c.support = nullptr;
  }
  if (fused) return dispatch_fused(p, FusedEntmaxForward{p, c});
  dispatch_simple(p, SimpleForward<simple::Mechanism::entmax>{p, entmax_extras(c)});
}

void entmax_backward(const detail::AttentionParams& p, const detail::GradientParams& g,
                     const detail::EntmaxConfig& cfg) {
  if (fused_path_applies(p, &g)) return dispatch_fused(p, FusedEntmaxBackward{p, g, cfg});
  dispatch_simple(p, SimpleBackward<simple::Mechanism::entmax>{p, g, entmax_extras(cfg)});
}

}  // namespace winnow::cuda
