// `winnow study FILE`: trains a list of mechanisms on one task with one budget and evaluates
// them at multiples of the training length (src/study/study.h; study files in studies/).
// `winnow eval --checkpoint C ...`: the same evaluations for one trained model.
// `winnow plot RESULT`: draws a study's result (for results written where PLplot was missing).
// `winnow generate --checkpoint C --prompt TEXT`: samples text from a model trained on text.
#include "study/study.h"

#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <functional>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include "commands.h"
#include "eval/evaluate.h"
#include "nn/language_model.h"
#include "study/report.h"
#include "tasks/text.h"
#include "train/checkpoint.h"
#include "train/config.h"
#include "train/trainer.h"
#include "winnow/error.h"

namespace winnow::apps {
namespace {
namespace fs = std::filesystem;
using nlohmann::json;

void add_study(CLI::App& app) {
  struct Args {
    std::string file;
    std::vector<std::string> overrides, only;
    std::string sweep;
    bool fresh = false, quiet = false, print = false;
    int gpus = 0, processes = 0;
  };
  auto args = std::make_shared<Args>();
  CLI::App* cmd = app.add_subcommand(
      "study",
      "Train several mechanisms on one task with one budget, evaluate each at multiples "
      "of the training length, and write a JSON result, a Markdown table and a plot");
  cmd->add_option("FILE", args->file, "study file (JSON); see studies/")
      ->required()
      ->check(CLI::ExistingFile);
  cmd->add_option("--set", args->overrides,
                  "override a key of the study, e.g. --set base.train.steps=200 "
                  "--set eval.multiples=[1,4]")
      ->take_all();
  cmd->add_option("--only", args->only, "run only the mechanisms with these labels")->take_all();
  cmd->add_option("--sweep", args->sweep,
                  "train every mechanism once per value of one experiment key and report the "
                  "final loss of each, e.g. --sweep train.lr=3e-4,1e-3,3e-3 (the study's "
                  "\"sweep\" object, from the command line)");
  cmd->add_flag("--fresh", args->fresh, "retrain every mechanism from scratch");
  cmd->add_flag("--quiet", args->quiet, "no training progress lines");
  cmd->add_flag("--print", args->print,
                "print the resolved study (profile and overrides applied) and exit");
  add_rank_options(*cmd, args->gpus, args->processes);
  cmd->callback([args] {
    std::vector<std::string> overrides = args->overrides;
    if (!args->sweep.empty()) {
      const std::size_t eq = args->sweep.find('=');
      if (eq == std::string::npos || eq == 0 || eq + 1 == args->sweep.size()) {
        throw Error(ErrorKind::invalid_argument,
                    "argument '--sweep': expected KEY=V1,V2,... (e.g. train.lr=3e-4,1e-3), got '" +
                        args->sweep + "'");
      }
      overrides.push_back("sweep.key=" + args->sweep.substr(0, eq));
      overrides.push_back("sweep.values=[" + args->sweep.substr(eq + 1) + "]");
    }
    const study::Study s = study::load_study(args->file, overrides);
    if (args->print) {
      json j = config::write(s);
      j["profile_applied"] = s.profile;
      std::printf("%s\n", j.dump(2).c_str());
      return;
    }
    for (const std::string& label : args->only) {
      bool found = false;
      for (const auto& m : s.mechanisms) found |= m.label == label;
      if (!found) {
        std::string labels;
        for (const auto& m : s.mechanisms)
          labels += (labels.empty() ? "\"" : ", \"") + m.label + "\"";
        throw Error(ErrorKind::invalid_argument,
                    "argument '--only': expected one of " + labels + ", got \"" + label + "\"");
      }
    }
    const std::string device = s.base.contains("device") && s.base["device"].is_string()
                                   ? s.base["device"].get<std::string>()
                                   : std::string("auto");
    if (const int ranks = rank_count("winnow study", args->gpus, args->processes, device); ranks > 0) {
      std::vector<std::string> rest = {args->file};
      for (const auto& o : args->overrides) rest.insert(rest.end(), {"--set", o});
      if (!args->only.empty()) {
        rest.push_back("--only");
        rest.insert(rest.end(), args->only.begin(), args->only.end());
      }
      if (!args->sweep.empty()) rest.insert(rest.end(), {"--sweep", args->sweep});
      if (args->fresh) rest.push_back("--fresh");
      if (args->quiet) rest.push_back("--quiet");
      if (args->gpus > 0) rest.insert(rest.end(), {"--set", "base.device=cuda"});
      return launch_ranks("study", ranks, rest);
    }
    // One voice for a data-parallel study: rank 0's (errors still reach stderr).
    if (train::world_from_environment().rank != 0) {
      if (std::freopen("/dev/null", "w", stdout) == nullptr) std::fclose(stdout);
    }
    std::printf("study %s (%s profile): %zu mechanisms, output in %s\n", s.name.c_str(),
                s.profile.c_str(), s.mechanisms.size(), s.out_dir.c_str());
    study::RunOptions options;
    options.fresh = args->fresh;
    options.quiet = args->quiet;
    options.only = args->only;
    study::run_study(s, options);
  });
}

void add_plot(CLI::App& app) {
  struct Args {
    std::string result, out;
  };
  auto args = std::make_shared<Args>();
  CLI::App* cmd = app.add_subcommand(
      "plot",
      "Draw a study's result.json (accuracy against length; loss by position and sink ratio "
      "where measured), a sweep's JSON (final loss against the swept value) or a GPU "
      "benchmark's JSON (bench/gpu_attention_bench.py --json: tokens/s against length) as SVG");
  cmd->add_option("RESULT", args->result, "a study's result.json or a benchmark's JSON")
      ->required()
      ->check(CLI::ExistingFile);
  cmd->add_option("--out", args->out,
                  "the SVG to write (default beside RESULT: accuracy.svg and the study's other "
                  "plots, <sweep>.svg for a sweep, or throughput.svg for a benchmark); for a "
                  "study, only the accuracy plot goes there");
  cmd->callback([args] {
    const json r = train::read_json_file(args->result, "RESULT");
    const auto beside = [&](const char* name) {
      return args->out.empty() ? (fs::path(args->result).parent_path() / name).string() : args->out;
    };
    if (r.contains("sweep") && r.contains("mechanisms") && r["mechanisms"].is_array()) {
      std::printf("%s", study::sweep_report(r).c_str());
      const std::string out =
          beside((fs::path(args->result).stem().string() + ".svg").c_str());
      study::plot_sweep(r, out);
      std::printf("\nplot: %s\n", out.c_str());
    } else if (r.contains("mechanisms") && r["mechanisms"].is_array()) {
      std::printf("%s", study::markdown_report(r).c_str());
      if (args->out.empty()) {
        for (const std::string& path :
             study::plot_study(r, fs::path(args->result).parent_path().string())) {
          std::printf("plot: %s\n", path.c_str());
        }
      } else {
        study::plot_result(r, args->out);
        std::printf("\nplot: %s\n", args->out.c_str());
      }
    } else if (r.contains("results") && r["results"].is_array()) {
      const std::string out = beside("throughput.svg");
      study::plot_throughput(r, out);
      std::printf("plot: %s\n", out.c_str());
    } else {
      throw Error(ErrorKind::invalid_argument,
                  "argument 'RESULT': expected a study result (with \"mechanisms\") or a "
                  "benchmark's JSON (with \"results\"), got '" + args->result + "'");
    }
  });
}

std::vector<std::int64_t> parse_list(const std::string& text, const std::string& option) {
  std::vector<std::int64_t> out;
  std::stringstream s(text);
  std::string item;
  while (std::getline(s, item, ',')) {
    std::size_t used = 0;
    long long v = 0;
    try {
      v = std::stoll(item, &used);
    } catch (const std::exception&) {
      used = 0;
    }
    if (used != item.size() || v < 1) {
      throw Error(ErrorKind::invalid_argument,
                  "argument '" + option +
                      "': expected positive integers separated by commas, got '" + text + "'");
    }
    out.push_back(v);
  }
  return out;
}

// A run folder, its checkpoints folder, or one checkpoint: the checkpoint folder it means.
std::string checkpoint_folder(const std::string& given) {
  const fs::path p(given);
  if (fs::exists(p / "trainer.json")) return p.string();
  for (const fs::path& root : {p / "checkpoints", p}) {
    const std::string latest = train::latest_checkpoint(root.string());
    if (!latest.empty()) return latest;
  }
  throw Error(ErrorKind::invalid_argument,
              "argument '--checkpoint': expected a checkpoint folder, a run's out_dir or its "
              "checkpoints folder, got '" +
                  given + "' (no trainer.json or latest checkpoint there)");
}

void add_eval(CLI::App& app) {
  struct Args {
    std::string checkpoint, task, lengths, multiples, text, json_path, device = "auto";
    std::vector<std::string> overrides;
    std::vector<double> depths = {0.1, 0.3, 0.5, 0.7, 0.9};
    std::int64_t instances = 200, batch_tokens = 0, probe_rows = 16, position_bins = 0;
    bool diagnostics = false;
  };
  auto args = std::make_shared<Args>();
  CLI::App* cmd = app.add_subcommand(
      "eval",
      "Evaluate a trained model at several lengths: accuracy and exact match on fresh "
      "instances, exact match by length and depth for generative tasks, loss by position, "
      "per-head diagnostics");
  cmd->add_option("--checkpoint", args->checkpoint, "a checkpoint folder or a run's out_dir")
      ->required();
  cmd->add_option("--task", args->task, "task name (default: the one the model trained on)");
  cmd->add_option("--set", args->overrides,
                  "override a task key, e.g. --set task.mqrar.scored_queries=4")
      ->take_all();
  cmd->add_option("--lengths", args->lengths, "sequence lengths, comma-separated");
  cmd->add_option("--multiples", args->multiples,
                  "multiples of the training length, comma-separated (default 1,4,16)");
  cmd->add_option("--instances", args->instances, "fresh instances per length (and depth)")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  cmd->add_option("--depths", args->depths, "needle depths of generative tasks")
      ->capture_default_str()
      ->check(CLI::Range(0.0, 1.0));
  cmd->add_option("--batch-tokens", args->batch_tokens, "tokens per forward pass (0: by device)")
      ->check(CLI::NonNegativeNumber);
  cmd->add_flag("--diagnostics", args->diagnostics,
                "per-layer, per-head sink ratio, entropy, zero fraction, remainder");
  cmd->add_option("--probe-rows", args->probe_rows,
                  "query rows per sequence the diagnostics inspect")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  cmd->add_option("--position-loss", args->position_bins,
                  "also report the next-token loss by position in this many bins");
  cmd->add_option("--text", args->text,
                  "with --position-loss: score this text file (character-level models) instead of "
                  "task sequences")
      ->check(CLI::ExistingFile);
  cmd->add_option("--device", args->device, "auto | cpu | cuda | cuda:N")->capture_default_str();
  cmd->add_option("--json", args->json_path, "also write the results to this file");
  cmd->callback([args] {
    const std::string folder = checkpoint_folder(args->checkpoint);
    const train::CheckpointMeta meta = train::read_checkpoint(folder);
    json cfg = meta.config;
    cfg["device"] = args->device;
    if (!args->task.empty()) cfg["task"]["name"] = args->task;
    for (const std::string& o : args->overrides) {
      if (o.rfind("task.", 0) != 0) {
        throw Error(ErrorKind::invalid_argument,
                    "argument '--set': expected a task key (task.…=value), got '" + o + "'");
      }
      train::apply_override(cfg, o);
    }
    train::ExperimentConfig config = train::parse_experiment(cfg);
    const std::unique_ptr<tasks::Task> task = tasks::make_task(config.task);
    if (task->vocab_size() > config.model.vocab_size) {
      throw Error(ErrorKind::invalid_argument,
                  "argument '--task': expected a task whose vocabulary fits the model's " +
                      std::to_string(config.model.vocab_size) + " tokens, got " + config.task.name +
                      " with " + std::to_string(task->vocab_size()));
    }
    if (task->generative() && args->diagnostics) {
      throw Error(ErrorKind::invalid_argument,
                  "argument '--diagnostics': expected a task scored on whole sequences (mqrar, "
                  "copy, progression), got the generative task " +
                      config.task.name);
    }
    const torch::Device device =
        train::pick_device(config.device, nn::uses_kernel(config.model));
    const nn::LanguageModel model = nn::make_language_model(config.model);
    train::restore_model(folder, *model);
    model->to(device);
    const eval::Runtime rt = eval::runtime_for(device, config.train.dtype, args->batch_tokens);

    std::vector<std::int64_t> lengths;
    if (!args->lengths.empty()) {
      lengths = parse_list(args->lengths, "--lengths");
    } else {
      for (std::int64_t m :
           parse_list(args->multiples.empty() ? "1,4,16" : args->multiples, "--multiples")) {
        lengths.push_back(m * config.train.seq_len);
      }
    }
    std::printf("checkpoint %s (step %lld): %s attention, trained on %s at L = %lld; device %s\n",
                folder.c_str(), static_cast<long long>(meta.step),
                config.model.attention.kind.c_str(),
                meta.config["task"]["name"].get<std::string>().c_str(),
                static_cast<long long>(config.train.seq_len), rt.device.str().c_str());
    json out = {{"checkpoint", folder},
                {"step", meta.step},
                {"task", config::write(config.task)},
                {"instances", args->instances},
                {"results", json::array()}};
    for (std::int64_t length : lengths) {
      json point = {{"length", length}};
      if (task->generative()) {
        std::printf("L = %6lld:", static_cast<long long>(length));
        json cells = json::array();
        for (std::size_t d = 0; d < args->depths.size(); ++d) {
          const eval::GenerationScore g = eval::score_generation(
              model, *task, length, args->depths[d], args->instances, config.seed, rt);
          cells.push_back({{"depth", args->depths[d]}, {"exact_match", g.exact_match()}});
          std::printf("  depth %.2f: %5.1f%%", args->depths[d], 100.0 * g.exact_match());
        }
        std::printf("\n");
        point["cells"] = cells;
      } else {
        std::optional<nn::AttentionProbe> probe;
        if (args->diagnostics) probe.emplace(args->probe_rows);
        const eval::SequenceScore s = eval::score_sequences(
            model, *task, length, args->instances, config.seed, rt, probe ? &*probe : nullptr);
        std::printf(
            "L = %6lld: accuracy %5.1f%%  exact match %5.1f%%  loss %.4f  (%lld sequences, %.0f "
            "scored positions)\n",
            static_cast<long long>(length), 100.0 * s.accuracy(), 100.0 * s.exact_match(), s.loss(),
            static_cast<long long>(s.sequences), s.scored);
        point.update(
            {{"accuracy", s.accuracy()}, {"exact_match", s.exact_match()}, {"loss", s.loss()}});
        if (probe) {
          point["diagnostics"] = probe->summary();
          for (const json& layer : point["diagnostics"]["layers"]) {
            std::printf("  layer %lld:",
                        static_cast<long long>(layer["layer"].get<std::int64_t>()));
            for (auto it = layer.begin(); it != layer.end(); ++it) {
              if (it.key() == "layer") continue;
              std::printf(" %s [", it.key().c_str());
              for (std::size_t h = 0; h < it.value().size(); ++h) {
                std::printf("%s%.3f", h ? " " : "", it.value()[h].get<double>());
              }
              std::printf("]");
            }
            std::printf("\n");
          }
        }
      }
      if (args->position_bins > 0) {
        torch::Tensor tokens;
        if (!args->text.empty()) {
          std::ifstream f(args->text);
          std::stringstream ss;
          ss << f.rdbuf();
          const std::vector<std::int64_t> all = tasks::text::encode(ss.str());
          const auto rows = static_cast<std::int64_t>(all.size()) / length;
          if (rows < 1) {
            throw Error(ErrorKind::invalid_argument,
                        "argument '--text': expected at least " + std::to_string(length) +
                            " characters, got " + std::to_string(all.size()));
          }
          tokens =
              torch::tensor(std::vector<std::int64_t>(all.begin(), all.begin() + rows * length))
                  .view({rows, length});
        } else {
          const std::int64_t rows = std::max<std::int64_t>(1, args->instances);
          tokens =
              task->sample(rows, length, eval::instance_seed(config.seed, length, 0, 0)).inputs;
        }
        const eval::PositionLoss pl =
            eval::loss_by_position(model, tokens, args->position_bins, rt);
        json bins = json::array();
        std::printf("  loss by position (nats):");
        for (std::size_t i = 0; i < pl.loss.size(); ++i) {
          bins.push_back({{"start", pl.bin_start[i]},
                          {"end", pl.bin_end[i]},
                          {"loss", pl.loss[i]},
                          {"perplexity", std::exp(pl.loss[i])}});
          std::printf(" [%lld,%lld) %.3f (ppl %.2f)", static_cast<long long>(pl.bin_start[i]),
                      static_cast<long long>(pl.bin_end[i]), pl.loss[i], std::exp(pl.loss[i]));
        }
        std::printf("\n");
        point["loss_by_position"] = bins;
      }
      std::fflush(stdout);
      out["results"].push_back(point);
    }
    if (!args->json_path.empty()) {
      std::ofstream f(args->json_path);
      f << out.dump(2) << '\n';
      if (!f)
        throw Error(ErrorKind::runtime,
                    "argument '--json': cannot write '" + args->json_path + "'");
    }
  });
}


// How a task's tokens read as text: bytes for the byte-level corpus, printable ASCII for the
// character-level tasks; nullopt for tasks whose tokens are not text.
struct TextCodec {
  std::function<std::vector<std::int64_t>(const std::string&)> encode;
  std::function<std::string(const std::vector<std::int64_t>&)> decode;
};
std::optional<TextCodec> text_codec(const std::string& task) {
  if (task == "corpus") {
    return TextCodec{[](const std::string& s) {
                       std::vector<std::int64_t> out;
                       for (unsigned char c : s) out.push_back(c);
                       return out;
                     },
                     [](const std::vector<std::int64_t>& t) {
                       std::string out;
                       for (std::int64_t x : t) out += static_cast<char>(static_cast<unsigned char>(x));
                       return out;
                     }};
  }
  if (task == "abcdigits" || task == "passkey") {
    return TextCodec{[](const std::string& s) { return tasks::text::encode(s); },
                     [](const std::vector<std::int64_t>& t) { return tasks::text::decode(t); }};
  }
  return std::nullopt;
}

void add_generate(CLI::App& app) {
  struct Args {
    std::string checkpoint, prompt, prompt_file, json_path, device = "auto";
    std::int64_t tokens = 256, top_k = 40, samples = 1;
    double temperature = 0.8;
    std::uint64_t seed = 0;
  };
  auto args = std::make_shared<Args>();
  CLI::App* cmd = app.add_subcommand(
      "generate",
      "Sample text from a model trained on text (the byte-level corpus, or the character-level "
      "tasks) through the KV cache, to look at what it learned");
  cmd->add_option("--checkpoint", args->checkpoint, "a checkpoint folder or a run's out_dir")
      ->required();
  cmd->add_option("--prompt", args->prompt, "the text to continue");
  cmd->add_option("--prompt-file", args->prompt_file, "read the prompt from this file")
      ->check(CLI::ExistingFile);
  cmd->add_option("--tokens", args->tokens, "tokens to generate (bytes, for the corpus)")
      ->capture_default_str()
      ->check(CLI::NonNegativeNumber);
  cmd->add_option("--temperature", args->temperature, "sampling temperature; 0: greedy")
      ->capture_default_str()
      ->check(CLI::NonNegativeNumber);
  cmd->add_option("--top-k", args->top_k, "sample among the k most likely tokens; 0: all")
      ->capture_default_str()
      ->check(CLI::NonNegativeNumber);
  cmd->add_option("--samples", args->samples, "continuations of the prompt, sampled together")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  cmd->add_option("--seed", args->seed, "seed of the draws")->capture_default_str();
  cmd->add_option("--device", args->device, "auto | cpu | cuda | cuda:N")->capture_default_str();
  cmd->add_option("--json", args->json_path, "also write the prompt and the samples to this file");
  cmd->callback([args] {
    if (!args->prompt.empty() && !args->prompt_file.empty()) {
      throw Error(ErrorKind::invalid_argument,
                  "arguments '--prompt' and '--prompt-file': expected one of them, got both");
    }
    std::string prompt = args->prompt;
    if (!args->prompt_file.empty()) {
      std::ifstream f(args->prompt_file, std::ios::binary);
      std::stringstream ss;
      ss << f.rdbuf();
      prompt = ss.str();
    }
    if (prompt.empty()) {
      throw Error(ErrorKind::invalid_argument,
                  "argument '--prompt': expected at least one character to continue, got none");
    }
    const std::string folder = checkpoint_folder(args->checkpoint);
    const train::CheckpointMeta meta = train::read_checkpoint(folder);
    json cfg = meta.config;
    cfg["device"] = args->device;
    const train::ExperimentConfig config = train::parse_experiment(cfg);
    const std::optional<TextCodec> codec = text_codec(config.task.name);
    if (!codec) {
      throw Error(ErrorKind::invalid_argument,
                  "argument '--checkpoint': expected a model trained on text (task corpus, "
                  "abcdigits or passkey), got one trained on " + config.task.name);
    }
    const std::vector<std::int64_t> encoded = codec->encode(prompt);
    const torch::Device device =
        train::pick_device(config.device, nn::uses_kernel(config.model));
    const nn::LanguageModel model = nn::make_language_model(config.model);
    train::restore_model(folder, *model);
    model->to(device);
    const eval::Runtime rt = eval::runtime_for(device, config.train.dtype, 0);
    const auto p_len = static_cast<std::int64_t>(encoded.size());
    const torch::Tensor prompts =
        torch::tensor(encoded).view({1, p_len}).expand({args->samples, p_len}).contiguous();
    eval::Sampling sampling;
    sampling.temperature = args->temperature;
    sampling.top_k = args->top_k;
    sampling.seed = args->seed;
    const torch::Tensor out = eval::generate(model, prompts, args->tokens, rt, sampling).contiguous();
    std::fprintf(stderr,
                 "checkpoint %s (step %lld), %s attention, trained at L = %lld; %lld prompt + %lld "
                 "generated tokens, temperature %g, top-k %lld, seed %llu\n",
                 folder.c_str(), static_cast<long long>(meta.step),
                 config.model.attention.kind.c_str(), static_cast<long long>(config.train.seq_len),
                 static_cast<long long>(p_len), static_cast<long long>(args->tokens),
                 args->temperature, static_cast<long long>(args->top_k),
                 static_cast<unsigned long long>(args->seed));
    json samples = json::array(), sample_tokens = json::array();
    for (std::int64_t i = 0; i < args->samples; ++i) {
      const std::int64_t* row = out[i].data_ptr<std::int64_t>();
      const std::vector<std::int64_t> tokens(row, row + out.size(1));
      const std::string text = codec->decode(tokens);
      sample_tokens.push_back(tokens);
      if (args->samples > 1) std::printf("%s--- sample %lld ---\n", i ? "\n" : "", static_cast<long long>(i + 1));
      std::printf("%s%s\n", prompt.c_str(), text.c_str());
      samples.push_back(text);
    }
    std::fflush(stdout);
    if (!args->json_path.empty()) {
      std::ofstream f(args->json_path);
      f << json{{"checkpoint", folder},
                {"step", meta.step},
                {"prompt", prompt},
                {"temperature", args->temperature},
                {"top_k", args->top_k},
                {"seed", args->seed},
                {"samples", samples},  // bytes that are not UTF-8 read as U+FFFD here
                {"sample_tokens", sample_tokens}}
               .dump(2, ' ', false, json::error_handler_t::replace)
        << '\n';
      if (!f)
        throw Error(ErrorKind::runtime, "argument '--json': cannot write '" + args->json_path + "'");
    }
  });
}

}  // namespace

void add_study_commands(CLI::App& app) {
  add_study(app);
  add_eval(app);
  add_plot(app);
  add_generate(app);
}

}  // namespace winnow::apps
