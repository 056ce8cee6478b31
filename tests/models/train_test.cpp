// Training on the CPU: a 2-layer d = 256 model of every layer kind, from the example configs in
// configs/toy/, learns the toy task below a stated loss; schedules, learning-rate groups,
// gradient accumulation, phases and auxiliary losses do what they say; checkpoints resume
// bit-identically and refuse corrupt or mismatched state with errors naming the problem;
// experiment files and overrides are checked key by key.
#include <gtest/gtest.h>
#include <torch/torch.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <chrono>
#include <functional>
#include <limits>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "models/trainer_test_support.h"
#include "support/expect_error.h"
#include "train/checkpoint.h"
#include "train/files.h"
#include "train/config.h"
#include "train/trainer.h"
#include "winnow/error.h"

namespace winnow::train {
namespace {
namespace fs = std::filesystem;
using torch::Tensor;

nlohmann::json read_json(const fs::path& path) {
  std::ifstream f(path);
  return nlohmann::json::parse(f);
}

using winnow::testing::expect_error;

// ------------------------------------------------------------------ the toy task, every kind

// The stated bound: held-out cross entropy from about ln 16 = 2.77 nats at initialization to
// below 0.25 after the config's steps (150; 250 for NoPE, which has to infer positions from
// causality alone).
constexpr double kLossBound = 0.25;

const std::vector<std::string>& toy_configs() {
  static const std::vector<std::string> names = {
      "softmax_rope", "softmax_nope",  "softmax_alibi",  "softmax_yarn",         "ssmax",
      "gated",        "differential", "stick_breaking", "stick_breaking_rb_gn", "entmax_rope",
      "sieve"};
  return names;
}

class Toy : public ::testing::TestWithParam<std::string> {};

TEST_P(Toy, TwoLayerD256ModelLearnsBelowTheBound) {
  const fs::path file = fs::path(WINNOW_SOURCE_DIR) / "configs" / "toy" / (GetParam() + ".json");
  const ExperimentConfig c =
      load_experiment(file.string(), {"device=cpu", "train.out_dir=" + scratch("toy_" + GetParam())});
  ASSERT_EQ(c.model.layers, 2);
  ASSERT_EQ(c.model.d_model, 256);
  Trainer trainer(c);
  trainer.quiet = true;
  const double before = trainer.evaluate()["eval_loss"].get<double>();
  const auto start = std::chrono::steady_clock::now();
  const nlohmann::json after = trainer.train();
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  std::printf("%s: eval loss %.3f -> %.4f (accuracy %.3f) in %lld steps, %.1f s\n", GetParam().c_str(),
              before, after["eval_loss"].get<double>(), after["eval_accuracy"].get<double>(),
              static_cast<long long>(c.train.steps), seconds);
  EXPECT_GT(before, 2.5);
  EXPECT_LT(after["eval_loss"].get<double>(), kLossBound) << after.dump();
  winnow::train::remove_tree(c.train.out_dir);
}

INSTANTIATE_TEST_SUITE_P(Configs, Toy, ::testing::ValuesIn(toy_configs()),
                         [](const ::testing::TestParamInfo<std::string>& info) { return info.param; });

// Every shipped example is one of the configs the test above trains.
TEST(Toy, EveryExampleConfigIsTrainedByTheTest) {
  for (const auto& entry : fs::directory_iterator(fs::path(WINNOW_SOURCE_DIR) / "configs" / "toy")) {
    const std::string name = entry.path().stem().string();
    EXPECT_NE(std::find(toy_configs().begin(), toy_configs().end(), name), toy_configs().end()) << name;
  }
}

// ------------------------------------------------------------------ small runs

ExperimentConfig small(const std::string& out_dir, const std::string& kind = "stick_breaking") {
  nlohmann::json j = {
      {"seed", 7},
      {"device", "cpu"},
      {"model", {{"d_model", 32}, {"layers", 2}, {"attention", {{"kind", kind}, {"heads", 2}}}}},
      {"train",
       {{"steps", 6}, {"batch_size", 8}, {"grad_accum", 2}, {"seq_len", 16}, {"lr", 3e-3},
        {"warmup", 2}, {"clip", 1.0}, {"log_every", 2}, {"eval_batches", 1}, {"out_dir", out_dir}}},
      {"task", {{"name", "progression"}, {"vocab_size", 12}}},
  };
  return parse_experiment(j);
}

// The Multiscreen architecture through the same trainer: a few steps on the CPU, a finite loss,
// parameters moved, and the log line naming the architecture.
TEST(SmallRuns, MultiscreenArchitectureTrains) {
  ExperimentConfig c = small(scratch("multiscreen"));
  c.model.architecture = "multiscreen";
  c.model.multiscreen.tiles = 2;
  c.train.weight_decay = 0.0;
  c.train.clip = 0.0;
  Trainer t(c);
  t.quiet = true;
  EXPECT_EQ(nn::describe(t.model()->config()), "multiscreen (2 tiles of d_K 16 / d_V 64, kernel)");
  const Tensor before = t.model()->named_parameters()["layer0.input_projection"].detach().clone();
  const nlohmann::json after = t.train();
  EXPECT_TRUE(std::isfinite(after["eval_loss"].get<double>())) << after.dump();
  EXPECT_FALSE(torch::equal(before, t.model()->named_parameters()["layer0.input_projection"]));
  winnow::train::remove_tree(c.train.out_dir);
}

Trainer quiet_trainer(const ExperimentConfig& c) {
  Trainer t(c);
  t.quiet = true;
  return t;
}

TEST(Schedules, WarmupThenTheChosenShape) {
  TrainConfig c;
  c.steps = 100;
  c.warmup = 10;
  c.min_lr_ratio = 0.1;
  c.schedule = "cosine";
  EXPECT_DOUBLE_EQ(lr_factor(c, 0), 0.1);
  EXPECT_DOUBLE_EQ(lr_factor(c, 9), 1.0);
  EXPECT_DOUBLE_EQ(lr_factor(c, 10), 1.0);
  EXPECT_NEAR(lr_factor(c, 55), 0.55, 1e-12);  // halfway through the cosine
  EXPECT_NEAR(lr_factor(c, 100), 0.1, 1e-12);
  c.schedule = "constant";
  EXPECT_DOUBLE_EQ(lr_factor(c, 80), 1.0);
  c.schedule = "wsd";
  c.decay_fraction = 0.2;
  EXPECT_DOUBLE_EQ(lr_factor(c, 82), 1.0);                // decay starts 80% into 90 steps
  EXPECT_NEAR(lr_factor(c, 91), 1.0 - 0.9 * 0.5, 1e-12);  // halfway through the decay
  EXPECT_NEAR(lr_factor(c, 100), 0.1, 1e-12);
}

// Adam's first step moves a parameter by lr (times its group's multiplier) wherever the
// gradient is well above eps.
TEST(Trainer, LearningRateMultipliersScaleTheirGroups) {
  ExperimentConfig c = small(scratch("groups"));
  c.train.lr_multipliers = {{"attention.q", 10.0}, {"attention", 3.0}};
  c.train.warmup = 0;
  c.train.schedule = "constant";
  c.train.weight_decay = 0.0;
  c.train.clip = 0.0;
  c.train.lr = 1e-4;
  Trainer t = quiet_trainer(c);
  auto params = t.model()->named_parameters();
  auto snapshot = [&](const char* name) { return params[name].detach().clone(); };
  const Tensor q0 = snapshot("block0.attention.q.weight"), k0 = snapshot("block0.attention.k.weight");
  const Tensor mlp0 = snapshot("block0.mlp.up.weight");
  t.step();
  auto moved = [&](const char* name, const Tensor& before) {
    return (params[name] - before).abs().median().item<double>();
  };
  EXPECT_NEAR(moved("block0.attention.q.weight", q0), 1e-3, 1e-5);  // longest match: 10x
  EXPECT_NEAR(moved("block0.attention.k.weight", k0), 3e-4, 3e-6);
  EXPECT_NEAR(moved("block0.mlp.up.weight", mlp0), 1e-4, 1e-6);
  winnow::train::remove_tree(c.train.out_dir);
}

// The loss is averaged over the whole batch, so splitting it into micro-batches changes only
// the order of floating-point sums.
TEST(Trainer, GradientAccumulationComputesTheFullBatchStep) {
  ExperimentConfig one = small(scratch("accum1")), four = small(scratch("accum4"));
  one.train.grad_accum = 1;
  four.train.grad_accum = 4;
  Trainer a = quiet_trainer(one), b = quiet_trainer(four);
  for (int i = 0; i < 3; ++i) {
    const StepStats sa = a.step(), sb = b.step();
    EXPECT_NEAR(sa.loss, sb.loss, 1e-5 * sa.loss);
  }
  auto pa = a.model()->named_parameters(), pb = b.model()->named_parameters();
  for (const auto& item : pa) {
    const double diff = (item.value() - pb[item.key()]).abs().max().item<double>();
    EXPECT_LT(diff, 1e-5) << item.key();
  }
  winnow::train::remove_tree(one.train.out_dir);
  winnow::train::remove_tree(four.train.out_dir);
}

TEST(Trainer, PhasesChooseWhatTrains) {
  ExperimentConfig c = small(scratch("phases"));
  Phase attention_only;
  attention_only.name = "attention_only";
  attention_only.steps = 2;
  attention_only.train_only = {"attention"};
  Phase still;
  still.name = "still";
  still.steps = 1;
  still.lr_scale = 0;
  Phase all;
  all.name = "all";
  all.freeze = {"embedding"};
  c.train.phases = {attention_only, still, all};
  c.train.weight_decay = 0.1;
  Trainer t = quiet_trainer(c);
  auto params = t.model()->named_parameters();
  auto snapshot = [&](const char* name) { return params[name].detach().clone(); };
  const Tensor att = snapshot("block1.attention.v.weight");
  const Tensor mlp = snapshot("block1.mlp.down.weight");
  const Tensor emb = snapshot("embedding.weight");
  EXPECT_EQ(t.step().phase, "attention_only");
  t.step();
  // Frozen parameters do not move at all: no gradient, so no moment and no weight decay.
  EXPECT_FALSE(torch::equal(params["block1.attention.v.weight"], att));
  EXPECT_TRUE(torch::equal(params["block1.mlp.down.weight"], mlp));
  EXPECT_TRUE(torch::equal(params["embedding.weight"], emb));
  const Tensor att2 = snapshot("block1.attention.v.weight");
  EXPECT_EQ(t.step().phase, "still");
  EXPECT_TRUE(torch::equal(params["block1.attention.v.weight"], att2));
  EXPECT_EQ(t.step().phase, "all");
  EXPECT_FALSE(torch::equal(params["block1.mlp.down.weight"], mlp));
  EXPECT_FALSE(torch::equal(params["block1.attention.v.weight"], att2));
  EXPECT_TRUE(torch::equal(params["embedding.weight"], emb));
  winnow::train::remove_tree(c.train.out_dir);
}

// GSA's recipe (003 section 6): a warm-up phase in which only the indexer trains, on its KL
// loss against the dense attention, then the sparse phase where everything trains and the
// indexer keeps its 10x learning rate.
TEST(SmallRuns, GsaWarmsItsIndexerUpThenTrainsSparse) {
  nlohmann::json j = {
      {"seed", 7},
      {"device", "cpu"},
      {"model",
       {{"d_model", 32},
        {"layers", 2},
        {"attention",
         {{"kind", "gsa"}, {"heads", 2}, {"k_base", 4}, {"k_min", 2}, {"k_max", 8}, {"indexer_heads", 2},
          {"indexer_dim", 8}}}}},
      {"train",
       {{"steps", 5}, {"batch_size", 8}, {"seq_len", 16}, {"lr", 3e-3}, {"warmup", 1}, {"clip", 1.0},
        {"log_every", 5}, {"eval_batches", 1}, {"out_dir", scratch("gsa")}, {"lr_multipliers", {{"indexer", 10.0}}},
        // 0.4 of 5 steps: the warm-up lasts two.
        {"phases", {{{"name", "indexer_warmup"}, {"fraction", 0.4}, {"train_only", {"indexer"}}}, {{"name", "sparse"}}}}}},
      {"task", {{"name", "progression"}, {"vocab_size", 12}}},
  };
  const ExperimentConfig c = parse_experiment(j);
  Trainer t = quiet_trainer(c);
  auto params = t.model()->named_parameters();
  auto snapshot = [&](const char* name) { return params[name].detach().clone(); };
  const Tensor q = snapshot("block1.attention.q.weight");
  const Tensor indexer = snapshot("block1.attention.indexer_q.weight");
  const StepStats first = t.step();
  EXPECT_EQ(first.phase, "indexer_warmup");
  ASSERT_EQ(first.aux.count("indexer_kl"), 1u);
  EXPECT_GT(first.aux.at("indexer_kl"), 0);
  t.step();
  EXPECT_TRUE(torch::equal(params["block1.attention.q.weight"], q));
  EXPECT_FALSE(torch::equal(params["block1.attention.indexer_q.weight"], indexer));
  const Tensor vbar = t.model()->named_buffers()["block1.attention.indexer_variance_mean"].detach().clone();
  EXPECT_GT(vbar.item<double>(), 0);  // set by the first batch
  const StepStats sparse = t.step();
  EXPECT_EQ(sparse.phase, "sparse");
  EXPECT_TRUE(std::isfinite(sparse.loss));
  EXPECT_FALSE(torch::equal(params["block1.attention.q.weight"], q));
  winnow::train::remove_tree(c.train.out_dir);
}

TEST(Trainer, PhaseWithZeroLearningRateLeavesParametersUnchanged) {
  ExperimentConfig c = small(scratch("lr_scale"));
  Phase still;
  still.name = "still";
  still.lr_scale = 0;
  c.train.phases = {still};
  Trainer t = quiet_trainer(c);
  const Tensor before = t.model()->named_parameters()["block0.attention.q.weight"].detach().clone();
  t.step();
  EXPECT_TRUE(torch::equal(before, t.model()->named_parameters()["block0.attention.q.weight"]));
  winnow::train::remove_tree(c.train.out_dir);
}

Trainer::AuxLossFn logit_l2() {
  return [](Trainer&, const tasks::Batch&, const torch::Tensor& logits) {
    return logits.to(torch::kFloat32).pow(2).mean();
  };
}

TEST(Trainer, AuxiliaryLossesAreWeightedByNameAndPhase) {
  auto run = [](const std::string& name, const std::function<void(ExperimentConfig&)>& set, bool with_fn) {
    ExperimentConfig c = small(scratch(name));
    set(c);
    Trainer t = quiet_trainer(c);
    if (with_fn) t.aux_loss_fns.emplace_back("logit_l2", logit_l2());
    StepStats s;
    for (int i = 0; i < 3; ++i) s = t.step();
    winnow::train::remove_tree(c.train.out_dir);
    return std::make_pair(t.model()->named_parameters()["block0.attention.q.weight"].detach().clone(), s);
  };
  const auto plain = run("aux_plain", [](ExperimentConfig&) {}, false);
  const auto zero = run("aux_zero", [](ExperimentConfig& c) { c.train.aux_loss_weights = {{"logit_l2", 0.0}}; }, true);
  const auto weighted = run("aux_weighted", [](ExperimentConfig& c) { c.train.aux_loss_weights = {{"logit_l2", 5.0}}; }, true);
  const auto phased = run("aux_phased", [](ExperimentConfig& c) {
    c.train.aux_loss_weights = {{"logit_l2", 5.0}};
    Phase p;
    p.name = "no_aux";
    p.aux_loss_weights = {{"logit_l2", 0.0}};
    c.train.phases = {p};
  }, true);
  EXPECT_TRUE(torch::equal(plain.first, zero.first));
  EXPECT_FALSE(torch::equal(plain.first, weighted.first));
  EXPECT_TRUE(torch::equal(plain.first, phased.first));
  ASSERT_EQ(weighted.second.aux.count("logit_l2"), 1u);
  EXPECT_GT(weighted.second.aux.at("logit_l2"), 0);

  ExperimentConfig c = small(scratch("aux_unknown"));
  c.train.aux_loss_weights = {{"indexer_kl", 1.0}};
  Trainer t = quiet_trainer(c);
  expect_error([&] { t.step(); }, "'train.aux_loss_weights.indexer_kl'");
  winnow::train::remove_tree(c.train.out_dir);
}

TEST(Trainer, NonFiniteLossStopsTrainingWithAClearError) {
  ExperimentConfig c = small(scratch("diverge"));
  Trainer t = quiet_trainer(c);
  t.aux_loss_fns.emplace_back("nan", [](Trainer&, const tasks::Batch&, const torch::Tensor& logits) {
    return logits.sum() * std::numeric_limits<double>::quiet_NaN();
  });
  const Tensor before = t.model()->named_parameters()["block0.attention.q.weight"].detach().clone();
  expect_error([&] { t.step(); }, "training diverged at step 1");
  try {
    t.step();
    ADD_FAILURE() << "a NaN loss did not throw";
  } catch (const winnow::train::TrainingDiverged& e) {
    EXPECT_EQ(e.step(), 1);  // the failed step did not count; sweeps read the step from here
  }
  EXPECT_TRUE(torch::equal(before, t.model()->named_parameters()["block0.attention.q.weight"]));
  winnow::train::remove_tree(c.train.out_dir);
}

TEST(Trainer, MetricsLogHasTrainAndEvalRecords) {
  ExperimentConfig c = small(scratch("metrics"));
  c.train.eval_every = 3;
  Trainer t = quiet_trainer(c);
  t.train();
  std::ifstream f(fs::path(c.train.out_dir) / "metrics.jsonl");
  std::vector<nlohmann::json> records;
  for (std::string line; std::getline(f, line);) records.push_back(nlohmann::json::parse(line));
  // Train records at steps 2, 4, 6 and evaluations at 3 and 6.
  ASSERT_EQ(records.size(), 5u);
  EXPECT_EQ(records[0]["event"], "train");
  EXPECT_EQ(records[0]["step"], 2);
  for (const char* key : {"loss", "lr", "grad_norm", "tokens_per_s", "elapsed_s", "max_activation", "loss_spikes"}) {
    EXPECT_TRUE(records[0].contains(key)) << key;
  }
  EXPECT_GT(records[0]["max_activation"].get<double>(), 0.0);
  for (const char* key : {"max_activation", "max_activation_by_layer", "loss_spikes", "max_loss_ratio"}) {
    EXPECT_TRUE(records[1].contains(key)) << key;
  }
  EXPECT_EQ(records[1]["max_activation_by_layer"].size(), static_cast<std::size_t>(c.model.layers));
  EXPECT_EQ(records[1]["event"], "eval");
  EXPECT_EQ(records[1]["step"], 3);
  EXPECT_TRUE(records[1].contains("eval_loss"));
  EXPECT_TRUE(records[1].contains("eval_accuracy"));
  EXPECT_EQ(records[2]["step"], 4);
  EXPECT_EQ(records[3]["event"], "train");
  EXPECT_EQ(records[3]["step"], 6);
  EXPECT_EQ(records.back()["event"], "eval");
  EXPECT_EQ(records.back()["step"], 6);
  winnow::train::remove_tree(c.train.out_dir);
}

TEST(Trainer, StepAndEvaluationHooksRun) {
  ExperimentConfig c = small(scratch("hooks"));
  c.train.eval_every = 2;
  Trainer t = quiet_trainer(c);
  std::vector<std::int64_t> steps;
  t.step_hooks.push_back([&](Trainer&, std::int64_t step) { steps.push_back(step); });
  t.eval_hooks.push_back([](Trainer& tr) { return nlohmann::json{{"hooked_step", tr.current_step()}}; });
  const nlohmann::json last = t.train();
  EXPECT_EQ(steps, (std::vector<std::int64_t>{0, 1, 2, 3, 4, 5}));
  EXPECT_EQ(last["hooked_step"], 6);
  winnow::train::remove_tree(c.train.out_dir);
}

TEST(TrainingHealth, CountsStepsAboveTheRunningMean) {
  winnow::train::TrainingHealth h;
  const double threshold = 0.25;
  std::int64_t step = 0;
  // A slowly falling loss: no spikes, and the first kHorizon steps are never judged.
  for (; step < 2 * winnow::train::TrainingHealth::kHorizon; ++step) {
    EXPECT_FALSE(h.observe(step + 1, 3.0 - 0.001 * static_cast<double>(step), threshold));
  }
  EXPECT_EQ(h.spikes, 0);
  EXPECT_GT(h.max_loss_ratio, 0.99);
  EXPECT_LT(h.max_loss_ratio, 1.0);
  const double running = 3.0 - 0.001 * static_cast<double>(step);  // about where the mean is
  EXPECT_FALSE(h.observe(++step, running * 1.1, threshold));  // 10% above: not a spike
  EXPECT_TRUE(h.observe(++step, running * 1.6, threshold));
  EXPECT_EQ(h.spikes, 1);
  EXPECT_EQ(h.last_spike_step, step);
  EXPECT_GT(h.max_loss_ratio, 1.5);
  // A report read twice counts once.
  EXPECT_FALSE(h.observe(step, running * 1.6, threshold));
  EXPECT_EQ(h.spikes, 1);
  h.max_activation = 12.5;
  const winnow::train::TrainingHealth back = winnow::train::TrainingHealth::from_json(h.to_json());
  EXPECT_EQ(back.to_json(), h.to_json());
}

TEST(TrainingHealth, SurvivesResumption) {
  const std::string dir_a = scratch("health_straight"), dir_b = scratch("health_resumed");
  ExperimentConfig a = small(dir_a), b = small(dir_b);
  Trainer straight = quiet_trainer(a);
  straight.train();
  {
    Trainer first = quiet_trainer(b);
    first.train(3);
  }
  Trainer second = quiet_trainer(b);
  ASSERT_TRUE(second.resume());
  EXPECT_EQ(second.health().seen, 3);
  second.train();
  // The activations are measured at log steps; the interrupted run also measured at its
  // last step (3), so its maximum covers the straight run's.
  nlohmann::json resumed = second.health().to_json(), whole = straight.health().to_json();
  EXPECT_GE(resumed["max_activation"].get<double>(), whole["max_activation"].get<double>());
  EXPECT_GT(whole["max_activation"].get<double>(), 0.0);
  resumed.erase("max_activation");
  whole.erase("max_activation");
  EXPECT_EQ(resumed, whole);
  winnow::train::remove_tree(dir_a);
  winnow::train::remove_tree(dir_b);
}

// ------------------------------------------------------------------ checkpoints

TEST(Checkpoints, ResumeGivesBitIdenticalParameters) {
  const std::string dir_a = scratch("straight"), dir_b = scratch("resumed");
  ExperimentConfig a = small(dir_a), b = small(dir_b);
  for (ExperimentConfig* c : {&a, &b}) {
    Phase first;
    first.name = "first";
    first.steps = 4;
    first.freeze = {"mlp"};
    Phase second;
    second.name = "second";
    c->train.phases = {first, second};
  }
  Trainer straight = quiet_trainer(a);
  straight.train();
  {
    Trainer first = quiet_trainer(b);
    first.train(3);  // saves at step 3, inside the first phase
  }  // nothing of the first trainer survives but its checkpoint
  Trainer second = quiet_trainer(b);
  ASSERT_TRUE(second.resume());
  EXPECT_EQ(second.current_step(), 3);
  second.train();
  expect_same_parameters(straight, second);
  // The optimizer state continues too: one more identical step keeps them identical.
  straight.step();
  second.step();
  expect_same_parameters(straight, second);
  winnow::train::remove_tree(dir_a);
  winnow::train::remove_tree(dir_b);
}

TEST(Checkpoints, ResumeDropsMetricsOfStepsThatRunAgain) {
  const std::string dir = scratch("metrics_resume");
  ExperimentConfig c = small(dir);
  c.train.log_every = 1;
  c.train.checkpoint_every = 2;
  c.train.keep_checkpoints = 0;
  {
    Trainer t = quiet_trainer(c);
    t.train(2);  // logs steps 1, 2 and an evaluation, then saves
    t.train(5);  // logs steps 3..5 and an evaluation, saves at 4 and 5
  }
  // Back to the step-2 checkpoint, as if the process had died right after writing it.
  const fs::path root = fs::path(dir) / "checkpoints";
  { std::ofstream(root / "latest") << "step_00000002\n"; }
  Trainer t = quiet_trainer(c);
  ASSERT_TRUE(t.resume());
  std::ifstream f(fs::path(dir) / "metrics.jsonl");
  std::int64_t last = 0;
  for (std::string line; std::getline(f, line);) last = nlohmann::json::parse(line)["step"];
  EXPECT_EQ(last, 2);
  winnow::train::remove_tree(dir);
}

TEST(Checkpoints, KeepsTheNewestOnes) {
  const std::string dir = scratch("keep");
  ExperimentConfig c = small(dir);
  c.train.checkpoint_every = 1;
  c.train.keep_checkpoints = 2;
  Trainer t = quiet_trainer(c);
  t.train();
  std::vector<std::string> names;
  for (const auto& e : fs::directory_iterator(fs::path(dir) / "checkpoints")) names.push_back(e.path().filename());
  std::sort(names.begin(), names.end());
  EXPECT_EQ(names, (std::vector<std::string>{"latest", "step_00000005", "step_00000006"}));
  EXPECT_EQ(read_checkpoint(latest_checkpoint(dir + "/checkpoints")).step, 6);
  winnow::train::remove_tree(dir);
}

TEST(Checkpoints, CorruptTruncatedOrMissingFilesGiveClearErrors) {
  const std::string dir = scratch("corrupt");
  {
    Trainer t = quiet_trainer(small(dir));
    t.train(2);
  }
  const fs::path folder = latest_checkpoint(dir + "/checkpoints");
  const fs::path backup = fs::path(dir) / "backup";
  fs::copy(folder, backup, fs::copy_options::recursive);
  auto restore = [&] {
    winnow::train::remove_tree(folder);
    fs::copy(backup, folder, fs::copy_options::recursive);
  };
  auto expect_resume_error = [&](const std::string& fragment) {
    Trainer t = quiet_trainer(small(dir));
    expect_error([&] { t.resume(); }, fragment);
    restore();
  };
  // Truncated model.
  fs::resize_file(folder / "model.pt", fs::file_size(folder / "model.pt") / 2);
  expect_resume_error("model.pt' is truncated or altered");
  // One flipped byte inside the optimizer state, size unchanged.
  {
    std::fstream f(folder / "optimizer.pt", std::ios::in | std::ios::out | std::ios::binary);
    f.seekg(static_cast<std::streamoff>(fs::file_size(folder / "optimizer.pt") / 2));
    const char byte = static_cast<char>(f.peek());
    f.seekp(static_cast<std::streamoff>(fs::file_size(folder / "optimizer.pt") / 2));
    f.put(static_cast<char>(byte ^ 0x5a));
  }
  expect_resume_error("optimizer.pt' is corrupt");
  // Garbage metadata, an old format, a missing file, a dangling pointer.
  { std::ofstream(folder / "trainer.json") << "{ not json"; }
  expect_resume_error("trainer.json' is corrupt");
  {
    nlohmann::json meta = read_json(folder / "trainer.json");
    meta["format_version"] = 0;
    std::ofstream(folder / "trainer.json") << meta.dump();
  }
  expect_resume_error("format version 0");
  fs::remove(folder / "rng.pt");
  expect_resume_error("has no rng.pt");
  { std::ofstream(fs::path(dir) / "checkpoints" / "latest") << "step_00000099\n"; }
  expect_resume_error("names 'step_00000099', which does not exist");
  { std::ofstream(fs::path(dir) / "checkpoints" / "latest") << folder.filename().string() << "\n"; }
  // Still loads once repaired.
  Trainer t = quiet_trainer(small(dir));
  EXPECT_TRUE(t.resume());
  EXPECT_EQ(t.current_step(), 2);
  winnow::train::remove_tree(dir);
}

TEST(Checkpoints, ResumingUnderAnotherConfigurationIsRefusedNamingTheKey) {
  const std::string dir = scratch("mismatch");
  {
    Trainer t = quiet_trainer(small(dir));
    t.train(1);
  }
  auto expect_refused = [&](const std::function<void(ExperimentConfig&)>& set, const std::string& key) {
    ExperimentConfig c = small(dir);
    set(c);
    Trainer t = quiet_trainer(c);
    expect_error([&] { t.resume(); }, "written with " + key + " = ");
  };
  expect_refused([](ExperimentConfig& c) { c.model.layers = 3; }, "model.layers");
  expect_refused([](ExperimentConfig& c) { c.train.lr = 1e-2; }, "train.lr");
  expect_refused([](ExperimentConfig& c) { c.seed = 8; }, "seed");
  expect_refused([](ExperimentConfig& c) { c.model.attention.options["remainder_bias"] = true; },
                 "model.attention.remainder_bias");
  // A longer run of the same configuration continues.
  ExperimentConfig longer = small(dir);
  longer.train.steps = 20;
  Trainer t = quiet_trainer(longer);
  EXPECT_TRUE(t.resume());
  winnow::train::remove_tree(dir);
}

// ------------------------------------------------------------------ configuration

TEST(Config, UnknownKeysAndBadValuesNameTheKey) {
  const nlohmann::json base = to_json(small(scratch("config")));
  auto expect = [&](const std::string& assignment, const std::string& fragment) {
    nlohmann::json j = base;
    apply_override(j, assignment);
    expect_error([&] { parse_experiment(j); }, fragment);
  };
  expect("train.stepz=3", "unknown key 'train.stepz'");
  expect("model.attention.flavour=x", "unknown key 'model.attention.flavour'");
  expect("model.attention.ssmax=true", "unknown key 'model.attention.ssmax'");
  expect("model.attention.rope.base=5", "unknown key 'model.attention.rope.base'");
  expect("colour=red", "unknown key 'colour'");
  expect("train.lr=-1", "key 'train.lr': expected > 0, got -1");
  expect("train.lr=fast", "key 'train.lr': expected a number, got \"fast\"");
  expect("train.schedule=linear", "key 'train.schedule': expected one of constant, cosine, wsd");
  expect("train.grad_accum=3", "'train.grad_accum'");
  expect("train.beta2=1", "'train.beta2'");
  expect("train.dtype=float16", "'train.dtype'");
  expect("train.phases=[{\"name\":\"a\",\"steps\":2},{\"name\":\"a\"}]", "'train.phases[1].name'");
  expect("train.phases=[{\"name\":\"a\"},{\"name\":\"b\"}]", "'train.phases[0].steps'");
  expect("train.phases=[{\"name\":\"a\",\"steps\":99},{\"name\":\"b\"}]", "'train.phases'");
  expect("train.phases=[{\"name\":\"a\",\"steps\":2,\"fraction\":0.5},{\"name\":\"b\"}]", "'train.phases[0].fraction'");
  expect("train.phases=[{\"name\":\"a\",\"fraction\":0.001},{\"name\":\"b\"}]", "'train.phases[0].steps'");
  expect("train.phases=[{\"name\":\"a\",\"fraction\":0.5},{\"name\":\"b\",\"fraction\":0.5}]", "'train.phases[1].fraction'");
  expect("train.phases=[{\"name\":\"a\",\"stepz\":1}]", "unknown key 'train.phases[0].stepz'");
  expect("train.lr_multipliers={\"indexer\":0}", "'train.lr_multipliers.indexer'");
  expect("model.attention.kind=magic", "'model.attention.kind'");
  expect("model.layers=1.5", "key 'model.layers': expected an integer, got 1.5");
  expect("model.vocab_size=8", "'model.vocab_size'");
  expect("model.attention.heads=0", "'model.attention.heads'");
  expect("task.name=sorting", "'task.name'");
  expect("task.vocab_size=2", "'task.vocab_size'");
  expect("device=tpu", "'device'");
  expect("seed=-1", "'seed'");
  expect("train=3", "key 'train': expected an object");
}

TEST(Config, PatternsMustMatchSomeParameter) {
  ExperimentConfig c = small(scratch("patterns"));
  c.train.lr_multipliers = {{"indexer", 10.0}};
  expect_error([&] { Trainer t(c); }, "'train.lr_multipliers.indexer'");
  c = small(scratch("patterns"));
  Phase p;
  p.name = "warmup";
  p.train_only = {"attention", "indexr"};
  c.train.phases = {p};
  expect_error([&] { Trainer t(c); }, "'train.phases[0].train_only[1]'");
  winnow::train::remove_tree(c.train.out_dir);
}

TEST(Config, OverridesParseJsonValuesBareWordsAndListIndices) {
  nlohmann::json j = to_json(small(scratch("overrides")));
  apply_override(j, "train.lr=3e-4");
  apply_override(j, "model.attention.kind=softmax");
  apply_override(j, "model.attention.ssmax=true");
  apply_override(j, "train.lr_multipliers={\"attention\": 10}");
  apply_override(j, "train.phases=[{\"name\": \"a\", \"steps\": 2}, {\"name\": \"b\"}]");
  apply_override(j, "train.phases[0].steps=3");
  // Keys of the previous kind's options are gone only if the file drops them: stick-breaking's
  // resolved options came along in to_json, so they are removed here.
  for (const char* k : {"remainder_bias", "head_norm", "attend_current", "halt_cutoff"}) {
    j["model"]["attention"].erase(k);
  }
  j["model"]["attention"]["position"] = "auto";
  const ExperimentConfig c = parse_experiment(j);
  EXPECT_DOUBLE_EQ(c.train.lr, 3e-4);
  EXPECT_EQ(c.model.attention.kind, "softmax");
  EXPECT_EQ(c.model.attention.position, "rope");
  EXPECT_EQ(c.model.attention.options["ssmax"], true);
  EXPECT_DOUBLE_EQ(c.train.lr_multipliers.at("attention"), 10.0);
  ASSERT_EQ(c.train.phases.size(), 2u);
  EXPECT_EQ(c.train.phases[0].steps, 3);
  expect_error([&] { apply_override(j, "no_equals_sign"); }, "'--set'");
  expect_error([&] { apply_override(j, "train.phases[5].steps=1"); }, "no element 5");
  expect_error([&] { apply_override(j, "train.lr.x=1"); }, "not an object");
}

TEST(Config, WrittenConfigReadsBackToItself) {
  ExperimentConfig c = small(scratch("roundtrip"), "softmax");
  c.train.phases = {Phase{"a", 2, {"attention"}, {}, 0.5, {{"x", 2.0}}}, Phase{"b", 0, {}, {"mlp"}, 1.0, {}}};
  c.train.lr_multipliers = {{"attention", 2.0}};
  const nlohmann::json once = to_json(c);
  EXPECT_EQ(to_json(parse_experiment(once)), once);
}

}  // namespace
}  // namespace winnow::train
