// Multi-query repeated associative recall (002 section 5.1; 000 table 1; spec/tasks.md).
#include <algorithm>
#include <cmath>

#include "tasks/task.h"
#include "winnow/error.h"

namespace winnow::tasks {

MqrarShape mqrar_shape(const MqrarConfig& c, std::int64_t length) {
  if (length % 2 != 0 || length < 4) {
    throw Error(ErrorKind::invalid_argument,
                "length: expected an even number of tokens >= 4 (MQRAR is made of key-value "
                "pairs, at least one initial and one query pair), got " +
                    std::to_string(length));
  }
  const std::int64_t pairs = length / 2;
  // Initial keys are distinct, so at most `keys` of them; longer sequences grow the query
  // phase, which is where the distractors (stale bindings) pile up.
  const auto wanted =
      static_cast<std::int64_t>(std::llround(static_cast<double>(pairs) * c.initial_fraction));
  const std::int64_t initial = std::clamp<std::int64_t>(std::min(wanted, c.keys), 1, pairs - 1);
  return {initial, pairs - initial};
}

std::vector<std::int64_t> mqrar_labels(const std::vector<std::int64_t>& tokens, std::int64_t keys,
                                       std::int64_t initial_pairs) {
  std::vector<std::int64_t> bound(static_cast<std::size_t>(keys), -1), labels(tokens.size(), -1);
  for (std::size_t t = 0; t + 1 < tokens.size(); t += 2) {
    const std::int64_t k = tokens[t], v = tokens[t + 1];
    if (k < 0 || k >= keys || v < keys) {
      throw Error(ErrorKind::invalid_argument, "mqrar_labels: expected key-value pairs (key < " +
                                                   std::to_string(keys) + " <= value), got " +
                                                   std::to_string(k) + " " + std::to_string(v) +
                                                   " at position " + std::to_string(t));
    }
    if (static_cast<std::int64_t>(t / 2) >= initial_pairs) labels[t] = bound[k];
    bound[k] = v;
  }
  return labels;
}

namespace {

class Mqrar final : public Task {
 public:
  explicit Mqrar(const MqrarConfig& c) : c_(c) {}
  std::int64_t vocab_size() const override { return c_.keys + c_.values; }
  std::int64_t min_length() const override { return 4; }

  Batch sample(std::int64_t batch, std::int64_t length, std::uint64_t seed) const override {
    const MqrarShape shape = mqrar_shape(c_, length);
    Rng rng(seed);
    Batch out = blank_batch(batch, length);
    auto in = out.inputs.accessor<std::int64_t, 2>();
    auto tg = out.targets.accessor<std::int64_t, 2>();
    auto m = out.loss_mask.accessor<float, 2>();
    std::vector<std::int64_t> all_keys(static_cast<std::size_t>(c_.keys));
    std::vector<std::int64_t> seq(static_cast<std::size_t>(length));
    // Queries before this one are unlabelled (scored_queries counts from the end).
    const std::int64_t first_scored =
        c_.scored_queries > 0 ? std::max<std::int64_t>(0, shape.queries - c_.scored_queries) : 0;
    for (std::int64_t b = 0; b < batch; ++b) {
      for (std::int64_t k = 0; k < c_.keys; ++k) all_keys[static_cast<std::size_t>(k)] = k;
      // A partial Fisher-Yates shuffle draws the distinct initial keys.
      for (std::int64_t i = 0; i < shape.initial_pairs; ++i) {
        const auto j =
            i + static_cast<std::int64_t>(rng.below(static_cast<std::uint64_t>(c_.keys - i)));
        std::swap(all_keys[static_cast<std::size_t>(i)], all_keys[static_cast<std::size_t>(j)]);
      }
      auto value = [&] {
        return c_.keys +
               static_cast<std::int64_t>(rng.below(static_cast<std::uint64_t>(c_.values)));
      };
      std::size_t t = 0;
      for (std::int64_t i = 0; i < shape.initial_pairs; ++i) {
        seq[t++] = all_keys[static_cast<std::size_t>(i)];
        seq[t++] = value();
      }
      for (std::int64_t i = 0; i < shape.queries; ++i) {
        seq[t++] = all_keys[rng.below(static_cast<std::uint64_t>(shape.initial_pairs))];
        seq[t++] = value();
      }
      const std::vector<std::int64_t> labels = mqrar_labels(seq, c_.keys, shape.initial_pairs);
      for (std::int64_t p = 0; p < length; ++p) {
        in[b][p] = seq[static_cast<std::size_t>(p)];
        const std::int64_t label = labels[static_cast<std::size_t>(p)];
        const std::int64_t query = p / 2 - shape.initial_pairs;
        if (label >= 0 && query >= first_scored) {
          tg[b][p] = label;
          m[b][p] = 1.0f;
        }
      }
    }
    return out;
  }

  std::string render(const std::vector<std::int64_t>& tokens) const override {
    std::string out;
    for (std::int64_t t : tokens) {
      out += out.empty() ? "" : " ";
      out += t < c_.keys ? "k" + std::to_string(t) : "v" + std::to_string(t - c_.keys);
    }
    return out;
  }

 private:
  MqrarConfig c_;
};

}  // namespace

std::unique_ptr<Task> make_mqrar(const MqrarConfig& config) {
  return std::make_unique<Mqrar>(config);
}

}  // namespace winnow::tasks
