// Device discovery for builds without the CUDA kernels.
#include "winnow/attention.h"

namespace winnow {

bool built_with_cuda() { return false; }
int cuda_device_count() { return 0; }

}  // namespace winnow
