// The Multiscreen language model (nn/multiscreen.h): its forward against a float64 composition
// written here from spec/screening.md (unit-norm tied embeddings, gated screening tiles, no
// norms), the kernel and composed implementations agreeing on logits and every gradient,
// incremental decoding through the cache equal to the full forward, 001's initialization, and
// the architecture key.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>
#include <cstdio>

#include "nn/composed.h"
#include "nn/language_model.h"
#include "nn/multiscreen.h"
#include "support/expect_error.h"
#include "winnow/error.h"

namespace winnow::nn {
namespace {

namespace F = torch::nn::functional;

ModelConfig small_config(const std::string& implementation = "kernel") {
  ModelConfig c;
  c.architecture = "multiscreen";
  c.vocab_size = 13;
  c.d_model = 16;
  c.layers = 2;
  c.context_len = 64;
  c.multiscreen.tiles = 3;
  c.multiscreen.key_dim = 4;
  c.multiscreen.value_dim = 6;
  c.multiscreen.implementation = implementation;
  return c;
}

// The spec's model, float64, from the parameters of `model`.
torch::Tensor reference_logits(MultiscreenLMImpl& model, const torch::Tensor& tokens) {
  auto p = model.named_parameters();
  const ModelConfig& c = model.config();
  const std::int64_t t = c.multiscreen.tiles, dk = c.multiscreen.key_dim, dv = c.multiscreen.value_dim;
  const std::int64_t b = tokens.size(0), l = tokens.size(1);
  const torch::Tensor w_e = p["embedding"];
  const torch::Tensor unit = w_e / w_e.norm(2, 1, true);
  torch::Tensor x = unit.index_select(0, tokens.reshape({-1})).view({b, l, c.d_model}) * torch::exp(p["s_e"]);
  for (std::int64_t layer = 0; layer < c.layers; ++layer) {
    const std::string n = "layer" + std::to_string(layer) + ".";
    const torch::Tensor w_in = p[n + "input_projection"];
    const torch::Tensor w_q = w_in.narrow(0, 0, t * dk), w_k = w_in.narrow(0, t * dk, t * dk);
    const torch::Tensor w_v = w_in.narrow(0, 2 * t * dk, t * dv), w_g = w_in.narrow(0, 2 * t * dk + t * dv, t * dv);
    const torch::Tensor q = torch::matmul(x, w_q.t()).view({b, l, t, dk});
    const torch::Tensor k = torch::matmul(x, w_k.t()).view({b, l, t, dk});
    const torch::Tensor v = torch::matmul(x, w_v.t()).view({b, l, t, dv});
    const torch::Tensor g = torch::matmul(x, w_g.t()).view({b, l, t, dv});
    const torch::Tensor u = composed::screening(q, k, v, p[n + "s_w"], p[n + "s_r"], c.multiscreen.mipe_threshold,
                                                c.multiscreen.window_expansion);
    const torch::Tensor z = u * torch::tanh(g * torch::sigmoid(g)) * torch::exp(p[n + "s_o"]).view({1, 1, t, 1});
    x = x + torch::matmul(z.reshape({b, l, t * dv}), p[n + "output_projection"].t());
  }
  return torch::matmul(x, unit.t()) * torch::exp(p["s_f"]);
}

torch::Tensor random_tokens(std::int64_t b, std::int64_t l, std::int64_t vocab, std::uint64_t seed) {
  torch::manual_seed(seed);
  return torch::randint(vocab, {b, l}, torch::kInt64);
}

TEST(Multiscreen, ForwardMatchesTheSpecsComposition) {
  torch::manual_seed(3);
  MultiscreenLM model(small_config());
  model->to(torch::kFloat64);
  // Acceptance widths near 1 so that many keys pass the Trim (at r = 0.5 few do at init).
  {
    torch::NoGradGuard no_grad;
    for (auto& item : model->named_parameters()) {
      if (item.key().find("s_r") != std::string::npos) item.value().fill_(3.0);
    }
  }
  const torch::Tensor tokens = random_tokens(2, 40, 13, 5);
  const torch::Tensor got = model->forward(tokens), want = reference_logits(*model, tokens);
  EXPECT_EQ(got.sizes(), torch::IntArrayRef({2, 40, 13}));
  EXPECT_LT((got - want).abs().max().item<double>(), 1e-10 * want.abs().max().item<double>());
}

TEST(Multiscreen, KernelAndComposedAgreeOnLogitsAndGradients) {
  torch::manual_seed(4);
  MultiscreenLM kernel(small_config("kernel")), composed_model(small_config("composed"));
  kernel->to(torch::kFloat64);
  composed_model->to(torch::kFloat64);
  {
    torch::NoGradGuard no_grad;
    auto a = kernel->named_parameters();
    auto b = composed_model->named_parameters();
    for (auto& item : a) {
      if (item.key().find("s_r") != std::string::npos) item.value().fill_(2.5);
      b[item.key()].copy_(item.value());
    }
  }
  const torch::Tensor tokens = random_tokens(2, 33, 13, 6);
  const torch::Tensor w = torch::randn({2, 33, 13}, torch::kFloat64);
  const torch::Tensor la = kernel->forward(tokens), lb = composed_model->forward(tokens);
  EXPECT_LT((la - lb).abs().max().item<double>(), 1e-10);
  (la * w).sum().backward();
  (lb * w).sum().backward();
  auto pb = composed_model->named_parameters();
  for (const auto& item : kernel->named_parameters()) {
    const torch::Tensor ga = item.value().grad(), gb = pb[item.key()].grad();
    ASSERT_TRUE(ga.defined()) << item.key();
    EXPECT_LT((ga - gb).abs().max().item<double>(), 1e-9 * (1 + gb.abs().max().item<double>())) << item.key();
  }
}

// Prefill, then one token at a time through the cache: the logits of the full forward.
TEST(Multiscreen, DecodingThroughTheCacheMatchesTheFullForward) {
  torch::manual_seed(5);
  MultiscreenLM model(small_config());
  model->to(torch::kFloat64);
  torch::NoGradGuard no_grad;
  const torch::Tensor tokens = random_tokens(2, 30, 13, 7);
  const torch::Tensor full = model->forward(tokens);
  KVCache cache = model->new_cache();
  std::vector<torch::Tensor> steps = {model->forward(tokens.narrow(1, 0, 11), &cache)};
  for (std::int64_t i = 11; i < 30; ++i) steps.push_back(model->forward(tokens.narrow(1, i, 1), &cache));
  EXPECT_EQ(cache.length(), 30);
  EXPECT_LT((torch::cat(steps, 1) - full).abs().max().item<double>(), 1e-11);
}

// Windows of at most 5 keys: the cache keeps O(window) keys (positions become relative, which
// MiPE and the Softmask cannot tell apart), and decoding still matches the full forward; with
// the windows expanded to infinity it keeps every key.
TEST(Multiscreen, DecodingKeepsOnlyTheKeysTheWindowsReach) {
  torch::manual_seed(6);
  ModelConfig c = small_config();
  c.multiscreen.mipe_threshold = 16;  // MiPE active at these windows
  for (const double expansion : {0.0, 4.5}) {
    c.multiscreen.window_expansion = expansion;
    MultiscreenLM model(c);
    model->to(torch::kFloat64);
    torch::NoGradGuard no_grad;
    for (auto& item : model->named_parameters()) {
      if (item.key().find("s_w") != std::string::npos) {
        item.value().copy_(torch::tensor({std::log(1.5), std::log(3.0), std::log(4.0)}, torch::kFloat64));
      }
      if (item.key().find("s_r") != std::string::npos) item.value().fill_(3.0);
    }
    const torch::Tensor tokens = random_tokens(2, 40, 13, 9);
    const torch::Tensor full = model->forward(tokens);
    KVCache cache = model->new_cache();
    std::vector<torch::Tensor> steps = {model->forward(tokens.narrow(1, 0, 9), &cache)};
    std::int64_t most = 0;
    for (std::int64_t i = 9; i < 40; ++i) {
      steps.push_back(model->forward(tokens.narrow(1, i, 1), &cache));
      most = std::max(most, cache.length());
    }
    EXPECT_LT((torch::cat(steps, 1) - full).abs().max().item<double>(), 1e-11) << expansion;
    if (expansion == 0.0) {
      EXPECT_LE(most, 2 * 7);  // keep = ceil(w_max = 5) + 1
    } else {
      EXPECT_EQ(cache.length(), 40);  // a window of 5 > 4.5 is infinite
    }
  }
}

// 001 appendix D: windows spaced from 2 to w_th + 1 over a layer's tiles, r = 0.5,
// s_O = log(1 / sqrt(tiles * layers)), s_E = 0, s_F = log(sqrt(d_E)), unit-norm embedding rows
// of N(0, (0.1 / sqrt(d_E))^2) entries.
TEST(Multiscreen, InitializationFollows001) {
  ModelConfig c = small_config();
  c.d_model = 64;
  c.layers = 4;
  c.multiscreen.tiles = 5;
  MultiscreenLM model(c);
  auto p = model->named_parameters();
  const torch::Tensor s_w = p["layer1.s_w"];
  EXPECT_NEAR(s_w[0].item<double>(), 0.0, 1e-7);
  EXPECT_NEAR(s_w[4].item<double>(), std::log(256.0), 1e-5);
  EXPECT_NEAR((torch::exp(s_w[4]) + 1).item<double>(), 257.0, 1e-3);
  EXPECT_EQ(p["layer0.s_r"].abs().max().item<double>(), 0.0);
  EXPECT_NEAR(p["layer3.s_o"][2].item<double>(), std::log(1.0 / std::sqrt(20.0)), 1e-6);
  EXPECT_NEAR(p["s_f"].item<double>(), std::log(8.0), 1e-6);
  EXPECT_NEAR(p["embedding"].std().item<double>(), 0.1 / 8.0, 0.002);
  // Parameters: embedding, and per layer W_in, W_out and three scalars per tile.
  std::int64_t n = 0;
  for (const auto& t : model->parameters()) n += t.numel();
  EXPECT_EQ(n, 13 * 64 + 2 + 4 * (5 * (2 * 4 + 2 * 6) * 64 + 64 * 5 * 6 + 3 * 5));
}

// Checkpoints go through LibTorch's archives, whose names must not be TorchScript keywords
// ("in" was one): a saved model loads into a fresh one with every parameter.
TEST(Multiscreen, RoundTripsThroughAnArchive) {
  torch::manual_seed(8);
  MultiscreenLM model(small_config()), fresh(small_config());
  const std::string path = ::testing::TempDir() + "multiscreen_archive.pt";
  {
    torch::serialize::OutputArchive out;
    model->save(out);
    out.save_to(path);
  }
  torch::serialize::InputArchive in;
  in.load_from(path);
  fresh->load(in);
  auto loaded = fresh->named_parameters();
  for (const auto& item : model->named_parameters()) {
    EXPECT_TRUE(torch::equal(item.value(), loaded[item.key()])) << item.key();
  }
  std::remove(path.c_str());
}

TEST(Multiscreen, ArchitectureIsAConfigKey) {
  ModelConfig c = small_config();
  EXPECT_NE(dynamic_cast<MultiscreenLMImpl*>(make_language_model(c).get()), nullptr);
  c.architecture = "recurrent";
  winnow::testing::expect_error([&] { make_language_model(c); }, "architecture");
  const nlohmann::json written = write_model(small_config());
  EXPECT_EQ(written["architecture"], "multiscreen");
  EXPECT_EQ(read_model(written).multiscreen.tiles, 3);
}

}  // namespace
}  // namespace winnow::nn
