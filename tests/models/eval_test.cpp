// Evaluation: accuracy and exact-match counts against hand-computed ones, greedy generation
// through the KV cache against generation by full forward passes, exact-match scoring of a
// generative task whose right answers the test knows, loss by position, and the diagnostics
// probe against hand-computed statistics and on every mechanism.
#include <gtest/gtest.h>

#include <cmath>
#include <set>

#include "eval/evaluate.h"
#include "winnow/error.h"
#include "nn/probe.h"
#include "nn/transformer.h"
#include "tasks/task.h"

namespace winnow::eval {
namespace {

nn::ModelConfig tiny(const std::string& kind, std::int64_t vocab = 11) {
  nn::ModelConfig c;
  c.vocab_size = vocab;
  c.d_model = 32;
  c.layers = 2;
  c.context_len = 8;
  c.attention.heads = 2;
  c.attention.kind = kind;
  return c;
}

TEST(Score, CountsMatchAHandComputation) {
  // Two sequences of three positions over three tokens.
  const torch::Tensor logits =
      torch::tensor({{{2.0f, 0.0f, 0.0f}, {0.0f, 5.0f, 0.0f}, {0.0f, 0.0f, 1.0f}},
                     {{1.0f, 1.5f, 0.0f}, {0.0f, 3.0f, 0.0f}, {0.0f, 0.0f, 4.0f}}});
  tasks::Batch b;
  b.targets = torch::tensor({{0, 2, 1}, {0, 1, 2}}, torch::kInt64);
  b.loss_mask = torch::tensor({{1.0f, 0.0f, 1.0f}, {0.0f, 1.0f, 1.0f}});
  b.inputs = torch::zeros({2, 3}, torch::kInt64);
  const SequenceScore s = score_logits(logits, b);
  // Scored: (0,0) right, (0,2) wrong (argmax 2, target 1), (1,1) right, (1,2) right.
  EXPECT_EQ(s.sequences, 2);
  EXPECT_DOUBLE_EQ(s.scored, 4);
  EXPECT_DOUBLE_EQ(s.correct, 3);
  EXPECT_DOUBLE_EQ(s.exact, 1);
  EXPECT_DOUBLE_EQ(s.accuracy(), 0.75);
  EXPECT_DOUBLE_EQ(s.exact_match(), 0.5);
  auto nll = [](std::vector<double> z, int t) {
    double sum = 0;
    for (double v : z) sum += std::exp(v);
    return std::log(sum) - z[static_cast<std::size_t>(t)];
  };
  const double expected =
      nll({2, 0, 0}, 0) + nll({0, 0, 1}, 1) + nll({0, 3, 0}, 1) + nll({0, 0, 4}, 2);
  EXPECT_NEAR(s.loss_sum, expected, 1e-5);
  SequenceScore twice = s;
  twice += s;
  EXPECT_DOUBLE_EQ(twice.accuracy(), 0.75);
  EXPECT_EQ(twice.sequences, 4);
}

TEST(Generate, ThroughTheCacheEqualsFullForwardPasses) {
  for (const std::string kind : {"softmax", "stick_breaking"}) {
    torch::manual_seed(3);
    nn::TransformerLM model(tiny(kind));
    model->eval();
    const torch::Tensor prompts = torch::randint(0, 11, {3, 7}, torch::kInt64);
    const torch::Tensor cached = generate_greedy(model.ptr(), prompts, 5, Runtime{});
    torch::NoGradGuard no_grad;
    torch::Tensor seq = prompts;
    for (int i = 0; i < 5; ++i) {
      const torch::Tensor logits = model->forward(seq);
      seq = torch::cat({seq, logits.select(1, logits.size(1) - 1).argmax(-1, true)}, 1);
    }
    EXPECT_TRUE(torch::equal(cached, seq.narrow(1, 7, 5))) << kind;
  }
}

// A generative task whose answers are right (the model's own greedy continuation) for the
// prompts whose seed is even, so the expected exact match is known.
class KnownAnswers final : public tasks::Task {
 public:
  explicit KnownAnswers(nn::TransformerLM model) : model_(std::move(model)) {}
  std::int64_t vocab_size() const override { return 11; }
  tasks::Batch sample(std::int64_t, std::int64_t, std::uint64_t) const override { return {}; }
  bool generative() const override { return true; }
  tasks::Prompt prompt(std::int64_t length, double, std::uint64_t seed) const override {
    tasks::Rng rng(seed);
    tasks::Prompt p;
    for (std::int64_t i = 0; i < length - 2; ++i)
      p.tokens.push_back(static_cast<std::int64_t>(rng.below(11)));
    const torch::Tensor mine =
        generate_greedy(model_.ptr(), torch::tensor(p.tokens).view({1, -1}), 2, Runtime{});
    p.answer = {mine[0][0].item<std::int64_t>(), mine[0][1].item<std::int64_t>()};
    if (seed % 2 == 1) {
      p.answer[1] = (p.answer[1] + 1) % 11;
    } else {
      ++right;
    }
    ++asked;
    return p;
  }
  mutable int right = 0, asked = 0;

