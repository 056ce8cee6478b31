// Training on the CPU: a 2-layer d = 256 model of every layer kind learns the toy task;
// checkpoints resume bit-identically; corrupt checkpoints and bad configurations give errors
// naming what is wrong; schedules have the documented shape.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <filesystem>
#include <fstream>
#include <string>
#include <unistd.h>

#include "train/checkpoint.h"
#include "train/config.h"
#include "train/trainer.h"
#include "winnow/error.h"

namespace winnow::train {
namespace {
namespace fs = std::filesystem;

std::string scratch(const std::string& name) {
  const fs::path p = fs::temp_directory_path() / ("winnow_test_" + name + "_" + std::to_string(::getpid()));
  fs::remove_all(p);
  return p.string();
}

ExperimentConfig toy(const std::string& name) {
  nlohmann::json j = {
      {"seed", 7},
      {"device", "cpu"},
      {"model", {{"d_model", 256}, {"layers", 2}, {"max_len", 32}, {"attention", {{"heads", 4}}}}},
      {"train",
       {{"steps", 150}, {"batch_size", 16}, {"seq_len", 32}, {"lr", 1e-3}, {"warmup", 20},
        {"clip", 1.0}, {"log_every", 50}, {"out_dir", scratch(name)}}},
      {"task", {{"name", "progression"}, {"vocab_size", 16}}},
  };
  return parse_experiment(j);
}

struct Kind {
  std::string name;
  std::vector<std::string> overrides;
};

class LossFalls : public ::testing::TestWithParam<Kind> {};

// The stated bound: from ln 16 = 2.77 nats to under 0.3 on held-out batches in 150 steps
// (300 for NoPE, which has to infer positions from causality alone).
TEST_P(LossFalls, TwoLayerD256ModelLearnsTheToyTask) {
  nlohmann::json j = to_json(toy(GetParam().name));
  for (const std::string& o : GetParam().overrides) apply_override(j, o);
  Trainer trainer(parse_experiment(j));
  trainer.quiet = true;
  const double before = trainer.evaluate()["eval_loss"].get<double>();
  trainer.train();
  const nlohmann::json after = trainer.evaluate();
  EXPECT_GT(before, 2.5);
  EXPECT_LT(after["eval_loss"].get<double>(), 0.3) << after.dump();
  fs::remove_all(trainer.config().train.out_dir);
}

INSTANTIATE_TEST_SUITE_P(
    Models, LossFalls,
    ::testing::Values(
        Kind{"softmax_rope", {}},
        Kind{"softmax_nope", {"model.attention.position=nope", "train.steps=300"}},
        Kind{"softmax_alibi", {"model.attention.position=alibi"}},
        Kind{"ssmax_gated", {"model.attention.ssmax=true", "model.attention.gate=g1g2"}},
        Kind{"differential", {"model.attention.kind=differential"}},
        Kind{"stick_breaking",
             {"model.attention.kind=stick_breaking", "model.attention.position=nope",
              "model.attention.remainder_bias=true", "model.attention.head_norm=true"}}),
    [](const ::testing::TestParamInfo<Kind>& info) { return info.param.name; });

ExperimentConfig small(const std::string& out_dir) {
  ExperimentConfig c = toy("unused");
  c.model.d_model = 64;
  c.train.steps = 6;
  c.train.grad_accum = 2;
  c.train.out_dir = out_dir;
  c.model.attention.kind = "stick_breaking";
  return c;
}

TEST(Checkpoints, ResumeGivesBitIdenticalParameters) {
  const std::string dir_a = scratch("straight"), dir_b = scratch("resumed");
  Trainer straight(small(dir_a));
  straight.quiet = true;
  straight.train();

  {
    Trainer first(small(dir_b));
    first.quiet = true;
    first.train(3);  // saves at step 3
  }  // the first process is gone: nothing survives but the checkpoint
  Trainer second(small(dir_b));
  second.quiet = true;
  ASSERT_TRUE(second.resume());
  EXPECT_EQ(second.step(), 3);
  second.train();

  auto a = straight.model()->named_parameters(), b = second.model()->named_parameters();
  ASSERT_EQ(a.size(), b.size());
  for (const auto& item : a) EXPECT_TRUE(torch::equal(item.value(), b[item.key()])) << item.key();
  fs::remove_all(dir_a);
  fs::remove_all(dir_b);
}

TEST(Checkpoints, CorruptOrTruncatedFilesGiveClearErrors) {
  const std::string dir = scratch("corrupt");
  {
    Trainer t(small(dir));
    t.quiet = true;
    t.train(2);
  }
  const std::string folder = latest_checkpoint(dir + "/checkpoints");
  ASSERT_FALSE(folder.empty());
  const auto expect_error = [&](const std::string& fragment) {
    Trainer t(small(dir));
    t.quiet = true;
    try {
      t.resume();
      ADD_FAILURE() << "no error";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(fragment), std::string::npos) << e.what();
    }
  };
  // Truncate the model file to half its size.
  const fs::path model = fs::path(folder) / "model.pt";
  fs::resize_file(model, fs::file_size(model) / 2);
  expect_error("model.pt");
  // Garbage metadata.
  { std::ofstream(fs::path(folder) / "trainer.json") << "{ not json"; }
  expect_error("trainer.json");
  // A missing file.
  fs::remove(fs::path(folder) / "optimizer.pt");
  expect_error("optimizer.pt");
  fs::remove_all(dir);
}

TEST(Checkpoints, ResumingWithAnotherModelIsRefused) {
  const std::string dir = scratch("mismatch");
  {
    Trainer t(small(dir));
    t.quiet = true;
    t.train(1);
  }
  ExperimentConfig other = small(dir);
  other.model.layers = 3;
  Trainer t(other);
  t.quiet = true;
  EXPECT_THROW(t.resume(), Error);
  fs::remove_all(dir);
}

TEST(Config, UnknownKeysAndBadValuesNameTheKey) {
  const nlohmann::json base = to_json(toy("config"));
  auto expect = [&](const std::string& assignment, const std::string& key) {
    nlohmann::json j = base;
    apply_override(j, assignment);
    try {
      parse_experiment(j);
      ADD_FAILURE() << "no error for " << assignment;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("'" + key + "'"), std::string::npos) << e.what();
    }
  };
  expect("train.stepz=3", "train.stepz");
  expect("model.attention.flavour=x", "model.attention.flavour");
  expect("train.lr=-1", "train.lr");
  expect("train.lr=fast", "train.lr");
  expect("train.schedule=linear", "train.schedule");
  expect("train.grad_accum=3", "train.grad_accum");
  expect("model.attention.kind=magic", "model.attention.kind");
  expect("model.layers=1.5", "model.layers");
  expect("model.vocab_size=8", "model.vocab_size");
  expect("task.name=sorting", "task.name");
  expect("device=tpu", "device");
  expect("train.lr_multipliers.indexer=0", "train.lr_multipliers.indexer");
}

