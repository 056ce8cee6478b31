// The threshold search of the fused path (entmax_rows.cuh), shared by entmax and Sieve.
#include "cuda/threshold_search.cuh"
#include "cuda/cuda.h"
#include "cuda/side_stream.h"

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <map>

namespace winnow::cuda {
namespace {

// Where a row's threshold comes from: a float per row, or a search's lower bound (the left end
// of its bracket: no probe of a later sweep lies below it).
struct RowThresholds {
  detail::Operand rows;
  __device__ float operator()(std::int64_t b, std::int64_t row, std::int64_t h) const {
    return *rows.at<const float>(b, row, h);
  }
};
struct SearchFloors {
  detail::Operand state;
  __device__ float operator()(std::int64_t b, std::int64_t row, std::int64_t h) const {
    return state.at<const SavedSearch>(b, row, h)->bracket.x;
  }
};

// One block per map row (the forward kernels' grid and query-tile order), 128 threads.
template <class Thresholds>
__global__ void select_live_key_tiles_kernel(const AttentionParams p, const TileMaxMap map,
                                             const Thresholds threshold, float score_to_threshold,
                                             std::uint32_t* bits, int words) {
  const QueryTile<kCellRows, kCellKeys> qt(p);
  if (qt.empty()) return;
  const int tid = threadIdx.x;
  // The smallest threshold of the block's rows; a NaN anywhere keeps every cell.
  const std::int64_t row = qt.r0 + tid;
  const float t = row < qt.s.q_len ? threshold(qt.b, qt.s.q_start + row, qt.h) : INFINITY;
  const bool nan = __syncthreads_or(t != t) != 0;
  float smallest = t;
  for (int lane_bit = 1; lane_bit < 32; lane_bit *= 2) {
    smallest = fminf(smallest, __shfl_xor_sync(0xffffffffu, smallest, lane_bit));
  }
  __shared__ float warp_smallest[kCellRows / 32];
  if (tid % 32 == 0) warp_smallest[tid / 32] = smallest;
  __syncthreads();
  for (int w = 0; w < kCellRows / 32; ++w) smallest = fminf(smallest, warp_smallest[w]);

  const int* cell_max = map.block_row(qt.b, qt.h, p.heads_q, qt.r0);
  std::uint32_t* const block_bits = bits + map_block(qt.b, qt.h, p.heads_q, map.q_blocks, qt.r0) * words;
  for (int w = tid; w < words; w += blockDim.x) {
    std::uint32_t word = 0;
    for (int c = 32 * w; c < 32 * w + 32 && c < qt.key_tiles; ++c) {
      const float most = ordered_float(cell_max[c]) * score_to_threshold;
      // Dead only when clearly below: the sweeps compare with fused operations, whose rounding
      // differs from this product's by an ulp or so.
      const float margin = 1e-5f * fmaxf(fabsf(most), fabsf(smallest)) + 1e-30f;
      const bool dead = !nan && most < smallest - margin;
      word |= dead ? 0u : 1u << (c - 32 * w);
    }
    block_bits[w] = word;
  }
}

}  // namespace

LiveTileSelection::LiveTileSelection(const detail::AttentionParams& p)
    : p_(p),
      enabled_(key_tile_skipping_enabled(p)),
      words_(map_words(p)),
      buffer_(p, enabled_ ? map_blocks(p) * static_cast<std::size_t>(map_cells(p) + words_) * sizeof(int) : 0) {
  if (!enabled_) return;
  map_.data = buffer_.as<int>();
  map_.q_blocks = map_query_blocks(p);
  map_.cells = map_cells(p);
  // Bytes of 0x80: an int below every score's ordered_int.
  check(cudaMemsetAsync(map_.data, 0x80, map_blocks(p) * map_.cells * sizeof(int), stream_of(p)),
        "clearing the tile-max map");
}

template <class Thresholds>
LiveKeyTiles LiveTileSelection::select_by(const Thresholds& threshold, float score_to_threshold) {
  LiveKeyTiles live;
  if (!enabled_) return live;
  std::uint32_t* bits = reinterpret_cast<std::uint32_t*>(map_.data + map_blocks(p_) * map_.cells);
  const dim3 grid(static_cast<unsigned>(map_.q_blocks), static_cast<unsigned>(p_.heads_q),
                  static_cast<unsigned>(p_.num_seqs));
  select_live_key_tiles_kernel<<<grid, kCellRows, 0, stream_of(p_)>>>(p_, map_, threshold, score_to_threshold,
                                                                      bits, words_);
  check_launch("select_live_key_tiles_kernel");
  live.bits = bits;
  live.q_blocks = map_.q_blocks;
  live.words = words_;
  return live;
}

LiveKeyTiles LiveTileSelection::select(const detail::Operand& threshold, float score_to_threshold) {
  return select_by(RowThresholds{threshold}, score_to_threshold);
}

LiveKeyTiles LiveTileSelection::select_above_floors(const detail::Operand& state, float score_to_x) {
  return select_by(SearchFloors{state}, score_to_x);
}

namespace {

std::atomic<std::int64_t> output_reruns{0};

// Four ints (the search flag and the support totals) that the side stream copies to pinned host
// memory once the sweeps' stream has reached them, and the host reads once an event says they
// landed: the host goes on enqueueing work while the copy waits its turn, and the sweeps'
// stream goes on to the next kernel without the copy between them. One per thread and device
// (events belong to a device), kept for the thread's life.
class HostFlag {
 public:
  HostFlag() {
    check(cudaHostAlloc(reinterpret_cast<void**>(&value_), kInts * sizeof(int), cudaHostAllocPortable),
          "allocating the search flag's host copy");
    check(cudaEventCreateWithFlags(&landed_, cudaEventDisableTiming), "creating the search flag's event");
  }
  ~HostFlag() {  // at thread exit, possibly after the context is gone: errors are moot
    cudaEventDestroy(landed_);
    cudaFreeHost(value_);
  }
  HostFlag(const HostFlag&) = delete;
  HostFlag& operator=(const HostFlag&) = delete;

