// Passkey retrieval (spec/tasks.md): an instruction, filler sentences with the needle at the
// asked depth, then the question; the answer is the key's digits.
#include <cmath>

#include "tasks/task.h"
#include "tasks/text.h"
#include "winnow/error.h"

namespace winnow::tasks {
namespace {

const std::string kInstruction =
    "A pass key is hidden somewhere in the text below. Find it and remember it.\n";
const std::string kFiller =
    "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. ";
const std::string kQuestion = "\nWhat is the pass key? The pass key is ";

std::string needle(const std::string& key) {
  return "The pass key is " + key + ". Remember it. " + key + " is the pass key. ";
}

class Passkey final : public CharacterPromptTask {
 public:
  Passkey(std::int64_t digits, const std::string& training_loss)
      : CharacterPromptTask(training_loss), digits_(digits) {}

  // No filler at all: the needle right after the instruction, then the question.
  std::int64_t min_length() const override {
    const auto n = static_cast<std::int64_t>(
        (kInstruction + needle(std::string(digits_, '0')) + kQuestion).size());
    return n + digits_;
  }

  Prompt prompt(std::int64_t length, double depth, std::uint64_t seed) const override {
    check_length(length);
    check_depth(depth);
    Rng rng(seed);

    // A leading zero would make the key a shorter number than `digits` says.
    std::string key(1, static_cast<char>('1' + rng.below(9)));
    while (static_cast<std::int64_t>(key.size()) < digits_) {
      key += static_cast<char>('0' + rng.below(10));
    }

    // The filler fills what the fixed parts leave; its last sentence may be cut short.
    const auto room = static_cast<std::size_t>(length - min_length());
    std::string filler;
    while (filler.size() < room) filler += kFiller;
    filler.resize(room);

    // The needle goes between sentences, so it reads as a sentence of its own. The boundaries
    // do not depend on the seed, so the needle moves monotonically with depth.
    const double wanted = depth * static_cast<double>(room);
    std::size_t at = 0;
    for (std::size_t i = 2; i <= room; ++i) {
      const bool boundary = filler[i - 2] == '.' && filler[i - 1] == ' ';
      if (boundary && std::abs(static_cast<double>(i) - wanted) <
                          std::abs(static_cast<double>(at) - wanted)) {
        at = i;
      }
    }

    Prompt p;
    p.tokens = text::encode(kInstruction + filler.substr(0, at) + needle(key) +
                            filler.substr(at) + kQuestion);
    p.answer = text::encode(key);
    return p;
  }

 private:
  std::int64_t digits_;
};

}  // namespace

std::unique_ptr<Task> make_passkey(const PasskeyConfig& config) {
  if (config.digits < 1) {
    throw Error(ErrorKind::invalid_argument,
                "passkey.digits: expected >= 1, got " + std::to_string(config.digits));
  }
  return std::make_unique<Passkey>(config.digits, config.training_loss);
}

}  // namespace winnow::tasks
