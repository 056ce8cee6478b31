#include "train/distributed.h"

#include <algorithm>
#include <cstdlib>
#include <string>

#include "winnow/error.h"

#ifndef WINNOW_HAVE_C10D_GLOO
#define WINNOW_HAVE_C10D_GLOO 0
#endif
#ifndef WINNOW_HAVE_C10D_NCCL
#define WINNOW_HAVE_C10D_NCCL 0
#endif

#if WINNOW_HAVE_C10D_GLOO || WINNOW_HAVE_C10D_NCCL
#include <torch/csrc/distributed/c10d/FileStore.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>
#endif
#if WINNOW_HAVE_C10D_GLOO
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#endif
#if WINNOW_HAVE_C10D_NCCL
#include <c10/cuda/CUDAFunctions.h>
#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>
#endif

namespace winnow::train {
namespace {

[[noreturn]] void fail_env(const std::string& name, const std::string& expected, const std::string& got) {
  throw Error(ErrorKind::invalid_argument,
              "winnow: environment variable " + name + ": expected " + expected + ", got " + got);
}

int env_int(const char* name, int fallback, int least) {
  const char* value = std::getenv(name);
  if (value == nullptr || *value == '\0') return fallback;
  char* end = nullptr;
  const long v = std::strtol(value, &end, 10);
  if (*end != '\0' || v < least || v > (1 << 20)) {
    fail_env(name, "an integer >= " + std::to_string(least), std::string("\"") + value + "\"");
  }
  return static_cast<int>(v);
}

}  // namespace

WorldInfo world_from_environment() {
  WorldInfo w;
  w.world = env_int("WORLD_SIZE", 1, 1);
  w.rank = env_int("RANK", 0, 0);
  w.local_rank = env_int("LOCAL_RANK", w.rank, 0);
  if (w.rank >= w.world) {
    fail_env("RANK", "a rank below WORLD_SIZE = " + std::to_string(w.world), std::to_string(w.rank));
  }
  return w;
}

bool gloo_available() { return WINNOW_HAVE_C10D_GLOO != 0; }
bool nccl_available() { return WINNOW_HAVE_C10D_NCCL != 0; }

std::string collective_backends() {
  std::string s;
  if (nccl_available()) s += "nccl";
  if (gloo_available()) s += s.empty() ? "gloo" : ", gloo";
  return s.empty() ? "none" : s;
}

Collective& Collective::of_process(const WorldInfo& info, torch::Device device) {
  // Never destroyed: tearing NCCL down in static destruction can hang, and the process is
  // ending anyway.
  static Collective* group = nullptr;
  if (group == nullptr) {
    group = new Collective(info, device);
  } else if (group->info_.rank != info.rank || group->info_.world != info.world || group->device_ != device) {
    throw Error(ErrorKind::invalid_argument,
                "winnow: a training asks for rank " + std::to_string(info.rank) + " of " + std::to_string(info.world) +
                    " on " + device.str() + ", but this process already trains as rank " +
                    std::to_string(group->info_.rank) + " of " + std::to_string(group->info_.world) + " on " +
                    group->device_.str() + " (set device the same way for every training of a study)");
  }
  return *group;
}

void Collective::Pending::wait() {
  if (wait_) wait_();
  wait_ = nullptr;
}

#if WINNOW_HAVE_C10D_GLOO || WINNOW_HAVE_C10D_NCCL

struct Collective::Group {
#if WINNOW_HAVE_C10D_GLOO
  c10::intrusive_ptr<c10d::ProcessGroupGloo> gloo;
#endif
#if WINNOW_HAVE_C10D_NCCL
  c10::intrusive_ptr<c10d::ProcessGroupNCCL> nccl;
#endif
  c10::intrusive_ptr<c10d::Work> allreduce(torch::Tensor t) {
    std::vector<torch::Tensor> one = {std::move(t)};
#if WINNOW_HAVE_C10D_NCCL
    if (nccl) return nccl->allreduce(one);
#endif
#if WINNOW_HAVE_C10D_GLOO
    if (gloo) return gloo->allreduce(one);
#endif
    throw Error(ErrorKind::runtime, "winnow: no process group");
  }
};

Collective::Collective(const WorldInfo& info, torch::Device device)
    : info_(info), device_(device), group_(std::make_unique<Group>()) {
  backend_ = device.is_cuda() && nccl_available() ? "nccl" : gloo_available() ? "gloo" : "";
  if (backend_.empty()) {
    throw Error(ErrorKind::unsupported,
                "winnow: WORLD_SIZE = " + std::to_string(info.world) + " asks for data-parallel training on " +
                    device.str() + ", but this build's LibTorch has " +
                    (nccl_available() ? "only NCCL, which needs CUDA devices" : "no c10d process group for it") +
                    "; train with one process");
  }
  c10::intrusive_ptr<c10d::Store> store;
  if (const char* file = std::getenv("WINNOW_STORE_FILE"); file != nullptr && *file != '\0') {
    store = c10::make_intrusive<c10d::FileStore>(file, info.world);
  } else {
    const char* addr = std::getenv("MASTER_ADDR");
    if (addr == nullptr || *addr == '\0') fail_env("MASTER_ADDR", "the address of rank 0 (as torchrun sets it)", "nothing");
    c10d::TCPStoreOptions options;
    options.port = static_cast<std::uint16_t>(env_int("MASTER_PORT", 29500, 1));
    options.isServer = info.rank == 0;
    options.numWorkers = info.world;
    store = c10::make_intrusive<c10d::TCPStore>(addr, options);
  }
#if WINNOW_HAVE_C10D_NCCL
  if (backend_ == "nccl") {
    c10::cuda::set_device(device.index());
    // NCCL's stream at high priority (WINNOW_NCCL_HIGH_PRIORITY=0 turns it off): its blocks take
    // the next free multiprocessors ahead of the backward pass's, so a bucket sent while the
    // backward runs ends sooner. MQRAR's two-GPU step: 0.5% faster (docs/performance.md).
    const bool high_priority = env_int("WINNOW_NCCL_HIGH_PRIORITY", 1, 0) != 0;
    group_->nccl = c10::make_intrusive<c10d::ProcessGroupNCCL>(store, info.rank, info.world,
                                                                c10d::ProcessGroupNCCL::Options::create(high_priority));
    group_->nccl->setBoundDeviceId(device);
  }
#endif
#if WINNOW_HAVE_C10D_GLOO
  if (backend_ == "gloo") {
    auto options = c10d::ProcessGroupGloo::Options::create();
    options->devices.push_back(c10d::ProcessGroupGloo::createDefaultDevice());
    group_->gloo = c10::make_intrusive<c10d::ProcessGroupGloo>(store, info.rank, info.world, options);
  }
#endif
  // NCCL creates its communicator at the first collective, which must not be inside a capture.
  torch::Tensor probe = torch::ones({1}, torch::TensorOptions().device(device));
  group_->allreduce(probe)->wait();
  if (const float summed = probe.item<float>(); summed != static_cast<float>(info.world)) {
    throw Error(ErrorKind::runtime, "winnow: the first all-reduce over " + std::to_string(info.world) +
                                        " ranks (" + backend_ + ") summed to " + std::to_string(summed));
  }
}

Collective::Pending Collective::start_sum(torch::Tensor t) {
  Pending p;
  c10::intrusive_ptr<c10d::Work> work = group_->allreduce(std::move(t));
  p.wait_ = [work] { work->wait(); };
  return p;
}

void Collective::sum(const std::vector<torch::Tensor>& tensors) {
  std::vector<torch::Tensor> flat32, others;
  for (const auto& t : tensors) (t.scalar_type() == torch::kFloat32 ? flat32 : others).push_back(t);
  if (!flat32.empty()) {
    std::vector<torch::Tensor> pieces;
    for (const auto& t : flat32) pieces.push_back(t.reshape(-1));
    torch::Tensor buffer = torch::cat(pieces);
    start_sum(buffer).wait();
    std::int64_t at = 0;
    for (const auto& t : flat32) {
      t.copy_(buffer.narrow(0, at, t.numel()).view_as(t));
      at += t.numel();
    }
  }
  for (const auto& t : others) {
    torch::Tensor c = t.contiguous();
    start_sum(c).wait();
    if (!c.is_same(t)) t.copy_(c);
  }
}

void Collective::barrier() {
  c10d::BarrierOptions options;
  if (device_.is_cuda()) options.device_ids = {device_.index()};
#if WINNOW_HAVE_C10D_NCCL
  if (group_->nccl) {
    group_->nccl->barrier(options)->wait();
    return;
  }
#endif
#if WINNOW_HAVE_C10D_GLOO
  group_->gloo->barrier(options)->wait();
#endif
}

#else

struct Collective::Group {};

Collective::Collective(const WorldInfo& info, torch::Device device) : info_(info), device_(device) {
  throw Error(ErrorKind::unsupported,
              "winnow: WORLD_SIZE = " + std::to_string(info.world) +
                  " asks for data-parallel training, but this build's LibTorch has no c10d process group "
                  "(neither NCCL nor gloo); train with one process");
}
Collective::Pending Collective::start_sum(torch::Tensor) { return {}; }
void Collective::sum(const std::vector<torch::Tensor>&) {}
void Collective::barrier() {}

#endif

Collective::~Collective() = default;

// ------------------------------------------------------------------ gradient buckets

GradientBuckets::GradientBuckets(Collective& collective, const std::vector<torch::Tensor>& params,
                                 std::int64_t bucket_bytes)
    : collective_(collective), bucket_bytes_(bucket_bytes) {
  for (const auto& p : params) {
    if (p.requires_grad()) params_.push_back(p);
  }
  std::vector<std::size_t> reversed;
  for (std::size_t i = params_.size(); i-- > 0;) reversed.push_back(i);
  build(reversed);
  for (std::size_t i = 0; i < params_.size(); ++i) {
    hooks_.push_back(params_[i].register_hook([this, i](const torch::Tensor& grad) { on_gradient(i, grad); }));
  }
}

GradientBuckets::~GradientBuckets() {
  for (std::size_t i = 0; i < params_.size(); ++i) params_[i].remove_hook(hooks_[i]);
}

void GradientBuckets::build(const std::vector<std::size_t>& order) {
  // DistributedDataParallel's first bucket is small too: the gradients that are ready first
  // start travelling while the rest of the backward pass runs.
  const std::int64_t first_cap = std::min<std::int64_t>(bucket_bytes_, std::int64_t{1} << 20);
  slots_.clear();
  buckets_.clear();
  slot_of_.assign(params_.size(), 0);
  std::vector<std::int64_t> sizes;  // elements per bucket
  for (std::size_t i : order) {
    const torch::Tensor& p = params_[i];
    const std::int64_t bytes = p.numel() * static_cast<std::int64_t>(p.element_size());
    bool open_new = buckets_.empty();
    if (!open_new) {
      const torch::Tensor& last = params_[slots_[buckets_.back().slots.back()].param];
      const std::int64_t cap = buckets_.size() == 1 ? first_cap : bucket_bytes_;
      const std::int64_t used = sizes.back() * static_cast<std::int64_t>(last.element_size());
      open_new = last.scalar_type() != p.scalar_type() || last.device() != p.device() || used + bytes > cap;
    }
    if (open_new) {
      buckets_.emplace_back();
      sizes.push_back(0);
    }
    Slot s;
    s.param = i;
    s.bucket = buckets_.size() - 1;
    s.offset = sizes.back();
    sizes.back() += p.numel();
    slot_of_[i] = slots_.size();
    buckets_.back().slots.push_back(slots_.size());
    slots_.push_back(s);
  }
  report_offset_ = sizes.empty() ? 0 : sizes.back();
  if (!sizes.empty()) sizes.back() += report_room_;  // the report's room survives a rebuild
  for (std::size_t b = 0; b < buckets_.size(); ++b) {
    const torch::Tensor& first = params_[slots_[buckets_[b].slots.front()].param];
    buckets_[b].flat = torch::zeros({sizes[b]}, first.options().requires_grad(false));
    buckets_[b].waiting = buckets_[b].slots.size();
  }
  next_to_start_ = 0;
}

std::vector<std::size_t> GradientBuckets::order() const {
  std::vector<std::size_t> o;
  for (const Slot& s : slots_) o.push_back(s.param);
  return o;
}

torch::Tensor GradientBuckets::slice(const Slot& s) const {
  const torch::Tensor& p = params_[s.param];
  return buckets_[s.bucket].flat.narrow(0, s.offset, p.numel()).view(p.sizes());
}

bool GradientBuckets::arm(const std::vector<torch::Tensor>& report) {
  armed_ = true;
  report_.clear();
  if (buckets_.empty()) return report.empty();
  Bucket& last = buckets_.back();
  for (const auto& r : report) {
    if (r.scalar_type() != last.flat.scalar_type() || r.numel() != 1 || r.device() != last.flat.device()) return false;
  }
  report_ = report;
  // Room for the report after the gradients; resized only when the count changes (the first
  // armed step of a phase), never inside a captured step.
  report_room_ = static_cast<std::int64_t>(report_.size());
  if (last.flat.numel() != report_offset_ + report_room_) {
    last.flat = torch::zeros({report_offset_ + report_room_}, last.flat.options());
  }
  return true;
}

void GradientBuckets::on_gradient(std::size_t param, const torch::Tensor& grad) {
  if (!armed_ || !grad.defined()) return;
  Slot& s = slots_[slot_of_[param]];
  if (s.filled) {
    throw Error(ErrorKind::runtime, "winnow: a parameter's gradient arrived twice in one backward pass");
  }
  if (!rebuilt_) arrivals_.push_back(param);
  s.filled = true;
  if (--buckets_[s.bucket].waiting == 0) start_ready(param, grad);
}

void GradientBuckets::start_ready(std::size_t param, const torch::Tensor& arriving) {
  while (next_to_start_ < buckets_.size() && buckets_[next_to_start_].waiting == 0) {
    Bucket& b = buckets_[next_to_start_++];
    // One concatenation into the buffer rather than a copy kernel per parameter. Autograd has
    // already added each earlier gradient into .grad (with the earlier micro-batches'); the one
    // arriving now joins its .grad here.
    std::vector<torch::Tensor> pieces;
    for (std::size_t i : b.slots) {
      const Slot& s = slots_[i];
      const torch::Tensor& p = params_[s.param];
      torch::Tensor g;
      if (arriving.defined() && s.param == param) {
        g = p.grad().defined() ? arriving + p.grad() : arriving;
      } else if (p.grad().defined()) {
        g = p.grad();
      } else {
        g = torch::zeros_like(p);  // no gradient on this pass (finish)
      }
      pieces.push_back(g.to(b.flat.scalar_type()).reshape(-1));
    }
    if (&b == &buckets_.back()) {
      for (const auto& r : report_) pieces.push_back(r.reshape(-1));
    }
    at::cat_out(b.flat, pieces, 0);
    b.pending = collective_.start_sum(b.flat);
  }
}

void GradientBuckets::finish() {
  armed_ = false;
  std::vector<bool> computed(params_.size(), false);
  for (const Slot& s : slots_) computed[s.param] = s.filled || params_[s.param].grad().defined();
  for (std::size_t b = next_to_start_; b < buckets_.size(); ++b) buckets_[b].waiting = 0;
  start_ready();
  for (Bucket& b : buckets_) b.pending.wait();
  for (std::size_t k = 0; k < report_.size(); ++k) {
    report_[k].copy_(buckets_.back().flat.narrow(0, report_offset_ + static_cast<std::int64_t>(k), 1).view_as(report_[k]));
  }
  report_.clear();
  for (Slot& s : slots_) {
    torch::Tensor p = params_[s.param];
    if (computed[s.param]) p.mutable_grad() = slice(s);
    s.filled = false;
  }
  for (Bucket& b : buckets_) b.waiting = b.slots.size();
  next_to_start_ = 0;
  if (rebuilt_) return;
  // Rebuild in the order the gradients arrived (those that never did last), as rank 0 saw it:
  // the order travels as a sum to which the other ranks add zeros.
  rebuilt_ = true;
  std::vector<std::size_t> order = arrivals_;
  std::vector<bool> seen(params_.size(), false);
  for (std::size_t i : order) seen[i] = true;
  for (std::size_t i = params_.size(); i-- > 0;) {
    if (!seen[i]) order.push_back(i);
  }
  if (collective_.world() > 1 && !params_.empty()) {
    std::vector<std::int64_t> mine(order.size(), 0);
    if (collective_.rank() == 0) std::copy(order.begin(), order.end(), mine.begin());
    torch::Tensor shared = torch::tensor(mine, torch::TensorOptions().dtype(torch::kInt64)).to(params_[0].device());
    collective_.sum({shared});
    shared = shared.cpu();
    const std::int64_t* summed = shared.data_ptr<std::int64_t>();
    for (std::size_t k = 0; k < order.size(); ++k) order[k] = static_cast<std::size_t>(summed[k]);
  }
  if (order != this->order()) build(order);
  arrivals_.clear();
}

}  // namespace winnow::train
