// Host-side helpers of the CUDA launchers: error checks that become winnow::Error, temporary
// device buffers from the caller's allocator, and the test that decides between the fused
// kernels and the simple path.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <string>

#include "core/params.h"
#include "winnow/error.h"

namespace winnow::cuda {

inline void check(cudaError_t status, const char* what) {
  if (status != cudaSuccess) {
    throw Error(ErrorKind::runtime,
                std::string("winnow: ") + what + ": " + cudaGetErrorString(status));
  }
}
inline void check_launch(const char* kernel) { check(cudaGetLastError(), kernel); }

inline cudaStream_t stream_of(const detail::AttentionParams& p) {
  return static_cast<cudaStream_t>(p.cuda_stream);
}

// A temporary device buffer, from the caller's allocator or stream-ordered cudaMallocAsync.
class DeviceBuffer {
 public:
  DeviceBuffer(DeviceAllocator* allocator, cudaStream_t stream, std::size_t bytes)
      : allocator_(allocator), stream_(stream) {
    if (bytes == 0) return;
    if (allocator_ != nullptr) {
      data_ = allocator_->allocate(bytes);
      if (data_ == nullptr) throw Error(ErrorKind::runtime, "winnow: device allocation failed");
    } else {
      check(cudaMallocAsync(&data_, bytes, stream_), "allocating a temporary buffer");
    }
  }
  DeviceBuffer(const detail::AttentionParams& p, std::size_t bytes)
      : DeviceBuffer(p.allocator, stream_of(p), bytes) {}
  ~DeviceBuffer() {
    if (data_ == nullptr) return;
    if (allocator_ != nullptr) {
      allocator_->deallocate(data_);
    } else {
      cudaFreeAsync(data_, stream_);
    }
  }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  template <class T>
  T* as() const {
    return static_cast<T*>(data_);
  }

 private:
  DeviceAllocator* allocator_;
  cudaStream_t stream_;
  void* data_ = nullptr;
};

// Whether the fused kernels take this call: 16-bit inputs, head dimension 64 or 128 for both
// keys and values (also 16 or 32 with small_dims, for a mechanism that dispatches them to the
// portable kernels: dispatch_fused<true>), and every row 16-byte aligned with unit stride along
// the head dimension.
bool fused_path_applies(const detail::AttentionParams& p, const detail::GradientParams* g, bool small_dims = false);

// Whether an operand's rows are contiguous features starting at 16-byte boundaries.
bool aligned_rows(const detail::Operand& op, DType dtype);

// Zeros into dk and dv (16-bit elements, rows as aligned_rows requires), for the backward's
// direct mode, in which blocks write only the keys they visit.
void clear_key_grads(const detail::AttentionParams& p, const detail::GradientParams& g);

// Multiprocessors of the current device.
int multiprocessors();

// Heads whose blocks interleave in a grid that runs each (head, sequence)'s blocks heaviest
// first (query tiles, or the softmax backward's key blocks): two when one head's blocks fill at
// most half the multiprocessors, else one. Run one head after another, the last heads' heaviest
// blocks start less than a block's run before the launch's end and leave an idle tail (3% of
// the sweep at L = 8192, B 4, 16 heads on an H100: tools/block_schedule.py); interleaved,
// forward+backward ran 2-7% faster there (softmax 7% at D = 128, stick-breaking 2%). Where one head's blocks fill the machine (L = 32768)
// that tail is negligible, and interleaving only doubles the keys and values the blocks in
// flight share in L2: softmax's D = 64 forward ran 8% slower (docs/performance.md, 2026-11-27).
// WINNOW_HEADS_PER_SWEEP = n forces n, for A/B measurements; WINNOW_FORWARD_HEADS_PER_SWEEP = n
// forces n for the forward kernels alone (the forwards' gain is the unsettled part: 2026-11-27).
enum class Pass { forward, backward };
int heads_per_sweep(Pass pass, std::int64_t blocks_per_head, std::int64_t heads);

// dk / dv from the fp32 accumulators [key row][kv head][dim] into the caller's tensors.
void store_key_grads(const detail::AttentionParams& p, const detail::GradientParams& g,
                     const float* dk, const float* dv);

}  // namespace winnow::cuda
