// What a task is, as plain values read from experiment files (nn/fields.h); no LibTorch here,
// so the configuration code that needs a task's vocabulary compiles quickly.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "nn/fields.h"
#include "tasks/text.h"

namespace winnow::tasks {

// MQRAR (spec/tasks.md): keys and values are disjoint token ranges, [0, keys) and
// [keys, keys + values).
struct MqrarConfig {
  std::int64_t keys = 128, values = 128;
  // The share of a sequence's pairs that form the initial assignment (capped by `keys`, since
  // the initial keys are distinct); the rest are query pairs.
  double initial_fraction = 0.5;
  // 0: every query is labelled. N > 0: only the last N queries are (a fixed number of scored
  // queries at every length, one reading of 000's "L = 4").
  std::int64_t scored_queries = 0;

  template <class V>
  void fields(V& v) {
    v("keys", keys, config::at_least(1));
    v("values", values, config::at_least(2));
    v("initial_fraction", initial_fraction, config::in_range(0, 1, false));
    v("scored_queries", scored_queries, config::with_words(config::at_least(0), "0: all"));
  }
};

struct CopyConfig {
  std::int64_t symbols = 32;  // the copied tokens are [0, symbols); the separator is `symbols`
  // Training sequences of L tokens hold one instance of a uniformly drawn 1 .. L/2 symbols
  // (the tokens after it are random and uncounted; causal attention never lets them reach
  // the instance), so a fixed offset to the source cannot solve them. Evaluation is unchanged.
  bool varied_training = false;

  template <class V>
  void fields(V& v) {
    v("symbols", symbols, config::at_least(2));
    v("varied_training", varied_training);
  }
};

// What a generative task's training batches put the loss on: "answer" (only the answer's
// tokens, as evaluation scores them) or "document" (every next token, as a language model
// trained on such documents would see them: repeated lines teach copying long before the
// answer alone does). Held-out batches and evaluation score the answer either way.

struct AbcdigitsConfig {
  std::string training_loss = "answer";

  template <class V>
  void fields(V& v) {
    v("training_loss", training_loss, config::one_of({"answer", "document"}));
  }
};

struct PasskeyConfig {
  std::int64_t digits = 5;
  std::string training_loss = "answer";  // as AbcdigitsConfig's

  template <class V>
  void fields(V& v) {
    v("digits", digits, config::in_range(1, 18, true));
    v("training_loss", training_loss, config::one_of({"answer", "document"}));
  }
};

// Language modeling on a byte-level corpus (tools/prepare_corpus.py writes it): `dir` holds
// train.bin and val.bin, one byte a token (vocab 256), documents separated by NUL bytes.
struct CorpusConfig {
  std::string dir = "data/corpus";

  template <class V>
  void fields(V& v) {
    v("dir", dir);
  }
};

struct TaskConfig {
  std::string name = "progression";  // progression | mqrar | copy | abcdigits | passkey | corpus
  std::int64_t vocab_size = 16;      // progression's vocabulary
  MqrarConfig mqrar;
  CopyConfig copy;
  AbcdigitsConfig abcdigits;
  PasskeyConfig passkey;
  CorpusConfig corpus;

  template <class V>
  void fields(V& v) {
    v("name", name);
    v("vocab_size", vocab_size, config::at_least(3));
    v("mqrar", mqrar);
    v("copy", copy);
    v("abcdigits", abcdigits);
    v("passkey", passkey);
    v("corpus", corpus);
  }
};

const std::vector<std::string>& task_names();

// The vocabulary a task's tokens span (models take theirs from it); an unknown name is an
// error naming task.name.
std::int64_t vocab_size_of(const TaskConfig& c);

}  // namespace winnow::tasks
