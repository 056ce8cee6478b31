// Device copies of host tensors for the API calls of the CUDA tests (support/attention_case.h's
// Placement), freed with the placement.
#pragma once

#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <vector>

#include "support/attention_case.h"

namespace winnow::testing {

inline void cuda_ok(cudaError_t status, const char* what) {
  ASSERT_EQ(status, cudaSuccess) << what << ": " << cudaGetErrorString(status);
}

// The current device's compute capability major (9: Hopper); 0, with the test failed, where it
// cannot be read.
inline int device_major() {
  int device = 0, major = 0;
  const cudaError_t status = cudaGetDevice(&device) == cudaSuccess
                                 ? cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device)
                                 : cudaErrorInvalidDevice;
  if (status != cudaSuccess) {
    ADD_FAILURE() << "reading the device's compute capability: " << cudaGetErrorString(status);
    return 0;
  }
  return major;
}

class CudaPlacement final : public Placement {
 public:
  ~CudaPlacement() override {
    for (void* p : allocations_) cudaFree(p);
  }
  TensorView place(const HostTensor& t) override {
    void* device = nullptr;
    cuda_ok(cudaMalloc(&device, t.byte_size()), "cudaMalloc");
    allocations_.push_back(device);
    cuda_ok(cudaMemcpy(device, t.bytes(), t.byte_size(), cudaMemcpyHostToDevice), "upload");
    TensorView v = t.view();
    v.data = device;
    v.device = Device::cuda(0);
    return v;
  }
  void fetch(const TensorView& placed, HostTensor& t) override {
    cuda_ok(cudaDeviceSynchronize(), "kernel execution");
    cuda_ok(cudaMemcpy(t.bytes(), placed.data, t.byte_size(), cudaMemcpyDeviceToHost), "download");
  }

 private:
  std::vector<void*> allocations_;
};

}  // namespace winnow::testing
