#include "winnow/torch/bridge.h"

#ifdef WINNOW_TORCH_CUDA
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAStream.h>
#endif

namespace winnow::torch_ops {
namespace {

[[noreturn]] void reject(const char* op, const char* name, const std::string& expected,
                         const at::Tensor& t) {
  throw Error(ErrorKind::invalid_argument,
              std::string(op) + ": argument '" + name + "': expected " + expected + ", got " +
                  std::string(c10::toString(t.scalar_type())) + " tensor of " +
                  std::to_string(t.dim()) + " dimensions on " + t.device().str());
}

}  // namespace

TensorView view_of(const at::Tensor& t, const char* op, const char* name) {
  if (!t.defined()) {
    throw Error(ErrorKind::invalid_argument,
                std::string(op) + ": argument '" + name + "': expected a tensor, got None");
  }
  TensorView v;
  switch (t.scalar_type()) {
    case at::kHalf: v.dtype = DType::float16; break;
    case at::kBFloat16: v.dtype = DType::bfloat16; break;
    case at::kFloat: v.dtype = DType::float32; break;
    case at::kDouble: v.dtype = DType::float64; break;
    case at::kInt: v.dtype = DType::int32; break;
    case at::kLong: v.dtype = DType::int64; break;
    default: reject(op, name, "a float16/bfloat16/float32/float64 or int32/int64 tensor", t);
  }
  if (t.is_cpu()) {
    v.device = Device::cpu();
  } else if (t.is_cuda()) {
    v.device = Device::cuda(t.device().index());
  } else {
    reject(op, name, "a CPU or CUDA tensor", t);
  }
  if (t.dim() > TensorView::kMaxDims) reject(op, name, "at most 4 dimensions", t);
  v.ndim = static_cast<int>(t.dim());
  for (int d = 0; d < v.ndim; ++d) {
    v.shape[d] = t.size(d);
    v.stride[d] = t.stride(d);
  }
  v.data = t.numel() > 0 ? t.data_ptr() : nullptr;
  return v;
}

std::optional<TensorView> view_of(const c10::optional<at::Tensor>& t, const char* op,
                                  const char* name) {
  if (!t.has_value() || !t->defined()) return std::nullopt;
  return view_of(*t, op, name);
}

#ifdef WINNOW_TORCH_CUDA
namespace {
class CachingAllocator final : public DeviceAllocator {
 public:
  void* allocate(std::size_t bytes) override {
    return c10::cuda::CUDACachingAllocator::raw_alloc(bytes);
  }
  void deallocate(void* ptr) override { c10::cuda::CUDACachingAllocator::raw_delete(ptr); }
};
CachingAllocator caching_allocator;
}  // namespace
#endif

DeviceScope::DeviceScope(const at::Tensor& q) : q_(q) {
#ifdef WINNOW_TORCH_CUDA
  if (q.is_cuda()) {
    previous_device_ = c10::cuda::current_device();
    c10::cuda::set_device(q.device().index());
  }
#endif
}

DeviceScope::~DeviceScope() {
#ifdef WINNOW_TORCH_CUDA
  if (previous_device_ >= 0) c10::cuda::set_device(static_cast<c10::DeviceIndex>(previous_device_));
#endif
}

ExecContext DeviceScope::context(bool deterministic, bool reference) const {
  ExecContext ctx;
  ctx.deterministic = deterministic;
  ctx.backend = reference ? Backend::reference : Backend::automatic;
#ifdef WINNOW_TORCH_CUDA
  if (q_.is_cuda()) {
    ctx.cuda_stream = c10::cuda::getCurrentCUDAStream(q_.device().index()).stream();
    ctx.allocator = &caching_allocator;
  }
#endif
  return ctx;
}

at::Tensor side_by_side(at::TensorList parts) {
  if (parts.empty() || !parts[0].defined()) return at::Tensor();
  // Traced tensors (torch.compile, opcheck's fake tensors) may have symbolic sizes, whose
  // offsets cannot be read: such parts are taken as apart, which is always correct.
  for (const at::Tensor& t : parts) {
    if (t.defined() && t.unsafeGetTensorImpl()->has_symbolic_sizes_strides()) return at::Tensor();
  }
  const at::Tensor& first = parts[0];
  if (first.dim() < 1 || first.stride(-1) != 1) return at::Tensor();
  int64_t width = 0;
  for (const at::Tensor& t : parts) {
    if (!t.defined() || t.scalar_type() != first.scalar_type() || t.dim() != first.dim() ||
        t.strides() != first.strides() || t.sizes().slice(0, t.dim() - 1) != first.sizes().slice(0, first.dim() - 1) ||
        !t.storage().is_alias_of(first.storage()) || t.storage_offset() != first.storage_offset() + width) {
      return at::Tensor();
    }
    width += t.size(-1);
  }
  // A row stride below the whole width would make the joined rows overlap.
  if (first.dim() >= 2 && first.size(-2) > 1 && first.stride(-2) < width) return at::Tensor();
  std::vector<int64_t> shape(first.sizes().begin(), first.sizes().end());
  shape.back() = width;
  return first.as_strided(shape, first.strides(), first.storage_offset());
}

at::Tensor heads_side_by_side(at::TensorList parts) {
  const c10::DispatchKeySet traced({c10::DispatchKey::Python, c10::DispatchKey::Functionalize});
  std::vector<at::Tensor> rows;
  for (const at::Tensor& t : parts) {
    if (!t.defined() || t.dim() != 4 || t.unsafeGetTensorImpl()->has_symbolic_sizes_strides() || t.is_meta() ||
        !(t.key_set() & traced).empty()) {
      return at::Tensor();
    }
    if (t.stride(3) != 1 || (t.size(2) > 1 && t.stride(2) != t.size(3))) return at::Tensor();
    rows.push_back(t.as_strided({t.size(0), t.size(1), t.size(2) * t.size(3)}, {t.stride(0), t.stride(1), 1},
                                t.storage_offset()));
  }
  return side_by_side(rows);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> packed_grads(const at::Tensor& q, const at::Tensor& k,
                                                            const at::Tensor& v) {
  const int64_t B = q.size(0), L = q.size(1);
  const int64_t nq = q.size(2) * q.size(3), nk = k.size(2) * k.size(3), nv = v.size(2) * v.size(3);
  const at::Tensor all = at::empty({B, L, nq + nk + nv}, q.options());
  return std::make_tuple(all.narrow(2, 0, nq).view(q.sizes()), all.narrow(2, nq, nk).view(k.sizes()),
                         all.narrow(2, nq + nk, nv).view(v.sizes()));
}

at::ScalarType stats_dtype(const at::Tensor& q) {
  return q.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
}

}  // namespace winnow::torch_ops
