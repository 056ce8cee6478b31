#include "train/config.h"

#include <cctype>
#include <fstream>
#include <set>

namespace winnow::train {
namespace {

using nlohmann::json;

bool valid_device(const std::string& d) {
  if (d == "auto" || d == "cpu" || d == "cuda") return true;
  if (d.rfind("cuda:", 0) != 0 || d.size() == 5) return false;
  for (std::size_t i = 5; i < d.size(); ++i) {
    if (!std::isdigit(static_cast<unsigned char>(d[i]))) return false;
  }
  return true;
}

void check_phases(const TrainConfig& t) {
  std::set<std::string> names;
  std::int64_t fixed = 0;
  for (std::size_t i = 0; i < t.phases.size(); ++i) {
    const Phase& p = t.phases[i];
    const std::string key = "train.phases[" + std::to_string(i) + "]";
    if (p.name.empty()) config::fail(key + ".name", "a non-empty name", "\"\"");
    if (!names.insert(p.name).second) {
      config::fail(key + ".name", "a name no other phase has", "\"" + p.name + "\"");
    }
    const bool last = i + 1 == t.phases.size();
    if (last && (p.steps != 0 || p.fraction != 0)) {
      config::fail(key + (p.steps != 0 ? ".steps" : ".fraction"), "0 or absent (the last phase runs to train.steps)",
                   p.steps != 0 ? std::to_string(p.steps) : json(p.fraction).dump());
    }
    if (!last && p.steps > 0 && p.fraction > 0) {
      config::fail(key + ".fraction", "absent when steps is given", json(p.fraction).dump());
    }
    if (!last && p.length(t.steps) < 1) {
      config::fail(key + ".steps", ">= 1 (or a fraction of train.steps that is at least one step)",
                   std::to_string(p.length(t.steps)));
    }
    if (!p.train_only.empty() && !p.freeze.empty()) {
      config::fail(key + ".freeze", "empty when train_only is given", json(p.freeze).dump());
    }
    fixed += p.length(t.steps);
  }
  if (fixed > t.steps) {
    config::fail("train.phases", "phases whose steps fit in train.steps (" +
                                     std::to_string(t.steps) + ")",
                 std::to_string(fixed) + " steps before the last phase");
  }
}

}  // namespace

ExperimentConfig parse_experiment(const json& j) {
  config::Reader r(j, "");
  ExperimentConfig c;
  c.fields(r);
  const json* model = r.claim("model");
  r.finish();
  if (model != nullptr) c.model = nn::read_model(*model, "model");
  resolve(c);
  return c;
}

void resolve(ExperimentConfig& c) {
  // The field lists' rules, for a configuration built in code as much as for a file.
  config::read<TrainConfig>(config::write(c.train), "train");
  config::read<tasks::TaskConfig>(config::write(c.task), "task");
  if (!valid_device(c.device)) config::fail("device", "auto, cpu, cuda or cuda:N", json(c.device).dump());
  if (c.threads < 0) config::fail("threads", ">= 0 (0: the default)", std::to_string(c.threads));
  bool known_task = false;
  for (const std::string& n : tasks::task_names()) known_task |= n == c.task.name;
  if (!known_task) {
    config::fail("task.name", "one of " + config::join(tasks::task_names()), json(c.task.name).dump());
  }
  const TrainConfig& t = c.train;
  if (t.batch_size % t.grad_accum != 0) {
    config::fail("train.grad_accum", "a divisor of train.batch_size (" + std::to_string(t.batch_size) + ")",
                 std::to_string(t.grad_accum));
  }
  if (t.decay_fraction <= 0) config::fail("train.decay_fraction", "in (0, 1]", config::number_text(t.decay_fraction));
  if (t.out_dir.empty()) config::fail("train.out_dir", "a folder", "\"\"");
  check_phases(t);

  const std::int64_t task_vocab = tasks::vocab_size_of(c.task);
  if (c.model.vocab_size == 0) c.model.vocab_size = task_vocab;
  if (c.model.vocab_size < task_vocab) {
    config::fail("model.vocab_size", ">= the task's vocabulary (" + std::to_string(task_vocab) + ")",
                 std::to_string(c.model.vocab_size));
  }
  if (c.model.context_len == 0) c.model.context_len = t.seq_len;
  nn::resolve(c.model, "model");
}

void apply_override(json& j, const std::string& assignment) {
  const std::size_t eq = assignment.find('=');
  if (eq == std::string::npos || eq == 0) {
    throw Error(ErrorKind::invalid_argument,
                "argument '--set': expected key.path=value, got '" + assignment + "'");
  }
  const std::string path = assignment.substr(0, eq), text = assignment.substr(eq + 1);
  json value;
  try {
    value = json::parse(text);
  } catch (const json::parse_error&) {
    value = text;
  }
  auto bad_path = [&](const std::string& why) {
    throw Error(ErrorKind::invalid_argument,
                "argument '--set': key '" + path + "': " + why);
  };
  json* node = &j;
  std::size_t start = 0;
  while (true) {
    const std::size_t dot = path.find('.', start);
    std::string part = path.substr(start, dot == std::string::npos ? std::string::npos : dot - start);
    // An optional list index: phases[1].
    long index = -1;
    if (const std::size_t open = part.find('['); open != std::string::npos) {
      if (part.back() != ']' || open + 2 > part.size() - 1) bad_path("malformed index in '" + part + "'");
      const std::string digits = part.substr(open + 1, part.size() - open - 2);
      for (char ch : digits) {
        if (!std::isdigit(static_cast<unsigned char>(ch))) bad_path("malformed index in '" + part + "'");
      }
      index = std::stol(digits);
      part = part.substr(0, open);
    }
    if (part.empty()) bad_path("empty name");
    if (node->is_null()) *node = json::object();
    if (!node->is_object()) bad_path("'" + part + "' sits inside a value that is not an object");
    node = &(*node)[part];
    if (index >= 0) {
      if (!node->is_array() || static_cast<std::size_t>(index) >= node->size()) {
        bad_path("'" + part + "' has no element " + std::to_string(index));
      }
      node = &(*node)[static_cast<std::size_t>(index)];
    }
    if (dot == std::string::npos) {
      *node = value;
      return;
    }
    start = dot + 1;
  }
}

json read_json_file(const std::string& path, const std::string& argument) {
  std::ifstream f(path);
  if (!f) throw Error(ErrorKind::invalid_argument, "argument '" + argument + "': cannot open '" + path + "'");
  try {
    return json::parse(f);
  } catch (const json::parse_error& e) {
    throw Error(ErrorKind::invalid_argument,
                "argument '" + argument + "': '" + path + "' is not valid JSON: " + e.what());
  }
}

ExperimentConfig load_experiment(const std::string& path, const std::vector<std::string>& overrides) {
  json j = read_json_file(path, "--config");
  for (const std::string& o : overrides) apply_override(j, o);
  return parse_experiment(j);
}

json to_json(const ExperimentConfig& c) {
  json j = config::write(c);
  j["model"] = nn::write_model(c.model);
  return j;
}

}  // namespace winnow::train
