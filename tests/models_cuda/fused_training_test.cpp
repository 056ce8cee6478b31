// The model layer's fused pieces on CUDA against the composed LibTorch expressions they replace
// (rotary embedding, RMSNorm), forward and gradients; winnow's clipped AdamW against
// torch::optim::AdamW; and the CUDA trainer's
// asynchronous step (pinned batches drawn ahead, reports read two steps later, the update
// skipped on the device for a diverged step) against synchronous steps and across a resume.
// Label `cuda`: runs on a machine with a GPU (tools/gpu_check.sh).
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>
#include <functional>
#include <limits>
#include <string>
#include <vector>

#include "models/trainer_test_support.h"
#include "support/adamw_case.h"
#include "nn/language_model.h"
#include "nn/modules.h"
#include "nn/transformer.h"
#include "train/autocast.h"
#include "train/config.h"
#include "train/files.h"
#include "train/trainer.h"
#include "winnow/error.h"

namespace winnow::train {
namespace {
using torch::Tensor;

double rel(const Tensor& a, const Tensor& b) {
  const Tensor a64 = a.to(torch::kCPU, torch::kFloat64), b64 = b.to(torch::kCPU, torch::kFloat64);
  return ((a64 - b64).norm() / b64.norm().clamp_min(1e-300)).item<double>();
}

const torch::Device kCuda(torch::kCUDA, 0);

TEST(CudaFusedPieces, RotaryMatchesTheComposedExpression) {
  for (const char* scaling : {"none", "yarn", "dynamic"}) {
    for (torch::ScalarType dtype : {torch::kBFloat16, torch::kFloat32}) {
      nn::RopeConfig c;
      c.scaling = scaling;
      c.factor = 4;
      const nn::Rope composed(c, 64, 32), fused(c, 64, 32, /*fused=*/true);
      torch::manual_seed(2);
      const Tensor x = torch::randn({3, 37, 5, 64}, torch::TensorOptions().dtype(dtype).device(kCuda))
                           .requires_grad_(true);
      const Tensor w = torch::randn_like(x);
      const Tensor y_composed = composed.apply(x, 7, 44), y_fused = fused.apply(x, 7, 44);
      const Tensor g_composed = torch::autograd::grad({(y_composed.to(torch::kFloat32) * w).sum()}, {x})[0];
      const Tensor g_fused = torch::autograd::grad({(y_fused.to(torch::kFloat32) * w).sum()}, {x})[0];
      // Both rotate in float32 and round once to the input's dtype.
      const double tol = dtype == torch::kBFloat16 ? 4e-3 : 1e-6;
      EXPECT_EQ(y_fused.scalar_type(), dtype);
      EXPECT_LT(rel(y_fused, y_composed), tol) << scaling;
      EXPECT_LT(rel(g_fused, g_composed), tol) << scaling;
    }
  }
}

TEST(CudaFusedPieces, RmsNormMatchesTheComposedExpression) {
  torch::manual_seed(3);
  nn::RMSNorm norm(96, 1e-5);
  norm->to(kCuda);
  {
    torch::NoGradGuard no_grad;
    norm->named_parameters()["weight"].normal_(1.0, 0.2);
  }
  const Tensor weight = norm->named_parameters()["weight"];
  const Tensor x = torch::randn({4, 33, 96}, torch::TensorOptions().device(kCuda)).requires_grad_(true);
  const Tensor w = torch::randn_like(x);
  const Tensor y = norm(x);
  const Tensor expected = x * torch::rsqrt(x.pow(2).mean(-1, true) + 1e-5) * weight;
  EXPECT_LT(rel(y, expected), 1e-6);
  const auto g = torch::autograd::grad({(y * w).sum()}, {x, weight});
  const auto ge = torch::autograd::grad({(expected * w).sum()}, {x, weight});
  EXPECT_LT(rel(g[0], ge[0]), 1e-5);
  EXPECT_LT(rel(g[1], ge[1]), 1e-5);
}

// QK-norm's use: bf16 head vectors (projections made under autocast) through the kernel, into
// bf16, against the composed float32 expression rounded the same way.
TEST(CudaFusedPieces, RmsNormOfBf16HeadsMatchesTheComposedExpression) {
  torch::manual_seed(5);
  nn::RMSNorm norm(64, 1e-6);
  norm->to(kCuda);
  {
    torch::NoGradGuard no_grad;
    norm->named_parameters()["weight"].normal_(1.0, 0.2);
  }
  const Tensor weight = norm->named_parameters()["weight"];
  const auto bf16 = torch::TensorOptions().device(kCuda).dtype(torch::kBFloat16);
  const Tensor x = (3 * torch::randn({4, 33, 5, 64}, bf16)).requires_grad_(true);
  const Tensor w = torch::randn({4, 33, 5, 64}, torch::TensorOptions().device(kCuda));
  Tensor y;
  {
    const train::Autocast autocast(true);
    y = norm(x);
  }
  ASSERT_EQ(y.scalar_type(), torch::kBFloat16);
  const Tensor xf = x.to(torch::kFloat32);
  const Tensor y_want = xf * torch::rsqrt(xf.pow(2).mean(-1, true) + 1e-6) * weight;
  EXPECT_LT(rel(y.to(torch::kFloat32), y_want), 4e-3);
  const auto g = torch::autograd::grad({(y.to(torch::kFloat32) * w).sum()}, {x, weight});
  // The kernel gets y's gradient in bf16: the reference rounds it the same way.
  const auto ge = torch::autograd::grad(
      {(y_want * w.to(torch::kBFloat16).to(torch::kFloat32)).sum()}, {x, weight});
  EXPECT_EQ(g[0].scalar_type(), torch::kBFloat16);
  EXPECT_LT(rel(g[0].to(torch::kFloat32), ge[0].to(torch::kFloat32)), 8e-3);
  EXPECT_LT(rel(g[1], ge[1]), 1e-3);
}

// The residual form under autocast, as the transformer uses it: a float32 stream plus a bf16
// branch output, normalized into bf16; both outputs used downstream.
TEST(CudaFusedPieces, AddRmsNormMatchesTheComposedExpressionUnderAutocast) {
  torch::manual_seed(4);
  nn::RMSNorm norm(256, 1e-5);
  norm->to(kCuda);
  {
    torch::NoGradGuard no_grad;
    norm->named_parameters()["weight"].normal_(1.0, 0.2);
  }
  const Tensor weight = norm->named_parameters()["weight"];
  const auto f32 = torch::TensorOptions().device(kCuda);
  const Tensor x = torch::randn({4, 33, 256}, f32).requires_grad_(true);
  const Tensor r = torch::randn({4, 33, 256}, f32.dtype(torch::kBFloat16)).requires_grad_(true);
  const Tensor ws = torch::randn({4, 33, 256}, f32), wy = torch::randn({4, 33, 256}, f32);
  Tensor s, y;
  {
    const train::Autocast autocast(true);
    std::tie(s, y) = norm->add_forward(x, r);
  }
  ASSERT_EQ(s.scalar_type(), torch::kFloat32);
  ASSERT_EQ(y.scalar_type(), torch::kBFloat16);
  const Tensor s_want = x + r.to(torch::kFloat32);
  const Tensor y_want = s_want * torch::rsqrt(s_want.pow(2).mean(-1, true) + 1e-5) * weight;
  EXPECT_LT(rel(s, s_want), 1e-7);
  EXPECT_LT(rel(y.to(torch::kFloat32), y_want), 4e-3);  // bf16 rounding of y
  const Tensor loss = (s * ws).sum() + (y.to(torch::kFloat32) * wy).sum();
  // y's gradient reaches the kernel rounded to bf16: the reference rounds it the same way.
  const Tensor loss_want = (s_want * ws).sum() + (y_want.to(torch::kBFloat16).to(torch::kFloat32) * wy).sum();
  const auto g = torch::autograd::grad({loss}, {x, r, weight});
  const auto ge = torch::autograd::grad({loss_want}, {x, r, weight});
  EXPECT_EQ(g[1].scalar_type(), torch::kBFloat16);
  EXPECT_LT(rel(g[0], ge[0]), 1e-5);
  EXPECT_LT(rel(g[1].to(torch::kFloat32), ge[1].to(torch::kFloat32)), 4e-3);
  EXPECT_LT(rel(g[2], ge[2]), 1e-5);
}

// winnow's clipped AdamW kernels (winnow/adamw.h) against torch::optim::AdamW in float64 after
// torch's clip, over more tensors than one launch takes (48) and tensors of many chunks, one
// chunk, part of one and none; then a step skipped by a non-finite guard.
TEST(CudaAdamW, MatchesTorchOptimAdamWAfterTheClip) {
  torch::manual_seed(5);
  std::vector<std::vector<std::int64_t>> shapes;
  for (int i = 0; i < 110; ++i) shapes.push_back({1 + (i * 37) % 300});
  shapes.push_back({0});
  shapes.push_back({2048});
  shapes.push_back({3, 5000});
  shapes.push_back({257, 256});
  testing::AdamWCase c(shapes, kCuda);
  const std::pair<double, double> steps[] = {{1.0, 1.0}, {1e-3, 1.0}, {1.0, 0.0}, {3.0, 2.0}};
  for (const auto& [size, max_norm] : steps) {
    const std::vector<Tensor> grads = c.gradients(size);
    const Tensor norm = torch_ops::clipped_adamw_step(c.groups(grads), testing::AdamWCase::kBeta1,
                                                      testing::AdamWCase::kBeta2, testing::AdamWCase::kEps, max_norm);
    const double expected = c.reference_step(grads, max_norm);
    EXPECT_TRUE(norm.is_cuda());
    EXPECT_NEAR(norm.item<double>(), expected, 1e-6 * expected);
    EXPECT_LT(c.worst_parameter_error(), 1e-6) << "gradient size " << size << ", max_norm " << max_norm;
  }
  std::vector<Tensor> before;
  for (const Tensor& p : c.params) before.push_back(p.clone());
  const Tensor nan_loss = torch::full({}, std::numeric_limits<float>::quiet_NaN(), torch::TensorOptions().device(kCuda));
  torch_ops::clipped_adamw_step(c.groups(c.gradients(1.0)), testing::AdamWCase::kBeta1, testing::AdamWCase::kBeta2,
                                testing::AdamWCase::kEps, 1.0, {nan_loss});
  for (std::size_t i = 0; i < before.size(); ++i) EXPECT_TRUE(torch::equal(before[i], c.params[i])) << i;
  for (const Tensor& s : c.steps) EXPECT_EQ(s.item<float>(), 4.0f);
}

// The trainer's step on the optimizer's own state: moments and step counts where
// torch::optim::AdamW keeps them, so that checkpoints read the same.
TEST(CudaAdamW, TrainerStepKeepsTorchOptimState) {
  ASSERT_TRUE(device_adamw_available(kCuda));
  torch::manual_seed(4);
  std::vector<Tensor> mine, theirs;
  for (auto shape : {std::vector<std::int64_t>{64, 48}, {48}, {7, 3, 5}}) {
    const Tensor p = torch::randn(shape, torch::TensorOptions().device(kCuda));
    mine.push_back(p.clone().requires_grad_(true));
    theirs.push_back(p.clone().requires_grad_(true));
  }
  auto make = [](std::vector<Tensor>& params) {
    std::vector<torch::optim::OptimizerParamGroup> groups;
    auto decay = std::make_unique<torch::optim::AdamWOptions>(2e-3);
    decay->betas({0.9, 0.95}).eps(1e-8).weight_decay(0.1);
    groups.emplace_back(std::vector<Tensor>{params[0], params[2]}, std::move(decay));
    auto plain = std::make_unique<torch::optim::AdamWOptions>(1e-3);
    plain->betas({0.9, 0.95}).eps(1e-8).weight_decay(0.0);
    groups.emplace_back(std::vector<Tensor>{params[1]}, std::move(plain));
    return torch::optim::AdamW(groups, torch::optim::AdamWOptions(1e-3));
  };
  torch::optim::AdamW device = make(mine), reference = make(theirs);
  const auto on_cuda = torch::TensorOptions().device(kCuda);
  const std::vector<Tensor> lrs = {torch::full({}, 2e-3, on_cuda), torch::full({}, 1e-3, on_cuda)};
  std::map<const void*, Tensor> steps;
  for (int step = 0; step < 5; ++step) {
    for (std::size_t i = 0; i < mine.size(); ++i) {
      const Tensor g = torch::randn_like(mine[i]);
      mine[i].mutable_grad() = g.clone();
      theirs[i].mutable_grad() = g.clone();
    }
    if (step == 2) {
      // A skipped step: nothing moves, and the next step is the reference's third.
      std::vector<Tensor> before;
      for (const Tensor& p : mine) before.push_back(p.detach().clone());
      device_adamw_step(device, steps, lrs, 0.0, {torch::full({}, INFINITY, on_cuda)});
      for (std::size_t i = 0; i < mine.size(); ++i) EXPECT_TRUE(torch::equal(before[i], mine[i]));
      continue;
    }
    device_adamw_step(device, steps, lrs, 0.0, {torch::zeros({}, on_cuda)});
    reference.step();
    for (std::size_t i = 0; i < mine.size(); ++i) EXPECT_LT(rel(mine[i], theirs[i]), 1e-6) << step << " " << i;
  }
  sync_optimizer_steps(device, steps);
  EXPECT_EQ(device.state().size(), mine.size());
  for (const auto& entry : device.state()) {
    EXPECT_EQ(static_cast<const torch::optim::AdamWParamState&>(*entry.second).step(), 4);
  }
}

// The trainer's loss (winnow/cross_entropy.h) on CUDA against log_softmax, gather and sum in
// float64 on the CPU: the loss and the logits' gradient in every logits dtype, rows that are not
// a multiple of the block's eight, one-column, odd and wide vocabularies, fractional and zero
// mask values; a counted row with a target out of range makes the loss NaN.
TEST(CudaCrossEntropy, MatchesLogSoftmaxGatherAndSum) {
  torch::manual_seed(8);
  for (auto dtype : {torch::kBFloat16, torch::kFloat16, torch::kFloat32, torch::kFloat64}) {
    for (std::int64_t v : {1, 259, 5000}) {
      const Tensor wide = torch::randn({1001, v + 3}, torch::kFloat64) * 3;
      const Tensor logits = wide.to(torch::TensorOptions().device(kCuda).dtype(dtype)).narrow(-1, 1, v);
      const Tensor targets = torch::randint(0, v, {1001}, torch::kInt64);
      const auto stats = dtype == torch::kFloat64 ? torch::kFloat64 : torch::kFloat32;
      const Tensor mask = ((torch::rand({1001}) > 0.25).to(torch::kFloat64) * torch::rand({1001}, torch::kFloat64));
      const Tensor x = logits.detach().requires_grad_(true);
      const Tensor loss = torch_ops::masked_cross_entropy_sum(x, targets.to(kCuda), mask.to(kCuda, stats));
      const Tensor grad = torch::autograd::grad({loss * 0.5}, {x})[0];
      const Tensor ref_x = logits.detach().to(torch::kCPU, torch::kFloat64).requires_grad_(true);
      const Tensor logp = torch::log_softmax(ref_x, -1);
      const Tensor expected = -(logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1) * mask.to(stats).to(torch::kFloat64)).sum();
      const Tensor ref_grad = torch::autograd::grad({expected * 0.5}, {ref_x})[0];
      const double tol = dtype == torch::kFloat64 ? 1e-12 : 1e-5;
      const double grad_tol = dtype == torch::kBFloat16 ? 1e-2 : dtype == torch::kFloat16 ? 2e-3 : tol;
      EXPECT_EQ(loss.scalar_type(), stats);
      EXPECT_NEAR(loss.item<double>(), expected.item<double>(), tol * std::abs(expected.item<double>()))
          << dtype << " V " << v;
      EXPECT_EQ(grad.scalar_type(), dtype);
      EXPECT_LT(rel(grad, ref_grad), grad_tol) << dtype << " V " << v;
    }
  }
  // A divisor on the device: the same bits as dividing afterwards (the trainer's old expression).
  for (auto dtype : {torch::kBFloat16, torch::kFloat32}) {
    const Tensor x = (torch::randn({777, 64}, torch::TensorOptions().device(kCuda)) * 2).to(dtype).requires_grad_(true);
    const Tensor targets = torch::randint(0, 64, {777}, torch::TensorOptions().dtype(torch::kInt64).device(kCuda));
    const Tensor mask = (torch::rand({777}, torch::TensorOptions().device(kCuda)) > 0.5).to(torch::kFloat32);
    const Tensor counted = mask.sum();
    const Tensor inside = torch_ops::masked_cross_entropy_sum(x, targets, mask, counted);
    const Tensor grad_inside = torch::autograd::grad({inside}, {x})[0];
    const Tensor after = torch_ops::masked_cross_entropy_sum(x, targets, mask) / counted;
    const Tensor grad_after = torch::autograd::grad({after}, {x})[0];
    EXPECT_TRUE(torch::equal(inside, after)) << dtype;
    EXPECT_TRUE(torch::equal(grad_inside, grad_after)) << dtype;
  }
  const Tensor logits = torch::randn({9, 4}, torch::TensorOptions().device(kCuda));
  const Tensor targets = torch::tensor({0, 1, 2, 3, 0, 1, 2, 3, 7}, torch::TensorOptions().dtype(torch::kInt64).device(kCuda));
  Tensor mask = torch::ones({9}, torch::TensorOptions().device(kCuda));
  EXPECT_TRUE(std::isnan(torch_ops::masked_cross_entropy_sum(logits, targets, mask).item<float>()));
  mask[8] = 0.0f;
  EXPECT_TRUE(std::isfinite(torch_ops::masked_cross_entropy_sum(logits, targets, mask).item<float>()));
}

// ------------------------------------------------------------------ the CUDA trainer

ExperimentConfig small(const std::string& out_dir, const std::string& kind,
                       const nlohmann::json& options = nlohmann::json::object()) {
  nlohmann::json j = {
      {"seed", 7},
      {"device", "cuda"},
      {"model", {{"d_model", 64}, {"layers", 2}, {"attention", {{"kind", kind}, {"heads", 2}}}}},
      {"train",
       {{"steps", 6}, {"batch_size", 8}, {"grad_accum", 2}, {"seq_len", 32}, {"lr", 3e-3},
        {"warmup", 2}, {"clip", 1.0}, {"log_every", 2}, {"eval_batches", 1},
        {"deterministic", true}, {"out_dir", out_dir}}},
      {"task", {{"name", "progression"}, {"vocab_size", 12}}},
  };
  if (kind == "softmax") j["model"]["attention"]["position"] = "rope";
  for (const auto& [key, value] : options.items()) j["model"]["attention"][key] = value;
  return parse_experiment(j);
}

// The casting concatenation (winnow/cast.h) on CUDA: every pair of float dtypes, 70 sources
// (two launches of at most 64), odd sizes, an empty one and one long enough for several blocks,
// bit for bit what LibTorch's concatenation and conversion give (float64 to 16 bits: at least as
// close to the float64 value, since LibTorch rounds twice).
TEST(CudaCast, MatchesCatThenToForEveryPairOfDtypes) {
  torch::manual_seed(14);
  const std::vector<torch::ScalarType> dtypes = {torch::kBFloat16, torch::kFloat16, torch::kFloat32, torch::kFloat64};
  for (const auto from : dtypes) {
    std::vector<Tensor> sources, flat;
    for (int s = 0; s < 70; ++s) {
      const std::int64_t n = s == 5 ? 0 : s == 9 ? 300007 : 1 + (s * 37) % 301;
      // Values past float16's range, and below its smallest normal, for the rounding's edges.
      sources.push_back((torch::randn({n}, torch::kFloat64) * std::pow(10.0, s % 9 - 4)).to(torch::TensorOptions().dtype(from).device(kCuda)));
      flat.push_back(sources.back());
    }
    for (const auto to : dtypes) {
      const Tensor out = torch_ops::cast_concatenate(sources, to);
      const Tensor expected = torch::cat(flat).to(to);
      EXPECT_EQ(out.scalar_type(), to);
      if (from == torch::kFloat64 && (to == torch::kBFloat16 || to == torch::kFloat16)) {
        // LibTorch rounds float64 to float32 first, then to 16 bits (twice); the kernel rounds
        // once, so it is never further from the float64 value.
        const Tensor exact = torch::cat(flat).to(torch::kFloat64);
        EXPECT_TRUE(((out.to(torch::kFloat64) - exact).abs() <= (expected.to(torch::kFloat64) - exact).abs()).all().item<bool>())
            << from << " to " << to;
        continue;
      }
      EXPECT_TRUE(torch::equal(out, expected)) << from << " to " << to;
    }
  }
}

// The weight-cast plan under bf16 autocast (nn::WeightCastPlan): the first pass casts per
// product and learns the groups, the later ones project with copies made in one launch; logits
// and every gradient bit for bit the same, and the plan holds all nine products of a two-layer
// model (q k v, the output, gate and up, down per block; the tied head).
TEST(CudaWeightCasts, LaterPassesEqualTheFirstBitForBit) {
  const ExperimentConfig config = small(scratch("cuda-weight-casts"), "softmax");
  torch::manual_seed(15);
  const nn::LanguageModel model = nn::make_language_model(config.model);
  model->to(kCuda);
  const Tensor tokens = torch::randint(config.model.vocab_size, {3, 40}, torch::TensorOptions().dtype(torch::kInt64).device(kCuda));
  std::vector<Tensor> logits, grads;
  for (int pass = 0; pass < 3; ++pass) {
    model->zero_grad();
    Tensor y;
    {
      Autocast autocast(true);
      y = model->forward(tokens);
    }
    (y.to(torch::kFloat32) * torch::linspace(-1, 1, y.size(-1), torch::TensorOptions().device(kCuda))).sum().backward();
    logits.push_back(y.detach());
    std::vector<Tensor> g;
    for (const auto& p : model->parameters()) g.push_back(p.grad().reshape(-1));
    grads.push_back(torch::cat(g));
  }
  const auto* transformer = dynamic_cast<const nn::TransformerLMImpl*>(model.get());
  ASSERT_NE(transformer, nullptr);
  EXPECT_EQ(transformer->weight_casts().size(), static_cast<std::size_t>(4 * config.model.layers + 1));
  for (int pass = 1; pass < 3; ++pass) {
    EXPECT_TRUE(torch::equal(logits[pass], logits[0])) << "pass " << pass;
    EXPECT_TRUE(torch::equal(grads[pass], grads[0])) << "pass " << pass;
  }
}

// The Multiscreen model on CUDA through the screening kernels (the simple path in float32,
// the fused one under bf16 autocast, d_K 16 / d_V 64) against its composed LibTorch screening
// on the CPU in float64: logits and every parameter's gradient, over more positions than the
// widest initial window (257) so that window skipping and MiPE's fade both matter.
TEST(CudaMultiscreen, ModelMatchesTheComposedModelOnTheCpu) {
  nn::ModelConfig c;
  c.architecture = "multiscreen";
  c.vocab_size = 29;
  c.d_model = 64;
  c.layers = 2;
  c.context_len = 320;
  c.multiscreen.tiles = 4;
  c.multiscreen.implementation = "kernel";
  torch::manual_seed(11);
  const nn::LanguageModel gpu = nn::make_language_model(c);
  c.multiscreen.implementation = "composed";
  const nn::LanguageModel cpu = nn::make_language_model(c);
  {
    torch::NoGradGuard no_grad;
    auto from = gpu->named_parameters();
    for (auto& item : cpu->named_parameters()) {
      // Wider acceptance than 001's r = 0.5, so that many pairs pass the Trim.
      if (item.key().find("s_r") != std::string::npos) from[item.key()].fill_(2.0);
      item.value().copy_(from[item.key()]);
    }
  }
  cpu->to(torch::kFloat64);
  gpu->to(kCuda);
  const Tensor tokens = torch::randint(29, {2, 320}, torch::kInt64);
  const Tensor w = torch::randn({2, 320, 29}, torch::kFloat64);
  const Tensor want = cpu->forward(tokens);
  (want * w).sum().backward();
  for (const bool bf16 : {false, true}) {
    gpu->zero_grad();
    Tensor got;
    {
      Autocast autocast(bf16);
      got = gpu->forward(tokens.to(kCuda));
    }
    (got.to(torch::kFloat64) * w.to(kCuda)).sum().backward();
    const double tol = bf16 ? 3e-2 : 1e-4;
    EXPECT_LT(rel(got, want), tol) << (bf16 ? "bf16" : "float32");
    auto cpu_params = cpu->named_parameters();
    for (const auto& item : gpu->named_parameters()) {
      ASSERT_TRUE(item.value().grad().defined()) << item.key();
      EXPECT_LT(rel(item.value().grad(), cpu_params[item.key()].grad()), bf16 ? 8e-2 : 1e-3)
          << item.key() << (bf16 ? " bf16" : " float32");
    }
  }
}

// The GSA model on CUDA (selection and sparse attention kernels, float32) against the same
// model on the CPU in float64 with the composed sparse attention: logits and the gradients the
// logits reach. The indexer's weights are scaled up so that its scores are well apart: near
// ties would let float32 and float64 select different keys. Under bf16 autocast the selection
// may differ from float64's, so only finiteness is checked there.
TEST(CudaGsa, ModelMatchesTheComposedModelOnTheCpu) {
  nn::ModelConfig c;
  c.vocab_size = 29;
  c.d_model = 64;
  c.layers = 2;
  c.context_len = 96;
  c.attention.kind = "gsa";
  c.attention.heads = 4;
  c.attention.kv_heads = 2;
  c.attention.options = {{"budget", "fixed"}, {"k", 16}, {"k_max", 16}, {"indexer_heads", 2}, {"indexer_dim", 16}};
  c.attention.implementation = "kernel";
  nn::resolve(c);
  torch::manual_seed(12);
  const nn::LanguageModel gpu = nn::make_language_model(c);
  c.attention.implementation = "composed";
  const nn::LanguageModel cpu = nn::make_language_model(c);
  {
    torch::NoGradGuard no_grad;
    auto from = gpu->named_parameters();
    for (auto& item : cpu->named_parameters()) {
      if (item.key().find("indexer") != std::string::npos) from[item.key()].mul_(3.0);
      item.value().copy_(from[item.key()]);
    }
  }
  cpu->to(torch::kFloat64);
  gpu->to(kCuda);
  const Tensor tokens = torch::randint(29, {2, 96}, torch::kInt64);
  const Tensor w = torch::randn({2, 96, 29}, torch::kFloat64);
  const Tensor want = cpu->forward(tokens);
  (want * w).sum().backward();
  const Tensor got = gpu->forward(tokens.to(kCuda));
  (got.to(torch::kFloat64) * w.to(kCuda)).sum().backward();
  EXPECT_LT(rel(got, want), 1e-4);
  auto cpu_params = cpu->named_parameters();
  for (const auto& item : gpu->named_parameters()) {
    const Tensor& expected = cpu_params[item.key()].grad();
    ASSERT_EQ(item.value().grad().defined(), expected.defined()) << item.key();
    if (expected.defined()) EXPECT_LT(rel(item.value().grad(), expected), 1e-3) << item.key();
  }
  Autocast autocast(true);
  EXPECT_TRUE(torch::isfinite(gpu->forward(tokens.to(kCuda))).all().item<bool>());
}

// Incremental decoding through the KV cache on CUDA: single tokens (and short chunks) take the
// split-KV decoding kernels (cuda/attention/decode.cuh), full passes the fused forward kernels;
// both must give the same logits. 600 tokens, so the one-token steps split their keys.
TEST(CudaDecode, CachedDecodingMatchesFullPasses) {
  for (const char* kind : {"softmax", "stick_breaking"}) {
    for (torch::Dtype dtype : {torch::kFloat32, torch::kBFloat16}) {
      SCOPED_TRACE(std::string(kind) + (dtype == torch::kFloat32 ? " float32" : " bfloat16"));
      nn::ModelConfig c;
      c.vocab_size = 29;
      c.d_model = 128;
      c.layers = 2;
      c.context_len = 1024;
      c.attention.kind = kind;
      c.attention.heads = 4;
      c.attention.kv_heads = 1;  // one row group of four query heads per kv head
      c.attention.implementation = "kernel";
      nn::resolve(c);
      torch::manual_seed(5);
      const nn::LanguageModel model = nn::make_language_model(c);
      model->to(kCuda, dtype);
      torch::NoGradGuard no_grad;
      const Tensor tokens = torch::randint(29, {2, 600}, torch::kInt64).to(kCuda);
      nn::KVCache cache = model->new_cache();
      std::vector<Tensor> pieces;
      std::int64_t seen = 0;
      for (std::int64_t chunk : {512, 3, 1, 8, 1, 1, 2}) {
        pieces.push_back(model->forward(tokens.narrow(1, seen, chunk), &cache));
        seen += chunk;
      }
      while (seen < 600) pieces.push_back(model->forward(tokens.narrow(1, seen++, 1), &cache));
      const Tensor cached = torch::cat(pieces, 1);
      const Tensor full = model->forward(tokens);
      const double tol = dtype == torch::kFloat32 ? 1e-4 : 3e-2;
      EXPECT_LT(rel(cached.narrow(1, 512, 88), full.narrow(1, 512, 88)), tol);
      EXPECT_LT(rel(cached, full), tol);
    }
  }
}

TEST(CudaTrainer, EnqueuedStepsEqualSynchronousSteps) {
  for (const char* kind : {"softmax", "stick_breaking"}) {
    const std::string dir_a = scratch("sync"), dir_b = scratch("async");
    Trainer a(small(dir_a, kind)), b(small(dir_b, kind));
    a.quiet = b.quiet = true;
    double last_loss = 0;
    for (int i = 0; i < 5; ++i) last_loss = a.step().loss;
    for (int i = 0; i < 5; ++i) b.enqueue_step();
    const StepStats s = b.wait_for_steps();
    EXPECT_EQ(s.step, 5);
    EXPECT_EQ(s.loss, last_loss) << kind;
    expect_same_parameters(a, b);
    remove_tree(dir_a);
    remove_tree(dir_b);
  }
}

TEST(CudaTrainer, GraphReplaysEqualOrdinarySteps) {
  // Sieve with the bound filter: its threshold is the row maximum, from a sweep with no flag
  // for the host to read (the exact filter's search has one).
  const std::vector<std::pair<std::string, nlohmann::json>> runs = {
      {"softmax", nlohmann::json::object()},
      {"stick_breaking", nlohmann::json::object()},
      {"sieve", {{"filter", "bound"}}}};
  for (const auto& [kind, options] : runs) {
    const std::string dir_a = scratch("eager"), dir_b = scratch("graph");
    ExperimentConfig eager_config = small(dir_a, kind, options), graph_config = small(dir_b, kind, options);
    eager_config.train.cuda_graph = false;
    Trainer a(eager_config), b(graph_config);
    a.quiet = b.quiet = true;
    EXPECT_EQ(b.graph_blocker(), "");
    EXPECT_NE(a.graph_blocker(), "");
    for (int i = 0; i < 7; ++i) {
      const StepStats sa = a.step(), sb = b.step();
      EXPECT_EQ(sa.loss, sb.loss) << kind << " step " << i + 1;
      EXPECT_EQ(sa.grad_norm, sb.grad_norm) << kind << " step " << i + 1;
    }
    EXPECT_TRUE(b.graph_active());
    EXPECT_FALSE(a.graph_active());
    expect_same_parameters(a, b);
    remove_tree(dir_a);
    remove_tree(dir_b);
  }
}

// Through a phase change (the graph is captured again for the new set of trained parameters)
// and a resume in the middle of the first phase's replays.
TEST(CudaTrainer, ResumeGivesBitIdenticalParameters) {
  const std::string dir_a = scratch("straight"), dir_b = scratch("resumed");
  auto config = [](const std::string& dir) {
    ExperimentConfig c = small(dir, "softmax");
    c.train.steps = 12;
    Phase first;
    first.name = "first";
    first.steps = 6;
    first.freeze = {"mlp"};
    Phase second;
    second.name = "second";
    c.train.phases = {first, second};
    return c;
  };
  Trainer straight(config(dir_a));
  straight.quiet = true;
  straight.train();
  EXPECT_TRUE(straight.graph_active());
  {
    Trainer first(config(dir_b));
    first.quiet = true;
    first.train(5);
  }
  Trainer second(config(dir_b));
  second.quiet = true;
  ASSERT_TRUE(second.resume());
  second.train();
  expect_same_parameters(straight, second);
  straight.step();
  second.step();
  expect_same_parameters(straight, second);
  remove_tree(dir_a);
  remove_tree(dir_b);
}

TEST(CudaTrainer, DivergedStepLeavesTheModelAndSaysWhere) {
  const std::string dir = scratch("diverge");
  Trainer t(small(dir, "softmax"));
  t.quiet = true;
  t.aux_loss_fns.emplace_back("nan", [](Trainer&, const tasks::Batch&, const Tensor& logits) {
    return logits.sum() * std::numeric_limits<double>::quiet_NaN();
  });
  const Tensor before = t.model()->named_parameters()["block0.attention.q.weight"].detach().clone();
  // Enqueued steps run ahead of the check; none of them may move the model.
  try {
    for (int i = 0; i < 4; ++i) t.enqueue_step();
    t.wait_for_steps();
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("training diverged at step 1"), std::string::npos) << e.what();
  }
  EXPECT_TRUE(torch::equal(before, t.model()->named_parameters()["block0.attention.q.weight"]));
  remove_tree(dir);
}

}  // namespace
}  // namespace winnow::train