TEST(Config, OverridesParseJsonValuesAndBareWords) {
  nlohmann::json j = to_json(toy("overrides"));
  apply_override(j, "train.lr=3e-4");
  apply_override(j, "model.attention.kind=stick_breaking");
  apply_override(j, "model.attention.ssmax=true");
  apply_override(j, "train.lr_multipliers={\"attention\": 10}");
  const ExperimentConfig c = parse_experiment(j);
  EXPECT_DOUBLE_EQ(c.train.lr, 3e-4);
  EXPECT_EQ(c.model.attention.kind, "stick_breaking");
  EXPECT_TRUE(c.model.attention.ssmax);
  ASSERT_EQ(c.train.lr_multipliers.size(), 1u);
  EXPECT_DOUBLE_EQ(c.train.lr_multipliers[0].second, 10.0);
  EXPECT_THROW(apply_override(j, "no_equals_sign"), Error);
}

TEST(Schedules, WarmupThenTheChosenShape) {
  TrainConfig c;
  c.steps = 100;
  c.warmup = 10;
  c.min_lr_ratio = 0.1;
  c.schedule = "cosine";
  EXPECT_DOUBLE_EQ(lr_factor(c, 0), 0.1);
  EXPECT_DOUBLE_EQ(lr_factor(c, 9), 1.0);
  EXPECT_NEAR(lr_factor(c, 55), 0.55, 1e-12);   // halfway through the cosine
  EXPECT_NEAR(lr_factor(c, 100), 0.1, 1e-12);
  c.schedule = "constant";
  EXPECT_DOUBLE_EQ(lr_factor(c, 80), 1.0);
  c.schedule = "wsd";
  c.decay_fraction = 0.2;
  EXPECT_DOUBLE_EQ(lr_factor(c, 70), 1.0);
  EXPECT_DOUBLE_EQ(lr_factor(c, 82), 1.0);                  // the decay starts at 80% of 90 steps
  EXPECT_NEAR(lr_factor(c, 91), 1.0 - 0.9 * 0.5, 1e-12);  // halfway through the decay
  EXPECT_NEAR(lr_factor(c, 100), 0.1, 1e-12);
}

// Adam's first step moves every parameter by lr (times its group's multiplier): the
// attention projections must move exactly 10x as far as the MLP's.
TEST(Trainer, LearningRateMultipliersScaleTheirParameterGroups) {
  ExperimentConfig c = small(scratch("groups"));
  c.train.lr_multipliers = {{"attention", 10.0}};
  c.train.warmup = 0;
  c.train.schedule = "constant";
  c.train.weight_decay = 0.0;
  c.train.clip = 0.0;
  c.train.lr = 1e-4;
  Trainer t(c);
  t.quiet = true;
  auto params = t.model()->named_parameters();
  const torch::Tensor attention_before = params["block0.attention.q.weight"].detach().clone();
  const torch::Tensor mlp_before = params["block0.mlp.up.weight"].detach().clone();
  t.train(1);
  const double attention_step = (params["block0.attention.q.weight"] - attention_before).abs().median().item<double>();
  const double mlp_step = (params["block0.mlp.up.weight"] - mlp_before).abs().median().item<double>();
  EXPECT_NEAR(attention_step, 1e-3, 1e-5);
  EXPECT_NEAR(mlp_step, 1e-4, 1e-6);
  fs::remove_all(c.train.out_dir);
}

}  // namespace
}  // namespace winnow::train
