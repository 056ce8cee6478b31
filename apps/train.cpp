// `winnow train`: trains the model an experiment file describes.
// `winnow train-bench`: training throughput (tokens/s) of a 2-layer d = 256 model per attention
// layer kind at a few sequence lengths, fused operators beside the composed LibTorch
// expressions; the measurement the models issue asks for on an H100.
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <algorithm>
#include <map>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include <unistd.h>

#include <torch/version.h>
#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 4)
// LibTorch's profiler (Kineto) as it is from 2.4 on: kernel times per phase of a step.
#include <torch/csrc/autograd/profiler_kineto.h>
#define WINNOW_KERNEL_PROFILE 1
#endif

#include "commands.h"
#include "train/files.h"
#include "train/config.h"
#include "train/trainer.h"
#include "winnow/error.h"

namespace winnow::apps {
namespace {
namespace fs = std::filesystem;

void add_train(CLI::App& app) {
  struct Args {
    std::string config;
    std::vector<std::string> overrides;
    bool fresh = false, print_config = false;
    int gpus = 0, processes = 0;
  };
  auto args = std::make_shared<Args>();
  CLI::App* cmd = app.add_subcommand(
      "train", "Train a model from an experiment file (continues from the checkpoint in "
               "train.out_dir when there is one)");
  cmd->add_option("--config", args->config, "experiment file (JSON); see configs/")
      ->required()
      ->check(CLI::ExistingFile);
  cmd->add_option("--set", args->overrides,
                  "override a key, e.g. --set train.lr=3e-4 --set model.attention.kind=stick_breaking")
      ->take_all();
  cmd->add_flag("--fresh", args->fresh,
                "delete the checkpoints and metrics in train.out_dir and start over");
  cmd->add_flag("--print-config", args->print_config,
                "print the resolved configuration (every default filled in) and exit");
  add_rank_options(*cmd, args->gpus, args->processes);
  cmd->callback([args] {
    const train::ExperimentConfig config = train::load_experiment(args->config, args->overrides);
    if (args->print_config) {
      std::printf("%s\n", train::to_json(config).dump(2).c_str());
      return;
    }
    if (const int ranks = rank_count("winnow train", args->gpus, args->processes, config.device); ranks > 0) {
      std::vector<std::string> rest = {"--config", args->config};
      for (const auto& o : args->overrides) rest.insert(rest.end(), {"--set", o});
      if (args->fresh) rest.push_back("--fresh");
      if (args->gpus > 0) rest.insert(rest.end(), {"--set", "device=cuda"});
      return launch_ranks("train", ranks, rest);
    }
    train::Trainer trainer(config);
    // One voice for a data-parallel run: rank 0's.
    const bool speaks = trainer.world().rank == 0;
    if (speaks) std::printf("model: %s, %lld layers, d_model %lld, %lld parameters; "
                "device %s\n",
                nn::describe(trainer.model()->config()).c_str(),
                static_cast<long long>(config.model.layers),
                static_cast<long long>(config.model.d_model),
                static_cast<long long>([&] {
                  std::int64_t n = 0;
                  for (const auto& p : trainer.model()->parameters()) n += p.numel();
                  return n;
                }()),
                trainer.device().str().c_str());
    if (args->fresh) {
      trainer.clear_outputs();
    } else {
      trainer.resume();
    }
    trainer.train();
    if (speaks) std::printf("checkpoint and metrics in %s\n", config.train.out_dir.c_str());
  });
}

// ------------------------------------------------------------------ train-bench

struct BenchKind {
  std::string name;
  nlohmann::json attention;  // model.attention of the run
};

const std::vector<BenchKind>& bench_kinds() {
  static const std::vector<BenchKind> kinds = {
      {"softmax_rope", {{"kind", "softmax"}, {"position", "rope"}}},
      {"softmax_nope", {{"kind", "softmax"}, {"position", "nope"}}},
      {"softmax_alibi", {{"kind", "softmax"}, {"position", "alibi"}}},
      {"ssmax", {{"kind", "softmax"}, {"ssmax", true}}},
      {"gated_g1g2", {{"kind", "softmax"}, {"gate", "g1g2"}}},
      {"differential", {{"kind", "differential"}}},
      {"stick_breaking", {{"kind", "stick_breaking"}}},
      {"stick_breaking_rb_gn", {{"kind", "stick_breaking"}, {"remainder_bias", true}, {"head_norm", true}}},
      {"entmax_rope", {{"kind", "entmax"}, {"position", "rope"}}},
      {"sieve", {{"kind", "sieve"}}},
      {"sieve_bound", {{"kind", "sieve"}, {"filter", "bound"}}},
      // GSA as studies/lm.json trains it: its sparse phase (no train.phases here, so no warm-up),
      // 003's sparse-only baseline, and the gated-only (dense) one.
      {"gsa", {{"kind", "gsa"}, {"position", "rope"}, {"k_base", 128}, {"k_min", 32}, {"k_max", 256}}},
      {"gsa_sparse_only",
       {{"kind", "gsa"}, {"position", "rope"}, {"gates", false}, {"indexer", "relu"}, {"budget", "fixed"},
        {"k", 128}, {"k_max", 128}}},
      {"gsa_gated_only", {{"kind", "gsa"}, {"position", "rope"}, {"indexer", "none"}}},
      {"softmax_rope@composed", {{"kind", "softmax"}, {"position", "rope"}, {"implementation", "composed"}}},
      {"stick_breaking@composed", {{"kind", "stick_breaking"}, {"implementation", "composed"}}},
      {"entmax_rope@composed", {{"kind", "entmax"}, {"position", "rope"}, {"implementation", "composed"}}},
      {"sieve@composed", {{"kind", "sieve"}, {"implementation", "composed"}}},
  };
  return kinds;
}

std::vector<std::string> split(const std::string& text) {
  std::vector<std::string> out;
  std::stringstream s(text);
  std::string item;
  while (std::getline(s, item, ',')) {
    if (!item.empty()) out.push_back(item);
  }
  return out;
}

// `steps` training steps with a StepProfile attached and, on CUDA with LibTorch >= 2.4, under
// LibTorch's profiler, whose kernels are assigned to the phase whose user scope they started
// in (the waits at phase ends make that exact). Prints a table; returns it as JSON.
nlohmann::json profile_steps(train::Trainer& trainer, std::int64_t steps, double free_ms_per_step) {
  train::StepProfile profile;
  std::map<std::string, std::pair<double, std::int64_t>> kernel_ns_by_phase, kernel_ns_by_name, kernel_ns_by_caller;
  bool kernel_times = false;
#ifdef WINNOW_KERNEL_PROFILE
  namespace prof = torch::profiler::impl;
  const prof::ProfilerConfig config(prof::ProfilerState::KINETO);
  const std::set<prof::ActivityType> activities = {prof::ActivityType::CPU, prof::ActivityType::CUDA};
  kernel_times = trainer.device().is_cuda();
  if (kernel_times) {
    torch::autograd::profiler::prepareProfiler(config, activities);
    torch::autograd::profiler::enableProfiler(config, activities);
  }
#endif
  trainer.profile = &profile;
  try {
    for (std::int64_t i = 0; i < steps; ++i) trainer.step();
  } catch (...) {
    trainer.profile = nullptr;
    throw;
  }
  trainer.profile = nullptr;
#ifdef WINNOW_KERNEL_PROFILE
  if (kernel_times) {
    const auto result = torch::autograd::profiler::disableProfiler();
    struct Span {
      std::string phase;
      std::uint64_t start, end;
    };
    std::vector<Span> spans;
    const std::string prefix = "winnow.step.";
    // Which operation launched each kernel: the kernel's linked correlation id is that of the
    // innermost CPU operation around its launch; the outermost operation around that one (a
    // module's aten::linear, an autograd node) says what it was for.
    struct CpuOp {
      std::string name;
      std::uint64_t start, end, thread;
    };
    std::vector<CpuOp> callers;
    std::map<std::uint64_t, std::size_t> caller_by_correlation;  // index into callers
    for (const auto& e : result->events()) {
      if (e.deviceType() != c10::DeviceType::CPU) continue;
      std::string name = e.name();
      if (name.rfind(prefix, 0) == 0) {
        spans.push_back({name.substr(prefix.size()), e.startNs(), e.endNs()});
        continue;
      }
      if (e.correlationId() != 0) caller_by_correlation[e.correlationId()] = callers.size();
      callers.push_back({std::move(name), e.startNs(), e.endNs(), e.startThreadId()});
    }
    const auto caller_of = [&](const CpuOp& inner) {
      const CpuOp* outer = &inner;
      for (const CpuOp& c : callers) {
        if (c.thread == inner.thread && c.start <= inner.start && c.end >= inner.end &&
            c.end - c.start > outer->end - outer->start) {
          outer = &c;
        }
      }
      return outer->name == inner.name ? inner.name : outer->name + " > " + inner.name;
    };
    for (const auto& e : result->events()) {
      // The phases' own scopes come back as GPU-side ranges too; they are not work.
      if (e.deviceType() != c10::DeviceType::CUDA || e.name().rfind(prefix, 0) == 0) continue;
      if (const auto it = caller_by_correlation.find(e.linkedCorrelationId()); it != caller_by_correlation.end()) {
        std::string kernel = e.name();
        if (kernel.size() > 60) kernel = kernel.substr(0, 60);
        auto& c = kernel_ns_by_caller[caller_of(callers[it->second]) + " : " + kernel];
        c.first += static_cast<double>(e.durationNs());
        c.second += 1;
      }
      std::string phase = "outside the phases";
      for (const Span& s : spans) {
        if (e.startNs() >= s.start && e.startNs() < s.end) phase = s.phase;
      }
      auto& p = kernel_ns_by_phase[phase];
      p.first += static_cast<double>(e.durationNs());
      p.second += 1;
      auto& k = kernel_ns_by_name[e.name()];
      k.first += static_cast<double>(e.durationNs());
      k.second += 1;
    }
  }
#endif
  const double n = static_cast<double>(std::max<std::int64_t>(profile.steps, 1));
  nlohmann::json phases = nlohmann::json::array();
  double wall_total = 0, kernel_total = 0;
  std::int64_t kernels_total = 0;
  std::printf("    %-22s %14s %16s %14s\n", "phase (synchronized)", "wall ms/step",
              kernel_times ? "GPU busy ms/step" : "", kernel_times ? "GPU ops/step" : "");
  auto row = [&](const std::string& name, double wall_s, const std::pair<double, std::int64_t>* k) {
    nlohmann::json r = {{"phase", name}, {"wall_ms", 1e3 * wall_s / n}};
    if (k != nullptr) {
      r["gpu_busy_ms"] = 1e-6 * k->first / n;
      r["gpu_ops"] = static_cast<double>(k->second) / n;
      std::printf("    %-22s %14.3f %16.3f %14.1f\n", name.c_str(), 1e3 * wall_s / n, 1e-6 * k->first / n,
                  static_cast<double>(k->second) / n);
    } else {
      std::printf("    %-22s %14.3f\n", name.c_str(), 1e3 * wall_s / n);
    }
    phases.push_back(r);
  };
  for (const auto& [name, seconds] : profile.seconds) {
    const auto it = kernel_ns_by_phase.find(name);
    const std::pair<double, std::int64_t> none{0, 0};
    row(name, seconds, kernel_times ? (it == kernel_ns_by_phase.end() ? &none : &it->second) : nullptr);
    wall_total += seconds;
    if (it != kernel_ns_by_phase.end()) {
      kernel_total += it->second.first;
      kernels_total += it->second.second;
    }
  }
  if (const auto it = kernel_ns_by_phase.find("outside the phases"); it != kernel_ns_by_phase.end()) {
    row(it->first, 0, &it->second);
    kernel_total += it->second.first;
    kernels_total += it->second.second;
  }
  std::printf("    %-22s %14.3f", "synchronized step", 1e3 * wall_total / n);
  if (kernel_times) {
    std::printf(" %16.3f %14.1f", 1e-6 * kernel_total / n, static_cast<double>(kernels_total) / n);
  }
  std::printf("\n    %-22s %14.3f\n", "free-running step", free_ms_per_step);
  nlohmann::json out = {{"steps", profile.steps},
                        {"phases", phases},
                        {"synchronized_ms_per_step", 1e3 * wall_total / n},
                        {"free_running_ms_per_step", free_ms_per_step}};
  if (kernel_times) {
    out["gpu_busy_ms_per_step"] = 1e-6 * kernel_total / n;
    out["gpu_ops_per_step"] = static_cast<double>(kernels_total) / n;
    std::vector<std::pair<std::string, std::pair<double, std::int64_t>>> top(kernel_ns_by_name.begin(),
                                                                             kernel_ns_by_name.end());
    std::sort(top.begin(), top.end(), [](const auto& a, const auto& b) { return a.second.first > b.second.first; });
    // Every operation goes to the JSON; the 30 largest are printed.
    nlohmann::json kernels = nlohmann::json::array();
    std::printf("    %-110s %10s %8s\n", "GPU op (largest total time)", "ms/step", "n/step");
    for (std::size_t i = 0; i < top.size(); ++i) {
      const auto& [name, k] = top[i];
      kernels.push_back({{"name", name}, {"ms", 1e-6 * k.first / n}, {"count", static_cast<double>(k.second) / n}});
      if (i >= 30) continue;
      std::printf("    %-110.110s %10.3f %8.1f\n", name.c_str(), 1e-6 * k.first / n,
                  static_cast<double>(k.second) / n);
    }
    out["top_gpu_ops"] = kernels;
    std::vector<std::pair<std::string, std::pair<double, std::int64_t>>> by_caller(kernel_ns_by_caller.begin(),
                                                                                   kernel_ns_by_caller.end());
    std::sort(by_caller.begin(), by_caller.end(),
              [](const auto& a, const auto& b) { return a.second.first > b.second.first; });
    nlohmann::json callers_json = nlohmann::json::array();
    for (const auto& [name, k] : by_caller) {
      callers_json.push_back({{"caller", name}, {"ms", 1e-6 * k.first / n}, {"count", static_cast<double>(k.second) / n}});
    }
    out["gpu_ops_by_caller"] = callers_json;
  }
  return out;
}

void add_train_bench(CLI::App& app) {
  struct Args {
    std::string device = "auto", lengths = "64,1024", kinds, json_path;
    std::int64_t tokens = 65536, steps = 10, warmup = 3;
    bool profile = false;
  };
  auto args = std::make_shared<Args>();
  CLI::App* cmd = app.add_subcommand(
      "train-bench",
      "Training tokens/s of a 2-layer d=256 model per attention layer kind (fused operators and "
      "composed LibTorch expressions)");
  cmd->add_option("--device", args->device, "auto | cpu | cuda | cuda:N")->capture_default_str();
  cmd->add_option("--lengths", args->lengths, "sequence lengths, comma-separated")->capture_default_str();
  cmd->add_option("--tokens", args->tokens, "tokens per optimizer step (batch = tokens / length)")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  cmd->add_option("--steps", args->steps, "timed steps per run")->capture_default_str()->check(CLI::PositiveNumber);
  cmd->add_option("--warmup", args->warmup, "untimed steps before them")->capture_default_str()->check(CLI::NonNegativeNumber);
  std::string kind_names;
  for (const auto& k : bench_kinds()) kind_names += (kind_names.empty() ? "" : ", ") + k.name;
  cmd->add_option("--kinds", args->kinds, "subset of: " + kind_names + " (default: all)");
  cmd->add_option("--json", args->json_path, "also write the results to this file");
  cmd->add_flag("--profile", args->profile,
                "after the timed steps, as many again synchronized at each phase of the step "
                "(wall time per phase; on CUDA also GPU time and operations per phase, and the "
                "largest kernels)");
  cmd->callback([args] {
    std::vector<const BenchKind*> kinds;
    if (args->kinds.empty()) {
      for (const auto& k : bench_kinds()) kinds.push_back(&k);
    } else {
      for (const std::string& name : split(args->kinds)) {
        const BenchKind* found = nullptr;
        for (const auto& k : bench_kinds()) {
          if (k.name == name) found = &k;
        }
        if (found == nullptr) {
          throw Error(ErrorKind::invalid_argument,
                      "argument '--kinds': expected names from " + [] {
                        std::string all;
                        for (const auto& k : bench_kinds()) all += (all.empty() ? "" : ", ") + k.name;
                        return all;
                      }() + ", got '" + name + "'");
        }
        kinds.push_back(found);
      }
    }
    std::vector<std::int64_t> lengths;
    for (const std::string& l : split(args->lengths)) {
      std::int64_t value = 0;
      try {
        value = std::stoll(l);
      } catch (const std::exception&) {
        value = 0;
      }
      if (value < 1 || value > args->tokens) {
        throw Error(ErrorKind::invalid_argument,
                    "argument '--lengths': expected integers in [1, --tokens], got '" + l + "'");
      }
      lengths.push_back(value);
    }

    const fs::path scratch = fs::temp_directory_path() / ("winnow-train-bench-" + std::to_string(::getpid()));
    nlohmann::json results = nlohmann::json::array();
    std::string device_name;
    std::printf("%6s %6s  %-24s %-9s %12s %10s  %s\n", "L", "batch", "kind", "impl", "tokens/s", "ms/step", "step");
    for (std::int64_t L : lengths) {
      for (const BenchKind* kind : kinds) {
        const std::int64_t batch = std::max<std::int64_t>(1, args->tokens / L);
        nlohmann::json experiment = {
            {"seed", 1},
            {"device", args->device},
            {"model", {{"d_model", 256}, {"layers", 2}, {"attention", kind->attention}}},
            {"train",
             {{"steps", args->warmup + args->steps * (args->profile ? 2 : 1)}, {"batch_size", batch}, {"seq_len", L},
              {"schedule", "constant"}, {"lr", 1e-3}, {"out_dir", scratch.string()}}},
            {"task", {{"name", "progression"}, {"vocab_size", 64}}}};
        experiment["model"]["attention"]["heads"] = 4;
        nlohmann::json record = {{"kind", kind->name}, {"L", L}, {"batch", batch}};
        try {
          const train::ExperimentConfig config = train::parse_experiment(experiment);
          record["implementation"] = config.model.attention.implementation;
          train::Trainer trainer(config);
          trainer.quiet = true;
          device_name = trainer.device().str();
          // The parameter count and the loss of the first step (before any update), which
          // bench/train_baseline.py checks its PyTorch model against.
          std::int64_t parameters = 0;
          for (const auto& p : trainer.model()->parameters()) parameters += p.numel();
          record["parameters"] = parameters;
          // Free-running steps, as `winnow train` runs them; the first one waits for its loss.
          auto step = [&] {
            if (!record.contains("initial_loss")) {
              record["initial_loss"] = trainer.step().loss;
            } else {
              trainer.enqueue_step();
            }
          };
          for (std::int64_t i = 0; i < args->warmup; ++i) step();
          trainer.wait_for_steps();
          if (trainer.device().is_cuda()) torch::cuda::synchronize();
          const auto start = std::chrono::steady_clock::now();
          for (std::int64_t i = 0; i < args->steps; ++i) step();
          trainer.wait_for_steps();
          if (trainer.device().is_cuda()) torch::cuda::synchronize();
          const double seconds =
              std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
          record["tokens_per_s"] = static_cast<double>(args->steps * trainer.tokens_per_step()) / seconds;
          const std::string blocker = trainer.graph_blocker();
          record["cuda_graph"] = blocker.empty() ? std::string("on") : "off: " + blocker;
          record["ms_per_step"] = 1e3 * seconds / static_cast<double>(args->steps);
          std::printf("%6lld %6lld  %-24s %-9s %12.0f %10.2f  %s\n", static_cast<long long>(L),
                      static_cast<long long>(batch), kind->name.c_str(),
                      record["implementation"].get<std::string>().c_str(),
                      record["tokens_per_s"].get<double>(), record["ms_per_step"].get<double>(),
                      blocker.empty() ? "graph" : "");
          if (args->profile) {
            std::fflush(stdout);
            record["profile"] = profile_steps(trainer, args->steps, record["ms_per_step"].get<double>());
          }
        } catch (const std::exception& e) {
          std::string what = e.what();
          if (const auto nl = what.find('\n'); nl != std::string::npos) what = what.substr(0, nl);
          record["error"] = what;
          std::printf("%6lld %6lld  %-24s error: %s\n", static_cast<long long>(L),
                      static_cast<long long>(batch), kind->name.c_str(), what.c_str());
        }
        std::fflush(stdout);
        std::error_code ec;
        winnow::train::remove_tree(scratch);
        results.push_back(record);
      }
    }
    // Fused over composed, for each kind measured both ways.
    nlohmann::json ratios = nlohmann::json::array();
    for (const auto& r : results) {
      const std::string name = r["kind"];
      if (name.find('@') != std::string::npos || !r.contains("tokens_per_s")) continue;
      for (const auto& c : results) {
        if (c["kind"] == name + "@composed" && c["L"] == r["L"] && c.contains("tokens_per_s")) {
          const double ratio = r["tokens_per_s"].get<double>() / c["tokens_per_s"].get<double>();
          ratios.push_back({{"kind", name}, {"L", r["L"]}, {"fused_over_composed", ratio}});
          std::printf("%s at L = %lld: fused / composed = %.2fx\n", name.c_str(),
                      static_cast<long long>(r["L"].get<std::int64_t>()), ratio);
        }
      }
    }
    if (!args->json_path.empty()) {
      std::ofstream f(args->json_path);
      f << nlohmann::json({{"device", device_name},
                           {"model", "2 layers, d_model 256, 4 heads, SwiGLU, vocab 64"},
                           {"tokens_per_step", args->tokens},
                           {"timed_steps", args->steps},
                           {"results", results},
                           {"fused_over_composed", ratios}})
               .dump(2)
        << '\n';
      if (!f) throw Error(ErrorKind::runtime, "argument '--json': cannot write '" + args->json_path + "'");
    }
  });
}

}  // namespace

void add_train_command(CLI::App& app) {
  add_train(app);
  add_train_bench(app);
}

}  // namespace winnow::apps
