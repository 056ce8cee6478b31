#include "tasks/task_config.h"

namespace winnow::tasks {

const std::vector<std::string>& task_names() {
  static const std::vector<std::string> names = {"progression", "mqrar", "copy", "abcdigits",
                                                 "passkey", "corpus"};
  return names;
}

std::int64_t vocab_size_of(const TaskConfig& c) {
  if (c.name == "progression") return c.vocab_size;
  if (c.name == "mqrar") return c.mqrar.keys + c.mqrar.values;
  if (c.name == "copy") return c.copy.symbols + 1;
  if (c.name == "abcdigits" || c.name == "passkey") return text::kVocab;
  if (c.name == "corpus") return 256;
  config::fail("task.name", "one of " + config::join(task_names()), "\"" + c.name + "\"");
}

}  // namespace winnow::tasks