 private:
  mutable nn::TransformerLM model_;
};

TEST(Generate, ExactMatchCountsTheRightAnswers) {
  torch::manual_seed(5);
  nn::TransformerLM model(tiny("stick_breaking"));
  KnownAnswers task(model);
  Runtime rt;
  rt.batch_tokens = 40;  // 4 prompts of 10 per batch: several batches
  const GenerationScore g = score_generation(model.ptr(), task, 10, 0.5, 13, 9, rt);
  EXPECT_EQ(task.asked, 13);
  EXPECT_EQ(g.instances, 13);
  EXPECT_EQ(g.exact, task.right);
  EXPECT_GT(task.right, 0);
  EXPECT_LT(task.right, 13);
}

TEST(PositionLoss, BinsAverageThePerTokenLoss) {
  torch::manual_seed(2);
  nn::TransformerLM model(tiny("softmax"));
  const torch::Tensor tokens = torch::randint(0, 11, {5, 13}, torch::kInt64);
  Runtime rt;
  rt.batch_tokens = 26;
  const PositionLoss one = loss_by_position(model.ptr(), tokens, 1, rt);
  const PositionLoss four = loss_by_position(model.ptr(), tokens, 4, rt);
  torch::NoGradGuard no_grad;
  const torch::Tensor logp = torch::log_softmax(model->forward(tokens.narrow(1, 0, 12)), -1);
  const torch::Tensor nll = -logp.gather(-1, tokens.narrow(1, 1, 12).unsqueeze(-1)).squeeze(-1);
  ASSERT_EQ(one.loss.size(), 1u);
  EXPECT_NEAR(one.loss[0], nll.mean().item<double>(), 1e-5);
  ASSERT_EQ(four.loss.size(), 4u);
  EXPECT_EQ(four.bin_start, (std::vector<std::int64_t>{0, 3, 6, 9}));
  EXPECT_EQ(four.bin_end, (std::vector<std::int64_t>{3, 6, 9, 12}));
  EXPECT_NEAR(four.loss[2], nll.narrow(1, 6, 3).mean().item<double>(), 1e-5);
}

TEST(PositionLoss, ScoringSequencesSumsTheLossByPosition) {
  torch::manual_seed(3);
  nn::TransformerLM model(tiny("softmax"));
  const tasks::Batch batch = [] {
    tasks::Batch b;
    b.inputs = torch::randint(0, 11, {3, 6}, torch::kInt64);
    b.targets = torch::randint(0, 11, {3, 6}, torch::kInt64);
    b.loss_mask = torch::tensor({{1, 1, 0, 1, 1, 1}, {1, 0, 0, 1, 1, 1}, {1, 1, 1, 1, 0, 1}},
                                torch::kFloat32);
    return b;
  }();
  torch::NoGradGuard no_grad;
  const torch::Tensor logits = model->forward(batch.inputs);
  PositionSums sums;
  const SequenceScore score = score_logits(logits, batch, &sums);
  (void)score_logits(logits, batch, &sums);  // twice: the sums add
  const torch::Tensor logp = torch::log_softmax(logits, -1);
  const torch::Tensor nll = -logp.gather(-1, batch.targets.unsqueeze(-1)).squeeze(-1);
  for (std::int64_t t = 0; t < 6; ++t) {
    const torch::Tensor m = batch.loss_mask.select(1, t);
    EXPECT_NEAR(sums.nll[t].item<double>(), 2 * (nll.select(1, t) * m).sum().item<double>(), 1e-5);
    EXPECT_EQ(sums.count[t].item<double>(), 2 * m.sum().item<double>());
  }
  // Bins weigh positions by their labelled tokens; all of them give the whole loss.
  const PositionLoss whole = binned(sums, 1);
  EXPECT_NEAR(whole.loss[0], score.loss(), 1e-6);
  EXPECT_EQ(whole.tokens[0], 2 * score.scored);
  const PositionLoss pairs = binned(sums, 3);
  ASSERT_EQ(pairs.loss.size(), 3u);
  EXPECT_EQ(pairs.tokens[1], 2 * 4.0);  // positions 2 and 3: 1 + 3 labelled, twice
  const double expected = ((nll.narrow(1, 2, 2) * batch.loss_mask.narrow(1, 2, 2)).sum() / 4).item<double>();
  EXPECT_NEAR(pairs.loss[1], expected, 1e-5);
  PositionSums other;
  other.add(torch::zeros({5}), torch::zeros({5}));
  EXPECT_THROW(other.add(torch::zeros({6}), torch::zeros({6})), Error);
}

TEST(Generate, SamplingIsSeededAndGreedyAtTemperatureZero) {
  torch::manual_seed(5);
  nn::TransformerLM model(tiny("softmax", 13));
  const torch::Tensor prompts = torch::randint(0, 13, {3, 4}, torch::kInt64);
  Runtime rt;
  const torch::Tensor greedy = generate_greedy(model.ptr(), prompts, 6, rt);
  Sampling s;
  s.temperature = 0;
  EXPECT_TRUE(torch::equal(generate(model.ptr(), prompts, 6, rt, s), greedy));
  s.temperature = 1.0;
  s.top_k = 1;  // only the most likely token remains
  EXPECT_TRUE(torch::equal(generate(model.ptr(), prompts, 6, rt, s), greedy));
  s.top_k = 0;
  s.temperature = 5.0;  // flat enough that two seeds differ somewhere in 3 x 40 draws
  s.seed = 7;
  const torch::Tensor a = generate(model.ptr(), prompts, 40, rt, s);
  EXPECT_EQ(a.sizes(), (std::vector<std::int64_t>{3, 40}));
  EXPECT_TRUE(torch::equal(a, generate(model.ptr(), prompts, 40, rt, s)));
  s.seed = 8;
  EXPECT_FALSE(torch::equal(a, generate(model.ptr(), prompts, 40, rt, s)));
  EXPECT_GE(a.min().item<std::int64_t>(), 0);
  EXPECT_LT(a.max().item<std::int64_t>(), 13);
  // top-k keeps the draws among the k most likely tokens of each step: with k = 2 every drawn
  // token is one of the two largest logits given the tokens before it.
  s.top_k = 2;
  const torch::Tensor b = generate(model.ptr(), prompts, 8, rt, s);
  {
    torch::NoGradGuard no_grad;
    const torch::Tensor all = torch::cat({prompts, b}, 1);
    const torch::Tensor logits = model->forward(all.narrow(1, 0, all.size(1) - 1));
    const torch::Tensor top2 = std::get<1>(logits.narrow(1, 3, 8).topk(2, -1));
    EXPECT_TRUE(top2.eq(b.unsqueeze(-1)).any(-1).all().item<bool>());
  }
  Sampling bad;
  bad.temperature = -1;
  EXPECT_THROW(generate(model.ptr(), prompts, 2, rt, bad), Error);
  bad.temperature = 1;
  bad.top_k = -2;
  EXPECT_THROW(generate(model.ptr(), prompts, 2, rt, bad), Error);
  EXPECT_THROW(generate(model.ptr(), torch::zeros({2, 0}, torch::kInt64), 2, rt, Sampling{}), Error);
}

TEST(Probe, StatisticsMatchAHandComputation) {
  nn::AttentionProbe probe(2);
  // Two rows at positions 2 and 3 of four keys, seeing their own key.
  const torch::Tensor w =
      torch::tensor({0.5, 0.25, 0.25, 0.0, 0.0, 0.0, 0.0, 1.0}).view({1, 1, 2, 4});
  probe.record(0, w, true,
               {{"remainder", torch::tensor({0.2, 0.4}, torch::kFloat64).view({1, 1, 2})}});
  const nlohmann::json s = probe.summary();
  const nlohmann::json& layer = s["layers"][0];
  EXPECT_NEAR(layer["sink_ratio"][0].get<double>(), (0.5 * 3 + 0.0) / 2, 1e-12);
  EXPECT_NEAR(layer["first_token_share"][0].get<double>(), (0.5 + 0.0) / 2, 1e-12);
  const double h0 = -(0.5 * std::log(0.5) + 2 * 0.25 * std::log(0.25));
  EXPECT_NEAR(layer["entropy"][0].get<double>(), h0 / 2, 1e-12);
  EXPECT_NEAR(layer["zero_fraction"][0].get<double>(), (0.0 / 3 + 3.0 / 4) / 2, 1e-12);
  EXPECT_NEAR(layer["remainder"][0].get<double>(), 0.3, 1e-12);
  EXPECT_NEAR(s["mean"]["remainder"].get<double>(), 0.3, 1e-12);
  // Nonzero weights among the visible keys: 3 and 1.
  EXPECT_NEAR(layer["support"][0].get<double>(), 2.0, 1e-12);
  EXPECT_EQ(layer["support_max"][0].get<double>(), 3.0);
  EXPECT_EQ(s["max"]["support_max"].get<double>(), 3.0);
  EXPECT_FALSE(s["mean"].contains("support_max"));
  // A second batch with a larger support raises the maximum.
  probe.record(0, torch::full({1, 1, 2, 4}, 0.25, torch::kFloat64), true);
  EXPECT_EQ(probe.summary()["layers"][0]["support_max"][0].get<double>(), 4.0);
  probe.clear();
  EXPECT_TRUE(probe.summary()["layers"].empty());
  EXPECT_TRUE(probe.summary()["max"].empty());
}

TEST(Probe, EveryMechanismFeedsIt) {
  for (const std::string kind : {"softmax", "differential", "stick_breaking", "entmax", "sieve", "threshold"}) {
    torch::manual_seed(4);
    nn::TransformerLM model(tiny(kind));
    nn::AttentionProbe probe(3);
    model->attach_probe(&probe);
    torch::NoGradGuard no_grad;
    model->forward(torch::randint(0, 11, {2, 9}, torch::kInt64));
    model->attach_probe(nullptr);
    const nlohmann::json s = probe.summary();
    ASSERT_EQ(s["layers"].size(), 2u) << kind;
    for (const auto& layer : s["layers"]) {
      ASSERT_EQ(layer["sink_ratio"].size(), 2u) << kind;
      EXPECT_GT(layer["entropy"][0].get<double>(), 0.0) << kind;
      EXPECT_EQ(layer.contains("remainder"), kind == "stick_breaking" || kind == "sieve") << kind;
      // The last probed row (position 8) sees 9 keys, or 8 where the current key is excluded.
      ASSERT_EQ(layer["support"].size(), 2u) << kind;
      EXPECT_GE(layer["support"][0].get<double>(), 1.0) << kind;
      EXPECT_LE(layer["support_max"][0].get<double>(), 9.0) << kind;
    }
    // Detached: nothing more is recorded.
    const std::string before = probe.summary().dump();
    model->forward(torch::randint(0, 11, {2, 9}, torch::kInt64));
    EXPECT_EQ(probe.summary().dump(), before);
  }
}

}  // namespace
}  // namespace winnow::eval
