// ABCDigits (spec/tasks.md): lines "X=dddddd\n", one fixed six-digit number per letter, the
// target letter's line exactly once at the asked depth among many lines of the other letters,
// then the query "T=" and T's six digits as the answer.
#include <algorithm>
#include <cmath>
#include <numeric>
#include <set>

#include "tasks/task.h"
#include "tasks/text.h"
#include "winnow/error.h"

namespace winnow::tasks {
namespace {

constexpr std::int64_t kLetters = 26;
constexpr std::int64_t kLine = 9;    // "X=dddddd\n"
constexpr std::int64_t kQuery = 2;   // "T="
constexpr std::int64_t kAnswer = 6;  // T's digits

class AbcDigits final : public CharacterPromptTask {
 public:
  using CharacterPromptTask::CharacterPromptTask;
  // Every letter's line once, T's included, then the query and the answer.
  std::int64_t min_length() const override { return kLetters * kLine + kQuery + kAnswer; }

  Prompt prompt(std::int64_t length, double depth, std::uint64_t seed) const override {
    check_length(length);
    check_depth(depth);
    Rng rng(seed);

    // Distinct numbers, so that a letter's digits identify the letter's line.
    std::vector<std::string> numbers;
    std::set<std::uint64_t> used;
    while (static_cast<std::int64_t>(numbers.size()) < kLetters) {
      const std::uint64_t n = 100000 + rng.below(900000);
      if (used.insert(n).second) numbers.push_back(std::to_string(n));
    }

    std::vector<std::uint64_t> weights(kLetters, 0);
    for (std::int64_t i = 1; i < kLetters; ++i) weights[i] = std::uint64_t{1} << (i - 1);
    rng.shuffle(weights);
    const std::int64_t target = std::find(weights.begin(), weights.end(), 0) - weights.begin();

    // Weight 0 gives the target an empty interval of the cumulative sums: it is never drawn.
    std::vector<std::uint64_t> cumulative(kLetters);
    std::partial_sum(weights.begin(), weights.end(), cumulative.begin());
    const std::uint64_t total = cumulative.back();  // 2^25 - 1

    const std::int64_t lines = (length - kQuery - kAnswer) / kLine;
    const std::int64_t count = lines - 1;  // the lines other than T's
    std::vector<std::int64_t> order;
    for (std::int64_t l = 0; l < kLetters; ++l) {
      if (l != target) order.push_back(l);
    }
    while (static_cast<std::int64_t>(order.size()) < count) {
      const std::uint64_t r = rng.below(total);
      order.push_back(std::upper_bound(cumulative.begin(), cumulative.end(), r) -
                      cumulative.begin());
    }
    rng.shuffle(order);
    const auto at = static_cast<std::int64_t>(std::floor(static_cast<double>(count) * depth));
    order.insert(order.begin() + at, target);

    // A length that is not a whole number of lines leaves 0..8 characters over; they go first
    // as blank lines, where they split no line and keep the query right after the last line.
    std::string s(static_cast<std::size_t>((length - kQuery - kAnswer) % kLine), '\n');
    for (const std::int64_t l : order) {
      s += static_cast<char>('A' + l);
      s += '=';
      s += numbers[l];
      s += '\n';
    }
    s += static_cast<char>('A' + target);
    s += '=';

    Prompt p;
    p.tokens = text::encode(s);
    p.answer = text::encode(numbers[target]);
    return p;
  }
};

}  // namespace

std::unique_ptr<Task> make_abcdigits(const AbcdigitsConfig& config) {
  return std::make_unique<AbcDigits>(config.training_loss);
}

}  // namespace winnow::tasks
