// Device discovery for builds without the CUDA kernels.
#include "core/device_copy.h"
#include "cuda/cuda.h"
#include "winnow/attention.h"
#include "winnow/error.h"

namespace winnow {

bool built_with_cuda() { return false; }
int cuda_device_count() { return 0; }

namespace detail {
void copy_to_host(void*, const void*, std::size_t, Device device, void*) {
  throw Error(ErrorKind::unsupported,
              "winnow: cannot read " + to_string(device) + " memory: this build has no CUDA support");
}
}  // namespace detail

// The API refuses CUDA tensors in builds without CUDA before it routes a call; these keep the
// routing table complete and say the same if reached.
namespace cuda {
namespace {
[[noreturn]] void no_cuda() {
  throw Error(ErrorKind::unsupported, "winnow: this build has no CUDA kernels");
}
}  // namespace
void softmax_forward(const detail::AttentionParams&) { no_cuda(); }
bool decode_kernels_take(const detail::DecodeParams&) { return false; }
void softmax_decode(const detail::DecodeParams&) { no_cuda(); }
void stick_breaking_decode(const detail::DecodeParams&) { no_cuda(); }
bool decode_path_applies(const detail::AttentionParams&) { return false; }
detail::DecodeParams decode_params_of(const detail::AttentionParams&) { no_cuda(); }
std::int64_t first_bad_paged_sequence(const detail::DecodeParams&, std::int64_t) { no_cuda(); }
void softmax_backward(const detail::AttentionParams&, const detail::GradientParams&) { no_cuda(); }
bool softmax_backward_rotates(const detail::AttentionParams&, const detail::GradientParams&) { return false; }
void stick_breaking_forward(const detail::AttentionParams&, const detail::StickBreakingConfig&) { no_cuda(); }
void stick_breaking_backward(const detail::AttentionParams&, const detail::GradientParams&,
                             const detail::StickBreakingConfig&) {
  no_cuda();
}
void entmax_forward(const detail::AttentionParams&, const detail::EntmaxConfig&) { no_cuda(); }
void entmax_backward(const detail::AttentionParams&, const detail::GradientParams&,
                     const detail::EntmaxConfig&) {
  no_cuda();
}
void threshold_forward(const detail::AttentionParams&, const detail::ThresholdConfig&) { no_cuda(); }
void threshold_backward(const detail::AttentionParams&, const detail::GradientParams&,
                        const detail::ThresholdConfig&) {
  no_cuda();
}
void screening_forward(const detail::AttentionParams&, const detail::ScreeningConfig&) { no_cuda(); }
void screening_backward(const detail::AttentionParams&, const detail::GradientParams&,
                        const detail::ScreeningConfig&) {
  no_cuda();
}
void gsa_select_keys(const detail::AttentionParams&, const detail::IndexerConfig&) { no_cuda(); }
void gsa_sparse_forward(const detail::AttentionParams&, const detail::KeyListConfig&) { no_cuda(); }
void gsa_sparse_backward(const detail::AttentionParams&, const detail::GradientParams&,
                         const detail::KeyListConfig&) {
  no_cuda();
}
std::int64_t gsa_first_bad_list(const detail::AttentionParams&, const detail::KeyListConfig&) { no_cuda(); }
void gsa_indexer_loss_forward(const detail::AttentionParams&, const detail::IndexerLossConfig&) { no_cuda(); }
void gsa_indexer_loss_backward(const detail::AttentionParams&, const detail::IndexerLossConfig&) { no_cuda(); }
void rotary(const detail::RotaryParams&) { no_cuda(); }
void rms_norm_forward(const detail::RMSNormParams&) { no_cuda(); }
void rms_norm_backward(const detail::RMSNormParams&) { no_cuda(); }
void swiglu_forward(const detail::SwiGLUParams&) { no_cuda(); }
void swiglu_backward(const detail::SwiGLUParams&) { no_cuda(); }
void adamw_clipped_step(const detail::AdamWParams&) { no_cuda(); }
void cross_entropy_forward(const detail::CrossEntropyParams&) { no_cuda(); }
void cross_entropy_backward(const detail::CrossEntropyParams&) { no_cuda(); }
void cast_concatenate(const detail::CastParams&) { no_cuda(); }
void sieve_forward(const detail::AttentionParams&, const detail::SieveConfig&) { no_cuda(); }
void sieve_backward(const detail::AttentionParams&, const detail::GradientParams&,
                    const detail::SieveConfig&) {
  no_cuda();
}
}  // namespace cuda

}  // namespace winnow
