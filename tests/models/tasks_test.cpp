// MQRAR and Copy: the spec's hand-made example, the structure of generated instances against
// an independent re-derivation of their labels, length rules and determinism. The byte-level
// corpus: windows of the files' bytes, determinism, errors.
#include <gtest/gtest.h>

#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "tasks/task.h"
#include "winnow/error.h"

namespace winnow::tasks {
namespace {

std::vector<std::int64_t> row(const torch::Tensor& t, std::int64_t b) {
  const torch::Tensor r = t[b].contiguous().to(torch::kInt64);
  return {r.data_ptr<std::int64_t>(), r.data_ptr<std::int64_t>() + r.numel()};
}

template <class F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return "(no error)";
}

// spec/tasks.md: B 6 P 4 E 3 X 1 Z 2 | E 2 B 1 E 5 B 4 labels 3 . 6 . 2 . 1 . in the query phase.
TEST(Mqrar, LabelsOfTheSpecExample) {
  const std::map<char, std::int64_t> key = {{'B', 0}, {'P', 1}, {'E', 2}, {'X', 3}, {'Z', 4}};
  const std::int64_t keys = 5;
  const std::string text = "B6P4E3X1Z2E2B1E5B4";
  std::vector<std::int64_t> tokens;
  for (std::size_t i = 0; i < text.size(); ++i) {
    tokens.push_back(i % 2 == 0 ? key.at(text[i]) : keys + (text[i] - '0'));
  }
  const std::vector<std::int64_t> labels = mqrar_labels(tokens, keys, 5);
  std::vector<std::int64_t> expected(18, -1);
  expected[10] = keys + 3;  // E: its initial 3
  expected[12] = keys + 6;  // B: its initial 6
  expected[14] = keys + 2;  // E again: the 2 of its re-binding, not the initial 3
  expected[16] = keys + 1;  // B again: 1
  EXPECT_EQ(labels, expected);
}

TEST(Mqrar, ShapeScalesTheQueriesOnceTheKeysRunOut) {
  MqrarConfig c;  // 128 keys, half the pairs initial
  EXPECT_EQ(mqrar_shape(c, 64).initial_pairs, 16);
  EXPECT_EQ(mqrar_shape(c, 64).queries, 16);
  EXPECT_EQ(mqrar_shape(c, 256).initial_pairs, 64);
  EXPECT_EQ(mqrar_shape(c, 1024).initial_pairs, 128);
  EXPECT_EQ(mqrar_shape(c, 1024).queries, 384);
  EXPECT_EQ(mqrar_shape(c, 4).initial_pairs, 1);
  EXPECT_EQ(mqrar_shape(c, 4).queries, 1);
  EXPECT_NE(error_of([&] { mqrar_shape(c, 65); }).find("length: expected an even number"),
            std::string::npos);
  EXPECT_NE(error_of([&] { mqrar_shape(c, 2); }).find("got 2"), std::string::npos);
}

// Labels re-derived by scanning back for the key's most recent pair.
TEST(Mqrar, InstancesHaveDistinctInitialKeysAndTheMostRecentBindingAsLabel) {
  MqrarConfig c;
  c.keys = 6;
  c.values = 5;
  auto task = make_mqrar(c);
  EXPECT_EQ(task->vocab_size(), 11);
  const std::int64_t length = 40;
  const MqrarShape shape = mqrar_shape(c, length);
  ASSERT_EQ(shape.initial_pairs, 6);  // 10 wanted, capped by the 6 keys
  const Batch b = task->sample(32, length, 7);
  ASSERT_EQ(b.inputs.sizes(), (std::vector<std::int64_t>{32, length}));
  for (std::int64_t r = 0; r < 32; ++r) {
    const auto in = row(b.inputs, r), tg = row(b.targets, r);
    const torch::Tensor m = b.loss_mask[r];
    std::set<std::int64_t> initial;
    for (std::int64_t p = 0; p < length; ++p) {
      if (p % 2 == 0) {
        ASSERT_GE(in[p], 0);
        ASSERT_LT(in[p], c.keys);
        if (p / 2 < shape.initial_pairs) {
          EXPECT_TRUE(initial.insert(in[p]).second) << "initial keys repeat";
        } else {
          EXPECT_TRUE(initial.count(in[p])) << "a query asks for an unassigned key";
        }
      } else {
        ASSERT_GE(in[p], c.keys);
        ASSERT_LT(in[p], c.keys + c.values);
      }
      const bool query_key = p % 2 == 0 && p / 2 >= shape.initial_pairs;
      EXPECT_EQ(m[p].item<float>(), query_key ? 1.0f : 0.0f) << "position " << p;
      if (query_key) {
        std::int64_t expected = -1;
        for (std::int64_t q = p - 2; q >= 0; q -= 2) {
          if (in[q] == in[p]) {
            expected = in[q + 1];
            break;
          }
        }
        EXPECT_EQ(tg[p], expected) << "position " << p;
      }
    }
  }
}

TEST(Mqrar, ScoredQueriesLabelsOnlyTheLastOnes) {
  MqrarConfig c;
  c.scored_queries = 3;
  auto task = make_mqrar(c);
  const Batch b = task->sample(4, 64, 1);
  for (std::int64_t r = 0; r < 4; ++r) {
    EXPECT_EQ(b.loss_mask[r].sum().item<float>(), 3.0f);
    EXPECT_EQ(b.loss_mask[r].narrow(0, 58, 6).sum().item<float>(), 3.0f);
    for (std::int64_t p : {58, 60, 62}) EXPECT_EQ(b.loss_mask[r][p].item<float>(), 1.0f);
  }
}

TEST(Mqrar, SameSeedSameInstancesOtherSeedOthers) {
  auto task = make_mqrar(MqrarConfig{});
  const Batch a = task->sample(8, 128, 42), b = task->sample(8, 128, 42),
              c = task->sample(8, 128, 43);
  EXPECT_TRUE(torch::equal(a.inputs, b.inputs));
  EXPECT_TRUE(torch::equal(a.targets, b.targets));
  EXPECT_FALSE(torch::equal(a.inputs, c.inputs));
  // The instances of one batch differ from each other.
  EXPECT_FALSE(torch::equal(a.inputs[0], a.inputs[1]));
}

TEST(Copy, LayoutTargetsAndMask) {
  CopyConfig c;
  c.symbols = 32;
  auto task = make_copy(c);
  EXPECT_EQ(task->vocab_size(), 33);
  const Batch b = task->sample(3, 10, 5);
  for (std::int64_t r = 0; r < 3; ++r) {
    const auto in = row(b.inputs, r), tg = row(b.targets, r);
    for (int i = 0; i < 5; ++i) {
      EXPECT_LT(in[i], 32);
      EXPECT_EQ(tg[5 + i], in[i]) << "the copy is predicted from the separator on";
    }
    EXPECT_EQ(in[5], 32);  // the separator
    for (int i = 0; i < 4; ++i) EXPECT_EQ(in[6 + i], in[i]);
    for (int p = 0; p < 10; ++p) EXPECT_EQ(b.loss_mask[r][p].item<float>(), p >= 5 ? 1.0f : 0.0f);
  }
  EXPECT_NE(error_of([&] { task->sample(1, 9, 0); }).find("length: expected an even number"),
            std::string::npos);
}

// varied_training: training rows start with an instance of 1 .. L/2 symbols and count only its
// copy; evaluation batches keep L/2 symbols and are the same as without the option.
TEST(Copy, VariedTrainingDrawsInstanceSizesAndLeavesEvaluationAlone) {
  CopyConfig fixed, varied;
  varied.varied_training = true;
  auto fixed_task = make_copy(fixed), varied_task = make_copy(varied);
  const Batch eval_a = fixed_task->sample(4, 16, 3), eval_b = varied_task->sample(4, 16, 3);
  EXPECT_TRUE(torch::equal(eval_a.inputs, eval_b.inputs));
  EXPECT_TRUE(torch::equal(fixed_task->sample_training(4, 16, 3).inputs, eval_a.inputs));

  const Batch b = varied_task->sample_training(64, 16, 7);
  std::set<std::int64_t> sizes;
  for (std::int64_t r = 0; r < 64; ++r) {
    const auto in = row(b.inputs, r), tg = row(b.targets, r);
    std::int64_t m = 0;
    while (in[m] != 32) ++m;  // the first separator ends the instance's symbols
    ASSERT_GE(m, 1);
    ASSERT_LE(m, 8);
    sizes.insert(m);
    for (std::int64_t p = 0; p < 16; ++p) {
      const bool counted = p >= m && p < 2 * m;
      EXPECT_EQ(b.loss_mask[r][p].item<float>(), counted ? 1.0f : 0.0f) << "row " << r << " pos " << p;
      if (counted) EXPECT_EQ(tg[p], in[p - m]) << "row " << r << " pos " << p;
    }
  }
  EXPECT_GE(sizes.size(), 6u) << "instance sizes are drawn, not fixed";
}

// A corpus folder as tools/prepare_corpus.py writes it: train.bin and val.bin of known bytes
// (train: byte i is (7 i + 3) mod 251, so every window of 2+ bytes occurs once; val: all 200).
std::string write_corpus(std::int64_t train_bytes = 5000) {
  // A folder per process and call: ctest runs tests in parallel processes.
  static int calls = 0;
  const std::filesystem::path dir = std::filesystem::temp_directory_path() /
                                    ("winnow_corpus_test_" + std::to_string(::getpid()) + "_" + std::to_string(calls++));
  std::filesystem::create_directories(dir);
  std::ofstream train(dir / "train.bin", std::ios::binary), val(dir / "val.bin", std::ios::binary);
  for (std::int64_t i = 0; i < train_bytes; ++i) train.put(static_cast<char>((7 * i + 3) % 251));
  for (int i = 0; i < 300; ++i) val.put(static_cast<char>(200));
  return dir.string();
}

TEST(Corpus, WindowsAreTheFilesBytesWithTargetsOneAhead) {
  TaskConfig c;
  c.name = "corpus";
  c.corpus.dir = write_corpus();
  const auto task = make_task(c);
  EXPECT_EQ(task->vocab_size(), 256);
  const Batch b = task->sample_training(16, 100, 11);
  ASSERT_EQ(b.inputs.sizes(), (std::vector<std::int64_t>{16, 100}));
  EXPECT_EQ(b.loss_mask.sum().item<double>(), 1600.0);
  for (std::int64_t r = 0; r < 16; ++r) {
    const std::vector<std::int64_t> in = row(b.inputs, r), target = row(b.targets, r);
    // The window starts where its first byte's step of 7 modulo 251 puts it; every later byte
    // and every target must continue the file from there.
    for (std::int64_t t = 0; t + 1 < 100; ++t) EXPECT_EQ(target[t], in[t + 1]);
    for (std::int64_t t = 0; t < 100; ++t) EXPECT_EQ((in[t] + 7) % 251, target[t]);
  }
  // Evaluation reads val.bin.
  const Batch v = task->sample(4, 50, 11);
  EXPECT_EQ(v.inputs.min().item<std::int64_t>(), 200);
  EXPECT_EQ(v.inputs.max().item<std::int64_t>(), 200);
}

TEST(Corpus, SameSeedSameWindowsOtherSeedOthers) {
  TaskConfig c;
  c.name = "corpus";
  c.corpus.dir = write_corpus();
  const auto task = make_task(c);
  const Batch a = task->sample_training(8, 64, 5), again = task->sample_training(8, 64, 5);
  const Batch other = task->sample_training(8, 64, 6);
  EXPECT_TRUE(torch::equal(a.inputs, again.inputs));
  EXPECT_FALSE(torch::equal(a.inputs, other.inputs));
  // A second task over the same folder (a resumed run) draws the same windows.
  EXPECT_TRUE(torch::equal(make_task(c)->sample_training(8, 64, 5).inputs, a.inputs));
}

TEST(Corpus, ErrorsNameTheFolderAndTheLength) {
  TaskConfig c;
  c.name = "corpus";
  c.corpus.dir = "/nonexistent/winnow-corpus";
  const std::string missing = error_of([&] { make_task(c); });
  EXPECT_NE(missing.find("task.corpus.dir"), std::string::npos) << missing;
  EXPECT_NE(missing.find("make corpus"), std::string::npos) << missing;
  c.corpus.dir = write_corpus(50);
  const auto task = make_task(c);
  const std::string too_long = error_of([&] { task->sample_training(2, 50, 1); });
  EXPECT_NE(too_long.find("length: expected at most 49"), std::string::npos) << too_long;
  EXPECT_EQ(task->render({'a', 0, '\n', 200}), "a<|doc|>\\n\\xc8");
}

TEST(Tasks, ConfigurationAndGeneratorAgreeOnTheVocabulary) {
  for (const std::string& name : task_names()) {
    TaskConfig c;
    c.name = name;
    c.mqrar.keys = 7;
    c.copy.symbols = 9;
    c.corpus.dir = write_corpus();
    EXPECT_EQ(make_task(c)->vocab_size(), vocab_size_of(c)) << name;
  }
}

TEST(Tasks, RegistryAndPortableRandomness) {
  TaskConfig c;
  c.name = "mqrar";
  EXPECT_EQ(make_task(c)->vocab_size(), 256);
  c.name = "nope";
  EXPECT_NE(error_of([&] { make_task(c); }).find("task.name"), std::string::npos);
  // Rng draws from the raw engine: its numbers are the same on every platform.
  Rng rng(5489);
  std::mt19937_64 engine(5489);
  const std::uint64_t first = engine();
  EXPECT_EQ(rng.below(~0ull), first % ~0ull);
  Rng a(3), b(3);
  for (int i = 0; i < 100; ++i) {
    const std::uint64_t x = a.below(7);
    EXPECT_LT(x, 7u);
    EXPECT_EQ(x, b.below(7));
  }
}

}  // namespace
}  // namespace winnow::tasks
