// bf16 autocast on CUDA for the scope of a forward pass, for the trainer and evaluation.
#pragma once

#include <ATen/autocast_mode.h>
#include <c10/core/Device.h>
#include <torch/version.h>

#include <string>

namespace winnow::train {

// Whether a run with train.dtype `dtype` on `device` computes under bf16 autocast: on CUDA,
// unless it asks for float32 (the CPU kernels run float32).
inline bool uses_autocast(const c10::Device& device, const std::string& dtype) {
  return device.is_cuda() && dtype != "float32";
}

// LibTorch's API for this changed in 2.4.
class Autocast {
 public:
  explicit Autocast(bool on) : on_(on) {
    if (!on_) return;
#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 4)
    at::autocast::set_autocast_enabled(at::kCUDA, true);
    at::autocast::set_autocast_dtype(at::kCUDA, at::kBFloat16);
#else
    at::autocast::set_enabled(true);
    at::autocast::set_autocast_gpu_dtype(at::kBFloat16);
#endif
    at::autocast::increment_nesting();
  }
  ~Autocast() {
    if (!on_) return;
    // The cast weights are cached for the region; drop them when it closes, as Python does.
    if (at::autocast::decrement_nesting() == 0) at::autocast::clear_cache();
#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 4)
    at::autocast::set_autocast_enabled(at::kCUDA, false);
#else
    at::autocast::set_enabled(false);
#endif
  }
  Autocast(const Autocast&) = delete;
  Autocast& operator=(const Autocast&) = delete;

 private:
  bool on_;
};

}  // namespace winnow::train
