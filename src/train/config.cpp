#include "train/config.h"

#include <fstream>
#include <set>

#include "winnow/error.h"

namespace winnow::train {
namespace {

using nlohmann::json;

[[noreturn]] void bad(const std::string& key, const std::string& expected, const std::string& got) {
  throw Error(ErrorKind::invalid_argument,
              "config: key '" + key + "': expected " + expected + ", got " + got);
}

// Walks one JSON object, reading known keys into typed fields; done() rejects the rest.
class Reader {
 public:
  Reader(const json& j, std::string path) : j_(j), path_(std::move(path)) {
    if (!j_.is_object()) bad(path_.empty() ? "(root)" : path_, "an object", j_.dump());
  }

  std::string key(const char* name) const { return path_.empty() ? name : path_ + "." + name; }

  template <class T>
  void read(const char* name, T& out) {
    seen_.insert(name);
    auto it = j_.find(name);
    if (it == j_.end()) return;
    const json& v = *it;
    if constexpr (std::is_same_v<T, bool>) {
      if (!v.is_boolean()) bad(key(name), "true or false", v.dump());
      out = v.get<bool>();
    } else if constexpr (std::is_integral_v<T>) {
      if (!v.is_number_integer()) bad(key(name), "an integer", v.dump());
      out = v.get<T>();
    } else if constexpr (std::is_floating_point_v<T>) {
      if (!v.is_number()) bad(key(name), "a number", v.dump());
      out = v.get<T>();
    } else {
      if (!v.is_string()) bad(key(name), "a string", v.dump());
      out = v.get<std::string>();
    }
  }

  Reader child(const char* name) {
    seen_.insert(name);
    auto it = j_.find(name);
    static const json empty = json::object();
    return Reader(it == j_.end() ? empty : *it, key(name));
  }

  const json* raw(const char* name) {
    seen_.insert(name);
    auto it = j_.find(name);
    return it == j_.end() ? nullptr : &*it;
  }

  void done() const {
    for (auto it = j_.begin(); it != j_.end(); ++it) {
      if (!seen_.count(it.key())) {
        throw Error(ErrorKind::invalid_argument, "config: unknown key '" + key(it.key().c_str()) + "'");
      }
    }
  }

