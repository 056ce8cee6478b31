#include "eval/evaluate.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <limits>

#include <ATen/CPUGeneratorImpl.h>

#include "train/autocast.h"
#include "winnow/error.h"

namespace winnow::eval {
namespace {

std::int64_t batch_for(const Runtime& rt, std::int64_t length, std::int64_t remaining) {
  return std::clamp<std::int64_t>(rt.batch_tokens / std::max<std::int64_t>(length, 1), 1,
                                  remaining);
}

// Eval streams start above the trainer's (1 and 2; train/trainer.cpp).
constexpr std::uint64_t kEvalStreamBase = 1000;

}  // namespace

Runtime runtime_for(const torch::Device& device, const std::string& dtype,
                    std::int64_t batch_tokens) {
  Runtime rt;
  rt.device = device;
  rt.autocast = train::uses_autocast(device, dtype);
  rt.batch_tokens = batch_tokens > 0 ? batch_tokens : (device.is_cuda() ? 262144 : 16384);
  return rt;
}

SequenceScore& SequenceScore::operator+=(const SequenceScore& o) {
  sequences += o.sequences;
  scored += o.scored;
  correct += o.correct;
  exact += o.exact;
  loss_sum += o.loss_sum;
  return *this;
}

std::uint64_t instance_seed(std::uint64_t seed, std::int64_t length, std::int64_t depth_index,
                            std::int64_t batch_index) {
  // depth_index < 2^21 (a depth in millionths), so (length, depth) pairs never share a stream.
  const std::uint64_t stream = kEvalStreamBase + (static_cast<std::uint64_t>(length) << 21) +
                               static_cast<std::uint64_t>(depth_index);
  return tasks::batch_seed(seed, stream, batch_index);
}

void PositionSums::add(const torch::Tensor& nll_by_position,
                       const torch::Tensor& count_by_position) {
  const torch::Tensor n = nll_by_position.to(torch::kCPU, torch::kFloat64);
  const torch::Tensor c = count_by_position.to(torch::kCPU, torch::kFloat64);
  if (!nll.defined()) {
    nll = n;
    count = c;
    return;
  }
  if (nll.size(0) != n.size(0)) {
    throw Error(ErrorKind::invalid_argument,
                "PositionSums::add: expected sequences of " + std::to_string(nll.size(0)) +
                    " positions, got " + std::to_string(n.size(0)));
  }
  nll += n;
  count += c;
}

PositionLoss binned(const PositionSums& sums, std::int64_t bins) {
  PositionLoss out;
  if (!sums.nll.defined()) return out;
  const std::int64_t positions = sums.nll.size(0);
  bins = std::clamp<std::int64_t>(bins, 1, positions);
  for (std::int64_t i = 0; i < bins; ++i) {
    const std::int64_t lo = positions * i / bins, hi = positions * (i + 1) / bins;
    const double tokens = sums.count.narrow(0, lo, hi - lo).sum().item<double>();
    const double nll = sums.nll.narrow(0, lo, hi - lo).sum().item<double>();
    out.bin_start.push_back(lo);
    out.bin_end.push_back(hi);
    out.tokens.push_back(tokens);
    out.loss.push_back(tokens > 0 ? nll / tokens : 0.0);
  }
  return out;
}

SequenceScore score_logits(const torch::Tensor& logits, const tasks::Batch& batch,
                           PositionSums* positions) {
  const torch::Tensor mask = batch.loss_mask.to(logits.device(), torch::kFloat32);
  const torch::Tensor targets = batch.targets.to(logits.device());
  const torch::Tensor logp = torch::log_softmax(logits.to(torch::kFloat32), -1);
  const torch::Tensor nll = -logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1);
  if (positions != nullptr) positions->add((nll * mask).sum(0), mask.sum(0));
  const torch::Tensor right = logits.argmax(-1).eq(targets).to(torch::kFloat32) * mask;
  const torch::Tensor wrong_rows = ((1 - right) * mask).sum(-1).gt(0);
  const torch::Tensor sums =
      torch::stack({mask.sum(), right.sum(), wrong_rows.logical_not().sum().to(torch::kFloat32),
                    (nll * mask).sum()})
          .to(torch::kCPU, torch::kFloat64);
  SequenceScore s;
  s.sequences = logits.size(0);
  s.scored = sums[0].item<double>();
  s.correct = sums[1].item<double>();
  s.exact = sums[2].item<double>();
  s.loss_sum = sums[3].item<double>();
  return s;
}

