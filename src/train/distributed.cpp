#include "train/distributed.h"

#include <cstdlib>
#include <string>

#include "winnow/error.h"

#if WINNOW_HAVE_C10D_GLOO
#include <torch/csrc/distributed/c10d/FileStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>
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

#if WINNOW_HAVE_C10D_GLOO

bool gloo_available() { return true; }

struct Collective::Group {
  c10::intrusive_ptr<c10d::ProcessGroupGloo> pg;
};

Collective::Collective(const WorldInfo& info) : info_(info), group_(std::make_unique<Group>()) {
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
  auto options = c10d::ProcessGroupGloo::Options::create();
  options->devices.push_back(c10d::ProcessGroupGloo::createDefaultDevice());
  group_->pg = c10::make_intrusive<c10d::ProcessGroupGloo>(store, info.rank, info.world, options);
}

void Collective::sum(const std::vector<torch::Tensor>& tensors) {
  std::vector<torch::Tensor> flat32, others;
  for (const auto& t : tensors) (t.scalar_type() == torch::kFloat32 ? flat32 : others).push_back(t);
  auto reduce = [&](torch::Tensor t) {
    std::vector<torch::Tensor> one = {t};
    group_->pg->allreduce(one)->wait();
  };
  if (!flat32.empty()) {
    std::vector<torch::Tensor> pieces;
    for (const auto& t : flat32) pieces.push_back(t.reshape(-1));
    torch::Tensor buffer = torch::cat(pieces);
    reduce(buffer);
    std::int64_t at = 0;
    for (const auto& t : flat32) {
      t.copy_(buffer.narrow(0, at, t.numel()).view_as(t));
      at += t.numel();
    }
  }
  for (const auto& t : others) {
    torch::Tensor c = t.contiguous();
    reduce(c);
    if (!c.is_same(t)) t.copy_(c);
  }
}

void Collective::barrier() { group_->pg->barrier()->wait(); }

#else

bool gloo_available() { return false; }

struct Collective::Group {};

Collective::Collective(const WorldInfo& info) : info_(info) {
  throw Error(ErrorKind::unsupported,
              "winnow: WORLD_SIZE = " + std::to_string(info.world) +
                  " asks for data-parallel training, but this build's LibTorch has no gloo process group "
                  "(c10d); train with one process");
}
void Collective::sum(const std::vector<torch::Tensor>&) {}
void Collective::barrier() {}

#endif

Collective::~Collective() = default;

}  // namespace winnow::train