 private:
  const json& j_;
  std::string path_;
  std::set<std::string> seen_;
};

void check(bool ok, const std::string& key, const std::string& expected, const json& got) {
  if (!ok) bad(key, expected, got.dump());
}

void check_choice(const std::string& value, const std::string& key,
                  const std::vector<std::string>& choices) {
  for (const std::string& c : choices) {
    if (value == c) return;
  }
  std::string list;
  for (const std::string& c : choices) list += (list.empty() ? "" : ", ") + c;
  bad(key, "one of " + list, "'" + value + "'");
}

void read_rope(Reader r, nn::RopeConfig& c) {
  r.read("scaling", c.scaling);
  r.read("theta", c.theta);
  r.read("factor", c.factor);
  r.read("original_max_len", c.original_max_len);
  r.read("yarn_beta_fast", c.yarn_beta_fast);
  r.read("yarn_beta_slow", c.yarn_beta_slow);
  r.done();
  check_choice(c.scaling, r.key("scaling"), {"none", "linear", "ntk", "dynamic", "yarn"});
  check(c.theta > 0, r.key("theta"), "> 0", c.theta);
  check(c.factor >= 1, r.key("factor"), ">= 1", c.factor);
}

void read_attention(Reader r, nn::AttentionConfig& c) {
  r.read("kind", c.kind);
  r.read("position", c.position);
  read_rope(r.child("rope"), c.rope);
  r.read("heads", c.heads);
  r.read("kv_heads", c.kv_heads);
  r.read("head_dim", c.head_dim);
  r.read("ssmax", c.ssmax);
  r.read("gate", c.gate);
  r.read("remainder_bias", c.remainder_bias);
  r.read("head_norm", c.head_norm);
  r.read("halt_cutoff", c.halt_cutoff);
  r.read("implementation", c.implementation);
  r.done();
  check_choice(c.kind, r.key("kind"), {"softmax", "differential", "stick_breaking"});
  check_choice(c.position, r.key("position"), {"rope", "nope", "alibi"});
  check_choice(c.gate, r.key("gate"), {"none", "g1", "g2", "g1g2"});
  check_choice(c.implementation, r.key("implementation"), {"kernel", "composed"});
  check(c.heads >= 1, r.key("heads"), ">= 1", c.heads);
  check(c.kv_heads >= 0, r.key("kv_heads"), ">= 0 (0: same as heads)", c.kv_heads);
  check(c.head_dim >= 0, r.key("head_dim"), ">= 0 (0: d_model / heads)", c.head_dim);
  check(c.halt_cutoff >= 0, r.key("halt_cutoff"), ">= 0", c.halt_cutoff);
}

void read_model(Reader r, nn::ModelConfig& c) {
  r.read("vocab_size", c.vocab_size);
  r.read("d_model", c.d_model);
  r.read("layers", c.layers);
  r.read("mlp", c.mlp);
  r.read("mlp_hidden", c.mlp_hidden);
  r.read("tie_embeddings", c.tie_embeddings);
  r.read("norm_eps", c.norm_eps);
  r.read("max_len", c.max_len);
  r.read("init_std", c.init_std);
  read_attention(r.child("attention"), c.attention);
  r.done();
  check(c.vocab_size >= 0, r.key("vocab_size"), ">= 0 (0: the task's vocabulary)", c.vocab_size);
  check(c.d_model >= 1, r.key("d_model"), ">= 1", c.d_model);
  check(c.layers >= 1, r.key("layers"), ">= 1", c.layers);
  check_choice(c.mlp, r.key("mlp"), {"swiglu", "gelu"});
  check(c.norm_eps > 0, r.key("norm_eps"), "> 0", c.norm_eps);
  check(c.init_std > 0, r.key("init_std"), "> 0", c.init_std);
  check(c.d_model % c.attention.heads == 0 || c.attention.head_dim > 0, r.key("d_model"),
        "a multiple of attention.heads (or set attention.head_dim)", c.d_model);
}

void read_train(Reader r, TrainConfig& c) {
  r.read("steps", c.steps);
  r.read("batch_size", c.batch_size);
  r.read("grad_accum", c.grad_accum);
  r.read("seq_len", c.seq_len);
  r.read("lr", c.lr);
  r.read("weight_decay", c.weight_decay);
  r.read("beta1", c.beta1);
  r.read("beta2", c.beta2);
  r.read("eps", c.eps);
  if (const json* m = r.raw("lr_multipliers")) {
    check(m->is_object(), r.key("lr_multipliers"), "an object of name-substring: multiplier", *m);
    for (auto it = m->begin(); it != m->end(); ++it) {
      check(it->is_number() && it->get<double>() > 0, r.key("lr_multipliers") + "." + it.key(),
            "a number > 0", *it);
      c.lr_multipliers.emplace_back(it.key(), it->get<double>());
    }
  }
  r.read("schedule", c.schedule);
  r.read("warmup", c.warmup);
  r.read("min_lr_ratio", c.min_lr_ratio);
  r.read("decay_fraction", c.decay_fraction);
  r.read("clip", c.clip);
  r.read("dtype", c.dtype);
  r.read("log_every", c.log_every);
  r.read("eval_every", c.eval_every);
  r.read("eval_batches", c.eval_batches);
  r.read("checkpoint_every", c.checkpoint_every);
  r.read("out_dir", c.out_dir);
  r.done();
  check(c.steps >= 0, r.key("steps"), ">= 0", c.steps);
  check(c.batch_size >= 1, r.key("batch_size"), ">= 1", c.batch_size);
  check(c.grad_accum >= 1 && c.batch_size % c.grad_accum == 0, r.key("grad_accum"),
        ">= 1 and dividing batch_size (" + std::to_string(c.batch_size) + ")", c.grad_accum);
  check(c.seq_len >= 1, r.key("seq_len"), ">= 1", c.seq_len);
  check(c.lr > 0, r.key("lr"), "> 0", c.lr);
  check(c.weight_decay >= 0, r.key("weight_decay"), ">= 0", c.weight_decay);
  check(c.beta1 >= 0 && c.beta1 < 1, r.key("beta1"), "in [0, 1)", c.beta1);
  check(c.beta2 >= 0 && c.beta2 < 1, r.key("beta2"), "in [0, 1)", c.beta2);
  check(c.eps > 0, r.key("eps"), "> 0", c.eps);
  check_choice(c.schedule, r.key("schedule"), {"constant", "cosine", "wsd"});
  check(c.warmup >= 0, r.key("warmup"), ">= 0", c.warmup);
  check(c.min_lr_ratio >= 0 && c.min_lr_ratio <= 1, r.key("min_lr_ratio"), "in [0, 1]", c.min_lr_ratio);
  check(c.decay_fraction > 0 && c.decay_fraction <= 1, r.key("decay_fraction"), "in (0, 1]", c.decay_fraction);
  check(c.clip >= 0, r.key("clip"), ">= 0 (0: off)", c.clip);
  check_choice(c.dtype, r.key("dtype"), {"auto", "float32", "bfloat16"});
  check(c.log_every >= 1, r.key("log_every"), ">= 1", c.log_every);
  check(c.eval_every >= 0, r.key("eval_every"), ">= 0", c.eval_every);
  check(c.eval_batches >= 1, r.key("eval_batches"), ">= 1", c.eval_batches);
  check(c.checkpoint_every >= 0, r.key("checkpoint_every"), ">= 0", c.checkpoint_every);
}

void read_task(Reader r, tasks::TaskConfig& c) {
  r.read("name", c.name);
  r.read("vocab_size", c.vocab_size);
  r.done();
  check_choice(c.name, r.key("name"), tasks::task_names());
}

}  // namespace

ExperimentConfig parse_experiment(const json& j) {
  Reader r(j, "");
  ExperimentConfig c;
  r.read("seed", c.seed);
  r.read("device", c.device);
  r.read("threads", c.threads);
  read_model(r.child("model"), c.model);
  read_train(r.child("train"), c.train);
  read_task(r.child("task"), c.task);
  r.done();
  check(c.device == "auto" || c.device == "cpu" || c.device.rfind("cuda", 0) == 0, "device",
        "auto, cpu, cuda or cuda:N", c.device);
  check(c.threads >= 0, "threads", ">= 0", c.threads);
  if (c.model.vocab_size == 0) c.model.vocab_size = c.task.vocab_size;
  check(c.model.vocab_size >= c.task.vocab_size, "model.vocab_size",
        ">= task.vocab_size (" + std::to_string(c.task.vocab_size) + ")", c.model.vocab_size);
  check(c.model.max_len >= c.train.seq_len, "model.max_len",
        ">= train.seq_len (" + std::to_string(c.train.seq_len) + ")", c.model.max_len);
  return c;
}

void apply_override(json& j, const std::string& assignment) {
  const std::size_t eq = assignment.find('=');
  if (eq == std::string::npos || eq == 0) {
    throw Error(ErrorKind::invalid_argument,
                "config override: expected key.path=value, got '" + assignment + "'");
  }
  const std::string path = assignment.substr(0, eq), text = assignment.substr(eq + 1);
  json value;
  try {
    value = json::parse(text);
  } catch (const json::parse_error&) {
    value = text;  // a bare word is a string: --set model.attention.kind=softmax
  }
  json* node = &j;
  std::size_t start = 0;
  while (true) {
    const std::size_t dot = path.find('.', start);
    const std::string part = path.substr(start, dot == std::string::npos ? std::string::npos : dot - start);
    if (part.empty()) {
      throw Error(ErrorKind::invalid_argument, "config override: empty key in '" + path + "'");
    }
    if (!node->is_object()) {
      throw Error(ErrorKind::invalid_argument,
                  "config override: '" + path + "' descends into a value that is not an object");
    }
    if (dot == std::string::npos) {
      (*node)[part] = value;
      return;
    }
    node = &(*node)[part];
    if (node->is_null()) *node = json::object();
    start = dot + 1;
  }
}

ExperimentConfig load_experiment(const std::string& path, const std::vector<std::string>& overrides) {
  std::ifstream f(path);
  if (!f) throw Error(ErrorKind::invalid_argument, "config: cannot open '" + path + "'");
  json j;
  try {
    j = json::parse(f);
  } catch (const json::parse_error& e) {
    throw Error(ErrorKind::invalid_argument, "config: '" + path + "' is not valid JSON: " + e.what());
  }
  for (const std::string& o : overrides) apply_override(j, o);
  return parse_experiment(j);
}

json to_json(const ExperimentConfig& c) {
  const nn::ModelConfig& m = c.model;
  const nn::AttentionConfig& a = m.attention;
  const TrainConfig& t = c.train;
  json multipliers = json::object();
  for (const auto& [name, mult] : t.lr_multipliers) multipliers[name] = mult;
  return {
      {"seed", c.seed},
      {"device", c.device},
      {"threads", c.threads},
      {"model",
       {{"vocab_size", m.vocab_size}, {"d_model", m.d_model}, {"layers", m.layers}, {"mlp", m.mlp},
        {"mlp_hidden", m.mlp_hidden}, {"tie_embeddings", m.tie_embeddings}, {"norm_eps", m.norm_eps},
        {"max_len", m.max_len}, {"init_std", m.init_std},
        {"attention",
         {{"kind", a.kind}, {"position", a.position},
          {"rope",
           {{"scaling", a.rope.scaling}, {"theta", a.rope.theta}, {"factor", a.rope.factor},
            {"original_max_len", a.rope.original_max_len}, {"yarn_beta_fast", a.rope.yarn_beta_fast},
            {"yarn_beta_slow", a.rope.yarn_beta_slow}}},
          {"heads", a.heads}, {"kv_heads", a.kv_heads}, {"head_dim", a.head_dim}, {"ssmax", a.ssmax},
          {"gate", a.gate}, {"remainder_bias", a.remainder_bias}, {"head_norm", a.head_norm},
          {"halt_cutoff", a.halt_cutoff}, {"implementation", a.implementation}}}}},
      {"train",
       {{"steps", t.steps}, {"batch_size", t.batch_size}, {"grad_accum", t.grad_accum},
        {"seq_len", t.seq_len}, {"lr", t.lr}, {"weight_decay", t.weight_decay}, {"beta1", t.beta1},
        {"beta2", t.beta2}, {"eps", t.eps}, {"lr_multipliers", multipliers}, {"schedule", t.schedule},
        {"warmup", t.warmup}, {"min_lr_ratio", t.min_lr_ratio}, {"decay_fraction", t.decay_fraction},
        {"clip", t.clip}, {"dtype", t.dtype}, {"log_every", t.log_every}, {"eval_every", t.eval_every},
        {"eval_batches", t.eval_batches}, {"checkpoint_every", t.checkpoint_every}, {"out_dir", t.out_dir}}},
      {"task", {{"name", c.task.name}, {"vocab_size", c.task.vocab_size}}},
  };
}

}  // namespace winnow::train