  static constexpr int kInts = 4;  // unfinished, then ThresholdCudaConfig::support_totals
  void copy_from(const int* device_flag, cudaStream_t stream, int ints = 1) {
    SideStream& side = for_current_device<SideStream>();
    side.follow(stream);
    check(cudaMemcpyAsync(value_, device_flag, ints * sizeof(int), cudaMemcpyDeviceToHost, side.stream()),
          "reading the search flag");
    check(cudaEventRecord(landed_, side.stream()), "recording the search flag's copy");
  }
  bool wait() const {
    check(cudaEventSynchronize(landed_), "waiting for a threshold sweep");
    return value_[0] != 0;
  }
  const int* values() const { return value_; }

 private:
  int* value_ = nullptr;
  cudaEvent_t landed_ = nullptr;
};

}  // namespace

std::int64_t threshold_output_reruns() { return output_reruns.load(); }

namespace {

// The pool of lists the collect sweep publishes, in floats. Where every row's lists fit (4 x
// ThresholdCollectRows::kListLength floats a row, 1 KB, in at most 2^27 floats, 512 MB), Hopper
// files the keys into it as it finds them (ThresholdCollectToPoolRows); else 64 floats a row, a
// quarter of that (random scores at 4K keys fill about 56), at most 2^26, which the sweep's
// warps reserve as they publish (ThresholdCollectRows::publish), a warp finding no room left
// searching its rows itself. WINNOW_SEARCH_LIST_POOL=n sets the pool to n floats instead (0:
// none, every warp searches its rows in the sweep), for comparison and tests; read per call.
inline constexpr std::int64_t kFullPoolFloatsPerRow = 4 * ThresholdCollectRows::kListLength;
std::int64_t list_pool_floats(const detail::AttentionParams& p) {
  const std::int64_t rows = p.rows_q * p.heads_q;
  if (const char* forced = std::getenv("WINNOW_SEARCH_LIST_POOL")) {
    return std::clamp<std::int64_t>(std::atoll(forced), 0, std::int64_t{1} << 27);
  }
  if (kFullPoolFloatsPerRow * rows <= (std::int64_t{1} << 27)) return kFullPoolFloatsPerRow * rows;
  return std::min<std::int64_t>(64 * rows, std::int64_t{1} << 26);
}

void launch_solve_published_lists(const detail::AttentionParams& p, const ThresholdCudaConfig& cfg) {
  const unsigned seqs = static_cast<unsigned>(p.num_seqs);
  const dim3 grid(static_cast<unsigned>((p.max_len_q + kSolveRowsPerBlock - 1) / kSolveRowsPerBlock),
                  static_cast<unsigned>(p.heads_q), seqs);
  if (grid.x == 0 || seqs == 0) return;
  solve_published_lists_kernel<><<<grid, 4 * kSolveRowsPerBlock, 0, stream_of(p)>>>(p, cfg);
  check_launch("solve_published_lists_kernel");
}

}  // namespace

// After the collect sweep and each step sweep one int comes back to the host: whether any row
// still moves. The output sweep is enqueued right behind the collect sweep, before the host
// looks, so that the GPU does not idle through the round trip (about 3% of entmax-1.5's
// forward at 4K keys); in the rare call where some row's lists overflowed, the step sweeps
// finish the search and the output sweep runs again, overwriting all it wrote. After the
// first sweep, the later ones visit only the key tiles with a score above the smallest floor
// of their block (every probe lies above its row's floor).
template <class T, int D>
void find_thresholds(const detail::AttentionParams& p, ThresholdCudaConfig cfg, LiveTileSelection& tiles,
                     const std::function<void()>& output_sweep, CountedSupport* counted,
                     const std::function<void()>& beside_first_sweep) {
  const std::size_t rows = static_cast<std::size_t>(p.rows_q * p.heads_q);
  // Per row its search and its published lists' places, the pool, then the flag, the support
  // totals and the pool's count (the step sweeps and the bound filter use the first only).
  const std::size_t pool = cfg.bound ? 0 : static_cast<std::size_t>(list_pool_floats(p));
  const std::size_t published = pool > 0 ? rows : 0;
  DeviceBuffer buffer(p, rows * sizeof(SavedSearch) + published * sizeof(PublishedList) + pool * sizeof(float) +
                             (HostFlag::kInts + 1) * sizeof(int));
  cfg.state = row_buffer(p, buffer.as<void>(), 1);
  unsigned char* const after_state = reinterpret_cast<unsigned char*>(buffer.as<SavedSearch>() + rows);
  if (pool > 0) {
    cfg.published = row_buffer(p, after_state, 1);
    cfg.list_pool = reinterpret_cast<float*>(after_state + published * sizeof(PublishedList));
    cfg.pool_capacity = static_cast<int>(pool);
  }
  cfg.unfinished = reinterpret_cast<int*>(after_state + published * sizeof(PublishedList) + pool * sizeof(float));
  if (pool > 0) cfg.pool_used = cfg.unfinished + HostFlag::kInts;
  cudaStream_t stream = stream_of(p);
  HostFlag& flag = for_current_device<HostFlag>();
  auto clear_flag = [&] {
    check(cudaMemsetAsync(cfg.unfinished, 0, sizeof(int), stream), "clearing the search flag");
  };
  if (counted != nullptr) {
    *counted = CountedSupport{};
    cfg.support_totals = cfg.unfinished + 1;
  }
  // The flag (which the first sweep does not touch) and the totals from zero in one clear before
  // the first sweep, where the GPU waits for the host's launches anyway: a clear between the
  // sweeps cost it about 2 us.
  const int cleared = pool > 0 ? HostFlag::kInts + 1 : counted != nullptr ? HostFlag::kInts : cfg.bound ? 0 : 1;
  if (cleared > 0) {
    check(cudaMemsetAsync(cfg.unfinished, 0, cleared * sizeof(int), stream), "clearing the search flag and totals");
  }
  cfg.tile_max = tiles.map();
  launch_threshold_sweep<T, D>(ThresholdSweep::start, p, cfg, LiveKeyTiles{});
  if (beside_first_sweep) beside_first_sweep();
  if (cfg.bound) return output_sweep();
  // No look at the flag between the first two sweeps: the collect sweep's blocks whose rows all
  // settled in the first return at once, which costs less than waiting for the host.
  cfg.tile_max = TileMaxMap{};
  const float score_to_x = static_cast<float>(p.scale) * (cfg.alpha - 1.f);
  const bool full_pool = pool > 0 && pool >= static_cast<std::size_t>(kFullPoolFloatsPerRow) * rows;
  launch_threshold_sweep<T, D>(full_pool ? ThresholdSweep::collect_to_pool : ThresholdSweep::collect, p, cfg,
                               tiles.select_above_floors(cfg.state, score_to_x));
  if (pool > 0) launch_solve_published_lists(p, cfg);
  flag.copy_from(cfg.unfinished, stream, counted != nullptr ? HostFlag::kInts : 1);
  output_sweep();
  cfg.support_totals = nullptr;  // the step sweeps count nothing
  cfg.list_pool = nullptr;       // and publish nothing
  if (!flag.wait()) {
    const int* const totals = flag.values() + 1;  // as ThresholdCudaConfig::support_totals
    if (counted != nullptr && totals[2] == 0) {
      counted->known = true;
      counted->entries = totals[0];
      counted->overflow = totals[1] != 0;
    }
    return;
  }
  const LiveKeyTiles live = tiles.select_above_floors(cfg.state, score_to_x);
  for (int step = 0; step < math::entmax::kMaxSearchSteps; ++step) {
    clear_flag();
    launch_threshold_sweep<T, D>(ThresholdSweep::step, p, cfg, live);
    flag.copy_from(cfg.unfinished, stream);
    if (!flag.wait()) break;
  }
  output_reruns.fetch_add(1, std::memory_order_relaxed);
  output_sweep();
}

#define WINNOW_FIND_THRESHOLDS(T, D)                                                                \
  template void find_thresholds<T, D>(const detail::AttentionParams&, ThresholdCudaConfig, LiveTileSelection&, \
                                      const std::function<void()>&, CountedSupport*, const std::function<void()>&);
WINNOW_FIND_THRESHOLDS(__nv_bfloat16, 64)
WINNOW_FIND_THRESHOLDS(__nv_bfloat16, 128)
WINNOW_FIND_THRESHOLDS(__half, 64)
WINNOW_FIND_THRESHOLDS(__half, 128)
// Sieve's head dimensions 16 and 32 (000's 16 heads of 16), on the portable kernels.
WINNOW_FIND_THRESHOLDS(__nv_bfloat16, 16)
WINNOW_FIND_THRESHOLDS(__nv_bfloat16, 32)
WINNOW_FIND_THRESHOLDS(__half, 16)
WINNOW_FIND_THRESHOLDS(__half, 32)
#undef WINNOW_FIND_THRESHOLDS

}  // namespace winnow::cuda
