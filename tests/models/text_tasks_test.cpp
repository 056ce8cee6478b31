// The character tokenizer and the two generative text tasks, ABCDigits and passkey
// (spec/tasks.md): exact lengths, the layout of the rendered prompts parsed back from the text,
// the needle's position against depth, determinism, errors, and the training batches that
// score the answer only.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <limits>
#include <map>
#include <string>
#include <vector>

#include "tasks/task.h"
#include "tasks/text.h"
#include "winnow/error.h"

namespace winnow::tasks {
namespace {

void expect_error(const std::function<void()>& fn, const std::string& fragment) {
  try {
    fn();
    ADD_FAILURE() << "no error; expected one mentioning " << fragment;
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::invalid_argument);
    EXPECT_NE(std::string(e.what()).find(fragment), std::string::npos) << e.what();
  }
}

std::size_t count_of(const std::string& text, const std::string& part) {
  std::size_t n = 0;
  for (std::size_t i = text.find(part); i != std::string::npos; i = text.find(part, i + 1)) ++n;
  return n;
}

bool all_digits(const std::string& s) {
  if (s.empty()) return false;
  for (const char c : s) {
    if (c < '0' || c > '9') return false;
  }
  return true;
}

std::vector<std::int64_t> row_tokens(const torch::Tensor& t, std::int64_t b) {
  torch::Tensor r = t[b].contiguous();
  return {r.data_ptr<std::int64_t>(), r.data_ptr<std::int64_t>() + r.numel()};
}

// ------------------------------------------------------------------ the tokenizer

TEST(TextTokens, FixedCodes) {
  EXPECT_EQ(text::kVocab, 96);
  EXPECT_EQ(text::encode("\n ~A0"), (std::vector<std::int64_t>{0, 1, 95, 34, 17}));
  EXPECT_EQ(text::decode({0, 1, 95, 34, 17}), "\n ~A0");
  EXPECT_TRUE(text::encode("").empty());
}

TEST(TextTokens, RoundTripOfEveryCharacter) {
  std::string all = "\n";
  for (char c = ' '; c <= '~'; ++c) all += c;
  const std::vector<std::int64_t> tokens = text::encode(all);
  ASSERT_EQ(tokens.size(), 96u);
  for (std::int64_t i = 0; i < 96; ++i) EXPECT_EQ(tokens[i], i);
  EXPECT_EQ(text::decode(tokens), all);
}

TEST(TextTokens, ErrorsNameTheCharacterAndPosition) {
  expect_error([] { text::encode("ab\tc"); }, "9");
  expect_error([] { text::encode("ab\tc"); }, "position 2");
  expect_error([] { text::encode(std::string("x\xc8")); }, "200");
  expect_error([] { text::encode(std::string("x\x7f")); }, "127");
  expect_error([] { text::decode({5, 96}); }, "96");
  expect_error([] { text::decode({5, 96}); }, "position 1");
  expect_error([] { text::decode({-1}); }, "-1");
}

// ------------------------------------------------------------------ ABCDigits

struct AbcText {
  std::size_t blank = 0;                           // leading '\n's
  std::vector<std::pair<char, std::string>> lines;  // letter, digits
  char query = 0;
};

// Parses a rendered prompt, failing the test on anything off the layout.
AbcText parse_abc(const std::string& s) {
  AbcText out;
  while (out.blank < s.size() && s[out.blank] == '\n') ++out.blank;
  std::size_t i = out.blank;
  while (s.size() - i > 2) {
    const std::string line = s.substr(i, 9);
    EXPECT_EQ(line.size(), 9u);
    EXPECT_TRUE(line[0] >= 'A' && line[0] <= 'Z') << line;
    EXPECT_EQ(line[1], '=') << line;
    EXPECT_TRUE(all_digits(line.substr(2, 6))) << line;
    EXPECT_EQ(line[8], '\n') << line;
    out.lines.emplace_back(line[0], line.substr(2, 6));
    i += 9;
  }
  EXPECT_EQ(s.size() - i, 2u);
  if (s.size() - i == 2) {
    EXPECT_EQ(s[i + 1], '=');
    out.query = s[i];
  }
  return out;
}

// Everything an instance promises, checked on the text.
void check_abc_instance(const Task& task, std::int64_t length, double depth, std::uint64_t seed) {
  SCOPED_TRACE("length " + std::to_string(length) + ", depth " + std::to_string(depth) +
               ", seed " + std::to_string(seed));
  const Prompt p = task.prompt(length, depth, seed);
  ASSERT_EQ(static_cast<std::int64_t>(p.tokens.size() + p.answer.size()), length);
  ASSERT_EQ(p.answer.size(), 6u);
  const std::string s = task.render(p.tokens);
  ASSERT_EQ(s.back(), '=') << "the prompt ends with the query \"T=\"";
  const AbcText t = parse_abc(s);
  ASSERT_TRUE(t.query >= 'A' && t.query <= 'Z');
  EXPECT_EQ(static_cast<std::int64_t>(t.blank), (length - 8) % 9);
  EXPECT_EQ(static_cast<std::int64_t>(t.lines.size()), (length - 8) / 9);

  std::map<char, std::string> number;
  std::map<char, std::int64_t> seen;
  std::int64_t target_at = -1;
  for (std::size_t i = 0; i < t.lines.size(); ++i) {
    const auto& [letter, digits] = t.lines[i];
    EXPECT_NE(digits[0], '0') << "a six-digit number in [100000, 999999]";
    auto [it, fresh] = number.emplace(letter, digits);
    EXPECT_EQ(it->second, digits) << "letter " << letter << " changed its number";
    ++seen[letter];
    if (letter == t.query) target_at = static_cast<std::int64_t>(i);
  }
  EXPECT_EQ(number.size(), 26u) << "the 25 other letters at least once, and T";
  EXPECT_EQ(seen[t.query], 1) << "T's line exactly once";
  std::map<std::string, char> owner;
  for (const auto& [letter, digits] : number) {
    EXPECT_TRUE(owner.emplace(digits, letter).second) << "numbers are distinct: " << digits;
  }
  EXPECT_EQ(text::decode(p.answer), number[t.query]);
  const auto count = static_cast<std::int64_t>(t.lines.size()) - 1;
  EXPECT_EQ(target_at, static_cast<std::int64_t>(std::floor(count * depth)));
}

TEST(AbcDigits, Basics) {
  const auto task = make_abcdigits();
  EXPECT_TRUE(task->generative());
  EXPECT_EQ(task->vocab_size(), 96);
  EXPECT_EQ(task->min_length(), 26 * 9 + 8);
  EXPECT_EQ(task->render(text::encode("A=123456\n")), "A=123456\n");
}

// training_loss "document" puts the training loss on every next token of the same sequences;
// held-out batches (sample) keep it on the answer, which evaluation scores.
TEST(AbcDigits, DocumentLossCoversEveryPredictionInTrainingOnly) {
  for (const char* name : {"abcdigits", "passkey"}) {
    TaskConfig c;
    c.name = name;
    const auto answer_only = make_task(c);
    c.abcdigits.training_loss = "document";
    c.passkey.training_loss = "document";
    const auto document = make_task(c);
    const Batch a = answer_only->sample_training(3, 300, 5), d = document->sample_training(3, 300, 5);
    EXPECT_TRUE(torch::equal(a.inputs, d.inputs)) << name;
    EXPECT_TRUE(torch::equal(a.targets, d.targets)) << name;
    const std::int64_t answer = std::string(name) == "abcdigits" ? 6 : 5;
    EXPECT_EQ(a.loss_mask.sum().item<double>(), 3.0 * answer) << name;
    EXPECT_EQ(d.loss_mask.sum().item<double>(), 3.0 * 299) << name;
    EXPECT_EQ(d.loss_mask.select(1, 299).sum().item<double>(), 0.0) << name;
    EXPECT_TRUE(torch::equal(document->sample(3, 300, 5).loss_mask, a.loss_mask)) << name;
  }
  TaskConfig bad;
  bad.name = "abcdigits";
  bad.abcdigits.training_loss = "everything";
  expect_error([&] { make_task(bad); }, "training_loss");
}

TEST(AbcDigits, LayoutAtEveryLengthAndDepth) {
  const auto task = make_abcdigits();
  for (const std::int64_t length : {242, 243, 250, 251, 300, 1000, 4096}) {
    for (const double depth : {0.0, 0.1, 0.5, 0.77, 1.0}) {
      for (const std::uint64_t seed : {1u, 2u, 12345u}) check_abc_instance(*task, length, depth, seed);
    }
  }
}

// Hand-checked small cases: the shortest prompt holds every letter once, and a length that is
// not a whole number of lines gets its leftover as leading blank lines.
TEST(AbcDigits, SmallInstances) {
  const auto task = make_abcdigits();
  {
    const std::string s = task->render(task->prompt(242, 1.0, 7).tokens);
    ASSERT_EQ(s.size(), 236u);  // 26 lines of 9, then "T="
    const AbcText t = parse_abc(s);
    EXPECT_EQ(t.blank, 0u);
    ASSERT_EQ(t.lines.size(), 26u);
    // Depth 1: T's line is the last one, right before the query.
    const std::string target = std::string(1, t.query) + "=";
    EXPECT_EQ(s.substr(225, 2), target);
    EXPECT_EQ(s.substr(234, 2), target);
  }
  {
    const std::string s = task->render(task->prompt(250, 0.0, 7).tokens);
    EXPECT_EQ(s.substr(0, 8), std::string(8, '\n'));
    EXPECT_NE(s[8], '\n');
    // Depth 0: T's line is the first line after the blank ones.
    EXPECT_EQ(s.substr(8, 2), s.substr(s.size() - 2));
  }
}

TEST(AbcDigits, TargetPositionFollowsDepth) {
  const auto task = make_abcdigits();
  const std::int64_t length = 1000;  // 110 lines: T's and 109 others
  for (const auto& [depth, expected] :
       std::vector<std::pair<double, std::int64_t>>{{0.0, 0}, {0.5, 54}, {1.0, 109}}) {
    const AbcText t = parse_abc(task->render(task->prompt(length, depth, 99).tokens));
    ASSERT_EQ(t.lines.size(), 110u);
    EXPECT_EQ(t.lines[expected].first, t.query) << "depth " << depth;
  }
}

// The weights 2^0 .. 2^24 make the heaviest letter take about half of the extra lines.
TEST(AbcDigits, LinesAreSkewed) {
  const auto task = make_abcdigits();
  const AbcText t = parse_abc(task->render(task->prompt(4096, 0.5, 3).tokens));
  std::map<char, std::int64_t> seen;
  for (const auto& line : t.lines) ++seen[line.first];
  std::int64_t top = 0;
  for (const auto& [letter, n] : seen) top = std::max(top, n);
  const double extra = static_cast<double>(t.lines.size() - 26);
  EXPECT_GT((top - 1) / extra, 0.4);
  EXPECT_LT((top - 1) / extra, 0.6);
}

TEST(AbcDigits, Deterministic) {
  const auto task = make_abcdigits();
  const Prompt a = task->prompt(500, 0.3, 42), b = task->prompt(500, 0.3, 42);
  EXPECT_EQ(a.tokens, b.tokens);
  EXPECT_EQ(a.answer, b.answer);
  EXPECT_NE(task->prompt(500, 0.3, 43).tokens, a.tokens);
}

TEST(AbcDigits, Errors) {
  const auto task = make_abcdigits();
  expect_error([&] { task->prompt(241, 0.5, 1); }, "length");
  expect_error([&] { task->prompt(0, 0.5, 1); }, "length");
  expect_error([&] { task->prompt(300, -0.1, 1); }, "depth");
  expect_error([&] { task->prompt(300, 1.5, 1); }, "depth");
  expect_error([&] { task->prompt(300, 1.5, 1); }, "1.5");
  expect_error([&] { task->prompt(300, std::nan(""), 1); }, "depth");
  expect_error([&] { task->sample(2, 241, 1); }, "length");
}

// ------------------------------------------------------------------ passkey

const std::string kQuery = "\nWhat is the pass key? The pass key is ";
const std::string kFiller =
    "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. ";

std::string needle_of(const std::string& key) {
  return "The pass key is " + key + ". Remember it. " + key + " is the pass key. ";
}

struct PasskeyText {
  std::string instruction;  // the first line, '\n' included
  std::string before, after;  // filler around the needle
  std::string key;
};

PasskeyText parse_passkey(const std::string& s) {
  PasskeyText out;
  const std::size_t eol = s.find('\n');
  EXPECT_NE(eol, std::string::npos);
  out.instruction = s.substr(0, eol + 1);
  EXPECT_GE(s.size(), kQuery.size());
  EXPECT_EQ(s.substr(s.size() - kQuery.size()), kQuery) << "the prompt ends with the question";
  EXPECT_EQ(count_of(s, "\n"), 2u) << "the instruction's newline and the question's";
  EXPECT_EQ(count_of(s, "Remember it."), 1u) << "one needle";
  const std::string body = s.substr(eol + 1, s.size() - kQuery.size() - eol - 1);
  const std::size_t start = body.find("The pass key is ");
  const std::size_t dot = body.find('.', start);
  if (start == std::string::npos || dot == std::string::npos) {
    ADD_FAILURE() << "no needle in " << body;
    return out;
  }
  out.key = body.substr(start + 16, dot - start - 16);
  EXPECT_EQ(body.substr(start, needle_of(out.key).size()), needle_of(out.key));
  out.before = body.substr(0, start);
  out.after = body.substr(start + needle_of(out.key).size());
  return out;
}

TEST(Passkey, Basics) {
  const auto task = make_passkey({});
  EXPECT_TRUE(task->generative());
  EXPECT_EQ(task->vocab_size(), 96);
  EXPECT_EQ(task->render(text::encode("The sky is blue. ")), "The sky is blue. ");
}

TEST(Passkey, MinimalPromptHasNoFiller) {
  for (const std::int64_t digits : {1, 5, 18}) {
    PasskeyConfig config;
    config.digits = digits;
    const auto task = make_passkey(config);
    const std::int64_t n = task->min_length();
    const Prompt p = task->prompt(n, 0.5, 11);
    ASSERT_EQ(static_cast<std::int64_t>(p.tokens.size() + p.answer.size()), n);
    const PasskeyText t = parse_passkey(task->render(p.tokens));
    EXPECT_TRUE(t.before.empty());
    EXPECT_TRUE(t.after.empty());
    // instruction + needle (49 characters and the key twice) + question (39) + answer.
    EXPECT_EQ(kQuery.size(), 39u);
    EXPECT_EQ(n, static_cast<std::int64_t>(t.instruction.size()) + 49 + 2 * digits + 39 + digits);
  }
}

TEST(Passkey, LayoutAtEveryLengthAndDepth) {
  for (const std::int64_t digits : {1, 5, 18}) {
    PasskeyConfig config;
    config.digits = digits;
    const auto task = make_passkey(config);
    const std::int64_t min = task->min_length();
    for (const std::int64_t length : {min, min + 1, min + 50, std::int64_t{300}, std::int64_t{1000},
                                      std::int64_t{4096}}) {
      for (const double depth : {0.0, 0.25, 0.5, 0.9, 1.0}) {
        for (const std::uint64_t seed : {1u, 2u, 777u}) {
          SCOPED_TRACE("digits " + std::to_string(digits) + ", length " + std::to_string(length) +
                       ", depth " + std::to_string(depth) + ", seed " + std::to_string(seed));
          const Prompt p = task->prompt(length, depth, seed);
          ASSERT_EQ(static_cast<std::int64_t>(p.tokens.size() + p.answer.size()), length);
          const PasskeyText t = parse_passkey(task->render(p.tokens));
          const std::string answer = text::decode(p.answer);
          EXPECT_EQ(t.key, answer);
          EXPECT_EQ(static_cast<std::int64_t>(answer.size()), digits);
          EXPECT_TRUE(all_digits(answer));
          EXPECT_NE(answer[0], '0');
          // The filler is the repeated sentences, cut anywhere at the end, and the needle sits
          // between two sentences.
          const std::string filler = t.before + t.after;
          std::string repeated;
          while (repeated.size() < filler.size()) repeated += kFiller;
          EXPECT_EQ(filler, repeated.substr(0, filler.size()));
          EXPECT_TRUE(t.before.empty() || t.before.substr(t.before.size() - 2) == ". ") << t.before;
        }
      }
    }
  }
}

TEST(Passkey, NeedleMovesWithDepth) {
  const auto task = make_passkey({});
  const std::int64_t length = 2000;
  const std::size_t longest_sentence = std::string("There and back again. ").size();
  std::size_t last = 0, room = 0;
  for (int i = 0; i <= 20; ++i) {
    const double depth = i / 20.0;
    const PasskeyText t = parse_passkey(task->render(task->prompt(length, depth, 5).tokens));
    room = t.before.size() + t.after.size();
    EXPECT_GE(t.before.size(), last) << "depth " << depth;
    last = t.before.size();
    // Within half a sentence of where the depth points.
    EXPECT_LE(std::abs(static_cast<double>(t.before.size()) - depth * room),
              longest_sentence / 2.0 + 1)
        << "depth " << depth;
    if (i == 0) {
      EXPECT_TRUE(t.before.empty());
    }
    if (i == 20) {
      EXPECT_LT(t.after.size(), longest_sentence);
    }
  }
  EXPECT_GT(room, 1800u);
}

TEST(Passkey, Deterministic) {
  const auto task = make_passkey({});
  const Prompt a = task->prompt(500, 0.3, 42), b = task->prompt(500, 0.3, 42);
  EXPECT_EQ(a.tokens, b.tokens);
  EXPECT_EQ(a.answer, b.answer);
  std::map<std::string, int> keys;
  for (std::uint64_t seed = 0; seed < 50; ++seed) ++keys[text::decode(task->prompt(500, 0.3, seed).answer)];
  EXPECT_GT(keys.size(), 45u) << "keys are drawn per seed";
}

TEST(Passkey, Errors) {
  const auto task = make_passkey({});
  const std::int64_t min = task->min_length();
  expect_error([&] { task->prompt(min - 1, 0.5, 1); }, "length");
  expect_error([&] { task->prompt(300, -0.5, 1); }, "depth");
  expect_error([&] { task->prompt(300, 2.0, 1); }, "depth");
  expect_error([&] { task->prompt(300, std::nan(""), 1); }, "depth");
  expect_error([&] { task->sample(2, min - 1, 1); }, "length");
  PasskeyConfig zero;
  zero.digits = 0;
  expect_error([&] { make_passkey(zero); }, "digits");
}

// ------------------------------------------------------------------ training batches

// The batch scores exactly the predictions of the answer tokens: with inputs = full[0, L) and
// targets = full[1, L) then a masked 0, positions L - answer - 1 .. L - 2. `answer_of` reads the
// answer back from the rendered prompt.
void check_batch(const Task& task, std::int64_t length, std::int64_t answer,
                 const std::function<std::string(const std::string&)>& answer_of) {
  const std::int64_t batch = 4;
  const Batch b = task.sample(batch, length, 2024);
  ASSERT_EQ(b.inputs.sizes(), (std::vector<std::int64_t>{batch, length}));
  ASSERT_EQ(b.targets.sizes(), (std::vector<std::int64_t>{batch, length}));
  ASSERT_EQ(b.loss_mask.sizes(), (std::vector<std::int64_t>{batch, length}));
  EXPECT_EQ(b.inputs.scalar_type(), torch::kInt64);
  EXPECT_EQ(b.targets.scalar_type(), torch::kInt64);
  EXPECT_EQ(b.loss_mask.scalar_type(), torch::kFloat32);

  torch::Tensor expected_mask = torch::zeros({batch, length});
  expected_mask.narrow(1, length - answer - 1, answer).fill_(1);
  EXPECT_TRUE(torch::equal(b.loss_mask, expected_mask));
  // Targets are the inputs shifted by one.
  EXPECT_TRUE(torch::equal(b.targets.narrow(1, 0, length - 1), b.inputs.narrow(1, 1, length - 1)));

  std::vector<std::string> rows;
  for (std::int64_t r = 0; r < batch; ++r) {
    const std::vector<std::int64_t> in = row_tokens(b.inputs, r), tg = row_tokens(b.targets, r);
    const std::string prompt =
        task.render(std::vector<std::int64_t>(in.begin(), in.end() - answer));
    const std::string key = answer_of(prompt);
    ASSERT_EQ(static_cast<std::int64_t>(key.size()), answer);
    EXPECT_EQ(std::vector<std::int64_t>(tg.end() - answer - 1, tg.end() - 1), text::encode(key));
    rows.push_back(task.render(in));
  }
  EXPECT_NE(rows[0], rows[1]) << "rows are different instances";

  const Batch again = task.sample(batch, length, 2024), other = task.sample(batch, length, 2025);
  EXPECT_TRUE(torch::equal(again.inputs, b.inputs));
  EXPECT_TRUE(torch::equal(again.targets, b.targets));
  EXPECT_FALSE(torch::equal(other.inputs, b.inputs));
}

TEST(AbcDigits, SampleScoresTheAnswer) {
  const auto task = make_abcdigits();
  check_batch(*task, 300, 6, [](const std::string& prompt) {
    const AbcText t = parse_abc(prompt);
    for (const auto& [letter, digits] : t.lines) {
      if (letter == t.query) return digits;
    }
    ADD_FAILURE() << "no line for " << t.query;
    return std::string();
  });
}

TEST(Passkey, SampleScoresTheAnswer) {
  for (const std::int64_t digits : {1, 5}) {
    PasskeyConfig config;
    config.digits = digits;
    const auto task = make_passkey(config);
    check_batch(*task, 400, digits,
                [](const std::string& prompt) { return parse_passkey(prompt).key; });
  }
}

}  // namespace
}  // namespace winnow::tasks
