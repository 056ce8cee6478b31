#include "study/study.h"

#include <torch/torch.h>
#include <torch/version.h>

#include <algorithm>
#include <cctype>
#include <cmath>
#include <chrono>
#include <cstdio>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <map>
#include <optional>
#include <set>

#include "eval/evaluate.h"
#include "study/report.h"
#include "tasks/task.h"
#include "train/checkpoint.h"
#include "train/config.h"
#include "train/trainer.h"
#include "winnow/error.h"

namespace winnow::study {
namespace fs = std::filesystem;
using nlohmann::json;

namespace {

[[noreturn]] void fail(const std::string& what) {
  throw Error(ErrorKind::invalid_argument, "study: " + what);
}

// Nested objects count as their dotted leaves: {"model": {"attention": {"filter": x}}} is
// "model.attention.filter": x. `--set mechanisms[5].set.model.attention.filter=exact` writes
// the nested form into a set of flat keys; applied as one value it would replace the base's
// whole model and then lose to the flat key. A leaf given both ways is an error.
void flatten_into(const std::string& key, const json& value, std::map<std::string, json>& leaves,
                  const std::string& where) {
  if (value.is_object() && !value.empty()) {
    for (auto it = value.begin(); it != value.end(); ++it) flatten_into(key + "." + it.key(), it.value(), leaves, where);
    return;
  }
  if (!leaves.emplace(key, value).second) fail(where + ": key '" + key + "' is given twice (flat and nested)");
}

// Applies {"dotted.key": value, ...}; `where` names the object in errors.
void apply_dotted(json& target, const json& dotted, const std::string& where) {
  if (!dotted.is_object())
    fail(where + ": expected an object of \"dotted.key\": value, got " + dotted.dump());
  std::map<std::string, json> leaves;
  for (auto it = dotted.begin(); it != dotted.end(); ++it) flatten_into(it.key(), it.value(), leaves, where);
  for (const auto& [key, value] : leaves) {
    try {
      train::apply_override(target, key + "=" + value.dump());
    } catch (const Error& e) {
      fail(where + ": " + e.what());
    }
  }
}

bool runs_on_cuda(const std::string& device) {
  if (device.rfind("cuda", 0) == 0) return true;
  return device == "auto" && torch::cuda::is_available();
}

// A mechanism's experiment: the base, its `set`, its own output folder.
json mechanism_config(const Study& s, const MechanismEntry& m) {
  json j = s.base;
  apply_dotted(j, m.set, "mechanism '" + m.label + "': set");
  j["train"]["out_dir"] = (fs::path(s.out_dir) / slug(m.label)).string();
  return j;
}

// The model a mechanism is evaluated with: the trained one, or (eval_set) one built from its
// config with those model keys changed, holding the trained weights.
nn::LanguageModel evaluation_model(const MechanismEntry& m, train::Trainer& trainer) {
  if (m.eval_set.empty()) return trainer.model();
  const std::string where = "mechanism '" + m.label + "': eval_set";
  for (auto it = m.eval_set.begin(); it != m.eval_set.end(); ++it) {
    if (it.key().rfind("model.", 0) != 0) fail(where + ": expected keys of the model (model.*), got '" + it.key() + "'");
  }
  json j = {{"model", nn::write_model(trainer.model()->config())}};
  apply_dotted(j, m.eval_set, where);
  nn::LanguageModel model = nn::make_language_model(nn::read_model(j["model"], "model"));
  torch::NoGradGuard no_grad;
  auto trained = trainer.model()->named_parameters();
  for (auto& item : model->named_parameters()) item.value().copy_(trained[item.key()]);
  auto trained_buffers = trainer.model()->named_buffers();
  for (auto& item : model->named_buffers()) {
    if (trained_buffers.contains(item.key())) item.value().copy_(trained_buffers[item.key()]);
  }
  model->to(trainer.device());
  return model;
}

// A run of a sweep: the mechanism's experiment with the swept key set, in its own folder.
json sweep_config(const Study& s, const MechanismEntry& m, const json& value) {
  json j = mechanism_config(s, m);
  try {
    train::apply_override(j, s.sweep.key + "=" + value.dump());
  } catch (const Error& e) {
    fail("sweep.key: " + std::string(e.what()));
  }
  j["train"]["out_dir"] = (fs::path(s.out_dir) / ("sweep_" + slug(s.sweep.key)) / slug(m.label) /
                           slug(value.dump()))
                              .string();
  return j;
}

tasks::TaskConfig eval_task_config(const Study& s, const train::ExperimentConfig& trained) {
  json task = config::write(trained.task);
  apply_dotted(task, s.eval.task, "eval.task");
  return config::read<tasks::TaskConfig>(task, "eval.task");
}

std::string today() {
  const std::time_t now = std::time(nullptr);
  char text[16];
  std::strftime(text, sizeof text, "%Y-%m-%d", std::gmtime(&now));
  return text;
}

// Whether --only leaves the mechanism in.
bool selected(const RunOptions& options, const MechanismEntry& m) {
  return options.only.empty() ||
         std::find(options.only.begin(), options.only.end(), m.label) != options.only.end();
}

// Writes the result JSON and its Markdown report into `dir` and prints the report.
void write_outputs(const fs::path& dir, const std::string& json_name, const std::string& md_name,
                   const json& result, const std::string& report) {
  for (const auto& [name, text] : {std::pair{json_name, result.dump(2) + "\n"}, std::pair{md_name, report}}) {
    std::ofstream f(dir / name);
    f << text;
    if (!f) throw Error(ErrorKind::runtime, "study: cannot write '" + (dir / name).string() + "'");
  }
  std::printf("\n%s\nresult: %s, table: %s\n", report.c_str(), (dir / json_name).string().c_str(),
              (dir / md_name).string().c_str());
}

// The name of the study's measure: its metric (accuracy or exact match) for tasks scored on
// whole sequences, exact match for generative ones.
std::string measure_name(const Study& s, const tasks::Task& task) {
  return task.generative() ? "exact_match" : s.eval.metric;
}

// The study's measure of a model at one length (measure_name; for generative tasks the mean
// over the depths).
double measure_at(const Study& s, const nn::LanguageModel& model, const tasks::Task& task,
                  std::int64_t length, std::int64_t instances, std::uint64_t seed,
                  const eval::Runtime& rt) {
  if (task.generative()) {
    double sum = 0;
    for (std::size_t d = 0; d < s.eval.depths.size(); ++d) {
      sum += eval::score_generation(model, task, length, s.eval.depths[d], instances, seed, rt).exact_match();
    }
    return s.eval.depths.empty() ? 0.0 : sum / static_cast<double>(s.eval.depths.size());
  }
  const eval::SequenceScore score = eval::score_sequences(model, task, length, instances, seed, rt);
  return s.eval.metric == "exact_match" ? score.exact_match() : score.accuracy();
}

// eval.select_multiple: scores every kept checkpoint of the run, leaves the best one's weights
// in the trainer's model and returns what it measured. The instances are drawn from another
// seed than the evaluation's, so the choice does not see the instances it is reported on.
json select_checkpoint(const Study& s, const MechanismEntry& m, const train::ExperimentConfig& config,
                       const tasks::Task& task, train::Trainer& trainer, const eval::Runtime& rt) {
  const fs::path root = fs::path(config.train.out_dir) / "checkpoints";
  const auto kept = train::step_checkpoints(root.string());  // (step, folder), oldest first
  if (kept.empty()) {
    fail("eval.select_multiple: mechanism '" + m.label + "' has no checkpoint in '" + root.string() +
         "' to choose from");
  }
  const std::int64_t length = config.train.seq_len * s.eval.select_multiple;
  const std::uint64_t seed = config.seed + 0x9E3779B97F4A7C15ull;  // apart from the evaluation's
  const std::string measure = measure_name(s, task);
  json checkpoints = json::array();
  double best = -1;
  std::size_t chosen = 0;
  for (std::size_t i = 0; i < kept.size(); ++i) {
    train::read_checkpoint(kept[i].second);  // verified before it is read
    train::restore_model(kept[i].second, *trainer.model());
    const double value = measure_at(s, trainer.model(), task, length, s.eval.select_instances, seed, rt);
    checkpoints.push_back({{"step", kept[i].first}, {measure, value}});
    if (value >= best) {
      best = value;
      chosen = i;
    }
  }
  // The model holds the last one scored.
  if (chosen + 1 != kept.size()) train::restore_model(kept[chosen].second, *trainer.model());
  std::printf("   checkpoint chosen at %lldx (L = %lld, %lld instances): step %lld, %s %.1f%%, of %zu\n",
              static_cast<long long>(s.eval.select_multiple), static_cast<long long>(length),
              static_cast<long long>(s.eval.select_instances), static_cast<long long>(kept[chosen].first),
              measure.c_str(), 100.0 * best, kept.size());
  std::fflush(stdout);
  return {{"multiple", s.eval.select_multiple}, {"length", length},
          {"instances", s.eval.select_instances}, {"measure", measure},
          {"checkpoints", checkpoints}, {"chosen_step", kept[chosen].first}};
}

std::int64_t parameter_count(train::Trainer& t) {
  std::int64_t n = 0;
  for (const auto& p : t.model()->parameters()) n += p.numel();
  return n;
}

}  // namespace

std::string slug(const std::string& label) {
  std::string out;
  for (char c : label) {
    const bool keep = std::isalnum(static_cast<unsigned char>(c)) != 0;
    if (keep) {
      out += static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
    } else if (!out.empty() && out.back() != '_') {
      out += '_';
    }
  }
  while (!out.empty() && out.back() == '_') out.pop_back();
  return out.empty() ? "run" : out;
}

Study load_study(const std::string& path, const std::vector<std::string>& overrides) {
  json j = train::read_json_file(path, "FILE");
  // Where it runs decides the profile; the overrides may move it.
  json probe = j;
  for (const std::string& o : overrides) train::apply_override(probe, o);
  std::string device = "auto";
  if (probe.contains("base") && probe["base"].is_object() && probe["base"].contains("device")) {
    const json& d = probe["base"]["device"];
    if (!d.is_string()) config::fail("base.device", "auto, cpu, cuda or cuda:N", d.dump());
    device = d.get<std::string>();
  }
  const std::string profile = runs_on_cuda(device) ? "cuda" : "cpu";
  if (j.contains("profiles")) {
    if (!j["profiles"].is_object()) fail("key 'profiles': expected an object with cpu and/or cuda");
    for (auto it = j["profiles"].begin(); it != j["profiles"].end(); ++it) {
      if (it.key() != "cpu" && it.key() != "cuda") {
        config::fail("profiles." + it.key(), "cpu or cuda", "\"" + it.key() + "\"");
      }
    }
    if (j["profiles"].contains(profile)) {
      const json dotted = j["profiles"][profile];
      apply_dotted(j, dotted, "profiles." + profile);
    }
  }
  for (const std::string& o : overrides) train::apply_override(j, o);

  Study s = config::read<Study>(j, "");
  s.profile = profile;
  if (s.out_dir.empty()) s.out_dir = "runs/studies/" + s.name;
  if (s.mechanisms.empty()) config::fail("mechanisms", "at least one mechanism", "[]");
  if (!s.sweep.key.empty() && (!s.sweep.values.is_array() || s.sweep.values.empty())) {
    config::fail("sweep.values", "a non-empty list of values for " + s.sweep.key, s.sweep.values.dump());
  }
  std::set<std::string> labels;
  for (std::size_t i = 0; i < s.mechanisms.size(); ++i) {
    const MechanismEntry& m = s.mechanisms[i];
    const std::string key = "mechanisms[" + std::to_string(i) + "]";
    if (m.label.empty()) config::fail(key + ".label", "a non-empty label", "\"\"");
    if (!labels.insert(slug(m.label)).second) {
      config::fail(key + ".label", "a label unlike the others", "\"" + m.label + "\"");
    }
    try {
      if (!s.sweep.key.empty()) {
        for (const json& value : s.sweep.values) (void)train::parse_experiment(sweep_config(s, m, value));
      }
      const train::ExperimentConfig c = train::parse_experiment(mechanism_config(s, m));
      const std::unique_ptr<tasks::Task> task = tasks::make_task(eval_task_config(s, c));
      for (std::int64_t mult : s.eval.multiples) {
        // Catches lengths the task cannot fill before any training starts.
        const std::int64_t length = c.train.seq_len * mult;
        if (task->generative()) {
          for (double depth : s.eval.depths) (void)task->prompt(length, depth, 0);
        } else {
          (void)task->sample(1, length, 0);
        }
      }
    } catch (const Error& e) {
      fail("mechanism '" + m.label + "': " + e.what());
    }
  }
  return s;
}

json run_study(const Study& s, const RunOptions& options) {
  if (!s.sweep.key.empty()) return run_sweep(s, options);
  json result = {{"study", s.name},
                 {"title", s.title},
                 {"profile", s.profile},
                 {"date", today()},
                 {"libtorch", TORCH_VERSION},
                 {"metric", s.eval.metric},
                 {"multiples", s.eval.multiples},
                 {"instances", s.eval.instances},
                 {"mechanisms", json::array()}};
  // Data-parallel studies: every rank trains and evaluates; rank 0 alone writes.
  const train::WorldInfo world = train::world_from_environment();
  result["data_parallel_ranks"] = world.world;
  fs::create_directories(s.out_dir);
  std::size_t index = 0;
  for (const MechanismEntry& m : s.mechanisms) {
    ++index;
    if (!selected(options, m)) continue;
    const train::ExperimentConfig config = train::parse_experiment(mechanism_config(s, m));
    train::Trainer trainer(config);
    trainer.quiet = options.quiet || world.rank != 0;
    if (options.fresh) {
      trainer.clear_outputs();
    } else {
      trainer.resume();
    }
    std::printf(
        "\n== [%zu/%zu] %s: %s, %lld parameters, %lld steps of %lld x %lld "
        "tokens on %s\n",
        index, s.mechanisms.size(), m.label.c_str(), nn::describe(trainer.model()->config()).c_str(),
        static_cast<long long>(parameter_count(trainer)),
        static_cast<long long>(config.train.steps), static_cast<long long>(config.train.batch_size),
        static_cast<long long>(config.train.seq_len), trainer.device().str().c_str());
    std::fflush(stdout);
    using Clock = std::chrono::steady_clock;
    const auto start = Clock::now();
    const std::int64_t resumed_at = trainer.current_step();
    json last_eval;
    if (trainer.current_step() < config.train.steps) {
      last_eval = trainer.train();
    } else {
      last_eval = trainer.evaluate();
    }
    const double train_seconds = std::chrono::duration<double>(Clock::now() - start).count();

    json entry = {{"label", m.label},
                  {"config", train::to_json(config)},
                  {"parameters", parameter_count(trainer)},
                  {"steps", config.train.steps},
                  {"resumed_at_step", resumed_at},
                  {"train_seconds", train_seconds},
                  {"train_tokens", config.train.steps * trainer.tokens_per_step()},
                  {"final_eval", last_eval},
                  {"health", trainer.health().to_json()},
                  {"results", json::array()}};

    const std::unique_ptr<tasks::Task> task = tasks::make_task(eval_task_config(s, config));
    const eval::Runtime rt =
        eval::runtime_for(trainer.device(), config.train.dtype, s.eval.batch_tokens);
    if (s.eval.select_multiple > 0) entry["selection"] = select_checkpoint(s, m, config, *task, trainer, rt);
    const nn::LanguageModel model = evaluation_model(m, trainer);
    if (!m.eval_set.empty()) entry["eval_set"] = m.eval_set;
    const auto eval_start = Clock::now();
    for (std::int64_t mult : s.eval.multiples) {
      const std::int64_t length = config.train.seq_len * mult;
      json point = {{"multiple", mult}, {"length", length}};
      if (task->generative()) {
        json cells = json::array();
        double sum = 0;
        for (std::size_t d = 0; d < s.eval.depths.size(); ++d) {
          const eval::GenerationScore g = eval::score_generation(
              model, *task, length, s.eval.depths[d], s.eval.instances, config.seed, rt);
          cells.push_back({{"depth", s.eval.depths[d]},
                           {"exact_match", g.exact_match()},
                           {"instances", g.instances}});
          sum += g.exact_match();
        }
        point["exact_match"] =
            s.eval.depths.empty() ? 0.0 : sum / static_cast<double>(s.eval.depths.size());
        point["cells"] = cells;
      } else {
        std::optional<nn::AttentionProbe> probe;
        if (s.eval.diagnostics && length <= s.eval.diagnostics_max_length)
          probe.emplace(s.eval.probe_rows);
        std::optional<eval::PositionSums> positions;
        if (s.eval.position_bins > 0) positions.emplace();
        const eval::SequenceScore score =
            eval::score_sequences(model, *task, length, s.eval.instances, config.seed, rt,
                                  probe ? &*probe : nullptr, positions ? &*positions : nullptr);
        if (positions) {
          const eval::PositionLoss pl = eval::binned(*positions, mult * s.eval.position_bins);
          point["position_loss"] = {{"start", pl.bin_start}, {"end", pl.bin_end},
                                    {"loss", pl.loss}, {"tokens", pl.tokens}};
        }
        point["accuracy"] = score.accuracy();
        point["exact_match"] = score.exact_match();
        point["loss"] = score.loss();
        point["instances"] = score.sequences;
        point["scored_positions"] = score.scored;
        if (probe) {
          // Architectures without the probe's attention layers (Multiscreen) leave it empty.
          json diagnostics = probe->summary();
          if (!diagnostics["mean"].empty()) point["diagnostics"] = diagnostics;
        }
      }
      const std::string measure = measure_name(s, *task);
      std::printf("   %-6s (L = %6lld): %s %.1f%%\n", (std::to_string(mult) + "x").c_str(),
                  static_cast<long long>(length), measure.c_str(), 100.0 * point[measure].get<double>());
      std::fflush(stdout);
      entry["results"].push_back(point);
    }
    entry["eval_seconds"] = std::chrono::duration<double>(Clock::now() - eval_start).count();
    if (!s.eval.latency_lengths.empty()) {
      json latency = json::array();
      for (std::int64_t length : s.eval.latency_lengths) {
        // A length the device cannot hold (out of memory) is recorded as such, not allowed to
        // throw away the study's trained and evaluated rows.
        try {
          const eval::ForwardLatency l = eval::forward_latency(model, model->config().vocab_size, length,
                                                               s.eval.latency_repeats, rt);
          latency.push_back({{"length", l.length}, {"median_ms", l.median_ms}, {"min_ms", l.min_ms}});
          std::printf("   forward latency (L = %6lld): %.3f ms (median of %lld)\n",
                      static_cast<long long>(length), l.median_ms,
                      static_cast<long long>(s.eval.latency_repeats));
        } catch (const c10::Error& e) {
          std::string what = e.what_without_backtrace();
          if (const auto nl = what.find('\n'); nl != std::string::npos) what = what.substr(0, nl);
          latency.push_back({{"length", length}, {"error", what}});
          std::printf("   forward latency (L = %6lld): failed: %s\n", static_cast<long long>(length),
                      what.c_str());
        }
        std::fflush(stdout);
      }
      entry["latency"] = latency;
    }
    result["generative"] = task->generative();
    result["task"] = config::write(eval_task_config(s, config));
    result["train_length"] = config.train.seq_len;
    result["device"] = trainer.device().str();
    result["mechanisms"].push_back(entry);
  }

  if (world.rank != 0) return result;
  write_outputs(fs::path(s.out_dir), "result.json", "table.md", result, markdown_report(result));
  if (can_plot()) {
    for (const std::string& path : plot_study(result, s.out_dir)) std::printf("plot: %s\n", path.c_str());
  } else {
    std::printf(
        "plot: not drawn, this build has no PLplot (winnow plot %s draws it on a build "
        "that has)\n",
        (fs::path(s.out_dir) / "result.json").string().c_str());
  }
  return result;
}

json run_sweep(const Study& s, const RunOptions& options) {
  const std::string name = "sweep_" + slug(s.sweep.key);
  json result = {{"study", s.name},
                 {"title", s.title},
                 {"profile", s.profile},
                 {"date", today()},
                 {"libtorch", TORCH_VERSION},
                 {"sweep", {{"key", s.sweep.key}, {"values", s.sweep.values}}},
                 {"mechanisms", json::array()}};
  const train::WorldInfo world = train::world_from_environment();
  result["data_parallel_ranks"] = world.world;
  fs::create_directories(s.out_dir);
  std::size_t index = 0;
  for (const MechanismEntry& m : s.mechanisms) {
    ++index;
    if (!selected(options, m)) continue;
    json entry = {{"label", m.label}, {"runs", json::array()}};
    for (const json& value : s.sweep.values) {
      const train::ExperimentConfig config = train::parse_experiment(sweep_config(s, m, value));
      const fs::path marker = fs::path(config.train.out_dir) / "diverged.json";
      std::printf("\n== [%zu/%zu] %s, %s = %s: %lld steps of %lld x %lld tokens\n", index,
                  s.mechanisms.size(), m.label.c_str(), s.sweep.key.c_str(), value.dump().c_str(),
                  static_cast<long long>(config.train.steps),
                  static_cast<long long>(config.train.batch_size),
                  static_cast<long long>(config.train.seq_len));
      std::fflush(stdout);
      json run = {{"value", value}, {"diverged", false}};
      using Clock = std::chrono::steady_clock;
      const auto start = Clock::now();
      train::Trainer trainer(config);
      trainer.quiet = options.quiet || world.rank != 0;
      if (options.fresh) {
        trainer.clear_outputs();
        std::error_code ec;
        if (world.rank == 0) fs::remove(marker, ec);
      }
      if (!options.fresh && fs::exists(marker)) {
        // A run that diverged diverges again the same way: its record stands.
        run = train::read_json_file(marker.string(), "diverged.json");
        run["value"] = value;
      } else {
        if (!options.fresh) trainer.resume();
        try {
          const json last = trainer.current_step() < config.train.steps ? trainer.train()
                                                                         : trainer.evaluate();
          const double loss = last.value("eval_loss", 0.0);
          const double uniform = std::log(static_cast<double>(config.model.vocab_size));
          run["final_loss"] = loss;
          run["final_eval"] = last;
          if (!std::isfinite(loss) || loss >= uniform) {
            run["diverged"] = true;
            run["why"] = "final held-out loss " + std::to_string(loss) +
                         " is no better than uniform guessing (" + std::to_string(uniform) + ")";
          }
        } catch (const train::TrainingDiverged& e) {
          run["diverged"] = true;
          run["diverged_at_step"] = e.step();
          run["why"] = e.what();
          if (world.rank == 0) {
            std::ofstream f(marker);
            f << run.dump(2) << '\n';
          }
          std::printf("   diverged: %s\n", e.what());
        }
        run["train_seconds"] = std::chrono::duration<double>(Clock::now() - start).count();
      }
      run["health"] = trainer.health().to_json();
      if (run.contains("final_loss")) {
        std::printf("   final held-out loss %.4f%s\n", run["final_loss"].get<double>(),
                    run["diverged"].get<bool>() ? " (diverged)" : "");
      }
      std::fflush(stdout);
      entry["runs"].push_back(run);
      result["task"] = config::write(config.task);
      result["device"] = trainer.device().str();
    }
    result["mechanisms"].push_back(entry);
  }
  if (world.rank != 0) return result;
  write_outputs(fs::path(s.out_dir), name + ".json", name + ".md", result, sweep_report(result));
  if (can_plot()) {
    const std::string path = (fs::path(s.out_dir) / (name + ".svg")).string();
    plot_sweep(result, path);
    std::printf("plot: %s\n", path.c_str());
  }
  return result;
}

}  // namespace winnow::study
