// The model layer on the CPU: every attention layer's forward and gradients through the fused
// operators against the same layer on the composed LibTorch expressions (float64); the
// KV-cache decode against the full forward for every layer kind; RoPE's invariances; ALiBi's
// bias; configuration errors.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <functional>
#include <string>
#include <vector>

#include "nn/composed.h"
#include "nn/layers.h"
#include "nn/rope.h"
#include "nn/transformer.h"
#include "winnow/error.h"

namespace winnow::nn {
namespace {

struct Variant {
  std::string name;
  std::function<void(AttentionConfig&)> set;
  // Dynamic NTK rescales RoPE with the number of tokens seen, so decoding (which sees one
  // more token per step) and one forward pass over the final length rotate differently by
  // design; Rope.DynamicScalingWaitsForTheTrainingLength covers it instead.
  bool cache_consistent = true;
};

const std::vector<Variant>& variants() {
  static const std::vector<Variant> all = {
      {"softmax_rope", [](AttentionConfig&) {}},
      {"softmax_rope_linear16", [](AttentionConfig& a) { a.rope.scaling = "linear"; a.rope.factor = 16; }},
      {"softmax_rope_ntk", [](AttentionConfig& a) { a.rope.scaling = "ntk"; a.rope.factor = 4; }},
      {"softmax_rope_dynamic", [](AttentionConfig& a) { a.rope.scaling = "dynamic"; a.rope.factor = 2; }, false},
      {"softmax_rope_yarn", [](AttentionConfig& a) { a.rope.scaling = "yarn"; a.rope.factor = 8; }},
      {"softmax_nope_gqa", [](AttentionConfig& a) { a.position = "nope"; a.kv_heads = 1; }},
      {"softmax_alibi", [](AttentionConfig& a) { a.position = "alibi"; }},
      {"ssmax", [](AttentionConfig& a) { a.ssmax = true; }},
      {"gated_g1g2", [](AttentionConfig& a) { a.gate = "g1g2"; }},
      {"differential", [](AttentionConfig& a) { a.kind = "differential"; }},
      {"stick_breaking", [](AttentionConfig& a) { a.kind = "stick_breaking"; a.position = "nope"; }},
      {"stick_breaking_rb_gn_rope",
       [](AttentionConfig& a) {
         a.kind = "stick_breaking";
         a.remainder_bias = true;
         a.head_norm = true;
       }},
  };
  return all;
}

ModelConfig tiny(const Variant& v) {
  ModelConfig c;
  c.vocab_size = 11;
  c.d_model = 32;
  c.layers = 2;
  c.max_len = 8;  // shorter than the test sequences: the RoPE scalings and SSMax engage
  c.attention.heads = 4;
  c.attention.kv_heads = 2;
  v.set(c.attention);
  return c;
}

double rel(const torch::Tensor& a, const torch::Tensor& b) {
  return ((a - b).norm() / b.norm().clamp_min(1e-300)).item<double>();
}

class LayerVariants : public ::testing::TestWithParam<int> {};

TEST_P(LayerVariants, KernelMatchesComposedForwardAndGradients) {
  const Variant& v = variants()[static_cast<std::size_t>(GetParam())];
  torch::manual_seed(3);
  ModelConfig kernel_cfg = tiny(v), composed_cfg = tiny(v);
  composed_cfg.attention.implementation = "composed";
  auto kernel = make_attention(kernel_cfg, 1);
  auto composed = make_attention(composed_cfg, 1);
  kernel->to(torch::kFloat64);
  composed->to(torch::kFloat64);
  {
    torch::NoGradGuard no_grad;
    auto src = kernel->named_parameters(), dst = composed->named_parameters();
    ASSERT_EQ(src.size(), dst.size());
    for (const auto& item : src) {
      // Perturb every parameter so zero-initialized ones (remainder bias) matter too.
      item.value().add_(torch::randn_like(item.value()) * 0.1);
      dst[item.key()].copy_(item.value());
    }
  }
  const torch::Tensor x = torch::randn({2, 13, 32}, torch::kFloat64).requires_grad_();
  const torch::Tensor x2 = x.detach().clone().requires_grad_();
  const torch::Tensor w = torch::randn({2, 13, 32}, torch::kFloat64);
  const torch::Tensor y = kernel->forward(x, nullptr), y2 = composed->forward(x2, nullptr);
  (y * w).sum().backward();
  (y2 * w).sum().backward();
  EXPECT_LT(rel(y, y2), 1e-10) << v.name;
  EXPECT_LT(rel(x.grad(), x2.grad()), 1e-10) << v.name;
  auto composed_params = composed->named_parameters();
  for (const auto& item : kernel->named_parameters()) {
    const torch::Tensor& g = item.value().grad();
    ASSERT_TRUE(g.defined()) << v.name << ": no gradient for " << item.key();
    EXPECT_LT(rel(g, composed_params[item.key()].grad()), 1e-9) << v.name << " " << item.key();
  }
}

TEST_P(LayerVariants, KvCacheDecodingReproducesFullForwardLogits) {
  const Variant& v = variants()[static_cast<std::size_t>(GetParam())];
  if (!v.cache_consistent) GTEST_SKIP() << v.name << " is length-dependent by design (see Variant)";
  torch::manual_seed(4);
  TransformerLM model(tiny(v));
  model->to(torch::kFloat64);
  const torch::Tensor tokens = torch::randint(0, 11, {2, 12}, torch::kInt64);
  torch::NoGradGuard no_grad;
  const torch::Tensor full = model->forward(tokens);
  KVCache cache = model->new_cache();
  std::vector<torch::Tensor> pieces = {model->forward(tokens.narrow(1, 0, 5), &cache)};
  for (std::int64_t t = 5; t < 12; ++t) pieces.push_back(model->forward(tokens.narrow(1, t, 1), &cache));
  EXPECT_EQ(cache.length(), 12);
  EXPECT_LT(rel(torch::cat(pieces, 1), full), 1e-10) << v.name;
}

INSTANTIATE_TEST_SUITE_P(Models, LayerVariants, ::testing::Range(0, static_cast<int>(variants().size())),
                         [](const ::testing::TestParamInfo<int>& info) {
                           return variants()[static_cast<std::size_t>(info.param)].name;
                         });

TEST(Rope, ScoresDependOnlyOnRelativePosition) {
  for (const char* scaling : {"none", "linear", "ntk", "yarn"}) {
    RopeConfig c;
    c.scaling = scaling;
    c.factor = 4;
    const Rope rope(c, 16, 64);
    torch::manual_seed(5);
    const torch::Tensor q = torch::randn({1, 1, 1, 16}, torch::kFloat64), k = torch::randn({1, 1, 1, 16}, torch::kFloat64);
    auto score = [&](std::int64_t pq, std::int64_t pk) {
      return (rope.apply(q, pq) * rope.apply(k, pk)).sum().item<double>();
    };
    EXPECT_NEAR(score(10, 3), score(40, 33), 1e-5) << scaling;
    EXPECT_NEAR(score(7, 7), score(100, 100), 1e-5) << scaling;
  }
}

TEST(Rope, DynamicScalingWaitsForTheTrainingLength) {
  RopeConfig none, dynamic;
  dynamic.scaling = "dynamic";
  dynamic.factor = 4;
  const torch::Tensor x = torch::randn({1, 32, 2, 8}, torch::kFloat64);
  // Within the training length (32) nothing changes; beyond it the base grows.
  EXPECT_LT(rel(Rope(dynamic, 8, 32).apply(x, 0), Rope(none, 8, 32).apply(x, 0)), 1e-12);
  EXPECT_GT(rel(Rope(dynamic, 8, 32).apply(x, 16), Rope(none, 8, 32).apply(x, 16)), 1e-3);
}

TEST(Rope, LinearScalingIsPositionInterpolation) {
  RopeConfig none, linear;
  linear.scaling = "linear";
  linear.factor = 4;
  const torch::Tensor x = torch::randn({1, 1, 2, 8}, torch::kFloat64);
  // Position 12 under factor 4 rotates like position 3 unscaled.
  EXPECT_LT(rel(Rope(linear, 8, 64).apply(x, 12), Rope(none, 8, 64).apply(x, 3)), 1e-6);
}

TEST(Alibi, BiasDecaysWithDistanceBySlope) {
  // q = 0: all logits equal, so the weights are exp(-m (j - i)) normalized; v = identity
  // reads them out.
  const std::int64_t L = 5;
  const torch::Tensor q = torch::zeros({1, L, 2, 4}, torch::kFloat64), k = torch::randn({1, L, 2, 4}, torch::kFloat64);
  const torch::Tensor v = torch::eye(L, torch::kFloat64).view({1, L, 1, L}).expand({1, L, 2, L});
  const torch::Tensor slopes = torch::tensor({0.5, 0.25}, torch::kFloat64);
  const torch::Tensor w = composed::softmax_attention(q, k, v, 1.0, true, slopes);
  for (std::int64_t h = 0; h < 2; ++h) {
    const double m = h == 0 ? 0.5 : 0.25;
    double norm = 0;
    for (std::int64_t i = 0; i < L; ++i) norm += std::exp(-m * static_cast<double>(L - 1 - i));
    for (std::int64_t i = 0; i < L; ++i) {
      EXPECT_NEAR(w[0][L - 1][h][i].item<double>(), std::exp(-m * static_cast<double>(L - 1 - i)) / norm, 1e-12);
    }
  }
}

TEST(ModelConfigErrors, NameTheKey) {
  auto expect = [](const std::function<void(ModelConfig&)>& set, const std::string& key) {
    ModelConfig c;
    c.d_model = 32;
    set(c);
    try {
      TransformerLM model(c);
      ADD_FAILURE() << "no error for " << key;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("'" + key + "'"), std::string::npos) << e.what();
    }
  };
  expect([](ModelConfig& c) { c.attention.kind = "magic"; }, "model.attention.kind");
  expect([](ModelConfig& c) { c.attention.kv_heads = 3; }, "model.attention.kv_heads");
  expect([](ModelConfig& c) { c.attention.position = "sinusoid"; }, "model.attention.position");
  expect([](ModelConfig& c) { c.attention.gate = "g3"; }, "model.attention.gate");
  expect([](ModelConfig& c) { c.attention.implementation = "fast"; }, "model.attention.implementation");
  expect([](ModelConfig& c) { c.mlp = "relu"; }, "model.mlp");
  expect([](ModelConfig& c) { c.attention.heads = 5; }, "model.attention.heads");
  expect([](ModelConfig& c) {
    c.attention.kind = "stick_breaking";
    c.attention.position = "alibi";
  }, "model.attention.position");
}

}  // namespace
}  // namespace winnow::nn
