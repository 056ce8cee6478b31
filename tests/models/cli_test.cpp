// The `winnow` command line tool as a user runs it: info, train with overrides, errors that
// name the key, resuming, a run killed with SIGKILL mid-training and resumed (bit-identical to
// an uninterrupted run), the train-bench command the GPU measurement uses, and the shipped
// study files run end to end at tiny size (study, eval, plot).
#include <gtest/gtest.h>
#include <fcntl.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <torch/torch.h>
#include <unistd.h>

#include <chrono>
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "nn/transformer.h"
#include "study/report.h"
#include "study/study.h"
#include "train/files.h"
#include "train/checkpoint.h"
#include "train/config.h"
#include "train/distributed.h"

extern char** environ;

namespace winnow {
namespace {
namespace fs = std::filesystem;

std::string scratch(const std::string& name) {
  const fs::path p = fs::temp_directory_path() / ("winnow_cli_" + name + "_" + std::to_string(::getpid()));
  winnow::train::remove_tree(p);
  fs::create_directories(p);
  return p.string();
}

struct Outcome {
  int status = -1;  // exit status, or -1 when killed by a signal
  std::string output;
};

std::string slurp(const fs::path& path) {
  std::ifstream f(path);
  std::stringstream s;
  s << f.rdbuf();
  return s.str();
}

// Starts the tool with stdout and stderr going to `log` and `env` ("NAME=value") added to this
// process's environment; returns its pid.
pid_t start(const std::vector<std::string>& args, const fs::path& log, const std::vector<std::string>& env = {}) {
  std::vector<std::string> argv_storage = {WINNOW_CLI};
  argv_storage.insert(argv_storage.end(), args.begin(), args.end());
  std::vector<char*> argv;
  for (auto& a : argv_storage) argv.push_back(a.data());
  argv.push_back(nullptr);
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_addopen(&actions, 1, log.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  posix_spawn_file_actions_adddup2(&actions, 1, 2);
  std::vector<std::string> env_storage(env.begin(), env.end());
  for (char** e = environ; *e != nullptr; ++e) env_storage.emplace_back(*e);
  std::vector<char*> envp;
  for (auto& e : env_storage) envp.push_back(e.data());
  envp.push_back(nullptr);
  pid_t pid = -1;
  const int rc = posix_spawn(&pid, WINNOW_CLI, &actions, nullptr, argv.data(), envp.data());
  posix_spawn_file_actions_destroy(&actions);
  if (rc != 0) throw std::runtime_error("cannot start " + std::string(WINNOW_CLI));
  return pid;
}

Outcome wait_for(pid_t pid, const fs::path& log) {
  int status = 0;
  waitpid(pid, &status, 0);
  return {WIFEXITED(status) ? WEXITSTATUS(status) : -1, slurp(log)};
}

Outcome run(const std::vector<std::string>& args, const std::string& dir) {
  const fs::path log = fs::path(dir) / "cli.log";
  return wait_for(start(args, log), log);
}

std::string config_file(const std::string& name) {
  return (fs::path(WINNOW_SOURCE_DIR) / "configs" / "toy" / (name + ".json")).string();
}

// A small, fast run of a shipped config.
std::vector<std::string> small_run(const std::string& config, const std::string& out_dir) {
  return {"train", "--config", config_file(config), "--set", "device=cpu", "--set",
          "train.out_dir=" + out_dir, "--set", "model.d_model=32", "--set", "train.seq_len=16",
          "--set", "train.batch_size=4"};
}

TEST(Cli, InfoListsEveryMechanism) {
  const std::string dir = scratch("info");
  const Outcome r = run({"info"}, dir);
  EXPECT_EQ(r.status, 0) << r.output;
  for (const nn::Mechanism& m : nn::mechanisms()) {
    EXPECT_NE(r.output.find("  " + m.name + ": "), std::string::npos) << r.output;
  }
  EXPECT_NE(r.output.find("LibTorch:"), std::string::npos) << r.output;
  winnow::train::remove_tree(dir);
}

TEST(Cli, TrainsWithOverridesThenResumes) {
  const std::string dir = scratch("train");
  std::vector<std::string> args = small_run("stick_breaking", dir + "/out");
  args.insert(args.end(), {"--set", "train.steps=4", "--set", "train.log_every=2"});
  Outcome r = run(args, dir);
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_NE(r.output.find("step 4/4"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("tok/s | ETA"), std::string::npos) << r.output;
  EXPECT_EQ(train::read_checkpoint(train::latest_checkpoint(dir + "/out/checkpoints")).step, 4);
  // The same command with more steps continues from the checkpoint.
  args.insert(args.end(), {"--set", "train.steps=6"});
  r = run(args, dir);
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_NE(r.output.find("resumed from"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("at step 4"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("step 6/6"), std::string::npos) << r.output;
  // --fresh starts over.
  args.push_back("--fresh");
  r = run(args, dir);
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_EQ(r.output.find("resumed from"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("step 2/6"), std::string::npos) << r.output;
  winnow::train::remove_tree(dir);
}

TEST(Cli, PrintConfigShowsEveryResolvedKey) {
  const std::string dir = scratch("print");
  const Outcome r = run({"train", "--config", config_file("stick_breaking_rb_gn"), "--print-config"}, dir);
  ASSERT_EQ(r.status, 0) << r.output;
  const nlohmann::json j = nlohmann::json::parse(r.output);
  EXPECT_EQ(j["model"]["attention"]["implementation"], "kernel");
  EXPECT_EQ(j["model"]["attention"]["remainder_bias"], true);
  EXPECT_EQ(j["model"]["context_len"], j["train"]["seq_len"]);
  winnow::train::remove_tree(dir);
}

TEST(Cli, BadInputIsAnErrorNamingTheKeyOrArgument) {
  const std::string dir = scratch("errors");
  auto expect = [&](std::vector<std::string> args, const std::string& fragment) {
    const Outcome r = run(args, dir);
    EXPECT_NE(r.status, 0) << r.output;
    EXPECT_NE(r.output.find(fragment), std::string::npos) << r.output;
    EXPECT_EQ(r.output.find("terminate"), std::string::npos) << r.output;
  };
  const std::string cfg = config_file("softmax_rope");
  expect({"train", "--config", cfg, "--set", "train.stepz=3"}, "unknown key 'train.stepz'");
  expect({"train", "--config", cfg, "--set", "model.attention.gate=g3"}, "key 'model.attention.gate'");
  expect({"train", "--config", cfg, "--set", "train.lr=fast"}, "key 'train.lr': expected a number");
  expect({"train", "--config", cfg, "--set", "oops"}, "argument '--set'");
  expect({"train", "--config", dir + "/missing.json"}, "--config");
  {
    std::ofstream(dir + "/broken.json") << "{\"seed\": 1,";
  }
  expect({"train", "--config", dir + "/broken.json"}, "is not valid JSON");
  expect({"train-bench", "--kinds", "softmax,nonsense"}, "argument '--kinds'");
  winnow::train::remove_tree(dir);
}

// Kill -9 at an arbitrary moment (possibly while a checkpoint is being written), resume, and
// compare with a run that was never interrupted.
TEST(Cli, KilledRunResumesBitIdentically) {
  const std::string dir = scratch("kill");
  const int total = 30;
  auto args = [&](const std::string& out, int steps) {
    std::vector<std::string> a = small_run("stick_breaking_rb_gn", out);
    // A constant schedule: the run length does not change the step it takes, so the killed run
    // can be asked for more steps than it will live to take.
    a.insert(a.end(), {"--set", "train.schedule=constant", "--set", "train.warmup=3", "--set",
                       "train.checkpoint_every=2", "--set", "train.eval_every=0", "--set",
                       "train.steps=" + std::to_string(steps)});
    return a;
  };
  const Outcome straight = run(args(dir + "/straight", total), dir);
  ASSERT_EQ(straight.status, 0) << straight.output;

  const fs::path log = fs::path(dir) / "killed.log";
  const pid_t pid = start(args(dir + "/resumed", 1000000), log);
  const fs::path latest = fs::path(dir) / "resumed" / "checkpoints" / "latest";
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(120);
  std::int64_t seen = 0;
  while (seen < 6 && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
    std::ifstream f(latest);
    std::string name;
    if (std::getline(f, name) && name.rfind("step_", 0) == 0) seen = std::stoll(name.substr(5));
  }
  ::kill(pid, SIGKILL);
  const Outcome killed = wait_for(pid, log);
  ASSERT_EQ(killed.status, -1) << "the run ended before it was killed:\n" << killed.output;
  ASSERT_GE(seen, 6) << killed.output;

  const Outcome resumed = run(args(dir + "/resumed", total), dir);
  ASSERT_EQ(resumed.status, 0) << resumed.output;
  ASSERT_NE(resumed.output.find("resumed from"), std::string::npos) << resumed.output;
  const auto step_pos = resumed.output.find("at step ");
  ASSERT_NE(step_pos, std::string::npos);
  const std::int64_t resumed_at = std::stoll(resumed.output.substr(step_pos + 8));
  std::printf("killed after a checkpoint of step %lld; resumed at step %lld\n",
              static_cast<long long>(seen), static_cast<long long>(resumed_at));
  EXPECT_GE(resumed_at, 6);
  EXPECT_LT(resumed_at, total) << "the killed run got too far for the comparison to test a resume";

  auto load = [&](const std::string& out) {
    const std::string folder = train::latest_checkpoint(out + "/checkpoints");
    const train::CheckpointMeta meta = train::read_checkpoint(folder);
    EXPECT_EQ(meta.step, total);
    nn::TransformerLM model(nn::read_model(meta.config["model"]));
    torch::serialize::InputArchive archive;
    archive.load_from(folder + "/model.pt");
    model->load(archive);
    return model;
  };
  nn::TransformerLM a = load(dir + "/straight"), b = load(dir + "/resumed");
  auto pa = a->named_parameters(), pb = b->named_parameters();
  ASSERT_EQ(pa.size(), pb.size());
  for (const auto& item : pa) EXPECT_TRUE(torch::equal(item.value(), pb[item.key()])) << item.key();
  winnow::train::remove_tree(dir);
}

// Data-parallel training (two processes over c10d's gloo group, as torchrun starts them) takes
// the same steps as one process up to the order of the gradient sums; only rank 0 writes; and a
// checkpoint written by two ranks resumes in one.
TEST(Cli, DataParallelTrainingMatchesOneProcessAndResumesOnAnotherWorldSize) {
  if (!train::gloo_available()) GTEST_SKIP() << "this LibTorch has no gloo process group";
  const std::string dir = scratch("ddp");
  auto args = [&](const std::string& out, int steps) {
    std::vector<std::string> a = small_run("stick_breaking", out);
    a.insert(a.end(), {"--set", "train.batch_size=8", "--set", "train.grad_accum=2", "--set",
                       "train.schedule=constant", "--set", "train.warmup=2", "--set", "train.eval_every=0",
                       "--set", "train.log_every=2", "--set", "threads=1", "--set",
                       "train.steps=" + std::to_string(steps)});
    // Small buckets: several all-reduces per step, started from the backward pass's hooks.
    a.insert(a.end(), {"--set", "train.bucket_mb=0.02"});
    return a;
  };
  auto run_ranks = [&](const std::string& out, int steps, const std::string& name) {
    std::vector<pid_t> pids;
    for (int rank = 0; rank < 2; ++rank) {
      pids.push_back(start(args(out, steps), fs::path(dir) / (name + std::to_string(rank) + ".log"),
                           {"WORLD_SIZE=2", "RANK=" + std::to_string(rank), "LOCAL_RANK=" + std::to_string(rank),
                            "WINNOW_STORE_FILE=" + dir + "/" + name + ".store"}));
    }
    std::vector<Outcome> outcomes;
    for (int rank = 0; rank < 2; ++rank) {
      outcomes.push_back(wait_for(pids[static_cast<std::size_t>(rank)],
                                  fs::path(dir) / (name + std::to_string(rank) + ".log")));
    }
    return outcomes;
  };
  const Outcome one = run(args(dir + "/one", 8), dir);
  ASSERT_EQ(one.status, 0) << one.output;
  const std::vector<Outcome> two = run_ranks(dir + "/two", 8, "two");
  ASSERT_EQ(two[0].status, 0) << two[0].output;
  ASSERT_EQ(two[1].status, 0) << two[1].output;
  EXPECT_NE(two[0].output.find("step 8/8"), std::string::npos) << two[0].output;
  EXPECT_EQ(two[1].output.find("step"), std::string::npos) << "rank 1 prints nothing:\n" << two[1].output;

  auto load = [&](const std::string& out) {
    const std::string folder = train::latest_checkpoint(out + "/checkpoints");
    const train::CheckpointMeta meta = train::read_checkpoint(folder);
    EXPECT_EQ(meta.step, 8);
    nn::TransformerLM model(nn::read_model(meta.config["model"]));
    torch::serialize::InputArchive archive;
    archive.load_from(folder + "/model.pt");
    model->load(archive);
    return model;
  };
  auto expect_close = [&](nn::TransformerLM a, nn::TransformerLM b) {
    auto pb = b->named_parameters();
    for (const auto& item : a->named_parameters()) {
      const torch::Tensor x = item.value(), y = pb[item.key()];
      EXPECT_LT(((x - y).norm() / y.norm().clamp_min(1e-12)).item<double>(), 1e-4) << item.key();
    }
  };
  expect_close(load(dir + "/two"), load(dir + "/one"));
  // One metrics log with one record per logged step, and the losses one process logged: the
  // ranks' report is summed too.
  auto logged_losses = [&](const std::string& out) {
    std::ifstream metrics(out + "/metrics.jsonl");
    std::vector<double> losses;
    for (std::string line; std::getline(metrics, line);) {
      const nlohmann::json record = nlohmann::json::parse(line);
      if (record.value("event", "") == "train") losses.push_back(record["loss"].get<double>());
    }
    return losses;
  };
  const std::vector<double> one_losses = logged_losses(dir + "/one"), two_losses = logged_losses(dir + "/two");
  ASSERT_EQ(two_losses.size(), 4u);
  ASSERT_EQ(one_losses.size(), 4u);
  for (std::size_t i = 0; i < 4; ++i) EXPECT_NEAR(two_losses[i], one_losses[i], 1e-4 * one_losses[i]) << "log " << i;

  // Two ranks for 4 steps, then one process from their checkpoint to step 8.
  const std::vector<Outcome> half = run_ranks(dir + "/switch", 4, "half");
  ASSERT_EQ(half[0].status, 0) << half[0].output;
  ASSERT_EQ(half[1].status, 0) << half[1].output;
  const Outcome rest = run(args(dir + "/switch", 8), dir);
  ASSERT_EQ(rest.status, 0) << rest.output;
  EXPECT_NE(rest.output.find("at step 4"), std::string::npos) << rest.output;
  expect_close(load(dir + "/switch"), load(dir + "/one"));

  // The same two ranks started by the tool itself.
  std::vector<std::string> launched = args(dir + "/launched", 8);
  launched.insert(launched.end(), {"--processes", "2"});
  const Outcome self = run(launched, dir);
  ASSERT_EQ(self.status, 0) << self.output;
  EXPECT_NE(self.output.find("step 8/8"), std::string::npos) << self.output;
  expect_close(load(dir + "/launched"), load(dir + "/one"));
  winnow::train::remove_tree(dir);
}

// Data-parallel settings that cannot work fail at once, naming the variable or key, before any
// rank waits for another.
TEST(Cli, DataParallelErrorsNameTheVariableOrKey) {
  const std::string dir = scratch("ddp_errors");
  const auto args = small_run("stick_breaking", dir + "/out");
  const fs::path log = fs::path(dir) / "err.log";
  Outcome r = wait_for(start(args, log, {"WORLD_SIZE=2", "RANK=5"}), log);
  EXPECT_NE(r.status, 0);
  EXPECT_NE(r.output.find("environment variable RANK: expected a rank below WORLD_SIZE = 2, got 5"),
            std::string::npos) << r.output;
  r = wait_for(start(args, log, {"WORLD_SIZE=3", "RANK=0"}), log);
  EXPECT_NE(r.status, 0);
  EXPECT_NE(r.output.find("train.batch_size"), std::string::npos) << r.output;
  // More GPUs than the machine has (this one: none visible to a CPU LibTorch, or fewer than 64).
  std::vector<std::string> gpus = args;
  gpus.insert(gpus.end(), {"--gpus", "64"});
  r = run(gpus, dir);
  EXPECT_NE(r.status, 0);
  EXPECT_NE(r.output.find("argument '--gpus': expected at most"), std::string::npos) << r.output;
  // A rank that fails stops the run, and the launcher says which.
  std::vector<std::string> odd = args;
  odd.insert(odd.end(), {"--processes", "3"});
  r = run(odd, dir);
  EXPECT_NE(r.status, 0);
  EXPECT_NE(r.output.find("exited with status"), std::string::npos) << r.output;
  winnow::train::remove_tree(dir);
}

TEST(Cli, TrainBenchMeasuresFusedAndComposed) {
  const std::string dir = scratch("bench");
  const Outcome r = run({"train-bench", "--device", "cpu", "--lengths", "16", "--tokens", "64", "--steps", "1",
                     "--warmup", "1", "--kinds", "stick_breaking,stick_breaking@composed,softmax_alibi",
                     "--json", dir + "/bench.json"},
                    dir);
  ASSERT_EQ(r.status, 0) << r.output;
  const nlohmann::json j = nlohmann::json::parse(slurp(dir + "/bench.json"));
  ASSERT_EQ(j["results"].size(), 3u) << j.dump(2);
  for (const auto& result : j["results"]) {
    EXPECT_GT(result.value("tokens_per_s", 0.0), 0) << result.dump();
    // What bench/train_baseline.py checks its PyTorch model against.
    EXPECT_EQ(result.value("parameters", 0), j["results"][0].value("parameters", -1)) << result.dump();
    EXPECT_GT(result.value("initial_loss", 0.0), 0) << result.dump();
  }
  EXPECT_EQ(j["results"][1]["implementation"], "composed");
  EXPECT_EQ(j["results"][2]["implementation"], "composed");  // ALiBi has no fused path
  ASSERT_EQ(j["fused_over_composed"].size(), 1u);
  EXPECT_EQ(j["fused_over_composed"][0]["kind"], "stick_breaking");
  winnow::train::remove_tree(dir);
}

// GSA's three rows of studies/lm.json as train-bench kinds (a step with selection, sparse
// attention and the indexer's loss; one without the indexer).
TEST(Cli, TrainBenchRunsTheGsaKinds) {
  const std::string dir = scratch("bench-gsa");
  const Outcome r = run({"train-bench", "--device", "cpu", "--lengths", "16", "--tokens", "64", "--steps", "1",
                         "--warmup", "1", "--kinds", "gsa,gsa_sparse_only,gsa_gated_only", "--json",
                         dir + "/bench.json"},
                        dir);
  ASSERT_EQ(r.status, 0) << r.output;
  const nlohmann::json j = nlohmann::json::parse(slurp(dir + "/bench.json"));
  ASSERT_EQ(j["results"].size(), 3u) << j.dump(2);
  for (const auto& result : j["results"]) {
    EXPECT_FALSE(result.contains("error")) << result.dump();
    EXPECT_GT(result.value("tokens_per_s", 0.0), 0) << result.dump();
    EXPECT_GT(result.value("initial_loss", 0.0), 0) << result.dump();
  }
  // The gated-only kind has no indexer: fewer parameters than the full GSA layer.
  EXPECT_LT(j["results"][2].value("parameters", 0), j["results"][0].value("parameters", 0)) << j.dump(2);
  winnow::train::remove_tree(dir);
}


std::string study_file(const std::string& name) {
  return (fs::path(WINNOW_SOURCE_DIR) / "studies" / (name + ".json")).string();
}

// The shipped study file at a tiny size: its CPU profile, then smaller still.
std::vector<std::string> tiny_study(const std::string& name, const std::string& out_dir) {
  return {"study", study_file(name), "--quiet", "--set", "base.device=cpu", "--set",
          "base.model.d_model=32", "--set", "base.train.steps=3", "--set",
          "base.train.batch_size=4", "--set", "base.train.warmup=1", "--set",
          "eval.instances=3", "--set", "out_dir=" + out_dir};
}

TEST(Cli, MqrarStudyRunsEndToEndThenEvalAndPlot) {
  const std::string dir = scratch("study");
  std::vector<std::string> args = tiny_study("mqrar", dir + "/out");
  args.insert(args.end(), {"--set", "eval.multiples=[1,4]"});
  Outcome r = run(args, dir);
  ASSERT_EQ(r.status, 0) << r.output;
  const nlohmann::json result = nlohmann::json::parse(slurp(dir + "/out/result.json"));
  EXPECT_EQ(result["profile"], "cpu");
  ASSERT_EQ(result["mechanisms"].size(), 6u);
  for (const auto& m : result["mechanisms"]) {
    ASSERT_EQ(m["results"].size(), 2u);
    EXPECT_EQ(m["results"][1]["length"], 256);
    for (const auto& p : m["results"]) {
      EXPECT_GE(p["accuracy"].get<double>(), 0.0);
      EXPECT_LE(p["accuracy"].get<double>(), 1.0);
      EXPECT_EQ(p["instances"], 3);
      EXPECT_TRUE(p.contains("diagnostics"));
    }
  }
  const std::string table = slurp(dir + "/out/table.md");
  EXPECT_NE(table.find("| mechanism | ID (64) | 4x (256) |"), std::string::npos) << table;
  EXPECT_NE(table.find("| Stick-breaking |"), std::string::npos) << table;
  EXPECT_NE(table.find("| alpha-Entmax+RoPE (YaRN 16) |"), std::string::npos) << table;
  EXPECT_NE(table.find("| Sieve |"), std::string::npos) << table;
  EXPECT_NE(table.find("| zero fraction | support | max support | remainder |"), std::string::npos)
      << table;
  EXPECT_NE(r.output.find("| Softmax+RoPE |"), std::string::npos) << "the table is printed";
  EXPECT_EQ(fs::exists(dir + "/out/accuracy.svg"), study::can_plot());

  // Running it again continues from the finished runs: no training, the same instances.
  r = run(args, dir);
  ASSERT_EQ(r.status, 0) << r.output;
  const nlohmann::json again = nlohmann::json::parse(slurp(dir + "/out/result.json"));
  EXPECT_EQ(again["mechanisms"][3]["resumed_at_step"], 3);
  EXPECT_EQ(again["mechanisms"][3]["results"], result["mechanisms"][3]["results"]);

  r = run({"eval", "--checkpoint", dir + "/out/stick_breaking", "--lengths", "64,128",
           "--instances", "4", "--diagnostics", "--position-loss", "2"},
          dir);
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_NE(r.output.find("L =     64: accuracy"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("L =    128: accuracy"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("remainder ["), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("support_max ["), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("loss by position (nats): [0,31)"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("(ppl "), std::string::npos) << r.output;

  if (study::can_plot()) {
    r = run({"plot", dir + "/out/result.json", "--out", dir + "/again.svg"}, dir);
    ASSERT_EQ(r.status, 0) << r.output;
    EXPECT_NE(slurp(dir + "/again.svg").find("<svg"), std::string::npos);
  }
  winnow::train::remove_tree(dir);
}

// `winnow study --processes 2`: both ranks train every selected mechanism together, rank 0 alone
// prints and writes, and the trained models match one process's up to the order of the sums.
TEST(Cli, DataParallelStudyMatchesOneProcess) {
  if (!train::gloo_available()) GTEST_SKIP() << "this LibTorch has no gloo process group";
  const std::string dir = scratch("study_ddp");
  auto args = [&](const std::string& out) {
    std::vector<std::string> a = tiny_study("mqrar", dir + "/" + out);
    a.erase(std::find(a.begin(), a.end(), "--quiet"));  // the progress lines are checked below
    a.insert(a.end(), {"--set", "base.train.log_every=1", "--set", "eval.multiples=[1,2]", "--set",
                       "base.threads=1", "--only", "Stick-breaking", "Softmax+RoPE"});
    return a;
  };
  const Outcome one = run(args("one"), dir);
  ASSERT_EQ(one.status, 0) << one.output;
  std::vector<std::string> two_args = args("two");
  two_args.insert(two_args.begin() + 1, {"--processes", "2"});
  const Outcome two = run(two_args, dir);
  ASSERT_EQ(two.status, 0) << two.output;
  auto count = [](const std::string& text, const std::string& what) {
    std::size_t n = 0;
    for (std::size_t at = text.find(what); at != std::string::npos; at = text.find(what, at + 1)) ++n;
    return n;
  };
  EXPECT_EQ(count(two.output, "\n== ["), 2u) << "one voice:\n" << two.output;
  EXPECT_EQ(count(two.output, "step 3/3"), 2u) << two.output;
  const nlohmann::json a = nlohmann::json::parse(slurp(dir + "/one/result.json"));
  const nlohmann::json b = nlohmann::json::parse(slurp(dir + "/two/result.json"));
  EXPECT_EQ(a["data_parallel_ranks"], 1);
  EXPECT_EQ(b["data_parallel_ranks"], 2);
  ASSERT_EQ(b["mechanisms"].size(), 2u);
  for (std::size_t m = 0; m < 2; ++m) {
    const double la = a["mechanisms"][m]["final_eval"]["eval_loss"].get<double>();
    const double lb = b["mechanisms"][m]["final_eval"]["eval_loss"].get<double>();
    EXPECT_NEAR(lb, la, 1e-4 * std::abs(la)) << b["mechanisms"][m]["label"];
  }
  winnow::train::remove_tree(dir);
}

// A mechanism evaluated with model keys changed for inference only: ABCDigits' Multiscreen row
// trains as configured and is evaluated with screening-window expansion at the training length,
// on the trained weights.
TEST(Cli, StudyEvaluatesWithEvalSetOnTheTrainedWeights) {
  const std::string dir = scratch("study_eval_set");
  std::vector<std::string> args = tiny_study("abcdigits", dir + "/out");
  args.insert(args.end(), {"--set", "eval.multiples=[1,2]", "--set", "eval.depths=[0.5]", "--only", "Multiscreen",
                           "--set", "eval.latency_lengths=[16,40]", "--set", "eval.latency_repeats=3"});
  Outcome r = run(args, dir);
  ASSERT_EQ(r.status, 0) << r.output;
  const nlohmann::json result = nlohmann::json::parse(slurp(dir + "/out/result.json"));
  ASSERT_EQ(result["mechanisms"].size(), 1u);
  const nlohmann::json& m = result["mechanisms"][0];
  EXPECT_EQ(m["config"]["model"]["architecture"], "multiscreen");
  EXPECT_EQ(m["config"]["model"]["multiscreen"]["window_expansion"], 0.0);
  EXPECT_EQ(m["eval_set"]["model.multiscreen.window_expansion"], 1024);
  ASSERT_EQ(m["results"].size(), 2u);
  EXPECT_NE(r.output.find("multiscreen (8 tiles"), std::string::npos) << r.output;
  // 001 figure 8's full-context forward latency, of the evaluated model, at the asked lengths.
  ASSERT_EQ(m["latency"].size(), 2u);
  for (std::size_t i = 0; i < 2; ++i) {
    EXPECT_EQ(m["latency"][i]["length"], i == 0 ? 16 : 40);
    EXPECT_GT(m["latency"][i]["min_ms"].get<double>(), 0.0);
    EXPECT_GE(m["latency"][i]["median_ms"].get<double>(), m["latency"][i]["min_ms"].get<double>());
  }
  EXPECT_NE(slurp(dir + "/out/table.md").find("| Multiscreen |"), std::string::npos);
  EXPECT_NE(slurp(dir + "/out/table.md").find("Full-context forward latency"), std::string::npos);
  if (study::can_plot()) EXPECT_NE(slurp(dir + "/out/latency.svg").find("<svg"), std::string::npos);
  args = tiny_study("abcdigits", dir + "/bad");
  args.insert(args.end(), {"--set", "eval.latency_lengths=[16,0]", "--only", "Multiscreen"});
  r = run(args, dir);
  EXPECT_NE(r.status, 0);
  EXPECT_NE(r.output.find("eval.latency_lengths"), std::string::npos) << r.output;
  // eval_set takes model keys only.
  args = tiny_study("abcdigits", dir + "/bad");
  args.insert(args.end(), {"--set", "mechanisms[5].eval_set={\"train.lr\":1}", "--only", "Multiscreen"});
  r = run(args, dir);
  EXPECT_NE(r.status, 0);
  EXPECT_NE(r.output.find("eval_set: expected keys of the model"), std::string::npos) << r.output;
  winnow::train::remove_tree(dir);
}

// eval.select_multiple (000's checkpoint chosen at 8x): every kept checkpoint is scored at the
// selection length, the best one (the later on a tie) is chosen, and the evaluation reports that
// checkpoint's weights: `winnow eval` on it gives the same numbers.
TEST(Cli, StudyEvaluatesTheCheckpointChosenAtTheSelectionLength) {
  const std::string dir = scratch("study_select");
  std::vector<std::string> args = tiny_study("mqrar", dir + "/out");
  args.insert(args.end(), {"--only", "Stick-breaking", "--set", "base.train.steps=6", "--set",
                           "base.train.checkpoint_every=2", "--set", "base.train.keep_checkpoints=0",
                           "--set", "eval.multiples=[1]", "--set", "eval.diagnostics=false", "--set",
                           "eval.select_multiple=2", "--set", "eval.select_instances=8",
                           // Four keys and values and a high rate: the checkpoints' accuracies
                           // differ, and not in the order of their steps.
                           "--set", "base.task.mqrar.keys=4", "--set", "base.task.mqrar.values=4",
                           "--set", "base.train.lr=0.03"});
  Outcome r = run(args, dir);
  ASSERT_EQ(r.status, 0) << r.output;
  const nlohmann::json result = nlohmann::json::parse(slurp(dir + "/out/result.json"));
  ASSERT_EQ(result["mechanisms"].size(), 1u);
  const nlohmann::json& m = result["mechanisms"][0];
  const nlohmann::json& sel = m["selection"];
  EXPECT_EQ(sel["multiple"], 2);
  EXPECT_EQ(sel["length"], 128);
  EXPECT_EQ(sel["instances"], 8);
  ASSERT_EQ(sel["checkpoints"].size(), 3u);
  double best = -1;
  long long want = 0;
  for (std::size_t i = 0; i < 3; ++i) {
    EXPECT_EQ(sel["checkpoints"][i]["step"], 2 * static_cast<long long>(i + 1));
    const double a = sel["checkpoints"][i]["accuracy"].get<double>();
    if (a >= best) {
      best = a;
      want = sel["checkpoints"][i]["step"].get<long long>();
    }
  }
  EXPECT_EQ(sel["chosen_step"], want);
  // The fixture's draw chooses an earlier checkpoint than the last, so that evaluating the final
  // weights instead would show below.
  EXPECT_LT(want, 6) << sel.dump();
  char step[32];
  std::snprintf(step, sizeof step, "step_%08lld", want);
  r = run({"eval", "--checkpoint", dir + "/out/stick_breaking/checkpoints/" + step, "--lengths", "64",
           "--instances", "3", "--json", dir + "/chosen.json"},
          dir);
  ASSERT_EQ(r.status, 0) << r.output;
  const nlohmann::json chosen = nlohmann::json::parse(slurp(dir + "/chosen.json"));
  EXPECT_EQ(chosen["results"][0]["loss"], m["results"][0]["loss"]);
  EXPECT_EQ(chosen["results"][0]["accuracy"], m["results"][0]["accuracy"]);
  EXPECT_NE(slurp(dir + "/out/table.md").find("| Stick-breaking | 2x (128) | " + std::to_string(want) + " |"),
            std::string::npos)
      << slurp(dir + "/out/table.md");
  winnow::train::remove_tree(dir);
}

// `winnow plot` on a GPU benchmark's JSON (000's figure 4 left): tokens/s against length,
// rows that failed (no tokens/s) left out; a row without its length is an error naming it.
TEST(Cli, PlotDrawsABenchmarksThroughput) {
  const std::string dir = scratch("plot_bench");
  const nlohmann::json bench = {
      {"device", "test"},
      {"results",
       {{{"method", "sdpa_flash"}, {"L", 1024}, {"inference_tokens_per_s", 5.7e7}, {"training_tokens_per_s", 1.5e7}},
        {{"method", "winnow_sieve_bound"}, {"L", 1024}, {"inference_tokens_per_s", 3.5e7}, {"training_tokens_per_s", 1.1e7}},
        {{"method", "sdpa_flash"}, {"L", 4096}, {"inference_tokens_per_s", 1.4e7}, {"training_tokens_per_s", 5.8e6}},
        {{"method", "winnow_sieve_bound"}, {"L", 4096}, {"inference_tokens_per_s", 1.4e7}, {"training_tokens_per_s", 4.3e6}},
        {{"method", "composed_sieve"}, {"L", 4096}, {"error", "OutOfMemoryError"}}}}};
  std::ofstream(dir + "/bench.json") << bench.dump();
  Outcome r = run({"plot", dir + "/bench.json"}, dir);
  if (study::can_plot()) {
    ASSERT_EQ(r.status, 0) << r.output;
    EXPECT_NE(slurp(dir + "/throughput.svg").find("<svg"), std::string::npos);
  } else {
    EXPECT_NE(r.status, 0);
    EXPECT_NE(r.output.find("no PLplot"), std::string::npos) << r.output;
  }
  nlohmann::json bad = bench;
  bad["results"][1].erase("L");
  std::ofstream(dir + "/bad.json") << bad.dump();
  r = run({"plot", dir + "/bad.json"}, dir);
  EXPECT_NE(r.status, 0);
  if (study::can_plot()) EXPECT_NE(r.output.find("positive \"L\""), std::string::npos) << r.output;
  r = run({"plot", dir + "/bench.json", "--out", dir + "/x.svg", "--extra"}, dir);
  EXPECT_NE(r.status, 0);
  winnow::train::remove_tree(dir);
}

TEST(Cli, GenerativeStudiesRunEndToEnd) {
  for (const std::string name : {"passkey", "abcdigits"}) {
    const std::string dir = scratch("study_" + name);
    std::vector<std::string> args = tiny_study(name, dir + "/out");
    args.insert(args.end(), {"--set", "eval.multiples=[1,2]", "--set", "eval.depths=[0,0.5]",
                             "--only", "Stick-breaking", "--only", "Softmax+RoPE"});
    const Outcome r = run(args, dir);
    ASSERT_EQ(r.status, 0) << r.output;
    const nlohmann::json result = nlohmann::json::parse(slurp(dir + "/out/result.json"));
    EXPECT_TRUE(result["generative"].get<bool>());
    ASSERT_EQ(result["mechanisms"].size(), 2u) << name;
    for (const auto& m : result["mechanisms"]) {
      ASSERT_EQ(m["results"].size(), 2u);
      ASSERT_EQ(m["results"][0]["cells"].size(), 2u);
      EXPECT_EQ(m["results"][0]["cells"][1]["instances"], 3);
    }
    EXPECT_NE(slurp(dir + "/out/table.md").find("by length and depth"), std::string::npos);
    const std::string run_dir = dir + "/out/stick_breaking";
    Outcome e = run({"eval", "--checkpoint", run_dir, "--multiples", "1", "--instances", "2",
                     "--depths", "0.5"},
                    dir);
    ASSERT_EQ(e.status, 0) << e.output;
    EXPECT_NE(e.output.find("depth 0.50:"), std::string::npos) << e.output;
    e = run({"eval", "--checkpoint", run_dir, "--diagnostics"}, dir);
    EXPECT_NE(e.status, 0);
    EXPECT_NE(e.output.find("argument '--diagnostics'"), std::string::npos) << e.output;
    winnow::train::remove_tree(dir);
  }
}

// The language-modeling study on a made-up corpus (the real one is `make corpus`'s): trains,
// evaluates loss and accuracy at every length with per-head diagnostics, reports bits per
// byte, and resumes.
// A small corpus in dir/corpus: a sentence repeated.
void write_corpus(const std::string& dir) {
  fs::create_directories(dir + "/corpus");
  std::ofstream train(dir + "/corpus/train.bin", std::ios::binary);
  std::ofstream val(dir + "/corpus/val.bin", std::ios::binary);
  const std::string text = "The quick brown fox jumps over the lazy dog.\n";
  for (int i = 0; i < 400; ++i) train << text;
  for (int i = 0; i < 40; ++i) val << text;
}

TEST(Cli, LanguageModelingStudyRunsEndToEnd) {
  const std::string dir = scratch("study_lm");
  write_corpus(dir);
  std::vector<std::string> args = tiny_study("lm", dir + "/out");
  args.insert(args.end(), {"--set", "base.task.corpus.dir=" + dir + "/corpus", "--set",
                           "eval.multiples=[1,2]"});
  Outcome r = run(args, dir);
  ASSERT_EQ(r.status, 0) << r.output;
  const nlohmann::json result = nlohmann::json::parse(slurp(dir + "/out/result.json"));
  ASSERT_EQ(result["mechanisms"].size(), 11u);
  for (const auto& m : result["mechanisms"]) {
    // Multiscreen has no softmax-like attention layers for the probe to read.
    const bool probed = m["config"]["model"]["architecture"] == "transformer";
    ASSERT_EQ(m["results"].size(), 2u);
    EXPECT_EQ(m["results"][1]["length"], 128);
    for (const char* key : {"spikes", "max_loss_ratio", "max_activation"}) {
      EXPECT_TRUE(m["health"].contains(key)) << key;
    }
    EXPECT_GT(m["health"]["max_activation"].get<double>(), 0.0);
    EXPECT_TRUE(m["final_eval"].contains("max_activation_by_layer"));
    for (const auto& p : m["results"]) {
      EXPECT_GT(p["loss"].get<double>(), 0.0);
      EXPECT_EQ(p["scored_positions"].get<double>(), 3.0 * p["length"].get<double>());
      ASSERT_EQ(p.contains("diagnostics"), probed) << m["label"];
      if (probed) {
        const auto& mean = p["diagnostics"]["mean"];
        EXPECT_NEAR(mean["sink_ratio"].get<double>() / mean["first_token_share"].get<double>(),
                    p["length"].get<double>() - 8, 8.0)  // the probed rows see L - 16 .. L keys
            << m["label"];
      }
      // The loss by position: 8 bins per training length, every labelled position counted
      // once, and their weighted mean the sequence loss.
      const auto& pl = p["position_loss"];
      const std::size_t bins = 8 * static_cast<std::size_t>(p["multiple"].get<int>());
      ASSERT_EQ(pl["loss"].size(), bins);
      double tokens = 0, nll = 0;
      for (std::size_t i = 0; i < bins; ++i) {
        tokens += pl["tokens"][i].get<double>();
        nll += pl["tokens"][i].get<double>() * pl["loss"][i].get<double>();
      }
      EXPECT_EQ(tokens, p["scored_positions"].get<double>());
      EXPECT_NEAR(nll / tokens, p["loss"].get<double>(), 1e-6);  // float32 sums, summed apart
      EXPECT_EQ(pl["end"][bins - 1], p["length"]);
    }
  }
  const std::string table = slurp(dir + "/out/table.md");
  EXPECT_NE(table.find("next-byte accuracy (%)"), std::string::npos) << table;
  EXPECT_NE(table.find("bits per byte"), std::string::npos) << table;
  EXPECT_EQ(table.find("exact match per sequence"), std::string::npos) << table;
  EXPECT_NE(table.find("| Differential softmax |"), std::string::npos) << table;
  EXPECT_NE(table.find("| Softmax+RoPE (QK-norm) |"), std::string::npos) << table;
  EXPECT_NE(table.find("| TDA |"), std::string::npos) << table;
  EXPECT_NE(table.find("| Multiscreen |"), std::string::npos) << table;
  EXPECT_NE(table.find("by position at L = 128"), std::string::npos) << table;
  EXPECT_NE(table.find("| mechanism | 0-64 | 64-128 |"), std::string::npos) << table;
  EXPECT_NE(table.find("| loss spikes | max activation |"), std::string::npos) << table;
  EXPECT_NE(table.find("first token"), std::string::npos) << table;
  if (study::can_plot()) {
    for (const char* plot : {"accuracy.svg", "loss_by_position.svg", "sink_ratio.svg"}) {
      EXPECT_GT(fs::file_size(fs::path(dir) / "out" / plot), 1000u) << plot;
    }
  }
  r = run(args, dir);
  ASSERT_EQ(r.status, 0) << r.output;
  const nlohmann::json again = nlohmann::json::parse(slurp(dir + "/out/result.json"));
  EXPECT_EQ(again["mechanisms"][0]["resumed_at_step"], 3);
  EXPECT_EQ(again["mechanisms"][0]["results"], result["mechanisms"][0]["results"]);

  // Sampling text from one of the trained models.
  const std::string run_dir = dir + "/out/softmax_rope";
  r = run({"generate", "--checkpoint", run_dir, "--prompt", "The quick", "--tokens", "20",
           "--seed", "3", "--samples", "2", "--json", dir + "/samples.json"},
          dir);
  ASSERT_EQ(r.status, 0) << r.output;
  const nlohmann::json samples = nlohmann::json::parse(slurp(dir + "/samples.json"));
  ASSERT_EQ(samples["samples"].size(), 2u);
  EXPECT_EQ(samples["prompt"], "The quick");
  ASSERT_EQ(samples["sample_tokens"][0].size(), 20u);
  EXPECT_NE(r.output.find("The quick"), std::string::npos) << r.output;
  const Outcome same = run({"generate", "--checkpoint", run_dir, "--prompt", "The quick",
                            "--tokens", "20", "--seed", "3", "--samples", "2", "--json",
                            dir + "/again.json"},
                           dir);
  ASSERT_EQ(same.status, 0) << same.output;
  EXPECT_EQ(nlohmann::json::parse(slurp(dir + "/again.json"))["sample_tokens"], samples["sample_tokens"]);
  r = run({"generate", "--checkpoint", run_dir, "--temperature", "0", "--prompt", ""}, dir);
  EXPECT_EQ(r.status, 2) << r.output;
  EXPECT_NE(r.output.find("argument '--prompt'"), std::string::npos) << r.output;
}

TEST(Cli, GenerateRefusesModelsNotTrainedOnText) {
  const std::string dir = scratch("generate_progression");
  Outcome r = run({"train", "--config", config_file("softmax_rope"), "--set", "device=cpu",
                   "--set", "train.out_dir=" + dir + "/run", "--set", "train.steps=1", "--set",
                   "model.d_model=32", "--set", "train.seq_len=16", "--set",
                   "train.batch_size=2"},
                  dir);
  ASSERT_EQ(r.status, 0) << r.output;
  r = run({"generate", "--checkpoint", dir + "/run", "--prompt", "abc"}, dir);
  EXPECT_EQ(r.status, 2) << r.output;
  EXPECT_NE(r.output.find("expected a model trained on text"), std::string::npos) << r.output;
}

// The learning-rate sweep: every mechanism at every value; a rate that blows up is marked
// diverged with its step, is not retrained on a rerun, and the report and plot show it.
TEST(Cli, LearningRateSweepMarksDivergedRuns) {
  const std::string dir = scratch("sweep");
  write_corpus(dir);
  std::vector<std::string> args = tiny_study("lm", dir + "/out");
  args.insert(args.end(), {"--set", "base.task.corpus.dir=" + dir + "/corpus", "--set",
                           "base.train.steps=6", "--set", "base.train.clip=0", "--only",
                           "Softmax+RoPE", "Stick-breaking", "--sweep", "train.lr=1e-3,1e5"});
  Outcome r = run(args, dir);
  ASSERT_EQ(r.status, 0) << r.output;
  const nlohmann::json result = nlohmann::json::parse(slurp(dir + "/out/sweep_train_lr.json"));
  EXPECT_EQ(result["sweep"]["key"], "train.lr");
  ASSERT_EQ(result["mechanisms"].size(), 2u);
  for (const auto& m : result["mechanisms"]) {
    ASSERT_EQ(m["runs"].size(), 2u);
    const auto& fine = m["runs"][0];
    EXPECT_EQ(fine["value"], 1e-3);
    EXPECT_FALSE(fine["diverged"].get<bool>()) << fine.dump();
    EXPECT_LT(fine["final_loss"].get<double>(), std::log(256.0));
    const auto& blown = m["runs"][1];
    EXPECT_TRUE(blown["diverged"].get<bool>()) << blown.dump();
    EXPECT_TRUE(blown.contains("why")) << blown.dump();
  }
  const std::string table = slurp(dir + "/out/sweep_train_lr.md");
  EXPECT_NE(table.find("sweep of train.lr"), std::string::npos) << table;
  EXPECT_NE(table.find("diverged"), std::string::npos) << table;
  if (study::can_plot()) EXPECT_GT(fs::file_size(fs::path(dir) / "out" / "sweep_train_lr.svg"), 1000u);
  EXPECT_FALSE(fs::exists(fs::path(dir) / "out" / "result.json"));
  // A rerun resumes the finished runs and takes the diverged ones' records as they are.
  r = run(args, dir);
  ASSERT_EQ(r.status, 0) << r.output;
  const nlohmann::json again = nlohmann::json::parse(slurp(dir + "/out/sweep_train_lr.json"));
  for (std::size_t i = 0; i < 2; ++i) {
    EXPECT_EQ(again["mechanisms"][i]["runs"][0]["final_loss"], result["mechanisms"][i]["runs"][0]["final_loss"]);
    EXPECT_EQ(again["mechanisms"][i]["runs"][1]["diverged"], true);
  }
  r = run({"study", study_file("lm"), "--set", "base.device=cpu", "--set",
           "base.task.corpus.dir=" + dir + "/corpus", "--sweep", "train.lr"},
          dir);
  EXPECT_EQ(r.status, 2) << r.output;
  EXPECT_NE(r.output.find("argument '--sweep'"), std::string::npos) << r.output;
  r = run({"study", study_file("lm"), "--set", "base.device=cpu", "--set",
           "base.task.corpus.dir=" + dir + "/corpus", "--sweep", "train.lrr=1e-3"},
          dir);
  EXPECT_NE(r.status, 0) << r.output;
  EXPECT_NE(r.output.find("lrr"), std::string::npos) << r.output;
}

// Every shipped study file reads and checks (each mechanism's experiment config, every
// evaluation length) under both profiles, without training.
TEST(Cli, EveryShippedStudyFileLoads) {
  // The language-modeling study opens its corpus (make corpus builds the real one; a fresh
  // clone has none): a small one stands in, for every file alike.
  const std::string corpus = scratch("study_load_corpus");
  for (const char* split : {"train.bin", "val.bin"}) {
    std::ofstream out(corpus + "/" + split, std::ios::binary);
    for (int i = 0; i < 100000; ++i) out.put(static_cast<char>('a' + i % 26));
  }
  std::size_t files = 0;
  for (const auto& entry : fs::directory_iterator(fs::path(WINNOW_SOURCE_DIR) / "studies")) {
    if (entry.path().extension() != ".json") continue;
    ++files;
    for (const char* device : {"cpu", "cuda"}) {
      try {
        const study::Study s =
            study::load_study(entry.path().string(), {std::string("base.device=") + device,
                                                      "base.task.corpus.dir=" + corpus});
        EXPECT_FALSE(s.mechanisms.empty()) << entry.path();
      } catch (const std::exception& e) {
        ADD_FAILURE() << entry.path() << " (" << device << "): " << e.what();
      }
    }
  }
  EXPECT_GE(files, 5u);
}

TEST(Cli, StudyErrorsNameTheMechanismAndKey) {
  const std::string dir = scratch("study_errors");
  std::vector<std::string> args = tiny_study("mqrar", dir + "/out");
  args.insert(args.end(), {"--set", "mechanisms[1].set={\"model.attention.colour\":1}"});
  Outcome r = run(args, dir);
  EXPECT_NE(r.status, 0);
  EXPECT_NE(r.output.find("mechanism 'Softmax+RoPE (YaRN 16)'"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("colour"), std::string::npos) << r.output;
  // A key reached through a mechanism's set by path lands nested beside the set's flat keys.
  r = run({"study", study_file("mqrar"), "--set", "mechanisms[5].set.model.attention.filter=exact", "--print"}, dir);
  EXPECT_NE(r.status, 0);
  EXPECT_NE(r.output.find("key 'model.attention.filter' is given twice"), std::string::npos) << r.output;
  r = run({"study", study_file("mqrar"), "--set", "mechanisms[5].set.model.attention.eps=3", "--print"}, dir);
  EXPECT_EQ(r.status, 0) << r.output;
  r = run({"study", study_file("mqrar"), "--only", "Softmax"}, dir);
  EXPECT_NE(r.status, 0);
  EXPECT_NE(r.output.find("argument '--only'"), std::string::npos) << r.output;
  r = run({"study", study_file("mqrar"), "--set", "eval.multiples=[1,0]"}, dir);
  EXPECT_NE(r.output.find("eval.multiples[1]"), std::string::npos) << r.output;
  // A length the task cannot fill is caught before any training.
  r = run({"study", study_file("mqrar"), "--set", "base.train.seq_len=63"}, dir);
  EXPECT_NE(r.status, 0);
  EXPECT_NE(r.output.find("length: expected an even number"), std::string::npos) << r.output;
  EXPECT_EQ(r.output.find("== [1/"), std::string::npos) << r.output;
  winnow::train::remove_tree(dir);
}

}  // namespace
}  // namespace winnow
