#include "winnow/cast.h"

#include <string>

#include "api/view_checks.h"
#include "core/cast_params.h"
#include "cpu/cpu.h"
#include "cuda/cuda.h"

namespace winnow::cast {
namespace {

using api::describe;
using api::fail;

constexpr const char* kOp = "winnow::cast::concatenate";

}  // namespace

void concatenate(const std::vector<TensorView>& sources, const TensorView& destination, const ExecContext& ctx) {
  if (!is_floating(destination.dtype)) {
    fail(kOp, "destination", "a float16, bfloat16, float32 or float64 tensor", describe(destination));
  }
  if (!api::contiguous(destination)) fail(kOp, "destination", "a contiguous tensor", "strides that are not row-major");
  api::check_device(kOp, "destination", destination);
  api::check_data(kOp, "destination", destination);
  detail::CastParams p;
  p.destination = destination.data;
  p.destination_dtype = destination.dtype;
  p.source_dtype = sources.empty() ? destination.dtype : sources[0].dtype;
  p.num_threads = ctx.num_threads;
  p.cuda_stream = ctx.cuda_stream;
  std::int64_t total = 0;
  for (std::size_t s = 0; s < sources.size(); ++s) {
    const TensorView& t = sources[s];
    const std::string name = "sources[" + std::to_string(s) + "]";
    api::check_device(kOp, name.c_str(), t);
    if (t.dtype != p.source_dtype || t.device != destination.device) {
      fail(kOp, name, describe(p.source_dtype, "any shape", destination.device) + " (like sources[0])", describe(t));
    }
    if (!api::contiguous(t)) fail(kOp, name, "a contiguous tensor", "strides that are not row-major");
    api::check_data(kOp, name.c_str(), t);
    if (api::overlaps(destination, t)) fail(kOp, "destination", "memory apart from every source", "an overlap with " + name);
    if (t.numel() > 0) p.segments.push_back({t.data, t.numel(), total});
    total += t.numel();
  }
  if (total > destination.numel()) {
    fail(kOp, "destination", "at least " + std::to_string(total) + " elements (the sources together)",
         std::to_string(destination.numel()));
  }
  if (p.segments.empty()) return;
  if (destination.device.kind == DeviceKind::cuda) {
    cuda::cast_concatenate(p);
  } else {
    cpu::cast_concatenate(p);
  }
}

}  // namespace winnow::cast
