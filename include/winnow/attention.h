// What every causal attention mechanism in winnow shares: how its operands are laid out,
// how a call is executed, and where gradients go.
//
// Layout (spec/conventions.md):
//   batched: q (B, Lq, Hq, D), k (B, Lk, Hkv, D), v (B, Lk, Hkv, Dv), any strides.
//   varlen:  q (Tq, Hq, D),    k (Tk, Hkv, D),    v (Tk, Hkv, Dv), with cu_seqlens_q (B+1,
//            int32) and optionally cu_seqlens_k (defaults to cu_seqlens_q); sequence b owns
//            rows cu[b] .. cu[b+1]-1 and attends only inside itself.
// Queries are a suffix of the keys: a sequence with Lq <= Lk queries holds the last Lq
// positions, so query row r sits at absolute position r + (Lk - Lq). That one rule covers
// training (Lq == Lk), chunked prefill and decoding with a cache.
// Grouped-query attention: query head h reads key/value head h / (Hq / Hkv).
// Per-row statistics (log-sum-exp, log remainder) are shaped like q without its last
// dimension, (B, Lq, Hq) or (Tq, Hq), float32 (float64 when the inputs are float64).
#pragma once

#include <cstddef>
#include <optional>

#include "winnow/tensor.h"

namespace winnow {

struct AttentionInputs {
  TensorView q;
  TensorView k;
  TensorView v;
  std::optional<TensorView> cu_seqlens_q;  // present: varlen (packed) mode
  std::optional<TensorView> cu_seqlens_k;  // defaults to cu_seqlens_q
};

struct AttentionGrads {
  TensorView dq;  // like q
  TensorView dk;  // like k
  TensorView dv;  // like v
};

enum class Backend {
  automatic,  // the fast path of the tensors' device
  reference,  // the float64 materializing oracle written from spec/ (CPU, float64 tensors only)
};

// Device memory for a call's temporary buffers (the CUDA backward's fp32 accumulators).
// Frameworks pass their caching allocator; without one winnow uses cudaMallocAsync on the
// call's stream.
class DeviceAllocator {
 public:
  virtual ~DeviceAllocator() = default;
  virtual void* allocate(std::size_t bytes) = 0;
  virtual void deallocate(void* ptr) = 0;
};

struct ExecContext {
  Backend backend = Backend::automatic;
  void* cuda_stream = nullptr;  // cudaStream_t for CUDA tensors; nullptr is the default stream
  bool deterministic = false;   // backward without atomics: bitwise repeatable results
  int num_threads = 0;          // CPU thread count; 0 uses OpenMP's default
  DeviceAllocator* allocator = nullptr;
};

// True when this build contains the CUDA kernels (it may still find no GPU at run time).
bool built_with_cuda();
// Number of visible CUDA devices; 0 when built without CUDA or when no driver/GPU is present.
int cuda_device_count();

}  // namespace winnow