SequenceScore score_sequences(const nn::LanguageModel& model, const tasks::Task& task,
                              std::int64_t length, std::int64_t instances, std::uint64_t seed,
                              const Runtime& rt, nn::AttentionProbe* probe,
                              PositionSums* positions) {
  torch::NoGradGuard no_grad;
  model->eval();
  struct Attached {
    const nn::LanguageModel& m;
    ~Attached() { m->attach_probe(nullptr); }
  } attached{model};
  model->attach_probe(probe);
  SequenceScore total;
  for (std::int64_t done = 0, index = 0; done < instances; ++index) {
    const std::int64_t b = batch_for(rt, length, instances - done);
    const tasks::Batch batch = task.sample(b, length, instance_seed(seed, length, 0, index));
    torch::Tensor logits;
    {
      train::Autocast autocast(rt.autocast);
      logits = model->forward(batch.inputs.to(rt.device));
    }
    total += score_logits(logits, batch, positions);
    done += b;
  }
  return total;
}

namespace {

// Continues prompts (B, P) by `steps` tokens through the KV cache: one prefill pass, then one
// token at a time; pick maps the last position's logits (B, V) to the next tokens (B, 1).
template <class Pick>
torch::Tensor decode(const nn::LanguageModel& model, const torch::Tensor& prompts, std::int64_t steps,
                     const Runtime& rt, Pick&& pick) {
  torch::NoGradGuard no_grad;
  model->eval();
  nn::KVCache cache = model->new_cache();
  std::vector<torch::Tensor> out;
  torch::Tensor next = prompts.to(rt.device);
  for (std::int64_t i = 0; i < steps; ++i) {
    torch::Tensor logits;
    {
      train::Autocast autocast(rt.autocast);
      logits = model->forward(next, &cache);
    }
    const torch::Tensor drawn = pick(logits.select(1, logits.size(1) - 1));
    out.push_back(drawn);
    next = drawn.to(rt.device);
  }
  return steps > 0 ? torch::cat(out, 1).cpu() : torch::empty({prompts.size(0), 0}, torch::kInt64);
}

}  // namespace

torch::Tensor generate_greedy(const nn::LanguageModel& model, const torch::Tensor& prompts,
                              std::int64_t steps, const Runtime& rt) {
  return decode(model, prompts, steps, rt,
                [](const torch::Tensor& last) { return last.argmax(-1, /*keepdim=*/true); });
}

torch::Tensor generate(const nn::LanguageModel& model, const torch::Tensor& prompts, std::int64_t steps,
                       const Runtime& rt, const Sampling& sampling) {
  if (!(sampling.temperature >= 0) || !std::isfinite(sampling.temperature)) {
    throw Error(ErrorKind::invalid_argument,
                "generate: argument 'temperature': expected a finite value >= 0, got " +
                    std::to_string(sampling.temperature));
  }
  if (sampling.top_k < 0) {
    throw Error(ErrorKind::invalid_argument, "generate: argument 'top_k': expected >= 0, got " +
                                                 std::to_string(sampling.top_k));
  }
  if (prompts.dim() != 2 || prompts.size(1) < 1) {
    throw Error(ErrorKind::invalid_argument,
                "generate: argument 'prompts': expected (B, P >= 1) tokens, got " +
                    c10::str(prompts.sizes()));
  }
  if (sampling.temperature == 0) return generate_greedy(model, prompts, steps, rt);
  // The generator lives on the CPU so that a seed draws the same tokens whatever the device.
  torch::Generator generator = at::detail::createCPUGenerator(sampling.seed);
  return decode(model, prompts, steps, rt, [&](const torch::Tensor& logits) {
    torch::Tensor last = logits.to(torch::kCPU, torch::kFloat64) / sampling.temperature;
    if (sampling.top_k > 0 && sampling.top_k < last.size(-1)) {
      // Below the k-th largest logit nothing is drawn; ties at the k-th all stay.
      const torch::Tensor kth = std::get<0>(last.topk(sampling.top_k, -1)).select(-1, sampling.top_k - 1);
      last = last.masked_fill(last.lt(kth.unsqueeze(-1)), -std::numeric_limits<double>::infinity());
    }
    return torch::multinomial(torch::softmax(last, -1), 1, /*replacement=*/false, generator);
  });
}

