// A second stream per thread and device for the small copies and clears of a multi-kernel call,
// so that they do not sit between its kernels on the caller's stream. There each costs the GPU
// 2-10 us of idling: in entmax-1.5's forward at 4K keys the search flag's 16-byte copy to the
// host left it idle 11 us between the collect and listing sweeps, and two memsets of the support
// record 4 us more (a trace of one call, 2026-11-30, docs/performance.md).
#pragma once

#include <cuda_runtime.h>

#include <map>

#include "cuda/launch.h"

namespace winnow::cuda {

// The calling thread's T for the current device, made on first use and kept for the thread's
// life: streams, events and pinned buffers belong to a device, and one a thread needs no lock.
template <class T>
T& for_current_device() {
  int device = 0;
  check(cudaGetDevice(&device), "asking for the current device");
  thread_local std::map<int, T> objects;
  return objects.try_emplace(device).first->second;
}

class SideStream {
 public:
  SideStream() {
    // Non-blocking: a blocking stream waits for the legacy default stream's work, and that
    // stream (PyTorch's default) for the side stream's, the serialization this is for avoiding.
    check(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), "creating a side stream");
    check(cudaEventCreateWithFlags(&main_reached_, cudaEventDisableTiming), "creating a side stream's event");
    check(cudaEventCreateWithFlags(&side_reached_, cudaEventDisableTiming), "creating a side stream's event");
  }
  ~SideStream() {  // at thread exit, possibly after the context is gone: errors are moot
    cudaEventDestroy(side_reached_);
    cudaEventDestroy(main_reached_);
    cudaStreamDestroy(stream_);
  }
  SideStream(const SideStream&) = delete;
  SideStream& operator=(const SideStream&) = delete;

  // The side stream's later work waits for all that `main` holds so far: memory the caller's
  // stream used (and its allocator may have handed out again) is then safe to write. An event
  // is recorded again for each call; a wait takes the record made before it.
  void follow(cudaStream_t main) {
    check(cudaEventRecord(main_reached_, main), "ordering a side stream after the caller's");
    check(cudaStreamWaitEvent(stream_, main_reached_, 0), "ordering a side stream after the caller's");
  }
  // Marks what the side stream holds so far, for wait_for_mark: work it is given later (a copy
  // that follows the caller's next kernel, say) does not hold the caller's stream up.
  void mark() { check(cudaEventRecord(side_reached_, stream_), "marking a side stream's work"); }
  // `main`'s later work waits for the side stream's work up to the last mark().
  void wait_for_mark(cudaStream_t main) {
    check(cudaStreamWaitEvent(main, side_reached_, 0), "ordering the caller's stream after a side stream");
  }
  cudaStream_t stream() const { return stream_; }

 private:
  cudaStream_t stream_ = nullptr;
  cudaEvent_t main_reached_ = nullptr, side_reached_ = nullptr;
};

}  // namespace winnow::cuda
