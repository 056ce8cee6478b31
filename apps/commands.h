// The winnow command line tool's subcommands.
#pragma once

#include <CLI/CLI.hpp>

#include <string>
#include <vector>

namespace winnow::apps {

void add_info_command(CLI::App& app);
void add_demo_command(CLI::App& app);
// `train` and `train-bench`; built with LibTorch only (WINNOW_WITH_MODELS).
void add_train_command(CLI::App& app);
// `study`, `eval`, `plot` and `generate`; built with LibTorch only.
void add_study_commands(CLI::App& app);

// Data-parallel runs started by winnow itself (apps/ranks.cpp; built with LibTorch only).
// `--gpus N` and `--processes N` on a subcommand:
void add_rank_options(CLI::App& cmd, int& gpus, int& processes);
// How many ranks the options ask for (0: none, run in this process), after checking them:
// not both, no WORLD_SIZE already set, the GPUs visible, a device (the config's) that can be a
// GPU. Errors begin with `command` ("winnow train").
int rank_count(const std::string& command, int gpus, int processes, const std::string& device);
// Starts `count` copies of `winnow <subcommand> <args>` as ranks 0 .. count - 1 of one
// data-parallel run, with torchrun's variables (rank 0 serves the store on a free local port)
// and NVLink multicast off; waits for them, and stops the others when one fails.
void launch_ranks(const std::string& subcommand, int count, const std::vector<std::string>& args);

}  // namespace winnow::apps
