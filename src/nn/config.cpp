#include "nn/config.h"

#include <algorithm>

#include "nn/mechanisms.h"

namespace winnow::nn {

ModelConfig read_model(const nlohmann::json& j, const std::string& path) {
  config::Reader r(j, path);
  ModelConfig c;
  c.fields(r);
  const nlohmann::json* attention = r.claim("attention");
  r.finish();
  if (attention != nullptr) {
    config::Reader a(*attention, path + ".attention");
    c.attention.fields(a);
    c.attention.options = a.unclaimed();
  }
  return c;
}

nlohmann::json write_model(const ModelConfig& c) {
  nlohmann::json m = config::write(c);
  nlohmann::json a = config::write(c.attention);
  a.update(c.attention.options);
  m["attention"] = a;
  return m;
}

void resolve(ModelConfig& c, const std::string& path) {
  // A config built in code passes the same rules as one read from a file.
  config::read<ModelConfig>(config::write(c), path);
  AttentionConfig& a = c.attention;
  const std::string ap = path + ".attention";
  {
    nlohmann::json common = config::write(a);
    config::read<AttentionConfig>(common, ap);
  }
  if (c.vocab_size < 1) {
    config::fail(path + ".vocab_size", ">= 1 (or 0 in a file, where the task supplies it)", "0");
  }
  if (c.context_len < 1) {
    config::fail(path + ".context_len", ">= 1 (or 0 in a file, where train.seq_len supplies it)",
                 std::to_string(c.context_len));
  }
  if (c.multiscreen.tiles == 0) c.multiscreen.tiles = c.layers;
  if (c.mlp_hidden == 0) {
    const std::int64_t raw = c.mlp == "swiglu" ? (8 * c.d_model + 2) / 3 : 4 * c.d_model;
    c.mlp_hidden = (raw + 63) / 64 * 64;
  }

  const Mechanism& m = find_mechanism(a.kind, ap + ".kind");
  if (a.position == "auto") a.position = m.positions.front();
  if (std::find(m.positions.begin(), m.positions.end(), a.position) == m.positions.end()) {
    config::fail(ap + ".position",
                 "one of " + config::join(m.positions) + " for attention kind '" + a.kind + "'",
                 "\"" + a.position + "\"");
  }
  if (a.kv_heads == 0) a.kv_heads = a.heads;
  if (a.heads % a.kv_heads != 0) {
    config::fail(ap + ".kv_heads", "a divisor of heads (" + std::to_string(a.heads) + ")",
                 std::to_string(a.kv_heads));
  }
  if (a.head_dim == 0) {
    if (c.d_model % a.heads != 0) {
      config::fail(ap + ".heads",
                   "a divisor of d_model (" + std::to_string(c.d_model) + "), or set head_dim",
                   std::to_string(a.heads));
    }
    a.head_dim = c.d_model / a.heads;
  }
  if (a.position == "rope" && a.head_dim % 2 != 0) {
    config::fail(ap + ".head_dim", "an even number (RoPE rotates pairs)", std::to_string(a.head_dim));
  }

  for (auto it = a.options.begin(); it != a.options.end(); ++it) {
    if (std::find(m.option_keys.begin(), m.option_keys.end(), it.key()) == m.option_keys.end()) {
      const std::string common = config::join(config::keys_of<AttentionConfig>());
      throw Error(ErrorKind::invalid_argument,
                  "config: unknown key '" + ap + "." + it.key() + "' (every attention kind takes " +
                      common + "; kind '" + a.kind + "' adds " +
                      (m.option_keys.empty() ? std::string("nothing") : config::join(m.option_keys)) +
                      ")");
    }
  }
  a.options = m.resolve_options(a.options, ap);

  const std::string gap = m.kernel_gap ? m.kernel_gap(a) : std::string();
  if (a.implementation == "kernel" && !gap.empty()) {
    config::fail(ap + ".implementation", "auto or composed (" + gap + ")", "\"kernel\"");
  }
  if (a.implementation == "auto") a.implementation = gap.empty() ? "kernel" : "composed";
  if (m.check) m.check(a, ap);
}

}  // namespace winnow::nn
