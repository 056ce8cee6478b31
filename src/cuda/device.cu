// Device discovery for builds with the CUDA kernels.
#include <cuda_runtime.h>

#include "winnow/attention.h"

namespace winnow {

bool built_with_cuda() { return true; }

int cuda_device_count() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    (void)cudaGetLastError();  // no driver or no device: report none, leave no sticky error
    return 0;
  }
  return count;
}

}  // namespace winnow
