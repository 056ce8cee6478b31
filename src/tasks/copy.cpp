// Copy (000 table 1; spec/tasks.md): random symbols, a separator, the same symbols again.
#include "tasks/task.h"
#include "winnow/error.h"

namespace winnow::tasks {
namespace {

class Copy final : public Task {
 public:
  explicit Copy(const CopyConfig& c) : symbols_(c.symbols), varied_(c.varied_training) {}
  std::int64_t vocab_size() const override { return symbols_ + 1; }
  std::int64_t min_length() const override { return 2; }

  // A sequence of `length` inputs holds m = length / 2 symbols, the separator and the first
  // m - 1 copied symbols; the targets run one ahead, so the m predictions from the separator on
  // are the copy, and only they count.
  Batch sample(std::int64_t batch, std::int64_t length, std::uint64_t seed) const override {
    return generate(batch, length, seed, false);
  }
  Batch sample_training(std::int64_t batch, std::int64_t length, std::uint64_t seed) const override {
    return generate(batch, length, seed, varied_);
  }

  std::string render(const std::vector<std::int64_t>& tokens) const override {
    std::string out;
    for (std::int64_t t : tokens) {
      out += out.empty() ? "" : " ";
      out += t == symbols_ ? std::string("|") : std::to_string(t);
    }
    return out;
  }

 private:
  // varied: each row's instance has m drawn from 1 .. length / 2 and starts the row; the rest
  // of the row is random symbols with no loss.
  Batch generate(std::int64_t batch, std::int64_t length, std::uint64_t seed, bool varied) const {
    if (length % 2 != 0 || length < 2) {
      throw Error(ErrorKind::invalid_argument,
                  "length: expected an even number of tokens >= 2 (m symbols, a separator and "
                  "m copied symbols, the last one predicted), got " +
                      std::to_string(length));
    }
    const std::int64_t half = length / 2;
    Rng rng(seed);
    torch::Tensor full = torch::empty({batch, length + 1}, torch::kInt64);
    auto f = full.accessor<std::int64_t, 2>();
    Batch out;
    out.loss_mask = torch::zeros({batch, length});
    auto mask = out.loss_mask.accessor<float, 2>();
    auto symbol = [&] {
      return static_cast<std::int64_t>(rng.below(static_cast<std::uint64_t>(symbols_)));
    };
    for (std::int64_t b = 0; b < batch; ++b) {
      const std::int64_t m =
          varied ? 1 + static_cast<std::int64_t>(rng.below(static_cast<std::uint64_t>(half))) : half;
      for (std::int64_t i = 0; i < m; ++i) {
        f[b][i] = symbol();
        f[b][m + 1 + i] = f[b][i];
      }
      f[b][m] = symbols_;
      for (std::int64_t i = 2 * m + 1; i <= length; ++i) f[b][i] = symbol();
      for (std::int64_t i = m; i < 2 * m; ++i) mask[b][i] = 1.0f;
    }
    out.inputs = full.narrow(1, 0, length).contiguous();
    out.targets = full.narrow(1, 1, length).contiguous();
    return out;
  }


 private:
  std::int64_t symbols_;
  bool varied_;
};

}  // namespace

std::unique_ptr<Task> make_copy(const CopyConfig& config) { return std::make_unique<Copy>(config); }

}  // namespace winnow::tasks
