// The casting concatenation (winnow/cast.h) on LibTorch tensors.
#include <ATen/ATen.h>

#include "winnow/cast.h"
#include "winnow/torch/ops.h"

namespace winnow::torch_ops {

at::Tensor cast_concatenate(at::TensorList sources, at::ScalarType dtype) {
  constexpr const char* op = "winnow::cast_concatenate";
  TORCH_CHECK_VALUE(!sources.empty(), op, ": argument 'sources': expected at least one tensor, got none");
  return translate_errors([&] {
    int64_t total = 0;
    std::vector<TensorView> views;
    for (const at::Tensor& t : sources) {
      TORCH_CHECK_VALUE(t.defined(), op, ": argument 'sources': expected defined tensors, got an undefined one");
      // Contiguous tensors travel flat (any rank fits a view); the API names any other.
      views.push_back(view_of(t.is_contiguous() ? t.view({-1}) : t, op, "sources"));
      total += t.numel();
    }
    at::Tensor out = at::empty({total}, sources[0].options().dtype(dtype));
    DeviceScope scope(sources[0]);
    cast::concatenate(views, view_of(out, op, "destination"), scope.context(false, false));
    return out;
  });
}

}  // namespace winnow::torch_ops
