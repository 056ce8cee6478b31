#include "eval/evaluate.h"

#include <algorithm>

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

SequenceScore score_logits(const torch::Tensor& logits, const tasks::Batch& batch) {
  const torch::Tensor mask = batch.loss_mask.to(logits.device(), torch::kFloat32);
  const torch::Tensor targets = batch.targets.to(logits.device());
  const torch::Tensor logp = torch::log_softmax(logits.to(torch::kFloat32), -1);
  const torch::Tensor nll = -logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1);
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

SequenceScore score_sequences(nn::TransformerLM& model, const tasks::Task& task,
                              std::int64_t length, std::int64_t instances, std::uint64_t seed,
                              const Runtime& rt, nn::AttentionProbe* probe) {
  torch::NoGradGuard no_grad;
  model->eval();
  struct Attached {
    nn::TransformerLM& m;
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
    total += score_logits(logits, batch);
    done += b;
  }
  return total;
}

torch::Tensor generate_greedy(nn::TransformerLM& model, const torch::Tensor& prompts,
                              std::int64_t steps, const Runtime& rt) {
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
    next = logits.select(1, logits.size(1) - 1).argmax(-1, /*keepdim=*/true);
    out.push_back(next);
  }
  return steps > 0 ? torch::cat(out, 1).cpu() : torch::empty({prompts.size(0), 0}, torch::kInt64);
}

GenerationScore score_generation(nn::TransformerLM& model, const tasks::Task& task,
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

PositionLoss loss_by_position(nn::TransformerLM& model, const torch::Tensor& tokens,
                              std::int64_t bins, const Runtime& rt) {
  if (tokens.dim() != 2 || tokens.size(1) < 2) {
    throw Error(ErrorKind::invalid_argument,
                "loss_by_position: argument 'tokens': expected (N, L >= 2), got " +
                    c10::str(tokens.sizes()));
  }
  const std::int64_t n = tokens.size(0), predicted = tokens.size(1) - 1;
  bins = std::clamp<std::int64_t>(bins, 1, predicted);
  torch::NoGradGuard no_grad;
  model->eval();
  torch::Tensor per_position = torch::zeros({predicted}, torch::kFloat64);
  for (std::int64_t start = 0; start < n;) {
    const std::int64_t b = batch_for(rt, tokens.size(1), n - start);
    const torch::Tensor chunk = tokens.narrow(0, start, b).to(rt.device);
    torch::Tensor logits;
    {
      train::Autocast autocast(rt.autocast);
      logits = model->forward(chunk.narrow(1, 0, predicted));
    }
    const torch::Tensor logp = torch::log_softmax(logits.to(torch::kFloat32), -1);
    const torch::Tensor nll =
        -logp.gather(-1, chunk.narrow(1, 1, predicted).unsqueeze(-1)).squeeze(-1);
    per_position += nll.sum(0).to(torch::kCPU, torch::kFloat64);
    start += b;
  }
  PositionLoss out;
  for (std::int64_t i = 0; i < bins; ++i) {
    const std::int64_t lo = predicted * i / bins, hi = predicted * (i + 1) / bins;
    out.bin_start.push_back(lo);
    out.bin_end.push_back(hi);
    const double count = static_cast<double>((hi - lo) * n);
    out.tokens.push_back(count);
    out.loss.push_back(per_position.narrow(0, lo, hi - lo).sum().item<double>() / count);
  }
  return out;
}

}  // namespace winnow::eval
