#include "train/checkpoint.h"

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Context.h>

#include <cstdio>
#include <mutex>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "winnow/error.h"

namespace winnow::train {
namespace fs = std::filesystem;

namespace {

constexpr int kFormatVersion = 1;

[[noreturn]] void fail(const std::string& what) {
  throw Error(ErrorKind::runtime, "checkpoint: " + what);
}

void write_text(const fs::path& path, const std::string& text) {
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  f << text;
  f.flush();
  if (!f) fail("cannot write '" + path.string() + "'");
}

std::string folder_name(std::int64_t step) {
  char name[32];
  std::snprintf(name, sizeof name, "step_%08lld", static_cast<long long>(step));
  return name;
}

}  // namespace

std::string save_checkpoint(const std::string& root, torch::nn::Module& model,
                            torch::optim::Optimizer& optimizer, const CheckpointState& state) {
  const fs::path dir(root);
  const fs::path final_dir = dir / folder_name(state.step);
  const fs::path tmp_dir = dir / (folder_name(state.step) + ".tmp");
  std::error_code ec;
  fs::create_directories(dir, ec);
  fs::remove_all(tmp_dir, ec);
  if (!fs::create_directories(tmp_dir, ec)) fail("cannot create '" + tmp_dir.string() + "'");
  try {
    torch::serialize::OutputArchive model_archive;
    model.save(model_archive);
    model_archive.save_to((tmp_dir / "model.pt").string());
    torch::serialize::OutputArchive optimizer_archive;
    optimizer.save(optimizer_archive);
    optimizer_archive.save_to((tmp_dir / "optimizer.pt").string());
    torch::serialize::OutputArchive rng;
    at::Generator generator = at::detail::getDefaultCPUGenerator();
    {
      std::lock_guard<std::mutex> lock(generator.mutex());
      rng.write("cpu", generator.get_state());
    }
    rng.save_to((tmp_dir / "rng.pt").string());
  } catch (const c10::Error& e) {
    fail("writing '" + tmp_dir.string() + "': " + e.what_without_backtrace());
  }
  const nlohmann::json meta = {
      {"format_version", kFormatVersion}, {"step", state.step}, {"config", state.config}};
  write_text(tmp_dir / "trainer.json", meta.dump(2));
  fs::remove_all(final_dir, ec);
  fs::rename(tmp_dir, final_dir, ec);
  if (ec) fail("cannot move '" + tmp_dir.string() + "' into place: " + ec.message());
  write_text(dir / "latest.tmp", final_dir.filename().string());
  fs::rename(dir / "latest.tmp", dir / "latest", ec);
  if (ec) fail("cannot update '" + (dir / "latest").string() + "': " + ec.message());
  return final_dir.string();
}

std::string latest_checkpoint(const std::string& root) {
  const fs::path pointer = fs::path(root) / "latest";
  std::ifstream f(pointer);
  if (!f) return "";
  std::string name;
  std::getline(f, name);
  if (name.empty() || name.find('/') != std::string::npos) {
    fail("'" + pointer.string() + "' does not name a checkpoint folder");
  }
  return (fs::path(root) / name).string();
}

CheckpointState load_checkpoint(const std::string& folder, torch::nn::Module& model,
                                torch::optim::Optimizer& optimizer) {
  const fs::path dir(folder);
  for (const char* name : {"trainer.json", "model.pt", "optimizer.pt", "rng.pt"}) {
    if (!fs::is_regular_file(dir / name)) fail("'" + folder + "' has no " + name);
  }
  CheckpointState state;
  try {
    std::ifstream f(dir / "trainer.json");
    const nlohmann::json meta = nlohmann::json::parse(f);
    if (meta.at("format_version").get<int>() != kFormatVersion) {
      fail("'" + folder + "' has format version " + meta.at("format_version").dump() +
           ", this build reads " + std::to_string(kFormatVersion));
    }
    state.step = meta.at("step").get<std::int64_t>();
    state.config = meta.at("config");
  } catch (const nlohmann::json::exception& e) {
    fail("'" + (dir / "trainer.json").string() + "' is corrupt: " + e.what());
  }
  auto load = [&](const char* name, auto&& apply) {
    try {
      torch::serialize::InputArchive archive;
      archive.load_from((dir / name).string());
      apply(archive);
    } catch (const c10::Error& e) {
      fail("'" + (dir / name).string() + "' is corrupt or does not match this model: " +
           e.what_without_backtrace());
    } catch (const std::exception& e) {
      fail("'" + (dir / name).string() + "' is corrupt or does not match this model: " + e.what());
    }
  };
  load("model.pt", [&](torch::serialize::InputArchive& a) { model.load(a); });
  load("optimizer.pt", [&](torch::serialize::InputArchive& a) { optimizer.load(a); });
  load("rng.pt", [&](torch::serialize::InputArchive& a) {
    torch::Tensor cpu;
    a.read("cpu", cpu);
    at::Generator generator = at::detail::getDefaultCPUGenerator();
    std::lock_guard<std::mutex> lock(generator.mutex());
    generator.set_state(cpu);
  });
  return state;
}

}  // namespace winnow::train
