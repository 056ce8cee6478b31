#include "train/checkpoint.h"
#include "train/files.h"

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Context.h>
#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <vector>

#include "winnow/error.h"

namespace winnow::train {
namespace fs = std::filesystem;

namespace {

constexpr int kFormatVersion = 1;
const char* const kDataFiles[] = {"model.pt", "optimizer.pt", "rng.pt"};

[[noreturn]] void fail(const std::string& what) { throw Error(ErrorKind::runtime, "checkpoint: " + what); }

// 64-bit FNV-1a: detects accidental corruption (not tampering) at a few GB/s.
std::string checksum(const fs::path& path) {
  std::ifstream f(path, std::ios::binary);
  if (!f) fail("cannot read '" + path.string() + "'");
  std::uint64_t h = 0xcbf29ce484222325ull;
  std::vector<char> buffer(1 << 16);
  while (f) {
    f.read(buffer.data(), static_cast<std::streamsize>(buffer.size()));
    const std::streamsize n = f.gcount();
    for (std::streamsize i = 0; i < n; ++i) {
      h ^= static_cast<unsigned char>(buffer[static_cast<std::size_t>(i)]);
      h *= 0x100000001b3ull;
    }
  }
  char text[17];
  std::snprintf(text, sizeof text, "%016llx", static_cast<unsigned long long>(h));
  return text;
}

// Makes a file's (or a folder's entries') contents durable before anything points at them.
void sync_path(const fs::path& path) {
  const int fd = ::open(path.c_str(), O_RDONLY);
  if (fd < 0) fail("cannot open '" + path.string() + "' to flush it");
  const int rc = ::fsync(fd);
  ::close(fd);
  if (rc != 0) fail("cannot flush '" + path.string() + "' to disk");
}

void write_text(const fs::path& path, const std::string& text) {
  {
    std::ofstream f(path, std::ios::binary | std::ios::trunc);
    f << text;
    f.flush();
    if (!f) fail("cannot write '" + path.string() + "'");
  }
  sync_path(path);
}

std::string folder_name(std::int64_t step) {
  char name[32];
  std::snprintf(name, sizeof name, "step_%08lld", static_cast<long long>(step));
  return name;
}

at::Generator cuda_generator(const torch::Device& device) {
  return at::globalContext().defaultGenerator(device);
}

void remove_old(const fs::path& root, std::int64_t keep) {
  std::error_code ec;
  for (const auto& entry : fs::directory_iterator(root, ec)) {
    const std::string name = entry.path().filename().string();
    if (entry.is_directory() && name.size() > 4 && name.compare(name.size() - 4, 4, ".tmp") == 0) {
      winnow::train::remove_tree(entry.path());  // left by a process killed while saving
    }
  }
  const auto steps = winnow::train::step_checkpoints(root.string());
  if (keep <= 0 || static_cast<std::int64_t>(steps.size()) <= keep) return;
  for (std::size_t i = 0; i + static_cast<std::size_t>(keep) < steps.size(); ++i) {
    winnow::train::remove_tree(steps[i].second);
  }
}

}  // namespace

std::vector<std::pair<std::int64_t, std::string>> step_checkpoints(const std::string& root) {
  std::vector<std::pair<std::int64_t, std::string>> steps;
  std::error_code ec;
  for (const auto& entry : fs::directory_iterator(root, ec)) {
    const std::string name = entry.path().filename().string();
    if (!entry.is_directory() || name.rfind("step_", 0) != 0 || name.size() == 5) continue;
    const std::string digits = name.substr(5);
    if (!std::all_of(digits.begin(), digits.end(), [](char c) { return c >= '0' && c <= '9'; })) continue;
    steps.emplace_back(std::stoll(digits), entry.path().string());
  }
  std::sort(steps.begin(), steps.end());
  return steps;
}

std::string save_checkpoint(const std::string& root, torch::nn::Module& model,
                            torch::optim::Optimizer& optimizer, const CheckpointMeta& meta,
                            std::int64_t keep, std::optional<torch::Device> cuda_device) {
  const fs::path dir(root);
  const fs::path final_dir = dir / folder_name(meta.step);
  const fs::path tmp_dir = dir / (folder_name(meta.step) + ".tmp");
  std::error_code ec;
  fs::create_directories(dir, ec);
  winnow::train::remove_tree(tmp_dir);
  if (!fs::create_directories(tmp_dir, ec)) fail("cannot create '" + tmp_dir.string() + "'");
  try {
    torch::serialize::OutputArchive model_archive;
    model.save(model_archive);
    model_archive.save_to((tmp_dir / "model.pt").string());
    torch::serialize::OutputArchive optimizer_archive;
    optimizer.save(optimizer_archive);
    optimizer_archive.save_to((tmp_dir / "optimizer.pt").string());
    torch::serialize::OutputArchive rng;
    {
      at::Generator cpu = at::detail::getDefaultCPUGenerator();
      std::lock_guard<std::mutex> lock(cpu.mutex());
      rng.write("cpu", cpu.get_state());
    }
    if (cuda_device) {
      at::Generator cuda = cuda_generator(*cuda_device);
      std::lock_guard<std::mutex> lock(cuda.mutex());
      rng.write("cuda", cuda.get_state());
    }
    rng.save_to((tmp_dir / "rng.pt").string());
  } catch (const c10::Error& e) {
    fail("writing '" + tmp_dir.string() + "': " + e.what_without_backtrace());
  }
  nlohmann::json files = nlohmann::json::object();
  for (const char* name : kDataFiles) {
    sync_path(tmp_dir / name);
    files[name] = {{"bytes", fs::file_size(tmp_dir / name)}, {"fnv1a64", checksum(tmp_dir / name)}};
  }
  const nlohmann::json doc = {{"format_version", kFormatVersion}, {"step", meta.step},
                              {"config", meta.config},          {"trainer", meta.trainer},
                              {"files", files}};
  write_text(tmp_dir / "trainer.json", doc.dump(2));
  sync_path(tmp_dir);
  winnow::train::remove_tree(final_dir);
  fs::rename(tmp_dir, final_dir, ec);
  if (ec) fail("cannot move '" + tmp_dir.string() + "' into place: " + ec.message());
  write_text(dir / "latest.tmp", final_dir.filename().string() + "\n");
  fs::rename(dir / "latest.tmp", dir / "latest", ec);
  if (ec) fail("cannot update '" + (dir / "latest").string() + "': " + ec.message());
  sync_path(dir);
  remove_old(dir, keep);
  return final_dir.string();
}

std::string latest_checkpoint(const std::string& root) {
  const fs::path pointer = fs::path(root) / "latest";
  std::ifstream f(pointer);
  if (!f) return "";
  std::string name;
  std::getline(f, name);
  if (name.empty() || name.find('/') != std::string::npos || name == "." || name == "..") {
    fail("'" + pointer.string() + "' does not name a checkpoint folder");
  }
  const fs::path folder = fs::path(root) / name;
  if (!fs::is_directory(folder)) {
    fail("'" + pointer.string() + "' names '" + name + "', which does not exist");
  }
  return folder.string();
}

CheckpointMeta read_checkpoint(const std::string& folder) {
  const fs::path dir(folder);
  const fs::path meta_path = dir / "trainer.json";
  if (!fs::is_regular_file(meta_path)) fail("'" + folder + "' has no trainer.json");
  CheckpointMeta meta;
  nlohmann::json files;
  try {
    std::ifstream f(meta_path);
    const nlohmann::json doc = nlohmann::json::parse(f);
    const int version = doc.at("format_version").get<int>();
    if (version != kFormatVersion) {
      fail("'" + meta_path.string() + "' has format version " + std::to_string(version) +
           "; this build reads version " + std::to_string(kFormatVersion));
    }
    meta.step = doc.at("step").get<std::int64_t>();
    meta.config = doc.at("config");
    meta.trainer = doc.at("trainer");
    files = doc.at("files");
    if (meta.step < 0 || !meta.config.is_object() || !meta.trainer.is_object() || !files.is_object()) {
      fail("'" + meta_path.string() + "' is corrupt: a field has the wrong type or value");
    }
  } catch (const nlohmann::json::exception& e) {
    fail("'" + meta_path.string() + "' is corrupt: " + e.what());
  }
  for (const char* name : kDataFiles) {
    const fs::path path = dir / name;
    if (!fs::is_regular_file(path)) fail("'" + folder + "' has no " + name);
    std::uint64_t bytes = 0;
    std::string recorded;
    try {
      bytes = files.at(name).at("bytes").get<std::uint64_t>();
      recorded = files.at(name).at("fnv1a64").get<std::string>();
    } catch (const nlohmann::json::exception& e) {
      fail("'" + meta_path.string() + "' is corrupt: no size and checksum for " + name);
    }
    const std::uint64_t actual = fs::file_size(path);
    if (actual != bytes) {
      fail("'" + path.string() + "' is truncated or altered: " + std::to_string(actual) +
           " bytes, the checkpoint recorded " + std::to_string(bytes));
    }
    if (checksum(path) != recorded) {
      fail("'" + path.string() + "' is corrupt: its checksum does not match the recorded one");
    }
  }
  return meta;
}

namespace {
template <class Apply>
void load_archive(const fs::path& dir, const char* name, Apply&& apply) {
  try {
    torch::serialize::InputArchive archive;
    archive.load_from((dir / name).string());
    apply(archive);
  } catch (const c10::Error& e) {
    fail("'" + (dir / name).string() + "' does not fit this model and optimizer: " +
         e.what_without_backtrace());
  } catch (const std::exception& e) {
    fail("'" + (dir / name).string() + "' does not fit this model and optimizer: " + e.what());
  }
}
}  // namespace

void restore_model(const std::string& folder, torch::nn::Module& model) {
  load_archive(fs::path(folder), "model.pt", [&](torch::serialize::InputArchive& a) { model.load(a); });
}

void restore_checkpoint(const std::string& folder, torch::nn::Module& model,
                        torch::optim::Optimizer& optimizer, std::optional<torch::Device> cuda_device) {
  const fs::path dir(folder);
  auto load = [&](const char* name, auto&& apply) { load_archive(dir, name, apply); };
  load("model.pt", [&](torch::serialize::InputArchive& a) { model.load(a); });
  load("optimizer.pt", [&](torch::serialize::InputArchive& a) { optimizer.load(a); });
  load("rng.pt", [&](torch::serialize::InputArchive& a) {
    torch::Tensor state;
    a.read("cpu", state);
    at::Generator cpu = at::detail::getDefaultCPUGenerator();
    {
      std::lock_guard<std::mutex> lock(cpu.mutex());
      cpu.set_state(state);
    }
    torch::Tensor cuda_state;
    if (cuda_device && a.try_read("cuda", cuda_state)) {
      at::Generator cuda = cuda_generator(*cuda_device);
      std::lock_guard<std::mutex> lock(cuda.mutex());
      cuda.set_state(cuda_state);
    }
  });
}

}  // namespace winnow::train