GenerationScore score_generation(const nn::LanguageModel& model, const tasks::Task& task,
                                 std::int64_t length, double depth, std::int64_t instances,
                                 std::uint64_t seed, const Runtime& rt) {
  if (!task.generative()) {
    throw Error(ErrorKind::invalid_argument,
                "task: generation scoring needs a generative task (abcdigits, passkey)");
  }
  // Each (length, depth) cell draws from its own stream: the depth's bits pick it.
  const auto depth_index = static_cast<std::int64_t>(std::llround(depth * 1e6));
  GenerationScore score;
  std::int64_t index = 0;
  while (score.instances < instances) {
    const std::int64_t b = batch_for(rt, length, instances - score.instances);
    tasks::Rng rng(instance_seed(seed, length, depth_index, index++));
    std::vector<tasks::Prompt> prompts;
    for (std::int64_t i = 0; i < b; ++i)
      prompts.push_back(task.prompt(length, depth, rng.below(~0ull)));
    // Every prompt of a cell has the same length (length minus its answer's).
    const auto p_len = static_cast<std::int64_t>(prompts[0].tokens.size());
    const auto a_len = static_cast<std::int64_t>(prompts[0].answer.size());
    torch::Tensor batch = torch::empty({b, p_len}, torch::kInt64);
    for (std::int64_t i = 0; i < b; ++i) {
      const auto& p = prompts[static_cast<std::size_t>(i)];
      if (static_cast<std::int64_t>(p.tokens.size()) != p_len ||
          static_cast<std::int64_t>(p.answer.size()) != a_len) {
        throw Error(ErrorKind::runtime, "task: prompts of one (length, depth) differ in length");
      }
      std::copy(p.tokens.begin(), p.tokens.end(), batch[i].data_ptr<std::int64_t>());
    }
    const torch::Tensor generated = generate_greedy(model, batch, a_len, rt);
    for (std::int64_t i = 0; i < b; ++i) {
      const auto& answer = prompts[static_cast<std::size_t>(i)].answer;
      const std::int64_t* g = generated[i].data_ptr<std::int64_t>();
      score.exact += std::equal(answer.begin(), answer.end(), g) ? 1 : 0;
    }
    score.instances += b;
  }
  return score;
}

PositionLoss loss_by_position(const nn::LanguageModel& model, const torch::Tensor& tokens,
                              std::int64_t bins, const Runtime& rt) {
  if (tokens.dim() != 2 || tokens.size(1) < 2) {
    throw Error(ErrorKind::invalid_argument,
                "loss_by_position: argument 'tokens': expected (N, L >= 2), got " +
                    c10::str(tokens.sizes()));
  }
  const std::int64_t n = tokens.size(0), predicted = tokens.size(1) - 1;
  torch::NoGradGuard no_grad;
  model->eval();
  PositionSums sums;
  for (std::int64_t start = 0; start < n;) {
    const std::int64_t b = batch_for(rt, tokens.size(1), n - start);
    const torch::Tensor chunk = tokens.narrow(0, start, b).to(rt.device);
    tasks::Batch batch;
    batch.inputs = chunk.narrow(1, 0, predicted);
    batch.targets = chunk.narrow(1, 1, predicted);
    batch.loss_mask = torch::ones({b, predicted}, torch::kFloat32);
    torch::Tensor logits;
    {
      train::Autocast autocast(rt.autocast);
      logits = model->forward(batch.inputs);
    }
    (void)score_logits(logits, batch, &sums);
    start += b;
  }
  return binned(sums, bins);
}

ForwardLatency forward_latency(const nn::LanguageModel& model, std::int64_t vocab, std::int64_t length,
                               std::int64_t repeats, const Runtime& rt) {
  if (length < 1 || repeats < 1 || vocab < 1) {
    throw Error(ErrorKind::invalid_argument,
                "forward_latency: expected length, repeats and vocab >= 1, got " + std::to_string(length) +
                    ", " + std::to_string(repeats) + " and " + std::to_string(vocab));
  }
  torch::NoGradGuard no_grad;
  model->eval();
  // Fixed tokens: the latency of a mechanism whose work depends on its weights (Multiscreen's
  // windows) should not depend on the draw.
  auto generator = at::make_generator<at::CPUGeneratorImpl>(instance_seed(0, length, 0, 0));
  const torch::Tensor tokens =
      torch::randint(vocab, {1, length}, generator, torch::TensorOptions().dtype(torch::kInt64)).to(rt.device);
  auto pass = [&] {
    train::Autocast autocast(rt.autocast);
    (void)model->forward(tokens);
  };
  auto wait = [&] {
    if (rt.device.is_cuda()) torch::cuda::synchronize(rt.device.index() < 0 ? -1 : rt.device.index());
  };
  // Untimed passes first, at least three and 200 ms of them: the first length measured would
  // otherwise carry the library's first-call setup and a GPU still raising its clocks.
  const auto warm_start = std::chrono::steady_clock::now();
  for (int i = 0; i < 3 || std::chrono::steady_clock::now() - warm_start < std::chrono::milliseconds(200); ++i) {
    pass();
    wait();
  }
  std::vector<double> ms;
  for (std::int64_t i = 0; i < repeats; ++i) {
    const auto start = std::chrono::steady_clock::now();
    pass();
    wait();
    ms.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count());
  }
  std::sort(ms.begin(), ms.end());
  ForwardLatency out;
  out.length = length;
  out.min_ms = ms.front();
  out.median_ms = ms.size() % 2 ? ms[ms.size() / 2] : 0.5 * (ms[ms.size() / 2 - 1] + ms[ms.size() / 2]);
  return out;
}

}  // namespace winnow::eval
